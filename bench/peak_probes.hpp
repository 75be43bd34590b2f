// Arithmetic peaks measured on the machine the benchmarks run on: one thread's f32 FMA rate and
// its vdpbf16ps rate, from independent chains long enough to cover the instructions' latency.
// Compiled with the kernels' target attributes, so a build without -march flags measures the
// same peak as a native one; 0 where the CPU lacks the instructions.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstddef>

#include "kvdecode/kvdecode.hpp"  // and <immintrin.h>, through detail/cpu.hpp

namespace kvdecode::bench {

#if KVDECODE_X86_KERNELS
KVDECODE_INTRINSICS_BEGIN
/// Seconds of 12 independent 512-bit FMA chains (enough to cover a 4-cycle latency on 2-3
/// pipes) for `reps` steps.
KVDECODE_TARGET_AVX512 inline double fma_chains(std::size_t reps) {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  const auto t0 = std::chrono::steady_clock::now();
  for (std::size_t r = 0; r < reps; ++r)
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (int i = 1; i < 12; ++i) acc[0] = _mm512_add_ps(acc[0], acc[i]);
  benchmark::DoNotOptimize(acc[0]);
  return s;
}

/// Seconds of 12 independent vdpbf16ps chains for `reps` steps.
KVDECODE_TARGET_AVX512BF16 inline double dpbf16_chains(std::size_t reps) {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  const auto a = (__m512bh)_mm512_set1_epi16(0x3F80);  // bf16 1.0
  const auto b = (__m512bh)_mm512_set1_epi16(0x3380);  // bf16 2^-24
  const auto t0 = std::chrono::steady_clock::now();
  for (std::size_t r = 0; r < reps; ++r)
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (int i = 1; i < 12; ++i) acc[0] = _mm512_add_ps(acc[0], acc[i]);
  benchmark::DoNotOptimize(acc[0]);
  return s;
}
KVDECODE_INTRINSICS_END
#endif

#if KVDECODE_X86_KERNELS
/// GFLOP/s of `chains` (12 chains of an instruction of `flops` flops, `reps` steps) where the
/// CPU has set ks; 0 where it has not.
inline double chains_gflops(KernelSet ks, double (*chains)(std::size_t), double flops,
                            std::size_t reps) {
  if (!cpu_supports(ks)) return 0;
  return static_cast<double>(reps) * 12 * flops / chains(reps) * 1e-9;
}
/// One thread's 512-bit f32 FMAs (16 lanes × 2 flops an instruction).
inline double fma_pass(std::size_t reps) {
  return chains_gflops(KernelSet::kAvx512, fma_chains, 16 * 2, reps);
}
/// vdpbf16ps (two bf16 products per lane: 64 flops an instruction), the instruction of
/// bf16-weight prefill on bf16 pairs.
inline double dpbf16_pass(std::size_t reps) {
  return chains_gflops(KernelSet::kAvx512Bf16, dpbf16_chains, 32 * 2, reps);
}
#else
inline double fma_pass(std::size_t) { return 0; }
inline double dpbf16_pass(std::size_t) { return 0; }
#endif

/// The measured per-core peak of a probe, once per run (best of 3 × ~20 ms).
template <double (*kPass)(std::size_t)>
double measured_peak() {
  static const double peak = [] {
    double best = 0;
    for (int i = 0; i < 3; ++i) best = std::max(best, kPass(std::size_t{1} << 22));
    return best;
  }();
  return peak;
}

}  // namespace kvdecode::bench
