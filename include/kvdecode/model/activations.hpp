// Activations<T>: every buffer one forward step of up to max_chunk tokens writes, allocated at
// construction so that decode allocates nothing. One per thread of decoding; the Model is shared.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kvdecode/aligned_buffer.hpp"
#include "kvdecode/detail/gemm.hpp"
#include "kvdecode/detail/qgemv.hpp"
#include "kvdecode/error.hpp"
#include "kvdecode/model/attention.hpp"
#include "kvdecode/model/model_config.hpp"
#include "kvdecode/model/work_counters.hpp"
#include "kvdecode/thread_pool.hpp"

namespace kvdecode {

namespace detail {
/// Rows [row, row + rows) of a chunk that belong to sequence `seq` of a batch, at pending
/// offsets [pending_first, pending_first + rows) of its store's open append.
struct SequenceRows {
  std::size_t seq = 0;
  std::size_t row = 0;
  std::size_t pending_first = 0;
  std::size_t rows = 0;
};
}  // namespace detail

/// What an Activations is sized for.
struct ActivationsOptions {
  /// Tokens one forward pass runs: prefill splits longer inputs into chunks of this many.
  /// Larger chunks read each weight once for more tokens; the scratch grows with it.
  std::size_t max_chunk = 64;
  /// Sequences a decode_batch / prefill_batch may run at once (logits rows for each; the chunk
  /// is raised to at least this, so a batched decode step is one pass).
  std::size_t max_batch = 1;
  /// The store's block_scratch_size() (0 for stores that read in place).
  std::size_t store_scratch = 0;
  /// Whether the model's weights are bf16 (Model<float, bf16>), whose multi-token projections
  /// round their f32 input to bf16 first, into x_rounded. false (f32 or double weights) leaves
  /// that buffer out; the model refuses such Activations if its weights need it.
  bool bf16_weights = true;
  /// The threads every step runs on (not owned; kept alive as long as these Activations are
  /// used); nullptr runs everything on the caller.
  ThreadPool* thread_pool = nullptr;
};

template <class T>
struct Activations {
  /// The most tokens and sequences any size option may ask for: a bound that keeps every buffer
  /// size well inside 64 bits for any config a checkpoint may hold.
  static constexpr std::size_t kMaxChunk = std::size_t{1} << 20;

  Activations() = default;
  /// Scratch for the model cfg sized as `options` says (see ActivationsOptions). Throws Error,
  /// allocating nothing, for a chunk or batch of 0 or above kMaxChunk.
  explicit Activations(const ModelConfig& cfg, const ActivationsOptions& options = {})
      : max_chunk(std::max(options.max_chunk, options.max_batch)),
        max_batch(options.max_batch),
        pool(options.thread_pool),
        n_threads(options.thread_pool == nullptr ? 1 : options.thread_pool->size()) {
    KVDECODE_CHECK(options.max_chunk >= 1 && options.max_chunk <= kMaxChunk,
                   "Activations: max_chunk ", options.max_chunk, ", expected 1 to ", kMaxChunk);
    KVDECODE_CHECK(options.max_batch >= 1 && options.max_batch <= kMaxChunk,
                   "Activations: max_batch ", options.max_batch, ", expected 1 to ", kMaxChunk);
    const std::size_t store_scratch = options.store_scratch;
    cfg.validate();
    const std::size_t n = this->max_chunk;
    const auto dim = static_cast<std::size_t>(cfg.dim);
    const auto kv_dim = static_cast<std::size_t>(cfg.kv_dim());
    const auto hidden = static_cast<std::size_t>(cfg.hidden_dim);
    const auto half = static_cast<std::size_t>(cfg.head_size()) / 2;
    x = AlignedBuffer<T>(n * dim);
    xb = AlignedBuffer<T>(n * dim);
    q = AlignedBuffer<T>(n * dim);
    k = AlignedBuffer<T>(n * kv_dim);
    v = AlignedBuffer<T>(n * kv_dim);
    att = AlignedBuffer<T>(n * dim);
    hb = AlignedBuffer<T>(n * hidden);
    hb2 = AlignedBuffer<T>(n * hidden);
    rope_cos = AlignedBuffer<T>(n * half);
    rope_sin = AlignedBuffer<T>(n * half);
    logits = AlignedBuffer<T>(static_cast<std::size_t>(cfg.vocab_size));
    batch_logits = AlignedBuffer<T>(max_batch * static_cast<std::size_t>(cfg.vocab_size));
    sequence_rows.resize(n);
    attention = AttentionScratch<T>(cfg, n, store_scratch, n_threads);
    if (n > 1) {  // several tokens with bf16 weights widen panels of weight rows and round x
      const auto max_in = static_cast<std::size_t>(std::max(cfg.dim, cfg.hidden_dim));
      panel_stride = detail::kPanelRows * max_in;
      panels = AlignedBuffer<T>(n_threads * panel_stride);
      if constexpr (std::is_same_v<T, float>) {
        if (options.bf16_weights) x_rounded = AlignedBuffer<T>(n * max_in);
      }
    }
    if constexpr (std::is_same_v<T, float>) {  // the input of block-format weights, quantized
      const auto max_in = static_cast<std::size_t>(std::max(cfg.dim, cfg.hidden_dim));
      x_codes = AlignedBuffer<std::int8_t>(n * max_in);
      x_scales = AlignedBuffer<float>(n * max_in / 32);
      x_sums = AlignedBuffer<std::int32_t>(n * max_in / 32);
    }
  }

  std::size_t max_chunk = 1;      // tokens one pass runs (≥ max_batch)
  std::size_t max_batch = 1;      // sequences a decode_batch / prefill_batch may run at once
  AlignedBuffer<T> x;             // [max_chunk] [dim]         residual stream
  AlignedBuffer<T> xb;            // [max_chunk] [dim]         normed input / projection output
  AlignedBuffer<T> q;             // [max_chunk] [dim]         rotated queries
  AlignedBuffer<T> k;             // [max_chunk] [kv_dim]      rotated keys of the new tokens
  AlignedBuffer<T> v;             // [max_chunk] [kv_dim]      values of the new tokens
  AlignedBuffer<T> att;           // [max_chunk] [dim]         attention output, heads side by side
  AlignedBuffer<T> hb;            // [max_chunk] [hidden_dim]  FFN gate, then silu(gate) ⊙ up
  AlignedBuffer<T> hb2;           // [max_chunk] [hidden_dim]  FFN up
  AlignedBuffer<T> rope_cos;      // [max_chunk] [head_size/2] RoPE angles of each new token
  AlignedBuffer<T> rope_sin;      // [max_chunk] [head_size/2]
  AlignedBuffer<T> logits;        // [vocab_size]              logits of the last token
  AlignedBuffer<T> batch_logits;  // [max_batch][vocab_size] last-token logits of each sequence
  std::vector<detail::SequenceRows> sequence_rows;  // [max_chunk]  of the chunk being run (batches)
  AttentionScratch<T> attention;
  std::size_t panel_stride = 0;  // kPanelRows × max(dim, hidden_dim) when max_chunk > 1, else 0
  AlignedBuffer<T> panels;       // [n_threads][kPanelRows][max(dim, hidden_dim)] widened weights
  AlignedBuffer<T> x_rounded;    // [max_chunk] [max(dim, hidden_dim)] input rounded to bf16
                                 // (f32 activations of bf16 weights, max_chunk > 1; else empty)
  AlignedBuffer<std::int8_t> x_codes;  // [max_chunk] [max(dim, hidden_dim)] input as int8 codes
  AlignedBuffer<float> x_scales;       // [max_chunk] [max(dim, hidden_dim) / 32] their scales
  AlignedBuffer<std::int32_t> x_sums;  // [max_chunk] [max(dim, hidden_dim) / 32] the sum of
                                       // each block of codes (qgemv.hpp)
  /// The threads every step runs on (not owned); nullptr runs everything on the caller.
  ThreadPool* pool = nullptr;
  /// Threads the per-thread scratch was sized for: a pool set later may have at most this many.
  std::size_t n_threads = 1;
  /// When set, the forward pass adds the work it does here (see work_counters.hpp).
  WorkCounters* counters = nullptr;
};

}  // namespace kvdecode
