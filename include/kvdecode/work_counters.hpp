// WorkCounters: exact counts of the work a forward pass does, kept only when the caller passes a
// counters object, so the uncounted path pays one null-pointer test per layer.
#pragma once

#include <cstdint>

namespace kvdecode {

/// The work of one phase (prefill or decode), summed over layers and heads.
struct PhaseCounters {
  std::uint64_t tokens = 0;            ///< tokens run through the model
  std::uint64_t kv_projections = 0;    ///< K/V rows computed: tokens × layers
  std::uint64_t attention_scores = 0;  ///< q·k dot products: Σ over layers, query heads, queries
  std::uint64_t kv_bytes_written = 0;  ///< bytes of K and V appended to the store
  std::uint64_t kv_bytes_read = 0;     ///< bytes of K and V read by attention (each kv head once)
  std::uint64_t weight_bytes_read = 0; ///< parameter bytes streamed (each matrix once per call)
  std::uint64_t flops = 0;             ///< multiply-adds × 2 of the matrix products and attention

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
