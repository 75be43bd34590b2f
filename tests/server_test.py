#!/usr/bin/env python3
"""The HTTP server on the loopback, driven by a client written with the standard library only
and by curl: health, completions (whole and streamed), a second chat turn that prefills only
what is new, concurrent clients, a client that disconnects mid-stream (its blocks are freed),
malformed requests; a server restarted on the same --prefix-dir that loads a prompt's blocks
from disk (and skips a corrupt file); bad --prefix-* values; /v1/models; every request field
honoured or refused; with --gpt2-model, a GGUF model of GPT-2's byte-level BPE vocabulary; with
--gguf-model and --generate, a GGUF model of q4_0 blocks served in each weight format
(--weights) with the generator's greedy text; with --generate, a sampled completion with every
sampling field set as the generator writes it. The server picks a free port (--port 0) and
prints it; every wait is bounded.

usage: server_test.py SERVER_BINARY [--gpt2-model FILE] [--gguf-model FILE --generate BINARY]
                      [unittest arguments, e.g. a class]
"""
import http.client
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import unittest

BINARY = None
SERVER = None
GPT2_MODEL = None  # --gpt2-model: a llama model with GPT-2's vocabulary (tests/CMakeLists.txt)
GGUF_MODEL = None  # --gguf-model: the bundled model's q4_0 GGUF file
GENERATE = None  # --generate: the generator, the lone run a served completion must equal
BLOCK = 16
MAX_BODY = 65536
TIMEOUT = 30  # seconds, for any one HTTP exchange


class Server:
    def __init__(self, binary, extra=()):
        self.proc = subprocess.Popen(
            [binary, "--port", "0", "--blocks", "256", "--block-size", str(BLOCK),
             "--max-body-bytes", str(MAX_BODY), "--threads", "1"] + list(extra),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.first_line = None
        line = self.proc.stdout.readline()  # "listening on http://127.0.0.1:PORT (...)"
        if not line.startswith("listening on http://127.0.0.1:"):
            self.proc.kill()
            raise RuntimeError("server did not start: %r %r" % (line, self.proc.stderr.read()))
        self.port = int(line.split("127.0.0.1:")[1].split()[0])
        self.first_line = line

    def stop(self):
        """SIGTERM; the exit code (None if it had to be killed). self.rest: the rest of stdout."""
        self.proc.terminate()
        try:
            self.rest = self.proc.communicate(timeout=10)[0]
            return self.proc.returncode
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            return None


def request(method, path, body=None, raw=None, server=None):
    """(status, parsed JSON or text) of one exchange with `server` (default: SERVER)."""
    conn = http.client.HTTPConnection("127.0.0.1", (server or SERVER).port, timeout=TIMEOUT)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    try:
        return resp.status, json.loads(text)
    except ValueError:
        return resp.status, text


def post(path, body, server=None):
    return request("POST", path, body, server=server)


def stream(path, body, server=None):
    """The parsed events of a streamed completion, up to [DONE] (which must come)."""
    conn = http.client.HTTPConnection("127.0.0.1", (server or SERVER).port, timeout=TIMEOUT)
    conn.request("POST", path, body=json.dumps(dict(body, stream=True)),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.status
    assert resp.getheader("Content-Type").startswith("text/event-stream")
    events, done = [], False
    for raw in resp:
        line = raw.decode().rstrip("\n")
        if not line:
            continue
        assert line.startswith("data: "), line
        if line == "data: [DONE]":
            done = True
            break
        events.append(json.loads(line[len("data: "):]))
    conn.close()
    assert done, "the stream ended without [DONE]"
    return events


def metrics(server=None):
    status, m = request("GET", "/metrics", server=server)
    assert status == 200
    return m


def wait_until(predicate, seconds=15):
    end = time.time() + seconds
    while time.time() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return False


class ServerTest(unittest.TestCase):
    def test_health(self):
        self.assertEqual(request("GET", "/health"), (200, {"status": "ok"}))

    def test_completion_then_same_prompt_reuses_its_full_blocks(self):
        body = {"prompt": "And it came to pass after these things, that God did tempt Abraham",
                "max_tokens": 12, "temperature": 0}
        status, first = post("/v1/completions", body)
        self.assertEqual(status, 200, first)
        self.assertEqual(first["object"], "text_completion")
        choice = first["choices"][0]
        self.assertTrue(choice["text"])
        self.assertIn(choice["finish_reason"], ("length", "stop"))
        u = first["usage"]
        p = u["prompt_tokens"]
        self.assertEqual(u["total_tokens"], p + u["completion_tokens"])
        status, second = post("/v1/completions", body)
        self.assertEqual(second["choices"][0]["text"], choice["text"])  # greedy, same prompt
        # Every full block of the prompt is cached, at most p - 1 tokens (the last is computed).
        self.assertEqual(second["usage"]["prompt_tokens_details"]["cached_tokens"],
                         min(BLOCK * (p // BLOCK), p - 1))

    def test_streaming_gives_the_same_text_as_a_whole_answer(self):
        body = {"prompt": "In the beginning", "max_tokens": 20, "temperature": 0}
        _, whole = post("/v1/completions", body)
        events = stream("/v1/completions", body)
        text = "".join(e["choices"][0]["text"] for e in events)
        self.assertEqual(text, whole["choices"][0]["text"])
        self.assertTrue(all(e["choices"][0]["finish_reason"] is None for e in events[:-1]))
        self.assertEqual(events[-1]["choices"][0]["finish_reason"],
                         whole["choices"][0]["finish_reason"])
        self.assertEqual(events[-1]["usage"]["completion_tokens"],
                         whole["usage"]["completion_tokens"])
        self.assertGreaterEqual(len(events), 2)

    def test_second_chat_turn_prefills_only_what_is_new(self):
        messages = [{"role": "system", "content": "Thus saith the LORD of hosts, the God of Israel"},
                    {"role": "user", "content": "And Moses went up unto God"}]
        before = metrics()
        status, t1 = post("/v1/chat/completions",
                          {"messages": messages, "temperature": 0, "max_tokens": 40})
        self.assertEqual(status, 200, t1)
        self.assertEqual(t1["object"], "chat.completion")
        answer = t1["choices"][0]["message"]
        self.assertEqual(answer["role"], "assistant")
        p1, g1 = t1["usage"]["prompt_tokens"], t1["usage"]["completion_tokens"]
        events = stream("/v1/chat/completions", {
            "messages": messages + [answer, {"role": "user", "content": "and the LORD called"}],
            "temperature": 0, "max_tokens": 8})
        self.assertEqual(events[0]["choices"][0]["delta"]["role"], "assistant")
        u2 = events[-1]["usage"]
        # Turn 1 fed its prompt and all but its last generated token: those positions' full
        # blocks are cached, and turn 2 computes only the rest.
        fed = p1 + g1 - 1
        cached = BLOCK * (fed // BLOCK)
        self.assertGreater(u2["prompt_tokens"], p1 + g1)
        self.assertEqual(u2["prompt_tokens_details"]["cached_tokens"], cached)
        self.assertEqual(u2["prefilled_tokens"], u2["prompt_tokens"] - cached)
        self.assertLess(u2["prefilled_tokens"], u2["prompt_tokens"] - p1 - g1 + BLOCK + 1)
        after = metrics()
        self.assertEqual(after["tokens_reused"] - before["tokens_reused"], cached)

    def test_concurrent_clients(self):
        n = 8
        results = [None] * n

        def client(i):
            try:
                results[i] = stream("/v1/completions", {
                    "prompt": "And the LORD spake unto Moses, saying, " + "Speak " * (i + 1),
                    "max_tokens": 24, "temperature": 0.8, "seed": i + 1})
            except Exception as e:  # reported below
                results[i] = e

        threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        alone_prompt_tokens = []
        for i in range(n):
            self.assertIsInstance(results[i], list, results[i])
            last = results[i][-1]
            self.assertIsNotNone(last["choices"][0]["finish_reason"])
            alone_prompt_tokens.append(last["usage"]["prompt_tokens"])
        # Each stream belongs to its own request: prompts of 1 .. 8 extra words.
        self.assertEqual(alone_prompt_tokens, sorted(alone_prompt_tokens))
        self.assertEqual(len(set(alone_prompt_tokens)), n)
        self.assertTrue(wait_until(lambda: metrics()["running"] == 0))

    def test_disconnect_mid_stream_frees_the_blocks(self):
        cancelled = metrics()["requests_cancelled"]
        sock = socket.create_connection(("127.0.0.1", SERVER.port), timeout=TIMEOUT)
        body = json.dumps({"prompt": "And it came to pass", "max_tokens": 450, "stream": True,
                           "temperature": 1.0}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: " + str(len(body)).encode() +
                     b"\r\n\r\n" + body)
        got = b""
        while got.count(b"data: ") < 3:
            chunk = sock.recv(4096)
            self.assertTrue(chunk, "the server closed the stream early")
            got += chunk
        self.assertTrue(wait_until(lambda: metrics()["blocks_held"] > 0, 5))
        sock.close()
        self.assertTrue(wait_until(lambda: metrics()["requests_cancelled"] == cancelled + 1),
                        metrics())
        m = metrics()
        self.assertEqual(m["running"], 0)
        self.assertEqual(m["blocks_held"], 0)

    def test_a_stop_string_ends_the_text_and_counts_as_finished_not_cancelled(self):
        body = {"prompt": "And it came to pass", "max_tokens": 40, "temperature": 0}
        status, whole = post("/v1/completions", body)
        self.assertEqual(status, 200, whole)
        text = whole["choices"][0]["text"]
        self.assertIn("e", text)
        self.assertTrue(wait_until(lambda: metrics()["running"] == 0))
        before = metrics()
        status, cut = post("/v1/completions", dict(body, stop="e"))
        self.assertEqual(status, 200, cut)
        self.assertEqual(cut["choices"][0]["text"], text[:text.index("e")])
        self.assertEqual(cut["choices"][0]["finish_reason"], "stop")
        self.assertTrue(wait_until(lambda: metrics()["running"] == 0))
        after = metrics()
        self.assertEqual(after["requests_finished"], before["requests_finished"] + 1)
        self.assertEqual(after["requests_cancelled"], before["requests_cancelled"])

    def test_malformed_requests_get_400_with_a_message(self):
        cases = [
            (b'{"prompt": ', "the body is not valid JSON"),
            (b'[1, 2]', "the body must be a JSON object"),
            (b'{"max_tokens": 4}', "the request needs a string 'prompt'"),
            (b'{"prompt": "a", "max_tokens": "many"}', "'max_tokens' must be an integer"),
            (b'{"prompt": "a", "max_tokens": 0}', "'max_tokens' must be an integer in [1, "),
            (b'{"prompt": "a", "max_tokens": 4.5}', "'max_tokens' must be an integer in [1, "),
            (b'{"prompt": "a", "top_k": -1}', "'top_k' must be an integer in [0, "),
            (b'{"prompt": "a", "min_p": 2}', "'min_p' must be in [0, 1]"),
            (b'{"prompt": "a", "repeat_penalty": 0}', "'repeat_penalty' must be in (0, 100]"),
            (b'{"prompt": "a", "seed": 9007199254740993}',
             "'seed' must be an integer in [-9007199254740992, 9007199254740992], got"),
            (b'{"prompt": "a", "seed": -9007199254740993}', "'seed' must be an integer in [-"),
            (b'{"prompt": "a", "seed": 1.5}', "'seed' must be an integer in [-"),
            (b'{"prompt": "a", "seed": "7"}', "'seed' must be an integer in [-"),
            (b'{"prompt": "a", "model": 3}', "'model' must be a string"),
            (b'{"prompt": "a", "stream_options": {"x": 1}}', "'stream_options' must be"),
            (b'{"prompt": "a", "temperature": -1}', "'temperature' must be in [0, 100]"),
            (b'{"prompt": "a", "stream": "yes"}', "'stream' must be true or false"),
            (b'{"prompt": "a", "stop": [1]}', "'stop' must be a string or up to 4 strings"),
            (b'{"prompt": "a", "n": 2}', "only 'n': 1 is supported"),
            (b'{"prompt": "a", "max_tokens": 600}', "exceed the context of 512 positions"),
        ]
        for raw, message in cases:
            status, body = request("POST", "/v1/completions", raw=raw)
            self.assertEqual(status, 400, raw)
            self.assertIn(message, body["error"]["message"], raw)
        chat_cases = [
            (b'{"messages": []}', "'messages' must be a non-empty array"),
            (b'{"messages": [{"role": "judge", "content": "x"}]}', "must be system, user"),
            (b'{"messages": [{"role": "user"}]}', "a message needs a string 'content'"),
            (b'{}', "the request needs 'messages'"),
            (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, '
             b'"max_completion_tokens": 5}', "'max_tokens' 4 and 'max_completion_tokens' 5 differ"),
        ]
        for raw, message in chat_cases:
            status, body = request("POST", "/v1/chat/completions", raw=raw)
            self.assertEqual(status, 400, raw)
            self.assertIn(message, body["error"]["message"], raw)
        status, body = request("POST", "/v1/completions",
                               raw=json.dumps({"prompt": "a" * MAX_BODY}).encode())
        self.assertEqual(status, 413)
        status, body = request("GET", "/v2/nothing")
        self.assertEqual(status, 404)
        self.assertEqual(request("GET", "/health")[0], 200)

    def test_models_lists_the_served_model(self):
        name = metrics()["model"]
        status, models = request("GET", "/v1/models")
        self.assertEqual(status, 200)
        self.assertEqual(models["object"], "list")
        self.assertEqual([m["id"] for m in models["data"]], [name])
        self.assertEqual(models["data"][0]["object"], "model")
        self.assertEqual(request("GET", "/v1/models/" + name), (200, models["data"][0]))
        status, body = request("GET", "/v1/models/gpt-4")
        self.assertEqual(status, 404)
        self.assertIn("no model 'gpt-4': this server serves '%s'" % name, body["error"]["message"])

    def test_every_field_is_honoured_or_refused(self):
        """A field the server does not implement is refused (400 naming it), or accepted only at
        the value that leaves it off; such values, "model", "user" and "stream_options" change
        nothing in the answer."""
        base = {"prompt": "And Abraham rose up early", "max_tokens": 10, "temperature": 0}
        _, plain = post("/v1/completions", base)
        off = dict(base, model="gpt-3.5-turbo-instruct", user="u1", n=1, best_of=1, echo=False,
                   suffix="", logprobs=None, presence_penalty=0, frequency_penalty=0.0,
                   logit_bias={}, stream_options={"include_usage": True}, stop=None)
        status, same = post("/v1/completions", off)
        self.assertEqual(status, 200, same)
        self.assertEqual(same["choices"][0]["text"], plain["choices"][0]["text"])
        refused = [({"frequency_penalty": 0.5}, "'frequency_penalty' is not supported: only 0 is"
                    " accepted, got 0.5 (this server's penalty is 'repeat_penalty')"),
                   ({"logprobs": 2}, "'logprobs' is not supported: only false"),
                   ({"echo": True}, "'echo' is not supported"),
                   ({"best_of": 3}, "'best_of' is not supported"),
                   ({"logit_bias": {"50": 100}}, "'logit_bias' is not supported"),
                   ({"suffix": "x"}, "'suffix' is not supported"),
                   ({"top_logprobs": 2}, "unknown field 'top_logprobs'"),  # chat only
                   ({"messages": []}, "unknown field 'messages'"),
                   ({"temprature": 0.5}, "unknown field 'temprature' (completions read prompt,")]
        for extra, message in refused:
            status, body = post("/v1/completions", dict(base, **extra))
            self.assertEqual(status, 400, extra)
            self.assertIn(message, body["error"]["message"], extra)
        chat = {"messages": [{"role": "user", "content": "And Moses said"}], "temperature": 0,
                "max_completion_tokens": 6}
        _, plain = post("/v1/chat/completions", chat)
        self.assertEqual(plain["usage"]["completion_tokens"], 6)
        off = dict(chat, max_tokens=6, tools=[], tool_choice="none", parallel_tool_calls=False,
                   response_format={"type": "text"}, logprobs=False, top_logprobs=0,
                   presence_penalty=0)
        status, same = post("/v1/chat/completions", off)
        self.assertEqual(status, 200, same)
        self.assertEqual(same["choices"][0]["message"], plain["choices"][0]["message"])
        for extra, message in [({"tools": [{"type": "function"}]}, "'tools' is not supported"),
                               ({"response_format": {"type": "json_object"}},
                                "'response_format' is not supported"),
                               ({"logprobs": True}, "'logprobs' is not supported"),
                               ({"echo": False}, "unknown field 'echo'")]:  # completions only
            status, body = post("/v1/chat/completions", dict(chat, **extra))
            self.assertEqual(status, 400, extra)
            self.assertIn(message, body["error"]["message"], extra)

    def test_top_k_1_and_min_p_1_sample_the_most_likely_token(self):
        # Whatever the temperature and the seed, keeping the most likely token alone is argmax.
        base = {"prompt": "And the LORD spake unto Moses", "max_tokens": 16}
        _, greedy = post("/v1/completions", dict(base, temperature=0))
        for extra in ({"top_k": 1}, {"min_p": 1}):
            status, answer = post("/v1/completions", dict(base, temperature=1.5, seed=5, **extra))
            self.assertEqual(status, 200, answer)
            self.assertEqual(answer["choices"][0]["text"], greedy["choices"][0]["text"], extra)
        _, free = post("/v1/completions", dict(base, temperature=1.5, seed=5))
        self.assertNotEqual(free["choices"][0]["text"], greedy["choices"][0]["text"])

    def test_a_request_without_a_seed_draws_its_own(self):
        body = {"prompt": "And it came to pass", "max_tokens": 12, "temperature": 1.0}
        answers = [post("/v1/completions", body)[1] for _ in range(3)]
        seeds = [a["usage"]["seed"] for a in answers]
        self.assertEqual(len(set(seeds)), 3, seeds)
        for a in answers:
            self.assertTrue(1 <= a["usage"]["seed"] <= 2 ** 53)
            _, again = post("/v1/completions", dict(body, seed=a["usage"]["seed"]))
            self.assertEqual(again["usage"]["seed"], a["usage"]["seed"])
            self.assertEqual(again["choices"][0]["text"], a["choices"][0]["text"])

    def test_curl(self):
        url = "http://127.0.0.1:%d" % SERVER.port
        out = subprocess.run(
            ["curl", "-sS", "-N", "--max-time", "30", url + "/v1/completions", "-d",
             '{"prompt": "And God said", "max_tokens": 6, "stream": true, "temperature": 0}'],
            capture_output=True, text=True, timeout=40)
        self.assertEqual(out.returncode, 0, out.stderr)
        lines = [l for l in out.stdout.split("\n") if l]
        self.assertEqual(lines[-1], "data: [DONE]")
        self.assertEqual(json.loads(lines[-2][6:])["usage"]["completion_tokens"], 6)
        out = subprocess.run(
            ["curl", "-sS", "--max-time", "30", "-o", "/dev/null", "-w", "%{http_code}",
             url + "/v1/chat/completions", "-d", "{not json"],
            capture_output=True, text=True, timeout=40)
        self.assertEqual(out.stdout, "400")


class EarlySignalTest(unittest.TestCase):
    def test_sigterm_before_the_server_listens_still_stops_it(self):
        # A signal taken before listening began used to be lost (stop() of a server not yet
        # running does nothing) and the server listened on.
        for delay in (0.02, 0.05, 0.1):
            proc = subprocess.Popen([BINARY, "--port", "0"], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            time.sleep(delay)
            proc.terminate()
            try:
                code = proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                code = "still running 10 s after SIGTERM"
            # -15: the signal came before main() blocked it (the default action).
            self.assertIn(code, (0, -15), "SIGTERM after %.2f s" % delay)


def block_file_bytes():
    """Bytes of one block file of the bundled model at BLOCK positions (docs/FORMATS.md §4): a
    192-byte header, BLOCK int32 tokens, keys and values [n_layers][n_kv_heads][BLOCK][head_size]
    of f32. The shape is read from the checkpoint's header."""
    model = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models", "kjv_tiny.bin")
    with open(model, "rb") as f:
        dim, _, n_layers, n_heads, n_kv_heads, _, _ = struct.unpack("<7i", f.read(28))
    return 192 + 4 * BLOCK + 2 * n_layers * n_kv_heads * BLOCK * (dim // n_heads) * 4


class PrefixDirTest(unittest.TestCase):
    """Servers of their own on a fresh --prefix-dir, stopped with SIGTERM between requests."""

    PROMPT = ("And it came to pass after these things, that God did tempt Abraham, and said "
              "unto him, Abraham: and he said, Behold, here I am.")

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="kvdecode_server_prefix_")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def block_files(self):
        return sorted(f for f in os.listdir(self.dir) if f.endswith(".kvblock"))

    def serve_once(self, body):
        """One request on a new server on self.dir, then SIGTERM: (response, metrics, rest of
        stdout)."""
        server = Server(BINARY, ["--prefix-dir", self.dir])
        try:
            status, answer = post("/v1/completions", body, server=server)
            self.assertEqual(status, 200, answer)
            m = metrics(server)
        finally:
            code = server.stop()
        self.assertEqual(code, 0)
        return answer, m, server.rest

    def test_restarted_server_loads_the_prompt_from_disk(self):
        body = {"prompt": self.PROMPT, "max_tokens": 8, "temperature": 0}
        first, m1, tail = self.serve_once(body)
        u1 = first["usage"]
        p, g = u1["prompt_tokens"], u1["completion_tokens"]
        self.assertGreaterEqual(p, 2 * BLOCK)
        self.assertEqual(u1["prompt_tokens_details"]["cached_tokens"], 0)
        self.assertEqual(m1["prefix_tier"]["files_on_disk"], 0)
        # The clean shutdown wrote every full block the request fed: its prompt and all but its
        # last generated token.
        files = (p + g - 1) // BLOCK
        self.assertEqual(len(self.block_files()), files)
        self.assertIn("%d block files written" % files, tail)
        self.assertTrue(all(os.path.getsize(os.path.join(self.dir, f)) == block_file_bytes()
                            for f in self.block_files()))

        second, m2, _ = self.serve_once(body)
        u2 = second["usage"]
        cached = min(BLOCK * (p // BLOCK), p - 1)  # the last prompt token is always computed
        self.assertEqual(u2["prompt_tokens_details"]["cached_tokens"], cached)
        self.assertEqual(u2["prompt_tokens_details"]["cached_from_disk_tokens"], cached)
        self.assertEqual(u2["prefilled_tokens"], p - cached)
        self.assertEqual(second["choices"][0]["text"], first["choices"][0]["text"])
        self.assertEqual(m2["prefix_block_hits"], 0)
        self.assertEqual(m2["prefix_block_disk_hits"], p // BLOCK)
        self.assertEqual(m2["tokens_from_disk"], cached)
        self.assertEqual(m2["prefix_tier"]["files_skipped"], 0)

    def test_a_corrupt_block_file_is_skipped_and_counted(self):
        body = {"prompt": self.PROMPT, "max_tokens": 4, "temperature": 0}
        first, _, _ = self.serve_once(body)
        for name in self.block_files():  # one payload byte of every file flipped
            path = os.path.join(self.dir, name)
            with open(path, "r+b") as f:
                f.seek(-5, os.SEEK_END)
                b = f.read(1)
                f.seek(-5, os.SEEK_END)
                f.write(bytes([b[0] ^ 0x40]))
        second, m, _ = self.serve_once(body)
        self.assertEqual(second["usage"]["prompt_tokens_details"]["cached_tokens"], 0)
        self.assertEqual(second["choices"][0]["text"], first["choices"][0]["text"])
        # The first block is asked for, found corrupt, and the match ends there.
        self.assertEqual(m["prefix_tier"]["skipped"]["corrupt"], 1)
        self.assertEqual(m["prefix_tier"]["files_skipped"], 1)
        self.assertEqual(m["prefix_block_disk_hits"], 0)

    def test_bad_prefix_flags_exit_2_with_one_line(self):
        a_file = os.path.join(self.dir, "a_file")
        open(a_file, "w").close()
        fb = block_file_bytes()
        cases = [
            (["--prefix-dir", self.dir, "--prefix-max-bytes", str(fb - 1)],
             "--prefix-max-bytes: %d is smaller than one block file of this model (%d bytes at "
             "--block-size %d)" % (fb - 1, fb, BLOCK)),
            (["--prefix-dir", self.dir, "--prefix-max-bytes", "0"],
             "--prefix-max-bytes: expects an integer in [1, "),
            (["--prefix-max-bytes", "100000"], "--prefix-max-bytes needs --prefix-dir"),
            (["--prefix-dir", os.path.join(a_file, "sub")],
             "--prefix-dir: PrefixTier: directory '%s' cannot be created" %
             os.path.join(a_file, "sub")),
            (["--prefix-dir", self.dir, "--no-prefix-cache"],
             "--prefix-dir needs the prefix cache"),
        ]
        for args, message in cases:
            out = subprocess.run([BINARY, "--port", "0", "--block-size", str(BLOCK)] + args,
                                 capture_output=True, text=True, timeout=TIMEOUT)
            self.assertEqual(out.returncode, 2, (args, out.stderr))
            self.assertEqual(out.stdout, "", args)
            lines = out.stderr.split("\n")
            self.assertEqual(len(lines), 2, (args, out.stderr))  # one line and its newline
            self.assertTrue(lines[0].startswith("server: " + message), (args, out.stderr))
            self.assertTrue(lines[0].endswith("(see server --help)"), (args, out.stderr))
        self.assertEqual(self.block_files(), [])


@unittest.skipIf(GPT2_MODEL is None and "--gpt2-model" not in sys.argv,
                 "no --gpt2-model (ctest runs it as server_http_gpt2_vocabulary)")
class Gpt2VocabularyTest(unittest.TestCase):
    """A GGUF llama model with GPT-2's byte-level BPE vocabulary (random weights, 50 257 tokens):
    prompts and chat messages go through BPE, no BOS before them (llama.cpp's default for gpt2),
    and a llama2.c tokenizer.bin cannot replace the vocabulary."""

    PROMPT = "Hello world, it's 2024!"

    @classmethod
    def setUpClass(cls):
        cls.server = Server(BINARY, ["-m", GPT2_MODEL])

    @classmethod
    def tearDownClass(cls):
        assert cls.server.stop() == 0

    def test_completion_of_a_bpe_prompt(self):
        body = {"prompt": self.PROMPT, "max_tokens": 8, "temperature": 0}
        status, answer = post("/v1/completions", body, server=self.server)
        self.assertEqual(status, 200, answer)
        # GPT-2's regex splits the prompt into 7 words (Hello, " world", ",", " it", "'s",
        # " 2024", "!"), each one token of its vocabulary; a BOS would make 8.
        self.assertEqual(answer["usage"]["prompt_tokens"], 7)
        g = answer["usage"]["completion_tokens"]
        self.assertTrue(1 <= g <= 8, answer)
        text = answer["choices"][0]["text"]
        self.assertNotEqual(text, "")
        streamed = stream("/v1/completions", body, server=self.server)
        self.assertEqual("".join(e["choices"][0]["text"] for e in streamed), text)

    def test_chat_template_with_bpe_tokens(self):
        body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4,
                "temperature": 0}
        status, answer = post("/v1/chat/completions", body, server=self.server)
        self.assertEqual(status, 200, answer)
        # "Hello" (15496) and the newline token (198) that ends a message; no BOS.
        self.assertEqual(answer["usage"]["prompt_tokens"], 2)
        self.assertEqual(answer["choices"][0]["message"]["role"], "assistant")

    def test_a_tokenizer_bin_is_refused(self):
        out = subprocess.run([BINARY, "--port", "0", "-m", GPT2_MODEL, "--tokenizer", "t.bin"],
                             capture_output=True, text=True, timeout=TIMEOUT)
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertTrue(out.stderr.startswith(
            "server: --tokenizer 't.bin' is a llama2.c tokenizer.bin, but '%s' has a gpt2 "
            "(byte-level BPE) vocabulary of its own; drop --tokenizer" % GPT2_MODEL), out.stderr)


@unittest.skipIf(GGUF_MODEL is None and "--gguf-model" not in sys.argv,
                 "no --gguf-model (ctest runs it as server_http_weight_formats)")
class WeightFormatsTest(unittest.TestCase):
    """The bundled model's q4_0 GGUF file served as stored (q4_0) and converted on load (q8_0,
    bf16, f32): the listening line and /metrics name the format, and a greedy completion is the
    text the generator writes alone with the same file and --weights (another program, no
    engine)."""

    PROMPT = "And it came to pass"
    TOKENS = 24

    def expect_generator_text(self, weights, named):
        server = Server(BINARY, ["-m", GGUF_MODEL] + (["--weights", weights] if weights else []))
        try:
            self.assertIn(", weights %s," % named, server.first_line)
            self.assertEqual(metrics(server)["weights"], named)
            body = {"prompt": self.PROMPT, "max_tokens": self.TOKENS, "temperature": 0}
            status, answer = post("/v1/completions", body, server=server)
        finally:
            self.assertEqual(server.stop(), 0)
        self.assertEqual(status, 200, answer)
        self.assertEqual(answer["usage"]["completion_tokens"], self.TOKENS)
        alone = subprocess.run(
            [GENERATE, "-m", GGUF_MODEL, "--weights", weights or "stored", "-p", self.PROMPT,
             "-n", str(self.TOKENS), "--temperature", "0"],
            capture_output=True, text=True, timeout=TIMEOUT)
        self.assertEqual(alone.returncode, 0, alone.stderr)
        self.assertEqual(self.PROMPT + answer["choices"][0]["text"], alone.stdout.rstrip("\n"))

    def test_stored_q4_0(self):
        self.expect_generator_text(None, "q4_0")

    def test_converted_on_load(self):
        for weights in ("q8_0", "bf16", "f32"):
            with self.subTest(weights=weights):
                self.expect_generator_text(weights, weights)


class SamplingTest(unittest.TestCase):
    """A sampled completion with every sampling field set is the text the generator writes alone
    with the same flags and seed (another program, no engine)."""

    def test_sampling_fields_as_the_generator_reads_them(self):
        if GENERATE is None:
            self.skipTest("needs --generate")
        prompt = "And it came to pass"
        fields = {"temperature": 0.9, "top_p": 0.95, "top_k": 8, "min_p": 0.05,
                  "repeat_penalty": 1.3, "repeat_last_n": 32, "seed": 11}
        status, answer = post("/v1/completions", dict(fields, prompt=prompt, max_tokens=40))
        self.assertEqual(status, 200, answer)
        flags = []
        for name, value in fields.items():
            flags += ["--" + name.replace("_", "-"), str(value)]
        alone = subprocess.run([GENERATE, "-p", prompt, "-n", "40"] + flags,
                               capture_output=True, text=True, timeout=TIMEOUT)
        self.assertEqual(alone.returncode, 0, alone.stderr)
        self.assertEqual(prompt + answer["choices"][0]["text"], alone.stdout.rstrip("\n"))
        # Each field is read: the same request without it (its default instead) says otherwise.
        for name in fields:
            rest = {k: v for k, v in fields.items() if k != name}
            if name == "seed":
                rest["seed"] = 12
            _, other = post("/v1/completions", dict(rest, prompt=prompt, max_tokens=40))
            self.assertNotEqual(other["choices"][0]["text"], answer["choices"][0]["text"], name)

    def test_any_integer_seed(self):
        """OpenAI takes any integer as a seed. A positive one is the generator's --seed; 0 and a
        negative seed s sample as --seed 2^53 + 1 - s, states no positive seed reaches."""
        if GENERATE is None:
            self.skipTest("needs --generate")
        prompt = "And it came to pass"
        texts = {}
        for seed, state in ((0, 2 ** 53 + 1), (-5, 2 ** 53 + 6), (-(2 ** 53), 2 ** 54 + 1),
                            (2 ** 53, 2 ** 53)):
            status, answer = post("/v1/completions", {"prompt": prompt, "max_tokens": 24,
                                                      "temperature": 1.0, "seed": seed})
            self.assertEqual(status, 200, answer)
            self.assertEqual(answer["usage"]["seed"], seed)
            alone = subprocess.run([GENERATE, "-p", prompt, "-n", "24", "--temperature", "1", "--top-p", "1",
                                    "--seed", str(state)],
                                   capture_output=True, text=True, timeout=TIMEOUT)
            self.assertEqual(alone.returncode, 0, alone.stderr)
            self.assertEqual(prompt + answer["choices"][0]["text"], alone.stdout.rstrip("\n"),
                             seed)
            texts[seed] = answer["choices"][0]["text"]
        self.assertEqual(len(set(texts.values())), len(texts), texts)


if __name__ == "__main__":
    BINARY = sys.argv.pop(1)
    for flag in ("--gpt2-model", "--gguf-model", "--generate"):
        if flag in sys.argv:
            i = sys.argv.index(flag)
            globals()[flag[2:].replace("-", "_").upper()] = sys.argv[i + 1]
            del sys.argv[i:i + 2]
    SERVER = Server(BINARY)
    try:
        result = unittest.main(exit=False, verbosity=2).result
    finally:
        code = SERVER.stop()
    ok = result.wasSuccessful() and code == 0
    if code != 0:
        print("server exit code after SIGTERM: %r" % code, file=sys.stderr)
    sys.exit(0 if ok else 1)
