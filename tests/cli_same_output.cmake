cmake_minimum_required(VERSION 3.25)
# Runs PLAIN and OTHER (;-lists, the same program with other flags) in WORKDIR: both must exit 0
# and print the same stdout byte for byte; OTHER's stderr must match EXPECT_STDERR_REGEX when
# given (e.g. that it did speculate). Used for speculation, whose greedy text must not change.
foreach(which IN ITEMS PLAIN OTHER)
  execute_process(COMMAND ${${which}} WORKING_DIRECTORY "${WORKDIR}" INPUT_FILE /dev/null
                  OUTPUT_VARIABLE out_${which} ERROR_VARIABLE err_${which} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${which} exited with ${rc}: ${${which}}\nstderr:\n${err_${which}}")
  endif()
endforeach()
if(NOT out_PLAIN STREQUAL out_OTHER)
  message(FATAL_ERROR "stdout differs\n--- ${PLAIN}:\n${out_PLAIN}\n--- ${OTHER}:\n${out_OTHER}")
endif()
if(DEFINED EXPECT_STDERR_REGEX AND NOT err_OTHER MATCHES "${EXPECT_STDERR_REGEX}")
  message(FATAL_ERROR "stderr does not match '${EXPECT_STDERR_REGEX}':\n${err_OTHER}")
endif()
message(STATUS "ok: the same stdout")
