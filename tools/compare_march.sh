#!/usr/bin/env bash
# What -march=native still buys a consumer now that the kernels are chosen at run time: builds
# one consumer of the library (bench/roofline_bench.cpp) twice, plain -O2 and -O2 -march=native,
# and runs the 15M decode and prefill (f32 and bf16 weights, 1 thread) of the two binaries
# alternately, ROUNDS times, then prints the median tok/s of each and their ratio, the ratio of
# the median CPU times (native / plain: less disturbed when other processes share the cores)
# and the load average before and after.
#
#   tools/compare_march.sh                 # ~5 minutes on 2 cores
#   ROUNDS=5 FILTER='15M/bf16' tools/compare_march.sh
#   FILTER='(15M|42M)/(f32|bf16)/threads:(1|2)/' tools/compare_march.sh
#   SKIP_BUILD=1 tools/compare_march.sh    # rerun the binaries already in $OUT
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-/tmp/kvdecode-march}"
ROUNDS="${ROUNDS:-3}"
FILTER="${FILTER:-15M/(f32|bf16)/threads:1}"
CXX="${CXX:-g++}"
mkdir -p "${OUT}"

build() {  # build <name> <extra flags...>
  local name=$1
  shift
  echo "== building ${name}: -O2 $*"
  "${CXX}" -std=c++20 -O2 -DNDEBUG "$@" -I"${ROOT}/include" -isystem /usr/include/eigen3 \
    "${ROOT}/bench/roofline_bench.cpp" -o "${OUT}/${name}" -lbenchmark -lpthread
}
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  build plain
  build native -march=native
fi

echo "== load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
for round in $(seq 1 "${ROUNDS}"); do
  for name in plain native; do
    echo "== round ${round}: ${name}"
    "${OUT}/${name}" --benchmark_filter="BM_Shape(Decode|Prefill)/${FILTER}" \
      --benchmark_min_time=0.5 --benchmark_format=json >"${OUT}/${name}.${round}.json"
  done
done

echo "== load average after: $(cut -d' ' -f1-3 /proc/loadavg)"

python3 - "${OUT}" "${ROUNDS}" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
runs, cpu = {}, {}
for name in ("plain", "native"):
    for r in range(1, rounds + 1):
        for b in json.load(open(f"{out}/{name}.{r}.json"))["benchmarks"]:
            runs.setdefault(b["name"], {}).setdefault(name, []).append(b["tok/s"])
            cpu.setdefault(b["name"], {}).setdefault(name, []).append(b["cpu_time"])
print(f"{'benchmark':48} {'plain tok/s':>12} {'native tok/s':>13} {'plain/native':>13}"
      f" {'CPU time n/p':>13}")
for bench, by in runs.items():
    p, n = statistics.median(by["plain"]), statistics.median(by["native"])
    cp, cn = statistics.median(cpu[bench]["plain"]), statistics.median(cpu[bench]["native"])
    print(f"{bench:48} {p:12.1f} {n:13.1f} {p / n:13.3f} {cn / cp:13.3f}")
PY
