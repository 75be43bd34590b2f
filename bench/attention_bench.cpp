// Attention of one layer alone, over the context length T and the GQA ratio: BM_AttentionDecode
// is one query against T cached keys (a cached decode step's attention, O(T));
// BM_AttentionRecompute is all T queries against their causal prefixes (an uncached step's
// attention, O(T²)). Both run attend() on a ContiguousStore filled with random rotated keys and
// values.

// Before any Eigen include: GCC 12's false -Wmaybe-uninitialized (see bench_model.hpp).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <benchmark/benchmark.h>

#include <cstdint>
#include <string>
#include <vector>

#include "bench_model.hpp"
#include "kvdecode/kvdecode.hpp"

namespace {

using namespace kvdecode;

/// The benchmark model's attention shape (6 query heads of 48) with one layer.
ModelConfig one_layer(std::int64_t n_kv_heads) {
  ModelConfig c = kvdecode::bench::bench_config(n_kv_heads);
  c.n_layers = 1;
  return c;
}

/// A one-layer store holding T positions of random keys and values.
ContiguousStore<float> filled_store(const ModelConfig& cfg, std::size_t T) {
  ContiguousStore<float> store(cfg, T);
  const auto kv_dim = static_cast<std::size_t>(cfg.kv_dim());
  detail::SplitMix64 rng(3);
  std::vector<float> k(kv_dim), v(kv_dim);
  const std::vector<std::int32_t> ids(T, 1);
  store.begin_append(ids);
  for (std::size_t i = 0; i < T; ++i) {
    for (std::size_t j = 0; j < kv_dim; ++j) {
      k[j] = static_cast<float>(rng.symmetric());
      v[j] = static_cast<float>(rng.symmetric());
    }
    store.write(0, i, k.data(), v.data());
  }
  store.commit_append();
  return store;
}

AlignedBuffer<float> random_queries(std::size_t n, std::size_t dim) {
  AlignedBuffer<float> q(n * dim);
  detail::SplitMix64 rng(5);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>(rng.symmetric());
  return q;
}

// state.range(0) = T; the kv-head count is bound at registration.
void BM_AttentionDecode(benchmark::State& state, std::int64_t n_kv_heads) {
  const ModelConfig cfg = one_layer(n_kv_heads);
  const auto T = static_cast<std::size_t>(state.range(0));
  const auto dim = static_cast<std::size_t>(cfg.dim);
  const ContiguousStore<float> store = filled_store(cfg, T);
  const AlignedBuffer<float> q = random_queries(1, dim);
  AlignedBuffer<float> out(dim);  // [dim] heads side by side
  AttentionScratch<float> scratch(cfg, 1, 0);
  for (auto _ : state) {
    attend(cfg, store, 0, T - 1, 1, q.data(), out.data(), scratch);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations());  // one query token per call
  // Each kv head's T keys and T values are read once; its kv_mul query heads share them.
  state.SetBytesProcessed(
      state.iterations() *
      static_cast<std::int64_t>(2 * T * static_cast<std::size_t>(cfg.kv_dim()) * sizeof(float)));
  state.counters["kv_mul"] = static_cast<double>(cfg.kv_mul());
  state.SetComplexityN(static_cast<benchmark::IterationCount>(T));
}

void BM_AttentionRecompute(benchmark::State& state, std::int64_t n_kv_heads) {
  const ModelConfig cfg = one_layer(n_kv_heads);
  const auto T = static_cast<std::size_t>(state.range(0));
  const auto dim = static_cast<std::size_t>(cfg.dim);
  const ContiguousStore<float> store = filled_store(cfg, T);
  const AlignedBuffer<float> q = random_queries(T, dim);
  AlignedBuffer<float> out(T * dim);  // [T][dim]
  AttentionScratch<float> scratch(cfg, T, 0);
  for (auto _ : state) {
    attend(cfg, store, 0, 0, T, q.data(), out.data(), scratch);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations());  // one new token per recompute
  state.counters["scores"] =
      static_cast<double>(T * (T + 1) / 2 * static_cast<std::size_t>(cfg.n_heads));
  state.SetComplexityN(static_cast<benchmark::IterationCount>(T));
}

// The 4-bit scores of one query against T cached keys in groups of 64 (hs 48, the codes in
// L2), in each coded kernel set this CPU runs: the avx512 set widens the codes to f32, the
// avx512bf16 set rounds the folded query to int8 and takes VNNI dot products.
void BM_Q4Scores(benchmark::State& state, KernelSet ks) {
  if (!cpu_supports(ks)) {
    state.SkipWithError("this CPU cannot run the set");
    return;
  }
  constexpr std::size_t kHs = 48, kGroup = 64;
  const auto T = static_cast<std::size_t>(state.range(0));
  detail::SplitMix64 rng(5);
  std::vector<float> q(kHs), qs((kHs + 31) / 32 * 32), s(kGroup);
  std::vector<std::uint16_t> kmin(T / kGroup * kHs), kstep(T / kGroup * kHs);
  std::vector<std::uint8_t> codes(T * kHs / 2);  // [T][hs / 2]
  for (float& x : q) x = static_cast<float>(rng.next() % 2001) / 1000.0f - 1.0f;
  for (std::uint16_t& x : kmin) x = detail::f16_from_float(-1.0f);
  for (std::uint16_t& x : kstep) x = detail::f16_from_float(2.0f / 15.0f);
  for (std::uint8_t& x : codes) x = static_cast<std::uint8_t>(rng.next());
  for (auto _ : state) {
    for (std::size_t g = 0; g < T / kGroup; ++g) {
      const float qm = detail::low_bit_query(ks, qs.data(), q.data(), kmin.data() + g * kHs,
                                             kstep.data() + g * kHs, 4, kHs);
      detail::coded_scores_low_bit(ks, s.data(), qs.data(), qm, codes.data() + g * kGroup * kHs / 2,
                                   4, kGroup, kHs, 0.1f);
      benchmark::DoNotOptimize(s.data());
    }
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(T));
  state.SetLabel(kernel_set_name(ks));
}

// One family per kv-head count, so each gets its own complexity fit. 6 query heads: 6 kv heads
// is MHA (kv_mul 1), 3 and 2 are GQA (kv_mul 2, 3), 1 is MQA (kv_mul 6).
const bool registered = [] {
  for (const std::int64_t kv : {6, 3, 2, 1}) {
    benchmark::RegisterBenchmark(("BM_AttentionDecode/kv_heads:" + std::to_string(kv)).c_str(),
                                 BM_AttentionDecode, kv)
        ->RangeMultiplier(2)
        ->Range(16, kvdecode::bench::top(2048, 64))
        ->Complexity(benchmark::oAuto)
        ->Repetitions(kvdecode::bench::reps(3));
  }
  for (const KernelSet ks : {KernelSet::kAvx512, KernelSet::kAvx512Bf16})
    benchmark::RegisterBenchmark(("BM_Q4Scores/" + std::string(kernel_set_name(ks))).c_str(),
                                 BM_Q4Scores, ks)
        ->Arg(4096)
        ->Repetitions(kvdecode::bench::reps(3));
  benchmark::RegisterBenchmark("BM_AttentionRecompute/kv_heads:6", BM_AttentionRecompute, 6)
      ->RangeMultiplier(2)
      ->Range(16, kvdecode::bench::top(2048, 64))
      ->Unit(benchmark::kMillisecond)
      ->Complexity(benchmark::oAuto)
      ->Repetitions(kvdecode::bench::reps(3));
  return true;
}();

}  // namespace

BENCHMARK_MAIN();
