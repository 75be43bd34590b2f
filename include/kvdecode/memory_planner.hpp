// MemoryPlanner: the KV-cache bytes a config needs for a context length and batch, and the
// longest context a byte budget holds, for every store kind, as constexpr arithmetic on the
// config, so a server can size its caches (or reject a request) before allocating anything.
#pragma once

#include <cstdint>
#include <limits>

#include "kvdecode/error.hpp"
#include "kvdecode/model_config.hpp"

namespace kvdecode {

/// Which store layout the plan is for; each has its own rule (MemoryPlanner::kv_bytes).
enum class StoreKind {
  kContiguous,  ///< ContiguousStore<T>: [n_layers][n_kv_heads][capacity][head_size] K and V
  kInt8,        ///< Int8Store<T>: int8 rows plus one f32 scale per (position, kv head)
  kQ4,          ///< Q4Store<T>: 4-bit codes, key (min, step) per channel and group, value per row
  kWindow,      ///< WindowStore<T>: S sinks and a ring of W - 1 + max_chunk positions
  kPaged,       ///< PagedStore<T>: whole blocks of block_size positions from a BlockPool
};

/// A store kind and the parameters its size depends on (the others are ignored).
struct StoreLayout {
  StoreKind kind = StoreKind::kContiguous;
  std::uint64_t group = 64;       ///< kQ4: positions per key group (Q4Store::kDefaultGroup)
  std::uint64_t window = 0;       ///< kWindow: W
  std::uint64_t sinks = 0;        ///< kWindow: S
  std::uint64_t max_chunk = 1;    ///< kWindow: the most positions one append brings
  bool streaming = false;         ///< kWindow: WindowPolicy::kStreaming (adds a rotation table)
  std::uint64_t block_size = 16;  ///< kPaged: positions per block
};

/// KV-cache sizing for one config, compute type T and store layout. Every size is 64-bit.
///
/// kv_bytes(T) is what the store's memory_bytes() reports for a capacity of T positions: the
/// K/V data, scales and any fixed part it reserves up front (the 4-bit store's full-precision
/// staging, the window's ring). The int32 token-id array every store keeps (4 bytes per
/// position, once, not per layer) is bookkeeping and is not part of it. For kPaged the figure
/// is one sequence's blocks without prefix sharing: shared blocks only make it smaller.
template <class T>
class MemoryPlanner {
 public:
  constexpr explicit MemoryPlanner(const ModelConfig& cfg, StoreLayout layout = {})
      : layout_(layout),
        n_layers_(checked(cfg.n_layers, "n_layers")),
        n_kv_heads_(checked(cfg.n_kv_heads, "n_kv_heads")),
        head_size_(checked(cfg.dim, "dim") / checked(cfg.n_heads, "n_heads")) {
    KVDECODE_CHECK(layout.kind != StoreKind::kQ4 || layout.group >= 2,
                   "MemoryPlanner: a 4-bit key group of ", layout.group,
                   " positions, expected at least 2");
    KVDECODE_CHECK(
        layout.kind != StoreKind::kWindow || (layout.window >= 1 && layout.max_chunk >= 1),
        "MemoryPlanner: a window of ", layout.window, " with max_chunk ", layout.max_chunk,
        ", expected both at least 1");
    KVDECODE_CHECK(layout.kind != StoreKind::kPaged || layout.block_size >= 1,
                   "MemoryPlanner: block_size must be at least 1");
  }

  constexpr const StoreLayout& layout() const { return layout_; }

  /// Bytes each further cached position adds, amortised over a key group for kQ4 (rounded
  /// down) and over a block for kPaged; 0 for kWindow, whose memory does not grow.
  constexpr std::uint64_t bytes_per_position() const {
    switch (layout_.kind) {
      case StoreKind::kContiguous:
      case StoreKind::kPaged:
        return f32_like_row();
      case StoreKind::kInt8:
        return 2 * heads() * (head_size_ + sizeof(float));
      case StoreKind::kQ4:
        return q4_group_bytes() / layout_.group;
      case StoreKind::kWindow:
        return 0;
    }
    return 0;  // unreachable: every kind is handled above
  }

  /// Bytes one store reserves whatever its capacity: the 4-bit store's staging of G positions
  /// and its cancel copy; the window's sinks, ring and (streaming) rotation table.
  constexpr std::uint64_t fixed_bytes() const {
    switch (layout_.kind) {
      case StoreKind::kQ4:
        return 4 * heads() * layout_.group * head_size_ * sizeof(T);
      case StoreKind::kWindow: {
        const std::uint64_t rows = layout_.sinks + layout_.window - 1 + layout_.max_chunk;
        const std::uint64_t table = layout_.streaming ? layout_.window * head_size_ : 0;
        return (2 * heads() * head_size_ * rows + table) * sizeof(T);
      }
      default:
        return 0;
    }
  }

  /// Bytes of `batch` stores of `context` positions each: batch × memory_bytes() of the store
  /// built for that capacity. Throws Error when the figure exceeds 64 bits.
  constexpr std::uint64_t kv_bytes(std::uint64_t context, std::uint64_t batch = 1) const {
    const std::uint64_t b = saturating_bytes(context, batch);
    KVDECODE_CHECK(b != kMax, "MemoryPlanner::kv_bytes: ", context, " positions × batch ", batch,
                   " overflows 64 bits");
    return b;
  }

  /// The largest context T with kv_bytes(T, batch) ≤ budget_bytes (0 when not even one position
  /// fits; the largest uint64 for kWindow when one store fits, as its memory does not grow with
  /// T). Not capped by cfg.seq_len: min() it with the model's context when that matters.
  constexpr std::uint64_t max_context(std::uint64_t budget_bytes, std::uint64_t batch = 1) const {
    KVDECODE_CHECK(batch > 0, "MemoryPlanner::max_context: batch must be positive, got 0");
    // batch × f(T) ≤ budget ⟺ f(T) ≤ floor(budget / batch), as f(T) is a whole number.
    const std::uint64_t per_store = budget_bytes / batch;
    const std::uint64_t fixed = fixed_bytes();
    if (per_store < fixed) return 0;
    const std::uint64_t room = per_store - fixed;
    switch (layout_.kind) {
      case StoreKind::kContiguous:
      case StoreKind::kInt8:
        return room / bytes_per_position();
      case StoreKind::kPaged: {  // whole blocks: ceil(T / bs) × bs × row ≤ room
        const std::uint64_t blocks = room / f32_like_row() / layout_.block_size;
        return blocks * layout_.block_size;
      }
      case StoreKind::kQ4: {  // floor(T / G) full groups; a partial group lives in the staging
        const std::uint64_t groups = room / q4_group_bytes();
        return groups > (kMax - (layout_.group - 1)) / layout_.group
                   ? kMax
                   : groups * layout_.group + layout_.group - 1;
      }
      case StoreKind::kWindow:
        return kMax;
    }
    return 0;  // unreachable
  }

 private:
  static constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();

  static constexpr std::uint64_t checked(std::int64_t value, const char* name) {
    KVDECODE_CHECK(value > 0, "MemoryPlanner: ModelConfig::", name, " must be positive, got ",
                   value);
    return static_cast<std::uint64_t>(value);
  }

  constexpr std::uint64_t heads() const { return n_layers_ * n_kv_heads_; }
  /// K and V of one position in T: 2 × n_layers × n_kv_heads × head_size × sizeof(T).
  constexpr std::uint64_t f32_like_row() const { return 2 * heads() * head_size_ * sizeof(T); }
  /// One full 4-bit group of G positions in every (layer, kv head): K and V codes (G × hs / 2
  /// bytes each), a key (min, step) f32 pair per channel, a value pair per position.
  constexpr std::uint64_t q4_group_bytes() const {
    const std::uint64_t g = layout_.group;
    return heads() * (g * head_size_ + 2 * sizeof(float) * head_size_ + 2 * sizeof(float) * g);
  }

  /// a × b, or kMax when it would overflow.
  static constexpr std::uint64_t mul(std::uint64_t a, std::uint64_t b) {
    return b != 0 && a > kMax / b ? kMax : a * b;
  }
  static constexpr std::uint64_t add(std::uint64_t a, std::uint64_t b) {
    return a > kMax - b ? kMax : a + b;
  }

  /// kv_bytes without the overflow check: kMax when the figure does not fit in 64 bits.
  constexpr std::uint64_t saturating_bytes(std::uint64_t context, std::uint64_t batch) const {
    std::uint64_t one = 0;
    switch (layout_.kind) {
      case StoreKind::kContiguous:
      case StoreKind::kInt8:
        one = mul(context, bytes_per_position());
        break;
      case StoreKind::kPaged:
        one = mul(mul((context + layout_.block_size - 1) / layout_.block_size, layout_.block_size),
                  f32_like_row());
        break;
      case StoreKind::kQ4:
        one = add(mul(context / layout_.group, q4_group_bytes()), fixed_bytes());
        break;
      case StoreKind::kWindow:
        one = fixed_bytes();
        break;
    }
    return mul(one, batch);
  }

  StoreLayout layout_;
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
