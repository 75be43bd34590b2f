#!/usr/bin/env bash
# Runs roofline_bench (decode and prefill of the 15M / 42M / 110M shapes, f32, bf16, q8_0, q4_0 weights,
# 1 and 2 threads, against the read bandwidth and FMA peak probed in the same run) with JSON
# output and rewrites the performance tables of docs/RESULTS.md.
#
#   tools/run_roofline.sh                  # ~6 minutes on 2 cores
#   BUILD_DIR=/tmp/b REPS=5 tools/run_roofline.sh
#
# Benchmarks are compiled -O3 -march=native whatever the build type (bench/CMakeLists.txt).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-/tmp/build-bench}"
OUT_DIR="${OUT_DIR:-${BUILD_DIR}/results}"
REPS="${REPS:-3}"

echo "== building roofline_bench in ${BUILD_DIR}"
cmake -S "${ROOT}" -B "${BUILD_DIR}" -DCMAKE_BUILD_TYPE=Release -DKVDECODE_BUILD_EXAMPLES=OFF \
  >/dev/null
cmake --build "${BUILD_DIR}" -j2 --target roofline_bench

mkdir -p "${OUT_DIR}"
"${ROOT}/tools/machine_info.sh" > "${OUT_DIR}/machine.txt"
cat "${OUT_DIR}/machine.txt"

start=$(date +%s)
"${BUILD_DIR}/bench/roofline_bench" --benchmark_min_time=0.3 \
  --benchmark_repetitions="${REPS}" --benchmark_report_aggregates_only=true \
  --benchmark_out="${OUT_DIR}/roofline_bench.json" --benchmark_out_format=json
echo "== roofline_bench took $(( $(date +%s) - start )) s"

python3 "${ROOT}/tools/roofline_table.py" --results "${OUT_DIR}" --markdown "${ROOT}/docs/RESULTS.md"
