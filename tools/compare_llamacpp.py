#!/usr/bin/env python3
"""Decode and prefill of the same GGUF files: kvdecode's generator beside llama.cpp's llama-bench.

llama.cpp is not part of this project: build it yourself (its CMake, -DGGML_NATIVE=ON) and pass
its llama-bench. For each file, thread count and mode the two programs run alternately (who goes
first alternates between rounds), and the table gives the median tok/s of each and their ratio.

  decode:  llama-bench -p 0 -n 128 (tg128)    vs  generate -p "" -n 128 (BOS, then 128 tokens)
  prefill: llama-bench -p 128 -n 0 (pp128)    vs  generate -f PROMPT -n 1 (a 128-token prompt)

The prompt is the longest repetition of one English sentence that encodes to 128 tokens (BOS
included) with the first file's vocabulary, found by asking the generator; all files must share
that vocabulary (the script checks the count on each). Standard library only.

  tools/compare_llamacpp.py --llama-bench ~/llama.cpp/build/bin/llama-bench \\
      --generate build/release/examples/generate 15M-q8_0.gguf 15M-q4_0.gguf

--weights makes the generator convert on load (e.g. `--weights bf16` on an f16 file, which it
otherwise widens to f32); llama.cpp always runs the file as stored.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

SENTENCE = ("Once upon a time there was a little girl named Lily who loved to play in the park "
            "with her friends and her dog").split()


def run_generate(opts, model, threads, mode):
    args = [opts.generate, "-m", model, "--temperature", "0", "--threads", str(threads),
            "--weights", opts.weights]
    args += ["-p", "", "-n", "128"] if mode == "decode" else ["-f", opts.prompt, "-n", "1"]
    p = subprocess.run(args, capture_output=True, text=True, errors="replace")
    if p.returncode != 0:
        sys.exit("generate failed: %s" % p.stderr.strip().splitlines()[-1])
    report = p.stderr
    if mode == "prefill":
        n = int(re.search(r"^prompt tokens\s+(\d+)", report, re.M).group(1))
        if n != 128:
            sys.exit("the prompt file encodes to %d tokens with %s, expected 128" % (n, model))
        return float(re.search(r"^prefill\s+[0-9.]+ ms, ([0-9.]+) tok/s", report, re.M).group(1))
    return float(re.search(r"^decode\s+([0-9.]+) tok/s", report, re.M).group(1))


def prompt_tokens(opts, model, text):
    with open(opts.prompt, "w") as f:
        f.write(text)
    p = subprocess.run([opts.generate, "-m", model, "-f", opts.prompt, "-n", "1", "--threads",
                        "1"], capture_output=True, text=True, errors="replace")
    return int(re.search(r"^prompt tokens\s+(\d+)", p.stderr, re.M).group(1))


def fit_prompt(opts, model):
    """Writes the 128-token prompt to opts.prompt (bisection over the number of words)."""
    lo, hi = 1, 256
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if prompt_tokens(opts, model, " ".join((SENTENCE * 32)[:mid])) <= 128:
            lo = mid
        else:
            hi = mid - 1
    if prompt_tokens(opts, model, " ".join((SENTENCE * 32)[:lo])) != 128:
        sys.exit("no repetition of the sentence encodes to exactly 128 tokens with " + model)


def run_llama_bench(opts, model, threads, mode):
    a = ["-p", "0", "-n", "128"] if mode == "decode" else ["-p", "128", "-n", "0"]
    p = subprocess.run([opts.llama_bench, "-m", model, "-t", str(threads), "-r", "1", "-o",
                        "json"] + a, capture_output=True, text=True, errors="replace")
    if p.returncode != 0:
        sys.exit("llama-bench failed: %s" % p.stderr.strip()[-300:])
    return json.loads(p.stdout)[0]["avg_ts"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+", help="GGUF files")
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--generate", required=True)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--weights", default="stored",
                    help="the generator's --weights: stored (as the file keeps them), or a format "
                         "to convert to on load, e.g. bf16 beside llama.cpp's f16 file")
    ap.add_argument("--modes", default="decode,prefill")
    opts = ap.parse_args()
    threads = [int(t) for t in opts.threads.split(",")]
    fd, opts.prompt = tempfile.mkstemp(suffix=".txt")
    os.close(fd)
    try:
        fit_prompt(opts, opts.models[0])
        return measure(opts, threads)
    finally:
        os.unlink(opts.prompt)


def measure(opts, threads):
    programs = [("llama.cpp", run_llama_bench), ("kvdecode", run_generate)]
    res = {}
    for r in range(opts.rounds):
        for model in opts.models:
            for t in threads:
                for mode in opts.modes.split(","):
                    for name, fn in programs if r % 2 == 0 else programs[::-1]:
                        v = fn(opts, model, t, mode)
                        res.setdefault((model, t, mode, name), []).append(v)
                        print("%s round %d %s %d thread(s) %s %s %.1f tok/s" % (
                            time.strftime("%H:%M:%S"), r + 1, model, t, mode, name, v),
                            flush=True)
    print("\n| file | threads | mode | llama.cpp tok/s | kvdecode tok/s | kvdecode / llama.cpp |")
    print("|---|---:|---|---:|---:|---:|")
    for model in opts.models:
        for t in threads:
            for mode in opts.modes.split(","):
                lc = statistics.median(res[(model, t, mode, "llama.cpp")])
                kv = statistics.median(res[(model, t, mode, "kvdecode")])
                print("| %s | %d | %s | %.1f | %.1f | %.2f |" % (
                    model.rsplit("/", 1)[-1], t, mode, lc, kv, kv / lc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
