// GEMM over a slice of output columns (= weight rows), y [n][out] = x [n][in] · wᵀ:
//   gemm_cols  prefill: Eigen's GEMM on each thread's slice, bf16 weights widened panel by panel
//              (x already rounded to bf16 by the caller: the rule in gemv.hpp);
//   gemm_few   a few tokens of one sequence (a prefill chunk, a speculative verify pass): each
//              weight row streamed once for all tokens, every output summed exactly as the GEMV
//              of the same set sums it (batched steps use gemm_lanes.hpp instead).
#pragma once

#include <algorithm>
#include <cstddef>
#include <type_traits>

#include "kvdecode/bf16.hpp"
#include "kvdecode/detail/cpu.hpp"
#include "kvdecode/detail/gemv.hpp"
#include "kvdecode/detail/ops.hpp"

namespace kvdecode::detail {

// ---------------------------------------------------------------------------------------------
// gemm_cols: portable (Eigen).
// ---------------------------------------------------------------------------------------------

/// Rows of bf16 weights widened at a time for one Eigen GEMM call: 64 rows × 2048 in × 4 bytes
/// = 512 KiB, which stays in L2 while the GEMM reuses it n times.
inline constexpr std::size_t kPanelRows = 64;

/// out [count] = x [count] rounded to bf16 and widened back (bf16.hpp's rounding): the input
/// every bf16 weight product takes.
inline void round_to_bf16(const float* x, float* out, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) out[i] = static_cast<float>(bf16(x[i]));
}

#if KVDECODE_X86_KERNELS
KVDECODE_INTRINSICS_BEGIN
/// a [n][lda] = x [n][in] rounded to bf16 (lda ≥ in, even), columns past in zero: the rows the
/// bf16 × bf16 products (vdpbf16ps, AMX tiles) take. VCVTNE2PS2BF16 rounds to nearest-even as
/// bf16.hpp does, except that it flushes subnormal inputs to zero, which those instructions do to
/// subnormal bf16 inputs anyway: the products are the same.
KVDECODE_TARGET_AVX512BF16 inline void round_rows_bf16_avx512bf16(bf16* a, std::size_t lda,
                                                                  const float* x, std::size_t n,
                                                                  std::size_t in) {
  const auto mask = [](std::size_t c, std::size_t end) {  // lanes of [c, c + 16) before end
    const std::size_t left = c < end ? std::min<std::size_t>(16, end - c) : 0;
    return static_cast<__mmask16>(left == 16 ? 0xFFFFu : (1u << left) - 1u);
  };
  for (std::size_t t = 0; t < n; ++t) {
    const float* row = x + t * in;
    bf16* dst = a + t * lda;
    std::size_t c = 0;
    for (; c + 32 <= in; c += 32) {
      const __m512bh v =
          _mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + c + 16), _mm512_loadu_ps(row + c));
      _mm512_storeu_si512(dst + c, reinterpret_cast<const __m512i&>(v));
    }
    for (; c < lda; c += 32) {  // the row's tail and the zero pad, 32 columns at a time
      const __m512 lo = _mm512_maskz_loadu_ps(mask(c, in), row + c);
      const __m512 hi = _mm512_maskz_loadu_ps(mask(c + 16, in), row + c + 16);
      const __m512bh v = _mm512_cvtne2ps_pbh(hi, lo);
      const auto m = static_cast<__mmask32>(mask(c, lda)) |
                     static_cast<__mmask32>(static_cast<__mmask32>(mask(c + 16, lda)) << 16);
      _mm512_mask_storeu_epi16(dst + c, m, reinterpret_cast<const __m512i&>(v));
    }
  }
}
KVDECODE_INTRINSICS_END
#endif  // KVDECODE_X86_KERNELS

/// y [n][out] columns [c0, c1) = x [n][in] · w [c0..c1)[in]ᵀ. `panel` is this thread's
/// scratch of kPanelRows × in elements, used only when W is not T; then x must already be
/// rounded to bf16 (round_to_bf16), so that the widened products are the GEMV's.
template <class T, class W>
void gemm_cols(T* y, const T* x, const W* w, std::size_t n, std::size_t in, std::size_t out,
               std::size_t c0, std::size_t c1, T* panel) {
  using Stride = Eigen::OuterStride<>;
  const auto ni = static_cast<Eigen::Index>(n);
  const auto ii = static_cast<Eigen::Index>(in);
  const Eigen::Map<const RowMatrix<T>> xm(x, ni, ii);
  const auto slice = [&](std::size_t b, std::size_t e, const T* rows) {
    const Eigen::Map<const RowMatrix<T>> wm(rows, static_cast<Eigen::Index>(e - b), ii);
    Eigen::Map<RowMatrix<T>, Eigen::Unaligned, Stride>(y + b, ni, static_cast<Eigen::Index>(e - b),
                                                       Stride(static_cast<Eigen::Index>(out)))
        .noalias() = xm * wm.transpose();
  };
  if constexpr (std::is_same_v<T, W>) {
    if (c1 > c0) slice(c0, c1, w + c0 * in);
  } else {
    for (std::size_t b = c0; b < c1; b += kPanelRows) {
      const std::size_t e = std::min(c1, b + kPanelRows);
      std::transform(w + b * in, w + e * in, panel, [](W v) { return widen<T>(v); });
      slice(b, e, panel);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// gemm_few: a few tokens, f32 weights.
// ---------------------------------------------------------------------------------------------

/// Most tokens gemm_few takes; more are a prefill-sized GEMM, where Eigen's packing pays.
inline constexpr std::size_t kMaxFewTokens = 16;

#if KVDECODE_X86_KERNELS
KVDECODE_INTRINSICS_BEGIN

/// AVX2: rows [c0, c1) two at a time, tokens three at a time (2 × 3 × 2 accumulators + loads
/// fill the 16 registers); dot_block_f32_avx2 is the GEMV's own block.
template <int R>
KVDECODE_TARGET_AVX2 inline void gemm_few_rows_avx2(float* y, const float* x, const float* w,
                                                    std::size_t n, std::size_t in, std::size_t out,
                                                    std::size_t r) {
  std::size_t t = 0;
  for (; t + 3 <= n; t += 3)
    dot_block_f32_avx2<R, 3>(y + t * out + r, out, w + r * in, x + t * in, in);
  if (n - t == 2) dot_block_f32_avx2<R, 2>(y + t * out + r, out, w + r * in, x + t * in, in);
  if (n - t == 1) dot_block_f32_avx2<R, 1>(y + t * out + r, out, w + r * in, x + t * in, in);
}

KVDECODE_TARGET_AVX2 inline void gemm_few_avx2(float* y, const float* x, const float* w,
                                               std::size_t n, std::size_t in, std::size_t out,
                                               std::size_t c0, std::size_t c1) {
  std::size_t r = c0;
  for (; r + 2 <= c1; r += 2) gemm_few_rows_avx2<2>(y, x, w, n, in, out, r);
  if (r < c1) gemm_few_rows_avx2<1>(y, x, w, n, in, out, r);
}

/// AVX-512: R weight rows × N tokens. Each (row, token) sums exactly as dot_f32_avx512 does
/// (two accumulators over alternate 16-column halves of every 32, the tail in the second), so a
/// token's output does not depend on the batch it runs in and equals the GEMV's bit for bit.
template <int R, int N>
KVDECODE_TARGET_AVX512 inline void gemm_few_block_avx512(float* y, std::size_t y_stride,
                                                         const float* w, const float* x,
                                                         std::size_t cols) {
  __m512 acc0[R][N];
  __m512 acc1[R][N];
  KVDECODE_UNROLL
  for (int i = 0; i < R; ++i) KVDECODE_UNROLL
  for (int j = 0; j < N; ++j) acc0[i][j] = acc1[i][j] = _mm512_setzero_ps();
  const auto wr = [&](int i) { return w + static_cast<std::size_t>(i) * cols; };
  const auto xr = [&](int j) { return x + static_cast<std::size_t>(j) * cols; };
  std::size_t c = 0;
  for (; c + 32 <= cols; c += 32) {
    KVDECODE_UNROLL
    for (int i = 0; i < R; ++i) {
      const __m512 w0 = _mm512_loadu_ps(wr(i) + c);
      const __m512 w1 = _mm512_loadu_ps(wr(i) + c + 16);
      KVDECODE_UNROLL
      for (int j = 0; j < N; ++j) {
        acc0[i][j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr(j) + c), acc0[i][j]);
        acc1[i][j] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr(j) + c + 16), acc1[i][j]);
      }
    }
  }
  if (c + 16 <= cols) {
    KVDECODE_UNROLL
    for (int i = 0; i < R; ++i) {
      const __m512 w0 = _mm512_loadu_ps(wr(i) + c);
      KVDECODE_UNROLL
      for (int j = 0; j < N; ++j)
        acc0[i][j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr(j) + c), acc0[i][j]);
    }
    c += 16;
  }
  if (c < cols) {
    const auto m = static_cast<__mmask16>((1u << (cols - c)) - 1u);
    KVDECODE_UNROLL
    for (int i = 0; i < R; ++i) {
      const __m512 w0 = _mm512_maskz_loadu_ps(m, wr(i) + c);
      KVDECODE_UNROLL
      for (int j = 0; j < N; ++j)
        acc1[i][j] = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(m, xr(j) + c), acc1[i][j]);
    }
  }
  KVDECODE_UNROLL
  for (int i = 0; i < R; ++i) KVDECODE_UNROLL
  for (int j = 0; j < N; ++j)
    y[static_cast<std::size_t>(j) * y_stride + static_cast<std::size_t>(i)] =
        _mm512_reduce_add_ps(_mm512_add_ps(acc0[i][j], acc1[i][j]));
}

/// Rows r .. r+R for tokens [0, n), N ≤ 4 tokens at a time (2 × 4 × 2 = 16 accumulators leave
/// registers for the loads).
template <int R>
KVDECODE_TARGET_AVX512 inline void gemm_few_rows_avx512(float* y, const float* x, const float* w,
                                                        std::size_t n, std::size_t in,
                                                        std::size_t out, std::size_t r) {
  std::size_t t = 0;
  for (; t + 4 <= n; t += 4)
    gemm_few_block_avx512<R, 4>(y + t * out + r, out, w + r * in, x + t * in, in);
  switch (n - t) {
    case 3:
      gemm_few_block_avx512<R, 3>(y + t * out + r, out, w + r * in, x + t * in, in);
      break;
    case 2:
      gemm_few_block_avx512<R, 2>(y + t * out + r, out, w + r * in, x + t * in, in);
      break;
    case 1:
      gemm_few_block_avx512<R, 1>(y + t * out + r, out, w + r * in, x + t * in, in);
      break;
    default:
      break;
  }
}

KVDECODE_TARGET_AVX512 inline void gemm_few_avx512(float* y, const float* x, const float* w,
                                                   std::size_t n, std::size_t in, std::size_t out,
                                                   std::size_t c0, std::size_t c1) {
  std::size_t r = c0;
  for (; r + 2 <= c1; r += 2) gemm_few_rows_avx512<2>(y, x, w, n, in, out, r);
  if (r < c1) gemm_few_rows_avx512<1>(y, x, w, n, in, out, r);
}

/// bf16 weights: each (row, token) is the GEMV's own dot product of the set, x already rounded
/// (the rounding is idempotent, so the GEMV's result bit for bit); rows outer, so a weight row
/// is read from memory once and from L1 by every token.
KVDECODE_TARGET_AVX2 inline void gemm_few_bf16_avx2(float* y, const float* x, const bf16* w,
                                                    std::size_t n, std::size_t in, std::size_t out,
                                                    std::size_t c0, std::size_t c1) {
  for (std::size_t r = c0; r < c1; ++r)
    for (std::size_t t = 0; t < n; ++t)
      y[t * out + r] = dot_bf16_avx2<false>(w + r * in, x + t * in, in);
}

KVDECODE_TARGET_AVX512 inline void gemm_few_bf16_avx512(float* y, const float* x, const bf16* w,
                                                        std::size_t n, std::size_t in,
                                                        std::size_t out, std::size_t c0,
                                                        std::size_t c1) {
  for (std::size_t r = c0; r < c1; ++r)
    for (std::size_t t = 0; t < n; ++t)
      y[t * out + r] = dot_bf16_avx512<false>(w + r * in, x + t * in, in);
}

KVDECODE_TARGET_AVX512BF16 inline void gemm_few_bf16_dpbf16(float* y, const float* x, const bf16* w,
                                                            std::size_t n, std::size_t in,
                                                            std::size_t out, std::size_t c0,
                                                            std::size_t c1) {
  for (std::size_t r = c0; r < c1; ++r)
    for (std::size_t t = 0; t < n; ++t)
      y[t * out + r] = dot_bf16_dpbf16(w + r * in, x + t * in, in);
}

KVDECODE_INTRINSICS_END
#endif  // KVDECODE_X86_KERNELS

/// Whether set ks has a gemm_few kernel for these types (else gemm_few is gemm_cols).
template <class T, class W>
constexpr bool has_gemm_few(KernelSet ks) {
  if constexpr (std::is_same_v<T, float> && std::is_same_v<W, bf16>) return true;
  return KVDECODE_X86_KERNELS && std::is_same_v<T, float> && std::is_same_v<W, float> &&
         ks != KernelSet::kPortable;
}

/// Whether Eigen's GEMM, compiled with this translation unit's flags, is as wide as set ks's
/// kernels. Where it is not (a build without -march flags on an AVX-512 CPU), attention's
/// products run in the set's kernels (attention_products.hpp) instead of SSE2 Eigen.
constexpr bool eigen_gemm_as_wide(KernelSet ks) {
#if defined(__AVX512F__)
  static_cast<void>(ks);
  return true;
#elif defined(__AVX2__) && defined(__FMA__)
  return ks != KernelSet::kAvx512 && ks != KernelSet::kAvx512Bf16;
#else
  return ks == KernelSet::kPortable;
#endif
}

/// y [n][out] columns [c0, c1) = x [n][in] · w [c0..c1)[in]ᵀ for n ≤ kMaxFewTokens tokens,
/// each output equal to the set's GEMV of that token bit for bit: every weight row is read from
/// memory once and from L1 by every token. With bf16 weights x must already be rounded
/// (round_to_bf16). Without a kernel for the types and set (has_gemm_few) it is gemm_cols.
template <class T, class W>
void gemm_few(KernelSet ks, T* y, const T* x, const W* w, std::size_t n, std::size_t in,
              std::size_t out, std::size_t c0, std::size_t c1, T* panel) {
  if constexpr (std::is_same_v<T, float> && std::is_same_v<W, bf16>) {
#if KVDECODE_X86_KERNELS
    switch (ks) {
      case KernelSet::kAvx512Bf16:
        return gemm_few_bf16_dpbf16(y, x, w, n, in, out, c0, c1);
      case KernelSet::kAvx512:
        return gemm_few_bf16_avx512(y, x, w, n, in, out, c0, c1);
      case KernelSet::kAvx2:
        return gemm_few_bf16_avx2(y, x, w, n, in, out, c0, c1);
      case KernelSet::kPortable:
        break;
    }
#endif
    for (std::size_t t = 0; t < n; ++t)
      gemv_rows_bf16_portable(y + t * out, w, x + t * in, c0, c1, in);
    return;
  }
#if KVDECODE_X86_KERNELS
  if constexpr (std::is_same_v<T, float> && std::is_same_v<W, float>) {
    switch (ks) {
      case KernelSet::kAvx512Bf16:
      case KernelSet::kAvx512:
        return gemm_few_avx512(y, x, w, n, in, out, c0, c1);
      case KernelSet::kAvx2:
        return gemm_few_avx2(y, x, w, n, in, out, c0, c1);
      case KernelSet::kPortable:
        break;
    }
  }
#endif
  static_cast<void>(ks);
  gemm_cols(y, x, w, n, in, out, c0, c1, panel);
}

}  // namespace kvdecode::detail
