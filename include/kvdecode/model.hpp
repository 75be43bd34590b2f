// Model<T>: a Llama-architecture decoder over a KvStore. prefill() runs many tokens with
// matrix-matrix products and writes their K/V; decode() runs one token against the cache.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "kvdecode/activations.hpp"
#include "kvdecode/attention.hpp"
#include "kvdecode/detail/ops.hpp"
#include "kvdecode/error.hpp"
#include "kvdecode/kv_store.hpp"
#include "kvdecode/model_config.hpp"
#include "kvdecode/reference.hpp"
#include "kvdecode/rope.hpp"
#include "kvdecode/weights.hpp"

namespace kvdecode {

/// The data path, top to bottom: token ids → embedding rows → n_layers × (RMSNorm → q/k/v →
/// RoPE → append K/V to the store → attention over the store → wo → residual → RMSNorm → SwiGLU
/// → residual) → final RMSNorm → classifier → logits.
///
/// A Model is immutable after construction: several threads may run it at once, each with its
/// own store and Activations.
template <class T>
class Model {
 public:
  explicit Model(Weights<T> weights) : w_(std::move(weights)) { w_.config.validate(); }

  const ModelConfig& config() const { return w_.config; }
  const Weights<T>& weights() const { return w_; }

  /// Runs one token at the next cache index: computes its q/k/v, appends its K/V to the
  /// store, attends over the whole cache and returns the logits [vocab_size] (a view into act).
  /// Throws Error (leaving cache and act as they were) for a bad token or a full cache.
  template <KvStore S>
  std::span<const T> decode(std::int32_t token, S& cache, Activations<T>& act) const {
    return run(std::span<const std::int32_t>(&token, 1), cache, act, {}, true);
  }

  /// Runs tokens after what the cache already holds (a prompt, a chunk of one, or a new turn),
  /// appending their K/V, and returns the logits of the last token. When all_logits is given it
  /// must hold tokens.size() × vocab_size values and receives every position's logits.
  /// Longer inputs than act.max_tokens run in chunks of act.max_tokens.
  template <KvStore S>
  std::span<const T> prefill(std::span<const std::int32_t> tokens, S& cache, Activations<T>& act,
                             std::span<T> all_logits = {}) const {
    return run(tokens, cache, act, all_logits, false);
  }

  /// The no-cache oracle: logits [tokens.size()][vocab_size] of every position, computed by the
  /// independent plain loops of reference.hpp.
  std::vector<T> forward_reference(std::span<const std::int32_t> tokens) const {
    return kvdecode::forward_reference(w_, tokens);
  }

 private:
  template <KvStore S>
  std::span<const T> run(std::span<const std::int32_t> tokens, S& cache, Activations<T>& act,
                         std::span<T> all_logits, bool is_decode) const {
    const ModelConfig& cfg = w_.config;
    const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
    KVDECODE_CHECK(!tokens.empty(), "Model::prefill: no tokens given");
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      KVDECODE_CHECK(tokens[i] >= 0 && tokens[i] < cfg.vocab_size, "Model: token id ",
                     tokens[i], " at input position ", i, " is outside the vocabulary [0, ",
                     cfg.vocab_size, ")");
    }
    KVDECODE_CHECK(all_logits.empty() || all_logits.size() == tokens.size() * vocab,
                   "Model::prefill: all_logits holds ", all_logits.size(), " values, expected ",
                   tokens.size(), " × ", vocab, " = ", tokens.size() * vocab);
    KVDECODE_CHECK(cache.n_layers() == static_cast<std::size_t>(cfg.n_layers) &&
                       cache.n_kv_heads() == static_cast<std::size_t>(cfg.n_kv_heads) &&
                       cache.head_size() == static_cast<std::size_t>(cfg.head_size()),
                   "Model: the store's shape (", cache.n_layers(), " layers, ",
                   cache.n_kv_heads(), " kv heads, head size ", cache.head_size(),
                   ") does not match the model (", cfg.n_layers, ", ", cfg.n_kv_heads, ", ",
                   cfg.head_size(), ")");
    KVDECODE_CHECK(act.logits.size() == vocab && act.x.size() == act.max_tokens *
                                                                     static_cast<std::size_t>(cfg.dim),
                   "Model: the Activations were built for another config");

    cache.begin_append(tokens);  // throws, changing nothing, when the cache is full
    try {
      for (std::size_t done = 0; done < tokens.size();) {
        const std::size_t n = std::min(act.max_tokens, tokens.size() - done);
        const bool last_chunk = done + n == tokens.size();
        std::span<T> chunk_logits;
        if (!all_logits.empty()) chunk_logits = all_logits.subspan(done * vocab, n * vocab);
        forward_chunk(tokens.subspan(done, n), done, cache, act, chunk_logits, last_chunk);
        done += n;
      }
    } catch (...) {
      cache.cancel_append();
      throw;
    }
    cache.commit_append();
    if (act.counters != nullptr) {
      count(is_decode ? act.counters->decode : act.counters->prefill, cache.size() - tokens.size(),
            tokens.size(), all_logits.empty() ? 1 : tokens.size());
    }
    return act.logits.span();
  }

  /// One chunk of n tokens at pending offset `pending_first` of the open append.
  template <KvStore S>
  void forward_chunk(std::span<const std::int32_t> tokens, std::size_t pending_first, S& cache,
                     Activations<T>& act, std::span<T> chunk_logits, bool last_chunk) const {
    const ModelConfig& cfg = w_.config;
    const std::size_t n = tokens.size();
    const auto dim = static_cast<std::size_t>(cfg.dim);
    const auto kv_dim = static_cast<std::size_t>(cfg.kv_dim());
    const auto hidden = static_cast<std::size_t>(cfg.hidden_dim);
    const auto hs = static_cast<std::size_t>(cfg.head_size());
    const auto half = hs / 2;
    const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
    const std::size_t first = cache.size() + pending_first;  // cache index of tokens[0]

    for (std::size_t i = 0; i < n; ++i) {
      const T* row = w_.token_embedding.data() + static_cast<std::size_t>(tokens[i]) * dim;
      std::copy_n(row, dim, act.x.data() + i * dim);
      rope_angles(cache.rope_position(first + i), hs, cfg.rope_theta, act.rope_cos.data() + i * half,
                  act.rope_sin.data() + i * half);
    }

    for (std::size_t l = 0; l < w_.layers.size(); ++l) {
      const LayerWeights<T>& lw = w_.layers[l];
      // Attention block.
      detail::rmsnorm(act.xb.data(), act.x.data(), lw.rms_att.data(), n, dim, cfg.norm_eps);
      detail::matmul(act.q.data(), act.xb.data(), lw.wq.data(), n, dim, dim);
      detail::matmul(act.k.data(), act.xb.data(), lw.wk.data(), n, dim, kv_dim);
      detail::matmul(act.v.data(), act.xb.data(), lw.wv.data(), n, dim, kv_dim);
      for (std::size_t i = 0; i < n; ++i) {
        const T* c = act.rope_cos.data() + i * half;
        const T* s = act.rope_sin.data() + i * half;
        apply_rope(act.q.data() + i * dim, static_cast<std::size_t>(cfg.n_heads), hs,
                   cfg.rope_style, c, s);
        apply_rope(act.k.data() + i * kv_dim, static_cast<std::size_t>(cfg.n_kv_heads), hs,
                   cfg.rope_style, c, s);
        cache.write(l, pending_first + i, act.k.data() + i * kv_dim, act.v.data() + i * kv_dim);
      }
      attend(cfg, cache, l, first, n, act.q.data(), act.att.data(), act.attention);
      detail::matmul(act.xb.data(), act.att.data(), lw.wo.data(), n, dim, dim);
      add_into(act.x.data(), act.xb.data(), n * dim);
      // Feed-forward block.
      detail::rmsnorm(act.xb.data(), act.x.data(), lw.rms_ffn.data(), n, dim, cfg.norm_eps);
      detail::matmul(act.hb.data(), act.xb.data(), lw.w1.data(), n, dim, hidden);
      detail::matmul(act.hb2.data(), act.xb.data(), lw.w3.data(), n, dim, hidden);
      detail::swiglu(act.hb.data(), act.hb2.data(), n * hidden);
      detail::matmul(act.xb.data(), act.hb.data(), lw.w2.data(), n, hidden, dim);
      add_into(act.x.data(), act.xb.data(), n * dim);
    }

    // Classifier: every row when all logits are wanted, else only the last token of the input.
    if (!chunk_logits.empty()) {
      detail::rmsnorm(act.xb.data(), act.x.data(), w_.rms_final.data(), n, dim, cfg.norm_eps);
      detail::matmul(chunk_logits.data(), act.xb.data(), w_.classifier(), n, dim, vocab);
      if (last_chunk) std::copy_n(chunk_logits.data() + (n - 1) * vocab, vocab, act.logits.data());
    } else if (last_chunk) {
      const T* x_last = act.x.data() + (n - 1) * dim;
      detail::rmsnorm(act.xb.data(), x_last, w_.rms_final.data(), 1, dim, cfg.norm_eps);
      detail::matmul(act.logits.data(), act.xb.data(), w_.classifier(), 1, dim, vocab);
    }
  }

  static void add_into(T* x, const T* y, std::size_t count) {
    for (std::size_t i = 0; i < count; ++i) x[i] += y[i];
  }

  /// Adds the work of one call that ran n tokens after `before` cached positions and computed
  /// logit_rows rows of logits.
  void count(PhaseCounters& c, std::size_t before, std::size_t n, std::size_t logit_rows) const {
    const ModelConfig& cfg = w_.config;
    const auto L = static_cast<std::uint64_t>(cfg.n_layers);
    const auto dim = static_cast<std::uint64_t>(cfg.dim);
    const auto kv_dim = static_cast<std::uint64_t>(cfg.kv_dim());
    const auto hidden = static_cast<std::uint64_t>(cfg.hidden_dim);
    const auto vocab = static_cast<std::uint64_t>(cfg.vocab_size);
    const auto hs = static_cast<std::uint64_t>(cfg.head_size());
    const auto n_heads = static_cast<std::uint64_t>(cfg.n_heads);
    const auto n_kv = static_cast<std::uint64_t>(cfg.n_kv_heads);
    const std::uint64_t b = before;
    const std::uint64_t m = n;
    // Query i (0-based within the call) sees b + i + 1 keys: Σ = m·b + m(m+1)/2.
    const std::uint64_t visible = m * b + m * (m + 1) / 2;
    c.tokens += m;
    c.kv_projections += m * L;
    c.attention_scores += visible * n_heads * L;
    c.kv_bytes_written += 2 * m * kv_dim * L * sizeof(T);
    // Each kv head's keys and values up to the last query are read once per call.
    c.kv_bytes_read += 2 * (b + m) * n_kv * hs * L * sizeof(T);
    const std::uint64_t layer_weights = dim * dim * 2 + kv_dim * dim * 2 + hidden * dim * 3;
    c.weight_bytes_read += (L * (layer_weights + 2 * dim) + dim + vocab * dim) * sizeof(T);
    c.flops += 2 * m * L * layer_weights + 2 * std::uint64_t{logit_rows} * vocab * dim +
               4 * visible * n_heads * hs * L;
  }

  Weights<T> w_;
};

}  // namespace kvdecode
