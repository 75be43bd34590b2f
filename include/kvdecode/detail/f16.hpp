// IEEE 754 binary16 (f16) conversions in portable code, for the quantized stores' ranges: an
// f16 (min, step) pair costs half an f32 one, and its 11-bit significand is far finer than
// the 2- and 4-bit steps it describes.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

namespace kvdecode::detail {

/// The f16 nearest to x (ties to even); beyond ±65504 it is ±infinity, NaN stays NaN.
inline std::uint16_t f16_from_float(float x) {
  const std::uint32_t b = std::bit_cast<std::uint32_t>(x);
  const auto sign = static_cast<std::uint16_t>((b >> 16) & 0x8000u);
  const std::uint32_t abs = b & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return static_cast<std::uint16_t>(sign | 0x7E00u);   // NaN
  if (abs >= 0x477FF000u) return static_cast<std::uint16_t>(sign | 0x7C00u);  // rounds to inf
  if (abs < 0x38800000u) {
    // Subnormal f16 (or zero): the value in units of 2^-24, rounded to nearest even.
    const float units = std::bit_cast<float>(abs) * 16777216.0f;  // exact: a power of two
    return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(std::nearbyint(units)));
  }
  // Normal: rebias the exponent (127 → 15) and round the 13 dropped significand bits.
  const std::uint32_t rebased = abs - 0x38000000u;
  const std::uint32_t rounded = rebased + 0xFFFu + ((rebased >> 13) & 1u);
  return static_cast<std::uint16_t>(sign | (rounded >> 13));
}

/// The f16 h as a float (exact).
inline float f16_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  float v = 0;
  if (exp == 0) {
    v = static_cast<float>(man) * 0x1p-24f;
  } else if (exp == 31) {
    v = man == 0 ? INFINITY : NAN;
  } else {
    v = std::bit_cast<float>(((exp + 112u) << 23) | (man << 13));
  }
  return std::bit_cast<float>(std::bit_cast<std::uint32_t>(v) | sign);
}

/// The largest f16 not above x (x finite and within ±65504).
inline std::uint16_t f16_at_most(float x) {
  std::uint16_t h = f16_from_float(x);
  if (f16_to_float(h) > x) {
    if (h == 0x0000u) return 0x8001u;                       // +0 → the smallest negative
    h = (h & 0x8000u) ? static_cast<std::uint16_t>(h + 1)   // negative: away from zero
                      : static_cast<std::uint16_t>(h - 1);  // positive: toward zero
  }
  return h;
}

/// The smallest f16 not below x ≥ 0 (finite and within 65504).
inline std::uint16_t f16_at_least(float x) {
  std::uint16_t h = f16_from_float(x);
  if (f16_to_float(h) < x) h = static_cast<std::uint16_t>(h + 1);
  return h;
}

/// [lo, hi] of the n values x[i · stride] as f32; both NaN if any is, since std::min and
/// std::max pass over a NaN and it would then be coded as a finite value of the range.
template <typename T>
void value_range(const T* x, std::size_t n, std::size_t stride, float& lo, float& hi) {
  lo = static_cast<float>(x[0]);
  hi = lo;
  bool nan = std::isnan(lo);
  for (std::size_t i = 1; i < n; ++i) {
    const auto v = static_cast<float>(x[i * stride]);
    lo = std::min(lo, v);
    hi = std::max(hi, v);
    nan = nan || std::isnan(v);
  }
  if (nan) lo = hi = std::numeric_limits<float>::quiet_NaN();
}

/// The f16 (min, step) covering [lo, hi] with codes 0 .. levels: min rounded down and step up,
/// so that every x in the range has a code within [0, levels] and errs by at most step / 2. A
/// range that f16 cannot hold (a bound beyond ±65504, or NaN) gets a non-finite min, so every
/// value decoded from it is non-finite and attention carries it on like a NaN row, never a
/// finite row outside that bound.
inline void f16_range(float lo, float hi, float levels, std::uint16_t& mn, std::uint16_t& step) {
  if (!(std::abs(lo) <= 65504.0f && std::abs(hi) <= 65504.0f)) {
    const float inf = std::numeric_limits<float>::infinity();
    mn = f16_from_float(std::isnan(lo) || std::isnan(hi) ? std::numeric_limits<float>::quiet_NaN()
                        : std::abs(lo) > 65504.0f        ? std::copysign(inf, lo)
                                                         : std::copysign(inf, hi));
    step = f16_from_float((hi - lo) / levels);
    return;
  }
  mn = f16_at_most(lo);
  step = f16_at_least((hi - f16_to_float(mn)) / levels);
}

/// The code of x in a range of minimum mn and inv = 1 / step (0 for a zero step): round((x −
/// mn) · inv) clamped to [0, levels]; a non-finite value gives code 0 instead of an undefined
/// conversion.
inline std::uint8_t range_code(float x, float mn, float inv, float levels) {
  const float r = std::nearbyint((x - mn) * inv);
  return static_cast<std::uint8_t>(r >= 0.0f ? std::min(r, levels) : 0.0f);
}

}  // namespace kvdecode::detail
