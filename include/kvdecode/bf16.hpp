// bf16: the bfloat16 weight-storage type (1 sign, 8 exponent, 7 mantissa bits: float's upper
// half). Weights stored as bf16 halve the bytes a decode step streams; arithmetic stays in f32.
#pragma once

#include <bit>
#include <cstdint>

namespace kvdecode {

/// A bfloat16 value. Conversions are explicit so that no f32 computation silently narrows:
/// bf16(x) rounds x to nearest-even (relative error ≤ 2^-8 = half an ulp of 8 significant
/// bits), float(b) is exact. NaN stays NaN (quiet); ±inf and ±0 are kept.
struct bf16 {
  std::uint16_t bits = 0;

  bf16() = default;
  explicit bf16(float x) : bits(round(x)) {}
  explicit bf16(double x) : bf16(static_cast<float>(x)) {}
  explicit operator float() const {
    return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
  }
  explicit operator double() const { return static_cast<double>(static_cast<float>(*this)); }

  static bf16 from_bits(std::uint16_t b) {
    bf16 r;
    r.bits = b;
    return r;
  }
  friend bool operator==(bf16 a, bf16 b) { return a.bits == b.bits; }

 private:
  static std::uint16_t round(float x) {
    const auto u = std::bit_cast<std::uint32_t>(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
    // Round to nearest, ties to even: add 0x7FFF plus the lowest kept bit, then truncate.
    const std::uint32_t lsb = (u >> 16) & 1u;
    return static_cast<std::uint16_t>((u + 0x7FFFu + lsb) >> 16);
  }
};

static_assert(sizeof(bf16) == 2);

/// Widens a stored value to the compute type: the identity for T, exact for bf16 → float.
template <class T, class W>
inline T widen(W w) {
  return static_cast<T>(w);
}

}  // namespace kvdecode
