// Shared setup of the KV-cache benchmarks (decode, generate, prefill, attention, memory): the
// benchmark model shape, one lazily built model, token streams, and the smoke-mode switch.
#pragma once

// GCC 12 reports -Wmaybe-uninitialized inside its own avx512fintrin.h when Eigen's AVX-512 GEMM
// packing is inlined at -O3 -march=native (a false positive in a system header); silenced for the
// benchmark translation units only, by a pragma at the top of each *_bench.cpp (it has to come
// before the first Eigen include, and clang-format would sort this header after it).

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "kvdecode/kvdecode.hpp"

namespace kvdecode::bench {

/// KVDECODE_BENCH_SMOKE=1 (set by the ctest smoke tests) shrinks every range to its first few
/// points, so a smoke run of all binaries stays well under a minute and still runs every code
/// path; the full ranges are for tools/run_benchmarks.sh.
inline bool smoke() {
  const char* v = std::getenv("KVDECODE_BENCH_SMOKE");
  return v != nullptr && std::strcmp(v, "0") != 0 && v[0] != '\0';
}

/// The top of a range: `full` normally, `small` in smoke mode.
inline std::int64_t top(std::int64_t full, std::int64_t small) { return smoke() ? small : full; }

/// Repetitions of a benchmark: `full` normally (the report's medians), 1 in smoke mode.
inline int reps(int full) { return smoke() ? 1 : full; }

/// The benchmark shape: llama2.c's stories15M (dim 288, 6 layers, 6 heads of 48, SwiGLU 768,
/// vocab 32000) with seq_len raised to 2048 so the cache's O(T) vs the recompute's O(T²) shows
/// over a wide range of contexts. Weights are random (the work does not depend on their values).
inline ModelConfig bench_config(std::int64_t n_kv_heads = 6) {
  ModelConfig c;
  c.dim = 288;
  c.hidden_dim = 768;
  c.n_layers = 6;
  c.n_heads = 6;
  c.n_kv_heads = n_kv_heads;
  c.vocab_size = 32000;
  c.seq_len = 2048;
  return c;
}

/// The f32 model of bench_config(), built once per process (random fill takes ~0.1 s).
inline const Model<float>& bench_model() {
  static const Model<float> model(random_weights<float>(bench_config(), 42));
  return model;
}

/// n token ids in [1, vocab), fixed by the seed.
inline std::vector<std::int32_t> bench_tokens(std::size_t n, std::uint64_t seed = 7) {
  detail::SplitMix64 rng(seed);
  std::vector<std::int32_t> t(n);
  const auto vocab = static_cast<std::uint64_t>(bench_config().vocab_size);
  for (auto& id : t) id = static_cast<std::int32_t>(1 + rng.next() % (vocab - 1));
  return t;
}

/// Exact counters of one call, recorded outside the timed loop, for bytes/s and the report.
inline void set_work_counters(benchmark::State& state, const PhaseCounters& c) {
  state.counters["kv_projections"] = static_cast<double>(c.kv_projections);
  state.counters["attention_scores"] = static_cast<double>(c.attention_scores);
  state.counters["kv_bytes_read"] = static_cast<double>(c.kv_bytes_read);
  state.counters["weight_bytes_read"] = static_cast<double>(c.weight_bytes_read);
  state.counters["flops"] = static_cast<double>(c.flops);
}

}  // namespace kvdecode::bench
