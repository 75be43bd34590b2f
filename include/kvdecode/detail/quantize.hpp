// Dequantization of the 8-bit and 4-bit KV stores' codes, in every kernel set of cpu.hpp.
// Attention dequantizes the whole cache every step, so at long context these loops run over
// every cached row per token and must be faster than streaming f32 rows; GCC 12 leaves the
// plain loops scalar (byte codes may alias the output; nibble pairs defeat its vectorizer).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvdecode/detail/cpu.hpp"
#include "kvdecode/detail/f16.hpp"

namespace kvdecode::detail {

// ---------------------------------------------------------------------------------------------
// 8-bit: out[r][c] = min[r] + code · step[r], one f16 (min, step) per row, the product and the
// sum rounded apart (no fused multiply-add), so every set computes the same values.
// ---------------------------------------------------------------------------------------------

template <class T>
void dequantize_int8_portable(const std::uint8_t* q, const std::uint16_t* mn,
                              const std::uint16_t* step, std::size_t n, std::size_t head_size,
                              T* out) {
  for (std::size_t r = 0; r < n; ++r) {
    const auto m = static_cast<T>(f16_to_float(mn[r]));
    const auto s = static_cast<T>(f16_to_float(step[r]));
    for (std::size_t c = 0; c < head_size; ++c) {
      const T scaled = static_cast<T>(q[r * head_size + c]) * s;
      out[r * head_size + c] = m + scaled;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 4-bit: byte b of a row holds channels 2b (low nibble) and 2b + 1 (high nibble).
//   keys   [r][c] = kmin[c] + code · kstep[c]  (per-channel range, shared by the group's rows)
//   values [r][c] = vmin[r] + code · vstep[r]  (per-row range)
// ---------------------------------------------------------------------------------------------

template <class T, class S>
void dequantize_q4_portable(const std::uint8_t* kq, const S* kmin, const S* kstep,
                            const std::uint8_t* vq, const S* vmin, const S* vstep, std::size_t n,
                            std::size_t head_size, T* keys, T* values) {
  const std::size_t hs = head_size;
  for (std::size_t r = 0; r < n; ++r) {
    const std::uint8_t* kr = kq + r * hs / 2;
    const std::uint8_t* vr = vq + r * hs / 2;
    T* ko = keys + r * hs;
    T* vo = values + r * hs;
    for (std::size_t c = 0; c < hs; c += 2) {
      ko[c] = static_cast<T>(kmin[c] + static_cast<S>(kr[c / 2] & 0xF) * kstep[c]);
      ko[c + 1] = static_cast<T>(kmin[c + 1] + static_cast<S>(kr[c / 2] >> 4) * kstep[c + 1]);
      vo[c] = static_cast<T>(vmin[r] + static_cast<S>(vr[c / 2] & 0xF) * vstep[r]);
      vo[c + 1] = static_cast<T>(vmin[r] + static_cast<S>(vr[c / 2] >> 4) * vstep[r]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 2-bit: byte b of a row holds channels 4b + j in bits 2j, 2j + 1 (j = 0..3); the same ranges
// as 4-bit. Portable only: a 2-bit cache is chosen for its size, and this loop is not what
// bounds a decode step at the lengths it is used for.
// ---------------------------------------------------------------------------------------------

template <class T, class S>
void dequantize_q2_portable(const std::uint8_t* kq, const S* kmin, const S* kstep,
                            const std::uint8_t* vq, const S* vmin, const S* vstep, std::size_t n,
                            std::size_t head_size, T* keys, T* values) {
  const std::size_t hs = head_size;
  for (std::size_t r = 0; r < n; ++r) {
    const std::uint8_t* kr = kq + r * hs / 4;
    const std::uint8_t* vr = vq + r * hs / 4;
    T* ko = keys + r * hs;
    T* vo = values + r * hs;
    for (std::size_t c = 0; c < hs; ++c) {
      const unsigned shift = 2 * static_cast<unsigned>(c % 4);
      ko[c] = static_cast<T>(kmin[c] + static_cast<S>((kr[c / 4] >> shift) & 3) * kstep[c]);
      vo[c] = static_cast<T>(vmin[r] + static_cast<S>((vr[c / 4] >> shift) & 3) * vstep[r]);
    }
  }
}

#if KVDECODE_X86_KERNELS
KVDECODE_INTRINSICS_BEGIN

KVDECODE_TARGET_AVX2 inline void dequantize_int8_avx2(const std::uint8_t* q,
                                                      const std::uint16_t* mn,
                                                      const std::uint16_t* step, std::size_t n,
                                                      std::size_t head_size, float* out) {
  for (std::size_t r = 0; r < n; ++r) {
    const std::uint8_t* qr = q + r * head_size;
    float* o = out + r * head_size;
    const __m256 m = _mm256_set1_ps(f16_to_float(mn[r]));
    const __m256 s = _mm256_set1_ps(f16_to_float(step[r]));
    std::size_t c = 0;
    for (; c + 8 <= head_size; c += 8) {
      const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qr + c));
      _mm256_storeu_ps(
          o + c,
          _mm256_add_ps(m, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes)), s)));
    }
    dequantize_int8_portable(qr + c, mn + r, step + r, 1, head_size - c, o + c);
  }
}

KVDECODE_TARGET_AVX512 inline void dequantize_int8_avx512(const std::uint8_t* q,
                                                          const std::uint16_t* mn,
                                                          const std::uint16_t* step, std::size_t n,
                                                          std::size_t head_size, float* out) {
  for (std::size_t r = 0; r < n; ++r) {
    const std::uint8_t* qr = q + r * head_size;
    float* o = out + r * head_size;
    const __m512 m = _mm512_set1_ps(f16_to_float(mn[r]));
    const __m512 s = _mm512_set1_ps(f16_to_float(step[r]));
    std::size_t c = 0;
    for (; c + 16 <= head_size; c += 16) {
      const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + c));
      _mm512_storeu_ps(
          o + c,
          _mm512_add_ps(m, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes)), s)));
    }
    dequantize_int8_portable(qr + c, mn + r, step + r, 1, head_size - c, o + c);
  }
}

/// 8 channels' codes from 4 bytes: each byte widened to a 16-bit lane b, made the byte pair
/// (b & 15, b >> 4), which is the channels' order, then widened to 8 floats.
KVDECODE_TARGET_AVX2 inline __m256 unpack_q4_avx2(const std::uint8_t* codes) {
  std::int32_t four = 0;
  std::memcpy(&four, codes, 4);
  const __m128i b = _mm_cvtepu8_epi16(_mm_cvtsi32_si128(four));
  const __m128i pairs =
      _mm_or_si128(_mm_and_si128(b, _mm_set1_epi16(0x0F)), _mm_slli_epi16(_mm_srli_epi16(b, 4), 8));
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(pairs));
}

/// The same for 16 channels from 8 bytes.
KVDECODE_TARGET_AVX512 inline __m512 unpack_q4_avx512(const std::uint8_t* codes) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
  const __m128i pairs =
      _mm_or_si128(_mm_and_si128(b, _mm_set1_epi16(0x0F)), _mm_slli_epi16(_mm_srli_epi16(b, 4), 8));
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(pairs));
}

KVDECODE_TARGET_AVX2 inline void dequantize_q4_avx2(const std::uint8_t* kq, const float* kmin,
                                                    const float* kstep, const std::uint8_t* vq,
                                                    const float* vmin, const float* vstep,
                                                    std::size_t n, std::size_t hs, float* keys,
                                                    float* values) {
  for (std::size_t r = 0; r < n; ++r) {
    const std::uint8_t* kr = kq + r * hs / 2;
    const std::uint8_t* vr = vq + r * hs / 2;
    float* ko = keys + r * hs;
    float* vo = values + r * hs;
    const __m256 vmin8 = _mm256_set1_ps(vmin[r]);
    const __m256 vstep8 = _mm256_set1_ps(vstep[r]);
    std::size_t c = 0;
    for (; c + 8 <= hs; c += 8) {
      _mm256_storeu_ps(ko + c, _mm256_add_ps(_mm256_loadu_ps(kmin + c),
                                             _mm256_mul_ps(unpack_q4_avx2(kr + c / 2),
                                                           _mm256_loadu_ps(kstep + c))));
      _mm256_storeu_ps(vo + c,
                       _mm256_add_ps(vmin8, _mm256_mul_ps(unpack_q4_avx2(vr + c / 2), vstep8)));
    }
    dequantize_q4_portable(kr + c / 2, kmin + c, kstep + c, vr + c / 2, vmin + r, vstep + r, 1,
                           hs - c, ko + c, vo + c);
  }
}

KVDECODE_TARGET_AVX512 inline void dequantize_q4_avx512(const std::uint8_t* kq, const float* kmin,
                                                        const float* kstep, const std::uint8_t* vq,
                                                        const float* vmin, const float* vstep,
                                                        std::size_t n, std::size_t hs, float* keys,
                                                        float* values) {
  for (std::size_t r = 0; r < n; ++r) {
    const std::uint8_t* kr = kq + r * hs / 2;
    const std::uint8_t* vr = vq + r * hs / 2;
    float* ko = keys + r * hs;
    float* vo = values + r * hs;
    const __m512 vmin16 = _mm512_set1_ps(vmin[r]);
    const __m512 vstep16 = _mm512_set1_ps(vstep[r]);
    std::size_t c = 0;
    for (; c + 16 <= hs; c += 16) {
      _mm512_storeu_ps(ko + c, _mm512_add_ps(_mm512_loadu_ps(kmin + c),
                                             _mm512_mul_ps(unpack_q4_avx512(kr + c / 2),
                                                           _mm512_loadu_ps(kstep + c))));
      _mm512_storeu_ps(vo + c,
                       _mm512_add_ps(vmin16, _mm512_mul_ps(unpack_q4_avx512(vr + c / 2), vstep16)));
    }
    dequantize_q4_portable(kr + c / 2, kmin + c, kstep + c, vr + c / 2, vmin + r, vstep + r, 1,
                           hs - c, ko + c, vo + c);
  }
}

KVDECODE_INTRINSICS_END
#endif  // KVDECODE_X86_KERNELS

// ---------------------------------------------------------------------------------------------
// Dispatch: one switch per call (a store passes all the rows of a block or group at once).
// ---------------------------------------------------------------------------------------------

/// out [n][head_size] = mn [n] + q [n][head_size] · step [n] (an f16 range per row).
template <class T>
void dequantize_int8(KernelSet ks, const std::uint8_t* q, const std::uint16_t* mn,
                     const std::uint16_t* step, std::size_t n, std::size_t head_size, T* out) {
#if KVDECODE_X86_KERNELS
  if constexpr (std::is_same_v<T, float>) {
    switch (ks) {
      case KernelSet::kAvx512Bf16:
      case KernelSet::kAvx512:
        return dequantize_int8_avx512(q, mn, step, n, head_size, out);
      case KernelSet::kAvx2:
        return dequantize_int8_avx2(q, mn, step, n, head_size, out);
      case KernelSet::kPortable:
        break;
    }
  }
#endif
  static_cast<void>(ks);
  dequantize_int8_portable(q, mn, step, n, head_size, out);
}

/// keys, values [n][head_size] from n rows of 4-bit codes kq, vq [n][head_size / 2]; the key
/// range per channel (kmin, kstep [head_size]), the value range per row (vmin, vstep [n]).
/// head_size is even. The ranges are of type S (float, or T when the caller decoded them so).
template <class T, class S>
void dequantize_q4(KernelSet ks, const std::uint8_t* kq, const S* kmin, const S* kstep,
                   const std::uint8_t* vq, const S* vmin, const S* vstep, std::size_t n,
                   std::size_t head_size, T* keys, T* values) {
#if KVDECODE_X86_KERNELS
  if constexpr (std::is_same_v<T, float> && std::is_same_v<S, float>) {
    switch (ks) {
      case KernelSet::kAvx512Bf16:
      case KernelSet::kAvx512:
        return dequantize_q4_avx512(kq, kmin, kstep, vq, vmin, vstep, n, head_size, keys, values);
      case KernelSet::kAvx2:
        return dequantize_q4_avx2(kq, kmin, kstep, vq, vmin, vstep, n, head_size, keys, values);
      case KernelSet::kPortable:
        break;
    }
  }
#endif
  static_cast<void>(ks);
  dequantize_q4_portable(kq, kmin, kstep, vq, vmin, vstep, n, head_size, keys, values);
}

}  // namespace kvdecode::detail
