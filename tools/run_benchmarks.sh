#!/usr/bin/env bash
# Runs the KV-cache benchmark suite (decode, generate, prefill, attention, memory) with JSON
# output, then draws docs/charts/*.png and rewrites the generated tables of docs/RESULTS.md.
#
#   tools/run_benchmarks.sh                # full run, ~6 minutes on 2 cores
#   BUILD_DIR=/tmp/b tools/run_benchmarks.sh
#   KVDECODE_BENCH_SMOKE=1 tools/run_benchmarks.sh   # tiny ranges, to test this script only
#
# Needs gnuplot (installs Debian's gnuplot-nox with apt-get only when it is missing).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-/tmp/build-bench}"
OUT_DIR="${OUT_DIR:-${BUILD_DIR}/results}"
BENCHES=(memory_bench attention_bench decode_bench prefill_bench generate_bench)

if ! command -v gnuplot >/dev/null 2>&1; then
  echo "== gnuplot missing: installing gnuplot-nox from Debian"
  if [ "$(id -u)" -eq 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gnuplot-nox >/dev/null
fi

echo "== building ${BENCHES[*]} in ${BUILD_DIR}"
cmake -S "${ROOT}" -B "${BUILD_DIR}" -DCMAKE_BUILD_TYPE=Release -DKVDECODE_BUILD_EXAMPLES=OFF \
  >/dev/null
cmake --build "${BUILD_DIR}" -j2 --target "${BENCHES[@]}"

mkdir -p "${OUT_DIR}"
"${ROOT}/tools/machine_info.sh" > "${OUT_DIR}/machine.txt"
cat "${OUT_DIR}/machine.txt"

start=$(date +%s)
for b in "${BENCHES[@]}"; do
  echo "== ${b}"
  # Repetitions, ranges and units are fixed in the sources; min_time 0.2 s per point.
  "${BUILD_DIR}/bench/${b}" --benchmark_min_time=0.2 \
    --benchmark_out="${OUT_DIR}/${b}.json" --benchmark_out_format=json \
    --benchmark_counters_tabular=false
done
echo "== suite took $(( $(date +%s) - start )) s"

python3 "${ROOT}/tools/plot_results.py" --results "${OUT_DIR}" --charts "${ROOT}/docs/charts" \
  --markdown "${ROOT}/docs/RESULTS.md"
