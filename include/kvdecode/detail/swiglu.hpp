// swiglu: the feed-forward gate a = silu(a) ⊙ b = a / (1 + exp(−a)) · b over f32 rows, in the
// run-time kernel sets on softmax_exp.hpp's vector exp (within about 1 ulp of libm's): a chunk's
// n × hidden_dim gates through scalar libm exp would cost as much as a projection.
#pragma once

#include <algorithm>
#include <cstddef>

#include "kvdecode/detail/cpu.hpp"
#include "kvdecode/detail/ops.hpp"
#include "kvdecode/detail/softmax_exp.hpp"

namespace kvdecode::detail {

#if KVDECODE_X86_KERNELS
KVDECODE_INTRINSICS_BEGIN

// exp's clamp at 88 makes 1 + exp(−a) finite below a = −88, where libm's is inf: there silu(a)
// is below 1e−36 in magnitude either way. Above a = 87 exp(−a) is 0 and silu(a) = a exactly.
KVDECODE_TARGET_AVX512 inline void swiglu_avx512(float* a, const float* b, std::size_t count) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (std::size_t i = 0; i < count; i += 16) {
    const std::size_t left = count - i;
    const auto m = static_cast<__mmask16>(left >= 16 ? 0xFFFFu : (1u << left) - 1u);
    const __m512 g = _mm512_maskz_loadu_ps(m, a + i);
    const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, e));
    _mm512_mask_storeu_ps(a + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, b + i)));
  }
}

KVDECODE_TARGET_AVX2 inline void swiglu_avx2(float* a, const float* b, std::size_t count) {
  const __m256 one = _mm256_set1_ps(1.0f);
  std::size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 g = _mm256_loadu_ps(a + i);
    const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), g));
    _mm256_storeu_ps(
        a + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(b + i)));
  }
  if (i < count) {  // the tail through a zero-padded vector
    alignas(32) float ta[8] = {}, tb[8] = {};
    std::copy(a + i, a + count, ta);
    std::copy(b + i, b + count, tb);
    swiglu_avx2(ta, tb, 8);
    std::copy(ta, ta + (count - i), a + i);
  }
}

KVDECODE_INTRINSICS_END
#endif  // KVDECODE_X86_KERNELS

/// a [count] = silu(a) ⊙ b with set ks; the portable set runs ops.hpp's scalar loop.
inline void swiglu(KernelSet ks, float* a, const float* b, std::size_t count) {
#if KVDECODE_X86_KERNELS
  if (ks == KernelSet::kAvx2) return swiglu_avx2(a, b, count);
  if (ks != KernelSet::kPortable) return swiglu_avx512(a, b, count);
#endif
  static_cast<void>(ks);
  swiglu(a, b, count);
}

}  // namespace kvdecode::detail
