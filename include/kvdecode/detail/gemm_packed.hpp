// gemm_packed: prefill-sized projections, y [n][out] columns [c0, c1) = x [n][in] · wᵀ, in the
// run-time kernel sets. Each panel of kPanelRows weight rows is packed once, transposed (and
// widened from bf16), into the thread's panel [in][kPanelRows]; a register tile of R tokens ×
// kPanelRows outputs then streams it once per R tokens (BLIS's packed panel, with the whole
// of `in` as the depth: a panel of 64 × in floats stays in L2).
// Every output sums `in` in index order, in blocks of kPackedDepth added to y; with bf16 weights x
// must already be rounded to bf16 (round_to_bf16), so every product is exact as the GEMV's
// (gemv.hpp's rule).
#pragma once

#include <algorithm>
#include <cstddef>
#include <type_traits>

#include "kvdecode/bf16.hpp"
#include "kvdecode/detail/cpu.hpp"
#include "kvdecode/detail/gemm.hpp"  // kPanelRows, KVDECODE_UNROLL (gemv.hpp)

namespace kvdecode::detail {

/// panel [in][kPanelRows] columns [0, rows) = w [rows][in]ᵀ widened to float; columns past rows
/// are left as they are (the kernels never store them).
template <class W>
inline void pack_panel(float* panel, const W* w, std::size_t rows, std::size_t in) {
  for (std::size_t j = 0; j < rows; ++j) {
    const W* row = w + j * in;
    for (std::size_t k = 0; k < in; ++k) panel[k * kPanelRows + j] = widen<float>(row[k]);
  }
}

/// Depth summed in registers before it is added to y: a sum of `in` terms then errs like one of
/// kPackedDepth + in / kPackedDepth terms, not of `in` (blocked summation).
inline constexpr std::size_t kPackedDepth = 64;

#if KVDECODE_X86_KERNELS
KVDECODE_INTRINSICS_BEGIN

/// y rows [0, R) columns [0, cols) = x [R][in] · panel [in][0, cols), cols ≤ 64: 6 × 4
/// accumulators, four panel loads and six broadcasts per 24 multiply-adds.
template <int R>
KVDECODE_TARGET_AVX512 inline void packed_tile_avx512(float* y, std::size_t y_stride,
                                                      const float* x, std::size_t in,
                                                      const float* panel, std::size_t cols) {
  __mmask16 m[4];
  KVDECODE_UNROLL
  for (int j = 0; j < 4; ++j) {
    const std::size_t lo = 16 * static_cast<std::size_t>(j);
    const std::size_t left = cols > lo ? cols - lo : 0;
    m[j] = static_cast<__mmask16>(left >= 16 ? 0xFFFFu : (1u << left) - 1u);
  }
  for (std::size_t k0 = 0; k0 < in; k0 += kPackedDepth) {
    const std::size_t k1 = std::min(in, k0 + kPackedDepth);
    __m512 acc[R][4];
    KVDECODE_UNROLL
    for (int i = 0; i < R; ++i) KVDECODE_UNROLL
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
    for (std::size_t k = k0; k < k1; ++k) {
      const float* p = panel + k * kPanelRows;
      const __m512 w0 = _mm512_loadu_ps(p);
      const __m512 w1 = _mm512_loadu_ps(p + 16);
      const __m512 w2 = _mm512_loadu_ps(p + 32);
      const __m512 w3 = _mm512_loadu_ps(p + 48);
      KVDECODE_UNROLL
      for (int i = 0; i < R; ++i) {
        const __m512 xb = _mm512_set1_ps(x[static_cast<std::size_t>(i) * in + k]);
        acc[i][0] = _mm512_fmadd_ps(xb, w0, acc[i][0]);
        acc[i][1] = _mm512_fmadd_ps(xb, w1, acc[i][1]);
        acc[i][2] = _mm512_fmadd_ps(xb, w2, acc[i][2]);
        acc[i][3] = _mm512_fmadd_ps(xb, w3, acc[i][3]);
      }
    }
    KVDECODE_UNROLL
    for (int i = 0; i < R; ++i) KVDECODE_UNROLL
    for (int j = 0; j < 4; ++j) {
      float* out = y + static_cast<std::size_t>(i) * y_stride + 16 * j;
      const __m512 sum =
          k0 == 0 ? acc[i][j] : _mm512_add_ps(_mm512_maskz_loadu_ps(m[j], out), acc[i][j]);
      _mm512_mask_storeu_ps(out, m[j], sum);
    }
  }
}

KVDECODE_TARGET_AVX512 inline void packed_panel_avx512(float* y, std::size_t y_stride,
                                                       const float* x, std::size_t n,
                                                       std::size_t in, const float* panel,
                                                       std::size_t cols) {
  std::size_t t = 0;
  for (; t + 6 <= n; t += 6)
    packed_tile_avx512<6>(y + t * y_stride, y_stride, x + t * in, in, panel, cols);
  for (; t + 2 <= n; t += 2)
    packed_tile_avx512<2>(y + t * y_stride, y_stride, x + t * in, in, panel, cols);
  if (t < n) packed_tile_avx512<1>(y + t * y_stride, y_stride, x + t * in, in, panel, cols);
}

/// AVX2: half a panel (32 columns) at a time, 3 × 4 accumulators of 16 registers.
template <int R>
KVDECODE_TARGET_AVX2 inline void packed_tile_avx2(float* y, std::size_t y_stride, const float* x,
                                                  std::size_t in, const float* panel,
                                                  std::size_t cols) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i m[4];
  KVDECODE_UNROLL
  for (int j = 0; j < 4; ++j) {
    const std::size_t lo = 8 * static_cast<std::size_t>(j);
    const std::size_t left = std::min<std::size_t>(8, cols > lo ? cols - lo : 0);
    m[j] = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)), idx);
  }
  for (std::size_t k0 = 0; k0 < in; k0 += kPackedDepth) {
    const std::size_t k1 = std::min(in, k0 + kPackedDepth);
    __m256 acc[R][4];
    KVDECODE_UNROLL
    for (int i = 0; i < R; ++i) KVDECODE_UNROLL
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_setzero_ps();
    for (std::size_t k = k0; k < k1; ++k) {
      const float* p = panel + k * kPanelRows;
      __m256 xb[R];
      KVDECODE_UNROLL
      for (int i = 0; i < R; ++i)
        xb[i] = _mm256_broadcast_ss(x + static_cast<std::size_t>(i) * in + k);
      KVDECODE_UNROLL
      for (int j = 0; j < 4; ++j) {
        const __m256 w = _mm256_loadu_ps(p + 8 * j);
        KVDECODE_UNROLL
        for (int i = 0; i < R; ++i) acc[i][j] = _mm256_fmadd_ps(xb[i], w, acc[i][j]);
      }
    }
    KVDECODE_UNROLL
    for (int i = 0; i < R; ++i) KVDECODE_UNROLL
    for (int j = 0; j < 4; ++j) {
      float* out = y + static_cast<std::size_t>(i) * y_stride + 8 * j;
      const __m256 sum =
          k0 == 0 ? acc[i][j] : _mm256_add_ps(_mm256_maskload_ps(out, m[j]), acc[i][j]);
      _mm256_maskstore_ps(out, m[j], sum);
    }
  }
}

KVDECODE_TARGET_AVX2 inline void packed_panel_avx2(float* y, std::size_t y_stride, const float* x,
                                                   std::size_t n, std::size_t in,
                                                   const float* panel, std::size_t cols) {
  for (std::size_t h = 0; h < cols; h += 32) {
    const std::size_t c = std::min<std::size_t>(32, cols - h);
    std::size_t t = 0;
    for (; t + 3 <= n; t += 3)
      packed_tile_avx2<3>(y + t * y_stride + h, y_stride, x + t * in, in, panel + h, c);
    for (; t < n; ++t)
      packed_tile_avx2<1>(y + t * y_stride + h, y_stride, x + t * in, in, panel + h, c);
  }
}

KVDECODE_INTRINSICS_END
#endif  // KVDECODE_X86_KERNELS

/// Whether set ks has gemm_packed for these types: f32 activations, f32 or bf16 weights, x86.
template <class T, class W>
constexpr bool has_gemm_packed(KernelSet ks) {
  return KVDECODE_X86_KERNELS && std::is_same_v<T, float> &&
         (std::is_same_v<W, float> || std::is_same_v<W, bf16>)&&ks != KernelSet::kPortable;
}

/// y [n][out] columns [c0, c1) = x [n][in] · w [c0..c1)[in]ᵀ with set ks (has_gemm_packed), on
/// the thread's panel [in][kPanelRows].
template <class W>
void gemm_packed(KernelSet ks, float* y, const float* x, const W* w, std::size_t n, std::size_t in,
                 std::size_t out, std::size_t c0, std::size_t c1, float* panel) {
  for (std::size_t b = c0; b < c1; b += kPanelRows) {
    const std::size_t cols = std::min(kPanelRows, c1 - b);
    pack_panel(panel, w + b * in, cols, in);
#if KVDECODE_X86_KERNELS
    if (ks == KernelSet::kAvx2)
      packed_panel_avx2(y + b, out, x, n, in, panel, cols);
    else
      packed_panel_avx512(y + b, out, x, n, in, panel, cols);
#else
    static_cast<void>(ks), static_cast<void>(x), static_cast<void>(n), static_cast<void>(out);
#endif
  }
}

}  // namespace kvdecode::detail
