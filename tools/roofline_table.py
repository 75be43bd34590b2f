#!/usr/bin/env python3
"""Writes the performance tables of docs/RESULTS.md from roofline_bench's JSON.

Reads <results>/roofline_bench.json and <results>/machine.txt (written by
tools/run_roofline.sh) and replaces the part of the markdown file between this script's
GENERATED markers with: the machine, the measured limits (read bandwidth, FMA peak, and the
vdpbf16ps peak where the CPU has it), decode and
prefill figures of every shape / weight type / thread count, the targets next to what was
measured, and the long-context slope. Medians of the repetitions. Standard library only.
"""

import argparse
import json
import os
import re
import sys

BEGIN = "<!-- BEGIN GENERATED: tools/roofline_table.py (do not edit by hand) -->"
END = "<!-- END GENERATED: tools/roofline_table.py -->"

# Peer figures measured on an AMD Zen 5 machine of 2 cores (256 greedy tokens, 2 threads).
PEERS = {
    "15M": {"run_c": 510, "run_c_aligned": 610, "llama_f32": 440, "llama_f16": 440, "llama_pp": 9300},
    "42M": {"run_c": 185, "run_c_aligned": 250, "llama_f32": 210, "llama_f16": 360, "llama_pp": 3000},
    "110M": {"run_c": 73, "run_c_aligned": 100, "llama_f32": 78, "llama_f16": 136, "llama_pp": 1100},
}
SHAPES = ["15M", "42M", "110M"]


def load(results):
    path = os.path.join(results, "roofline_bench.json")
    if not os.path.exists(path):
        sys.exit(f"roofline_table.py: {path} is missing; run tools/run_roofline.sh first")
    with open(path) as f:
        entries = json.load(f)["benchmarks"]
    out = {}
    for e in entries:
        if e.get("error_occurred"):
            sys.exit(f"roofline_table.py: {e['name']} failed: {e.get('error_message')}")
        name = re.sub(r"(/(repeats|iterations):\d+|/real_time)+$", "", e["run_name"])
        median = e["run_type"] == "aggregate" and e.get("aggregate_name") == "median"
        if median or (e["run_type"] == "iteration" and name not in out):
            out[name] = e
    return out


def get(runs, name, counter):
    e = runs.get(name)
    if e is None:
        sys.exit(f"roofline_table.py: no result for {name}")
    if counter not in e:
        sys.exit(f"roofline_table.py: {name} has no counter {counter}")
    return float(e[counter])


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def verdict(measured, target):
    return "met" if measured >= target else f"not met ({measured / target:.0%} of target)"


def generate(runs, machine):
    out = ["### Machine and run", "", "```", machine.strip(), "```", ""]

    bw = {t: get(runs, f"BM_ReadBandwidth/threads:{t}", "GB/s") for t in (1, 2)}
    peak = get(runs, "BM_FmaPeak", "GFLOP/s")
    limits = [["read bandwidth, GB/s (sum of a 512 MiB array)", f"{bw[1]:.1f}", f"{bw[2]:.1f}"],
              ["f32 FMA peak, GFLOP/s (12 chains of 512-bit FMA)", f"{peak:.0f}", f"{2 * peak:.0f}"]]
    dot = runs.get("BM_Bf16DotPeak")  # registered where the CPU has AVX512_BF16
    if dot is not None:
        g = float(dot["GFLOP/s"])
        limits.append(["bf16 dot-product peak, GFLOP/s (12 chains of vdpbf16ps)", f"{g:.0f}",
                       f"{2 * g:.0f}"])
    out += ["### Limits measured in the run", "",
            table(["probe", "1 thread", "2 threads"], limits), ""]

    rows = []
    for s in SHAPES:
        for w in ("f32", "bf16", "q8_0", "q4_0"):
            for t in (1, 2):
                d = f"BM_ShapeDecode/{s}/{w}/threads:{t}"
                p = f"BM_ShapePrefill/{s}/{w}/threads:{t}"
                rows.append([s, w, t, f"{get(runs, d, 'tok/s'):.1f}", f"{get(runs, d, 'MB/tok'):.1f}",
                             f"{get(runs, d, 'GB/s'):.1f}", f"{get(runs, d, 'probe_GB/s'):.1f}",
                             f"{get(runs, d, 'roofline%'):.0f} %", f"{get(runs, p, 'tok/s'):.0f}",
                             f"{get(runs, p, 'GFLOP/s'):.0f}", f"{get(runs, p, 'probe_peak%'):.0f} %",
                             f"{get(runs, p, 'peak%'):.0f} %"])
    out += ["### Decode and prefill of the standard shapes (random weights)", "",
            "Decode: one token after 128 cached positions. Prefill: 128 tokens into an empty cache "
            "(as llama.cpp's pp128). GB/s = (weights + K/V read per step) × tok/s; roofline = that "
            "÷ the bandwidth probed just before the timed loop at the same thread count. Peak % "
            "is against the FMA peak measured in this run (for bf16 weights on bf16 pairs, the "
            "vdpbf16ps peak), and against the nominal 215 GFLOP/s per core of a Zen 5 core (two "
            "full-width 512-bit FMA pipes; an f32 figure, so bf16 pairs may pass 100 %).", "",
            table(["shape", "weights", "threads", "decode tok/s", "MB read / tok", "GB/s",
                   "probe GB/s", "roofline", "prefill tok/s", "GFLOP/s", "% measured peak",
                   "% nominal peak"], rows), ""]

    def dec(s, w, t):
        return get(runs, f"BM_ShapeDecode/{s}/{w}/threads:{t}", "tok/s")

    def roof(s, w, t):
        return get(runs, f"BM_ShapeDecode/{s}/{w}/threads:{t}", "roofline%")

    def pre(s, w, t):
        return get(runs, f"BM_ShapePrefill/{s}/{w}/threads:{t}", "tok/s")

    targets = []
    for s in ("42M", "110M"):
        best = max(roof(s, "f32", t) for t in (1, 2))
        targets.append([f"{s} f32 decode ≥ 90 % of the in-run roofline", "90 %",
                        f"{roof(s, 'f32', 1):.0f} % / {roof(s, 'f32', 2):.0f} % (1 / 2 threads)",
                        verdict(best, 90)])
    t15 = 1.25 * PEERS["15M"]["run_c_aligned"]
    targets.append(["15M f32 decode ≥ 1.25 × the best f32 peer (610)", f"{t15:.0f} tok/s",
                    f"{dec('15M', 'f32', 2):.0f} tok/s", verdict(dec("15M", "f32", 2), t15)])
    for s in SHAPES:
        tb = 1.1 * PEERS[s]["llama_f16"]
        targets.append([f"{s} bf16 decode ≥ 1.1 × llama.cpp f16", f"{tb:.0f} tok/s",
                        f"{dec(s, 'bf16', 2):.0f} tok/s", verdict(dec(s, "bf16", 2), tb)])
    for s in SHAPES:
        tp = 1.3 * PEERS[s]["llama_pp"]
        best = max(pre(s, w, 2) for w in ("f32", "bf16"))
        targets.append([f"{s} prefill ≥ 1.3 × llama.cpp pp128", f"{tp:.0f} tok/s",
                        f"{pre(s, 'f32', 2):.0f} f32 / {pre(s, 'bf16', 2):.0f} bf16 tok/s",
                        verdict(best, tp)])
    pk = get(runs, "BM_ShapePrefill/110M/f32/threads:2", "probe_peak%")
    targets.append(["110M prefill ≥ 60 % of the FMA peak (f32, 2 threads)", "60 %",
                    f"{pk:.0f} % of measured, "
                    f"{get(runs, 'BM_ShapePrefill/110M/f32/threads:2', 'peak%'):.0f} % of nominal",
                    verdict(pk, 60)])
    for s in ("42M", "110M"):
        for w in ("f32", "bf16"):
            r = dec(s, w, 2) / dec(s, w, 1)
            targets.append([f"{s} {w} decode, 2 threads ≥ 1.7 × 1 thread", "1.70×", f"{r:.2f}×",
                            verdict(r, 1.7)])
    targets.append(["(the bandwidth probe itself, 2 threads ÷ 1)", "", f"{bw[2] / bw[1]:.2f}×", ""])
    out += ["### Targets against this run", "",
            table(["target", "bar", "measured (2 threads unless said)", "verdict"], targets), ""]

    long_rows = []
    for t in (1, 2):
        pts = []
        for T in (64, 256, 512, 1000):
            e = f"BM_LongContextDecode/42M/f32/threads:{t}/T:{T}"
            pts.append((T, 1e3 / get(runs, e, "tok/s")))
        slope = (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0]) * 1e3  # µs per position
        kv_per_pos = 2 * 8 * 512 * 4  # bytes of K and V per position, 8 layers, kv_dim 512
        predicted = kv_per_pos / (bw[t] * 1e9) * 1e6
        long_rows.append([t] + [f"{ms:.2f}" for _, ms in pts] + [f"{slope:.2f}", f"{predicted:.2f}"])
    out += ["### Long context (42M, f32): decode-step time over the cached positions T", "",
            table(["threads", "T = 64 ms", "T = 256 ms", "T = 512 ms", "T = 1000 ms",
                   "slope µs / position", "K/V bytes ÷ probe bandwidth, µs / position"], long_rows), ""]
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", required=True)
    ap.add_argument("--markdown", required=True)
    a = ap.parse_args()
    runs = load(a.results)
    with open(os.path.join(a.results, "machine.txt")) as f:
        machine = f.read()
    body = generate(runs, machine)
    with open(a.markdown) as f:
        text = f.read()
    if BEGIN not in text or END not in text:
        sys.exit(f"roofline_table.py: {a.markdown} has no GENERATED markers for this script")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(a.markdown, "w") as f:
        f.write(head + BEGIN + "\n" + body + "\n" + END + tail)
    print(f"wrote the performance tables into {a.markdown}")


if __name__ == "__main__":
    main()
