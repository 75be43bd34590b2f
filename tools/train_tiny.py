#!/usr/bin/python3
"""Trains kvdecode's shipped demo model: a small Llama-architecture transformer on the King James
Bible, exported in llama2.c's v0 checkpoint and tokenizer.bin formats, plus PyTorch oracle logits.

    apt-get install -y python3-torch bible-kjv libopenblas0-pthread  # Debian 12
    nice -n 19 /usr/bin/python3 tools/train_tiny.py            # about 1.5-2 h on 2 shared cores
    nice -n 19 /usr/bin/python3 tools/train_tiny.py --resume   # continue a stopped run

That one command (fixed seeds, 2 threads) writes
  models/kjv_tiny.bin           llama2.c v0 checkpoint (shared classifier, f32)
  models/tokenizer.bin          llama2.c tokenizer.bin (a BPE of 4096 pieces trained here)
  models/train_log.txt          loss curve, validation loss, samples (rewritten as it goes)
  tests/data/oracle/            PyTorch logits of fixed prompts for tests/oracle_test.cpp
and keeps its training state in build/train_tiny.ckpt every --eval-every steps, from which
--resume continues (with the same other arguments) and --export-only writes the model files.
tools/plot_training.py draws the loss curve from the log.

Text: the KJV (1611; public domain) as printed by Debian's bible-kjv program from the
bible-kjv-text package, one verse a line (verse numbers and chapter headings dropped), one
chapter a document (BOS before each). Every 40th chapter is held out for validation; its loss
is also given per character (the chapters' characters, a newline between verses and one per
BOS), which does not depend on the vocabulary.

The model code here is written from docs/FORMATS.md §2 (llama2.c model.py / run.c math):
RMSNorm (eps 1e-5), RoPE on adjacent pairs (theta 10000), SwiGLU, GQA with query head h using kv
head h // kv_mul, shared embedding/classifier. Training runs the matrix products in bfloat16
(torch.autocast; the weights, the optimizer and the loss stay f32); the exported weights are
f32, and the oracle runs them in float64 with full-sequence causal attention (no KV cache), so
it shares no code with the C++ library.
"""

import argparse
import heapq
import json
import math
import os
import re
import struct
import subprocess
import sys
import time
from collections import Counter

# Debian's torch uses whatever libblas.so.3 the alternatives system selects; the reference BLAS
# is ~20x slower than OpenBLAS. If libopenblas0-pthread is installed, use it for this process
# only (re-exec with LD_LIBRARY_PATH), whatever the system-wide choice.
_OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread"
if os.path.isdir(_OPENBLAS) and os.environ.get("KVDECODE_TRAIN_REEXEC") != "1":
    # OMP_WAIT_POLICY=PASSIVE: on cores shared with other work (nice -n 19), OpenMP threads that
    # spin at every barrier waiting for a descheduled peer made steps 4-8x slower.
    env = dict(os.environ, KVDECODE_TRAIN_REEXEC="1", OPENBLAS_NUM_THREADS="2",
               OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
               LD_LIBRARY_PATH=_OPENBLAS + ":" + os.environ.get("LD_LIBRARY_PATH", ""))
    os.execve(sys.executable, [sys.executable] + sys.argv, env)

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --------------------------------------------------------------------------------------------
# Configuration (llama2.c names)

CONFIG = dict(dim=192, hidden_dim=512, n_layers=4, n_heads=6, n_kv_heads=2, vocab_size=4096,
              seq_len=512)
# Training: STEPS steps of BATCH_SIZE x SHORT_LEN tokens, then from LONG_FROM * STEPS on, of
# BATCH_SIZE / 2 x seq_len (the same tokens a step): the short windows are cheaper (attention
# grows with the window), the long ones teach the positions up to seq_len.
STEPS, BATCH_SIZE, SHORT_LEN, LONG_FROM, LR, EVAL_EVERY = 2000, 16, 256, 0.9, 3e-3, 200
SEED = 1234
BOS, EOS = 1, 2
BYTE_OFFSET = 3  # run.c: byte fallback id = byte + 3
ORACLE_PROMPTS = ["In the beginning", "And the LORD said unto Moses,", "Blessed are the",
                  "Once upon a time"]
ORACLE_NEW_TOKENS = 32


# --------------------------------------------------------------------------------------------
# Text: the KJV via Debian's `bible` program

def package_version(pkg):
    out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", pkg], capture_output=True,
                         text=True)
    return out.stdout.strip() if out.returncode == 0 else "not installed"


def load_chapters():
    """[(heading, [verse, ...])] in canonical order, from `bible Genesis1:1-Revelation22:21`."""
    try:
        text = subprocess.run(["bible", "Genesis1:1-Revelation22:21"], capture_output=True,
                              text=True, check=True, env=dict(os.environ, COLUMNS="80")).stdout
    except FileNotFoundError:
        sys.exit("train_tiny.py: the `bible` program is missing: apt-get install -y bible-kjv")
    chapters = []
    prev_blank = True
    for line in text.split("\n"):
        if not line.strip():
            prev_blank = True
            continue
        m = re.match(r"^  (\d+) (.*)$", line)
        if m:
            chapters[-1][1].append(m.group(2).strip())
        elif prev_blank:
            chapters.append((line.strip(), []))
        else:  # a wrapped verse continues
            chapters[-1][1][-1] += " " + line.strip()
        prev_blank = False
    return chapters


# --------------------------------------------------------------------------------------------
# Tokenizer: BPE trained on the text, encoded exactly as run.c's encode() does

def train_bpe(texts, vocab_size):
    """Pieces (id = index) and scores in llama2.c's layout: <unk>, BOS, EOS, 256 byte tokens, the
    characters of the text, then merges, each scored -rank (run.c prefers the higher score).
    Merges are learned inside pre-tokens (an optional leading space + letters, digits, or one
    other character), like sentencepiece's word pieces; encoding is run.c's own algorithm."""
    pieces = ["<unk>", "\n<s>\n", "\n</s>\n"] + ["<0x%02X>" % b for b in range(256)]
    scores = [0.0] * len(pieces)
    chars = Counter()
    words = Counter()
    for t in texts:
        t = " " + t  # run.c's dummy prefix
        chars.update(t)
        words.update(re.findall(r" ?[A-Za-z]+| ?[0-9]+|.", t, flags=re.S))
    for i, (c, _) in enumerate(sorted(chars.items(), key=lambda kv: (-kv[1], kv[0]))):
        pieces.append(c)
        scores.append(-1e6 - i)  # never a merge result, so the value only orders them
    assert " " in pieces
    # Word-level BPE: each distinct pre-token as a list of symbols, weighted by its count. Pair
    # counts are kept up to date incrementally (only the words holding the merged pair change),
    # and a heap with lazy deletion finds the most frequent pair; ties go to the smaller pair
    # text, so the result does not depend on hashing.
    vocab_words = [(list(w), n) for w, n in sorted(words.items()) if len(w) > 1]
    pair_count = Counter()
    where = {}
    for wi, (syms, n) in enumerate(vocab_words):
        for pr in zip(syms, syms[1:]):
            pair_count[pr] += n
            where.setdefault(pr, set()).add(wi)
    heap = [(-c, pr) for pr, c in pair_count.items()]
    heapq.heapify(heap)
    known = set(pieces)
    rank = 0
    while len(pieces) < vocab_size and heap:
        negc, (a, b) = heapq.heappop(heap)
        if pair_count.get((a, b), 0) != -negc or negc == 0:
            continue  # stale entry
        merged = a + b
        changed = set()
        for wi in sorted(where.pop((a, b), ())):
            syms, n = vocab_words[wi]
            for pr in zip(syms, syms[1:]):
                pair_count[pr] -= n
                changed.add(pr)
            i = 0
            while i < len(syms) - 1:
                if syms[i] == a and syms[i + 1] == b:
                    syms[i:i + 2] = [merged]
                i += 1
            for pr in zip(syms, syms[1:]):
                pair_count[pr] += n
                changed.add(pr)
                where.setdefault(pr, set()).add(wi)
        for pr in changed:
            c = pair_count[pr]
            if c > 0:
                heapq.heappush(heap, (-c, pr))
            else:
                del pair_count[pr]
        if merged not in known:
            known.add(merged)
            pieces.append(merged)
            scores.append(-float(rank))
            rank += 1
    return pieces, scores


class RunCTokenizer:
    """run.c encode()/decode(), as restated in docs/FORMATS.md section 3. The merge loop
    uses a heap instead of run.c's repeated scans; it makes the same choices: the pair whose
    merged piece scores highest, the leftmost on ties (heap key (-score, left token's position))."""

    def __init__(self, pieces, scores):
        self.pieces, self.scores = pieces, scores
        self.ids = {}
        for i, p in enumerate(pieces):
            self.ids.setdefault(p.encode("utf-8"), i)
        self.bytes = [p.encode("utf-8") for p in pieces]

    def encode(self, text, bos=True, eos=False):
        data = text.encode("utf-8")
        toks = [BOS] if bos else []
        if data:
            toks.append(self.ids[b" "])
        i = 0
        while i < len(data):
            j = i + 1
            while j < len(data) and j - i < 4 and (data[j] & 0xC0) == 0x80:
                j += 1
            cp = data[i:j]
            if cp in self.ids:
                toks.append(self.ids[cp])
            else:
                toks.extend(b + BYTE_OFFSET for b in cp)
            i = j
        start = 1 if bos else 0
        toks[start:] = self._merge(toks[start:])
        if eos:
            toks.append(EOS)
        return toks

    def _merge(self, toks):
        # run.c merges over the whole list, BOS included; BOS's piece "\n<s>\n" + anything is
        # never a piece here, so merging after it is the same.
        n = len(toks)
        tok = list(toks)
        nxt = list(range(1, n + 1))
        prv = list(range(-1, n - 1))
        alive = [True] * n
        heap = []

        def push(i):
            j = nxt[i]
            if j < n:
                m = self.ids.get(self.bytes[tok[i]] + self.bytes[tok[j]])
                if m is not None:
                    heapq.heappush(heap, (-self.scores[m], i, tok[i], tok[j], m))

        for i in range(n - 1):
            push(i)
        while heap:
            _, i, ti, tj, m = heapq.heappop(heap)
            j = nxt[i] if alive[i] else n
            if j >= n or tok[i] != ti or tok[j] != tj:
                continue  # stale entry
            tok[i] = m
            alive[j] = False
            nxt[i] = nxt[j]
            if nxt[j] < n:
                prv[nxt[j]] = i
            if prv[i] >= 0:
                push(prv[i])
            push(i)
        return [tok[i] for i in range(n) if alive[i]]

    def encode_reference(self, text, bos=True):
        """run.c's quadratic loop, literally; used to check encode() on some texts."""
        data = text.encode("utf-8")
        toks = [BOS] if bos else []
        if data:
            toks.append(self.ids[b" "])
        i = 0
        while i < len(data):
            j = i + 1
            while j < len(data) and j - i < 4 and (data[j] & 0xC0) == 0x80:
                j += 1
            cp = data[i:j]
            toks.extend([self.ids[cp]] if cp in self.ids else [b + BYTE_OFFSET for b in cp])
            i = j
        while True:
            best, best_id, best_i = -1e10, -1, -1
            for k in range(len(toks) - 1):
                m = self.ids.get(self.bytes[toks[k]] + self.bytes[toks[k + 1]])
                if m is not None and self.scores[m] > best:
                    best, best_id, best_i = self.scores[m], m, k
            if best_i < 0:
                return toks
            toks[best_i:best_i + 2] = [best_id]

    def decode(self, ids):
        out = b""
        prev = BOS
        for t in ids:
            p = self.bytes[t]
            if prev == BOS and p.startswith(b" "):
                p = p[1:]
            m = re.fullmatch(rb"<0x([0-9A-F]{2})>", p)
            out += bytes([int(m.group(1), 16)]) if m else p
            prev = t
        return out.decode("utf-8", errors="replace")

    def write(self, path):
        with open(path, "wb") as f:
            f.write(struct.pack("<I", max(len(b) for b in self.bytes)))
            for b, s in zip(self.bytes, self.scores):
                f.write(struct.pack("<fi", s, len(b)))
                f.write(b)


# --------------------------------------------------------------------------------------------
# Model: llama2.c's architecture, full-sequence causal attention

class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rope_tables(head_size, seq_len, dtype):
    """cos, sin [seq_len][head_size/2]: angle pos * 10000^(-2j/head_size) (llama2.c)."""
    j = torch.arange(0, head_size, 2, dtype=torch.float64)
    freq = 1.0 / (10000.0 ** (j / head_size))
    ang = torch.outer(torch.arange(seq_len, dtype=torch.float64), freq)
    return torch.cos(ang).to(dtype), torch.sin(ang).to(dtype)


def apply_rope(x, cos, sin):
    """x [B][T][H][hs]: rotates the adjacent pairs (2j, 2j+1) of every head."""
    a, b = x[..., 0::2], x[..., 1::2]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        dim, hd = cfg["dim"], cfg["hidden_dim"]
        self.n_heads, self.n_kv_heads = cfg["n_heads"], cfg["n_kv_heads"]
        self.hs = dim // self.n_heads
        kv_dim = self.n_kv_heads * self.hs
        self.attention_norm = RMSNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_dim, bias=False)
        self.wv = nn.Linear(dim, kv_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = RMSNorm(dim)
        self.w1 = nn.Linear(dim, hd, bias=False)
        self.w2 = nn.Linear(hd, dim, bias=False)
        self.w3 = nn.Linear(dim, hd, bias=False)

    def forward(self, x, cos, sin, mask):
        B, T, _ = x.shape
        h = self.attention_norm(x)
        q = self.wq(h).view(B, T, self.n_heads, self.hs)
        k = self.wk(h).view(B, T, self.n_kv_heads, self.hs)
        v = self.wv(h).view(B, T, self.n_kv_heads, self.hs)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kv_mul = self.n_heads // self.n_kv_heads
        # Query head h reads kv head h // kv_mul (llama2.c model.py's repeat_interleave): the
        # query heads are grouped [B][kv head][kv_mul][T][hs] and K, V broadcast over the group,
        # the same products without copying K and V kv_mul times.
        q = q.view(B, T, self.n_kv_heads, kv_mul, self.hs).permute(0, 2, 3, 1, 4)
        k = k.transpose(1, 2).unsqueeze(2)  # [B][kv head][1][T][hs]
        v = v.transpose(1, 2).unsqueeze(2)
        att = (q * (1.0 / math.sqrt(self.hs))) @ k.transpose(-2, -1) + mask[:T, :T]
        out = F.softmax(att, dim=-1) @ v  # [B][kv head][kv_mul][T][hs]
        x = x + self.wo(out.permute(0, 3, 1, 2, 4).reshape(B, T, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Transformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg["vocab_size"], cfg["dim"])
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg["n_layers"]))
        self.norm = RMSNorm(cfg["dim"])
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2 style scaled residual projections
            if name.endswith("wo.weight") or name.endswith("w2.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg["n_layers"]))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, tokens):
        T = tokens.shape[1]
        dtype = self.tok_embeddings.weight.dtype
        cos, sin = rope_tables(self.cfg["dim"] // self.cfg["n_heads"], T, dtype)
        mask = torch.full((T, T), float("-inf"), dtype=dtype).triu(1)
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x) @ self.tok_embeddings.weight.t()  # shared classifier


def export_v0(model, path):
    """llama2.c legacy v0: 7 x int32 header (vocab_size > 0: shared classifier), f32 tensors."""
    cfg = model.cfg
    hs = cfg["dim"] // cfg["n_heads"]
    with open(path, "wb") as f:
        f.write(struct.pack("<7i", cfg["dim"], cfg["hidden_dim"], cfg["n_layers"],
                            cfg["n_heads"], cfg["n_kv_heads"], cfg["vocab_size"],
                            cfg["seq_len"]))

        def put(t):
            f.write(t.detach().to(torch.float32).contiguous().numpy().astype("<f4").tobytes())

        L = model.layers
        put(model.tok_embeddings.weight)
        for name in ["attention_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w1", "w2", "w3"]:
            for layer in L:
                put(getattr(layer, name).weight)
        put(model.norm.weight)
        cos, sin = rope_tables(hs, cfg["seq_len"], torch.float32)  # legacy freq_cis block
        put(cos)
        put(sin)


def load_v0(ckpt_path, tok_path):
    """Reads back what export_v0() and RunCTokenizer.write() wrote (for --oracle-only)."""
    with open(ckpt_path, "rb") as f:
        data = f.read()
    keys = ["dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"]
    cfg = dict(zip(keys, struct.unpack("<7i", data[:28])))
    assert cfg["vocab_size"] > 0, "expected a shared classifier"
    w = torch.from_numpy(np.frombuffer(data, dtype="<f4", offset=28).astype(np.float32))
    model = Transformer(cfg)
    pos = 0

    def take(p):
        nonlocal pos
        n = p.numel()
        with torch.no_grad():
            p.copy_(w[pos:pos + n].view_as(p))
        pos += n

    take(model.tok_embeddings.weight)
    for name in ["attention_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w1", "w2", "w3"]:
        for layer in model.layers:
            take(getattr(layer, name).weight)
    take(model.norm.weight)
    assert pos + cfg["seq_len"] * (cfg["dim"] // cfg["n_heads"]) == len(w)
    pieces, scores = [], []
    with open(tok_path, "rb") as f:
        f.read(4)
        for _ in range(cfg["vocab_size"]):
            score, n = struct.unpack("<fi", f.read(8))
            pieces.append(f.read(n).decode("utf-8"))
            scores.append(score)
    return model, RunCTokenizer(pieces, scores)


# --------------------------------------------------------------------------------------------
# Training

def batches(data, batch_size, seq_len, gen):
    """Random windows of seq_len + 1 tokens from the token stream."""
    starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=gen)
    x = torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()])
    return x[:, :-1], x[:, 1:]


@torch.no_grad()
def evaluate(model, data, seq_len, max_windows=None):
    """Mean next-token loss over consecutive non-overlapping windows of the held-out stream."""
    model.eval()
    n = (len(data) - 1) // seq_len
    if max_windows:
        n = min(n, max_windows)
    total, count = 0.0, 0
    for i in range(0, n, 16):
        idx = range(i, min(n, i + 16))
        x = torch.stack([data[j * seq_len:j * seq_len + seq_len] for j in idx])
        y = torch.stack([data[j * seq_len + 1:j * seq_len + seq_len + 1] for j in idx])
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")
        total += loss.item()
        count += y.numel()
    model.train()
    return total / count


@torch.no_grad()
def greedy(model, ids, n_new):
    """Greedy continuation, re-running the full causal forward over the whole sequence each step
    (no cache). Returns (new ids, logits of the final sequence [len][vocab], min top-2 gap)."""
    seq = list(ids)
    gaps = []
    new = []
    for _ in range(n_new):
        logits = model(torch.tensor([seq]))[0, -1]
        top2 = torch.topk(logits, 2).values
        gaps.append((top2[0] - top2[1]).item())
        nxt = int(torch.argmax(logits))
        new.append(nxt)
        seq.append(nxt)
    # run.c feeds positions 0..len-2 of prompt + generated; the last generated id is never fed.
    fed = list(ids) + new[:-1]
    return new, fed, model(torch.tensor([fed]))[0], min(gaps)


@torch.no_grad()
def sample(model, tok, prompt, n_new, temperature, gen):
    seq = tok.encode(prompt)
    for _ in range(n_new):
        logits = model(torch.tensor([seq[-model.cfg["seq_len"]:]]))[0, -1].float()
        p = F.softmax(logits / temperature, dim=-1)
        nxt = int(torch.multinomial(p, 1, generator=gen))
        if nxt == BOS:
            break
        seq.append(nxt)
    return tok.decode(seq[1:])


def write_oracle(model, tok, oracle_dir, log, encode_text=None):
    """Float64 forward (the f32 weights widened exactly) for every prompt: ids, logits and the
    greedy continuation, in the simple formats tests/oracle_test.cpp reads."""
    os.makedirs(oracle_dir, exist_ok=True)
    m64 = Transformer(model.cfg)
    m64.load_state_dict(model.state_dict())
    m64 = m64.double().eval()
    meta = {"config": model.cfg, "cases": []}
    for k, prompt in enumerate(ORACLE_PROMPTS):
        ids = tok.encode(prompt, bos=True)
        assert ids == tok.encode_reference(prompt, bos=True)
        new, fed, logits, gap = greedy(m64, ids, ORACLE_NEW_TOKENS)
        # The single final forward must give the same greedy ids as the step-by-step runs.
        assert [int(i) for i in logits[len(ids) - 1:].argmax(-1)] == new
        base = os.path.join(oracle_dir, "case%d" % k)
        with open(base + ".prompt.txt", "w") as f:
            f.write(prompt)
        for suffix, v in [(".prompt_ids.txt", ids), (".input_ids.txt", fed),
                          (".generated_ids.txt", new)]:
            with open(base + suffix, "w") as f:
                f.write(" ".join(map(str, v)) + "\n")
        with open(base + ".logits.f32", "wb") as f:
            f.write(logits.numpy().astype("<f4").tobytes())
        text = tok.decode(ids[1:] + new)
        meta["cases"].append(dict(prompt=prompt, n_prompt=len(ids), n_positions=len(fed),
                                  min_top2_gap=gap, max_abs_logit=float(logits.abs().max()),
                                  greedy_text=text))
        log("oracle case%d: %r -> %r (min top-2 gap %.4f)" % (k, prompt, text, gap))
    # A longer encode check: the start of a held-out chapter (Genesis 8), the way training saw it.
    if encode_text is not None:
        ids = tok.encode(encode_text, bos=True)
        assert ids == tok.encode_reference(encode_text, bos=True)
        with open(os.path.join(oracle_dir, "encode_text.txt"), "w") as f:
            f.write(encode_text)
        with open(os.path.join(oracle_dir, "encode_ids.txt"), "w") as f:
            f.write(" ".join(map(str, ids)) + "\n")
    with open(os.path.join(oracle_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")


def lr_at(step, steps, peak):
    """Linear warmup over 2 % of the steps, then cosine from peak to peak / 10."""
    warmup = max(1, steps // 50)
    if step < warmup:
        return peak * (step + 1) / warmup
    return 0.1 * peak + 0.45 * peak * (1 + math.cos(math.pi * (step - warmup) /
                                                     max(1, steps - warmup)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    ap.add_argument("--lr", type=float, default=LR)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=EVAL_EVERY,
                    help="steps between validation losses (full held-out set) and checkpoints")
    ap.add_argument("--models-dir", default=os.path.join(ROOT, "models"))
    ap.add_argument("--oracle-dir", default=os.path.join(ROOT, "tests", "data", "oracle"))
    ap.add_argument("--checkpoint", default=os.path.join(ROOT, "build", "train_tiny.ckpt"),
                    help="training state (model, optimizer, sampler RNG, log), written every "
                         "--eval-every steps; not part of the shipped files")
    ap.add_argument("--resume", action="store_true",
                    help="continue from --checkpoint (same arguments as the stopped run)")
    ap.add_argument("--config", default=None,
                    help="JSON overriding CONFIG entries (to time other shapes with --benchmark)")
    ap.add_argument("--export-only", action="store_true",
                    help="write the model files from --checkpoint as it is (a run cut short)")
    ap.add_argument("--no-bf16", action="store_true",
                    help="train in f32 (default: bf16 autocast for the matrix products, f32 "
                         "weights, optimizer and loss)")
    ap.add_argument("--benchmark", action="store_true", help="time 6 steps and exit")
    ap.add_argument("--oracle-only", action="store_true",
                    help="rewrite the oracle files from the checkpoint in --models-dir")
    args = ap.parse_args()
    cfg = dict(CONFIG, **(json.loads(args.config) if args.config else {}))

    torch.manual_seed(SEED)
    np.random.seed(SEED)
    torch.set_num_threads(args.threads)
    os.makedirs(args.models_dir, exist_ok=True)
    log_path = os.path.join(args.models_dir, "train_log.txt")
    log_lines = []

    def log(msg):
        print(msg, flush=True)
        log_lines.append(msg)
        if not args.benchmark and not args.oracle_only:
            with open(log_path, "w") as f:  # the whole log so far, after every line
                f.write("\n".join(log_lines) + "\n")

    t0 = time.time()
    log("torch %s, bible-kjv %s, bible-kjv-text %s, %d threads" % (
        torch.__version__, package_version("bible-kjv"), package_version("bible-kjv-text"),
        args.threads))
    chapters = load_chapters()
    docs = ["\n".join(verses) for _, verses in chapters]
    log("text: %d chapters, %d verses, %d characters" % (
        len(docs), sum(len(v) for _, v in chapters), sum(map(len, docs))))
    train_docs = [d for i, d in enumerate(docs) if i % 40 != 7]
    val_docs = [d for i, d in enumerate(docs) if i % 40 == 7]
    encode_text = val_docs[0][:1500]
    if args.oracle_only:
        model, tok = load_v0(os.path.join(args.models_dir, "kjv_tiny.bin"),
                             os.path.join(args.models_dir, "tokenizer.bin"))
        write_oracle(model, tok, args.oracle_dir, log, encode_text)
        return

    pieces, scores = train_bpe(train_docs, cfg["vocab_size"])
    assert len(pieces) == cfg["vocab_size"], len(pieces)
    tok = RunCTokenizer(pieces, scores)
    for d in val_docs[:3]:  # the heap encoder against run.c's literal loop
        assert tok.encode(d[:2000]) == tok.encode_reference(d[:2000])

    def stream(ds):
        out = []
        for d in ds:
            out += tok.encode(d, bos=True)
        return torch.tensor(out, dtype=torch.long)

    train, val = stream(train_docs), stream(val_docs)
    # Characters of the held-out chapters, with one for each BOS (the chapter break it marks):
    # nats/char = val loss per token x val tokens / this.
    val_chars = sum(len(d) + 1 for d in val_docs)
    words = Counter(w for d in train_docs for w in re.findall(r"[A-Za-z]+", d))
    single = [w for w in words if (" " + w).encode() in tok.ids]
    log("tokenizer: vocab %d, train %d tokens (%.2f chars/token), val %d tokens (%d chars, "
        "%.2f chars/token); %d of %d distinct words (%.1f %% of the word occurrences) are one "
        "token after a space; %.0fs" % (
            len(pieces), len(train), sum(len(d) + 1 for d in train_docs) / len(train), len(val),
            val_chars, val_chars / len(val), len(single), len(words),
            100 * sum(words[w] for w in single) / sum(words.values()), time.time() - t0))

    def per_char(loss):
        return loss * len(val) / val_chars

    model = Transformer(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    log("model: %s, %d parameters" % (json.dumps(cfg), n_params))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(SEED)
    steps = 6 if args.benchmark else args.steps
    tokens_per_step = args.batch_size * SHORT_LEN
    log("training: %d steps of %d tokens (%d x %d, from step %d %d x %d) = %.2f epochs; "
        "AdamW lr %.1e; %s" % (
            args.steps, tokens_per_step, args.batch_size, SHORT_LEN, int(LONG_FROM * args.steps),
            args.batch_size // 2, cfg["seq_len"], args.steps * tokens_per_step / len(train),
            args.lr, "f32" if args.no_bf16 else "bf16 autocast"))
    start, elapsed = 0, 0.0
    if args.resume or args.export_only:
        state = torch.load(args.checkpoint)
        assert state["config"] == cfg and state["steps"] == args.steps, "different run"
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        start, elapsed = state["step"], state["elapsed"]
        log_lines[:] = state["log"] + log_lines[:0]
        log("resumed at step %d from %s (%.0fs of training before)" % (
            start, args.checkpoint, elapsed))

    def save_state(step):
        os.makedirs(os.path.dirname(os.path.abspath(args.checkpoint)), exist_ok=True)
        tmp = args.checkpoint + ".tmp"
        torch.save(dict(config=cfg, steps=args.steps, step=step, model=model.state_dict(),
                        opt=opt.state_dict(), gen=gen.get_state(), log=list(log_lines),
                        elapsed=elapsed + time.time() - t_train), tmp)
        os.replace(tmp, args.checkpoint)

    t_train = time.time()
    t_bench = None
    long_from = int(LONG_FROM * args.steps)
    for step in range(start, 0 if args.export_only else steps):
        if args.benchmark and step == 1:
            t_bench = time.time()  # the first step warms up allocations
        lr = lr_at(step, args.steps, args.lr)
        for g in opt.param_groups:
            g["lr"] = lr
        if step < long_from:
            x, y = batches(train, args.batch_size, min(SHORT_LEN, cfg["seq_len"]), gen)
        else:
            x, y = batches(train, args.batch_size // 2, cfg["seq_len"], gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not args.no_bf16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        done = step + 1
        if step % 10 == 0 or done == steps:
            log("step %5d/%d  lr %.2e  train loss %.4f  %.0fs" % (
                step, steps, lr, loss.item(), elapsed + time.time() - t_train))
        if not args.benchmark and (done % args.eval_every == 0 or done == steps):
            win = SHORT_LEN if done <= long_from else cfg["seq_len"]
            v = evaluate(model, val, win)
            log("step %5d  val loss %.4f nats/token, %.4f nats/char (windows of %d)  epoch %.2f"
                % (done, v, per_char(v), win, done * tokens_per_step / len(train)))
            save_state(done)
    if args.benchmark:
        dt = (time.time() - t_bench) / (steps - 1)
        log("%.2f s/step, %.0f tokens/s, %d parameters" % (dt, tokens_per_step / dt, n_params))
        return
    elapsed += time.time() - t_train

    val_loss = evaluate(model, val, cfg["seq_len"])
    train_loss = evaluate(model, train[:len(val)], cfg["seq_len"])
    log("final: val loss %.4f nats/token (perplexity %.2f), %.4f nats/char; train loss %.4f "
        "nats/token, %.4f nats/char (same number of tokens); training %.0fs" % (
            val_loss, math.exp(val_loss), per_char(val_loss), train_loss, per_char(train_loss),
            elapsed))

    ckpt = os.path.join(args.models_dir, "kjv_tiny.bin")
    tok_path = os.path.join(args.models_dir, "tokenizer.bin")
    export_v0(model, ckpt)
    tok.write(tok_path)
    log("wrote %s (%d bytes), %s (%d bytes)" % (ckpt, os.path.getsize(ckpt), tok_path,
                                               os.path.getsize(tok_path)))
    model.eval()
    sgen = torch.Generator().manual_seed(SEED)
    for prompt in ["And God said", "Once upon a time"]:
        log("sample (T=0.8) %r:\n%s" % (prompt, sample(model, tok, prompt, 120, 0.8, sgen)))
    write_oracle(model, tok, args.oracle_dir, log, encode_text)
    log("total %.0fs (this process)" % (time.time() - t0))


if __name__ == "__main__":
    main()
