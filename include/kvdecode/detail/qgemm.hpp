// Prefill-sized products with block-quantized weights (Q8_0, Q4_0): y [n][out] = w · x for more
// tokens than a batched decode step takes. The input is quantized as for the GEMV (qgemv.hpp);
// the avx512bf16 set then runs a register tile of kTileRows weight rows × kTileTokens tokens,
// two blocks per 512-bit register, so each weight block is loaded once for four tokens and each
// input block once for four rows (ggml's tinyBLAS kernels tile the same way). Each lane's four
// products are the GEMV's exact integers; the f32 sums run in another order (a 16-lane
// accumulator per output), so an output differs from the GEMV's by f32 rounding only.
// Other sets run qgemm_rows.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvdecode/detail/cpu.hpp"
#include "kvdecode/detail/qgemv.hpp"
#include "kvdecode/weight_blocks.hpp"

namespace kvdecode::detail {

inline constexpr std::size_t kTileRows = 4, kTileTokens = 4;

/// Bytes of input codes a token chunk may hold: the chunk stays in L1 while a thread's rows
/// stream past it.
inline constexpr std::size_t kTileChunkBytes = 16 * 1024;

#if KVDECODE_X86_KERNELS
KVDECODE_INTRINSICS_BEGIN

/// 16 lanes: a in the first eight, b in the last eight (a block's scale beside its lanes).
KVDECODE_TARGET_AVX512BF16 inline __m512 pair_scales(float a, float b) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(a)),
                                             _mm256_castps_pd(_mm256_set1_ps(b)), 1));
}

/// Blocks w[0] and, if `two`, w[1] as 64 bytes the products take: Q8_0 its signed codes, Q4_0
/// its unsigned nibbles in element order (low nibbles first); a missing second block is zero.
KVDECODE_TARGET_AVX512BF16 inline __m512i pair_weights(const Q8_0* w, bool two) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[0].qs));
  const __m256i b =
      two ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[1].qs)) : _mm256_setzero_si256();
  return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}
KVDECODE_TARGET_AVX512BF16 inline __m256i nibbles_vnni(const Q4_0& w) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs));
  const __m128i low = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low), _mm_and_si128(q, low));
}
KVDECODE_TARGET_AVX512BF16 inline __m512i pair_weights(const Q4_0* w, bool two) {
  const __m256i b = two ? nibbles_vnni(w[1]) : _mm256_setzero_si256();
  return _mm512_inserti64x4(_mm512_castsi256_si512(nibbles_vnni(w[0])), b, 1);
}

/// acc [R][T] += the products of blocks b and, if kTwo, b + 1 for rows r.. and tokens t...
/// vpdpbusd multiplies unsigned by signed bytes. Q4_0: the nibbles are the unsigned side and
/// each lane starts at the input's offset (−8 × its four codes), as qgemv.hpp's kernel does.
/// Q8_0: the input is made unsigned (x + 128, an exclusive or with 0x80) and each lane starts at
/// −128 × its four weight codes, so it holds Σ x·w exactly.
template <class B, std::size_t R, std::size_t T, bool kTwo>
KVDECODE_TARGET_AVX512BF16 inline void qtile_step_vnni(__m512 (&acc)[R][T], const B* w,
                                                       const std::int8_t* xc,
                                                       const std::int32_t* xo, const float* xs,
                                                       std::size_t in, std::size_t r, std::size_t t,
                                                       std::size_t b) {
  constexpr bool kQ8 = std::is_same_v<B, Q8_0>;
  constexpr std::size_t kLanes = kWeightBlock / kOffsetGroup;  // offsets per block
  constexpr __mmask64 kBytes = kTwo ? ~__mmask64{0} : __mmask64{0xFFFFFFFF};
  constexpr __mmask16 kInts = kTwo ? __mmask16{0xFFFF} : __mmask16{0x00FF};
  const std::size_t nb = in / kWeightBlock;
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i xv[T];
  __m512i x_init[T];
  __m512 sx[T];
  KVDECODE_UNROLL
  for (std::size_t j = 0; j < T; ++j) {
    const std::size_t tok = t + j;
    xv[j] = _mm512_maskz_loadu_epi8(kBytes, xc + tok * in + b * kWeightBlock);
    if constexpr (kQ8) {
      xv[j] = _mm512_xor_si512(xv[j], bias);
      x_init[j] = _mm512_setzero_si512();
    } else {
      x_init[j] = _mm512_maskz_loadu_epi32(kInts, xo + tok * (in / kOffsetGroup) + b * kLanes);
    }
    sx[j] = pair_scales(xs[tok * nb + b], kTwo ? xs[tok * nb + b + 1] : 0.0f);
  }
  KVDECODE_UNROLL
  for (std::size_t i = 0; i < R; ++i) {
    const B* const wr = w + (r + i) * nb + b;
    const __m512i wv = pair_weights(wr, kTwo);
    const __m512 sw = pair_scales(_cvtsh_ss(wr[0].d), kTwo ? _cvtsh_ss(wr[1].d) : 0.0f);
    __m512i w_init = _mm512_setzero_si512();
    if constexpr (kQ8)
      w_init = _mm512_sub_epi32(w_init, _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, wv));
    KVDECODE_UNROLL
    for (std::size_t j = 0; j < T; ++j) {
      const __m512i d =
          kQ8 ? _mm512_dpbusd_epi32(w_init, xv[j], wv) : _mm512_dpbusd_epi32(x_init[j], wv, xv[j]);
      acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sw, sx[j]), acc[i][j]);
    }
  }
}

/// y [t + j][r + i] for i < R, j < T: one register tile over every block, two at a time.
template <class B, std::size_t R, std::size_t T>
KVDECODE_TARGET_AVX512BF16 inline void qtile_vnni(float* y, const B* w, const std::int8_t* xc,
                                                  const std::int32_t* xo, const float* xs,
                                                  std::size_t in, std::size_t out, std::size_t r,
                                                  std::size_t t) {
  const std::size_t nb = in / kWeightBlock;
  __m512 acc[R][T];
  KVDECODE_UNROLL
  for (std::size_t i = 0; i < R; ++i) {
    KVDECODE_UNROLL
    for (std::size_t j = 0; j < T; ++j) acc[i][j] = _mm512_setzero_ps();
  }
  std::size_t b = 0;
  for (; b + 2 <= nb; b += 2) qtile_step_vnni<B, R, T, true>(acc, w, xc, xo, xs, in, r, t, b);
  if (b < nb) qtile_step_vnni<B, R, T, false>(acc, w, xc, xo, xs, in, r, t, b);
  KVDECODE_UNROLL
  for (std::size_t i = 0; i < R; ++i) {
    KVDECODE_UNROLL
    for (std::size_t j = 0; j < T; ++j) y[(t + j) * out + r + i] = _mm512_reduce_add_ps(acc[i][j]);
  }
}

template <class B>
KVDECODE_TARGET_AVX512BF16 inline void qgemm_tiled_vnni(float* y, const B* w, const std::int8_t* xc,
                                                        const std::int32_t* xo, const float* xs,
                                                        std::size_t n, std::size_t in,
                                                        std::size_t out, std::size_t r0,
                                                        std::size_t r1) {
  const std::size_t chunk = std::max(kTileTokens, kTileChunkBytes / in / kTileTokens * kTileTokens);
  for (std::size_t t0 = 0; t0 < n; t0 += chunk) {
    const std::size_t t1 = std::min(n, t0 + chunk);
    std::size_t r = r0;
    for (; r + kTileRows <= r1; r += kTileRows) {
      std::size_t t = t0;
      for (; t + kTileTokens <= t1; t += kTileTokens)
        qtile_vnni<B, kTileRows, kTileTokens>(y, w, xc, xo, xs, in, out, r, t);
      for (; t < t1; ++t) qtile_vnni<B, kTileRows, 1>(y, w, xc, xo, xs, in, out, r, t);
    }
    for (; r < r1; ++r) {
      std::size_t t = t0;
      for (; t + kTileTokens <= t1; t += kTileTokens)
        qtile_vnni<B, 1, kTileTokens>(y, w, xc, xo, xs, in, out, r, t);
      for (; t < t1; ++t) qtile_vnni<B, 1, 1>(y, w, xc, xo, xs, in, out, r, t);
    }
  }
}

KVDECODE_INTRINSICS_END
#endif  // KVDECODE_X86_KERNELS

/// y [n][out] rows [r0, r1) = w [out][in / 32] · x for each of n tokens, x quantized by
/// quantize_activations with offsets (read by the Q4_0 tile). The avx512bf16 set runs the tile;
/// the others qgemm_rows (the GEMV's sums). `ks` must be a set the CPU supports.
template <class B>
void qgemm_tiled(KernelSet ks, float* y, const B* w, const std::int8_t* xc, const float* xs,
                 const std::int32_t* xo, std::size_t n, std::size_t in, std::size_t out,
                 std::size_t r0, std::size_t r1) {
#if KVDECODE_X86_KERNELS
  if (ks == KernelSet::kAvx512Bf16) return qgemm_tiled_vnni(y, w, xc, xo, xs, n, in, out, r0, r1);
#endif
  qgemm_rows(ks, y, w, xc, xs, xo, n, in, out, r0, r1);
}

}  // namespace kvdecode::detail
