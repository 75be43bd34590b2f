#!/usr/bin/env python3
"""bench/load_client against the HTTP server on the loopback: two clients x one streamed request
of a few tokens. Its JSON must hold one record per request whose usage numbers match the
server's own (/metrics counts the tokens generated; a non-streamed request of the same prompt
counts its tokens), with a TTFT no shorter than the engine's and one gap fewer than text events; against a port nobody
listens on it exits 1 with one line on stderr and the error in its JSON. tools/load_bench.py
--client runs its client phase with it.

usage: load_client_test.py SERVER_BINARY LOAD_CLIENT_BINARY
"""
import json
import os
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import server_test  # noqa: E402  (its Server and request helpers)

SERVER_BINARY = None
CLIENT_BINARY = None
SYSTEM = "In the beginning God created the heaven and the earth. And the earth was without form"
# tools/load_bench.py's first questions, as the client numbers them: "<question> (c.r)".
QUESTIONS = ["And the LORD said unto Moses", "Then answered Peter and said"]
MAX_TOKENS = 4


class LoadClientTest(unittest.TestCase):
    def setUp(self):
        self.server = server_test.Server(SERVER_BINARY)
        self.addCleanup(self.server.stop)

    def run_client(self, port, clients, requests, extra=()):
        return subprocess.run(
            [CLIENT_BINARY, "--port", str(port), "--clients", str(clients), "--requests",
             str(requests), "--max-tokens", str(MAX_TOKENS), "--system", "-", "--timeout", "30"]
            + list(extra), input=SYSTEM, capture_output=True, text=True, timeout=60)

    def test_vary_lengths_gives_each_request_its_own_max_tokens(self):
        out = self.run_client(self.server.port, 3, 2, ["--vary-lengths"])
        self.assertEqual(out.returncode, 0, out.stderr)
        records = json.loads(out.stdout)["requests"]
        self.assertEqual(len(records), 6)
        for r in records:  # M/2 + (37c + 11r) mod M, as tools/load_bench.py's max_tokens_of
            asked = MAX_TOKENS // 2 + (37 * r["client"] + 11 * r["request"]) % MAX_TOKENS
            self.assertEqual(r["max_tokens"], asked, r)
            self.assertTrue(1 <= r["completion_tokens"] <= asked, r)
        self.assertGreater(len({r["max_tokens"] for r in records}), 1)
        out = self.run_client(self.server.port, 1, 1, ["--vary-lengths", "--max-tokens", "1"])
        self.assertEqual(out.returncode, 2)
        self.assertIn("--vary-lengths needs --max-tokens 2 or more, got 1", out.stderr)

    def test_two_clients_match_the_server_counters(self):
        out = self.run_client(self.server.port, 2, 1)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stderr, "")
        result = json.loads(out.stdout)
        self.assertEqual(result["errors"], [])
        records = sorted(result["requests"], key=lambda r: (r["client"], r["request"]))
        self.assertEqual([(r["client"], r["request"]) for r in records], [(0, 0), (1, 0)])
        status, metrics = server_test.request("GET", "/metrics", server=self.server)
        self.assertEqual(status, 200)
        self.assertEqual(metrics["requests_finished"], 2)
        self.assertEqual(sum(r["completion_tokens"] for r in records),
                         metrics["tokens_generated"])
        self.assertEqual(result["completion_tokens"], metrics["tokens_generated"])
        for r in records:
            self.assertTrue(1 <= r["completion_tokens"] <= MAX_TOKENS, r)
            # Each event holds one token or more; the last holds none (the usage).
            self.assertTrue(1 <= r["text_events"] <= r["completion_tokens"], r)
            self.assertEqual(len(r["gaps_ms"]), r["text_events"] - 1, r)
            # The engine's interval (submission -> first token) lies inside the client's.
            self.assertTrue(0 < r["engine_ttft_ms"] <= r["ttft_ms"], r)
            self.assertTrue(all(g >= 0 for g in r["gaps_ms"]), r)
            self.assertTrue(0 <= r["cached_tokens"] <= r["prompt_tokens"], r)
            prompt = SYSTEM + "\n" + QUESTIONS[r["client"]] + " (%d.0)" % r["client"]
            status, answer = server_test.post("/v1/completions",
                                              {"prompt": prompt, "max_tokens": 1},
                                              server=self.server)
            self.assertEqual(status, 200, answer)
            self.assertEqual(r["prompt_tokens"], answer["usage"]["prompt_tokens"])

    def test_a_server_that_is_gone_exits_1(self):
        port = self.server.port
        self.assertEqual(self.server.stop(), 0)
        out = self.run_client(port, 1, 1)
        self.assertEqual(out.returncode, 1, out.stderr)
        self.assertRegex(out.stderr, r"^load_client: 1 of 1 requests failed, the first: "
                                     r"client 0 request 0: HTTP: [^\n]*\n$")
        result = json.loads(out.stdout)
        self.assertEqual(result["requests"], [])
        self.assertEqual(len(result["errors"]), 1)


class LoadBenchTest(unittest.TestCase):
    def test_load_bench_runs_its_clients_with_the_binary(self):
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools",
                              "load_bench.py")
        out = subprocess.run(
            [sys.executable, script, SERVER_BINARY, "--client", CLIENT_BINARY, "--clients", "2",
             "--requests", "1", "--max-tokens", str(MAX_TOKENS), "--system-tokens", "32",
             "--threads", "1"], capture_output=True, text=True, timeout=120)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn("measured by the C++ client " + CLIENT_BINARY, out.stdout)
        for setup in ("batched, prefix cache", "batched, no prefix cache",
                      "one at a time, prefix cache"):
            self.assertRegex(out.stdout, r"\n\| %s \| 2 \| " % setup)  # 2 requests, none failed


if __name__ == "__main__":
    SERVER_BINARY = sys.argv.pop(1)
    CLIENT_BINARY = sys.argv.pop(1)
    unittest.main(verbosity=2)
