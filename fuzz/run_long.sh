#!/usr/bin/env bash
# The long fuzzing run recorded in docs/FUZZING.md: each target for RUNS executions (default
# 10^6), one after another, from its seed corpus. New inputs go to WORK (not the repository);
# a crash leaves crash-<sha1> in the current directory and stops that target.
#   fuzz/run_long.sh [RUNS] [WORK]      (after: cmake --preset fuzz && cmake --build --preset fuzz)
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-1000000}
work=${2:-/tmp/kvdecode-fuzz-work}
status=0
for t in checkpoint tokenizer encode cache_file; do
  mkdir -p "$work/$t"
  echo "== fuzz_$t: $runs runs"
  nice build/fuzz/fuzz/fuzz_$t -runs="$runs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    "$work/$t" fuzz/corpus/$t 2>&1 | grep -E '^(Done|stat::|==[0-9]+==|SUMMARY|artifact)' || status=1
done
exit $status
