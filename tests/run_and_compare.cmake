# Runs COMMAND (a ;-list) and checks its exit code against EXPECT_RC and, when EXPECTED_STDOUT
# is given, its stdout byte for byte against that file; EXPECT_STDERR_REGEX and
# EXPECT_STDOUT_REGEX, when given, must match. Used by the generator's CLI tests.
execute_process(COMMAND ${COMMAND} WORKING_DIRECTORY "${WORKDIR}"
                OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
if(NOT rc STREQUAL "${EXPECT_RC}")
  message(FATAL_ERROR "exit code ${rc}, expected ${EXPECT_RC}\nstdout:\n${out}\nstderr:\n${err}")
endif()
if(DEFINED EXPECTED_STDOUT)
  file(READ "${EXPECTED_STDOUT}" expected)
  if(NOT out STREQUAL expected)
    file(WRITE "${CMAKE_CURRENT_BINARY_DIR}/actual_stdout.txt" "${out}")
    message(FATAL_ERROR "stdout differs from ${EXPECTED_STDOUT}\n--- got:\n${out}\n--- expected:\n${expected}")
  endif()
endif()
if(DEFINED EXPECT_STDERR_REGEX AND NOT err MATCHES "${EXPECT_STDERR_REGEX}")
  message(FATAL_ERROR "stderr does not match '${EXPECT_STDERR_REGEX}':\n${err}")
endif()
if(DEFINED EXPECT_STDOUT_REGEX AND NOT out MATCHES "${EXPECT_STDOUT_REGEX}")
  message(FATAL_ERROR "stdout does not match '${EXPECT_STDOUT_REGEX}':\n${out}")
endif()
message(STATUS "ok (exit ${rc})")
