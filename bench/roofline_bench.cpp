// Decode and prefill of the 15M / 42M / 110M shapes at 1 and 2 threads with f32, bf16, q8_0 and
// q4_0 weights (the four interleaved at each shape and thread count; prefill also bf16 with AMX
// turned off, where the CPU has AMX, as bf16_noamx), against rooflines
// measured in the same run: a read-bandwidth probe (sum of a 512 MiB array) for decode, the f32
// FMA peak for prefill (the vdpbf16ps peak for bf16 weights on bf16 pairs).
//
// Counters: tok/s; GB/s = bytes a decode step must read (weights + K/V) × tok/s; roofline% =
// GB/s ÷ the probe's GB/s at the same thread count, probed just before the timed loop;
// GFLOP/s, peak% = GFLOP/s ÷ (kPeakGflops × threads) and probe_peak% = the same over the
// measured FMA peak, for prefill. Times are wall-clock (the pool's threads work too).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "kvdecode/io/checkpoint.hpp"
#include "kvdecode/kvdecode.hpp"  // and <immintrin.h>, through detail/cpu.hpp
#include "peak_probes.hpp"

namespace {

using namespace kvdecode;
using Clock = std::chrono::steady_clock;

/// f32 FMA peak of one Zen 5 core: 2 × 512-bit FMA pipes × 16 lanes × 2 flops × ~3.4 GHz
/// (the nominal figure the prefill targets are stated against).
constexpr double kPeakGflops = 215.0;
constexpr std::size_t kDecodeContext = 128;  // cached positions each timed decode step sees
constexpr std::size_t kPrefillTokens = 128;  // as llama.cpp's pp128

// ---------------------------------------------------------------------------------------------
// Thread pools, one per thread count, alive for the whole run.
// ---------------------------------------------------------------------------------------------

ThreadPool* pool_for(std::size_t threads) {
  static std::map<std::size_t, std::unique_ptr<ThreadPool>> pools;
  if (threads <= 1) return nullptr;
  auto& p = pools[threads];
  if (!p) p = std::make_unique<ThreadPool>(threads);
  return p.get();
}

// ---------------------------------------------------------------------------------------------
// Read-bandwidth probe.
// ---------------------------------------------------------------------------------------------

constexpr std::size_t kProbeFloats = std::size_t{1} << 27;  // 512 MiB, 16× the L3

const AlignedBuffer<float>& probe_array() {
  static const AlignedBuffer<float> a = [] {
    AlignedBuffer<float> b(kProbeFloats);
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>(i & 7);
    return b;
  }();
  return a;
}

/// Σ a[begin, end) with four independent accumulators (loads, not FMAs, are the limit).
float sum_range(const float* a, std::size_t begin, std::size_t end) {
#if defined(__AVX512F__)
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  std::size_t i = begin;
  for (; i + 64 <= end; i += 64) {
    s0 = _mm512_add_ps(s0, _mm512_load_ps(a + i));
    s1 = _mm512_add_ps(s1, _mm512_load_ps(a + i + 16));
    s2 = _mm512_add_ps(s2, _mm512_load_ps(a + i + 32));
    s3 = _mm512_add_ps(s3, _mm512_load_ps(a + i + 48));
  }
  float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
  for (; i < end; ++i) s += a[i];
  return s;
#else
  float s[8] = {};
  std::size_t i = begin;
  for (; i + 8 <= end; i += 8)
    for (std::size_t k = 0; k < 8; ++k) s[k] += a[i + k];
  for (; i < end; ++i) s[0] += a[i];
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
#endif
}

/// One pass over the probe array on `threads` threads; returns seconds.
double probe_pass(std::size_t threads) {
  const AlignedBuffer<float>& a = probe_array();
  float partial[64] = {};
  const auto t0 = Clock::now();
  parallel_run(pool_for(threads), [&](std::size_t t, std::size_t nt) {
    // Boundaries on 64-float (256-byte) multiples keep every thread's loads aligned.
    const auto [b, e] = ThreadPool::share(a.size(), nt, t, 64);
    partial[t] = sum_range(a.data(), b, e);
  });
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  benchmark::DoNotOptimize(partial);
  return s;
}

/// Read bandwidth (bytes/s) at a thread count now: the median of 3 passes run just before a
/// benchmark's timed loop. This machine's bandwidth drifts (a shared host: 2-thread passes span
/// ~30-52 GB/s over minutes), so each roofline% is paired with a probe taken under the same
/// conditions rather than with the best pass of the run.
double probe_now(std::size_t threads) {
  probe_pass(threads);  // page-in and warm-up
  double passes[3];
  for (double& p : passes) p = static_cast<double>(probe_array().bytes()) / probe_pass(threads);
  std::sort(passes, passes + 3);
  return passes[1];
}

void BM_ReadBandwidth(benchmark::State& state) {
  const auto threads = static_cast<std::size_t>(state.range(0));
  probe_pass(threads);  // page-in and warm-up
  double total = 0;
  double best = 0;
  for (auto _ : state) {
    const double s = probe_pass(threads);
    total += s;
    best = std::max(best, static_cast<double>(probe_array().bytes()) / s);
  }
  const double bytes = static_cast<double>(probe_array().bytes());
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(probe_array().bytes()));
  state.counters["GB/s"] = bytes * static_cast<double>(state.iterations()) / total * 1e-9;
  state.counters["best_GB/s"] = best * 1e-9;
}

// ---------------------------------------------------------------------------------------------
// FMA-peak probe: the nominal 215 GFLOP/s/core is a Zen 5 figure (two full-width 512-bit FMA
// pipes); a CPU that splits 512-bit FMAs in two (Zen 4, family 25) peaks at half that, so the
// peak is measured too and prefill reports both ratios.
// ---------------------------------------------------------------------------------------------

// The probes themselves are in peak_probes.hpp (paged_bench's batched decode reads them too).
using bench::dpbf16_pass;
using bench::fma_pass;
using bench::measured_peak;

void BM_FmaPeak(benchmark::State& state) {
  double gflops = 0;
  for (auto _ : state) gflops = std::max(gflops, fma_pass(std::size_t{1} << 22));
  state.counters["GFLOP/s"] = gflops;
  state.counters["nominal%"] = 100.0 * gflops / kPeakGflops;
}

void BM_Bf16DotPeak(benchmark::State& state) {
  double gflops = 0;
  for (auto _ : state) gflops = std::max(gflops, dpbf16_pass(std::size_t{1} << 22));
  state.counters["GFLOP/s"] = gflops;
}

// ---------------------------------------------------------------------------------------------
// Models.
// ---------------------------------------------------------------------------------------------

struct Shape {
  const char* name;
  ModelConfig cfg;
};

ModelConfig make(std::int64_t dim, std::int64_t hidden, std::int64_t layers, std::int64_t heads,
                 std::int64_t kv_heads, std::int64_t vocab, std::int64_t seq) {
  ModelConfig c;
  c.dim = dim;
  c.hidden_dim = hidden;
  c.n_layers = layers;
  c.n_heads = heads;
  c.n_kv_heads = kv_heads;
  c.vocab_size = vocab;
  c.seq_len = seq;
  return c;
}

const std::vector<Shape>& shapes() {
  static const std::vector<Shape> s = {
      {"15M", make(288, 768, 6, 6, 6, 32000, 256)},
      {"42M", make(512, 1376, 8, 8, 8, 32000, 1024)},
      {"110M", make(768, 2048, 12, 12, 12, 32000, 1024)},
  };
  return s;
}

/// The weight types of one shape, built once: bf16 is the f32 weights rounded, q8_0 and q4_0
/// the f32 weights quantized.
struct Models {
  std::unique_ptr<Model<float, bf16>> bf;
  std::unique_ptr<Model<float, Q8_0>> q8;
  std::unique_ptr<Model<float, Q4_0>> q4;
  std::unique_ptr<Model<float>> f32;
};

/// kBf16NoAmx: the bf16 model with AMX turned off (prefill only, where the CPU has AMX), to
/// compare the tiles with the avx512bf16 set's own kernels in the same run.
enum class WeightType { kF32, kBf16, kQ8_0, kQ4_0, kBf16NoAmx };
constexpr const char* kWeightTypeNames[] = {"f32", "bf16", "q8_0", "q4_0", "bf16_noamx"};

Models& models(std::size_t shape) {
  static std::map<std::size_t, Models> cache;
  Models& m = cache[shape];
  if (!m.f32) {
    Weights<float> w = random_weights<float>(shapes()[shape].cfg, 42);
    m.bf = std::make_unique<Model<float, bf16>>(convert_weights<bf16>(w));
    m.q8 = std::make_unique<Model<float, Q8_0>>(quantize_weights<Q8_0>(w));
    m.q4 = std::make_unique<Model<float, Q4_0>>(quantize_weights<Q4_0>(w));
    m.f32 = std::make_unique<Model<float>>(std::move(w));
  }
  return m;
}

/// Runs fn on the model of this shape with weights of type wt.
template <class Fn>
void with_model(std::size_t shape, WeightType wt, Fn&& fn) {
  Models& m = models(shape);
  switch (wt) {
    case WeightType::kBf16:
    case WeightType::kBf16NoAmx:
      return fn(*m.bf);
    case WeightType::kQ8_0:
      return fn(*m.q8);
    case WeightType::kQ4_0:
      return fn(*m.q4);
    case WeightType::kF32:
      break;
  }
  fn(*m.f32);
}

/// Bytes a decode step at `context` cached positions must read: every weight once plus every
/// cached K and V row (f32) of every layer.
template <class W>
double decode_bytes(const Model<float, W>& model, std::size_t context) {
  const ModelConfig& c = model.config();
  const double kv = 2.0 * static_cast<double>(context + 1) * static_cast<double>(c.kv_dim()) *
                    static_cast<double>(c.n_layers) * sizeof(float);
  return static_cast<double>(model.weights().bytes()) + kv;
}

// ---------------------------------------------------------------------------------------------
// Decode and prefill.
// ---------------------------------------------------------------------------------------------

template <class W>
void decode_loop(benchmark::State& state, const Model<float, W>& model, std::size_t threads,
                 std::size_t context) {
  const ModelConfig& cfg = model.config();
  ThreadPool* pool = pool_for(threads);
  ContiguousStore<float> cache(cfg);
  Activations<float> prompt_act(cfg, {.max_chunk = 64, .thread_pool = pool});
  Activations<float> act(cfg, {.max_chunk = 1, .thread_pool = pool});
  const auto tokens = [&] {
    std::vector<std::int32_t> t(context + 1);
    for (std::size_t i = 0; i < t.size(); ++i)
      t[i] = static_cast<std::int32_t>((i * 7919 + 1) % static_cast<std::size_t>(cfg.vocab_size));
    return t;
  }();
  model.prefill(std::span<const std::int32_t>(tokens).first(context), cache, prompt_act);
  model.decode(tokens[context], cache, act);  // warm-up
  cache.truncate(context);
  const double bandwidth = probe_now(threads);
  const auto t0 = Clock::now();
  for (auto _ : state) {
    benchmark::DoNotOptimize(model.decode(tokens[context], cache, act).data());
    cache.truncate(context);  // every step sees the same context
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count() /
                         static_cast<double>(state.iterations());
  const double bytes = decode_bytes(model, context);
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()));
  state.SetBytesProcessed(
      static_cast<std::int64_t>(bytes * static_cast<double>(state.iterations())));
  state.counters["tok/s"] = 1.0 / seconds;
  state.counters["GB/s"] = bytes / seconds * 1e-9;
  state.counters["probe_GB/s"] = bandwidth * 1e-9;
  state.counters["roofline%"] = 100.0 * bytes / seconds / bandwidth;
  state.counters["MB/tok"] = bytes * 1e-6;
}

template <class W>
void prefill_loop(benchmark::State& state, const Model<float, W>& model, std::size_t threads) {
  const ModelConfig& cfg = model.config();
  ThreadPool* pool = pool_for(threads);
  ContiguousStore<float> cache(cfg);
  Activations<float> act(cfg, {.max_chunk = kPrefillTokens, .thread_pool = pool});
  std::vector<std::int32_t> tokens(kPrefillTokens);
  for (std::size_t i = 0; i < tokens.size(); ++i)
    tokens[i] =
        static_cast<std::int32_t>((i * 104729 + 3) % static_cast<std::size_t>(cfg.vocab_size));
  // One counted call gives the exact flops of a call (projections, attention, last logits).
  WorkCounters counted;
  act.counters = &counted;
  model.prefill(tokens, cache, act);
  act.counters = nullptr;
  const double flops = static_cast<double>(counted.prefill.flops);
  const auto t0 = Clock::now();
  for (auto _ : state) {
    cache.reset();
    benchmark::DoNotOptimize(model.prefill(tokens, cache, act).data());
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count() /
                         static_cast<double>(state.iterations());
  const double gflops = flops / seconds * 1e-9;
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * kPrefillTokens));
  state.counters["tok/s"] = static_cast<double>(kPrefillTokens) / seconds;
  state.counters["GFLOP/s"] = gflops;
  state.counters["peak%"] = 100.0 * gflops / (kPeakGflops * static_cast<double>(threads));
  // bf16 weights on bf16 pairs run vdpbf16ps, not f32 fmas: their own probe is their peak.
  const auto dim = static_cast<std::size_t>(cfg.dim);
  const bool pairs = detail::packed_pairs_apply<float, W>(active_kernel_set(), dim);
  state.SetLabel(detail::amx_applies<float, W>(active_kernel_set(), dim) ? "amx"
                 : pairs                                                 ? "bf16 pairs"
                                                                         : "");
  const double probe = pairs ? measured_peak<dpbf16_pass>() : measured_peak<fma_pass>();
  if (probe > 0)
    state.counters["probe_peak%"] = 100.0 * gflops / (probe * static_cast<double>(threads));
}

void BM_ShapeDecode(benchmark::State& state, std::size_t shape, std::size_t threads,
                    WeightType wt) {
  with_model(shape, wt, [&](const auto& m) { decode_loop(state, m, threads, kDecodeContext); });
}

void BM_ShapePrefill(benchmark::State& state, std::size_t shape, std::size_t threads,
                     WeightType wt) {
  const bool amx = amx_enabled();
  if (wt == WeightType::kBf16NoAmx) force_amx(false);
  with_model(shape, wt, [&](const auto& m) { prefill_loop(state, m, threads); });
  force_amx(amx);
}

/// A decode step at several contexts (42M, f32): the slope of time over T should be the K/V
/// bytes per position ÷ bandwidth.
void BM_LongContextDecode(benchmark::State& state, std::size_t threads) {
  decode_loop(state, *models(1).f32, threads, static_cast<std::size_t>(state.range(0)));
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  for (const std::int64_t t : {1, 2})
    benchmark::RegisterBenchmark("BM_ReadBandwidth", BM_ReadBandwidth)
        ->Arg(t)
        ->ArgName("threads")
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  benchmark::RegisterBenchmark("BM_FmaPeak", BM_FmaPeak)->Iterations(3)->UseRealTime();
  if (dpbf16_pass(1) > 0)  // the CPU has AVX512_BF16
    benchmark::RegisterBenchmark("BM_Bf16DotPeak", BM_Bf16DotPeak)->Iterations(3)->UseRealTime();
  constexpr WeightType kTypes[] = {WeightType::kF32, WeightType::kBf16, WeightType::kQ8_0,
                                   WeightType::kQ4_0};
  for (std::size_t s = 0; s < shapes().size(); ++s)
    for (const std::size_t t : {1, 2})
      for (const WeightType wt : kTypes) {  // the weight types side by side: interleaved
        const std::string suffix = std::string("/") + shapes()[s].name + "/" +
                                   kWeightTypeNames[static_cast<int>(wt)] +
                                   "/threads:" + std::to_string(t);
        benchmark::RegisterBenchmark(("BM_ShapeDecode" + suffix).c_str(), BM_ShapeDecode, s, t, wt)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
      }
  std::vector<WeightType> prefill_types(std::begin(kTypes), std::end(kTypes));
  if (cpu_supports_amx()) prefill_types.push_back(WeightType::kBf16NoAmx);
  for (std::size_t s = 0; s < shapes().size(); ++s)
    for (const std::size_t t : {1, 2})
      for (const WeightType wt : prefill_types) {
        const std::string suffix = std::string("/") + shapes()[s].name + "/" +
                                   kWeightTypeNames[static_cast<int>(wt)] +
                                   "/threads:" + std::to_string(t);
        benchmark::RegisterBenchmark(("BM_ShapePrefill" + suffix).c_str(), BM_ShapePrefill, s, t,
                                     wt)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
      }
  for (const std::size_t t : {1, 2})
    benchmark::RegisterBenchmark(
        ("BM_LongContextDecode/42M/f32/threads:" + std::to_string(t)).c_str(), BM_LongContextDecode,
        t)
        ->ArgName("T")
        ->Arg(64)
        ->Arg(256)
        ->Arg(512)
        ->Arg(1000)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
