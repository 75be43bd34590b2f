// BM_Prefill: a P-token prompt in one prefill() call (matrix-matrix products, every token of a
// layer at once) against BM_PrefillAsDecode: the same P tokens fed one decode() call at a time
// (matrix-vector products, the weights streamed once per token). The first is the time to first
// token of a P-token prompt; the second is what the per-token decode loop costs for P tokens.

// Before any Eigen include: GCC 12's false -Wmaybe-uninitialized (see bench_model.hpp).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <benchmark/benchmark.h>

#include <cstdint>
#include <memory>
#include <span>

#include "bench_model.hpp"
#include "kvdecode/kvdecode.hpp"

namespace {

using namespace kvdecode;
using kvdecode::bench::bench_model;
using kvdecode::bench::bench_tokens;

/// nullptr for one thread, else a pool of `threads` that lives as long as the benchmark.
std::unique_ptr<ThreadPool> make_pool(std::int64_t threads) {
  return threads > 1 ? std::make_unique<ThreadPool>(static_cast<std::size_t>(threads)) : nullptr;
}

void BM_Prefill(benchmark::State& state) {
  const Model<float>& model = bench_model();
  const auto P = static_cast<std::size_t>(state.range(0));
  const auto pool = make_pool(state.range(1));
  const auto tokens = bench_tokens(P);
  ContiguousStore<float> cache(model.config(), P);
  Activations<float> act(model.config(), {.max_chunk = P, .thread_pool = pool.get()});
  for (auto _ : state) {
    cache.reset();
    benchmark::DoNotOptimize(model.prefill(tokens, cache, act).data());
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(P) * state.iterations());  // prompt tokens/s
}

void BM_PrefillAsDecode(benchmark::State& state) {
  const Model<float>& model = bench_model();
  const auto P = static_cast<std::size_t>(state.range(0));
  const auto pool = make_pool(state.range(1));
  const auto tokens = bench_tokens(P);
  ContiguousStore<float> cache(model.config(), P);
  Activations<float> act(model.config(), {.max_chunk = 1, .thread_pool = pool.get()});
  for (auto _ : state) {
    cache.reset();
    for (const std::int32_t t : tokens)
      benchmark::DoNotOptimize(model.decode(t, cache, act).data());
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(P) * state.iterations());
}

void prompt_range(benchmark::internal::Benchmark* b) {
  b->ArgNames({"P", "threads"});
  for (const std::int64_t threads : {1, 2})
    for (std::int64_t P = 16; P <= kvdecode::bench::top(1024, 64); P *= 4) b->Args({P, threads});
  b->Unit(benchmark::kMillisecond)->Repetitions(kvdecode::bench::reps(3));
}

BENCHMARK(BM_Prefill)->Apply(prompt_range);
BENCHMARK(BM_PrefillAsDecode)->Apply(prompt_range);

}  // namespace

BENCHMARK_MAIN();
