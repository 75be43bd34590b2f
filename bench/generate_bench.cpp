// BM_Generate: the total time of generating n tokens after a one-token prompt with generate(),
// with the KV cache and without it (use_cache = false: the same kernels re-run prefill of the
// whole sequence into a reset store for every new token). items/s = generated tokens/s.

// Before any Eigen include: GCC 12's false -Wmaybe-uninitialized (see bench_model.hpp).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "bench_model.hpp"
#include "kvdecode/kvdecode.hpp"

namespace {

using namespace kvdecode;
using kvdecode::bench::bench_model;

void BM_Generate(benchmark::State& state, bool use_cache) {
  const Model<float>& model = bench_model();
  const auto n = static_cast<std::size_t>(state.range(0));
  const std::vector<std::int32_t> prompt{1};  // BOS, as llama2.c run.c starts
  ContiguousStore<float> cache(model.config());
  // Chunks as long as the sequence, so the uncached recompute is one prefill call per token.
  Activations<float> act(model.config(), {.max_chunk = use_cache ? 1 : n});
  // Counting is one closed form per call, so it can stay on inside the timed loop.
  WorkCounters counters;
  act.counters = &counters;
  GenerationOptions options;
  options.max_new_tokens = n;
  options.use_cache = use_cache;
  GenerationStats stats;
  for (auto _ : state) {
    cache.reset();
    Sampler sampler(model.config().vocab_size, SamplerOptions{0.0, 0.9, 0, 1});  // greedy
    stats = generate(model, cache, act, std::span<const std::int32_t>(prompt), sampler, options,
                     [](std::int32_t token) { benchmark::DoNotOptimize(token); });
  }
  if (stats.generated_tokens != n) state.SkipWithError("generation stopped early");
  const auto iters = static_cast<double>(state.iterations());
  const PhaseCounters total = counters.total();
  state.SetItemsProcessed(static_cast<std::int64_t>(n) * state.iterations());  // tokens/s
  // The counters summed over every iteration: bytes/s = bytes streamed per second.
  state.SetBytesProcessed(static_cast<std::int64_t>(total.kv_bytes_read + total.weight_bytes_read));
  state.counters["kv_projections"] = static_cast<double>(total.kv_projections) / iters;
  state.counters["attention_scores"] = static_cast<double>(total.attention_scores) / iters;
  state.counters["flops"] = static_cast<double>(total.flops) / iters;
  state.counters["ttft_ms"] = stats.ttft_ms;
  state.SetComplexityN(static_cast<benchmark::IterationCount>(n));
}

void token_range(benchmark::internal::Benchmark* b) {
  b->RangeMultiplier(2)->Range(64, kvdecode::bench::top(1024, 64));
  b->Unit(benchmark::kMillisecond)->Complexity(benchmark::oAuto);
}

// Cached generation is a few seconds at n = 1024: three repetitions give a median. Uncached is
// ~2 minutes at n = 1024 and averages over a thousand steps by itself, so it runs once.
BENCHMARK_CAPTURE(BM_Generate, cached, true)
    ->Apply(token_range)
    ->Repetitions(kvdecode::bench::reps(3));
BENCHMARK_CAPTURE(BM_Generate, uncached, false)->Apply(token_range)->Iterations(1);

// BM_Sample: one draw of the Sampler with the generator's default sampling (temperature 0.8,
// top-p 0.9) from logits of vocab_size Gaussian values (sd 2.5, 16 rows in turn), as every
// sampled token of generate() pays it after the model's step.
void BM_Sample(benchmark::State& state) {
  const auto vocab = static_cast<std::size_t>(state.range(0));
  std::vector<std::vector<float>> logits(16, std::vector<float>(vocab));  // [16][vocab]
  detail::SplitMix64 rng(vocab);
  for (auto& row : logits)
    for (float& x : row) {  // Box-Muller from two uniforms in (0, 1]
      const double u1 = (static_cast<double>(rng.next() >> 11) + 1.0) * 0x1.0p-53;
      const double u2 = static_cast<double>(rng.next() >> 11) * 0x1.0p-53;
      x = static_cast<float>(2.5 * std::sqrt(-2.0 * std::log(u1)) *
                             std::cos(6.283185307179586 * u2));
    }
  Sampler sampler(static_cast<std::int64_t>(vocab), SamplerOptions{0.8, 0.9, 0, 1});
  std::size_t i = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(sampler.sample(std::span<const float>(logits[i])));
    i = (i + 1) % logits.size();
  }
  state.SetItemsProcessed(state.iterations());  // draws/s
}
BENCHMARK(BM_Sample)->ArgName("vocab")->Arg(4096)->Arg(32000)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
