// GEMV over a range of weight rows, y[r] = Σ_c w[r][c]·x[c] (decode: each weight read once per
// token, so memory bound), for f32 and bf16 weights, in every kernel set of cpu.hpp, beside the
// naive double-precision loop they are checked against.
//
// bf16 weights, one rule on every path (GEMV, gemm_few, gemm_cols, every set): x is rounded to
// bf16 (nearest-even, bf16.hpp) at the input of each weight product, each bf16 × bf16 product is
// exact in f32, and the products are summed in f32; paths differ only in summation order. (The
// AVX512_BF16 instructions also flush subnormal inputs to zero, values below 2^-126.)
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvdecode/bf16.hpp"
#include "kvdecode/detail/cpu.hpp"
#include "kvdecode/detail/ops.hpp"
#include "kvdecode/detail/prefetch.hpp"

namespace kvdecode::detail {

// ---------------------------------------------------------------------------------------------
// Naive reference: the plain loop every optimised kernel is checked against (tests, benches).
// ---------------------------------------------------------------------------------------------

/// y [rows] = w [rows][cols] · x [cols], one double-precision sum per row.
template <class T, class W>
void gemv_naive(T* y, const W* w, const T* x, std::size_t rows, std::size_t cols) {
  for (std::size_t r = 0; r < rows; ++r) {
    double sum = 0;
    for (std::size_t c = 0; c < cols; ++c)
      sum += static_cast<double>(widen<T>(w[r * cols + c])) * static_cast<double>(x[c]);
    y[r] = static_cast<T>(sum);
  }
}

/// Longest input whose rounded copy the bf16 GEMVs keep on the stack (32 KiB as f32); longer
/// ones round x inside the row loop instead (same rounding, so the same result).
inline constexpr std::size_t kMaxStackCols = 8192;

// ---------------------------------------------------------------------------------------------
// Portable: Eigen for f32, a plain loop for bf16.
// ---------------------------------------------------------------------------------------------

template <class T>
void gemv_rows_portable(T* y, const T* w, const T* x, std::size_t r0, std::size_t r1,
                        std::size_t cols) {
  const auto ci = static_cast<Eigen::Index>(cols);
  const Eigen::Map<const RowMatrix<T>> wm(w + r0 * cols, static_cast<Eigen::Index>(r1 - r0), ci);
  VectorMap<T>(y + r0, static_cast<Eigen::Index>(r1 - r0)).noalias() =
      wm * ConstVectorMap<T>(x, ci);
}

/// bf16 weight × bf16-rounded x, summed in f32 with four partial sums.
inline void gemv_rows_bf16_portable(float* y, const bf16* w, const float* x, std::size_t r0,
                                    std::size_t r1, std::size_t cols) {
  for (std::size_t r = r0; r < r1; ++r) {
    const bf16* wr = w + r * cols;
    float s[4] = {0, 0, 0, 0};
    std::size_t c = 0;
    for (; c + 4 <= cols; c += 4)
      for (std::size_t k = 0; k < 4; ++k)
        s[k] += static_cast<float>(wr[c + k]) * static_cast<float>(bf16(x[c + k]));
    for (; c < cols; ++c) s[0] += static_cast<float>(wr[c]) * static_cast<float>(bf16(x[c]));
    y[r] = (s[0] + s[1]) + (s[2] + s[3]);
  }
}

#if KVDECODE_X86_KERNELS
KVDECODE_INTRINSICS_BEGIN

// ---------------------------------------------------------------------------------------------
// Prefetch: every set's GEMV asks for its weights' cache lines ahead of the loads.
// ---------------------------------------------------------------------------------------------

/// How far ahead of the weights being multiplied the GEMVs ask for their cache lines (into the
/// next rows past a row's end): one core reading one row at a time keeps too few lines in
/// flight to reach the memory's bandwidth, f32 or bf16, AVX2 or AVX-512.
inline constexpr std::size_t kGemvPrefetchBytes = 2048;

/// Asks for the cache line kGemvPrefetchBytes past p. Past the matrix's end that address may be
/// unmapped: a prefetch instruction never faults, and the address is formed as an integer.
KVDECODE_TARGET_AVX2 KVDECODE_PREFETCH_INLINE void prefetch_weights_ahead(const void* p) {
  const std::uintptr_t ahead = reinterpret_cast<std::uintptr_t>(p) + kGemvPrefetchBytes;
  _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
}

// ---------------------------------------------------------------------------------------------
// AVX2 + FMA: 8 lanes.
// ---------------------------------------------------------------------------------------------

/// Lanes [0, left) set, left in 1..7.
KVDECODE_TARGET_AVX2 inline __m256i tail_mask_avx2(std::size_t left) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

KVDECODE_TARGET_AVX2 inline float reduce_add_avx2(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

/// R weight rows × N inputs (w [R][cols], x [N][cols]; y[j·y_stride + i]): every load of a
/// weight row feeds N inputs and every load of an input feeds R rows. Each (row, input) sums
/// the same way whatever R and N (two accumulators over alternate 8-column halves of every 16,
/// the tail in the second), so the GEMV (R = N = 1) and gemm_few agree bit for bit. kPrefetch:
/// each 64-byte step of a row also asks for the line kGemvPrefetchBytes ahead (the GEMV).
#if defined(__clang__)
#define KVDECODE_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define KVDECODE_UNROLL _Pragma("GCC unroll 16")
#else
#define KVDECODE_UNROLL
#endif
template <int R, int N, bool kPrefetch = false>
KVDECODE_TARGET_AVX2 inline void dot_block_f32_avx2(float* y, std::size_t y_stride, const float* w,
                                                    const float* x, std::size_t cols) {
  __m256 acc0[R][N];
  __m256 acc1[R][N];
  KVDECODE_UNROLL
  for (int i = 0; i < R; ++i) KVDECODE_UNROLL
  for (int j = 0; j < N; ++j) acc0[i][j] = acc1[i][j] = _mm256_setzero_ps();
  const auto wr = [&](int i) { return w + static_cast<std::size_t>(i) * cols; };
  const auto xr = [&](int j) { return x + static_cast<std::size_t>(j) * cols; };
  std::size_t c = 0;
  for (; c + 16 <= cols; c += 16) {
    KVDECODE_UNROLL
    for (int i = 0; i < R; ++i) {
      if constexpr (kPrefetch) prefetch_weights_ahead(wr(i) + c);
      const __m256 w0 = _mm256_loadu_ps(wr(i) + c);
      const __m256 w1 = _mm256_loadu_ps(wr(i) + c + 8);
      KVDECODE_UNROLL
      for (int j = 0; j < N; ++j) {
        acc0[i][j] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr(j) + c), acc0[i][j]);
        acc1[i][j] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr(j) + c + 8), acc1[i][j]);
      }
    }
  }
  if (c + 8 <= cols) {
    KVDECODE_UNROLL
    for (int i = 0; i < R; ++i) {
      const __m256 w0 = _mm256_loadu_ps(wr(i) + c);
      KVDECODE_UNROLL
      for (int j = 0; j < N; ++j)
        acc0[i][j] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr(j) + c), acc0[i][j]);
    }
    c += 8;
  }
  if (c < cols) {  // 1..7 columns left: masked loads read nothing past the row
    const __m256i m = tail_mask_avx2(cols - c);
    KVDECODE_UNROLL
    for (int i = 0; i < R; ++i) {
      const __m256 w0 = _mm256_maskload_ps(wr(i) + c, m);
      KVDECODE_UNROLL
      for (int j = 0; j < N; ++j)
        acc1[i][j] = _mm256_fmadd_ps(w0, _mm256_maskload_ps(xr(j) + c, m), acc1[i][j]);
    }
  }
  KVDECODE_UNROLL
  for (int i = 0; i < R; ++i) KVDECODE_UNROLL
  for (int j = 0; j < N; ++j)
    y[static_cast<std::size_t>(j) * y_stride + static_cast<std::size_t>(i)] =
        reduce_add_avx2(_mm256_add_ps(acc0[i][j], acc1[i][j]));
}

KVDECODE_TARGET_AVX2 inline void gemv_rows_f32_avx2(float* y, const float* w, const float* x,
                                                    std::size_t r0, std::size_t r1,
                                                    std::size_t cols) {
  for (std::size_t r = r0; r < r1; ++r)
    dot_block_f32_avx2<1, 1, true>(y + r, 1, w + r * cols, x, cols);
}

/// 8 values rounded to bf16 (nearest-even) and widened back: bf16(float) of bf16.hpp, lane-wise.
KVDECODE_TARGET_AVX2 inline __m256 round_bf16_avx2(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m256i rounded =
      _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), hi);
  const __m256i quiet_nan = _mm256_and_si256(_mm256_or_si256(u, _mm256_set1_epi32(0x400000)), hi);
  return _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(quiet_nan),
                          _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

/// 8 bf16 weights widened to f32 (exact: the upper half of a float).
KVDECODE_TARGET_AVX2 inline __m256 widen_bf16_avx2(const bf16* w) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))), 16));
}

template <bool kRoundX>
KVDECODE_TARGET_AVX2 inline __m256 load_x_avx2(const float* p) {
  const __m256 v = _mm256_loadu_ps(p);
  return kRoundX ? round_bf16_avx2(v) : v;
}

/// One bf16 row · x: x already rounded (kRoundX false) or rounded here; same order as the f32
/// GEMV (two accumulators over alternate 8-column halves, the tail in the second). kPrefetch:
/// each 64-byte step also asks for the line kGemvPrefetchBytes ahead (the GEMV).
template <bool kRoundX, bool kPrefetch = false>
KVDECODE_TARGET_AVX2 inline float dot_bf16_avx2(const bf16* w, const float* x, std::size_t cols) {
  __m256 acc0 = _mm256_setzero_ps();
  __m256 acc1 = _mm256_setzero_ps();
  std::size_t c = 0;
  for (; c + 32 <= cols; c += 32) {  // the 16-column step twice: one cache line of weights
    if constexpr (kPrefetch) prefetch_weights_ahead(w + c);
    acc0 = _mm256_fmadd_ps(widen_bf16_avx2(w + c), load_x_avx2<kRoundX>(x + c), acc0);
    acc1 = _mm256_fmadd_ps(widen_bf16_avx2(w + c + 8), load_x_avx2<kRoundX>(x + c + 8), acc1);
    acc0 = _mm256_fmadd_ps(widen_bf16_avx2(w + c + 16), load_x_avx2<kRoundX>(x + c + 16), acc0);
    acc1 = _mm256_fmadd_ps(widen_bf16_avx2(w + c + 24), load_x_avx2<kRoundX>(x + c + 24), acc1);
  }
  if (c + 16 <= cols) {
    acc0 = _mm256_fmadd_ps(widen_bf16_avx2(w + c), load_x_avx2<kRoundX>(x + c), acc0);
    acc1 = _mm256_fmadd_ps(widen_bf16_avx2(w + c + 8), load_x_avx2<kRoundX>(x + c + 8), acc1);
    c += 16;
  }
  if (c + 8 <= cols) {
    acc0 = _mm256_fmadd_ps(widen_bf16_avx2(w + c), load_x_avx2<kRoundX>(x + c), acc0);
    c += 8;
  }
  if (c < cols) {  // 1..7 columns: copied out, as AVX2 has no masked 16-bit load
    bf16 wt[8] = {};
    std::memcpy(wt, w + c, (cols - c) * sizeof(bf16));
    __m256 xt = _mm256_maskload_ps(x + c, tail_mask_avx2(cols - c));
    if (kRoundX) xt = round_bf16_avx2(xt);
    acc1 = _mm256_fmadd_ps(widen_bf16_avx2(wt), xt, acc1);
  }
  return reduce_add_avx2(_mm256_add_ps(acc0, acc1));
}

KVDECODE_TARGET_AVX2 inline void gemv_rows_bf16_avx2(float* y, const bf16* w, const float* x,
                                                     std::size_t r0, std::size_t r1,
                                                     std::size_t cols) {
  if (cols <= kMaxStackCols) {
    alignas(32) float xr[kMaxStackCols];  // x rounded to bf16 once per call
    std::size_t c = 0;
    for (; c + 8 <= cols; c += 8) _mm256_store_ps(xr + c, round_bf16_avx2(_mm256_loadu_ps(x + c)));
    for (; c < cols; ++c) xr[c] = static_cast<float>(bf16(x[c]));
    for (std::size_t r = r0; r < r1; ++r) y[r] = dot_bf16_avx2<false, true>(w + r * cols, xr, cols);
    return;
  }
  for (std::size_t r = r0; r < r1; ++r) y[r] = dot_bf16_avx2<true, true>(w + r * cols, x, cols);
}

// ---------------------------------------------------------------------------------------------
// AVX-512: 16 lanes.
// ---------------------------------------------------------------------------------------------

/// One f32 row · x: each 64-byte load of x feeds the row, two accumulators hide the FMA latency
/// (alternate 16-column halves of every 32, the tail in the second), as gemm_few sums; each
/// 128-byte step asks for the two lines kGemvPrefetchBytes ahead.
KVDECODE_TARGET_AVX512 inline float dot_f32_avx512(const float* w, const float* x,
                                                   std::size_t cols) {
  __m512 acc0 = _mm512_setzero_ps();
  __m512 acc1 = _mm512_setzero_ps();
  std::size_t c = 0;
  for (; c + 32 <= cols; c += 32) {
    prefetch_weights_ahead(w + c);
    prefetch_weights_ahead(w + c + 16);
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + c), _mm512_loadu_ps(x + c), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + c + 16), _mm512_loadu_ps(x + c + 16), acc1);
  }
  if (c + 16 <= cols) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + c), _mm512_loadu_ps(x + c), acc0);
    c += 16;
  }
  if (c < cols) {  // 1..15 columns left: masked loads read nothing past the row
    const auto m = static_cast<__mmask16>((1u << (cols - c)) - 1u);
    acc1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w + c), _mm512_maskz_loadu_ps(m, x + c), acc1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

KVDECODE_TARGET_AVX512 inline void gemv_rows_f32_avx512(float* y, const float* w, const float* x,
                                                        std::size_t r0, std::size_t r1,
                                                        std::size_t cols) {
  for (std::size_t r = r0; r < r1; ++r) y[r] = dot_f32_avx512(w + r * cols, x, cols);
}

/// 16 values rounded to bf16 (nearest-even) and widened back, as round_bf16_avx2.
KVDECODE_TARGET_AVX512 inline __m512 round_bf16_avx512(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512i rounded =
      _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), hi);
  const __m512i quiet_nan = _mm512_and_si512(_mm512_or_si512(u, _mm512_set1_epi32(0x400000)), hi);
  return _mm512_castsi512_ps(
      _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded, quiet_nan));
}

/// 16 bf16 weights (the first `m` of them) widened to f32.
KVDECODE_TARGET_AVX512 inline __m512 widen_bf16_avx512(const bf16* w, __mmask16 m = 0xFFFF) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, reinterpret_cast<const void*>(w))), 16));
}

template <bool kRoundX>
KVDECODE_TARGET_AVX512 inline __m512 load_x_avx512(const float* p, __mmask16 m) {
  const __m512 v = _mm512_maskz_loadu_ps(m, p);
  return kRoundX ? round_bf16_avx512(v) : v;
}

/// One bf16 row · x without the BF16 instructions: weights widened, x rounded (kRoundX) or
/// already rounded, then the f32 GEMV's order. kPrefetch: each 64-byte step also asks for the
/// line kGemvPrefetchBytes ahead (the GEMV).
template <bool kRoundX, bool kPrefetch = false>
KVDECODE_TARGET_AVX512 inline float dot_bf16_avx512(const bf16* w, const float* x,
                                                    std::size_t cols) {
  __m512 acc0 = _mm512_setzero_ps();
  __m512 acc1 = _mm512_setzero_ps();
  std::size_t c = 0;
  for (; c + 32 <= cols; c += 32) {
    if constexpr (kPrefetch) prefetch_weights_ahead(w + c);
    acc0 = _mm512_fmadd_ps(widen_bf16_avx512(w + c), load_x_avx512<kRoundX>(x + c, 0xFFFF), acc0);
    acc1 = _mm512_fmadd_ps(widen_bf16_avx512(w + c + 16),
                           load_x_avx512<kRoundX>(x + c + 16, 0xFFFF), acc1);
  }
  if (c + 16 <= cols) {
    acc0 = _mm512_fmadd_ps(widen_bf16_avx512(w + c), load_x_avx512<kRoundX>(x + c, 0xFFFF), acc0);
    c += 16;
  }
  if (c < cols) {
    const auto m = static_cast<__mmask16>((1u << (cols - c)) - 1u);
    acc1 = _mm512_fmadd_ps(widen_bf16_avx512(w + c, m), load_x_avx512<kRoundX>(x + c, m), acc1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

KVDECODE_TARGET_AVX512 inline void gemv_rows_bf16_avx512(float* y, const bf16* w, const float* x,
                                                         std::size_t r0, std::size_t r1,
                                                         std::size_t cols) {
  if (cols <= kMaxStackCols) {
    alignas(64) float xr[kMaxStackCols];  // x rounded to bf16 once per call
    std::size_t c = 0;
    for (; c + 16 <= cols; c += 16)
      _mm512_store_ps(xr + c, round_bf16_avx512(_mm512_loadu_ps(x + c)));
    for (; c < cols; ++c) xr[c] = static_cast<float>(bf16(x[c]));
    for (std::size_t r = r0; r < r1; ++r)
      y[r] = dot_bf16_avx512<false, true>(w + r * cols, xr, cols);
    return;
  }
  for (std::size_t r = r0; r < r1; ++r) y[r] = dot_bf16_avx512<true, true>(w + r * cols, x, cols);
}

// ---------------------------------------------------------------------------------------------
// AVX-512 + AVX512_BF16: the dot-product instruction (two exact bf16 products per lane).
// ---------------------------------------------------------------------------------------------

/// One bf16 row · x, x converted to bf16 in the loop (inputs longer than kMaxStackCols).
/// kPrefetch: each 128-byte step also asks for the two lines kGemvPrefetchBytes ahead (the GEMV).
template <bool kPrefetch = false>
KVDECODE_TARGET_AVX512BF16 inline float dot_bf16_dpbf16(const bf16* w, const float* x,
                                                        std::size_t cols) {
  __m512 acc0 = _mm512_setzero_ps();
  __m512 acc1 = _mm512_setzero_ps();
  std::size_t c = 0;
  for (; c + 64 <= cols; c += 64) {
    if constexpr (kPrefetch) {
      prefetch_weights_ahead(w + c);
      prefetch_weights_ahead(w + c + 32);
    }
    const __m512bh x0 = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + c + 16), _mm512_loadu_ps(x + c));
    const __m512bh x1 =
        _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + c + 48), _mm512_loadu_ps(x + c + 32));
    acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(w + c), x0);
    acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_loadu_si512(w + c + 32), x1);
  }
  for (; c < cols; c += 32) {  // the last 1..63 columns, 32 at a time, masked past the row
    const std::size_t left = std::min<std::size_t>(32, cols - c);
    const auto m32 = static_cast<__mmask32>(left == 32 ? ~0u : (1u << left) - 1u);
    const auto lo = static_cast<__mmask16>(m32 & 0xFFFFu);
    const auto hi = static_cast<__mmask16>(m32 >> 16);
    const __m512bh x0 = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, x + c + 16),
                                            _mm512_maskz_loadu_ps(lo, x + c));
    acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_maskz_loadu_epi16(m32, w + c), x0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

/// The same with x already converted (xb [cols], 64-byte aligned): a pure load + dot loop,
/// prefetching as dot_bf16_dpbf16<true>.
KVDECODE_TARGET_AVX512BF16 inline float dot_bf16x_dpbf16(const bf16* w, const bf16* xb,
                                                         std::size_t cols) {
  __m512 acc0 = _mm512_setzero_ps();
  __m512 acc1 = _mm512_setzero_ps();
  std::size_t c = 0;
  for (; c + 64 <= cols; c += 64) {
    prefetch_weights_ahead(w + c);
    prefetch_weights_ahead(w + c + 32);
    const auto x0 = (__m512bh)_mm512_load_si512(xb + c);
    const auto x1 = (__m512bh)_mm512_load_si512(xb + c + 32);
    acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(w + c), x0);
    acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_loadu_si512(w + c + 32), x1);
  }
  for (; c < cols; c += 32) {
    const std::size_t left = std::min<std::size_t>(32, cols - c);
    const auto m32 = static_cast<__mmask32>(left == 32 ? ~0u : (1u << left) - 1u);
    const auto x0 = (__m512bh)_mm512_maskz_loadu_epi16(m32, xb + c);
    acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_maskz_loadu_epi16(m32, w + c), x0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

KVDECODE_TARGET_AVX512BF16 inline void gemv_rows_bf16_dpbf16(float* y, const bf16* w,
                                                             const float* x, std::size_t r0,
                                                             std::size_t r1, std::size_t cols) {
  if (cols <= kMaxStackCols) {
    // x rounded to bf16 once per call (the same nearest-even rounding as in the loop).
    alignas(64) bf16 xb[kMaxStackCols];
    std::size_t c = 0;
    for (; c + 32 <= cols; c += 32)
      _mm512_store_si512(xb + c, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + c + 16),
                                                              _mm512_loadu_ps(x + c)));
    for (; c < cols; ++c) xb[c] = bf16(x[c]);
    for (std::size_t r = r0; r < r1; ++r) y[r] = dot_bf16x_dpbf16(w + r * cols, xb, cols);
    return;
  }
  for (std::size_t r = r0; r < r1; ++r) y[r] = dot_bf16_dpbf16<true>(w + r * cols, x, cols);
}

KVDECODE_INTRINSICS_END
#endif  // KVDECODE_X86_KERNELS

// ---------------------------------------------------------------------------------------------
// Dispatch: one switch per call, outside every loop. `ks` must be a set the CPU supports.
// ---------------------------------------------------------------------------------------------

/// y[r] = Σ_c w[r][c]·x[c] for r in [r0, r1); w [rows][cols] row-major, y and w indexed by the
/// absolute row. A row's arithmetic does not depend on the range, so threads splitting the rows
/// get the single-threaded result bit for bit.
template <class T>
void gemv_rows(KernelSet ks, T* y, const T* w, const T* x, std::size_t r0, std::size_t r1,
               std::size_t cols) {
#if KVDECODE_X86_KERNELS
  if constexpr (std::is_same_v<T, float>) {
    switch (ks) {
      case KernelSet::kAvx512Bf16:
      case KernelSet::kAvx512:
        return gemv_rows_f32_avx512(y, w, x, r0, r1, cols);
      case KernelSet::kAvx2:
        return gemv_rows_f32_avx2(y, w, x, r0, r1, cols);
      case KernelSet::kPortable:
        break;
    }
  }
#endif
  static_cast<void>(ks);
  gemv_rows_portable(y, w, x, r0, r1, cols);
}

/// The bf16-weight GEMV under the rule at the top of this header.
inline void gemv_rows(KernelSet ks, float* y, const bf16* w, const float* x, std::size_t r0,
                      std::size_t r1, std::size_t cols) {
#if KVDECODE_X86_KERNELS
  switch (ks) {
    case KernelSet::kAvx512Bf16:
      return gemv_rows_bf16_dpbf16(y, w, x, r0, r1, cols);
    case KernelSet::kAvx512:
      return gemv_rows_bf16_avx512(y, w, x, r0, r1, cols);
    case KernelSet::kAvx2:
      return gemv_rows_bf16_avx2(y, w, x, r0, r1, cols);
    case KernelSet::kPortable:
      break;
  }
#endif
  static_cast<void>(ks);
  gemv_rows_bf16_portable(y, w, x, r0, r1, cols);
}

}  // namespace kvdecode::detail
