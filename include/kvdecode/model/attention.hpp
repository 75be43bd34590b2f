// Cached attention: queries of one layer against everything a KvStore holds for it, with
// MHA/GQA/MQA head sharing, the causal mask, and a numerically stable online softmax.
#pragma once

#include <algorithm>
#include <array>
#include <cassert>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <type_traits>

#include "kvdecode/aligned_buffer.hpp"
#include "kvdecode/detail/attention_products.hpp"
#include "kvdecode/detail/coded_attention.hpp"
#include "kvdecode/detail/ops.hpp"
#include "kvdecode/detail/rotation.hpp"
#include "kvdecode/detail/softmax_exp.hpp"
#include "kvdecode/error.hpp"
#include "kvdecode/model/model_config.hpp"
#include "kvdecode/store/kv_store.hpp"
#include "kvdecode/thread_pool.hpp"

namespace kvdecode {

/// Up to this many queries (a decode step, a short speculative verification) attend to a
/// CodedKvStore's codes directly; a longer prefill chunk decodes each block once into scratch
/// and shares it among its queries through the matrix products.
inline constexpr std::size_t kMaxCodedQueries = 4;

/// Scratch of attention over up to max_queries queries on up to n_threads threads, allocated
/// once so a decode step allocates nothing.
template <class T>
struct AttentionScratch {
  /// Keys are consumed kTile rows at a time, which bounds the score buffer whatever the context.
  static constexpr std::size_t kTile = 256;

  AttentionScratch() = default;
  AttentionScratch(const ModelConfig& cfg, std::size_t max_queries, std::size_t store_scratch,
                   std::size_t n_threads = 1)
      : max_queries_(max_queries),
        store_scratch_(store_scratch),
        n_threads_(n_threads == 0 ? 1 : n_threads),
        kv_mul_(static_cast<std::size_t>(cfg.kv_mul())),
        scores(n_threads_ * score_rows() * kTile),
        row_max(n_threads_ * kv_mul_ * max_queries),
        row_sum(row_max.size()),
        query_sum(row_max.size()),
        block(n_threads_ * store_scratch),
        packed_keys(detail::attention_may_use_kernels<T>()
                        ? n_threads_ * static_cast<std::size_t>(cfg.head_size()) * kTile
                        : 0),
        gathered(n_threads_ * 2 * kTile * static_cast<std::size_t>(cfg.head_size())),
        coded(n_threads_ * coded_size(static_cast<std::size_t>(cfg.head_size()), kv_mul_)),
        coded_queries(n_threads_ * kv_mul_ * std::min(max_queries, kMaxCodedQueries) *
                      detail::int8_query_floats(static_cast<std::size_t>(cfg.head_size()))) {}

  /// Elements of one thread's coded-path scratch: the queries of a kv head's kv_mul heads folded
  /// with a group's ranges [kv_mul][round_up(head_size, 32)] and their q · min [round_up(kv_mul,
  /// 16)], the rotated query [head_size], a rotated block's value sum [head_size] and a tile's
  /// value weights (detail::coded_pv_scratch_floats).
  static constexpr std::size_t coded_size(std::size_t head_size, std::size_t kv_mul) {
    return kv_mul * ((head_size + 31) / 32 * 32) + (kv_mul + 15) / 16 * 16 + 2 * head_size +
           detail::coded_pv_scratch_floats(kTile);
  }

  /// Thread t's score tile [score_rows()][kTile] and store scratch [block_scratch_size()].
  T* thread_scores(std::size_t t) { return scores.data() + t * score_rows() * kTile; }
  std::span<T> thread_block(std::size_t t) {
    return block.span().subspan(t * store_scratch_, store_scratch_);
  }
  /// Thread t's running max and sum [kv_mul][max_queries]: the query heads of the kv head it
  /// works on, so threads working on the same head of different sequences never share them.
  T* thread_row_max(std::size_t t) { return row_max.data() + t * kv_mul_ * max_queries_; }
  T* thread_row_sum(std::size_t t) { return row_sum.data() + t * kv_mul_ * max_queries_; }
  /// Thread t's Σ of each query's channels [kv_mul][max_queries] (the coded path's 8-bit keys).
  T* thread_query_sum(std::size_t t) { return query_sum.data() + t * kv_mul_ * max_queries_; }
  /// Thread t's transposed key tile [head_size][kTile] (only where attention's own products run).
  T* thread_packed_keys(std::size_t t) {
    return packed_keys.data() + t * (packed_keys.size() / n_threads_);
  }
  /// Thread t's gathered key tile [kTile][head_size], its value tile following it.
  T* thread_gathered(std::size_t t) { return gathered.data() + t * (gathered.size() / n_threads_); }
  /// Thread t's coded-path scratch [coded_size(head_size, kv_mul)].
  T* thread_coded(std::size_t t) { return coded.data() + t * (coded.size() / n_threads_); }
  /// Thread t's queries prepared for 8-bit key codes (detail::int8_query), [kv_mul][up to
  /// kMaxCodedQueries][int8_query_floats(head_size)].
  T* thread_coded_queries(std::size_t t) {
    return coded_queries.data() + t * (coded_queries.size() / n_threads_);
  }
  std::size_t n_threads() const { return n_threads_; }
  std::size_t max_queries() const { return max_queries_; }
  /// Rows of a thread's score tile: one per query, or one per query head of a kv head when a
  /// query attends to rows in place (all kv_mul heads' scores at once).
  std::size_t score_rows() const { return std::max(max_queries_, kv_mul_); }

 private:
  std::size_t max_queries_ = 0;
  std::size_t store_scratch_ = 0;
  std::size_t n_threads_ = 1;
  std::size_t kv_mul_ = 1;

 public:
  AlignedBuffer<T> scores;       // [n_threads][score_rows()][kTile] scores, then probabilities
  AlignedBuffer<T> row_max;      // [n_threads][kv_mul][max_queries] running max of each query
  AlignedBuffer<T> row_sum;      // [n_threads][kv_mul][max_queries] running Σ exp(score - max)
  AlignedBuffer<T> query_sum;    // [n_threads][kv_mul][max_queries] Σ of a query's channels
  AlignedBuffer<T> block;        // [n_threads][store.block_scratch_size()] for stores that decode
  AlignedBuffer<T> packed_keys;  // [n_threads][head_size][kTile] or empty (Eigen's products)
  AlignedBuffer<T> gathered;     // [n_threads][2][kTile][head_size] a tile of several blocks' K, V
  AlignedBuffer<T> coded;        // [n_threads][coded_size(head_size, kv_mul)] (attention on codes)
  AlignedBuffer<T> coded_queries;  // [n_threads][kv_mul][min(max_queries, kMaxCodedQueries)][..]
};

/// Below this many multiply-adds (queries × keys × head_size × heads) attention stays on one
/// thread: it is done before a second thread would be awake.
inline constexpr std::size_t kMinParallelAttention = std::size_t{1} << 15;

namespace detail {
/// One query's step of the online softmax over a tile: row [cols] holds its scores (-inf where
/// masked) and becomes exp(score - new max); the running max m and sum l are updated and the
/// output row o [hs] rescaled to the new max. Returns false, the row zeroed, when nothing in
/// the tile is visible. f32 takes set ks's exp (softmax_exp.hpp).
template <class T>
inline bool online_softmax_row(T* row_data, std::size_t cols, T& m, T& l, T* o, std::size_t hs,
                               KernelSet ks) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>> row(row_data, static_cast<Eigen::Index>(cols));
  const T tile_max = row.maxCoeff();
  if (tile_max == neg_inf) {
    row.setZero();
    return false;
  }
  const T new_max = std::max(m, tile_max);
  // exp(-inf) = 0 on the first tile; a max that did not move (most tiles past the first few)
  // skips the call: exp(0) is exactly 1.
  const T correction = new_max == m ? T(1) : std::exp(m - new_max);
  T sum;
  if constexpr (std::is_same_v<T, float>) {
    sum = softmax_exp(ks, row_data, cols, new_max);
  } else {
    static_cast<void>(ks);
    row = (row.array() - new_max).exp();
    // Results below the smallest normal are zeroed, as softmax_exp does (its header says why).
    row = (row.array() < std::numeric_limits<T>::min()).select(T(0), row);
    sum = row.sum();
  }
  l = l * correction + sum;
  m = new_max;
  if (correction != T(1))
    Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>>(o, static_cast<Eigen::Index>(hs)) *= correction;
  return true;
}

}  // namespace detail

/// Up to this many queries attend to f32 rows in place one query at a time, in the sets with
/// coded_attention.hpp's kernels: a decode step reads each row once, so the rows stream from
/// memory with their next lines requested ahead instead of through a GEMV. It is the few-token
/// projections' bound, so a speculative verification's queries take decode's arithmetic; a
/// longer chunk shares each tile among its queries through the matrix products.
inline constexpr std::size_t kMaxRowQueries = detail::kMaxFewTokens;

namespace detail {
/// Stands for attention's coded-block callback when CodedKvStore is checked.
struct CodedBlockSinkArchetype {
  template <class Block>
  void operator()(const Block&) const {}
};

/// attend_kv_head on the codes a CodedKvStore hands (for_each_coded_block), with set ks's
/// coded_attention.hpp kernels: scores and p·v widen each row's codes in registers, so no row
/// is decoded into memory; rows the store keeps in full precision take the f32 row kernels. A
/// block's rows go through the online softmax query by query, in tiles of at most kTile rows.
/// Rotated low-bit codes are met with the rotated query (R q · y = q · Rᵀ y), and their value
/// sum is rotated back before it joins the output.
template <class S>
void attend_kv_head_coded(const ModelConfig& cfg, const S& store, std::size_t layer, std::size_t g,
                          std::size_t q_first, std::size_t n, const float* q, float* out,
                          AttentionScratch<float>& scratch, std::size_t t, KernelSet ks) {
  constexpr std::size_t kTile = AttentionScratch<float>::kTile;
  const auto dim = static_cast<std::size_t>(cfg.dim);
  const auto hs = static_cast<std::size_t>(cfg.head_size());
  const auto kv_mul = static_cast<std::size_t>(cfg.kv_mul());
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const std::size_t q_last = q_first + n - 1;

  float* const s_all = scratch.thread_scores(t);   // [score_rows][kTile] a tile's scores per query
                                                   // (8-bit keys: per query head of one query)
  float* const m_all = scratch.thread_row_max(t);  // [kv_mul][n]
  float* const l_all = scratch.thread_row_sum(t);  // [kv_mul][n]
  float* const qsum_all = scratch.thread_query_sum(t);  // [kv_mul][n] Σ of each query
  const std::size_t qs_size = (hs + 31) / 32 * 32;
  float* const qs = scratch.thread_coded(t);         // [kv_mul][qs_size] query ⊙ a group's steps
  float* const qm = qs + kv_mul * qs_size;           // [kv_mul] query · a group's mins
  float* const qrot = qm + (kv_mul + 15) / 16 * 16;  // [hs] the rotated query
  float* const acc = qrot + hs;                      // [hs] a rotated block's value sum
  float* const w = acc + hs;  // [coded_pv_scratch_floats(kTile)] p · the rows' value steps
  float* const qv_all = scratch.thread_coded_queries(t);  // [kv_mul][n][int8_query_floats]
  const std::size_t qv_size = int8_query_floats(hs);
  bool qv_ready = false;  // prepared at the first 8-bit block
  for (std::size_t j = 0; j < kv_mul; ++j) {
    for (std::size_t r = 0; r < n; ++r)
      std::fill_n(out + r * dim + (g * kv_mul + j) * hs, hs, 0.0f);
    std::fill_n(m_all + j * n, n, neg_inf);
    std::fill_n(l_all + j * n, n, 0.0f);
    for (std::size_t r = 0; r < n; ++r) {
      const float* qh = q + r * dim + (g * kv_mul + j) * hs;
      qsum_all[j * n + r] = std::accumulate(qh, qh + hs, 0.0f);
    }
  }

  // Query r's rows [first, first + rows) of the block for its head j, their scores in srow: the
  // mask and the online softmax; false when none is visible.
  const auto softmax_rows = [&](std::size_t j, std::size_t r, float* srow, std::size_t first,
                                std::size_t rows) {
    const std::size_t qi = q_first + r;
    bool full = first + rows - 1 <= qi;
    if constexpr (MaskingKvStore<S>) full = false;
    if (!full)
      for (std::size_t c = 0; c < rows; ++c) {
        bool visible = first + c <= qi;
        if constexpr (MaskingKvStore<S>) visible = visible && !store.masks(qi, first + c);
        if (!visible) srow[c] = neg_inf;
      }
    return online_softmax_row(srow, rows, m_all[j * n + r], l_all[j * n + r],
                              out + r * dim + (g * kv_mul + j) * hs, hs, ks);
  };
  // Rows [first, first + rows) of the block: per query head and query, its scores, the softmax,
  // then p·v.
  const auto attend_rows = [&](std::size_t first, std::size_t rows, const auto& scores_of,
                               const auto& pv_of) {
    for (std::size_t j = 0; j < kv_mul; ++j)
      for (std::size_t r = 0; r < n; ++r) {
        if (first > q_first + r) continue;  // every row in this query's future
        float* const srow = s_all + r * kTile;
        scores_of(srow, q + r * dim + (g * kv_mul + j) * hs, qsum_all[j * n + r],
                  qv_all + (j * n + r) * qv_size);
        if (softmax_rows(j, r, srow, first, rows))
          pv_of(out + r * dim + (g * kv_mul + j) * hs, srow);
      }
  };
  // The same with a query's kv_mul heads scored together into s_all [kv_mul][kTile] and summed
  // together by heads_pv_of(o [kv_mul][hs], p [kv_mul][kTile]). What a query sees does not depend
  // on the head, so its heads see rows of the tile together or none does; a head whose scores
  // are all -inf (overflow) sees none, and its zeroed row adds exactly nothing to its output.
  const auto attend_rows_by_query = [&](std::size_t first, std::size_t rows,
                                        const auto& heads_scores_of, const auto& heads_pv_of) {
    for (std::size_t r = 0; r < n; ++r) {
      if (first > q_first + r) continue;
      heads_scores_of(s_all, r);
      bool seen = false;
      for (std::size_t j = 0; j < kv_mul; ++j)
        seen = softmax_rows(j, r, s_all + j * kTile, first, rows) || seen;
      if (seen) heads_pv_of(out + r * dim + g * kv_mul * hs, s_all);
    }
  };

  store.for_each_coded_block(layer, g, q_last + 1, [&](const auto& b) {
    using Block = std::decay_t<decltype(b)>;
    for (std::size_t r0 = 0; r0 < b.n; r0 += kTile) {
      const std::size_t rows = std::min(kTile, b.n - r0);
      if constexpr (std::is_same_v<Block, Int8KvBlock>) {
        const std::uint8_t* keys = b.keys + r0 * hs;      // [rows][hs]
        const std::uint8_t* values = b.values + r0 * hs;  // [rows][hs]
        if (!qv_ready) {
          for (std::size_t j = 0; j < kv_mul; ++j)
            for (std::size_t r = 0; r < n; ++r)
              int8_query(ks, qv_all + (j * n + r) * qv_size, q + r * dim + (g * kv_mul + j) * hs,
                         hs);
          qv_ready = true;
        }
        attend_rows_by_query(
            b.first + r0, rows,
            [&](float* s, std::size_t r) {
              coded_heads_scores_int8(ks, s, kTile, q + r * dim + g * kv_mul * hs, hs,
                                      qv_all + r * qv_size, n * qv_size, qsum_all + r, n, kv_mul,
                                      keys, b.key_min + r0, b.key_step + r0, rows, hs, scale);
            },
            [&](float* o, const float* p) {
              coded_heads_pv_int8(ks, o, hs, p, kTile, kv_mul, w, values, b.value_min + r0,
                                  b.value_step + r0, rows, hs);
            });
      } else if constexpr (std::is_same_v<Block, LowBitKvBlock>) {
        const std::size_t row_bytes = hs * b.bits / 8;
        const std::uint8_t* keys = b.keys + r0 * row_bytes;      // [rows][row_bytes]
        const std::uint8_t* values = b.values + r0 * row_bytes;  // [rows][row_bytes]
        // Rotated values are summed per head, into acc, and rotated back before they join o.
        const auto heads_pv_of = [&](float* o, const float* p) {
          if (b.signs == nullptr)
            return coded_heads_pv_low_bit(ks, o, hs, p, kTile, kv_mul, w, values, b.bits,
                                          b.value_min + r0, b.value_step + r0, rows, hs);
          for (std::size_t j = 0; j < kv_mul; ++j) {
            std::fill_n(acc, hs, 0.0f);
            coded_pv_low_bit(ks, acc, p + j * kTile, w, values, b.bits, b.value_min + r0,
                             b.value_step + r0, rows, hs);
            rotate_rows(acc, 1, hs, b.signs, /*inverse=*/true);
            for (std::size_t c = 0; c < hs; ++c) o[j * hs + c] += acc[c];
          }
        };
        attend_rows_by_query(
            b.first + r0, rows,
            [&](float* s, std::size_t r) {
              for (std::size_t j = 0; j < kv_mul; ++j) {
                const float* qh = q + r * dim + (g * kv_mul + j) * hs;
                if (b.signs != nullptr) {
                  std::copy_n(qh, hs, qrot);
                  rotate_rows(qrot, 1, hs, b.signs, /*inverse=*/false);
                  qh = qrot;
                }
                qm[j] = low_bit_query(ks, qs + j * qs_size, qh, b.key_min, b.key_step, b.bits, hs);
              }
              coded_heads_scores_low_bit(ks, s, kTile, qs, qs_size, qm, 1, kv_mul, keys, b.bits,
                                         rows, hs, scale);
            },
            heads_pv_of);
      } else {
        static_assert(std::is_same_v<Block, KvBlock<float>>, "a coded block attention knows");
        const float* keys = b.keys + r0 * b.stride;      // [rows][stride]
        const float* values = b.values + r0 * b.stride;  // [rows][stride]
        attend_rows(
            b.first + r0, rows,
            [&](float* s, const float* qh, float, const float*) {
              f32_row_scores(ks, s, qh, keys, values, nullptr, b.stride, rows, hs, scale);
            },
            [&](float* o, const float* p) { f32_row_pv(ks, o, p, values, b.stride, rows, hs); });
      }
    }
  });

  for (std::size_t j = 0; j < kv_mul; ++j)
    for (std::size_t r = 0; r < n; ++r) {
      float* const o = out + r * dim + (g * kv_mul + j) * hs;
      const float l = l_all[j * n + r];
      for (std::size_t c = 0; c < hs; ++c) o[c] /= l;
    }
}
}  // namespace detail

/// out [n][dim], the heads of kv head g = softmax(q kᵀ / sqrt(head_size)) v, on thread t's
/// scratch: the work attend() shares out, callable for one (sequence, kv head) of a batch.
///
/// q [n][dim] holds the rotated queries at cache indices q_first .. q_first+n-1; the store must
/// already hold (committed or pending) every key up to q_first+n-1. Query head h reads kv head
/// h / kv_mul, and the kv_mul heads that share a kv head are handled together so each key tile
/// is fetched once for all of them. Keys are taken in tiles of up to kTile rows with the online
/// softmax of FlashAttention: the running max is subtracted before exp, so large scores never
/// overflow.
///
/// A tile gathers consecutive KvBlocks (a paged sequence gives one per run of adjacent blocks).
/// Tiles start at multiples of kTile keys from the first key whatever the blocks, so a
/// fragmented store takes the same softmax steps as a contiguous one. With Eigen's products a
/// tile of several blocks is copied into one [kTile][head_size] key tile and value tile, then
/// computed as the contiguous store's tile is (the same bits); the kernel set's products pack
/// the keys anyway and take p·v per block; up to kMaxRowQueries f32 queries read the blocks in
/// place, query by query with the kv_mul heads together, each row's score on its own and p·v
/// in row order (the same bits too). A store that
/// decodes into scratch (block_scratch_size() > 0) hands a block valid only during its
/// callback, so its tiles end at every block.
template <class T, KvStore S>
void attend_kv_head(const ModelConfig& cfg, const S& store, std::size_t layer, std::size_t g,
                    std::size_t q_first, std::size_t n, const T* q, T* out,
                    AttentionScratch<T>& scratch, std::size_t t) {
  if constexpr (std::is_same_v<T, float> && CodedKvStore<S, detail::CodedBlockSinkArchetype>) {
    const KernelSet cks = active_kernel_set();
    if (n <= kMaxCodedQueries && detail::coded_attention_kernels(cks))
      return detail::attend_kv_head_coded(cfg, store, layer, g, q_first, n, q, out, scratch, t,
                                          cks);
  }
  using detail::RowMatrix;
  using Stride = Eigen::OuterStride<>;
  constexpr std::size_t kTile = AttentionScratch<T>::kTile;
  const auto dim = static_cast<std::size_t>(cfg.dim);
  const auto hs = static_cast<std::size_t>(cfg.head_size());
  const auto kv_mul = static_cast<std::size_t>(cfg.kv_mul());
  const T scale = T(1) / std::sqrt(static_cast<T>(hs));
  const T neg_inf = -std::numeric_limits<T>::infinity();
  const auto ni = static_cast<Eigen::Index>(n);
  const auto hsi = static_cast<Eigen::Index>(hs);
  const auto dims = Stride(static_cast<Eigen::Index>(dim));
  const std::size_t q_last = q_first + n - 1;

  // Queries whose scores are computed together against the columns the last of them sees.
  constexpr std::size_t kQueryBlock = 32;
  T* const tile_scores = scratch.thread_scores(t);  // [n][cols], by rows [kv_mul][cols]
  T* const m_all = scratch.thread_row_max(t);       // [kv_mul][n]
  T* const l_all = scratch.thread_row_sum(t);       // [kv_mul][n]
  for (std::size_t j = 0; j < kv_mul; ++j) {
    detail::StridedMap<T>(out + (g * kv_mul + j) * hs, ni, hsi, dims).setZero();
    std::fill_n(m_all + j * n, n, neg_inf);
    std::fill_n(l_all + j * n, n, T(0));
  }

  // The tile being gathered: up to kTile key rows from one or more blocks.
  struct TileRun {
    const T* keys;    // [rows][stride]
    const T* values;  // [rows][stride]
    std::size_t stride;
    std::size_t first;  // cache index of the first row
    std::size_t col;    // its first column in the tile
    std::size_t rows;
  };
  std::array<TileRun, kTile> runs;  // [n_runs] (a block gives at least one row)
  std::size_t n_runs = 0;
  std::size_t cols = 0;
  // Up to kMaxRowQueries f32 queries read the rows in place; otherwise a build whose Eigen is
  // narrower than the CPU takes the kernel set's products instead of Eigen's.
  const KernelSet ks = active_kernel_set();
  const bool by_rows =
      std::is_same_v<T, float> && n <= kMaxRowQueries && detail::coded_attention_kernels(ks);
  const bool own_products = !by_rows && detail::attention_uses_kernels<T>(ks);
  T* const kt = own_products ? scratch.thread_packed_keys(t) : nullptr;  // [hs][kTile]

  const auto flush = [&] {
    if (cols == 0) return;
    // A tile's columns are consecutive positions for every store but a masking one (a window's
    // sinks and ring may share a tile): there vis may only be too large, and the mask below goes
    // by each run's own first position.
    const std::size_t tile_first = runs[0].first;
    const auto taken_below = [&](const TileRun& run, std::size_t vis) {  // columns below vis
      return run.col >= vis ? std::size_t{0} : std::min(run.rows, vis - run.col);
    };
    if constexpr (std::is_same_v<T, float>)
      if (by_rows) {
        // Query by query, the kv_mul heads together: each run's rows are read once for all of
        // them (scores [kv_mul][cols]); per head the arithmetic of one head at a time.
        for (std::size_t r = 0; r < n; ++r) {
          const std::size_t qi = q_first + r;
          if (qi < tile_first) continue;  // the whole tile in this query's future
          const std::size_t vis = std::min(cols, qi - tile_first + 1);
          const T* const qr = q + r * dim + g * kv_mul * hs;
          T* const outr = out + r * dim + g * kv_mul * hs;
          for (std::size_t k = 0; k < n_runs; ++k)
            if (const std::size_t take = taken_below(runs[k], vis); take > 0)
              detail::f32_heads_scores(
                  ks, tile_scores + runs[k].col, cols, qr, kv_mul, runs[k].keys, runs[k].values,
                  k + 1 < n_runs ? runs[k + 1].keys : nullptr, runs[k].stride, take, hs, scale);
          if constexpr (MaskingKvStore<S>)  // the same mask for every head
            for (std::size_t k = 0; k < n_runs; ++k)
              for (std::size_t c = 0; c < taken_below(runs[k], vis); ++c)
                if (const std::size_t ki = runs[k].first + c; ki > qi || store.masks(qi, ki))
                  for (std::size_t j = 0; j < kv_mul; ++j)
                    tile_scores[j * cols + runs[k].col + c] = neg_inf;
          for (std::size_t j = 0; j < kv_mul; ++j)
            detail::online_softmax_row(tile_scores + j * cols, vis, m_all[j * n + r],
                                       l_all[j * n + r], outr + j * hs, hs, ks);
          for (std::size_t k = 0; k < n_runs; ++k)
            if (const std::size_t take = taken_below(runs[k], vis); take > 0)
              detail::f32_heads_pv(ks, outr, tile_scores + runs[k].col, cols, runs[k].values,
                                   runs[k].stride, take, hs, kv_mul);
        }
        n_runs = 0;
        cols = 0;
        return;
      }
    if constexpr (std::is_same_v<T, float>)
      if (own_products)
        for (std::size_t k = 0; k < n_runs; ++k)
          detail::pack_keys(ks, kt, kTile, runs[k].col, runs[k].keys, runs[k].stride, runs[k].rows,
                            hs);
    // Eigen's products take a tile of several blocks as a copy of its rows, [cols][hs] like a
    // contiguous store's tile: one GEMV per tile instead of one per 16-row block, and the same
    // arithmetic as the contiguous store, so a fragmented table gives the same bits.
    TileRun packed{};
    const TileRun* products = runs.data();  // [n_products]
    std::size_t n_products = n_runs;
    if (!own_products && n_runs > 1) {
      T* const gk = scratch.thread_gathered(t);  // [kTile][hs]
      T* const gv = gk + kTile * hs;             // [kTile][hs]
      for (std::size_t k = 0; k < n_runs; ++k) {
        const TileRun& run = runs[k];
        assert(run.first == runs[0].first + run.col);  // a tile's rows are consecutive in cache
        if (run.stride == hs) {
          std::copy_n(run.keys, run.rows * hs, gk + run.col * hs);
          std::copy_n(run.values, run.rows * hs, gv + run.col * hs);
        } else {
          for (std::size_t c = 0; c < run.rows; ++c) {
            std::copy_n(run.keys + c * run.stride, hs, gk + (run.col + c) * hs);
            std::copy_n(run.values + c * run.stride, hs, gv + (run.col + c) * hs);
          }
        }
      }
      packed = TileRun{gk, gv, hs, runs[0].first, 0, cols};
      products = &packed;
      n_products = 1;
    }
    const auto ci = static_cast<Eigen::Index>(cols);
    for (std::size_t j = 0; j < kv_mul; ++j) {
      const std::size_t h = g * kv_mul + j;
      const detail::ConstStridedMap<T> qh(q + h * hs, ni, hsi, dims);
      detail::StridedMap<T> oh(out + h * hs, ni, hsi, dims);
      Eigen::Map<RowMatrix<T>> s(tile_scores, ni, ci);
      T* m = m_all + j * n;
      T* l = l_all + j * n;
      // Causal: a block of queries takes only the columns its last query can see, so a chunk
      // attending to itself computes about half the square instead of all of it.
      for (std::size_t r0 = 0; r0 < n; r0 += kQueryBlock) {
        const std::size_t rb = std::min(kQueryBlock, n - r0);
        const std::size_t q_hi = q_first + r0 + rb - 1;  // the block's last query
        if (q_hi < tile_first) continue;                 // the whole tile in its future
        const std::size_t vis = std::min(cols, q_hi - tile_first + 1);
        const auto r0i = static_cast<Eigen::Index>(r0);
        const auto rbi = static_cast<Eigen::Index>(rb);
        const auto taken = [&](const TileRun& run) { return taken_below(run, vis); };
        if constexpr (std::is_same_v<T, float>)
          if (own_products)
            detail::attention_scores(ks, tile_scores + r0 * cols, cols, q + r0 * dim + h * hs, dim,
                                     kt, kTile, rb, vis, hs, scale);
        for (std::size_t k = 0; k < n_products && !own_products; ++k) {
          const TileRun& run = products[k];
          const std::size_t take = taken(run);
          if (take == 0) break;
          const auto ti = static_cast<Eigen::Index>(take);
          const auto bs = Stride(static_cast<Eigen::Index>(run.stride));
          // Scaled after the product: Eigen evaluates a product inside a larger expression
          // ((q·Kᵀ)·scale) into a heap temporary.
          auto cols_of = s.block(r0i, static_cast<Eigen::Index>(run.col), rbi, ti);
          cols_of.noalias() = qh.middleRows(r0i, rbi) *
                              detail::ConstStridedMap<T>(run.keys, ti, hsi, bs).transpose();
          cols_of *= scale;
        }
        // Every query of the block sees every column below vis unless a column lies past the
        // block's first query or the store adds a mask of its own.
        bool full = tile_first + vis - 1 <= q_first + r0;
        if constexpr (MaskingKvStore<S>) full = false;
        for (std::size_t r = r0; r < r0 + rb; ++r) {
          T* const row = tile_scores + r * cols;
          if (!full && !MaskingKvStore<S>) {  // only the columns past the query
            const std::size_t seen =
                std::min(vis, q_first + r + 1 - std::min(q_first + r + 1, tile_first));
            std::fill(row + seen, row + vis, neg_inf);
          } else if (!full) {
            const std::size_t qi = q_first + r;
            for (std::size_t k = 0; k < n_runs; ++k) {
              const TileRun& run = runs[k];
              const std::size_t take = taken(run);
              for (std::size_t c = 0; c < take; ++c) {
                const std::size_t ki = run.first + c;
                bool visible = ki <= qi;
                if constexpr (MaskingKvStore<S>) visible = visible && !store.masks(qi, ki);
                if (!visible) row[run.col + c] = neg_inf;
              }
            }
          }
          detail::online_softmax_row(row, vis, m[r], l[r], out + r * dim + h * hs, hs, ks);
        }
        if constexpr (std::is_same_v<T, float>)
          if (own_products) {
            for (std::size_t k = 0; k < n_runs; ++k)
              if (const std::size_t take = taken(runs[k]); take > 0)
                detail::attention_pv(ks, out + r0 * dim + h * hs, dim,
                                     tile_scores + r0 * cols + runs[k].col, cols, runs[k].values,
                                     runs[k].stride, rb, take, hs);
            continue;
          }
        for (std::size_t k = 0; k < n_products; ++k) {
          const TileRun& run = products[k];
          const std::size_t take = taken(run);
          if (take == 0) break;
          const auto ti = static_cast<Eigen::Index>(take);
          const auto bs = Stride(static_cast<Eigen::Index>(run.stride));
          oh.middleRows(r0i, rbi).noalias() +=
              s.block(r0i, static_cast<Eigen::Index>(run.col), rbi, ti) *
              detail::ConstStridedMap<T>(run.values, ti, hsi, bs);
        }
      }
    }
    n_runs = 0;
    cols = 0;
  };

  const bool in_place = store.block_scratch_size() == 0;
  bool past_queries = false;  // later keys are in every query's future
  store.for_each_block(layer, g, q_last + 1, scratch.thread_block(t), [&](const KvBlock<T>& b) {
    for (std::size_t r0 = 0; r0 < b.n && !past_queries;) {
      if (b.first + r0 > q_last) {
        past_queries = true;
        break;
      }
      const std::size_t take = std::min(kTile - cols, b.n - r0);
      runs[n_runs++] = TileRun{
          b.keys + r0 * b.stride, b.values + r0 * b.stride, b.stride, b.first + r0, cols, take};
      cols += take;
      r0 += take;
      if (cols == kTile) flush();
    }
    if (!in_place) flush();  // the block's rows are gone after this callback
  });
  flush();

  for (std::size_t j = 0; j < kv_mul; ++j) {
    detail::StridedMap<T> oh(out + (g * kv_mul + j) * hs, ni, hsi, dims);
    const T* l = l_all + j * n;
    for (std::size_t r = 0; r < n; ++r) oh.row(static_cast<Eigen::Index>(r)) /= l[r];
  }
}

/// out [n][dim] = softmax(q kᵀ / sqrt(head_size)) v for n queries of one layer (see
/// attend_kv_head). With a pool (of at most scratch.n_threads() threads) the kv heads are
/// shared out among its threads; each head's arithmetic is the same on any thread, so the
/// result is too.
template <class T, KvStore S>
void attend(const ModelConfig& cfg, const S& store, std::size_t layer, std::size_t q_first,
            std::size_t n, const T* q, T* out, AttentionScratch<T>& scratch,
            ThreadPool* pool = nullptr) {
  const auto n_kv_heads = static_cast<std::size_t>(cfg.n_kv_heads);
  const std::size_t end = q_first + n;
  // Threads only pay when each gets tens of microseconds of keys to stream.
  const std::size_t work =
      n * end * static_cast<std::size_t>(cfg.head_size()) * static_cast<std::size_t>(cfg.n_heads);
  ThreadPool* p = work >= kMinParallelAttention && n_kv_heads > 1 ? pool : nullptr;
  KVDECODE_CHECK(p == nullptr || p->size() <= scratch.n_threads(), "attend: a pool of ",
                 p == nullptr ? 0 : p->size(), " threads, but the scratch is sized for ",
                 scratch.n_threads());
  KVDECODE_CHECK(n <= scratch.max_queries(), "attend: ", n,
                 " queries, but the scratch is sized for ", scratch.max_queries());
  parallel_run(p, [&](std::size_t t, std::size_t nt) {
    const auto [g0, g1] = ThreadPool::share(n_kv_heads, nt, t);
    for (std::size_t g = g0; g < g1; ++g)
      attend_kv_head(cfg, store, layer, g, q_first, n, q, out, scratch, t);
  });
}

}  // namespace kvdecode
