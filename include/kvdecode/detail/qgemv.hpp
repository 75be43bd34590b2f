// Projections with block-quantized weights (Q8_0, Q4_0: weight_blocks.hpp) in the ggml manner:
// the input x is quantized once per call to int8 codes with an f32 scale per block of 32, each
// block's product is an exact integer dot product, and the blocks are summed in f32 weighted by
// (weight scale × input scale). One kernel serves a GEMV (one token) and a few-token GEMM: weight
// rows outer, tokens inner, so a row is read from memory once and from L1 for every token, and a
// token's output equals its GEMV bit for bit whatever the batch.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kvdecode/detail/cpu.hpp"
#include "kvdecode/detail/gemv.hpp"  // KVDECODE_UNROLL
#include "kvdecode/weight_blocks.hpp"

namespace kvdecode::detail {

// ---------------------------------------------------------------------------------------------
// The input, quantized once per call.
// ---------------------------------------------------------------------------------------------

/// Codes per entry of quantize_activations' `offsets`: the four bytes vpdpbusd sums per lane.
inline constexpr std::size_t kOffsetGroup = 4;

/// x [n][in] → codes [n][in], scales [n][in / 32]: per block d = max|x| / 127 (f32, not
/// ggml's binary16, which would add a rounding of its own), codes = nearest(x / d) in
/// [−127, 127], so |x − code · d| ≤ d / 2. A block holding a non-finite value gets codes 0 and
/// d = NaN, so its products are NaN as an f32 GEMV's would be. in must be a multiple of 32.
/// offsets [n][in / 4] (may be null): −8 × the sum of each 4 consecutive codes, so a Q4_0 kernel
/// can multiply the unsigned nibbles q and add this to get Σ (q − 8)·x without subtracting 8
/// from every nibble of every row.
inline void quantize_activations(const float* x, std::size_t n, std::size_t in, std::int8_t* codes,
                                 float* scales, std::int32_t* offsets = nullptr) {
  for (std::size_t b = 0; b < n * (in / kWeightBlock); ++b) {
    const float* xb = x + b * kWeightBlock;
    float amax = 0;
    bool finite = true;
    for (std::size_t j = 0; j < kWeightBlock; ++j) {
      finite = finite && std::isfinite(xb[j]);
      amax = std::max(amax, std::fabs(xb[j]));
    }
    const float d = finite ? amax / 127.0f : std::nanf("");
    const float id = finite && amax > 0 ? 127.0f / amax : 0.0f;
    scales[b] = d;
    for (std::size_t j = 0; j < kWeightBlock; ++j) {
      const float q = std::nearbyint(xb[j] * id);
      codes[b * kWeightBlock + j] = static_cast<std::int8_t>(std::clamp(q, -127.0f, 127.0f));
    }
  }
  if (offsets == nullptr) return;
  for (std::size_t g = 0; g < n * in / kOffsetGroup; ++g) {
    std::int32_t sum = 0;
    for (std::size_t j = 0; j < kOffsetGroup; ++j) sum += codes[g * kOffsetGroup + j];
    offsets[g] = -8 * sum;
  }
}

// ---------------------------------------------------------------------------------------------
// Naive reference: double-precision sums of the dequantized weights (tests).
// ---------------------------------------------------------------------------------------------

/// y [rows] = dequantize(w [rows][cols / 32]) · x [cols] in double, x unquantized.
template <class B>
void qgemv_naive(float* y, const B* w, const float* x, std::size_t rows, std::size_t cols) {
  const std::size_t nb = cols / kWeightBlock;
  float row[kWeightBlock];
  for (std::size_t r = 0; r < rows; ++r) {
    double sum = 0;
    for (std::size_t b = 0; b < nb; ++b) {
      dequantize_row(w + r * nb + b, row, kWeightBlock);
      for (std::size_t j = 0; j < kWeightBlock; ++j)
        sum += static_cast<double>(row[j]) * static_cast<double>(x[b * kWeightBlock + j]);
    }
    y[r] = static_cast<float>(sum);
  }
}

// ---------------------------------------------------------------------------------------------
// Portable: integer sums per block in plain C++.
// ---------------------------------------------------------------------------------------------

/// The block's 32 weights as signed codes (q8_0 as stored, q4_0 nibble − 8).
inline void block_codes(const Q8_0& b, std::int8_t* out) {
  for (std::size_t j = 0; j < kWeightBlock; ++j) out[j] = b.qs[j];
}
inline void block_codes(const Q4_0& b, std::int8_t* out) {
  for (std::size_t j = 0; j < kWeightBlock / 2; ++j) {
    out[j] = static_cast<std::int8_t>((b.qs[j] & 15) - 8);
    out[j + 16] = static_cast<std::int8_t>((b.qs[j] >> 4) - 8);
  }
}

template <class B>
float qdot_portable(const B* w, const std::int8_t* xc, const float* xs, std::size_t nb) {
  float acc = 0;
  std::int8_t wc[kWeightBlock];
  for (std::size_t b = 0; b < nb; ++b) {
    block_codes(w[b], wc);
    std::int32_t s = 0;
    for (std::size_t j = 0; j < kWeightBlock; ++j)
      s += static_cast<std::int32_t>(wc[j]) * xc[b * kWeightBlock + j];
    acc += static_cast<float>(s) * (f16_to_float(w[b].d) * xs[b]);
  }
  return acc;
}

#if KVDECODE_X86_KERNELS
KVDECODE_INTRINSICS_BEGIN

// ---------------------------------------------------------------------------------------------
// AVX2: one block per 256-bit register. The products are formed as |w| · (x · sign(w)), so the
// unsigned × signed instructions (maddubs, vpdpbusd) take a signed weight: |w| ≤ 128 and
// |x| ≤ 127 keep maddubs's pair sums below 2^15, so they never saturate.
// ---------------------------------------------------------------------------------------------

KVDECODE_TARGET_AVX2 inline __m256i block_codes_avx2(const Q8_0& b) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs));
}

KVDECODE_TARGET_AVX2 inline __m256i block_codes_avx2(const Q4_0& b) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs));
  const __m128i low = _mm_set1_epi8(15);
  const __m256i nibbles = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low),  // 16..31
                                           _mm_and_si128(q, low));                    // 0..15
  return _mm256_sub_epi8(nibbles, _mm256_set1_epi8(8));
}

/// Σ_j w_j · x_j of one block as 8 int32 partial sums.
KVDECODE_TARGET_AVX2 inline __m256i block_dot_avx2(__m256i w, const std::int8_t* xc) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc));
  const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

KVDECODE_TARGET_AVX2 inline float reduce_add_q_avx2(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

/// acc + (d_w · d_x) · the block's integer dot product, as 8 lanes.
template <class B>
KVDECODE_TARGET_AVX2 inline __m256 qblock_avx2(const B& w, const std::int8_t* xc, float xs,
                                               __m256 acc) {
  const __m256 s = _mm256_cvtepi32_ps(block_dot_avx2(block_codes_avx2(w), xc));
  return _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(w.d) * xs), s, acc);
}

/// One row · one token: four f32 accumulators over blocks b mod 4.
template <class B>
KVDECODE_TARGET_AVX2 inline float qdot_avx2(const B* w, const std::int8_t* xc, const float* xs,
                                            std::size_t nb) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  std::size_t b = 0;
  for (; b + 4 <= nb; b += 4) {
    KVDECODE_UNROLL
    for (std::size_t i = 0; i < 4; ++i)
      acc[i] = qblock_avx2(w[b + i], xc + (b + i) * kWeightBlock, xs[b + i], acc[i]);
  }
  for (std::size_t i = 0; b < nb; ++b, ++i)
    acc[i] = qblock_avx2(w[b], xc + b * kWeightBlock, xs[b], acc[i]);
  return reduce_add_q_avx2(
      _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}

template <class B>
KVDECODE_TARGET_AVX2 inline void qgemm_rows_avx2(float* y, const B* w, const std::int8_t* xc,
                                                 const float* xs, std::size_t n, std::size_t in,
                                                 std::size_t out, std::size_t r0, std::size_t r1) {
  const std::size_t nb = in / kWeightBlock;
  for (std::size_t r = r0; r < r1; ++r)
    for (std::size_t t = 0; t < n; ++t)
      y[t * out + r] = qdot_avx2(w + r * nb, xc + t * in, xs + t * nb, nb);
}

// ---------------------------------------------------------------------------------------------
// AVX512_VNNI (the avx512bf16 set): vpdpbusd forms the block's four-product sums in one
// instruction, exactly (no 16-bit intermediate); 256-bit, as a block is 32 bytes.
// ---------------------------------------------------------------------------------------------

KVDECODE_TARGET_AVX512BF16 inline __m256i block_dot_vnni(const Q8_0& w, const std::int8_t* xc,
                                                         const std::int32_t*) {
  const __m256i wc = block_codes_avx2(w);
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc));
  // vpdpbusd: the first operand unsigned, the second signed.
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(wc, wc),
                             _mm256_sign_epi8(x, wc));
}

/// Q4_0: the unsigned nibbles q straight into vpdpbusd, which adds them to the input's offsets
/// (−8 × each lane's four codes): Σ q·x − 8·Σ x = Σ (q − 8)·x, lane by lane the integers the
/// signed form gives.
KVDECODE_TARGET_AVX512BF16 inline __m256i block_dot_vnni(const Q4_0& w, const std::int8_t* xc,
                                                         const std::int32_t* offsets) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs));
  const __m128i low = _mm_set1_epi8(15);
  const __m256i nibbles = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low),  // 16..31
                                           _mm_and_si128(q, low));                    // 0..15
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc));
  const __m256i init = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(offsets));
  return _mm256_dpbusd_epi32(init, nibbles, x);
}

/// acc + (d_w · d_x) · the block's integer dot product, as 8 lanes.
template <class B>
KVDECODE_TARGET_AVX512BF16 inline __m256 qblock_vnni(const B& w, const std::int8_t* xc,
                                                     const std::int32_t* offsets, float xs,
                                                     __m256 acc) {
  const __m256 s = _mm256_cvtepi32_ps(block_dot_vnni(w, xc, offsets));
  return _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(w.d) * xs), s, acc);
}

/// One row · one token, as qdot_avx2. xo: the token's offsets (Q4_0 only).
template <class B>
KVDECODE_TARGET_AVX512BF16 inline float qdot_vnni(const B* w, const std::int8_t* xc,
                                                  const std::int32_t* xo, const float* xs,
                                                  std::size_t nb) {
  constexpr std::size_t kLanes = kWeightBlock / kOffsetGroup;
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  std::size_t b = 0;
  for (; b + 4 <= nb; b += 4) {
    KVDECODE_UNROLL
    for (std::size_t i = 0; i < 4; ++i)
      acc[i] = qblock_vnni(w[b + i], xc + (b + i) * kWeightBlock, xo + (b + i) * kLanes, xs[b + i],
                           acc[i]);
  }
  for (std::size_t i = 0; b < nb; ++b, ++i)
    acc[i] = qblock_vnni(w[b], xc + b * kWeightBlock, xo + b * kLanes, xs[b], acc[i]);
  return reduce_add_q_avx2(
      _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}

template <class B>
KVDECODE_TARGET_AVX512BF16 inline void qgemm_rows_vnni(float* y, const B* w, const std::int8_t* xc,
                                                       const std::int32_t* xo, const float* xs,
                                                       std::size_t n, std::size_t in,
                                                       std::size_t out, std::size_t r0,
                                                       std::size_t r1) {
  const std::size_t nb = in / kWeightBlock;
  for (std::size_t r = r0; r < r1; ++r)
    for (std::size_t t = 0; t < n; ++t)
      y[t * out + r] =
          qdot_vnni(w + r * nb, xc + t * in, xo + t * (in / kOffsetGroup), xs + t * nb, nb);
}

KVDECODE_INTRINSICS_END
#endif  // KVDECODE_X86_KERNELS

// ---------------------------------------------------------------------------------------------
// Dispatch: one switch per call, outside every loop. `ks` must be a set the CPU supports.
// ---------------------------------------------------------------------------------------------

/// y [n][out] rows [r0, r1) = w [out][in / 32] · x for each of n tokens, x given quantized by
/// quantize_activations (codes [n][in], scales [n][in / 32], offsets [n][in / 4]; the offsets
/// are read by the avx512bf16 Q4_0 kernel only and may be null otherwise). A (row, token) output
/// depends on neither the range nor n, so threads and batches get the single-token result bit
/// for bit. The avx512 set runs the AVX2 kernel (a block fills a 256-bit register; the loop is
/// bound by memory, not by vector width); avx512bf16 replaces maddubs + madd by vpdpbusd, whose
/// lanes sum the same four products, so it gives the AVX2 kernel's outputs bit for bit.
template <class B>
void qgemm_rows(KernelSet ks, float* y, const B* w, const std::int8_t* xc, const float* xs,
                const std::int32_t* xo, std::size_t n, std::size_t in, std::size_t out,
                std::size_t r0, std::size_t r1) {
#if KVDECODE_X86_KERNELS
  switch (ks) {
    case KernelSet::kAvx512Bf16:
      return qgemm_rows_vnni(y, w, xc, xo, xs, n, in, out, r0, r1);
    case KernelSet::kAvx512:
    case KernelSet::kAvx2:
      return qgemm_rows_avx2(y, w, xc, xs, n, in, out, r0, r1);
    case KernelSet::kPortable:
      break;
  }
#endif
  static_cast<void>(ks);
  static_cast<void>(xo);
  const std::size_t nb = in / kWeightBlock;
  for (std::size_t r = r0; r < r1; ++r)
    for (std::size_t t = 0; t < n; ++t)
      y[t * out + r] = qdot_portable(w + r * nb, xc + t * in, xs + t * nb, nb);
}

}  // namespace kvdecode::detail
