#!/usr/bin/env bash
# Prefill of the 15M / 42M / 110M shapes (128 tokens) with f32 weights, bf16 weights on AMX tiles
# and bf16 weights with AMX turned off (roofline_bench's BM_ShapePrefill), in ROUNDS alternating
# runs of one binary, each run timing the three side by side; prints the median tok/s of each
# and the ratios, with the load average before every round (the machine may be shared: compare
# ratios within a run).
#
#   tools/amx_prefill_rounds.sh                     # build/release, 5 rounds
#   BIN=/path/roofline_bench ROUNDS=7 tools/amx_prefill_rounds.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${BIN:-${ROOT}/build/release/bench/roofline_bench}"
ROUNDS="${ROUNDS:-5}"
FILTER="${FILTER:-ShapePrefill/(15M|42M|110M)/(f32|bf16|bf16_noamx)/}"
OUT="$(mktemp -d)"

for r in $(seq 1 "${ROUNDS}"); do
  echo "round ${r}: load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2
  "${BIN}" --benchmark_filter="${FILTER}" --benchmark_min_time=0.3 \
    --benchmark_out="${OUT}/round${r}.json" --benchmark_out_format=json >/dev/null
done

python3 - "${OUT}" <<'EOF'
import glob, json, statistics, sys
runs = {}
for f in sorted(glob.glob(sys.argv[1] + "/round*.json")):
    for b in json.load(open(f))["benchmarks"]:
        _, shape, weights, threads = b["name"].split("/")[:4]
        runs.setdefault((shape, threads.split(":")[1], weights), []).append(b["tok/s"])
med = {k: statistics.median(v) for k, v in runs.items()}
print("| shape | threads | f32 tok/s | bf16 AMX tok/s | bf16 no AMX tok/s | AMX ÷ f32 | AMX ÷ no AMX |")
print("|---:|---:|---:|---:|---:|---:|---:|")
for shape in ("15M", "42M", "110M"):
    for t in ("1", "2"):
        f, a, n = (med.get((shape, t, w)) for w in ("f32", "bf16", "bf16_noamx"))
        if None in (f, a, n):
            continue
        print(f"| {shape} | {t} | {f:.0f} | {a:.0f} | {n:.0f} | {a / f:.2f}× | {a / n:.2f}× |")
print(f"\n(medians of {len(glob.glob(sys.argv[1] + '/round*.json'))} rounds)")
EOF
