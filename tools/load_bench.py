#!/usr/bin/env python3
"""Load benchmark of the HTTP server on the loopback (standard library only).

N concurrent clients each send R streamed /v1/completions requests one after another: a shared
system prompt of about 256 tokens, then a question of its own. Three server set-ups, each
started fresh on a free port: batched with the prefix cache, batched without it, and one request
at a time (--max-running 1, prefix cache on). Before the clients start, one request warms the
server up (and, with the cache, computes the system prompt once). Client-side times: TTFT is
request sent -> first streamed text; "event gap" is the time between streamed events (the server
puts every token already sampled into one event, so under load an event may hold several);
throughput is generated tokens / wall time of the whole run. The engine's own TTFT (submission
-> first token) and inter-token latency (per token) come from /metrics. Prints Markdown tables.

The clients: by default Python threads in this process (one per client, one connection per
request, every event parsed with json.loads). They share the machine's cores and one interpreter
lock with nothing else to do but still add a few ms to every client-side time, more under load.
With --client build/release/bench/load_client the same requests (prompts, seeds, temperature,
stop, streaming, one connection per request) are sent by that C++ program, which costs far less
to measure with; the warm-up, /metrics and the report stay the same, and the report names the
client that measured. The binary is never picked up on its own: a figure measured by the Python
client stays reproducible by the same command line.

With --prefix-restart, instead: the time to first token of one request (system prompt + a
question) on a server with an empty --prefix-dir (cold), on a server restarted on that directory
(the system prompt's blocks loaded from disk) and again on that server (from memory). Each
server first answers an unrelated warm-up request.

With --vary-lengths, request r of client c asks for M/2 + (37c + 11r) mod M tokens (M =
--max-tokens, about M on average) instead of M: the clients no longer all finish in the same
step, so their next requests no longer reach the server together.

usage: tools/load_bench.py build/release/examples/server [--clients 16] [--requests 2] [--repeat 5]
                          [--max-tokens 64] [--vary-lengths]
                          [--client build/release/bench/load_client]
       tools/load_bench.py build/release/examples/server --prefix-restart [--repeat 5]
"""
import argparse
import http.client
import json
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

SYSTEM_WORDS = (
    "And it came to pass in those days, that there went out a decree from Caesar Augustus, that "
    "all the world should be taxed. And all went to be taxed, every one into his own city. And "
    "Joseph also went up from Galilee, out of the city of Nazareth, into Judaea, unto the city of "
    "David, which is called Bethlehem; because he was of the house and lineage of David: To be "
    "taxed with Mary his espoused wife, being great with child. And so it was, that, while they "
    "were there, the days were accomplished that she should be delivered. And she brought forth "
    "her firstborn son, and wrapped him in swaddling clothes, and laid him in a manger; because "
    "there was no room for them in the inn. And there were in the same country shepherds abiding "
    "in the field, keeping watch over their flock by night. And, lo, the angel of the Lord came "
    "upon them, and the glory of the Lord shone round about them: and they were sore afraid. And "
    "the angel said unto them, Fear not: for, behold, I bring you good tidings of great joy, "
    "which shall be to all people. For unto you is born this day in the city of David a Saviour, "
    "which is Christ the Lord. And this shall be a sign unto you; Ye shall find the babe wrapped "
    "in swaddling clothes, lying in a manger. And suddenly there was with the angel a multitude "
    "of the heavenly host praising God, and saying, Glory to God in the highest, and on earth "
    "peace, good will toward men. And it came to pass, as the angels were gone away from them "
    "into heaven, the shepherds said one to another, Let us now go even unto Bethlehem, and see "
    "this thing which is come to pass, which the Lord hath made known unto us.").split()

QUESTIONS = ["And the LORD said unto Moses", "Then answered Peter and said", "And David arose",
             "Now the serpent was more subtil", "And Jesus went up into a mountain",
             "Hear, O Israel", "In the beginning was the Word", "And Abraham rose up early"]


class Server:
    def __init__(self, binary, args):
        self.proc = subprocess.Popen([binary, "--port", "0"] + args, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if "127.0.0.1:" not in line:
            self.proc.kill()
            sys.exit("server did not start: %r %r" % (line, self.proc.stderr.read()))
        self.port = int(line.split("127.0.0.1:")[1].split()[0])

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=10)


def post(port, body, timeout):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", "/v1/completions", body=json.dumps(body))
    resp = conn.getresponse()
    data = json.loads(resp.read())
    conn.close()
    return data


def get(port, path, timeout):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("GET", path)
    data = json.loads(conn.getresponse().read())
    conn.close()
    return data


def streamed(port, body, timeout):
    """(ttft_s, [inter-token gaps in s], completion_tokens, prompt_tokens, cached_tokens,
    the engine's TTFT in s from the usage)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(dict(body, stream=True)))
    resp = conn.getresponse()
    times, usage = [], None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            if line == "data: [DONE]":
                break
            continue
        event = json.loads(line[6:])
        if event["choices"][0]["text"]:
            times.append(time.perf_counter())
        if "usage" in event:
            usage = event["usage"]
    conn.close()
    gaps = [b - a for a, b in zip(times, times[1:])]
    return (times[0] - t0, gaps, usage["completion_tokens"], usage["prompt_tokens"],
            usage["prompt_tokens_details"]["cached_tokens"], usage["ttft_ms"] / 1e3)


def system_prompt(port, target, timeout):
    """The longest prefix of SYSTEM_WORDS whose prompt (BOS included) has <= target tokens."""
    lo, hi = 1, len(SYSTEM_WORDS)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        n = post(port, {"prompt": " ".join(SYSTEM_WORDS[:mid]), "max_tokens": 1},
                 timeout)["usage"]["prompt_tokens"]
        lo, hi = (mid, hi) if n <= target else (lo, mid - 1)
    text = " ".join(SYSTEM_WORDS[:lo])
    return text, post(port, {"prompt": text, "max_tokens": 1}, timeout)["usage"]["prompt_tokens"]


def cpu_seconds(pid):
    """User + system CPU seconds of process pid (all its threads, /proc), or of this one."""
    if pid is None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values, q):
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def max_tokens_of(opts, c, r):
    """max_tokens of request r of client c: --max-tokens, or with --vary-lengths a spread over
    [M/2, 3M/2) (about M on average), so the clients do not all finish in the same step."""
    m = opts.max_tokens
    return m // 2 + (37 * c + 11 * r) % m if opts.vary_lengths else m


def python_clients(opts, port, system):
    """The client phase in this process: one thread per client, one connection per request.
    (results, errors, wall s, client CPU s)."""
    results, errors = [], []
    lock = threading.Lock()

    def client(c):
        for r in range(opts.requests):
            q = QUESTIONS[(c + r) % len(QUESTIONS)] + " (%d.%d)" % (c, r)
            try:
                res = streamed(port, {"prompt": system + "\n" + q, "max_tokens": max_tokens_of(opts, c, r),
                                      "temperature": 0.8, "seed": 1 + c * 100 + r, "stop": []},
                               opts.timeout)
                with lock:
                    results.append(res)
            except Exception as e:  # counted and reported
                with lock:
                    errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(opts.clients)]
    cpu0 = cpu_seconds(None)
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors, time.perf_counter() - t0, cpu_seconds(None) - cpu0


def native_clients(opts, port, system):
    """The same client phase run by the --client binary (bench/load_client.cpp), which prints a
    record per request and its own wall and CPU time. (results, errors, wall s, client CPU s)."""
    out = subprocess.run(
        [opts.client, "--port", str(port), "--clients", str(opts.clients), "--requests",
         str(opts.requests), "--max-tokens", str(opts.max_tokens), "--system", "-", "--timeout",
         str(opts.timeout)] + (["--vary-lengths"] if opts.vary_lengths else []),
        input=system, capture_output=True, text=True)
    try:
        data = json.loads(out.stdout)
    except ValueError:
        sys.exit("%s failed (exit code %d): %s" % (opts.client, out.returncode, out.stderr.strip()))
    results, errors = [], list(data["errors"])
    for r in data["requests"]:
        if r["ttft_ms"] is None:  # as the Python client, which finds no first text time
            errors.append("client %d request %d: no text event" % (r["client"], r["request"]))
            continue
        results.append((r["ttft_ms"] / 1e3, [g / 1e3 for g in r["gaps_ms"]],
                        r["completion_tokens"], r["prompt_tokens"], r["cached_tokens"],
                        r["engine_ttft_ms"] / 1e3))
    return results, errors, data["wall_s"], data["cpu_s"]


def run(binary, name, args, opts, system):
    server = Server(binary, args)
    try:
        post(server.port, {"prompt": system + "\nAmen.", "max_tokens": 4, "temperature": 0},
             opts.timeout)  # warm-up
        warm = get(server.port, "/metrics", opts.timeout)
        cpu0 = cpu_seconds(server.proc.pid)
        if opts.client:
            results, errors, wall, client_cpu = native_clients(opts, server.port, system)
        else:
            results, errors, wall, client_cpu = python_clients(opts, server.port, system)
        server_cpu = cpu_seconds(server.proc.pid) - cpu0
        m = get(server.port, "/metrics", opts.timeout)
    finally:
        server.stop()
    ttft = [r[0] * 1e3 for r in results]
    itl = [g * 1e3 for r in results for g in r[1]]
    beyond = [(r[0] - r[5]) * 1e3 for r in results]  # client TTFT - the engine's, per request
    tokens = sum(r[2] for r in results)
    return {
        "name": name, "requests": len(results), "errors": errors, "wall_s": wall,
        "tokens": tokens, "tok_s": tokens / wall,
        "ttft_p50": pct(ttft, 0.5), "ttft_p90": pct(ttft, 0.9), "ttft_p99": pct(ttft, 0.99),
        "beyond_p50": pct(beyond, 0.5), "beyond_p90": pct(beyond, 0.9),
        "itl_p50": pct(itl, 0.5), "itl_p90": pct(itl, 0.9), "itl_p99": pct(itl, 0.99),
        "prompt_tokens": statistics.mean(r[3] for r in results),
        "cached": statistics.mean(r[4] for r in results),
        "prefilled": m["tokens_prefilled"] - warm["tokens_prefilled"],
        "preemptions": m["preemptions"],
        "server_itl_p50": m["itl"]["p50_ms"], "server_itl_p99": m["itl"]["p99_ms"],
        "server_ttft_p50": m["ttft"]["p50_ms"],
        "server_cpu": server_cpu, "client_cpu": client_cpu, "steps": m["steps"],
        "passes": m.get("passes", m["steps"]),
    }


def restart_bench(opts, common, system, n_system):
    """Cold, from disk after a restart, and from memory: TTFT of one request each, per run."""

    def measure(server, question):
        t0 = time.perf_counter()
        r = post(server.port, {"prompt": system + "\n" + QUESTIONS[question], "max_tokens": 1,
                               "temperature": 0}, opts.timeout)
        wall = (time.perf_counter() - t0) * 1e3
        u = r["usage"]
        return (u["prefilled_tokens"], u["prompt_tokens_details"]["cached_tokens"],
                u["prompt_tokens_details"]["cached_from_disk_tokens"], u["ttft_ms"], wall)

    def start(directory):
        server = Server(opts.server, common + ["--prefix-dir", directory])
        post(server.port, {"prompt": "Amen.", "max_tokens": 2}, opts.timeout)  # warm-up
        return server

    rows = []
    for rep in range(opts.repeat):
        directory = tempfile.mkdtemp(prefix="kvdecode_prefix_bench_")
        try:
            server = start(directory)
            row = {"cold": measure(server, 0)}
            server.stop()  # writes the cached blocks to the directory
            server = start(directory)
            row["disk"] = measure(server, 1)
            row["memory"] = measure(server, 2)
            server.stop()
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        rows.append(row)
        print("run %d: " % (rep + 1) + "; ".join(
            "%s: prefilled %d, cached %d (%d from disk), engine TTFT %.2f ms, client %.2f ms" %
            ((phase,) + row[phase]) for phase in ("cold", "disk", "memory")))
    print("\n| %d-token system prompt + question | prefilled | from disk | engine TTFT ms, "
          "median (min) | client ms, median (min) |" % n_system)
    print("|---|---:|---:|---:|---:|")
    for phase, name in (("cold", "empty --prefix-dir"), ("disk", "restarted, blocks on disk"),
                        ("memory", "same server again, blocks in memory")):
        ttft = [row[phase][3] for row in rows]
        wall = [row[phase][4] for row in rows]
        print("| %s | %d | %d | %.2f (%.2f) | %.2f (%.2f) |" % (
            name, rows[0][phase][0], rows[0][phase][2], statistics.median(ttft), min(ttft),
            statistics.median(wall), min(wall)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("server")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=2, help="requests per client, in sequence")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--vary-lengths", action="store_true",
                    help="request r of client c asks for MAX/2 + (37c + 11r) mod MAX tokens "
                         "(about MAX on average) instead of MAX, so the clients' requests do "
                         "not all end in the same step and arrive together again")
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300, help="seconds per HTTP exchange")
    ap.add_argument("--repeat", type=int, default=1, help="runs of the three set-ups")
    ap.add_argument("--client", metavar="PATH",
                    help="run the clients with this binary (bench/load_client) instead of "
                         "Python threads; --prefix-restart's single requests stay in Python")
    ap.add_argument("--server-args", default="", metavar="ARGS",
                    help="more arguments for every server started, "
                         "e.g. --server-args=--no-sub-passes")
    ap.add_argument("--prefix-restart", action="store_true",
                    help="measure TTFT cold / after a restart on a --prefix-dir / in memory")
    opts = ap.parse_args()
    if opts.vary_lengths and opts.max_tokens < 2:
        ap.error("--vary-lengths needs --max-tokens 2 or more")
    if opts.client and not (os.path.isfile(opts.client) and os.access(opts.client, os.X_OK)):
        ap.error("--client %s is not an executable file (cmake --build build/release --target "
                 "load_client)" % opts.client)
    common = ["--threads", str(opts.threads), "--blocks", "2048", "--max-running",
              str(max(16, opts.clients)), "--step-tokens", "256",
              "--http-threads", str(opts.clients + 8)] + shlex.split(opts.server_args)
    probe = Server(opts.server, common)
    try:
        system, n_system = system_prompt(probe.port, opts.system_tokens, opts.timeout)
    finally:
        probe.stop()
    if opts.prefix_restart:
        restart_bench(opts, common, system, n_system)
        return 0
    setups = [("batched, prefix cache", common),
              ("batched, no prefix cache", common + ["--no-prefix-cache"]),
              ("one at a time, prefix cache", common + ["--max-running", "1"])]
    runs, failed = [], False
    for rep in range(opts.repeat):
        rows = [run(opts.server, name, args, opts, system) for name, args in setups]
        report(rows, opts, n_system, rep)
        runs.append(rows)
        failed = failed or any(r["errors"] for r in rows)
    # A shared machine disturbs some runs more than others: the medians over the runs, and the
    # best run of each set-up (least disturbed), are both given.
    print("\nover %d runs (median / best of each set-up), measured by %s:\n" % (
        opts.repeat, client_name(opts)))
    print("| set-up | gen tok/s | TTFT p50 ms | engine TTFT p50 ms | client - engine TTFT p50 ms "
          "| engine ITL p50 ms |")
    print("|---|---:|---:|---:|---:|---:|")
    summary = []
    for k, (name, _) in enumerate(setups):
        col = lambda key: [rows[k][key] for rows in runs]
        row = {"tok_s": (statistics.median(col("tok_s")), max(col("tok_s"))),
               "ttft": (statistics.median(col("ttft_p50")), min(col("ttft_p50"))),
               "sttft": (statistics.median(col("server_ttft_p50")), min(col("server_ttft_p50"))),
               "beyond": (statistics.median(col("beyond_p50")), min(col("beyond_p50"))),
               "sitl": (statistics.median(col("server_itl_p50")), min(col("server_itl_p50")))}
        summary.append(row)
        print("| %s | %.0f / %.0f | %.1f / %.1f | %.1f / %.1f | %.1f / %.1f | %.2f / %.2f |" % (
            name, row["tok_s"][0], row["tok_s"][1], row["ttft"][0], row["ttft"][1],
            row["sttft"][0], row["sttft"][1], row["beyond"][0], row["beyond"][1],
            row["sitl"][0], row["sitl"][1]))
    cached, uncached, serial = summary
    ttft = [rows[1]["ttft_p50"] / rows[0]["ttft_p50"] for rows in runs]
    tok = [rows[0]["tok_s"] / rows[2]["tok_s"] for rows in runs]
    print("\nTTFT p50 without / with the prefix cache, per run: %s; of the medians %.1fx, of the "
          "best runs %.1fx" % (", ".join("%.1fx" % x for x in ttft),
                               uncached["ttft"][0] / cached["ttft"][0],
                               uncached["ttft"][1] / cached["ttft"][1]))
    sttft = [rows[1]["server_ttft_p50"] / rows[0]["server_ttft_p50"] for rows in runs]
    print("engine TTFT p50 without / with the prefix cache, per run: %s; of the medians %.1fx, of "
          "the best runs %.1fx" % (", ".join("%.1fx" % x for x in sttft),
                                   uncached["sttft"][0] / cached["sttft"][0],
                                   uncached["sttft"][1] / cached["sttft"][1]))
    print("generated tokens/s batched / one at a time, per run: %s; of the medians %.1fx, of the "
          "best runs %.1fx" % (", ".join("%.1fx" % x for x in tok),
                               cached["tok_s"][0] / serial["tok_s"][0],
                               cached["tok_s"][1] / serial["tok_s"][1]))
    # The machine's other load takes wall time, not our CPU time: tokens per server CPU-second
    # and tokens per step (the effective batch) show what the engine itself did in each run.
    # (A run too short for one clock tick of server CPU time has no figure.)
    cpu = ["%.1fx" % ((rows[0]["tokens"] / rows[0]["server_cpu"]) /
                      (rows[2]["tokens"] / rows[2]["server_cpu"]))
           if rows[0]["server_cpu"] > 0 and rows[2]["server_cpu"] > 0 and rows[2]["tokens"] > 0
           else "n/a" for rows in runs]
    print("generated tokens per server CPU-second batched / one at a time, per run: %s" %
          ", ".join(cpu))
    print("batched (prefix cache) tokens per step, per run: %s; model passes per step: %s; its "
          "wall share of one core: %s" % (
        ", ".join("%.1f" % (rows[0]["tokens"] / rows[0]["steps"]) for rows in runs),
        ", ".join("%.2f" % (rows[0]["passes"] / rows[0]["steps"]) for rows in runs),
        ", ".join("%.0f%%" % (100 * rows[0]["server_cpu"] / rows[0]["wall_s"]) for rows in runs)))
    return 1 if failed else 0


def client_name(opts):
    return ("the C++ client %s" % opts.client if opts.client else
            "the Python client (%d threads in this process)" % opts.clients)


def report(rows, opts, n_system, rep):
    lengths = ("%d-%d generated tokens (--vary-lengths)" % (opts.max_tokens // 2,
                                                             opts.max_tokens // 2 + opts.max_tokens - 1)
               if opts.vary_lengths else "%d generated tokens each" % opts.max_tokens)
    print("\nrun %d: %d clients x %d requests, system prompt %d tokens (BOS included), %s, "
          "%d engine threads; measured by %s\n" % (
              rep + 1, opts.clients, opts.requests, n_system, lengths, opts.threads,
              client_name(opts)))
    print("| set-up | requests | wall s | gen tok/s | TTFT p50 / p90 / p99 ms | "
          "event gap p50 / p90 / p99 ms | engine TTFT p50 ms | client - engine TTFT p50 / p90 ms | "
          "engine ITL p50 / p99 ms | prompt tok (cached) | prefilled | preemptions | "
          "CPU s server / client | steps |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print("| %s | %d%s | %.2f | %.0f | %.1f / %.1f / %.1f | %.2f / %.2f / %.2f | %.1f | "
              "%.1f / %.1f | %.2f / %.2f | %.0f (%.0f) | %d | %d | %.2f / %.2f | %d |" % (
                  r["name"], r["requests"],
                  " (%d failed)" % len(r["errors"]) if r["errors"] else "", r["wall_s"],
                  r["tok_s"], r["ttft_p50"], r["ttft_p90"], r["ttft_p99"], r["itl_p50"],
                  r["itl_p90"], r["itl_p99"], r["server_ttft_p50"], r["beyond_p50"],
                  r["beyond_p90"], r["server_itl_p50"], r["server_itl_p99"],
                  r["prompt_tokens"], r["cached"], r["prefilled"], r["preemptions"],
                  r["server_cpu"], r["client_cpu"], r["steps"]))
    cached, uncached, serial = rows
    print("\nTTFT p50 without / with the prefix cache: %.1fx" %
          (uncached["ttft_p50"] / cached["ttft_p50"]))
    print("generated tokens/s batched / one at a time: %.1fx" %
          (cached["tok_s"] / serial["tok_s"]))
    for r in rows:
        for e in r["errors"][:3]:
            print("error (%s): %s" % (r["name"], e), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
