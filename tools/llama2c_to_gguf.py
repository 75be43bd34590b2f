#!/usr/bin/env python3
"""Convert a llama2.c v0 checkpoint (and its tokenizer.bin) into a GGUF v3 file of the llama
architecture, written from the format description (ggml docs/gguf.md; docs/FORMATS.md §4).
Standard library only.

  tools/llama2c_to_gguf.py model.bin out.gguf [--tokenizer tokenizer.bin] [--type q8_0]
  tools/llama2c_to_gguf.py model.bin out.gguf --vocab-from ggml-vocab-gpt-2.gguf

--vocab-from copies the tokenizer.* metadata of another GGUF file (e.g. llama.cpp's vocab-only
files) byte for byte, so a checkpoint of that vocabulary size gets that vocabulary, of any
tokenizer model ("llama" or "gpt2").

--type stores the 2-D weights as f32, f16, bf16, q8_0 or q4_0 (the gains stay f32, as llama.cpp
keeps them); a matrix whose rows are not whole 32-element blocks falls back to f16. Q and K rows
are stored as llama2.c has them: llama.cpp's llama rope (ggml's normal mode) rotates adjacent
pairs as run.c does, so no permutation is needed (llama.cpp's HF converter permutes only because
HF's rotate_half pairs (j, j + head_size/2)).
"""
import argparse
import array
import math
import struct
import sys

# gguf_metadata_value_type
UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY = 4, 5, 6, 7, 8, 9
# ggml_type
GGML = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8, "bf16": 30}
# llama.cpp token types
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6
SPACE_MARK = "\u2581"


def read_checkpoint(path):
    data = open(path, "rb").read()
    dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len = struct.unpack_from("<7i", data)
    shared = vocab > 0
    vocab = abs(vocab)
    head_size = dim // n_heads
    kv_dim = n_kv_heads * head_size
    pos = 28

    def take(n):
        nonlocal pos
        a = array.array("f")
        a.frombytes(data[pos:pos + 4 * n])
        if sys.byteorder == "big":
            a.byteswap()
        pos += 4 * n
        return a

    t = {"token_embd": take(vocab * dim)}
    per_layer = [("attn_norm", dim), ("attn_q", dim * dim), ("attn_k", kv_dim * dim),
                 ("attn_v", kv_dim * dim), ("attn_output", dim * dim), ("ffn_norm", dim),
                 ("ffn_gate", hidden * dim), ("ffn_down", dim * hidden), ("ffn_up", hidden * dim)]
    for name, n in per_layer:
        for layer in range(n_layers):
            t[f"blk.{layer}.{name}"] = take(n)
    t["output_norm"] = take(dim)
    pos += 4 * seq_len * head_size  # freq_cis_real and freq_cis_imag: [seq_len][head_size / 2]
    if not shared:
        t["output"] = take(vocab * dim)
    if pos != len(data):
        sys.exit(f"{path}: {len(data)} bytes, the header implies {pos}")
    cfg = dict(dim=dim, hidden_dim=hidden, n_layers=n_layers, n_heads=n_heads,
               n_kv_heads=n_kv_heads, vocab_size=vocab, seq_len=seq_len, kv_dim=kv_dim)
    return cfg, t


# Sizes of the fixed-size GGUF value types (uint8 .. float64, bool), for skipping values.
VALUE_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def read_vocab_metadata(path):
    """The tokenizer.* key-value pairs of a GGUF file, each as its encoded bytes (key, type and
    value, as written in a GGUF header), and the number of tokens (tokenizer.ggml.tokens)."""
    data = open(path, "rb").read()
    magic, version, _, n_kv = struct.unpack_from("<IIQQ", data)
    if magic != 0x46554747 or version not in (2, 3):
        sys.exit(f"{path}: not a GGUF v2/v3 file")
    pos = 24

    def skip_string(at):
        (n,) = struct.unpack_from("<Q", data, at)
        return at + 8 + n

    def skip_value(vtype, at):
        if vtype == STRING:
            return skip_string(at)
        if vtype == ARRAY:
            element, count = struct.unpack_from("<IQ", data, at)
            at += 12
            if element in VALUE_BYTES:
                return at + count * VALUE_BYTES[element]
            for _ in range(count):
                at = skip_value(element, at)
            return at
        return at + VALUE_BYTES[vtype]

    pairs, n_tokens = [], None
    for _ in range(n_kv):
        start = pos
        key_end = skip_string(pos)
        key = data[pos + 8:key_end].decode("utf-8")
        (vtype,) = struct.unpack_from("<I", data, key_end)
        pos = skip_value(vtype, key_end + 4)
        if key.startswith("tokenizer."):
            pairs.append((key, data[start:pos]))
        if key == "tokenizer.ggml.tokens" and vtype == ARRAY:
            n_tokens = struct.unpack_from("<Q", data, key_end + 8)[0]
    if n_tokens is None:
        sys.exit(f"{path}: no tokenizer.ggml.tokens array")
    return pairs, n_tokens


def read_tokenizer(path, vocab_size):
    data = open(path, "rb").read()
    pos = 4  # max_token_length
    pieces, scores = [], []
    for _ in range(vocab_size):
        score, n = struct.unpack_from("<fi", data, pos)
        pos += 8
        pieces.append(data[pos:pos + n])
        pos += n
        scores.append(score)
    return pieces, scores


def gguf_tokens(pieces):
    """llama2.c pieces -> GGUF tokens and token types: ' ' becomes U+2581, BOS/EOS lose the
    newlines llama2.c's export put around them."""
    tokens, types = [], []
    for i, p in enumerate(pieces):
        text = p.decode("utf-8", errors="surrogateescape")
        if i == 1 and text == "\n<s>\n":
            text = "<s>"
        if i == 2 and text == "\n</s>\n":
            text = "</s>"
        tokens.append(text.replace(" ", SPACE_MARK).encode("utf-8", errors="surrogateescape"))
        if i == 0:
            types.append(UNKNOWN)
        elif i in (1, 2):
            types.append(CONTROL)
        elif 3 <= i < 259 and text == f"<0x{i - 3:02X}>":
            types.append(BYTE)
        else:
            types.append(NORMAL)
    return tokens, types


# ---------------------------------------------------------------------------------------------
# Tensor encodings (ggml's layouts).

def f16_bits(x):
    return struct.unpack("<H", struct.pack("<e", x))[0]


def encode_f16(values):
    return struct.pack(f"<{len(values)}e", *values)


def encode_bf16(values):
    out = bytearray()
    for x in values:
        u = struct.unpack("<I", struct.pack("<f", x))[0]
        if (u & 0x7FFFFFFF) > 0x7F800000:
            b = (u >> 16) | 0x40  # quiet NaN
        else:
            b = (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # round to nearest even
        out += struct.pack("<H", b)
    return bytes(out)


def round_half_away(x):
    return int(math.floor(abs(x) + 0.5)) * (1 if x >= 0 else -1)


def f32(x):
    """x rounded to float32, as ggml's quantizers compute (every step of a float32 +, *, / is one
    rounding of the double result: double holds more than 2 * 24 + 2 bits, so no double rounding)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def encode_q8_0(values):
    """ggml's quantize_row_q8_0_ref, in float32: blocks of 32, d = max|x| / 127, q = round(x / d)
    (half away from zero), d stored as f16."""
    out = bytearray()
    for b in range(0, len(values), 32):
        block = values[b:b + 32]
        amax = max(abs(x) for x in block)
        d = f32(amax / 127.0)
        inv = f32(1.0 / d) if d else 0.0
        out += struct.pack("<e", d)
        out += struct.pack("<32b", *(round_half_away(f32(x * inv)) for x in block))
    return bytes(out)


def encode_q4_0(values):
    """ggml's quantize_row_q4_0_ref, in float32: blocks of 32, d = m / -8 where m is the first
    element of largest magnitude, codes q = min(15, trunc(x / d + 8.5)); byte j holds element j
    (low nibble) and j + 16 (high); d stored as f16."""
    out = bytearray()
    for b in range(0, len(values), 32):
        block = values[b:b + 32]
        m = max(block, key=abs)
        d = f32(m / -8.0)
        inv = f32(1.0 / d) if d else 0.0
        codes = [min(15, int(f32(f32(x * inv) + 8.5))) for x in block]
        out += struct.pack("<e", d)
        out += bytes(codes[j] | (codes[j + 16] << 4) for j in range(16))
    return bytes(out)


def encode(values, type_name):
    if type_name == "f32":
        a = array.array("f", values)
        if sys.byteorder == "big":
            a.byteswap()
        return a.tobytes()
    return {"f16": encode_f16, "bf16": encode_bf16, "q8_0": encode_q8_0,
            "q4_0": encode_q4_0}[type_name](values)


# ---------------------------------------------------------------------------------------------
# GGUF writing.

def gguf_string(s):
    if isinstance(s, str):
        s = s.encode("utf-8")
    return struct.pack("<Q", len(s)) + s


def kv(key, vtype, value, element_type=None):
    out = gguf_string(key) + struct.pack("<I", vtype)
    if vtype == ARRAY:
        out += struct.pack("<IQ", element_type, len(value))
        for v in value:
            out += scalar(element_type, v)
    else:
        out += scalar(vtype, value)
    return out


def scalar(vtype, v):
    if vtype == STRING:
        return gguf_string(v)
    return struct.pack({UINT32: "<I", INT32: "<i", FLOAT32: "<f", BOOL: "<?"}[vtype], v)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("output")
    ap.add_argument("--tokenizer", help="tokenizer.bin to store as tokenizer.ggml.* metadata")
    ap.add_argument("--vocab-from", metavar="GGUF",
                    help="copy the tokenizer.* metadata of this GGUF file; its token count must "
                         "be the checkpoint's vocab_size")
    ap.add_argument("--allow-vocab-mismatch", action="store_true",
                    help="write --vocab-from's vocabulary even when its token count differs "
                         "(a file readers refuse; for tests)")
    ap.add_argument("--type", default="f32", choices=sorted(GGML))
    ap.add_argument("--alignment", type=int, default=32, help="general.alignment (32: omitted)")
    ap.add_argument("--name", default="llama2c")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=TYPE:VALUE",
                    help="add or replace a metadata key, TYPE one of u32, i32, f32, bool, str "
                         "(e.g. llama.rope.scaling.type=str:linear); for tests")
    args = ap.parse_args()

    if args.tokenizer and args.vocab_from:
        sys.exit("--tokenizer and --vocab-from both give the vocabulary; pass one")
    cfg, tensors = read_checkpoint(args.checkpoint)
    dim, hidden, kv_dim = cfg["dim"], cfg["hidden_dim"], cfg["kv_dim"]
    meta = [
        kv("general.architecture", STRING, "llama"),
        kv("general.name", STRING, args.name),
        kv("llama.context_length", UINT32, cfg["seq_len"]),
        kv("llama.embedding_length", UINT32, dim),
        kv("llama.block_count", UINT32, cfg["n_layers"]),
        kv("llama.feed_forward_length", UINT32, hidden),
        kv("llama.rope.dimension_count", UINT32, dim // cfg["n_heads"]),
        kv("llama.attention.head_count", UINT32, cfg["n_heads"]),
        kv("llama.attention.head_count_kv", UINT32, cfg["n_kv_heads"]),
        # run.c hard-codes both; v0 checkpoints store neither.
        kv("llama.attention.layer_norm_rms_epsilon", FLOAT32, 1e-5),
        kv("llama.rope.freq_base", FLOAT32, 10000.0),
    ]
    if args.alignment != 32:
        meta.append(kv("general.alignment", UINT32, args.alignment))
    if args.tokenizer:
        pieces, scores = read_tokenizer(args.tokenizer, cfg["vocab_size"])
        tokens, types = gguf_tokens(pieces)
        meta += [
            kv("tokenizer.ggml.model", STRING, "llama"),
            kv("tokenizer.ggml.tokens", ARRAY, tokens, STRING),
            kv("tokenizer.ggml.scores", ARRAY, scores, FLOAT32),
            kv("tokenizer.ggml.token_type", ARRAY, types, INT32),
            kv("tokenizer.ggml.bos_token_id", UINT32, 1),
            kv("tokenizer.ggml.eos_token_id", UINT32, 2),
            kv("tokenizer.ggml.unknown_token_id", UINT32, 0),
            kv("tokenizer.ggml.add_bos_token", BOOL, True),
            kv("tokenizer.ggml.add_eos_token", BOOL, False),
        ]
    if args.vocab_from:
        pairs, n_tokens = read_vocab_metadata(args.vocab_from)
        if n_tokens != cfg["vocab_size"] and not args.allow_vocab_mismatch:
            sys.exit(f"{args.vocab_from}: {n_tokens} tokens, but {args.checkpoint} has vocab_size "
                     f"{cfg['vocab_size']}")
        meta += [encoded for _, encoded in pairs]

    types = {"u32": (UINT32, int), "i32": (INT32, int), "f32": (FLOAT32, float),
             "bool": (BOOL, lambda v: v == "true"), "str": (STRING, str)}
    for item in args.set:
        key, typed = item.split("=", 1)
        type_name, value = typed.split(":", 1)
        vtype, parse = types[type_name]
        prefix = gguf_string(key)
        meta = [m for m in meta if not m.startswith(prefix)]
        meta.append(kv(key, vtype, parse(value)))

    # ggml dims: innermost first, so a row-major [out][in] matrix is {in, out}.
    vocab = cfg["vocab_size"]
    shapes = {"token_embd": [dim, vocab], "output_norm": [dim], "output": [dim, vocab]}
    per_layer = {"attn_norm": [dim], "attn_q": [dim, dim], "attn_k": [dim, kv_dim],
                 "attn_v": [dim, kv_dim], "attn_output": [dim, dim], "ffn_norm": [dim],
                 "ffn_gate": [dim, hidden], "ffn_down": [hidden, dim], "ffn_up": [dim, hidden]}
    order = ["token_embd"]
    for layer in range(cfg["n_layers"]):
        for name, shape in per_layer.items():
            shapes[f"blk.{layer}.{name}"] = shape
            order.append(f"blk.{layer}.{name}")
    order.append("output_norm")
    if "output" in tensors:
        order.append("output")

    align = args.alignment
    infos, blobs, offset = [], [], 0
    for name in order:
        shape = shapes[name]
        type_name = args.type
        if len(shape) == 1:
            type_name = "f32"
        elif type_name in ("q8_0", "q4_0") and shape[0] % 32 != 0:
            type_name = "f16"
        blob = encode(tensors[name], type_name)
        infos.append(gguf_string(name + ".weight") + struct.pack("<I", len(shape)) +
                     struct.pack(f"<{len(shape)}Q", *shape) +
                     struct.pack("<IQ", GGML[type_name], offset))
        blobs.append(blob)
        offset += len(blob)
        offset += -offset % align

    header = struct.pack("<IIQQ", 0x46554747, 3, len(order), len(meta))
    head = header + b"".join(meta) + b"".join(infos)
    with open(args.output, "wb") as f:
        f.write(head)
        f.write(b"\0" * (-len(head) % align))
        for blob in blobs:
            f.write(blob)
            f.write(b"\0" * (-len(blob) % align))


if __name__ == "__main__":
    main()
