// Activations<T>: every buffer one forward step of up to max_tokens tokens writes, allocated at
// construction so that decode allocates nothing. One per thread of decoding; the Model is shared.
#pragma once

#include <algorithm>
#include <cstddef>
#include <type_traits>
#include <vector>

#include "kvdecode/aligned_buffer.hpp"
#include "kvdecode/attention.hpp"
#include "kvdecode/detail/gemm.hpp"
#include "kvdecode/model_config.hpp"
#include "kvdecode/thread_pool.hpp"
#include "kvdecode/work_counters.hpp"

namespace kvdecode {

namespace detail {
/// Rows [row, row + rows) of a chunk that belong to sequence `seq` of a batch, at pending
/// offsets [pending_first, pending_first + rows) of its store's open append.
struct BatchSegment {
  std::size_t seq = 0;
  std::size_t row = 0;
  std::size_t pending_first = 0;
  std::size_t rows = 0;
};
}  // namespace detail

template <class T>
struct Activations {
  Activations() = default;
  /// Scratch for chunks of up to max_tokens tokens (prefill splits longer prompts into chunks);
  /// store_scratch is the store's block_scratch_size() (0 for ContiguousStore). thread_pool,
  /// when given, runs the projections and attention of every step on all its threads; the
  /// caller keeps it alive as long as these Activations are used (nullptr = one thread).
  /// max_batch_size > 1 sizes them for Model::decode_batch / prefill_batch of up to that many
  /// sequences: logits rows for each, and max_tokens raised to at least max_batch_size so a
  /// batched decode step is one chunk.
  explicit Activations(const ModelConfig& cfg, std::size_t max_chunk = 1,
                       std::size_t store_scratch = 0, ThreadPool* thread_pool = nullptr,
                       std::size_t max_batch_size = 1)
      : max_tokens(std::max({max_chunk, max_batch_size, std::size_t{1}})),
        max_batch(std::max(max_batch_size, std::size_t{1})),
        pool(thread_pool),
        n_threads(thread_pool == nullptr ? 1 : thread_pool->size()) {
    cfg.validate();
    const std::size_t n = this->max_tokens;
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
    segments.resize(n);
    attention = AttentionScratch<T>(cfg, n, store_scratch, n_threads);
    if (n > 1) {  // several tokens with bf16 weights widen panels of weight rows and round x
      const auto max_in = static_cast<std::size_t>(std::max(cfg.dim, cfg.hidden_dim));
      panel_stride = detail::kPanelRows * max_in;
      panels = AlignedBuffer<T>(n_threads * panel_stride);
      if constexpr (std::is_same_v<T, float>) x_rounded = AlignedBuffer<T>(n * max_in);
    }
  }

  std::size_t max_tokens = 1;
  std::size_t max_batch = 1;      // sequences a decode_batch / prefill_batch may run at once
  AlignedBuffer<T> x;             // [max_tokens][dim]         residual stream
  AlignedBuffer<T> xb;            // [max_tokens][dim]         normed input / projection output
  AlignedBuffer<T> q;             // [max_tokens][dim]         rotated queries
  AlignedBuffer<T> k;             // [max_tokens][kv_dim]      rotated keys of the new tokens
  AlignedBuffer<T> v;             // [max_tokens][kv_dim]      values of the new tokens
  AlignedBuffer<T> att;           // [max_tokens][dim]         attention output, heads side by side
  AlignedBuffer<T> hb;            // [max_tokens][hidden_dim]  FFN gate, then silu(gate) ⊙ up
  AlignedBuffer<T> hb2;           // [max_tokens][hidden_dim]  FFN up
  AlignedBuffer<T> rope_cos;      // [max_tokens][head_size/2] RoPE angles of each new token
  AlignedBuffer<T> rope_sin;      // [max_tokens][head_size/2]
  AlignedBuffer<T> logits;        // [vocab_size]              logits of the last token
  AlignedBuffer<T> batch_logits;  // [max_batch][vocab_size] last-token logits of each sequence
  std::vector<detail::BatchSegment> segments;  // [max_tokens] of the chunk being run (batches)
  AttentionScratch<T> attention;
  std::size_t panel_stride = 0;  // kPanelRows × max(dim, hidden_dim) when max_tokens > 1, else 0
  AlignedBuffer<T> panels;       // [n_threads][kPanelRows][max(dim, hidden_dim)] widened weights
  AlignedBuffer<T> x_rounded;    // [max_tokens][max(dim, hidden_dim)] input rounded to bf16
  /// The threads every step runs on (not owned); nullptr runs everything on the caller.
  ThreadPool* pool = nullptr;
  /// Threads the per-thread scratch was sized for: a pool set later may have at most this many.
  std::size_t n_threads = 1;
  /// When set, the forward pass adds the work it does here (see work_counters.hpp).
  WorkCounters* counters = nullptr;
};

}  // namespace kvdecode
