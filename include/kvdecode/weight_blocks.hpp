// Q8_0 and Q4_0: ggml's block-quantized weight formats, byte for byte (block_q8_0, block_q4_0):
// 32 weights share one IEEE half scale d. Weights stored so read 34 or 18 bytes per 32 weights
// instead of 128 (f32), which is what a memory-bound decode step pays for.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace kvdecode {

/// Weights per block of both formats (ggml's QK8_0 = QK4_0 = 32).
inline constexpr std::size_t kWeightBlock = 32;

// ---------------------------------------------------------------------------------------------
// IEEE binary16 (ggml_fp16_t), the scale's storage.
// ---------------------------------------------------------------------------------------------

/// The float a binary16 bit pattern denotes (exact: every half is a float).
inline float f16_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1Fu;
  const std::uint32_t mant = h & 0x3FFu;
  if (exp == 0) {  // zero or subnormal: mant × 2^-24
    const float v = static_cast<float>(mant) * 0x1p-24f;
    return sign != 0 ? -v : v;
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7F800000u | (mant << 13));  // inf, NaN
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}

/// x rounded to the nearest binary16 (ties to even); beyond 65504 + half an ulp it is ±inf, NaN
/// stays NaN.
inline std::uint16_t float_to_f16(float x) {
  const auto u = std::bit_cast<std::uint32_t>(x);
  const auto sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<std::uint16_t>(sign | 0x7E00u);
  if (a >= 0x38800000u) {  // a half normal (or overflow): round the 13 dropped mantissa bits
    const std::uint32_t rounded = a + 0xFFFu + ((a >> 13) & 1u);
    const std::uint32_t h = (rounded - 0x38000000u) >> 13;
    return static_cast<std::uint16_t>(sign | std::min<std::uint32_t>(h, 0x7C00u));
  }
  // A half subnormal: units of 2^-24, scaled exactly and rounded in the current (nearest) mode;
  // 1024 units is the smallest normal's encoding.
  const float units = std::nearbyint(std::bit_cast<float>(a) * 0x1p24f);
  return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(units));
}

// ---------------------------------------------------------------------------------------------
// The blocks.
// ---------------------------------------------------------------------------------------------

/// ggml's block_q8_0: x[j] = qs[j] · d.
struct Q8_0 {
  std::uint16_t d;     // binary16 scale
  std::int8_t qs[32];  // [32] codes
};

/// ggml's block_q4_0: x[j] = ((qs[j] & 15) − 8) · d for j < 16, ((qs[j − 16] >> 4) − 8) · d for
/// j ≥ 16 (the low nibbles hold the first half of the block, the high nibbles the second).
struct Q4_0 {
  std::uint16_t d;      // binary16 scale
  std::uint8_t qs[16];  // [16] two 4-bit codes each
};

static_assert(sizeof(Q8_0) == 34 && std::is_trivially_copyable_v<Q8_0>);
static_assert(sizeof(Q4_0) == 18 && std::is_trivially_copyable_v<Q4_0>);

/// Whether W is a block format (weights in blocks of kWeightBlock) rather than one value each.
template <class W>
inline constexpr bool kIsBlockFormat = std::is_same_v<W, Q8_0> || std::is_same_v<W, Q4_0>;

/// The format's name as ggml spells it ("q8_0", "q4_0").
template <class W>
constexpr const char* block_format_name() {
  return std::is_same_v<W, Q8_0> ? "q8_0" : "q4_0";
}

/// x [32] → one Q8_0 block as ggml's quantize_row_q8_0_ref forms it: d = max|x| / 127,
/// qs = round(x / d) (half away from zero), d stored as binary16.
inline Q8_0 quantize_block_q8_0(const float* x) {
  float amax = 0;
  for (std::size_t j = 0; j < kWeightBlock; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  Q8_0 b{};
  b.d = float_to_f16(d);
  for (std::size_t j = 0; j < kWeightBlock; ++j) {
    // |q| ≤ 127, except where d is subnormal and 1/d overflows (the stored f16 d is then 0, so
    // any code gives 0): clamped, as converting an out-of-range float is undefined. NaN (a
    // non-finite input) stores 0.
    const float q = std::round(x[j] * id);
    b.qs[j] = static_cast<std::int8_t>(q == q ? std::clamp(q, -127.0f, 127.0f) : 0.0f);
  }
  return b;
}

/// x [32] → one Q4_0 block as ggml's quantize_row_q4_0_ref forms it: the value m of largest
/// magnitude maps to code 0 (d = m / −8), codes = min(15, trunc(x / d + 8.5)).
inline Q4_0 quantize_block_q4_0(const float* x) {
  float amax = 0;
  float m = 0;
  for (std::size_t j = 0; j < kWeightBlock; ++j) {
    if (std::fabs(x[j]) > amax) {
      amax = std::fabs(x[j]);
      m = x[j];
    }
  }
  const float d = m / -8.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  Q4_0 b{};
  b.d = float_to_f16(d);
  const auto code = [&](float v) {
    const float c = v * id + 8.5f;  // NaN (a non-finite input) stores code 0
    return static_cast<std::uint8_t>(c >= 0.0f ? std::min(c, 15.0f) : 0.0f);
  };
  for (std::size_t j = 0; j < kWeightBlock / 2; ++j)
    b.qs[j] = static_cast<std::uint8_t>(code(x[j]) | (code(x[j + 16]) << 4));
  return b;
}

inline Q8_0 quantize_block(const float* x, Q8_0*) { return quantize_block_q8_0(x); }
inline Q4_0 quantize_block(const float* x, Q4_0*) { return quantize_block_q4_0(x); }

/// x [n] → blocks [n / 32]; n must be a multiple of kWeightBlock.
template <class B>
void quantize_row(const float* x, B* out, std::size_t n) {
  for (std::size_t b = 0; b < n / kWeightBlock; ++b)
    out[b] = quantize_block(x + b * kWeightBlock, static_cast<B*>(nullptr));
}

/// blocks [n / 32] → out [n]: each value as the block's formula gives it, in f32.
inline void dequantize_row(const Q8_0* in, float* out, std::size_t n) {
  for (std::size_t b = 0; b < n / kWeightBlock; ++b) {
    const float d = f16_to_float(in[b].d);
    for (std::size_t j = 0; j < kWeightBlock; ++j)
      out[b * kWeightBlock + j] = static_cast<float>(in[b].qs[j]) * d;
  }
}

inline void dequantize_row(const Q4_0* in, float* out, std::size_t n) {
  for (std::size_t b = 0; b < n / kWeightBlock; ++b) {
    const float d = f16_to_float(in[b].d);
    for (std::size_t j = 0; j < kWeightBlock / 2; ++j) {
      out[b * kWeightBlock + j] = static_cast<float>((in[b].qs[j] & 15) - 8) * d;
      out[b * kWeightBlock + j + 16] = static_cast<float>((in[b].qs[j] >> 4) - 8) * d;
    }
  }
}

}  // namespace kvdecode
