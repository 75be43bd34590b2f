#!/usr/bin/env python3
"""Draws the demo model's loss curve from its training log with gnuplot: train loss (every 10th
step's batch) and validation loss (the whole held-out set), in nats per token, against epochs.

    tools/plot_training.py [models/train_log.txt] [docs/charts/kjv_tiny_training.png]

Standard library only (apt-get install -y gnuplot-nox).
"""

import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    log = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "models", "train_log.txt")
    png = sys.argv[2] if len(sys.argv) > 2 else os.path.join(ROOT, "docs", "charts",
                                                             "kjv_tiny_training.png")
    text = open(log).read()
    m = re.search(r"training: (\d+) steps of (\d+) tokens .* = ([0-9.]+) epochs", text)
    steps, epochs = int(m.group(1)), float(m.group(3))
    per_step = epochs / steps
    train = [(int(s) + 1, float(l)) for s, l in
             re.findall(r"^step +(\d+)/\d+ .*train loss ([0-9.]+)", text, flags=re.M)]
    val = [(int(s), float(l), float(c), int(w)) for s, l, c, w in
           re.findall(r"^step +(\d+) +val loss ([0-9.]+) nats/token, ([0-9.]+) nats/char "
                      r"\(windows of (\d+)\)", text, flags=re.M)]
    with tempfile.TemporaryDirectory() as tmp:
        tf, vf = os.path.join(tmp, "train.dat"), os.path.join(tmp, "val.dat")
        with open(tf, "w") as f:
            f.writelines("%g %g\n" % (s * per_step, l) for s, l in train)
        with open(vf, "w") as f:
            f.writelines("%g %g %g\n" % (s * per_step, l, c) for s, l, c, _ in val)
        last = val[-1]
        script = f"""
set terminal pngcairo size 900,500 font ",11"
set output "{png}"
set title "kjv_tiny training: loss (nats/token); final validation {last[1]:.3f} nats/token = {last[2]:.3f} nats/char" noenhanced
set xlabel "epochs of the training chapters ({steps} steps)"
set ylabel "cross-entropy (nats/token)"
set grid
set yrange [2:8.5]
set key top right
plot "{tf}" using 1:2 with lines lw 1 lc rgb "#8888cc" title "train (one batch every 10 steps)" noenhanced, \\
     "{vf}" using 1:2 with linespoints lw 2 pt 7 lc rgb "#cc3333" title "validation (held-out chapters)"
"""
        os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
        subprocess.run(["gnuplot"], input=script, text=True, check=True)
    print("wrote %s (%d train points, %d validation points)" % (png, len(train), len(val)))


if __name__ == "__main__":
    main()
