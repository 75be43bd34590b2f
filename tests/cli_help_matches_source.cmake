# An example's --help and the usage synopsis in its source file's header comment name the same
# flags, and each flag the parser accepts (a `a == "--flag"` comparison in the source) appears in
# both. Inputs: PROGRAM (the executable), SOURCE (its .cpp file).
execute_process(COMMAND "${PROGRAM}" --help OUTPUT_VARIABLE help RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${PROGRAM} --help exited with ${rc}")
endif()
file(READ "${SOURCE}" source)

# The synopsis: the "//   program [...]" lines of the header comment, up to the first blank
# comment line.
if(NOT source MATCHES "\n//   [a-z_]+ (\\[[^\n]*(\n//            [^\n]*)*)")
  message(FATAL_ERROR "no usage synopsis in the header comment of ${SOURCE}")
endif()
set(synopsis "${CMAKE_MATCH_1}")

function(flags_in text out_var)
  # Square brackets would stop CMake from splitting the match list at its semicolons.
  string(REGEX REPLACE "[][]" " " text "${text}")
  string(REGEX MATCHALL "(^|[^a-z-])(--?[a-z][a-z0-9-]*)" raw "${text}")
  set(flags "")
  foreach(m IN LISTS raw)
    string(REGEX MATCH "--?[a-z][a-z0-9-]*" flag "${m}")
    list(APPEND flags "${flag}")
  endforeach()
  list(REMOVE_DUPLICATES flags)
  list(SORT flags)
  set(${out_var} "${flags}" PARENT_SCOPE)
endfunction()

flags_in("${synopsis}" in_synopsis)
# --help: the flags that start an option line ("  --flag ARG   text").
string(REGEX MATCHALL "\n  --?[a-z][a-z0-9-]*" help_lines "${help}")
flags_in("${help_lines}" in_help)
# The parser: every flag compared against.
string(REGEX MATCHALL "a == \"--?[a-z][a-z0-9-]*\"" parsed_raw "${source}")
flags_in("${parsed_raw}" in_parser)
list(REMOVE_ITEM in_parser -h)  # --help's short spelling, not advertised

if(NOT in_synopsis STREQUAL in_help)
  message(FATAL_ERROR "header synopsis flags:\n  ${in_synopsis}\n--help flags:\n  ${in_help}")
endif()
if(NOT in_parser STREQUAL in_help)
  message(FATAL_ERROR "flags the parser accepts:\n  ${in_parser}\n--help flags:\n  ${in_help}")
endif()
list(LENGTH in_help count)
message(STATUS "ok: ${count} flags in --help, the header and the parser")
