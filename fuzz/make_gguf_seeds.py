#!/usr/bin/env python3
"""Writes the fuzz_gguf seed corpus (fuzz/corpus/gguf/): tiny llama2.c checkpoints, built here
with fixed pseudo-random weights, converted by tools/llama2c_to_gguf.py in each tensor type,
with and without a vocabulary; and a vocabulary-only file of a small byte-level BPE ("gpt2")
vocabulary.

  fuzz/make_gguf_seeds.py fuzz/corpus/gguf
"""
import os
import random
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
CONVERTER = os.path.join(HERE, "..", "tools", "llama2c_to_gguf.py")


def checkpoint(path, dim, hidden, n_heads, n_kv_heads, vocab, seq_len, shared=True, seed=1):
    rng = random.Random(seed)
    kv_dim = dim // n_heads * n_kv_heads
    head_size = dim // n_heads
    n = (vocab * dim + 2 * dim + 2 * dim * dim + 2 * kv_dim * dim + 3 * hidden * dim + dim)
    n += seq_len * head_size  # freq_cis (skipped by readers)
    if not shared:
        n += vocab * dim
    header = struct.pack("<7i", dim, hidden, 1, n_heads, n_kv_heads,
                         vocab if shared else -vocab, seq_len)
    with open(path, "wb") as f:
        f.write(header + struct.pack(f"<{n}f", *(rng.uniform(-1, 1) for _ in range(n))))


def tokenizer(path, vocab):
    """llama2.c's layout: <unk>, BOS, EOS, the 256 byte pieces, then ' ' and letters."""
    pieces = [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [b"<0x%02X>" % i for i in range(256)]
    pieces += [b" ", b"a", b"b", b" a", b"ab"][:vocab - len(pieces)]
    with open(path, "wb") as f:
        f.write(struct.pack("<I", max(len(p) for p in pieces)))
        for i, p in enumerate(pieces):
            f.write(struct.pack("<fi", -float(i), len(p)) + p)


def gpt2_byte_chars():
    """GPT-2's bytes_to_unicode(): printable Latin-1 bytes stand for themselves, the rest for
    U+0100.. in byte order."""
    chars, n = [], 256
    for b in range(256):
        if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or b >= 0xAE:
            chars.append(chr(b))
        else:
            chars.append(chr(n))
            n += 1
    return chars


def gpt2_vocabulary(path):
    """GGUF v3 without tensors: tokenizer.ggml.* of a byte-level BPE vocabulary (256 byte tokens,
    three merges, an end-of-text control token)."""
    def string(s):
        b = s.encode("utf-8")
        return struct.pack("<Q", len(b)) + b

    def kv(key, type_id, payload):
        return string(key) + struct.pack("<I", type_id) + payload

    tokens = gpt2_byte_chars() + ["\u0120t", "he", "\u0120the", "<|endoftext|>"]
    merges = ["\u0120 t", "h e", "\u0120t he"]
    types = [1] * (len(tokens) - 1) + [3]
    eot = len(tokens) - 1
    kvs = [
        kv("tokenizer.ggml.model", 8, string("gpt2")),
        kv("tokenizer.ggml.pre", 8, string("gpt-2")),
        kv("tokenizer.ggml.tokens", 9,
           struct.pack("<IQ", 8, len(tokens)) + b"".join(string(t) for t in tokens)),
        kv("tokenizer.ggml.token_type", 9,
           struct.pack("<IQ", 5, len(types)) + struct.pack(f"<{len(types)}i", *types)),
        kv("tokenizer.ggml.merges", 9,
           struct.pack("<IQ", 8, len(merges)) + b"".join(string(m) for m in merges)),
        kv("tokenizer.ggml.bos_token_id", 4, struct.pack("<I", eot)),
        kv("tokenizer.ggml.eos_token_id", 4, struct.pack("<I", eot)),
    ]
    with open(path, "wb") as f:
        f.write(struct.pack("<IIQQ", 0x46554747, 3, 0, len(kvs)) + b"".join(kvs))


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        small = os.path.join(tmp, "small.bin")
        checkpoint(small, 4, 6, 1, 1, 5, 3)
        unshared = os.path.join(tmp, "unshared.bin")
        checkpoint(unshared, 8, 6, 2, 1, 5, 3, shared=False)
        wide = os.path.join(tmp, "wide.bin")
        checkpoint(wide, 32, 32, 2, 1, 264, 4)
        tok = os.path.join(tmp, "tokenizer.bin")
        tokenizer(tok, 264)
        runs = [("small_f32", small, []), ("unshared_f32_align64", unshared, ["--alignment", "64"])]
        for t in ("f16", "bf16", "q8_0", "q4_0"):
            runs.append((f"vocab_{t}", wide, ["--tokenizer", tok, "--type", t]))
        for name, ckpt, args in runs:
            subprocess.check_call([sys.executable, CONVERTER, ckpt,
                                   os.path.join(out, name + ".gguf")] + args)
    gpt2_vocabulary(os.path.join(out, "gpt2_vocab.gguf"))


if __name__ == "__main__":
    main()
