// MemoryPlanner: the KV-cache bytes a config needs for a context length and batch, and the
// longest context a byte budget holds, as constexpr arithmetic on the config, so a server can
// size its caches (or reject a request) before allocating anything.
#pragma once

#include <cstdint>
#include <limits>

#include "kvdecode/error.hpp"
#include "kvdecode/model_config.hpp"

namespace kvdecode {

/// Which store layout the plan is for. Each kind has its own bytes-per-position rule; new store
/// kinds add an enumerator and a case in MemoryPlanner::bytes_per_position (TODO(#4): paged,
/// quantized and windowed stores).
enum class StoreKind {
  kContiguous,  ///< ContiguousStore<T>: [n_layers][n_kv_heads][capacity][head_size] K and V
};

/// KV-cache sizing for one config, element type T and store kind. Every size is 64-bit and
/// computed without overflow for any config that passes ModelConfig::validate().
///
/// The figure is what the store's memory_bytes() reports: the K and V blocks it reserves up
/// front. ContiguousStore's int32 token-id array (4 bytes per position, once, not per layer)
/// is bookkeeping and is not part of it.
template <class T, StoreKind kKind = StoreKind::kContiguous>
class MemoryPlanner {
 public:
  constexpr explicit MemoryPlanner(const ModelConfig& cfg)
      : n_layers_(checked(cfg.n_layers, "n_layers")),
        n_kv_heads_(checked(cfg.n_kv_heads, "n_kv_heads")),
        head_size_(checked(cfg.dim, "dim") / checked(cfg.n_heads, "n_heads")) {}

  /// Bytes one cached position of one sequence takes: K and V of every layer and kv head,
  /// 2 × n_layers × n_kv_heads × head_size × sizeof(T).
  constexpr std::uint64_t bytes_per_position() const {
    switch (kKind) {
      case StoreKind::kContiguous:
        return 2 * n_layers_ * n_kv_heads_ * head_size_ * sizeof(T);
    }
    return 0;  // unreachable: every kind is handled above
  }

  /// Bytes of `batch` stores of `context` positions each (what batch × memory_bytes() of
  /// ContiguousStore(cfg, context) gives). Throws Error when the product exceeds 64 bits.
  constexpr std::uint64_t kv_bytes(std::uint64_t context, std::uint64_t batch = 1) const {
    const std::uint64_t per = bytes_per_position();
    constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
    KVDECODE_CHECK(batch == 0 || context <= kMax / batch / per,
                   "MemoryPlanner::kv_bytes: ", context, " positions × batch ", batch, " × ", per,
                   " bytes per position overflows 64 bits");
    return context * batch * per;
  }

  /// The largest context T with kv_bytes(T, batch) ≤ budget_bytes (0 when not even one position
  /// fits). Not capped by cfg.seq_len: min() it with the model's context when that matters.
  constexpr std::uint64_t max_context(std::uint64_t budget_bytes, std::uint64_t batch = 1) const {
    KVDECODE_CHECK(batch > 0, "MemoryPlanner::max_context: batch must be positive, got 0");
    // floor(budget / (batch × per)) computed as two floors, which is the same and cannot
    // overflow: floor(floor(a / b) / c) = floor(a / (b c)) for positive integers.
    return budget_bytes / bytes_per_position() / batch;
  }

 private:
  static constexpr std::uint64_t checked(std::int64_t value, const char* name) {
    KVDECODE_CHECK(value > 0, "MemoryPlanner: ModelConfig::", name, " must be positive, got ",
                   value);
    return static_cast<std::uint64_t>(value);
  }

  std::uint64_t n_layers_;
  std::uint64_t n_kv_heads_;
  std::uint64_t head_size_;
};

/// Bytes of the parameters a Weights<W> of cfg holds (= Weights<W>::bytes()), to compare the
/// cache with: at long context the KV cache outgrows the weights.
template <class W>
constexpr std::uint64_t weight_bytes(const ModelConfig& cfg) {
  const auto dim = static_cast<std::uint64_t>(cfg.dim);
  const auto hidden = static_cast<std::uint64_t>(cfg.hidden_dim);
  const auto layers = static_cast<std::uint64_t>(cfg.n_layers);
  const auto vocab = static_cast<std::uint64_t>(cfg.vocab_size);
  const std::uint64_t kv_dim =
      static_cast<std::uint64_t>(cfg.n_kv_heads) * (dim / static_cast<std::uint64_t>(cfg.n_heads));
  // Per layer: two gains, wq and wo [dim][dim], wk and wv [kv_dim][dim], w1 w2 w3 (hidden × dim).
  const std::uint64_t per_layer = 2 * dim + 2 * dim * dim + 2 * kv_dim * dim + 3 * hidden * dim;
  const std::uint64_t classifier = cfg.shared_classifier ? 0 : vocab * dim;
  return (vocab * dim + layers * per_layer + dim + classifier) * sizeof(W);
}

}  // namespace kvdecode
