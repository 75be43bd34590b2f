// The stores the cache-file fuzz target restores into and the seed generator saves from: every
// store kind, each with fixed options for the tiny seed model, chosen by a number.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kvdecode/kvdecode.hpp"

namespace kvdecode::fuzz {

/// contiguous, int8, q4 (group 4), trained window (W 4), streaming window (W 3, 1 sink), paged
/// (blocks of 2 in a pool of 6).
inline constexpr int kCacheKinds = 6;
inline constexpr const char* kCacheKindNames[kCacheKinds] = {"contiguous", "int8",      "q4",
                                                             "window",     "streaming", "paged"};
inline constexpr std::size_t kMaxTokens = 4;  // Activations max_chunk = the windows' max_chunk

/// Calls f(store) with a fresh, empty store of kind k (0 ≤ k < kCacheKinds) for cfg.
template <class F>
void with_cache_store(int k, const ModelConfig& cfg, F&& f) {
  switch (k) {
    case 0: {
      ContiguousStore<float> s(cfg);
      f(s);
      return;
    }
    case 1: {
      Int8Store<float> s(cfg);
      f(s);
      return;
    }
    case 2: {
      Q4Store<float> s(cfg, 0, 4, 4);
      f(s);
      return;
    }
    case 3: {
      WindowStore<float> s(cfg, {.window = 4, .max_chunk = kMaxTokens});
      f(s);
      return;
    }
    case 4: {
      WindowStore<float> s(
          cfg,
          {.window = 3, .sinks = 1, .policy = WindowPolicy::kStreaming, .max_chunk = kMaxTokens});
      f(s);
      return;
    }
    default: {
      BlockPool<float> pool(cfg, 6, 2);
      PagedStore<float> s(pool);
      f(s);
      return;
    }
  }
}

/// Appends tokens in the pieces the store accepts.
template <KvStore S>
void feed(const Model<float>& model, S& s, Activations<float>& act,
          std::span<const std::int32_t> tokens) {
  while (!tokens.empty()) {
    const std::size_t n = std::min({tokens.size(), kvdecode::detail::append_limit(s), kMaxTokens});
    model.prefill(tokens.first(n), s, act);
    tokens = tokens.subspan(n);
  }
}

/// Everything a refused restore must leave as it was: tokens, resident rows, a pool's counts.
struct StoreState {
  std::vector<std::int32_t> tokens;
  std::vector<float> rows;
  std::vector<std::size_t> counts;
  friend bool operator==(const StoreState&, const StoreState&) = default;
};

template <KvStore S>
StoreState store_state(const S& s) {
  StoreState st;
  st.tokens.assign(s.tokens().begin(), s.tokens().end());
  st.counts = {s.size(), s.pending()};
  std::vector<float> scratch(s.block_scratch_size());
  for (std::size_t l = 0; l < s.n_layers(); ++l)
    for (std::size_t h = 0; h < s.n_kv_heads(); ++h)
      s.for_each_block(l, h, s.size(), std::span<float>(scratch), [&](const KvBlock<float>& b) {
        for (std::size_t r = 0; r < b.n; ++r) {
          st.rows.insert(st.rows.end(), b.keys + r * b.stride,
                         b.keys + r * b.stride + s.head_size());
          st.rows.insert(st.rows.end(), b.values + r * b.stride,
                         b.values + r * b.stride + s.head_size());
        }
      });
  if constexpr (requires { s.pool(); }) {
    const auto& pool = *s.pool();
    st.counts.insert(st.counts.end(), {pool.n_free(), pool.n_evictable()});
    for (std::size_t b = 0; b < pool.n_blocks(); ++b) st.counts.push_back(pool.ref_count(b));
    st.counts.insert(st.counts.end(), s.block_table().begin(), s.block_table().end());
  }
  return st;
}

}  // namespace kvdecode::fuzz
