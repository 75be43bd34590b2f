// WorkCounters: exact counts of the work a forward pass does, kept only when the caller passes a
// counters object. The forward pass sums a few figures per chunk (StepWork: the K/V bytes its
// stores say attention reads, the chunks, the keys the causal mask lets through) and adds them
// once per call, so the uncounted path pays one null-pointer test per call.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvdecode/model/model_config.hpp"

namespace kvdecode {

/// What one call of the forward pass did, summed over its sequences and chunks; the counters
/// turn it into bytes and FLOPs with the model's shape.
struct StepWork {
  std::uint64_t tokens = 0;  ///< tokens run
  /// keys the causal mask lets each query see, summed over queries (per layer and query head)
  std::uint64_t visible = 0;
  /// bytes attention read from the stores, all layers and kv heads: Σ over (sequence, chunk)
  /// of the store's read_bytes up to the chunk's last row of that sequence
  std::uint64_t kv_bytes_read = 0;
  std::uint64_t chunks = 0;        ///< passes over the layer weights
  std::uint64_t logit_chunks = 0;  ///< passes over the classifier
  std::uint64_t logit_rows = 0;    ///< rows of logits computed
};

/// The work of one phase (prefill or decode), summed over layers and heads.
struct PhaseCounters {
  std::uint64_t tokens = 0;          ///< tokens run through the model
  std::uint64_t kv_projections = 0;  ///< K/V rows computed: tokens × layers
  /// q·k dot products the causal mask lets through: Σ over layers, query heads and queries of
  /// the keys each query sees (a k-token prefill pays k(k+1)/2 per layer and head)
  std::uint64_t attention_scores = 0;
  std::uint64_t kv_bytes_written = 0;  ///< bytes of K and V appended to the store
  /// bytes attention read from the store, as the store represents them (f32 rows, int8 or
  /// 4-bit codes with their scales, only the resident rows of a window): each kv head's rows
  /// up to the chunk's last query, once per chunk (the kv_mul query heads sharing a kv head
  /// reuse its tiles)
  std::uint64_t kv_bytes_read = 0;
  /// parameter bytes streamed: layer matrices and gains once per chunk, the classifier once per
  /// chunk that computes logits, one embedding row per token
  std::uint64_t weight_bytes_read = 0;
  std::uint64_t flops = 0;  ///< multiply-adds × 2 of the projections, classifier, q·k and p·v

  /// Adds one call's work on a model of shape cfg computing in elements of compute_bytes bytes
  /// with weight_bytes bytes per weights_per_unit weights (a block format: 34 or 18 bytes per
  /// 32; its f32 gains, 0.1 % of a layer, are counted at the same rate).
  void add(const ModelConfig& cfg, std::size_t compute_bytes, std::size_t weight_bytes,
           const StepWork& w, std::size_t weights_per_unit = 1) {
    const auto L = static_cast<std::uint64_t>(cfg.n_layers);
    const auto dim = static_cast<std::uint64_t>(cfg.dim);
    const auto kv_dim = static_cast<std::uint64_t>(cfg.kv_dim());
    const auto hidden = static_cast<std::uint64_t>(cfg.hidden_dim);
    const auto vocab = static_cast<std::uint64_t>(cfg.vocab_size);
    const auto hs = static_cast<std::uint64_t>(cfg.head_size());
    const auto n_heads = static_cast<std::uint64_t>(cfg.n_heads);
    // kv_bytes_written: the K/V rows the model hands the stores, in the compute type.
    tokens += w.tokens;
    kv_projections += w.tokens * L;
    attention_scores += w.visible * n_heads * L;
    kv_bytes_written += 2 * w.tokens * kv_dim * L * compute_bytes;
    kv_bytes_read += w.kv_bytes_read;
    // Weights: every layer matrix and gain once per chunk; the final gain and the classifier
    // once per chunk that computes logits; one embedding row per token.
    const std::uint64_t layer_matrices = dim * dim * 2 + kv_dim * dim * 2 + hidden * dim * 3;
    weight_bytes_read += (w.chunks * L * (layer_matrices + 2 * dim) +
                          w.logit_chunks * (dim + vocab * dim) + w.tokens * dim) *
                         weight_bytes / weights_per_unit;
    // FLOPs of the matrix products (2 per multiply-add): projections, classifier, q·k and p·v.
    flops += 2 * w.tokens * L * layer_matrices + 2 * w.logit_rows * vocab * dim +
             4 * w.visible * n_heads * hs * L;
  }

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
