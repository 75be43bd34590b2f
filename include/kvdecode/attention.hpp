// Cached attention: queries of one layer against everything a KvStore holds for it, with
// MHA/GQA/MQA head sharing, the causal mask, and a numerically stable online softmax.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <span>

#include "kvdecode/aligned_buffer.hpp"
#include "kvdecode/detail/ops.hpp"
#include "kvdecode/error.hpp"
#include "kvdecode/kv_store.hpp"
#include "kvdecode/model_config.hpp"
#include "kvdecode/thread_pool.hpp"

namespace kvdecode {

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
        scores(n_threads_ * max_queries * kTile),
        row_max(static_cast<std::size_t>(cfg.n_heads) * max_queries),
        row_sum(row_max.size()),
        block(n_threads_ * store_scratch) {}

  /// Thread t's score tile [max_queries][kTile] and store scratch [block_scratch_size()].
  T* thread_scores(std::size_t t) { return scores.data() + t * max_queries_ * kTile; }
  std::span<T> thread_block(std::size_t t) {
    return block.span().subspan(t * store_scratch_, store_scratch_);
  }
  std::size_t n_threads() const { return n_threads_; }

 private:
  std::size_t max_queries_ = 0;
  std::size_t store_scratch_ = 0;
  std::size_t n_threads_ = 1;

 public:
  AlignedBuffer<T> scores;   // [n_threads][max_queries][kTile] scores, then probabilities
  AlignedBuffer<T> row_max;  // [n_heads][max_queries]   running max of each query's scores
  AlignedBuffer<T> row_sum;  // [n_heads][max_queries]   running Σ exp(score - max)
  AlignedBuffer<T> block;    // [n_threads][store.block_scratch_size()] for stores that decode
};

/// Below this many multiply-adds (queries × keys × head_size × heads) attention stays on one
/// thread: it is done before a second thread would be awake.
inline constexpr std::size_t kMinParallelAttention = std::size_t{1} << 16;

/// out [n][dim] = softmax(q kᵀ / sqrt(head_size)) v for n queries of one layer.
///
/// q [n][dim] holds the rotated queries at cache indices q_first .. q_first+n-1; the store must
/// already hold (committed or pending) every key up to q_first+n-1. Query head h reads kv head
/// h / kv_mul, and the kv_mul heads that share a kv head are handled together so each key tile
/// is fetched once for all of them. Keys are taken in tiles with the online softmax of
/// FlashAttention: the running max is subtracted before exp, so large scores never overflow.
/// With a pool (of at most scratch.n_threads() threads) the kv heads are shared out among its
/// threads; each head's arithmetic is the same on any thread, so the result is too.
template <class T, KvStore S>
void attend(const ModelConfig& cfg, const S& store, std::size_t layer, std::size_t q_first,
            std::size_t n, const T* q, T* out, AttentionScratch<T>& scratch,
            ThreadPool* pool = nullptr) {
  using detail::RowMatrix;
  using Stride = Eigen::OuterStride<>;
  const auto dim = static_cast<std::size_t>(cfg.dim);
  const auto hs = static_cast<std::size_t>(cfg.head_size());
  const auto kv_mul = static_cast<std::size_t>(cfg.kv_mul());
  const auto n_kv_heads = static_cast<std::size_t>(cfg.n_kv_heads);
  const T scale = T(1) / std::sqrt(static_cast<T>(hs));
  const T neg_inf = -std::numeric_limits<T>::infinity();
  const auto ni = static_cast<Eigen::Index>(n);
  const auto hsi = static_cast<Eigen::Index>(hs);
  const std::size_t q_last = q_first + n - 1;
  const std::size_t end = q_last + 1;

  // Work of one kv head and its kv_mul query heads, on thread `t`.
  const auto group = [&](std::size_t g, std::size_t t) {
    T* const tile_scores = scratch.thread_scores(t);
    for (std::size_t j = 0; j < kv_mul; ++j) {
      const std::size_t h = g * kv_mul + j;
      detail::StridedMap<T>(out + h * hs, ni, hsi, Stride(static_cast<Eigen::Index>(dim)))
          .setZero();
      std::fill_n(scratch.row_max.data() + h * n, n, neg_inf);
      std::fill_n(scratch.row_sum.data() + h * n, n, T(0));
    }
    store.for_each_block(layer, g, end, scratch.thread_block(t), [&](const KvBlock<T>& b) {
      for (std::size_t t0 = 0; t0 < b.n; t0 += AttentionScratch<T>::kTile) {
        const std::size_t tn = std::min(AttentionScratch<T>::kTile, b.n - t0);
        const std::size_t k_first = b.first + t0;
        const std::size_t k_last = k_first + tn - 1;
        if (k_first > q_last) return;  // later keys are in every query's future
        const auto tni = static_cast<Eigen::Index>(tn);
        const auto bs = Stride(static_cast<Eigen::Index>(b.stride));
        const detail::ConstStridedMap<T> keys(b.keys + t0 * b.stride, tni, hsi, bs);
        const detail::ConstStridedMap<T> values(b.values + t0 * b.stride, tni, hsi, bs);
        // Every query sees every key of the tile unless a key lies past the first query or the
        // store adds a mask of its own.
        bool full = k_last <= q_first;
        if constexpr (MaskingKvStore<S>) full = false;

        for (std::size_t j = 0; j < kv_mul; ++j) {
          const std::size_t h = g * kv_mul + j;
          const detail::ConstStridedMap<T> qh(q + h * hs, ni, hsi,
                                              Stride(static_cast<Eigen::Index>(dim)));
          detail::StridedMap<T> oh(out + h * hs, ni, hsi, Stride(static_cast<Eigen::Index>(dim)));
          Eigen::Map<RowMatrix<T>> s(tile_scores, ni, tni);
          s.noalias() = (qh * keys.transpose()) * scale;
          T* m = scratch.row_max.data() + h * n;
          T* l = scratch.row_sum.data() + h * n;
          for (std::size_t r = 0; r < n; ++r) {
            auto row = s.row(static_cast<Eigen::Index>(r));
            if (!full) {
              const std::size_t qi = q_first + r;
              for (std::size_t c = 0; c < tn; ++c) {
                const std::size_t ki = k_first + c;
                bool visible = ki <= qi;
                if constexpr (MaskingKvStore<S>) visible = visible && !store.masks(qi, ki);
                if (!visible) row(static_cast<Eigen::Index>(c)) = neg_inf;
              }
            }
            const T tile_max = row.maxCoeff();
            if (tile_max == neg_inf) {  // nothing visible in this tile for this query
              row.setZero();
              continue;
            }
            const T new_max = std::max(m[r], tile_max);
            const T correction = std::exp(m[r] - new_max);  // exp(-inf) = 0 on the first tile
            row = (row.array() - new_max).exp();
            l[r] = l[r] * correction + row.sum();
            m[r] = new_max;
            if (correction != T(1)) oh.row(static_cast<Eigen::Index>(r)) *= correction;
          }
          oh.noalias() += s * values;
        }
      }
    });
    for (std::size_t j = 0; j < kv_mul; ++j) {
      const std::size_t h = g * kv_mul + j;
      detail::StridedMap<T> oh(out + h * hs, ni, hsi, Stride(static_cast<Eigen::Index>(dim)));
      const T* l = scratch.row_sum.data() + h * n;
      for (std::size_t r = 0; r < n; ++r) oh.row(static_cast<Eigen::Index>(r)) /= l[r];
    }
  };

  // Threads only pay when each gets tens of microseconds of keys to stream.
  const std::size_t work = n * end * hs * static_cast<std::size_t>(cfg.n_heads);
  ThreadPool* p = work >= kMinParallelAttention && n_kv_heads > 1 ? pool : nullptr;
  KVDECODE_CHECK(p == nullptr || p->size() <= scratch.n_threads(), "attend: a pool of ",
                 p == nullptr ? 0 : p->size(), " threads, but the scratch is sized for ",
                 scratch.n_threads());
  parallel_run(p, [&](std::size_t t, std::size_t nt) {
    const auto [g0, g1] = ThreadPool::share(n_kv_heads, nt, t);
    for (std::size_t g = g0; g < g1; ++g) group(g, t);
  });
}

}  // namespace kvdecode
