// The arithmetic of the stores' byte formulas: the (layers × kv heads × head size) shape a
// config gives every store, and saturating 64-bit products, so that a figure too large for 64
// bits comes out as kSizeMax (which MemoryPlanner reports as an overflow) instead of wrapping.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <limits>

#include "kvdecode/model/model_config.hpp"

namespace kvdecode::detail {

inline constexpr std::uint64_t kSizeMax = std::numeric_limits<std::uint64_t>::max();

/// a · b · ..., or kSizeMax when the product does not fit.
constexpr std::uint64_t sat_mul(std::initializer_list<std::uint64_t> factors) {
  std::uint64_t p = 1;
  for (const std::uint64_t f : factors) {
    if (f == 0) return 0;
    p = p > kSizeMax / f ? kSizeMax : p * f;
  }
  return p;
}
/// a + b + ..., or kSizeMax when the sum does not fit.
constexpr std::uint64_t sat_add(std::initializer_list<std::uint64_t> terms) {
  std::uint64_t s = 0;
  for (const std::uint64_t t : terms) s = s > kSizeMax - t ? kSizeMax : s + t;
  return s;
}

/// The shape of a model's K/V as every store sees it.
struct KvDims {
  std::uint64_t layers = 0;
  std::uint64_t kv_heads = 0;
  std::uint64_t head_size = 0;

  static constexpr KvDims of(const ModelConfig& cfg) {
    return {static_cast<std::uint64_t>(cfg.n_layers), static_cast<std::uint64_t>(cfg.n_kv_heads),
            static_cast<std::uint64_t>(cfg.n_heads > 0 ? cfg.dim / cfg.n_heads : 0)};
  }
  /// (layer, kv head) pairs: the rows one position adds to each of K and V.
  constexpr std::uint64_t heads() const { return layers * kv_heads; }
  /// K and V of one position in element type of `bytes` bytes, every layer and kv head.
  constexpr std::uint64_t row_bytes(std::uint64_t bytes) const {
    return sat_mul({2, heads(), head_size, bytes});
  }
};

/// The capacity a store option of 0 stands for: the model's context.
constexpr std::uint64_t capacity_or_seq_len(std::uint64_t capacity, const ModelConfig& cfg) {
  return capacity == 0 ? static_cast<std::uint64_t>(cfg.seq_len) : capacity;
}

}  // namespace kvdecode::detail
