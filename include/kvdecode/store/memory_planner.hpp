// MemoryPlanner<S>: the KV-cache bytes a config needs for a context length and batch, and the
// longest context a byte budget holds, for any store S, from the store's own formula
// (S::memory_bytes_for), so a server can size its caches (or reject a request) before
// allocating anything.
#pragma once

#include <cstdint>

#include "kvdecode/detail/store_sizes.hpp"
#include "kvdecode/error.hpp"
#include "kvdecode/model/model_config.hpp"
#include "kvdecode/store/kv_store.hpp"
#include "kvdecode/weight_blocks.hpp"

namespace kvdecode {

/// KV-cache sizing for one config and store S built with `options` (whose capacity the planner
/// sets). kv_bytes(T) is exactly what memory_bytes() of a store of capacity T reports: every
/// byte it allocates, the K/V data, scales, any fixed part it reserves up front (the 4-bit
/// store's staging, the window's ring) and its token ids, each buffer rounded up to its
/// alignment (aligned_allocation_bytes: 64 B, or 2 MiB for a buffer of 4 MiB or more). For
/// PagedStore the figure is one sequence's blocks without prefix sharing: shared blocks only make
/// it smaller. Every size is 64-bit.
///
/// The per-position and fixed figures are read off the formula at T = kSpan and 2 kSpan, where
/// every buffer that grows with T is a whole number of 2 MiB (kSpan / G too, for any
/// power-of-two group or block size G up to 2^16), so alignment adds nothing to the slope.
template <KvStore S>
class MemoryPlanner {
 public:
  using Options = typename S::Options;

  constexpr explicit MemoryPlanner(const ModelConfig& cfg, Options options = {})
      : cfg_(cfg), options_(options) {
    checked(cfg.n_layers, "n_layers");
    checked(cfg.n_kv_heads, "n_kv_heads");
    checked(cfg.n_heads, "n_heads");
    checked(cfg.dim, "dim");
    KVDECODE_CHECK(bytes(1) > 0, "MemoryPlanner: the store options give a store of 0 bytes");
  }

  constexpr const Options& options() const { return options_; }

  /// Bytes each further cached position adds, averaged over kSpan positions; 0 for a window,
  /// whose memory does not grow.
  constexpr double bytes_per_position() const {
    return static_cast<double>(bytes(2 * kSpan) - bytes(kSpan)) / static_cast<double>(kSpan);
  }

  /// Bytes one store reserves whatever its capacity (the 4-bit staging; the window's ring):
  /// f(T) - T × bytes_per_position() at T = kSpan, in whole numbers as 2 f(T) - f(2T).
  constexpr std::uint64_t fixed_bytes() const {
    const std::uint64_t twice = detail::sat_mul({2, bytes(kSpan)}), at_2t = bytes(2 * kSpan);
    return twice > at_2t ? twice - at_2t : 0;
  }

  /// Bytes `batch` stores of `context` positions each reserve beyond context ×
  /// bytes_per_position() and fixed_bytes(): for a paged sequence the rows of its last block
  /// past its end (up to block_size − 1 positions each, what a larger block costs), and for
  /// every store its buffers' rounding to their alignment; 0 for a store sized to the position
  /// whose buffers are whole multiples of it.
  constexpr std::uint64_t padding_bytes(std::uint64_t context, std::uint64_t batch = 1) const {
    const std::uint64_t per_span = bytes(2 * kSpan) - bytes(kSpan);  // kSpan positions' bytes
    const std::uint64_t used =
        detail::sat_add({detail::sat_mul({per_span / kSpan, context}),
                         detail::sat_mul({per_span % kSpan, context}) / kSpan});
    const std::uint64_t all = bytes(context), fixed = fixed_bytes();
    const std::uint64_t one = all > fixed ? all - fixed : 0;
    return detail::sat_mul({one > used ? one - used : 0, batch});
  }

  /// Bytes of `batch` stores of `context` positions each: batch × memory_bytes() of the store
  /// built for that capacity. Throws Error when the figure exceeds 64 bits.
  constexpr std::uint64_t kv_bytes(std::uint64_t context, std::uint64_t batch = 1) const {
    const std::uint64_t b = detail::sat_mul({bytes(context), batch});
    KVDECODE_CHECK(b != detail::kSizeMax, "MemoryPlanner::kv_bytes: ", context,
                   " positions × batch ", batch, " overflows 64 bits");
    return b;
  }

  /// The largest context T with kv_bytes(T, batch) ≤ budget_bytes (0 when not even one position
  /// fits; the largest uint64 when the store's memory does not grow with T and one store fits).
  /// Not capped by cfg.seq_len: min() it with the model's context when that matters. A binary
  /// search over the store's formula, which never shrinks as T grows.
  constexpr std::uint64_t max_context(std::uint64_t budget_bytes, std::uint64_t batch = 1) const {
    KVDECODE_CHECK(batch > 0, "MemoryPlanner::max_context: batch must be positive, got 0");
    // batch × f(T) ≤ budget ⟺ f(T) ≤ floor(budget / batch), as f(T) is a whole number.
    const std::uint64_t per_store = budget_bytes / batch;
    if (bytes(1) > per_store) return 0;
    if (bytes(detail::kSizeMax) <= per_store) return detail::kSizeMax;
    std::uint64_t lo = 1, hi = detail::kSizeMax;  // f(lo) ≤ per_store < f(hi)
    while (hi - lo > 1) {
      const std::uint64_t mid = lo + (hi - lo) / 2;
      (bytes(mid) <= per_store ? lo : hi) = mid;
    }
    return lo;
  }

 private:
  // 2^37 positions: 2^21 (2 MiB) times 2^16, the largest group or block size the figures above
  // are exact for; its formula fits 64 bits for up to 2^26 bytes per position.
  static constexpr std::uint64_t kSpan = std::uint64_t{1} << 37;

  static constexpr void checked(std::int64_t value, const char* name) {
    KVDECODE_CHECK(value > 0, "MemoryPlanner: ModelConfig::", name, " must be positive, got ",
                   value);
  }

  /// One store's bytes at capacity T (saturating; T = 0 would mean seq_len to the store, and
  /// holds nothing here).
  constexpr std::uint64_t bytes(std::uint64_t context) const {
    if (context == 0) return 0;
    Options o = options_;
    o.capacity = static_cast<decltype(o.capacity)>(context);
    return S::memory_bytes_for(cfg_, o);
  }

  ModelConfig cfg_;
  Options options_;
};

/// Bytes of the parameters a Weights<W> of cfg holds (= Weights<W>::bytes()), to compare the
/// cache with: at long context the KV cache outgrows the weights. With a block format (Q8_0,
/// Q4_0) a matrix is weights / 32 blocks of sizeof(W) bytes and the gains stay f32.
template <class W>
constexpr std::uint64_t weight_bytes(const ModelConfig& cfg) {
  const auto dim = static_cast<std::uint64_t>(cfg.dim);
  const auto hidden = static_cast<std::uint64_t>(cfg.hidden_dim);
  const auto layers = static_cast<std::uint64_t>(cfg.n_layers);
  const auto vocab = static_cast<std::uint64_t>(cfg.vocab_size);
  const std::uint64_t kv_dim =
      static_cast<std::uint64_t>(cfg.n_kv_heads) * (dim / static_cast<std::uint64_t>(cfg.n_heads));
  // Per layer: wq and wo [dim][dim], wk and wv [kv_dim][dim], w1 w2 w3 (hidden × dim); two gains.
  const std::uint64_t classifier = cfg.shared_classifier ? 0 : vocab * dim;
  const std::uint64_t matrices =
      vocab * dim + layers * (2 * dim * dim + 2 * kv_dim * dim + 3 * hidden * dim) + classifier;
  const std::uint64_t gains = (2 * layers + 1) * dim;
  if constexpr (kIsBlockFormat<W>) return matrices / kWeightBlock * sizeof(W) + gains * 4;
  return (matrices + gains) * sizeof(W);
}

}  // namespace kvdecode
