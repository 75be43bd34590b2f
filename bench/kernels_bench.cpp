// The projection kernels alone, each beside its baseline: the hand-written GEMV against Eigen's
// (f32) and the portable loop (bf16), on the 110M classifier's shape (32000 × 768, 98 MB of f32,
// 3× the L3, so every call streams from DRAM), at 1 and 2 threads; and the threaded Eigen GEMM
// of prefill on a 110M FFN shape. Every kernel is checked against the naive loop before timing.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>

#include "kvdecode/detail/kernels.hpp"
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

/// Throws unless y matches the double-accumulated naive GEMV within n·2^-24·Σ|w x| per row
/// (f32 summation), plus, for bf16, the rounding of x to bf16 (2^-8 relative per term).
template <class W>
void check_against_naive(const float* y, const W* w, const float* x, std::size_t rows,
                         std::size_t cols) {
  AlignedBuffer<float> ref(rows);
  detail::gemv_naive(ref.data(), w, x, rows, cols);
  const double rel = static_cast<double>(cols) * 0x1p-24 + (std::is_same_v<W, bf16> ? 0x1p-8 : 0);
  for (std::size_t r = 0; r < rows; ++r) {
    double mag = 0;
    for (std::size_t c = 0; c < cols; ++c)
      mag += std::abs(static_cast<double>(static_cast<float>(w[r * cols + c])) * x[c]);
    if (std::abs(static_cast<double>(y[r]) - ref[r]) > rel * mag + 1e-30)
      throw std::runtime_error("kernel differs from the naive GEMV at row " + std::to_string(r));
  }
}

void set_gemv_counters(benchmark::State& state, std::size_t bytes) {
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(bytes));
}

/// The hand-written kernel (AVX-512 when compiled for it), rows split across the pool.
template <class W>
void BM_Gemv(benchmark::State& state) {
  const auto threads = static_cast<std::size_t>(state.range(0));
  const AlignedBuffer<W>& w = classifier<W>();
  AlignedBuffer<float> y(kRows);
  detail::linear(y.data(), input().data(), w.data(), 1, kCols, kRows, pool_for(threads), nullptr,
                 0);
  check_against_naive(y.data(), w.data(), input().data(), kRows, kCols);
  for (auto _ : state) {
    detail::linear(y.data(), input().data(), w.data(), 1, kCols, kRows, pool_for(threads), nullptr,
                   0);
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
  check_against_naive(y.data(), w.data(), input().data(), kRows, kCols);
  for (auto _ : state) {
    detail::gemv_rows_bf16_portable(y.data(), w.data(), input().data(), 0, kRows, kCols);
    benchmark::DoNotOptimize(y.data());
  }
  set_gemv_counters(state, w.bytes());
}

/// Prefill's projection: 128 tokens × the 110M FFN gate (2048 × 768), Eigen GEMM per thread.
template <class W>
void BM_Gemm(benchmark::State& state) {
  constexpr std::size_t n = 128, in = 768, out = 2048;
  const auto threads = static_cast<std::size_t>(state.range(0));
  const AlignedBuffer<W> w = random_buffer<W>(out * in, 3);
  const AlignedBuffer<float> x = random_buffer<float>(n * in, 4);
  AlignedBuffer<float> y(n * out);
  AlignedBuffer<float> panels(threads * detail::kPanelRows * in);
  for (auto _ : state) {
    detail::linear(y.data(), x.data(), w.data(), n, in, out, pool_for(threads), panels.data(),
                   detail::kPanelRows * in);
    benchmark::DoNotOptimize(y.data());
  }
  const double flops = 2.0 * n * in * out;
  state.counters["GFLOP/s"] = benchmark::Counter(
      flops * static_cast<double>(state.iterations()) * 1e-9, benchmark::Counter::kIsRate);
}

BENCHMARK(BM_GemvEigen)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK_TEMPLATE(BM_Gemv, float)->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_GemvBf16Portable)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK_TEMPLATE(BM_Gemv, bf16)->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK_TEMPLATE(BM_Gemm, float)->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK_TEMPLATE(BM_Gemm, bf16)->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
