// Model<T>: a Llama-architecture decoder over a KvStore. prefill() runs many tokens with
// matrix-matrix products and writes their K/V; decode() runs one token against the cache;
// decode_batch() / prefill_batch() run several sequences, each weight read once for all.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvdecode/bf16.hpp"
#include "kvdecode/detail/linear.hpp"
#include "kvdecode/detail/ops.hpp"
#include "kvdecode/detail/row_groups.hpp"
#include "kvdecode/detail/swiglu.hpp"
#include "kvdecode/error.hpp"
#include "kvdecode/model/activations.hpp"
#include "kvdecode/model/amx_panels.hpp"
#include "kvdecode/model/attention.hpp"
#include "kvdecode/model/model_config.hpp"
#include "kvdecode/model/reference.hpp"
#include "kvdecode/model/rope.hpp"
#include "kvdecode/model/weights.hpp"
#include "kvdecode/store/kv_store.hpp"
#include "kvdecode/weight_blocks.hpp"

namespace kvdecode {

/// The store type of a contiguous range of store pointers (std::vector<S*>, std::array<S*, N>,
/// std::span<S* const>, a C array): what decode_batch / prefill_batch take.
template <class Stores>
using StoreOf =
    std::remove_pointer_t<std::remove_cvref_t<decltype(*std::data(std::declval<const Stores&>()))>>;

/// The data path, top to bottom: token ids → embedding rows → n_layers × (RMSNorm → q/k/v →
/// RoPE → append K/V to the store → attention over the store → wo → residual → RMSNorm → SwiGLU
/// → residual) → final RMSNorm → classifier → logits.
///
/// T is the compute type (activations, KV cache, logits); W the weight-storage type: T itself,
/// bf16 with T = float (half the bytes per decode step; products summed in f32), or a block
/// format with T = float: Q8_0 or Q4_0 (weight_blocks.hpp; 34 or 18 bytes per 32 weights), the
/// input of each projection quantized to int8 blocks and multiplied in integers (qgemv.hpp).
///
/// A Model is immutable after construction: several threads may run it at once, each with its
/// own store and Activations. Threads for one step come from the pool in the Activations.
template <class T, class W = T>
class Model {
  static_assert(std::is_same_v<T, W> ||
                    (std::is_same_v<T, float> && (std::is_same_v<W, bf16> || kIsBlockFormat<W>)),
                "Model<T, W>: weights are stored as T, or as bf16, Q8_0 or Q4_0 with T = float");

 public:
  explicit Model(Weights<W> weights) : w_(std::move(weights)) {
    w_.config.validate();
    if constexpr (!std::is_same_v<T, GainOf<W>>) {
      // The RMSNorm gains, widened once: they are a few KiB and read every step.
      const auto dim = static_cast<std::size_t>(w_.config.dim);
      gains_ = AlignedBuffer<T>((2 * w_.layers.size() + 1) * dim);
      for (std::size_t l = 0; l < w_.layers.size(); ++l) {
        widen_into(gains_.data() + 2 * l * dim, w_.layers[l].rms_att.data(), dim);
        widen_into(gains_.data() + (2 * l + 1) * dim, w_.layers[l].rms_ffn.data(), dim);
      }
      widen_into(gains_.data() + 2 * w_.layers.size() * dim, w_.rms_final.data(), dim);
    }
    if constexpr (kIsBlockFormat<W>) repack_matrices();
    if constexpr (std::is_same_v<T, float> && std::is_same_v<W, bf16>) {
      if (AmxPanels::wanted()) amx_ = AmxPanels(w_);
    }
  }

  const ModelConfig& config() const { return w_.config; }
  /// The weights the model runs on. With a block format the projection matrices and the
  /// classifier (the embedding table too when it is shared) are held in the row-group layout of
  /// detail/row_groups.hpp, repacked in place at construction (detail::repacked_block reads a
  /// block back as stored).
  const Weights<W>& weights() const { return w_; }
  /// Bytes of the layer matrices re-laid for the AMX tiles at construction (AmxPanels), held
  /// beside weights() by bf16 models where prefill runs on AMX; 0 otherwise.
  std::size_t amx_panel_bytes() const { return amx_.bytes(); }

  /// Runs one token at the next cache index: computes its q/k/v, appends its K/V to the
  /// store, attends over the whole cache and returns the logits [vocab_size] (a view into act).
  /// Throws Error (leaving cache and act as they were) for a bad token or a full cache.
  template <KvStore S>
  std::span<const T> decode(std::int32_t token, S& cache, Activations<T>& act) const {
    S* const one[1] = {&cache};
    return run<S>({&token, 1}, {}, one, act, {}, Phase::kDecode);
  }

  /// Runs tokens after what the cache already holds (a prompt, a chunk of one, or a new turn),
  /// appending their K/V, and returns the logits of the last token. When all_logits is given it
  /// must hold tokens.size() × vocab_size values and receives every position's logits.
  /// Longer inputs than act.max_chunk run in chunks of act.max_chunk.
  template <KvStore S>
  std::span<const T> prefill(std::span<const std::int32_t> tokens, S& cache, Activations<T>& act,
                             std::span<T> all_logits = {}) const {
    S* const one[1] = {&cache};
    return run<S>(tokens, {}, one, act, all_logits, Phase::kPrefill);
  }

  /// One decode step of B = stores.size() sequences: token b runs at the next cache index of
  /// *stores[b]. Each weight matrix is read once for the whole batch (the B tokens' activations
  /// are a [B][dim] matrix); attention runs per sequence over its own store, RoPE at its own
  /// position. Returns the logits [B][vocab_size] (a view into act.batch_logits). Needs
  /// B ≤ act.max_batch; allocates nothing. Transactional: if any check or any store's
  /// begin_append throws (a full store, an exhausted pool, a bad token), the appends already
  /// begun are cancelled and every store is left as it was. `stores` is any contiguous range
  /// of store pointers (a std::vector, a std::array, a span).
  /// For B = 1 the arithmetic is decode()'s, so the logits are the same bit for bit; for
  /// 2 ≤ B ≤ 16 with f32 or bf16 weights on an x86 kernel set the projections sum in lanes
  /// (detail/gemm_lanes.hpp): a sequence's logits are the same whatever batch it is in, and
  /// within f32 rounding of decode()'s.
  template <class Stores, KvStore S = StoreOf<Stores>>
  std::span<const T> decode_batch(std::span<const std::int32_t> tokens, const Stores& stores,
                                  Activations<T>& act) const {
    const std::span<S* const> ptrs(std::data(stores), std::size(stores));
    KVDECODE_CHECK(tokens.size() == ptrs.size(), "Model::decode_batch: ", tokens.size(),
                   " tokens for ", ptrs.size(), " sequences, expected one per sequence");
    return run<S>(tokens, {}, ptrs, act, {}, Phase::kDecode, true);
  }

  /// Prefill of B = stores.size() prompts (or continuations) at once: sequence b's tokens are
  /// the next lengths[b] of `tokens` (prompts concatenated in order), run after what *stores[b]
  /// holds. Inputs longer than act.max_chunk run in chunks of act.max_chunk tokens across
  /// sequence boundaries; each chunk reads every weight matrix once. Returns the logits of each
  /// prompt's last token, [B][vocab_size] in act.batch_logits. Transactional as decode_batch.
  template <class Stores, KvStore S = StoreOf<Stores>>
  std::span<const T> prefill_batch(std::span<const std::int32_t> tokens,
                                   std::span<const std::size_t> lengths, const Stores& stores,
                                   Activations<T>& act) const {
    const std::span<S* const> ptrs(std::data(stores), std::size(stores));
    KVDECODE_CHECK(lengths.size() == ptrs.size(), "Model::prefill_batch: ", lengths.size(),
                   " lengths for ", ptrs.size(), " sequences");
    return run<S>(tokens, lengths, ptrs, act, {}, Phase::kPrefill, true);
  }

  /// The no-cache oracle: logits [tokens.size()][vocab_size] of every position, computed by the
  /// independent plain loops of reference.hpp.
  std::vector<T> forward_reference(
      std::span<const std::int32_t> tokens) const requires std::is_same_v<T, W> {
    return kvdecode::forward_reference(w_, tokens);
  }

 private:
  using SequenceRows = detail::SequenceRows;  // rows of a chunk that belong to one sequence

  /// The checks every entry makes on a store before touching it.
  template <KvStore S>
  void check_store(const S& cache) const {
    const ModelConfig& cfg = w_.config;
    KVDECODE_CHECK(cache.n_layers() == static_cast<std::size_t>(cfg.n_layers) &&
                       cache.n_kv_heads() == static_cast<std::size_t>(cfg.n_kv_heads) &&
                       cache.head_size() == static_cast<std::size_t>(cfg.head_size()),
                   "Model: the store's shape (", cache.n_layers(), " layers, ", cache.n_kv_heads(),
                   " kv heads, head size ", cache.head_size(), ") does not match the model (",
                   cfg.n_layers, ", ", cfg.n_kv_heads, ", ", cfg.head_size(), ")");
  }
  void check_tokens_and_act(std::span<const std::int32_t> tokens, const Activations<T>& act) const {
    const ModelConfig& cfg = w_.config;
    KVDECODE_CHECK(!tokens.empty(), "Model::prefill: no tokens given");
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      KVDECODE_CHECK(tokens[i] >= 0 && tokens[i] < cfg.vocab_size, "Model: token id ", tokens[i],
                     " at input position ", i, " is outside the vocabulary [0, ", cfg.vocab_size,
                     ")");
    }
    KVDECODE_CHECK(act.logits.size() == static_cast<std::size_t>(cfg.vocab_size) &&
                       act.x.size() == act.max_chunk * static_cast<std::size_t>(cfg.dim),
                   "Model: the Activations were built for another config");
    KVDECODE_CHECK(act.pool == nullptr || act.pool->size() <= act.n_threads,
                   "Model: the Activations' pool has ", act.pool == nullptr ? 0 : act.pool->size(),
                   " threads but its scratch was sized for ", act.n_threads,
                   "; pass the pool to the Activations constructor");
    if constexpr (!std::is_same_v<T, W>) {
      KVDECODE_CHECK(act.max_chunk == 1 || !act.x_rounded.empty(),
                     "Model: the Activations were built with bf16_weights = false, but this "
                     "model's weights are bf16 (its projections of several tokens round their "
                     "input into Activations::x_rounded)");
    }
  }

  enum class Phase { kPrefill, kDecode };
  using Order = detail::FewTokenOrder;

  /// Every entry point: B = stores.size() sequences, sequence b running the next length(b)
  /// tokens (lengths[b]; one each for a batched decode; all of them for B = 1 unbatched) after
  /// what *stores[b] holds. Returns the last-token logits of each sequence: [vocab_size] in
  /// act.logits for the unbatched calls, [B][vocab_size] in act.batch_logits for the batched
  /// ones; all_logits (unbatched prefill only) receives every position's.
  ///
  /// A transaction over the stores: every append begins before any K/V is written; the first
  /// that cannot (a full store, an exhausted pool) throws, and the ones already begun are
  /// cancelled, as on any error later; only a completed pass commits them all.
  template <KvStore S>
  std::span<const T> run(std::span<const std::int32_t> tokens, std::span<const std::size_t> lengths,
                         std::span<S* const> stores, Activations<T>& act, std::span<T> all_logits,
                         Phase phase, bool batched = false) const {
    const ModelConfig& cfg = w_.config;
    const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
    const auto dim = static_cast<std::size_t>(cfg.dim);
    const std::size_t B = stores.size();
    const char* const name =
        batched ? (phase == Phase::kDecode ? "Model::decode_batch" : "Model::prefill_batch")
                : (phase == Phase::kDecode ? "Model::decode" : "Model::prefill");
    KVDECODE_CHECK(B > 0, name, ": no sequences given");
    KVDECODE_CHECK(B <= act.max_batch, name, ": ", B,
                   " sequences, but the Activations were built for batches of at most ",
                   act.max_batch, " (the max_batch constructor argument)");
    check_tokens_and_act(tokens, act);
    KVDECODE_CHECK(all_logits.empty() || all_logits.size() == tokens.size() * vocab, name,
                   ": all_logits holds ", all_logits.size(), " values, expected ", tokens.size(),
                   " × ", vocab, " = ", tokens.size() * vocab);
    const auto length = [&](std::size_t b) {
      return !lengths.empty() ? lengths[b] : batched ? std::size_t{1} : tokens.size();
    };
    std::size_t total = 0;
    for (std::size_t b = 0; b < B; ++b) {
      KVDECODE_CHECK(length(b) > 0, name, ": sequence ", b, " has no tokens");
      total += length(b);
    }
    KVDECODE_CHECK(total == tokens.size(), name, ": the lengths add up to ", total, " tokens but ",
                   tokens.size(), " were given");
    for (std::size_t b = 0; b < B; ++b) {
      KVDECODE_CHECK(stores[b] != nullptr, name, ": the store of sequence ", b, " is null");
      check_store(*stores[b]);
      for (std::size_t c = 0; c < b; ++c)
        KVDECODE_CHECK(stores[c] != stores[b], name, ": sequences ", c, " and ", b,
                       " are the same store");
    }
    T* const out = batched ? act.batch_logits.data() : act.logits.data();  // [B][vocab]
    // Batched steps sum each output of a few-token product in lanes, the same for a sequence
    // whatever batch of 2..kMaxFewTokens rows it rides in; one sequence's calls as decode() does.
    const Order order = batched ? Order::kLanes : Order::kGemv;

    std::size_t begun = 0;
    const auto cancel_begun = [&]() noexcept {
      for (std::size_t b = 0; b < begun; ++b) stores[b]->cancel_append();
    };
    try {
      for (std::size_t at = 0; begun < B; at += length(begun), ++begun)
        stores[begun]->begin_append(tokens.subspan(at, length(begun)));
    } catch (...) {
      cancel_begun();
      throw;
    }

    StepWork work;  // what WorkCounters add once the pass has committed
    try {
      // Chunks of up to max_chunk rows of the concatenation; a sequence may span several.
      std::size_t b = 0;       // first sequence with rows in the chunk
      std::size_t b_done = 0;  // rows of sequence b in earlier chunks
      for (std::size_t done = 0; done < total; ++work.chunks) {
        const std::size_t n = std::min(act.max_chunk, total - done);
        std::size_t n_parts = 0;
        std::size_t ending_first = B;  // sequences ending in this chunk: [ending_first, b)
        for (std::size_t row = 0; row < n;) {
          const std::size_t rows = std::min(length(b) - b_done, n - row);
          act.sequence_rows[n_parts++] = SequenceRows{b, row, b_done, rows};
          // Attention reads the store up to this part's last row, before its writes commit.
          work.kv_bytes_read += stores[b]->read_bytes(stores[b]->size() + b_done + rows);
          row += rows;
          b_done += rows;
          if (b_done == length(b)) {
            ending_first = std::min(ending_first, b);
            ++b;
            b_done = 0;
          }
        }
        forward_layers(tokens.subspan(done, n), stores,
                       std::span<const SequenceRows>(act.sequence_rows.data(), n_parts), act,
                       order);
        if (!all_logits.empty()) {  // every row's logits
          T* chunk_logits = all_logits.data() + done * vocab;
          detail::rmsnorm(act.xb.data(), act.x.data(), gain_final(), n, dim, cfg.norm_eps);
          linear_group({{chunk_logits, w_.classifier(), vocab}}, act.xb.data(), n, dim, act, order);
          if (done + n == total) std::copy_n(chunk_logits + (n - 1) * vocab, vocab, out);
          ++work.logit_chunks;
        } else if (ending_first < b) {
          // The last row of each sequence that ends here: consecutive sequences, so their
          // logits rows are consecutive too.
          std::size_t k = 0;
          for (std::size_t i = 0; i < n_parts; ++i) {
            const SequenceRows& part = act.sequence_rows[i];
            if (part.pending_first + part.rows != length(part.seq)) continue;
            detail::rmsnorm(act.xb.data() + k * dim,
                            act.x.data() + (part.row + part.rows - 1) * dim, gain_final(), 1, dim,
                            cfg.norm_eps);
            ++k;
          }
          linear_group({{out + ending_first * vocab, w_.classifier(), vocab}}, act.xb.data(), k,
                       dim, act, order);
          ++work.logit_chunks;
        }
        done += n;
      }
    } catch (...) {
      cancel_begun();
      throw;
    }
    for (std::size_t i = 0; i < B; ++i) stores[i]->commit_append();

    if (act.counters != nullptr) {
      work.tokens = total;
      work.logit_rows = all_logits.empty() ? B : total;
      for (std::size_t i = 0; i < B; ++i) {
        const std::uint64_t m = length(i);
        work.visible += m * (stores[i]->size() - m) + m * (m + 1) / 2;
      }
      (phase == Phase::kDecode ? act.counters->decode : act.counters->prefill)
          .add(cfg, sizeof(T), sizeof(W), work, Weights<W>::kPerElement);
    }
    return batched ? act.batch_logits.span().first(B * vocab) : act.logits.span();
  }

  /// Embedding, RoPE angles and every layer for one chunk of n = tokens.size() rows made of
  /// parts (runs of rows of one sequence each, in row order); leaves the residual stream of
  /// every row in act.x [n][dim]. K/V rows go to each part's store at its pending offset.
  template <KvStore S>
  void forward_layers(std::span<const std::int32_t> tokens, std::span<S* const> stores,
                      std::span<const SequenceRows> parts, Activations<T>& act, Order order) const {
    embed(tokens, stores, parts, act);
    for (std::size_t l = 0; l < w_.layers.size(); ++l) {
      attention_block(l, tokens.size(), stores, parts, act, order);
      ffn_block(l, tokens.size(), act, order);
    }
  }

  /// act.x [n][dim] = the embedding rows of the tokens; act.rope_cos / rope_sin [n][head_size/2]
  /// = the angles of each row's RoPE position in its own sequence.
  template <KvStore S>
  void embed(std::span<const std::int32_t> tokens, std::span<S* const> stores,
             std::span<const SequenceRows> parts, Activations<T>& act) const {
    const ModelConfig& cfg = w_.config;
    const auto dim = static_cast<std::size_t>(cfg.dim);
    const auto hs = static_cast<std::size_t>(cfg.head_size());
    const auto half = hs / 2;
    for (const SequenceRows& part : parts) {
      const S& cache = *stores[part.seq];
      for (std::size_t i = part.row; i < part.row + part.rows; ++i) {
        // One row per token; a block format's row dequantized here (llama.cpp's get_rows).
        const auto token = static_cast<std::size_t>(tokens[i]);
        if constexpr (kIsBlockFormat<W>) {
          if (cfg.shared_classifier) {  // the table is the classifier, repacked
            detail::dequantize_repacked_row(w_.token_embedding.data(),
                                            static_cast<std::size_t>(cfg.vocab_size),
                                            dim / kWeightBlock, token, act.x.data() + i * dim);
          } else {
            widen_into(act.x.data() + i * dim, w_.token_embedding.data() + token * dim / 32, dim);
          }
        } else {
          widen_into(act.x.data() + i * dim, w_.token_embedding.data() + token * dim, dim);
        }
        const std::size_t index = cache.size() + part.pending_first + (i - part.row);
        rope_angles(cache.rope_position(index), hs, cfg.rope_theta, act.rope_cos.data() + i * half,
                    act.rope_sin.data() + i * half);
      }
    }
  }

  /// x += wo · attention(RoPE(wq · norm(x)), store ∪ RoPE(wk · norm(x)), wv · norm(x)) for the
  /// n rows of layer l: the new K/V rows are written to their stores first, so a chunk attends
  /// to itself.
  template <KvStore S>
  void attention_block(std::size_t l, std::size_t n, std::span<S* const> stores,
                       std::span<const SequenceRows> parts, Activations<T>& act,
                       Order order) const {
    const ModelConfig& cfg = w_.config;
    const LayerWeights<W>& lw = w_.layers[l];
    const auto dim = static_cast<std::size_t>(cfg.dim);
    const auto kv_dim = static_cast<std::size_t>(cfg.kv_dim());
    const auto hs = static_cast<std::size_t>(cfg.head_size());
    const auto half = hs / 2;
    const auto n_kv_heads = static_cast<std::size_t>(cfg.n_kv_heads);

    detail::rmsnorm(act.xb.data(), act.x.data(), gain_att(l), n, dim, cfg.norm_eps);
    // q, k and v read the same input: one parallel region for the three.
    linear_group({{act.q.data(), lw.wq.data(), dim, amx_.get(l, &AmxLayerPanels::wq)},
                  {act.k.data(), lw.wk.data(), kv_dim, amx_.get(l, &AmxLayerPanels::wk)},
                  {act.v.data(), lw.wv.data(), kv_dim, amx_.get(l, &AmxLayerPanels::wv)}},
                 act.xb.data(), n, dim, act, order);
    for (const SequenceRows& part : parts) {
      S& cache = *stores[part.seq];
      for (std::size_t i = part.row; i < part.row + part.rows; ++i) {
        const T* c = act.rope_cos.data() + i * half;
        const T* s = act.rope_sin.data() + i * half;
        apply_rope(act.q.data() + i * dim, static_cast<std::size_t>(cfg.n_heads), hs,
                   cfg.rope_style, c, s);
        apply_rope(act.k.data() + i * kv_dim, n_kv_heads, hs, cfg.rope_style, c, s);
        cache.write(l, part.pending_first + (i - part.row), act.k.data() + i * kv_dim,
                    act.v.data() + i * kv_dim);
      }
    }

    if (parts.size() == 1) {  // one sequence: attend()'s static split over kv heads
      const SequenceRows& part = parts[0];
      const S& cache = *stores[part.seq];
      attend(cfg, cache, l, cache.size() + part.pending_first, part.rows,
             act.q.data() + part.row * dim, act.att.data() + part.row * dim, act.attention,
             act.pool);
    } else {
      // A batch: (part, kv head) items shared out by run_items, as the sequences' contexts
      // differ; kv head by kv head, so that a pool's sequences appended in turn are read in the
      // order their blocks lie in (BlockPool keeps a head's blocks together).
      std::size_t work = 0;
      for (const SequenceRows& part : parts)
        work += part.rows * (stores[part.seq]->size() + part.pending_first + part.rows);
      work *= hs * static_cast<std::size_t>(cfg.n_heads);
      const std::size_t items = parts.size() * n_kv_heads;
      ThreadPool* const pool = work >= kMinParallelAttention ? act.pool : nullptr;
      const auto item = [&](std::size_t i, std::size_t t) {
        const SequenceRows& part = parts[i % parts.size()];
        const S& cache = *stores[part.seq];
        attend_kv_head(cfg, cache, l, i / parts.size(), cache.size() + part.pending_first,
                       part.rows, act.q.data() + part.row * dim, act.att.data() + part.row * dim,
                       act.attention, t);
      };
      run_items(pool, items, item);
    }

    linear_group({{act.xb.data(), lw.wo.data(), dim, amx_.get(l, &AmxLayerPanels::wo)}},
                 act.att.data(), n, dim, act, order);
    add_into(act.x.data(), act.xb.data(), n * dim);
  }

  /// Below this many SwiGLU elements (a decode step's hidden_dim, a small batch's) the caller
  /// runs them alone: waking the pool (~1-2 µs) would cost more than it shares out.
  static constexpr std::size_t kMinParallelSwiglu = std::size_t{1} << 16;

  /// x += w2 · (silu(w1 · norm(x)) ⊙ w3 · norm(x)) for the n rows of layer l (SwiGLU).
  void ffn_block(std::size_t l, std::size_t n, Activations<T>& act, Order order) const {
    const ModelConfig& cfg = w_.config;
    const LayerWeights<W>& lw = w_.layers[l];
    const auto dim = static_cast<std::size_t>(cfg.dim);
    const auto hidden = static_cast<std::size_t>(cfg.hidden_dim);
    detail::rmsnorm(act.xb.data(), act.x.data(), gain_ffn(l), n, dim, cfg.norm_eps);
    // gate and up read the same input: one parallel region for both.
    linear_group({{act.hb.data(), lw.w1.data(), hidden, amx_.get(l, &AmxLayerPanels::w1)},
                  {act.hb2.data(), lw.w3.data(), hidden, amx_.get(l, &AmxLayerPanels::w3)}},
                 act.xb.data(), n, dim, act, order);
    // A chunk's gates are shared out on the pool (the same values on any split).
    const std::size_t count = n * hidden;
    const KernelSet ks = active_kernel_set();
    parallel_run(count >= kMinParallelSwiglu ? act.pool : nullptr,
                 [&](std::size_t t, std::size_t nt) {
                   const auto [i0, i1] = ThreadPool::share(count, nt, t, 16);
                   if constexpr (std::is_same_v<T, float>) {
                     detail::swiglu(ks, act.hb.data() + i0, act.hb2.data() + i0, i1 - i0);
                   } else {
                     detail::swiglu(act.hb.data() + i0, act.hb2.data() + i0, i1 - i0);
                   }
                 });
    linear_group({{act.xb.data(), lw.w2.data(), dim, amx_.get(l, &AmxLayerPanels::w2)}},
                 act.hb.data(), n, hidden, act, order);
    add_into(act.x.data(), act.xb.data(), n * dim);
  }

  using Projection = detail::Projection<T, W>;

  /// The projections sharing input x [n][in], on act's pool and scratch (detail/linear.hpp).
  static void linear_group(std::initializer_list<Projection> ps, const T* x, std::size_t n,
                           std::size_t in, Activations<T>& act, Order order) {
    detail::linear_group<T, W>(ps, x, n, in, act.pool,
                               {act.panels.data(), act.panel_stride, act.x_rounded.data(),
                                act.x_codes.data(), act.x_scales.data(), act.x_sums.data()},
                               active_kernel_set(), order);
  }

  /// Block formats: every matrix the projections read, rows interleaved in groups in place
  /// (detail/row_groups.hpp); the memory held stays the same.
  void repack_matrices() requires kIsBlockFormat<W> {
    const auto dim = static_cast<std::size_t>(w_.config.dim);
    const auto hidden = static_cast<std::size_t>(w_.config.hidden_dim);
    std::vector<W> scratch;  // [8][in / 32] one group's rows as stored
    const auto repack = [&](AlignedBuffer<W>& m, std::size_t in) {
      const std::size_t nb = in / kWeightBlock;
      detail::repack_row_groups(m.data(), m.size() / nb, nb, scratch);
    };
    for (LayerWeights<W>& lw : w_.layers) {
      for (AlignedBuffer<W>* m : {&lw.wq, &lw.wk, &lw.wv, &lw.wo, &lw.w1, &lw.w3}) repack(*m, dim);
      repack(lw.w2, hidden);
    }
    repack(w_.config.shared_classifier ? w_.token_embedding : w_.wcls, dim);
  }

  /// out [count] = in widened to T; for a block format in holds count / 32 blocks.
  template <class From>
  static void widen_into(T* out, const From* in, std::size_t count) {
    if constexpr (kIsBlockFormat<From>) {
      dequantize_row(in, out, count);
    } else {
      for (std::size_t i = 0; i < count; ++i) out[i] = widen<T>(in[i]);
    }
  }
  const T* gain_att(std::size_t l) const {
    if constexpr (std::is_same_v<T, GainOf<W>>) {
      return w_.layers[l].rms_att.data();
    } else {
      return gains_.data() + 2 * l * static_cast<std::size_t>(w_.config.dim);
    }
  }
  const T* gain_ffn(std::size_t l) const {
    if constexpr (std::is_same_v<T, GainOf<W>>) {
      return w_.layers[l].rms_ffn.data();
    } else {
      return gains_.data() + (2 * l + 1) * static_cast<std::size_t>(w_.config.dim);
    }
  }
  const T* gain_final() const {
    if constexpr (std::is_same_v<T, GainOf<W>>) {
      return w_.rms_final.data();
    } else {
      return gains_.data() + 2 * w_.layers.size() * static_cast<std::size_t>(w_.config.dim);
    }
  }

  static void add_into(T* x, const T* y, std::size_t count) {
    for (std::size_t i = 0; i < count; ++i) x[i] += y[i];
  }

  Weights<W> w_;
  AmxPanels amx_;  // layer matrices re-laid for the AMX tiles (bf16 W where AMX runs), or empty
  AlignedBuffer<T>
      gains_;  // [2 n_layers + 1][dim] rms_att, rms_ffn per layer, rms_final; bf16 W only
};

}  // namespace kvdecode
