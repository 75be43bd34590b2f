#!/usr/bin/env python3
"""Write a llama2.c v0 checkpoint of deterministic pseudo-random weights, of any shape (shared
classifier), for tests that need a model of a given vocabulary size (e.g. GPT-2's 50 257 tokens)
without storing one. Standard library only.

  tests/random_checkpoint.py out.bin --dim 32 --hidden-dim 64 --n-layers 2 --n-heads 4 \\
      --n-kv-heads 2 --vocab-size 50257 --seq-len 64 [--seed 1]

Each tensor is uniform with a standard deviation that keeps activations, attention scores and
logits of order one (embedding 2 / sqrt(dim), wq and wk 1.5 / sqrt(dim), other matrices
1 / sqrt(fan_in), RMS gains 1 + U(-0.25, 0.25)), so greedy tokens are not ties and a wrong
RoPE, norm or head grouping changes them. Same arguments, same bytes.
"""
import argparse
import array
import math
import random
import struct
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("output")
    for name in ("dim", "hidden-dim", "n-layers", "n-heads", "n-kv-heads", "vocab-size",
                 "seq-len"):
        ap.add_argument("--" + name, type=int, required=True)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    dim, hidden, layers, heads = a.dim, a.hidden_dim, a.n_layers, a.n_heads
    head_size = dim // heads
    kv_dim = a.n_kv_heads * head_size
    rng = random.Random(a.seed)

    with open(a.output, "wb") as f:
        f.write(struct.pack("<7i", dim, hidden, layers, heads, a.n_kv_heads, a.vocab_size,
                            a.seq_len))

        def uniform(n, std, offset=0.0):
            # U(-s, s) has standard deviation s / sqrt(3); 32 random bits per value.
            scale = std * math.sqrt(3) / 2147483648.0
            raw = array.array("I")
            raw.frombytes(rng.getrandbits(32 * n).to_bytes(4 * n, "little"))
            out = array.array("f", (offset + (u - 2147483647.5) * scale for u in raw))
            if sys.byteorder == "big":
                out.byteswap()
            out.tofile(f)

        def gains(n):
            for _ in range(layers):
                uniform(n, 0.25 / math.sqrt(3), 1.0)

        uniform(a.vocab_size * dim, 2 / math.sqrt(dim))  # token_embedding [vocab_size][dim]
        gains(dim)  # rms_att_weight [n_layers][dim]
        for rows, std in ((dim, 1.5), (kv_dim, 1.5), (kv_dim, 1.0), (dim, 1.0)):  # wq wk wv wo
            for _ in range(layers):
                uniform(rows * dim, std / math.sqrt(dim))
        gains(dim)  # rms_ffn_weight
        for rows, fan_in in ((hidden, dim), (dim, hidden), (hidden, dim)):  # w1 w2 w3
            for _ in range(layers):
                uniform(rows * fan_in, 1 / math.sqrt(fan_in))
        uniform(dim, 0.25 / math.sqrt(3), 1.0)  # rms_final_weight
        # freq_cis_real, freq_cis_imag [seq_len][head_size / 2] each: unused by run.c.
        array.array("f", bytes(4 * a.seq_len * head_size)).tofile(f)


if __name__ == "__main__":
    main()
