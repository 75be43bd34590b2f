// softmax_exp: the exponentials of attention's online softmax, row [cols] = exp(row - shift) and
// their sum, in the run-time kernel sets, so a build whose Eigen is SSE2 does not pay for a
// narrow exp on every score. Results too small to matter are exactly zero: a subnormal adds
// nothing to an f32 sum next to the row's largest term (exp(0) = 1), and every multiply-add it
// enters in p·v takes a slow microcode assist.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>

#include "kvdecode/detail/cpu.hpp"
#include "kvdecode/detail/ops.hpp"  // Eigen

namespace kvdecode::detail {

/// Below this argument the vector kernels return 0: exp(-87) ≈ 1.6e-38 is the last result they
/// compute that is still a normal float (the smallest is ≈ 1.18e-38 = exp(-87.34)).
inline constexpr float kExpFloorArg = -87.0f;

/// The portable set: Eigen's exp as this translation unit compiles it, then results below the
/// smallest normal float zeroed (a libm exp returns subnormals there; Eigen's vectorized one
/// clamps).
inline float softmax_exp_portable(float* row_data, std::size_t cols, float shift) {
  Eigen::Map<Eigen::Matrix<float, 1, Eigen::Dynamic>> row(row_data,
                                                          static_cast<Eigen::Index>(cols));
  row = (row.array() - shift).exp();
  row = (row.array() < std::numeric_limits<float>::min()).select(0.0f, row);  // NaN stays
  return row.sum();
}

#if KVDECODE_X86_KERNELS
KVDECODE_INTRINSICS_BEGIN

// exp(x) = 2^n · exp(r), n = round(x · log2 e), r = x − n · ln 2 in two steps (Cody–Waite) and
// exp(r) on [−ln2/2, ln2/2] by Cephes' expf polynomial (within about 1 ulp). x is clamped to
// [kExpFloorArg, 88] first, so 2^n is a normal float; a NaN passes through.
inline constexpr float kLog2e = 1.44269504088896341f;
inline constexpr float kLn2Hi = 0.693359375f;
inline constexpr float kLn2Lo = -2.12194440e-4f;
inline constexpr float kExpP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                   4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

KVDECODE_TARGET_AVX512 inline __m512 exp_avx512(__m512 x) {
  const __m512 xc = _mm512_min_ps(_mm512_set1_ps(88.0f),
                                  _mm512_max_ps(_mm512_set1_ps(kExpFloorArg), x));  // NaN stays
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpP[0]);  // exp(r) = 1 + r + r² · P(r)
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP[i]));
  const __m512 e = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpFloorArg), _CMP_LT_OQ);
  return _mm512_maskz_scalef_ps(static_cast<__mmask16>(~tiny), e, n);
}

KVDECODE_TARGET_AVX512 inline float softmax_exp_avx512(float* row, std::size_t cols, float shift) {
  const __m512 s = _mm512_set1_ps(shift);
  __m512 sum = _mm512_setzero_ps();
  for (std::size_t c = 0; c < cols; c += 16) {
    const std::size_t left = cols - c;
    const auto m = static_cast<__mmask16>(left >= 16 ? 0xFFFFu : (1u << left) - 1u);
    const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + c), s));
    _mm512_mask_storeu_ps(row + c, m, e);
    sum = _mm512_mask_add_ps(sum, m, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

KVDECODE_TARGET_AVX2 inline __m256 exp_avx2(__m256 x) {
  const __m256 xc = _mm256_min_ps(_mm256_set1_ps(88.0f),
                                  _mm256_max_ps(_mm256_set1_ps(kExpFloorArg), x));  // NaN stays
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpP[0]);  // exp(r) = 1 + r + r² · P(r)
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpP[i]));
  const __m256 e = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);  // 2^n
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(kExpFloorArg), _CMP_LT_OQ);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(e, _mm256_castsi256_ps(bits)));
}

KVDECODE_TARGET_AVX2 inline float softmax_exp_avx2(float* row, std::size_t cols, float shift) {
  const __m256 s = _mm256_set1_ps(shift);
  __m256 sum = _mm256_setzero_ps();
  std::size_t c = 0;
  for (; c + 8 <= cols; c += 8) {
    const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(row + c), s));
    _mm256_storeu_ps(row + c, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (c < cols) {  // the tail through a vector padded with −inf, whose exp is 0
    alignas(32) float tail[8];
    std::fill_n(tail, 8, -std::numeric_limits<float>::infinity());
    std::copy(row + c, row + cols, tail);
    const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_load_ps(tail), s));
    _mm256_store_ps(tail, e);
    std::copy(tail, tail + (cols - c), row + c);
    sum = _mm256_add_ps(sum, e);
  }
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}

KVDECODE_INTRINSICS_END
#endif  // KVDECODE_X86_KERNELS

/// row [cols] = exp(row − shift), results below the smallest normal float (the x86 sets: below
/// exp(kExpFloorArg)) exactly 0; returns their sum, with set ks. Arguments are ≤ 0 in softmax.
inline float softmax_exp(KernelSet ks, float* row, std::size_t cols, float shift) {
#if KVDECODE_X86_KERNELS
  if (ks == KernelSet::kAvx2) return softmax_exp_avx2(row, cols, shift);
  if (ks != KernelSet::kPortable) return softmax_exp_avx512(row, cols, shift);
#endif
  static_cast<void>(ks);
  return softmax_exp_portable(row, cols, shift);
}

}  // namespace kvdecode::detail
