# The generator's --save-cache / --load-cache, run as a user would on the tiny fixture (greedy):
#   1. a run that saves its prefilled prompt prints what a run without a cache file prints;
#   2. a run that loads it prints the same, and says all but the last prompt token came from it;
#   3. a longer prompt that starts with the saved one loads it, prefills only the rest, and
#      prints what a run without a cache file prints for that prompt;
#   4. a cache of a prompt that shares only a prefix is reused up to that prefix (the restored
#      cache truncated), and the text is that of a run without a cache file;
#   5. a truncated file and a flipped payload byte each exit with code 1 and one line on stderr
#      naming the file and what is wrong.
# Inputs: GENERATE (the executable), WORKDIR (tests/data/llama2c-tiny), PROMPT, KV (the store
# flags, e.g. --kv;int8), OUT (a scratch folder).
file(REMOVE_RECURSE "${OUT}")
file(MAKE_DIRECTORY "${OUT}")
set(base "${GENERATE}" --model model.bin --tokenizer tokenizer.bin -n 40 --temperature 0 ${KV})

function(run_generate rc_expected out_var err_var)
  execute_process(COMMAND ${base} ${ARGN} WORKING_DIRECTORY "${WORKDIR}"
                  OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
  if(NOT rc STREQUAL "${rc_expected}")
    message(FATAL_ERROR "generate ${ARGN}: exit code ${rc}, expected ${rc_expected}\n"
                        "stdout:\n${out}\nstderr:\n${err}")
  endif()
  set(${out_var} "${out}" PARENT_SCOPE)
  set(${err_var} "${err}" PARENT_SCOPE)
endfunction()

function(expect_equal what got expected)
  if(NOT got STREQUAL expected)
    message(FATAL_ERROR "${what}\n--- got:\n${got}\n--- expected:\n${expected}")
  endif()
endfunction()

# "prompt tokens      24 (23 reused from cache file ...)" → total and from_file.
function(prompt_counts err total_var file_var)
  if(NOT err MATCHES "prompt tokens +([0-9]+) \\(([0-9]+) reused from cache file")
    message(FATAL_ERROR "no prompt-token line naming the cache file in:\n${err}")
  endif()
  set(${total_var} ${CMAKE_MATCH_1} PARENT_SCOPE)
  set(${file_var} ${CMAKE_MATCH_2} PARENT_SCOPE)
endfunction()

set(cache "${OUT}/prompt.kvc")

# 1. Save after prefill; the text does not change.
run_generate(0 plain plain_err --prompt "${PROMPT}")
run_generate(0 saving saving_err --prompt "${PROMPT}" --save-cache "${cache}")
expect_equal("stdout of the saving run differs from the run without a cache file" "${saving}"
             "${plain}")
if(NOT saving_err MATCHES "cache saved +[^\n]*prompt.kvc \\(([0-9]+) positions\\)")
  message(FATAL_ERROR "no 'cache saved' line in:\n${saving_err}")
endif()
set(saved ${CMAKE_MATCH_1})
if(NOT EXISTS "${cache}")
  message(FATAL_ERROR "--save-cache did not write ${cache}")
endif()

# 2. Load it for the same prompt: all but the last prompt token come from the file (the last
#    one is prefilled for its logits).
run_generate(0 loading loading_err --prompt "${PROMPT}" --load-cache "${cache}")
expect_equal("stdout with --load-cache differs from the run without a cache file" "${loading}"
             "${plain}")
prompt_counts("${loading_err}" total from_file)
math(EXPR expected_from_file "${total} - 1")
if(NOT saved EQUAL total OR NOT from_file EQUAL expected_from_file)
  message(FATAL_ERROR "saved ${saved} positions for a ${total}-token prompt and loaded "
                      "${from_file}; expected ${total} and ${expected_from_file}")
endif()

# 3. A longer prompt starting with the saved one: the whole file is used, the rest prefilled.
set(longer "${PROMPT} Then it rained.")
run_generate(0 longer_plain longer_plain_err --prompt "${longer}")
run_generate(0 longer_loaded longer_err --prompt "${longer}" --load-cache "${cache}")
expect_equal("stdout of a longer prompt with --load-cache differs from the run without it"
             "${longer_loaded}" "${longer_plain}")
prompt_counts("${longer_err}" longer_total longer_from_file)
if(NOT longer_from_file EQUAL saved OR NOT longer_total GREATER saved)
  message(FATAL_ERROR "longer prompt: ${longer_from_file} of ${longer_total} tokens from the "
                      "file, expected all ${saved} saved ones")
endif()

# 4. A cache of a prompt that shares only its first words: those are reused.
set(other "Once upon a time, Tom ran")
run_generate(0 other_plain other_plain_err --prompt "${other}")
run_generate(0 other_loaded other_err --prompt "${other}" --load-cache "${cache}")
expect_equal("stdout of a prompt sharing a prefix with --load-cache differs from the run without it"
             "${other_loaded}" "${other_plain}")
prompt_counts("${other_err}" other_total other_from_file)
# BOS, "Once", " upon", " a", " time", "," at least; never the whole saved prompt.
if(other_from_file LESS 5 OR NOT other_from_file LESS saved)
  message(FATAL_ERROR "a prompt sharing 'Once upon a time,': ${other_from_file} tokens reused "
                      "of ${saved} saved")
endif()
if(NOT other_err MATCHES "which held ${saved}\\)")
  message(FATAL_ERROR "the report does not say how many positions the file held:\n${other_err}")
endif()

# 5. Files that must be refused with one line.
function(expect_refused what regex)
  run_generate(1 out err ${ARGN})
  if(NOT err MATCHES "^generate: cache file '[^']*': [^\n]*${regex}[^\n]*\n$")
    message(FATAL_ERROR "${what}: expected one line matching '${regex}', got:\n${err}")
  endif()
  if(NOT out STREQUAL "")
    message(FATAL_ERROR "${what}: generated text although the cache was refused:\n${out}")
  endif()
endfunction()

# Byte-level damage, made with head and dd (the tests run on Linux).
find_program(HEAD head)
find_program(DD dd)
if(HEAD AND DD)
  # Offsets from the file's size, which depends on the store: a cut inside the payload, and a
  # payload byte well past the header.
  file(SIZE "${cache}" size)
  math(EXPR cut "${size} - 7")
  math(EXPR at "${size} - ${size} / 3")
  execute_process(COMMAND ${HEAD} -c ${cut} "${cache}" OUTPUT_FILE "${OUT}/truncated.kvc")
  expect_refused("truncated file" "truncated" --prompt "${PROMPT}"
                 --load-cache "${OUT}/truncated.kvc")
  # One payload byte replaced: the payload checksum catches it.
  file(COPY_FILE "${cache}" "${OUT}/flipped.kvc")
  file(READ "${cache}" old OFFSET ${at} LIMIT 1 HEX)
  if(old STREQUAL "5a")
    file(WRITE "${OUT}/byte.txt" "Y")
  else()
    file(WRITE "${OUT}/byte.txt" "Z")
  endif()
  execute_process(COMMAND ${DD} if=${OUT}/byte.txt of=${OUT}/flipped.kvc bs=1 seek=${at}
                          conv=notrunc status=none)
  expect_refused("flipped payload byte" "corrupted" --prompt "${PROMPT}"
                 --load-cache "${OUT}/flipped.kvc")
else()
  message(FATAL_ERROR "head and dd are needed to damage a cache file")
endif()
message(STATUS "ok: saved ${saved} positions, loaded ${from_file} of ${total}")
