#!/usr/bin/env python3
"""Draws the KV-cache benchmark charts and tables from Google Benchmark JSON.

Reads <results>/{decode,generate,prefill,attention,memory}_bench.json and machine.txt (written
by tools/run_benchmarks.sh), draws <charts>/*.png with gnuplot, and replaces the part of the
markdown file between the GENERATED markers with tables of the medians, the complexity fits
Google Benchmark reported, and two-term least-squares fits (which keep the constant or linear
term that a one-term BigO fit cannot). Standard library only: no numpy, no matplotlib.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

BEGIN = "<!-- BEGIN GENERATED: tools/plot_results.py (do not edit by hand) -->"
END = "<!-- END GENERATED: tools/plot_results.py -->"

UNIT_S = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


# ---------------------------------------------------------------------------------------------
# Reading the JSON
# ---------------------------------------------------------------------------------------------

def load(results, name):
    path = os.path.join(results, name + ".json")
    if not os.path.exists(path):
        sys.exit(f"plot_results.py: {path} is missing; run tools/run_benchmarks.sh first")
    with open(path) as f:
        return json.load(f)["benchmarks"]


def base_name(run_name):
    """'BM_DecodeStep/cached/16/repeats:3' -> 'BM_DecodeStep/cached/16' (also /iterations:N)."""
    return re.sub(r"(/(repeats|iterations):\d+)+$", "", run_name)


def medians(entries):
    """{base name: entry} holding the median aggregate, or the single run without repetitions."""
    out, singles = {}, {}
    for e in entries:
        if e.get("error_occurred"):
            sys.exit(f"plot_results.py: {e['name']} failed: {e.get('error_message')}")
        key = base_name(e["run_name"])
        if e["run_type"] == "aggregate" and e.get("aggregate_name") == "median":
            out[key] = e
        elif e["run_type"] == "iteration":
            singles.setdefault(key, []).append(e)
    for key, runs in singles.items():
        if key not in out and len(runs) == 1:
            out[key] = runs[0]
    return out


def fits(entries):
    """{family: (big_o, coefficient, rms)} from the BigO / RMS aggregates."""
    big, rms = {}, {}
    for e in entries:
        if e.get("aggregate_name") == "BigO":
            big[base_name(e["run_name"])] = (e["big_o"], e["real_coefficient"], e["time_unit"])
        elif e.get("aggregate_name") == "RMS":
            rms[base_name(e["run_name"])] = e["rms"]
    return {k: (v[0], v[1], v[2], rms.get(k)) for k, v in big.items()}


def seconds(e):
    return e["real_time"] * UNIT_S[e["time_unit"]]


def series(meds, prefix):
    """[(arg, entry)] of the entries named prefix/<int>, sorted by the integer."""
    pts = []
    for k, e in meds.items():
        m = re.fullmatch(re.escape(prefix) + r"/(\d+)", k)
        if m:
            pts.append((int(m.group(1)), e))
    return sorted(pts)


# ---------------------------------------------------------------------------------------------
# Least squares with a few terms: y ≈ Σ c_k·f_k(x), minimising the relative error (each row is
# divided by y) so the small-x points count as much as the large ones. Normal equations solved
# by Gaussian elimination with partial pivoting; a handful of points and terms only.
# ---------------------------------------------------------------------------------------------

def fit(points, terms):
    k = len(terms)
    a = [[0.0] * (k + 1) for _ in range(k)]
    for x, y in points:
        row = [f(x) / y for f in terms]
        for i in range(k):
            for j in range(k):
                a[i][j] += row[i] * row[j]
            a[i][k] += row[i]
    for c in range(k):
        p = max(range(c, k), key=lambda r: abs(a[r][c]))
        a[c], a[p] = a[p], a[c]
        for r in range(k):
            if r != c:
                m = a[r][c] / a[c][c]
                a[r] = [v - m * w for v, w in zip(a[r], a[c])]
    coef = [a[i][k] / a[i][i] for i in range(k)]
    worst = max(abs(sum(c * f(x) for c, f in zip(coef, terms)) - y) / y for x, y in points)
    return coef, worst


# ---------------------------------------------------------------------------------------------
# gnuplot
# ---------------------------------------------------------------------------------------------

def gnuplot(script):
    subprocess.run(["gnuplot"], input=script, text=True, check=True)


def terminal():
    out = subprocess.run(["gnuplot", "-e", "set terminal"], capture_output=True, text=True)
    text = out.stdout + out.stderr
    return "pngcairo" if "pngcairo" in text else "png"


def write_dat(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(" ".join(str(v) for v in r) + "\n")


def plot(charts, tmp, name, title, xlabel, ylabel, lines, logx=True, logy=True, extra=""):
    """lines: [(rows, legend, style)], rows = [(x, y)]."""
    term = terminal()
    files = []
    for i, (rows, _, _) in enumerate(lines):
        path = os.path.join(tmp, f"{name}_{i}.dat")
        write_dat(path, rows)
        files.append(path)
    plots = ", ".join(
        f"'{files[i]}' using 1:2 with {style} title '{legend}'"
        for i, (_, legend, style) in enumerate(lines))
    script = f"""
set terminal {term} size 960,600 enhanced font ',11'
set output '{os.path.join(charts, name + '.png')}'
set title '{title}'
set xlabel '{xlabel}'
set ylabel '{ylabel}'
set grid
set key top left
{'set logscale x 2' if logx else ''}
{'set logscale y' if logy else ''}
{extra}
plot {plots}
"""
    gnuplot(script)


# ---------------------------------------------------------------------------------------------
# Tables and charts
# ---------------------------------------------------------------------------------------------

def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--results", required=True)
    ap.add_argument("--charts", required=True)
    ap.add_argument("--markdown", required=True)
    args = ap.parse_args()
    os.makedirs(args.charts, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="kvdecode-plot-")

    machine = open(os.path.join(args.results, "machine.txt")).read().strip()
    dec_e, gen_e, pre_e = (load(args.results, n) for n in ("decode_bench", "generate_bench",
                                                            "prefill_bench"))
    att_e, mem_e = load(args.results, "attention_bench"), load(args.results, "memory_bench")
    dec, gen, pre, att, mem = (medians(x) for x in (dec_e, gen_e, pre_e, att_e, mem_e))
    all_fits = {}
    for x in (dec_e, gen_e, att_e):
        all_fits.update(fits(x))
    md = []

    md.append("### Machine and run\n")
    md.append("```\n" + machine + "\n```\n")

    # --- decode step -----------------------------------------------------------------------
    cached = series(dec, "BM_DecodeStep/cached")
    uncached = series(dec, "BM_DecodeStep/uncached")
    unc = dict(uncached)
    rows = []
    for T, e in cached:
        u = unc.get(T)
        rows.append([T, f"{seconds(e) * 1e3:.2f}", f"{seconds(u) * 1e3:.1f}" if u else "",
                     f"{seconds(u) / seconds(e):.1f}×" if u else "",
                     f"{1 / seconds(e):.0f}", f"{e.get('bytes_per_second', 0) / 1e9:.1f}"])
    md.append("### Per-step latency over context length T (BM_DecodeStep)\n")
    md.append(table(["T", "cached ms", "uncached ms", "uncached / cached", "cached tok/s",
                     "cached GB/s streamed"], rows) + "\n")
    plot(args.charts, tmp, "decode_step_latency",
         "One decode step at context T (15M shape, seq\\_len 2048, 1 thread)",
         "context length T (tokens)", "time per new token (ms)",
         [([(T, seconds(e) * 1e3) for T, e in cached], "with KV cache (decode)", "linespoints lw 2"),
          ([(T, seconds(e) * 1e3) for T, e in uncached],
           "without cache (prefill of all T tokens)", "linespoints lw 2")])

    # --- generate ---------------------------------------------------------------------------
    g_c = series(gen, "BM_Generate/cached")
    g_u = dict(series(gen, "BM_Generate/uncached"))
    rows = []
    for n, e in g_c:
        u = g_u.get(n)
        rows.append([n, f"{seconds(e):.3f}", f"{seconds(u):.2f}" if u else "",
                     f"{seconds(u) / seconds(e):.1f}×" if u else "",
                     f"{n / seconds(e):.0f}", f"{n / seconds(u):.1f}" if u else "",
                     f"{e['kv_projections']:.0f}", f"{u['kv_projections']:.0f}" if u else "",
                     f"{e['attention_scores']:.3g}", f"{u['attention_scores']:.3g}" if u else ""])
    md.append("### Generating n tokens after a 1-token prompt (BM_Generate)\n")
    md.append(table(["n", "cached s", "uncached s", "speedup", "cached tok/s", "uncached tok/s",
                     "K/V proj. cached", "K/V proj. uncached", "scores cached",
                     "scores uncached"], rows) + "\n")
    plot(args.charts, tmp, "generate_total_time",
         "Total time to generate n tokens (15M shape, 1 thread)", "tokens generated n",
         "total time (s)",
         [([(n, seconds(e)) for n, e in g_c], "with KV cache", "linespoints lw 2"),
          (sorted((n, seconds(e)) for n, e in g_u.items()), "without cache (recompute each step)",
           "linespoints lw 2")])

    # --- fits -------------------------------------------------------------------------------
    rows = []
    for fam in sorted(all_fits):
        big_o, coef, unit, rms = all_fits[fam]
        rows.append([fam.replace("|", "\\|"), "O(1)" if big_o == "(1)" else f"O({big_o})",
                     f"{coef:.4g} {unit}", f"{rms * 100:.0f} %" if rms is not None else ""])
    md.append("### Complexity fits reported by Google Benchmark (`Complexity(oAuto)`)\n")
    md.append(table(["benchmark family", "best one-term fit", "coefficient", "RMS"], rows) + "\n")

    two = []
    one, lin, sq, cube = (lambda x: 1.0), (lambda x: x), (lambda x: x * x), (lambda x: x ** 3)
    if cached:
        (a, b), w = fit([(T, seconds(e) * 1e3) for T, e in cached], [one, lin])
        two.append(["BM_DecodeStep/cached", "a + b·T",
                    f"a = {a:.3g} ms, b = {b * 1e3:.3g} µs/token", f"{w * 100:.0f} %"])
    if uncached:
        (a, b, c), w = fit([(T, seconds(e) * 1e3) for T, e in uncached], [one, lin, sq])
        two.append(["BM_DecodeStep/uncached", "a + b·T + c·T²",
                    f"a = {a:.3g} ms, b = {b * 1e3:.3g} µs/token, c = {c * 1e6:.3g} ns/token²",
                    f"{w * 100:.0f} %"])
    if g_c:
        (a, b), w = fit([(n, seconds(e)) for n, e in g_c], [lin, sq])
        two.append(["BM_Generate/cached", "a·n + b·n²",
                    f"a = {a * 1e3:.3g} ms/token, b = {b * 1e6:.3g} µs/token²", f"{w * 100:.0f} %"])
    if g_u:
        (a, b, c), w = fit(sorted((n, seconds(e)) for n, e in g_u.items()), [lin, sq, cube])
        two.append(["BM_Generate/uncached", "a·n + b·n² + c·n³",
                    f"a = {a * 1e3:.3g} ms/token, b = {b * 1e6:.3g} µs/token², "
                    f"c = {c * 1e9:.3g} ns/token³", f"{w * 100:.0f} %"])
    md.append("Fits of the medians with every term the cost model has (relative least squares; "
              "the worst point's relative error in the last column):\n")
    md.append(table(["series", "model", "coefficients", "worst error"], two) + "\n")

    # --- prefill vs decode ------------------------------------------------------------------
    def by_threads(meds, prefix):
        out = {}
        for k, e in meds.items():
            m = re.fullmatch(re.escape(prefix) + r"/P:(\d+)/threads:(\d+)", k)
            if m:
                out.setdefault(int(m.group(2)), []).append((int(m.group(1)), e))
        return {t: sorted(v) for t, v in out.items()}

    p_pre = by_threads(pre, "BM_Prefill")
    p_dec = by_threads(pre, "BM_PrefillAsDecode")
    rows, lines = [], []
    for t in sorted(p_pre):
        d = dict(p_dec.get(t, []))
        for P, e in p_pre[t]:
            de = d.get(P)
            rows.append([P, t, f"{seconds(e) * 1e3:.1f}", f"{e['items_per_second']:.0f}",
                         f"{seconds(de) * 1e3:.0f}" if de else "",
                         f"{de['items_per_second']:.0f}" if de else "",
                         f"{seconds(de) / seconds(e):.1f}×" if de else ""])
        lines.append(([(P, e["items_per_second"]) for P, e in p_pre[t]],
                      f"prefill, {t} thread{'s' if t > 1 else ''}", "linespoints lw 2"))
        if t in p_dec:
            lines.append(([(P, e["items_per_second"]) for P, e in p_dec[t]],
                          f"one decode() per token, {t} thread{'s' if t > 1 else ''}",
                          "linespoints lw 2 dt 2"))
    md.append("### Prefill vs the same tokens decoded one at a time (BM_Prefill, "
              "BM_PrefillAsDecode)\n")
    md.append(table(["prompt P", "threads", "prefill ms (= TTFT)", "prefill tok/s",
                     "decode loop ms", "decode tok/s", "prefill speedup"], rows) + "\n")
    plot(args.charts, tmp, "prefill_vs_decode",
         "Prompt tokens per second: one prefill() call vs P decode() calls (15M shape)",
         "prompt length P (tokens)", "tokens / s", lines)

    # --- attention --------------------------------------------------------------------------
    kvs = sorted({int(m.group(1)) for k in att
                  for m in [re.match(r"BM_AttentionDecode/kv_heads:(\d+)/", k)] if m}, reverse=True)
    att_series = {kv: series(att, f"BM_AttentionDecode/kv_heads:{kv}") for kv in kvs}
    rec = series(att, "BM_AttentionRecompute/kv_heads:6")
    rec_d = dict(rec)
    rows = []
    for T, _ in att_series[kvs[0]] if kvs else []:
        row = [T]
        for kv in kvs:
            e = dict(att_series[kv]).get(T)
            row.append(f"{seconds(e) * 1e6:.1f}" if e else "")
        r = rec_d.get(T)
        row.append(f"{seconds(r) * 1e3:.2f}" if r else "")
        rows.append(row)
    md.append("### Attention of one layer alone (BM_AttentionDecode, BM_AttentionRecompute)\n")
    md.append(table(["T"] + [f"decode µs, {kv} kv heads (kv_mul {6 // kv})" for kv in kvs] +
                    ["recompute ms, 6 kv heads (T queries)"], rows) + "\n")
    lines = [([(T, seconds(e) * 1e6) for T, e in att_series[kv]],
              f"1 query, {kv} kv heads (kv\\_mul {6 // kv})", "linespoints lw 2") for kv in kvs]
    lines.append(([(T, seconds(e) * 1e6) for T, e in rec], "T queries (recompute), 6 kv heads",
                  "linespoints lw 2 dt 2"))
    plot(args.charts, tmp, "attention_vs_context",
         "Attention of one layer (6 query heads of 48) over context T", "context length T",
         "time per call (µs)", lines)

    # --- memory -----------------------------------------------------------------------------
    rows, lines = [], []
    weights_mib = None
    for k in sorted(mem, key=lambda k: (not k.startswith("BM_KvAppend"), k.split("_")[1],
                                        mem[k]["n_heads/n_kv_heads"])):
        e = mem[k]
        name = k.split("/", 1)[1]
        gbps = e.get("bytes_per_second")
        rows.append([name, f"{e['n_heads/n_kv_heads']:.0f}", f"{e['kv_bytes_per_token']:.0f}",
                     f"{e['kv_MiB_at_seq_len']:.1f} (T = {e['seq_len']:.0f})",
                     f"{e['weights_MiB']:.1f}", f"{e['kv_exceeds_weights_at']:.0f}",
                     f"{e['max_context_in_24GiB']:.0f}" if "max_context_in_24GiB" in e else "",
                     f"{gbps / 1e9:.1f}" if gbps and k.startswith("BM_KvAppend") else ""])
        if k.startswith("BM_KvAppend"):
            per = e["kv_bytes_per_token"]
            lines.append(([(T, per * T / 2 ** 20) for T in range(0, 8193, 256)],
                          f"{name.replace('_', ' ')} ({per / 1024:.1f} KiB/token)", "lines lw 2"))
            if name.endswith("MHA"):
                weights_mib = e["weights_MiB"]
    md.append("### KV memory per token (BM_KvAppend, BM_KvPlan; MemoryPlanner, f32)\n")
    md.append(table(["shape", "n_heads / n_kv_heads", "KV bytes / token", "KV MiB at seq_len",
                     "weights MiB (f32)", "KV > weights from T =", "max T in 24 GiB",
                     "append GB/s"], rows) + "\n")
    if weights_mib is not None:
        lines.append(([(0, weights_mib), (8192, weights_mib)], "f32 weights of the 15M shape (MHA)",
                      "lines lw 2 dt 2 lc rgb 'black'"))
    plot(args.charts, tmp, "kv_memory_vs_context",
         "KV cache (f32, batch 1) of the 15M shape vs context length", "context length T (tokens)",
         "MiB", lines, logx=False, logy=False,
         extra="set xrange [0:8192]\nset arrow from 2048, graph 0 to 2048, graph 1 nohead dt 3\n"
               "set label 'seq\\_len 2048' at 2100, graph 0.6")

    # --- write ------------------------------------------------------------------------------
    generated = "\n".join(md).rstrip() + "\n"
    text = open(args.markdown).read() if os.path.exists(args.markdown) else ""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        text = head + BEGIN + "\n" + generated + END + tail
    else:
        text = text + "\n" + BEGIN + "\n" + generated + END + "\n"
    with open(args.markdown, "w") as f:
        f.write(text)
    print(f"plot_results.py: wrote {args.markdown} and charts in {args.charts}")


if __name__ == "__main__":
    main()
