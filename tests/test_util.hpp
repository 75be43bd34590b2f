// Helpers shared by the test suites: small configs, random token streams, logit comparisons.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "kvdecode/kvdecode.hpp"

namespace kvdecode::testing_util {

inline ModelConfig small_config(std::int64_t n_heads = 4, std::int64_t n_kv_heads = 2,
                                std::int64_t seq_len = 48) {
  ModelConfig c;
  c.dim = 16 * n_heads;
  c.hidden_dim = 96;
  c.n_layers = 2;
  c.n_heads = n_heads;
  c.n_kv_heads = n_kv_heads;
  c.vocab_size = 53;
  c.seq_len = seq_len;
  return c;
}

inline std::vector<std::int32_t> random_tokens(std::size_t n, std::int64_t vocab,
                                               std::uint64_t seed) {
  detail::SplitMix64 rng(seed);
  std::vector<std::int32_t> t(n);
  for (auto& id : t) id = static_cast<std::int32_t>(rng.next() % static_cast<std::uint64_t>(vocab));
  return t;
}

/// max |a - b| over two equally long logit vectors. A NaN in either (which std::max would skip)
/// is a failure of the calling test and makes the result +infinity, so every bound on it fails
/// too, and so does a maximum taken over several calls.
template <class RangeA, class RangeB>
double max_abs_diff(const RangeA& a, const RangeB& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const double d = std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i]));
    if (std::isnan(d)) {
      ADD_FAILURE() << "max_abs_diff: NaN at index " << i << " (" << a[i] << " vs " << b[i] << ")";
      return std::numeric_limits<double>::infinity();
    }
    worst = std::max(worst, d);
  }
  return worst;
}

/// Whether two stores hold bit-identical keys and values for their first n positions.
template <class T>
bool same_contents(const ContiguousStore<T>& a, const ContiguousStore<T>& b, std::size_t n) {
  for (std::size_t l = 0; l < a.n_layers(); ++l)
    for (std::size_t h = 0; h < a.n_kv_heads(); ++h)
      for (std::size_t p = 0; p < n; ++p) {
        const auto ka = a.key(l, h, p), kb = b.key(l, h, p);
        const auto va = a.value(l, h, p), vb = b.value(l, h, p);
        for (std::size_t i = 0; i < ka.size(); ++i)
          if (ka[i] != kb[i] || va[i] != vb[i]) return false;
      }
  return true;
}

}  // namespace kvdecode::testing_util
