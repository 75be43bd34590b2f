#!/usr/bin/env bash
# Prints what a benchmark report needs to say about the machine and the tree it measured.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "commit: $(git -C "${ROOT}" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "${ROOT}" diff --quiet 2>/dev/null || echo ' (+ uncommitted changes)')"
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p' | head -1)"
echo "cpu_family_model: $(lscpu | sed -n 's/^CPU family: *//p' | head -1)/$(lscpu | sed -n 's/^Model: *//p' | head -1)"
echo "cores: $(nproc)"
echo "avx512: $(grep -q avx512f /proc/cpuinfo && echo yes || echo no)$(grep -q avx512_bf16 /proc/cpuinfo && echo ', with bf16 dot products' || true)"
echo "cache (cpuinfo): $(sed -n "s/^cache size[[:space:]]*: *//p" /proc/cpuinfo | head -1)"
echo "memory: $(free -g | awk '/^Mem:/ {print $2 " GiB"}')"
echo "compiler: $(c++ --version | head -1)"
echo "kernel: $(uname -r)"
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
