// The projection kernels alone, each beside its baseline: the GEMV of every kernel set this CPU
// runs against Eigen's (f32) and the portable loop (bf16), on the 110M classifier's shape
// (32000 × 768, 98 MB of f32: from DRAM where the L3 is smaller, partly from the L3 where it is
// not), at 1 and 2 threads; the threaded GEMM of prefill on a 110M FFN shape; a batched step's
// few-token kernels (gemm_few, gemm_lanes) in L2 and streaming, and one token's GEMV beside 16
// tokens' gemm_lanes over a 1 GiB ring of matrices (from DRAM on any L3); and, where the CPU
// has AMX, the AMX GEMM with per-call and pre-packed weight panels beside gemm_few. Before any
// timing, every set's GEMV and GEMM are checked against the naive loop on odd sizes (every
// masked tail), and each timed kernel on its own shape.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvdecode/detail/gemm_lanes.hpp"
#include "kvdecode/detail/gemv.hpp"
#include "kvdecode/detail/linear.hpp"
#include "kvdecode/kvdecode.hpp"

namespace {

using namespace kvdecode;

ThreadPool* pool_for(std::size_t threads) {
  static std::map<std::size_t, std::unique_ptr<ThreadPool>> pools;
  if (threads <= 1) return nullptr;
  auto& p = pools[threads];
  if (!p) p = std::make_unique<ThreadPool>(threads);
  return p.get();
}

template <class W>
AlignedBuffer<W> random_buffer(std::size_t n, std::uint64_t seed) {
  AlignedBuffer<W> b(n);
  detail::SplitMix64 rng(seed);
  for (std::size_t i = 0; i < n; ++i) b[i] = static_cast<W>(static_cast<float>(rng.symmetric()));
  return b;
}

constexpr std::size_t kRows = 32000;
constexpr std::size_t kCols = 768;

template <class W>
const AlignedBuffer<W>& classifier() {
  static const AlignedBuffer<W> w = random_buffer<W>(kRows * kCols, 1);
  return w;
}
const AlignedBuffer<float>& input() {
  static const AlignedBuffer<float> x = random_buffer<float>(kCols, 2);
  return x;
}

/// Throws unless y [n][rows] matches the double-accumulated naive product within
/// n·2^-24·Σ|w x| per output (f32 summation); for bf16 weights the naive loop takes x rounded
/// to bf16, as every bf16 kernel does.
template <class W>
void check_against_naive(const float* y, const W* w, const float* x, std::size_t n,
                         std::size_t rows, std::size_t cols, const char* what) {
  std::vector<float> xr(x, x + n * cols);
  if constexpr (std::is_same_v<W, bf16>) detail::round_to_bf16(x, xr.data(), n * cols);
  AlignedBuffer<float> ref(rows);
  for (std::size_t t = 0; t < n; ++t) {
    detail::gemv_naive(ref.data(), w, xr.data() + t * cols, rows, cols);
    for (std::size_t r = 0; r < rows; ++r) {
      double mag = 0;
      for (std::size_t c = 0; c < cols; ++c)
        mag +=
            std::abs(static_cast<double>(static_cast<float>(w[r * cols + c])) * xr[t * cols + c]);
      if (std::abs(static_cast<double>(y[t * rows + r]) - ref[r]) >
          static_cast<double>(cols) * 0x1p-24 * mag + 1e-30)
        throw std::runtime_error(std::string(what) + " differs from the naive product at " +
                                 std::to_string(n) + "×" + std::to_string(rows) + "×" +
                                 std::to_string(cols) + ", token " + std::to_string(t) + " row " +
                                 std::to_string(r));
    }
  }
}

/// y [n][out] = x [n][in] · wᵀ through linear_group with kernel set ks on pool.
template <class W>
void project(KernelSet ks, float* y, const float* x, const W* w, std::size_t n, std::size_t in,
             std::size_t out, ThreadPool* pool, float* panels, float* x_rounded) {
  detail::linear_group<float, W>({{y, w, out}}, x, n, in, pool,
                                 {panels, detail::kPanelRows * in, x_rounded}, ks);
}

/// Every supported set's projections on odd sizes (tails of every step width, one and a few and
/// many tokens, 1 and 2 threads) against the naive loop; throws on the first mismatch.
template <class W>
void check_odd_sizes() {
  for (const KernelSet ks : kKernelSets) {
    if (!cpu_supports(ks)) continue;
    for (const std::size_t in : {1, 7, 17, 31, 33, 63, 65, 95, 129, 295})
      for (const std::size_t out : {1, 13, 70})
        for (const std::size_t n : {1, 3, 16, 17})
          for (const std::size_t threads : {1, 2}) {
            const AlignedBuffer<W> w = random_buffer<W>(out * in, in + out);
            const AlignedBuffer<float> x = random_buffer<float>(n * in, n + in);
            AlignedBuffer<float> y(n * out), panels(threads * detail::kPanelRows * in),
                rounded(n * in);
            project(ks, y.data(), x.data(), w.data(), n, in, out, pool_for(threads), panels.data(),
                    rounded.data());
            check_against_naive(y.data(), w.data(), x.data(), n, out, in, kernel_set_name(ks));
          }
  }
}

void set_gemv_counters(benchmark::State& state, std::size_t bytes) {
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(bytes));
}

/// Kernel set range(1) (its index in kKernelSets), rows split across range(0) threads.
template <class W>
void BM_Gemv(benchmark::State& state) {
  const auto threads = static_cast<std::size_t>(state.range(0));
  const KernelSet ks = kKernelSets[static_cast<std::size_t>(state.range(1))];
  if (!cpu_supports(ks)) {
    state.SkipWithError((std::string("this CPU cannot run ") + kernel_set_name(ks)).c_str());
    return;
  }
  state.SetLabel(kernel_set_name(ks));
  const AlignedBuffer<W>& w = classifier<W>();
  AlignedBuffer<float> y(kRows);
  project(ks, y.data(), input().data(), w.data(), 1, kCols, kRows, pool_for(threads), nullptr,
          nullptr);
  check_against_naive(y.data(), w.data(), input().data(), 1, kRows, kCols, kernel_set_name(ks));
  for (auto _ : state) {
    project(ks, y.data(), input().data(), w.data(), 1, kCols, kRows, pool_for(threads), nullptr,
            nullptr);
    benchmark::DoNotOptimize(y.data());
  }
  set_gemv_counters(state, w.bytes());
}

/// Baseline f32: Eigen's GEMV (what detail::matmul did before), one thread.
void BM_GemvEigen(benchmark::State& state) {
  const AlignedBuffer<float>& w = classifier<float>();
  AlignedBuffer<float> y(kRows);
  for (auto _ : state) {
    detail::matmul(y.data(), input().data(), w.data(), 1, kCols, kRows);
    benchmark::DoNotOptimize(y.data());
  }
  set_gemv_counters(state, w.bytes());
}

/// Baseline bf16: the portable loop, one thread.
void BM_GemvBf16Portable(benchmark::State& state) {
  const AlignedBuffer<bf16>& w = classifier<bf16>();
  AlignedBuffer<float> y(kRows);
  detail::gemv_rows_bf16_portable(y.data(), w.data(), input().data(), 0, kRows, kCols);
  check_against_naive(y.data(), w.data(), input().data(), 1, kRows, kCols, "portable bf16");
  for (auto _ : state) {
    detail::gemv_rows_bf16_portable(y.data(), w.data(), input().data(), 0, kRows, kCols);
    benchmark::DoNotOptimize(y.data());
  }
  set_gemv_counters(state, w.bytes());
}

/// Prefill's projection: 128 tokens × the 110M FFN gate (2048 × 768), the GEMM per thread.
template <class W>
void BM_Gemm(benchmark::State& state) {
  constexpr std::size_t n = 128, in = 768, out = 2048;
  const auto threads = static_cast<std::size_t>(state.range(0));
  const AlignedBuffer<W> w = random_buffer<W>(out * in, 3);
  const AlignedBuffer<float> x = random_buffer<float>(n * in, 4);
  AlignedBuffer<float> y(n * out);
  AlignedBuffer<float> panels(threads * detail::kPanelRows * in), rounded(n * in);
  const KernelSet ks = active_kernel_set();
  state.SetLabel(kernel_set_name(ks));
  project(ks, y.data(), x.data(), w.data(), n, in, out, pool_for(threads), panels.data(),
          rounded.data());
  check_against_naive(y.data(), w.data(), x.data(), 4, out, in, "GEMM");  // the first 4 tokens
  for (auto _ : state) {
    project(ks, y.data(), x.data(), w.data(), n, in, out, pool_for(threads), panels.data(),
            rounded.data());
    benchmark::DoNotOptimize(y.data());
  }
  const double flops = 2.0 * n * in * out;
  state.counters["GFLOP/s"] = benchmark::Counter(
      flops * static_cast<double>(state.iterations()) * 1e-9, benchmark::Counter::kIsRate);
}

/// The AMX GEMM alone, one thread, n tokens × (out, in): each weight panel re-laid for the B
/// tiles per call (prepacked 0, what prefill runs), or the matrix re-laid once beforehand
/// (prepacked 1: what keeping a second, packed copy of the weights would give). Weights stay
/// in L2 / L3 between calls: the arithmetic, not the stream from memory.
void BM_GemmAmx(benchmark::State& state) {
  if (!cpu_supports_amx()) {
    state.SkipWithError("this CPU lacks AMX-BF16 or the OS refused the tiles");
    return;
  }
  const auto n = static_cast<std::size_t>(state.range(0));
  const auto out = static_cast<std::size_t>(state.range(1));
  const auto in = static_cast<std::size_t>(state.range(2));
  const bool prepacked = state.range(3) != 0;
  const AlignedBuffer<bf16> w = random_buffer<bf16>(out * in, 3);
  const AlignedBuffer<float> x = random_buffer<float>(n * in, 4);
  AlignedBuffer<float> y(n * out);
  AlignedBuffer<bf16> a(n * detail::amx_lda(in));
  AlignedBuffer<bf16> panel(detail::kAmxPanelRows * detail::amx_lda(in));
  AlignedBuffer<bf16> packed(detail::amx_packed_size(out, in));
  detail::pack_weights_amx(packed.data(), w.data(), out, in);
  for (auto _ : state) {
    detail::pack_x_amx(a.data(), x.data(), n, in);
    detail::gemm_amx(y.data(), a.data(), w.data(), n, in, out, 0, out, panel.data(),
                     prepacked ? packed.data() : nullptr);
    benchmark::DoNotOptimize(y.data());
  }
  check_against_naive(y.data(), w.data(), x.data(), std::min<std::size_t>(n, 4), out, in,
                      "AMX GEMM");
  const double flops = 2.0 * static_cast<double>(n * in * out);
  state.counters["GFLOP/s"] = benchmark::Counter(
      flops * static_cast<double>(state.iterations()) * 1e-9, benchmark::Counter::kIsRate);
}

/// The same products with the avx512bf16 set's gemm_few (batched decode's kernel), x rounded
/// per call as linear_group rounds it.
void BM_GemmFewBf16(benchmark::State& state) {
  if (!cpu_supports(KernelSet::kAvx512Bf16)) {
    state.SkipWithError("this CPU lacks AVX512_BF16");
    return;
  }
  const auto n = static_cast<std::size_t>(state.range(0));
  const auto out = static_cast<std::size_t>(state.range(1));
  const auto in = static_cast<std::size_t>(state.range(2));
  const AlignedBuffer<bf16> w = random_buffer<bf16>(out * in, 3);
  const AlignedBuffer<float> x = random_buffer<float>(n * in, 4);
  AlignedBuffer<float> y(n * out), rounded(n * in);
  for (auto _ : state) {
    detail::round_to_bf16(x.data(), rounded.data(), n * in);
    detail::gemm_few<float, bf16>(KernelSet::kAvx512Bf16, y.data(), rounded.data(), w.data(), n, in,
                                  out, 0, out, nullptr);
    benchmark::DoNotOptimize(y.data());
  }
  const double flops = 2.0 * static_cast<double>(n * in * out);
  state.counters["GFLOP/s"] = benchmark::Counter(
      flops * static_cast<double>(state.iterations()) * 1e-9, benchmark::Counter::kIsRate);
}

/// A batched step's projection, one thread, the active set, f32 or bf16 weights: range(0)
/// tokens through gemm_few (range(1) = 0, each output summed as the GEMV), gemm_lanes without a
/// panel (1, the weight-lane tiles) or with the thread's panel (2: the token-lane tiles, f32 on
/// AVX-512 from kTokenLanesMin tokens, bf16 in avx512bf16 from kTokenPairLanesMin), on a
/// 512 × 512 block that stays in L2 (range(2) = 0) or the 15M classifier, 32000 × 288 (37 MB
/// in f32, streamed from memory; 1).
template <class W>
void BM_FewTokens(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const bool lanes = state.range(1) >= 1;
  const bool with_panel = state.range(1) == 2;
  const std::size_t out = state.range(2) == 0 ? 512 : 32000;
  const std::size_t in = state.range(2) == 0 ? 512 : 288;
  const AlignedBuffer<W> w = random_buffer<W>(out * in, 5);
  AlignedBuffer<float> x = random_buffer<float>(n * in, 6);  // [n][in], rounded for bf16 weights
  if constexpr (std::is_same_v<W, bf16>) detail::round_to_bf16(x.data(), x.data(), n * in);
  AlignedBuffer<float> y(n * out);
  AlignedBuffer<float> panel(detail::kPanelRows * in);  // [kPanelRows][in] the thread's scratch
  const KernelSet ks = active_kernel_set();
  state.SetLabel(std::string(kernel_set_name(ks)) + (with_panel ? " gemm_lanes+panel"
                                                     : lanes    ? " gemm_lanes"
                                                                : " gemm_few"));
  const auto run = [&] {
    if (lanes) {
      detail::gemm_lanes(ks, y.data(), x.data(), w.data(), n, in, out, 0, out,
                         with_panel ? panel.data() : nullptr);
    } else {
      detail::gemm_few(ks, y.data(), x.data(), w.data(), n, in, out, 0, out,
                       static_cast<float*>(nullptr));
    }
  };
  run();
  check_against_naive(y.data(), w.data(), x.data(), n, out, in, "few tokens");
  for (auto _ : state) {
    run();
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["GFLOP/s"] = benchmark::Counter(
      2.0 * static_cast<double>(n * in * out) * static_cast<double>(state.iterations()) * 1e-9,
      benchmark::Counter::kIsRate);
}

/// One token's GEMV against 16 tokens' gemm_lanes (the thread's panel: tokens in lanes), each
/// call on the next of a ring of 1376 × 512 matrices (42M's w1) filling kStreamBytes, so every
/// call reads its weights from DRAM whatever the L3: the streaming rate one core reaches with
/// and without a batch's arithmetic between its loads.
constexpr std::size_t kStreamBytes = std::size_t{1} << 30;
constexpr std::size_t kStreamOut = 1376;
constexpr std::size_t kStreamIn = 512;
constexpr std::size_t kStreamCount = kStreamBytes / (kStreamOut * kStreamIn * sizeof(float));

/// [kStreamCount][kStreamOut][kStreamIn]: copies of one random matrix, built once for every run.
const AlignedBuffer<float>& stream_ring() {
  static const AlignedBuffer<float> ring = [] {
    constexpr std::size_t size = kStreamOut * kStreamIn;
    AlignedBuffer<float> r(kStreamCount * size);
    const AlignedBuffer<float> one = random_buffer<float>(size, 7);
    for (std::size_t m = 0; m < kStreamCount; ++m) std::copy_n(one.data(), size, &r[m * size]);
    return r;
  }();
  return ring;
}

void BM_StreamedProjection(benchmark::State& state) {
  const std::size_t n = state.range(0) == 0 ? 1 : 16;
  constexpr std::size_t out = kStreamOut;
  constexpr std::size_t in = kStreamIn;
  constexpr std::size_t count = kStreamCount;
  const AlignedBuffer<float>& ring = stream_ring();
  const AlignedBuffer<float> x = random_buffer<float>(n * in, 8);
  AlignedBuffer<float> y(n * out);
  AlignedBuffer<float> panel(detail::kPanelRows * in);  // [kPanelRows][in] the thread's scratch
  const KernelSet ks = active_kernel_set();
  state.SetLabel(std::string(kernel_set_name(ks)) + (n == 1 ? " gemv" : " gemm_lanes+panel"));
  std::size_t m = 0;
  const auto run = [&] {
    const float* w = &ring[m * out * in];
    if (n == 1) {
      detail::gemv_rows(ks, y.data(), w, x.data(), 0, out, in);
    } else {
      detail::gemm_lanes(ks, y.data(), x.data(), w, n, in, out, 0, out, panel.data());
    }
    m = (m + 1) % count;
  };
  run();
  check_against_naive(y.data(), ring.data(), x.data(), n, out, in, "streamed projection");
  for (auto _ : state) {
    run();
    benchmark::DoNotOptimize(y.data());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * out * in * sizeof(float)));
  state.counters["GFLOP/s"] = benchmark::Counter(
      2.0 * static_cast<double>(n * in * out) * static_cast<double>(state.iterations()) * 1e-9,
      benchmark::Counter::kIsRate);
}

BENCHMARK(BM_GemvEigen)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_GemvBf16Portable)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK_TEMPLATE(BM_Gemm, float)->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK_TEMPLATE(BM_Gemm, bf16)->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_StreamedProjection)
    ->ArgName("batch16")
    ->Arg(0)
    ->Arg(1)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_TEMPLATE(BM_FewTokens, float)
    ->ArgsProduct({{2, 4, 16}, {0, 1, 2}, {0, 1}})
    ->ArgNames({"n", "lanes", "classifier"})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_TEMPLATE(BM_FewTokens, bf16)
    ->ArgsProduct({{2, 4, 12, 13, 16}, {0, 1, 2}, {0, 1}})
    ->ArgNames({"n", "lanes", "classifier"})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

/// The benchmarks of instruction sets: registered for what this CPU runs, and a line on standard
/// error for each one it cannot (a skip, where SkipWithError would report a failure).
void register_by_cpu() {
  std::vector<std::int64_t> sets;
  for (std::size_t i = 0; i < kKernelSets.size(); ++i) {
    if (cpu_supports(kKernelSets[i])) {
      sets.push_back(static_cast<std::int64_t>(i));
    } else {
      std::fprintf(stderr, "kernels_bench: skipped BM_Gemv/set:%zu: this CPU cannot run %s\n", i,
                   std::string(kernel_set_name(kKernelSets[i])).c_str());
    }
  }
  for (auto* b : {benchmark::RegisterBenchmark("BM_Gemv<float>", BM_Gemv<float>),
                  benchmark::RegisterBenchmark("BM_Gemv<bf16>", BM_Gemv<bf16>)})
    b->ArgsProduct({{1, 2}, sets})
        ->ArgNames({"threads", "set"})
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  if (cpu_supports_amx()) {
    benchmark::RegisterBenchmark("BM_GemmAmx", BM_GemmAmx)
        // 128 tokens through the projections of the 15M, 42M and 110M shapes
        ->ArgsProduct({{128}, {288, 768}, {288, 768}, {0, 1}})
        ->ArgsProduct({{128}, {512, 1376}, {512, 1376}, {0, 1}})
        ->ArgsProduct({{128}, {768, 2048}, {768, 2048}, {0, 1}})
        ->ArgsProduct({{4, 8, 16}, {768, 2048}, {768}, {0}})  // batched-decode sizes
        ->ArgNames({"n", "out", "in", "prepacked"})
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  } else {
    std::fprintf(stderr,
                 "kernels_bench: skipped BM_GemmAmx: this CPU lacks AMX-BF16 or the OS refused "
                 "the tiles\n");
  }
  if (cpu_supports(KernelSet::kAvx512Bf16)) {
    benchmark::RegisterBenchmark("BM_GemmFewBf16", BM_GemmFewBf16)
        ->ArgsProduct({{4, 8, 16}, {768, 2048}, {768}})
        ->ArgNames({"n", "out", "in"})
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  } else {
    std::fprintf(stderr, "kernels_bench: skipped BM_GemmFewBf16: this CPU lacks AVX512_BF16\n");
  }
}

}  // namespace

int main(int argc, char** argv) {
  check_odd_sizes<float>();
  check_odd_sizes<bf16>();
  register_by_cpu();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
