#!/usr/bin/env python3
"""Counts the invented words of the bundled KJV model: runs the built generator at its default
settings (no flags but --seed) for seeds 1-5 and reports the generated words that are not words
of the King James Bible (case-insensitive, punctuation stripped). Standard library only.

    tools/kjv_word_check.py [--generate build/dev/examples/generate] [--seeds 1-5]

The KJV word set comes from Debian's `bible` program (apt-get install -y bible-kjv), the text
tools/train_tiny.py trains on. The prompt the generator echoes is not counted.
"""

import argparse
import os
import re
import subprocess
import sys
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORD = re.compile(r"[a-z]+")


def words(text):
    """Lower-cased runs of letters: punctuation, digits and the apostrophe split words."""
    return WORD.findall(text.lower())


def kjv_words():
    try:
        text = subprocess.run(["bible", "Genesis1:1-Revelation22:21"], capture_output=True,
                              text=True, check=True,
                              env=dict(os.environ, COLUMNS="80")).stdout
    except FileNotFoundError:
        sys.exit("kjv_word_check.py: the `bible` program is missing: apt-get install -y bible-kjv")
    # Chapter headings ("Genesis 1") are book names, which are KJV words too.
    return set(words(text))


def default_generator():
    for preset in ["release", "dev"]:
        path = os.path.join(ROOT, "build", preset, "examples", "generate")
        if os.path.exists(path):
            return path
    return os.path.join(ROOT, "build", "dev", "examples", "generate")


def seed_range(spec):
    lo, _, hi = spec.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--generate", default=default_generator(), help="the generate binary")
    ap.add_argument("--seeds", default="1-5", help="a seed or a range, e.g. 1-5")
    ap.add_argument("--prompt", default="And it came to pass",
                    help="the generator's default prompt for the KJV model (echoed, not counted)")
    ap.add_argument("--model", help="another checkpoint (tokenizer.bin beside it), run on the "
                    "same prompt; default: the bundled models/kjv_tiny.bin")
    ap.add_argument("--show", action="store_true", help="print each seed's text")
    args = ap.parse_args()

    vocab = kjv_words()
    total, bad = 0, Counter()
    for seed in seed_range(args.seeds):
        cmd = [args.generate, "--seed", str(seed)]
        if args.model:
            cmd += ["--model", args.model, "--prompt", args.prompt]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        text = out.stdout
        if not text.startswith(args.prompt):
            sys.exit("seed %d: the output does not start with the prompt %r" % (seed, args.prompt))
        gen = words(text[len(args.prompt):])
        miss = [w for w in gen if w not in vocab]
        end = re.search(r"^generated tokens +(.*)$", out.stderr, flags=re.M)
        print("seed %d: %d words, %d not in the KJV %s; generated tokens %s" % (
            seed, len(gen), len(miss), sorted(set(miss)), end.group(1) if end else "?"))
        if args.show:
            print(text)
        total += len(gen)
        bad.update(miss)
    n_bad = sum(bad.values())
    print("total: %d words, %d not in the KJV (%.2f %%): %s" % (
        total, n_bad, 100.0 * n_bad / max(1, total), ", ".join(sorted(bad))))


if __name__ == "__main__":
    main()
