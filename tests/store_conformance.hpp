// The store conformance suite: what every KvStore must do, as a typed GoogleTest suite. A store's
// test file specialises StoreTraits<Store> and instantiates the suite:
//
//   template <> struct kvdecode::testing_util::StoreTraits<MyStore> {
//     // A fresh store for the config, able to hold `capacity` positions of one sequence.
//     struct Holder { ...; MyStore& store(); };            // owns whatever the store needs
//     static std::unique_ptr<Holder> make(const ModelConfig& cfg, std::size_t capacity);
//     static constexpr bool kExactRows = true;     // for_each_block returns the written rows
//     static constexpr double kRowTolerance = 0;   // else: max |Δ| of a row element, relative
//                                                  // to the row's max |x|
//     static constexpr double kLogitTolerance = 1e-5;  // decode vs reference, × (1 + |ref|)
//     // The cache indices for_each_block(layer, head, end) must return, in order, after the
//     // suite's appends (at most 40 positions): all of [0, end) for a store that keeps them.
//     static std::vector<std::size_t> expected_resident(std::size_t end) {
//       return all_indices(end);
//     }
//   };
//   using MyStores = ::testing::Types<MyStore>;  // a name: the macro splits on commas
//   INSTANTIATE_TYPED_TEST_SUITE_P(My, StoreConformance, MyStores);
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <memory>
#include <vector>

#include "kvdecode/kvdecode.hpp"
#include "test_util.hpp"

namespace kvdecode::testing_util {

template <class Store>
struct StoreTraits;

/// The cache indices 0, 1, ..., end - 1.
inline std::vector<std::size_t> all_indices(std::size_t end) {
  std::vector<std::size_t> v(end);
  for (std::size_t i = 0; i < end; ++i) v[i] = i;
  return v;
}

/// Deterministic K/V rows for (layer, cache index): [kv_dim] each, different for every input.
template <class T>
std::vector<T> test_row(std::size_t layer, std::size_t index, std::size_t kv_dim, bool value) {
  std::vector<T> row(kv_dim);
  for (std::size_t i = 0; i < kv_dim; ++i)
    row[i] = static_cast<T>(std::sin(0.37 * static_cast<double>(i + 1) +
                                     1.3 * static_cast<double>(layer) +
                                     0.11 * static_cast<double>(index) + (value ? 2.0 : 0.0)));
  return row;
}

/// The token ids the suite appends: position p holds token (7p + 3) mod 50.
inline std::vector<std::int32_t> test_tokens(std::size_t first, std::size_t n) {
  std::vector<std::int32_t> t(n);
  for (std::size_t i = 0; i < n; ++i) t[i] = static_cast<std::int32_t>((7 * (first + i) + 3) % 50);
  return t;
}

/// Every resident (cache index → key row, value row) of one (layer, kv head), via the concept.
template <class Store>
struct Gathered {
  std::vector<std::size_t> indices;
  std::vector<std::vector<typename Store::Scalar>> keys, values;
};

template <class Store>
Gathered<Store> gather(const Store& s, std::size_t layer, std::size_t head, std::size_t end) {
  using T = typename Store::Scalar;
  Gathered<Store> g;
  std::vector<T> scratch(s.block_scratch_size());
  s.for_each_block(layer, head, end, std::span<T>(scratch), [&](const KvBlock<T>& b) {
    for (std::size_t r = 0; r < b.n; ++r) {
      g.indices.push_back(b.first + r);
      g.keys.emplace_back(b.keys + r * b.stride, b.keys + r * b.stride + s.head_size());
      g.values.emplace_back(b.values + r * b.stride, b.values + r * b.stride + s.head_size());
    }
  });
  return g;
}

template <class Store>
class StoreConformance : public ::testing::Test {
 protected:
  using T = typename Store::Scalar;
  using Traits = StoreTraits<Store>;
  ModelConfig cfg_ = small_config(4, 2, 64);
  std::size_t kv_dim() const { return static_cast<std::size_t>(cfg_.kv_dim()); }

  void append_rows(Store& s, std::size_t n) {
    const std::size_t first = s.size();
    s.begin_append(test_tokens(first, n));
    for (std::size_t l = 0; l < s.n_layers(); ++l)
      for (std::size_t i = 0; i < n; ++i) {
        const auto k = test_row<T>(l, first + i, kv_dim(), false);
        const auto v = test_row<T>(l, first + i, kv_dim(), true);
        s.write(l, i, k.data(), v.data());
      }
    s.commit_append();
  }

  // The rows a store returns are the rows written (exactly, or within the store's bound).
  void expect_rows(const Store& s, std::size_t end) {
    if (end == s.size()) {
      const auto t = s.tokens();
      ASSERT_EQ(std::vector<std::int32_t>(t.begin(), t.end()), test_tokens(0, end));
    }
    for (std::size_t l = 0; l < s.n_layers(); ++l)
      for (std::size_t h = 0; h < s.n_kv_heads(); ++h) {
        const Gathered<Store> g = gather(s, l, h, end);
        // Exactly the indices the store says it keeps, in increasing order: an empty or short
        // for_each_block fails here, not only a wrong row.
        ASSERT_EQ(g.indices, Traits::expected_resident(end))
            << "layer " << l << " head " << h << " end " << end;
        for (std::size_t r = 0; r < g.indices.size(); ++r) {
          const std::size_t index = g.indices[r];
          ASSERT_LT(index, end);
          const auto k = test_row<T>(l, index, kv_dim(), false);
          const auto v = test_row<T>(l, index, kv_dim(), true);
          const std::size_t hs = s.head_size();
          double kmax = 0, vmax = 0;
          for (std::size_t i = 0; i < hs; ++i) {
            kmax = std::max(kmax, std::abs(static_cast<double>(k[h * hs + i])));
            vmax = std::max(vmax, std::abs(static_cast<double>(v[h * hs + i])));
          }
          for (std::size_t i = 0; i < hs; ++i) {
            if constexpr (Traits::kExactRows) {
              ASSERT_EQ(g.keys[r][i], k[h * hs + i])
                  << "layer " << l << " head " << h << " index " << index;
              ASSERT_EQ(g.values[r][i], v[h * hs + i]);
            } else {
              ASSERT_NEAR(g.keys[r][i], k[h * hs + i], Traits::kRowTolerance * kmax);
              ASSERT_NEAR(g.values[r][i], v[h * hs + i], Traits::kRowTolerance * vmax);
            }
          }
        }
      }
  }
};

TYPED_TEST_SUITE_P(StoreConformance);

TYPED_TEST_P(StoreConformance, StartsEmptyWithItsShape) {
  auto holder = TestFixture::Traits::make(this->cfg_, 40);
  auto& s = holder->store();
  EXPECT_EQ(s.size(), 0u);
  EXPECT_EQ(s.pending(), 0u);
  EXPECT_GE(s.capacity(), 40u);
  EXPECT_EQ(s.n_layers(), 2u);
  EXPECT_EQ(s.n_kv_heads(), 2u);
  EXPECT_EQ(s.head_size(), 16u);
  EXPECT_EQ(gather(s, 0, 0, 0).indices.size(), 0u);
}

TYPED_TEST_P(StoreConformance, ReturnsWhatWasWritten) {
  auto holder = TestFixture::Traits::make(this->cfg_, 40);
  auto& s = holder->store();
  this->append_rows(s, 1);
  this->append_rows(s, 16);
  this->append_rows(s, 7);
  EXPECT_EQ(s.size(), 24u);
  this->expect_rows(s, 24);
  this->expect_rows(s, 9);  // a prefix: only indices below end
}

TYPED_TEST_P(StoreConformance, PendingRowsAreReadableBeforeCommit) {
  auto holder = TestFixture::Traits::make(this->cfg_, 40);
  auto& s = holder->store();
  this->append_rows(s, 5);
  s.begin_append(test_tokens(5, 3));
  for (std::size_t l = 0; l < s.n_layers(); ++l)
    for (std::size_t i = 0; i < 3; ++i) {
      const auto k = test_row<typename TypeParam::Scalar>(l, 5 + i, this->kv_dim(), false);
      const auto v = test_row<typename TypeParam::Scalar>(l, 5 + i, this->kv_dim(), true);
      s.write(l, i, k.data(), v.data());
    }
  EXPECT_EQ(s.size(), 5u);
  EXPECT_EQ(s.pending(), 3u);
  this->expect_rows(s, 8);
  s.commit_append();
  EXPECT_EQ(s.size(), 8u);
}

TYPED_TEST_P(StoreConformance, CancelLeavesTheStoreAsItWas) {
  auto holder = TestFixture::Traits::make(this->cfg_, 40);
  auto& s = holder->store();
  this->append_rows(s, 6);
  const std::size_t bytes = s.memory_bytes();
  s.begin_append(test_tokens(0, 4));
  const auto junk = std::vector<typename TypeParam::Scalar>(this->kv_dim(), 99);
  for (std::size_t l = 0; l < s.n_layers(); ++l)
    for (std::size_t i = 0; i < 4; ++i) s.write(l, i, junk.data(), junk.data());
  s.cancel_append();
  EXPECT_EQ(s.size(), 6u);
  EXPECT_EQ(s.pending(), 0u);
  EXPECT_EQ(s.memory_bytes(), bytes);
  this->expect_rows(s, 6);
  this->append_rows(s, 4);  // and the same positions can be appended for real
  this->expect_rows(s, 10);
}

TYPED_TEST_P(StoreConformance, OverflowThrowsAndChangesNothing) {
  auto holder = TestFixture::Traits::make(this->cfg_, 40);
  auto& s = holder->store();
  this->append_rows(s, 10);
  EXPECT_THROW(s.begin_append(test_tokens(10, s.capacity() - s.size() + 1)), Error);
  EXPECT_EQ(s.size(), 10u);
  EXPECT_EQ(s.pending(), 0u);
  this->expect_rows(s, 10);
  this->append_rows(s, 1);
  EXPECT_EQ(s.size(), 11u);
}

TYPED_TEST_P(StoreConformance, TruncateAndResetRollBack) {
  auto holder = TestFixture::Traits::make(this->cfg_, 40);
  auto& s = holder->store();
  this->append_rows(s, 20);
  s.truncate(13);
  EXPECT_EQ(s.size(), 13u);
  this->expect_rows(s, 13);
  this->append_rows(s, 9);  // rows 13.. are rewritten with their own contents
  EXPECT_EQ(s.size(), 22u);
  this->expect_rows(s, 22);
  EXPECT_THROW(s.truncate(23), Error);
  EXPECT_EQ(s.size(), 22u);
  s.reset();
  EXPECT_EQ(s.size(), 0u);
  this->append_rows(s, 3);
  this->expect_rows(s, 3);
}

TYPED_TEST_P(StoreConformance, DecodeThroughTheStoreMatchesReference) {
  using Scalar = typename TypeParam::Scalar;
  const ModelConfig cfg = small_config(4, 2, 48);
  const Model<Scalar> model(random_weights<Scalar>(cfg, 77));
  const auto tokens = random_tokens(40, cfg.vocab_size, 3);
  const std::vector<Scalar> ref = model.forward_reference(tokens);
  auto holder = TestFixture::Traits::make(cfg, 40);
  auto& s = holder->store();
  Activations<Scalar> act(cfg, {.max_chunk = 8, .store_scratch = s.block_scratch_size()});
  const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
  // A prefill of 11 tokens, then one at a time.
  model.prefill(std::span<const std::int32_t>(tokens).first(11), s, act);
  for (std::size_t p = 11; p < tokens.size(); ++p) {
    const auto logits = model.decode(tokens[p], s, act);
    for (std::size_t i = 0; i < vocab; ++i) {
      const double r = ref[p * vocab + i];
      ASSERT_NEAR(logits[i], r, TestFixture::Traits::kLogitTolerance * (1 + std::abs(r)))
          << "position " << p << " logit " << i;
    }
  }
}

REGISTER_TYPED_TEST_SUITE_P(StoreConformance, StartsEmptyWithItsShape, ReturnsWhatWasWritten,
                            PendingRowsAreReadableBeforeCommit, CancelLeavesTheStoreAsItWas,
                            OverflowThrowsAndChangesNothing, TruncateAndResetRollBack,
                            DecodeThroughTheStoreMatchesReference);

}  // namespace kvdecode::testing_util
