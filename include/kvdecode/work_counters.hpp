// WorkCounters: exact counts of the work a forward pass does, kept only when the caller passes a
// counters object. Each count is a closed form in (cached positions, new tokens, chunk size), added
// once per prefill()/decode() call, so the uncounted path pays one null-pointer test per call.
#pragma once

#include <cstdint>

namespace kvdecode {

/// The work of one phase (prefill or decode), summed over layers and heads.
struct PhaseCounters {
  std::uint64_t tokens = 0;          ///< tokens run through the model
  std::uint64_t kv_projections = 0;  ///< K/V rows computed: tokens × layers
  /// q·k dot products the causal mask lets through: Σ over layers, query heads and queries of
  /// the keys each query sees (a k-token prefill pays k(k+1)/2 per layer and head)
  std::uint64_t attention_scores = 0;
  std::uint64_t kv_bytes_written = 0;  ///< bytes of K and V appended to the store
  /// bytes of K and V read by attention: each kv head's rows up to the chunk's last query, once
  /// per chunk (the kv_mul query heads sharing a kv head reuse its tiles)
  std::uint64_t kv_bytes_read = 0;
  /// parameter bytes streamed: layer matrices and gains once per chunk, the classifier once per
  /// chunk that computes logits, one embedding row per token
  std::uint64_t weight_bytes_read = 0;
  std::uint64_t flops = 0;  ///< multiply-adds × 2 of the projections, classifier, q·k and p·v

  PhaseCounters& operator+=(const PhaseCounters& o) {
    tokens += o.tokens;
    kv_projections += o.kv_projections;
    attention_scores += o.attention_scores;
    kv_bytes_written += o.kv_bytes_written;
    kv_bytes_read += o.kv_bytes_read;
    weight_bytes_read += o.weight_bytes_read;
    flops += o.flops;
    return *this;
  }
  friend bool operator==(const PhaseCounters&, const PhaseCounters&) = default;
};

struct WorkCounters {
  PhaseCounters prefill;  ///< Model::prefill calls (several tokens per call)
  PhaseCounters decode;   ///< Model::decode calls (one token per call)
  PhaseCounters total() const {
    PhaseCounters t = prefill;
    t += decode;
    return t;
  }
};

}  // namespace kvdecode
