// BM_DecodeStep: the latency of producing one token at context length T, with the KV cache
// (decode() of one token against T-1 cached positions) and without it (the same kernels
// re-running prefill of all T tokens into a reset store, as generate(use_cache = false) does).
// Complexity fits over T say how each grows: O(N) with the cache, O(N²) without.

// Before any Eigen include: GCC 12's false -Wmaybe-uninitialized (see bench_model.hpp).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <benchmark/benchmark.h>

#include <cstdint>
#include <span>

#include "bench_model.hpp"
#include "kvdecode/kvdecode.hpp"

namespace {

using namespace kvdecode;
using kvdecode::bench::bench_model;
using kvdecode::bench::bench_tokens;

// One new token at cache index T-1: decode() against T-1 cached positions. The store is
// truncated back after each step (O(1)), so every iteration sees the same T.
void BM_DecodeStepCached(benchmark::State& state) {
  const Model<float>& model = bench_model();
  const auto T = static_cast<std::size_t>(state.range(0));
  const auto tokens = bench_tokens(T);
  ContiguousStore<float> cache(model.config(), T);
  Activations<float> act(model.config(), {.max_chunk = T});
  if (T > 1) model.prefill(std::span<const std::int32_t>(tokens).first(T - 1), cache, act);
  {  // one counted step, outside the timing, for the bytes it streams
    WorkCounters c;
    act.counters = &c;
    model.decode(tokens[T - 1], cache, act);
    cache.truncate(T - 1);
    act.counters = nullptr;
    kvdecode::bench::set_work_counters(state, c.decode);
    state.counters["bytes_per_step"] =
        static_cast<double>(c.decode.kv_bytes_read + c.decode.weight_bytes_read);
  }
  for (auto _ : state) {
    benchmark::DoNotOptimize(model.decode(tokens[T - 1], cache, act).data());
    cache.truncate(T - 1);
  }
  state.SetItemsProcessed(state.iterations());  // items/s = tokens/s
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(state.counters["bytes_per_step"].value));
  state.SetComplexityN(static_cast<benchmark::IterationCount>(T));
}

// The same token without a cache: reset the store and prefill all T tokens (the logits of the
// last one only), which recomputes every K/V and the whole causal triangle of scores.
void BM_DecodeStepUncached(benchmark::State& state) {
  const Model<float>& model = bench_model();
  const auto T = static_cast<std::size_t>(state.range(0));
  const auto tokens = bench_tokens(T);
  ContiguousStore<float> cache(model.config(), T);
  Activations<float> act(model.config(), {.max_chunk = T});  // one chunk: the fastest recompute
  {
    WorkCounters c;
    act.counters = &c;
    model.prefill(tokens, cache, act);
    act.counters = nullptr;
    kvdecode::bench::set_work_counters(state, c.prefill);
    state.counters["bytes_per_step"] =
        static_cast<double>(c.prefill.kv_bytes_read + c.prefill.weight_bytes_read);
  }
  for (auto _ : state) {
    cache.reset();
    benchmark::DoNotOptimize(model.prefill(tokens, cache, act).data());
  }
  state.SetItemsProcessed(state.iterations());
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(state.counters["bytes_per_step"].value));
  state.SetComplexityN(static_cast<benchmark::IterationCount>(T));
}

void context_range(benchmark::internal::Benchmark* b) {
  b->RangeMultiplier(2)->Range(16, kvdecode::bench::top(2048, 64));
  b->Unit(benchmark::kMillisecond)->Complexity(benchmark::oAuto);
  b->Repetitions(kvdecode::bench::reps(3));
}

BENCHMARK(BM_DecodeStepCached)->Name("BM_DecodeStep/cached")->Apply(context_range);
BENCHMARK(BM_DecodeStepUncached)->Name("BM_DecodeStep/uncached")->Apply(context_range);

}  // namespace

BENCHMARK_MAIN();
