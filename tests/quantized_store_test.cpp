// Int8Store and Q4Store: the conformance suite, the per-element error bound against each
// store's own quantization step, exact residual rows, transactions across group boundaries, and
// memory per token against a formula written here (and the 27 % / 15 % budgets).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <optional>
#include <vector>

#include "double_forward.hpp"
#include "kvdecode/store/int8_store.hpp"
#include "kvdecode/store/q4_store.hpp"
#include "store_conformance.hpp"
#include "test_util.hpp"

namespace kvdecode::testing_util {

// test_row() values are sines: |x| ≤ 1, and a 16-channel row spans more than 2π of phase in
// steps of 0.37, so its max |x| is at least cos(0.37 / 2) > 0.98. Row tolerances below are the
// stores' worst-case errors in those units, divided by that smallest row max.
constexpr double kMinRowMax = 0.98;

template <class T>
struct StoreTraits<Int8Store<T>> {
  struct Holder {
    Int8Store<T> s;
    Int8Store<T>& store() { return s; }
  };
  static std::unique_ptr<Holder> make(const ModelConfig& cfg, std::size_t capacity) {
    return std::make_unique<Holder>(Holder{Int8Store<T>(cfg, capacity)});
  }
  static constexpr bool kExactRows = false;
  // Half a step over the row's range: (max − min) / 510 ≤ max|x| / 255, which the f16 range
  // widens by under 0.2 % (range_half_step): within max|x| / 254.
  static constexpr double kRowTolerance = 0.5 / 127 * (1 + 1e-6);
  // An empirical regression guard, not a derived bound (those are in
  // quant_error_budget_test.cpp): this small random model (head_size 16, sharp attention)
  // measures max |Δlogit| / (1 + |ref|) = 0.078, about what uniform noise of half a step in
  // the f32 cache gives (0.097 absolute); the guard is twice that.
  static constexpr double kLogitTolerance = 0.15;
  static std::vector<std::size_t> expected_resident(std::size_t end) { return all_indices(end); }
};

template <class T>
struct StoreTraits<Q4Store<T>> {
  struct Holder {
    Q4Store<T> s;
    Q4Store<T>& store() { return s; }
  };
  // Groups of 8 and a residual of 8, so the suite's 40 positions cross four group boundaries;
  // unrotated, so the per-element bound below holds (the rotated store has its own tests).
  static std::unique_ptr<Holder> make(const ModelConfig& cfg, std::size_t capacity) {
    return std::make_unique<Holder>(Holder{Q4Store<T>(cfg, capacity, 8, 8, false)});
  }
  static constexpr bool kExactRows = false;
  // A range of at most 2 gives steps ≤ 2/15 and errors ≤ 1/15; a row that truncate() sent back
  // to staging is quantized twice, the second time over a range widened by ≤ 2/15:
  // 1/15 + (2 + 2/15) / 30 = 0.138 in absolute terms; the f16 ranges widen each step by at
  // most a factor (1 + 2^-10)² plus 2^-10 of |min| ≤ 1 (q4_half_step).
  static constexpr double kRowTolerance = (1.0 / 15 + (2.0 + 2.0 / 15) / 30) * 1.003 / kMinRowMax;
  // Empirical regression guard as for int8: measured 0.76 with groups of 8 on this model.
  static constexpr double kLogitTolerance = 1.5;
  static std::vector<std::size_t> expected_resident(std::size_t end) { return all_indices(end); }
};

using QuantizedStores =
    ::testing::Types<Int8Store<float>, Int8Store<double>, Q4Store<float>, Q4Store<double>>;
INSTANTIATE_TYPED_TEST_SUITE_P(Quantized, StoreConformance, QuantizedStores);

namespace {

/// Random rows [n][kv_dim] with a few outlier channels, as real keys have (KIVI §3).
std::vector<float> random_rows(std::size_t n, std::size_t kv_dim, std::uint64_t seed) {
  detail::SplitMix64 rng(seed);
  std::vector<float> x(n * kv_dim);
  for (std::size_t r = 0; r < n; ++r)
    for (std::size_t c = 0; c < kv_dim; ++c) {
      const double outlier = c % 11 == 3 ? 8.0 + 2.0 * rng.symmetric() : 0.0;
      x[r * kv_dim + c] = static_cast<float>(rng.symmetric() + outlier);
    }
  return x;
}

template <class Store>
void append(Store& s, const std::vector<float>& k, const std::vector<float>& v, std::size_t first,
            std::size_t n, std::size_t kv_dim) {
  s.begin_append(test_tokens(first, n));
  for (std::size_t l = 0; l < s.n_layers(); ++l)
    for (std::size_t i = 0; i < n; ++i)
      s.write(l, i, k.data() + (first + i) * kv_dim, v.data() + (first + i) * kv_dim);
  s.commit_append();
}

TEST(Int8StoreTest, EveryElementWithinHalfItsRowStep) {
  const ModelConfig cfg = small_config(4, 2, 64);
  const std::size_t kv_dim = 32, hs = 16, n = 50;
  const auto k = random_rows(n, kv_dim, 1), v = random_rows(n, kv_dim, 2);
  Int8Store<float> s(cfg, n);
  append(s, k, v, 0, 20, kv_dim);
  append(s, k, v, 20, 30, kv_dim);
  for (std::size_t h = 0; h < 2; ++h) {
    const auto g = gather(s, 1, h, n);
    ASSERT_EQ(g.indices.size(), n);
    for (std::size_t p = 0; p < n; ++p) {
      // The step is recomputed here from the f32 row's range, not read back from the store.
      double klo = 1e30, khi = -1e30, vlo = 1e30, vhi = -1e30;
      for (std::size_t c = 0; c < hs; ++c) {
        klo = std::min(klo, double{k[p * kv_dim + h * hs + c]});
        khi = std::max(khi, double{k[p * kv_dim + h * hs + c]});
        vlo = std::min(vlo, double{v[p * kv_dim + h * hs + c]});
        vhi = std::max(vhi, double{v[p * kv_dim + h * hs + c]});
      }
      // The stored range covers the row: min at or below its minimum, 255 steps reach its max.
      const double mn = detail::f16_to_float(s.key_min(1, h, p));
      const double step = detail::f16_to_float(s.key_step(1, h, p));
      EXPECT_LE(mn, klo);
      EXPECT_GE(mn + 255 * step, khi);
      for (std::size_t c = 0; c < hs; ++c) {
        EXPECT_LE(std::abs(g.keys[p][c] - k[p * kv_dim + h * hs + c]),
                  range_half_step(klo, khi, 255));
        EXPECT_LE(std::abs(g.values[p][c] - v[p * kv_dim + h * hs + c]),
                  range_half_step(vlo, vhi, 255));
      }
    }
  }
}

// A non-finite row, or one beyond the f16 range of its (min, step), reads back non-finite in
// every channel, so attention carries the NaN on instead of reading a plausible row; the rows
// around it are quantized as usual.
TEST(Int8StoreTest, NonFiniteRowsReadBackNonFinite) {
  const ModelConfig cfg = small_config(4, 2, 64);
  const std::size_t kv_dim = 32, hs = 16, n = 4;
  auto k = random_rows(n, kv_dim, 5), v = random_rows(n, kv_dim, 6);
  k[1 * kv_dim + 3] = std::numeric_limits<float>::quiet_NaN();  // position 1, head 0
  k[2 * kv_dim + 5] = 1e6f;                                     // position 2, head 0
  v[3 * kv_dim + 7] = -std::numeric_limits<float>::infinity();  // position 3, head 0
  Int8Store<float> s(cfg, n);
  append(s, k, v, 0, n, kv_dim);
  const auto g = gather(s, 0, 0, n);
  for (std::size_t c = 0; c < hs; ++c) {
    EXPECT_TRUE(std::isfinite(g.keys[0][c]) && std::isfinite(g.values[0][c])) << c;
    EXPECT_FALSE(std::isfinite(g.keys[1][c])) << c;
    EXPECT_FALSE(std::isfinite(g.keys[2][c])) << c;
    EXPECT_FALSE(std::isfinite(g.values[3][c])) << c;
  }
  const auto other = gather(s, 0, 1, n);  // the other kv head of the same positions
  for (std::size_t p = 0; p < n; ++p)
    for (std::size_t c = 0; c < hs; ++c) EXPECT_TRUE(std::isfinite(other.keys[p][c])) << p;
}

// The same ranges in the 4-bit store (detail::f16_range): a key channel beyond ±65504 in one
// group reads back non-finite in every row of that group, a value row in every channel.
TEST(Q4StoreTest, RangesBeyondF16ReadBackNonFinite) {
  const ModelConfig cfg = small_config(4, 2, 64);
  const std::size_t kv_dim = 32, hs = 16, n = 8;
  auto k = random_rows(n, kv_dim, 7), v = random_rows(n, kv_dim, 8);
  k[2 * kv_dim + 5] = 7e4f;  // position 2, head 0, channel 5
  v[3 * kv_dim + 7] = 7e4f;  // position 3, head 0
  Q4Store<float> s(cfg, n, /*group=*/8, /*residual=*/0, /*rotate=*/false);
  append(s, k, v, 0, n, kv_dim);
  const auto g = gather(s, 0, 0, n);
  for (std::size_t p = 0; p < n; ++p)
    for (std::size_t c = 0; c < hs; ++c) {
      EXPECT_EQ(std::isfinite(g.keys[p][c]), c != 5) << p << " " << c;
      EXPECT_EQ(std::isfinite(g.values[p][c]), p != 3) << p << " " << c;
    }
}

// A NaN anywhere in a key channel's group or a value row, not only in its first element (where
// std::min and std::max happen to keep it), makes that channel or row read back as NaN.
TEST(Q4StoreTest, NanElementsReadBackNaN) {
  const ModelConfig cfg = small_config(4, 2, 64);
  const std::size_t kv_dim = 32, hs = 16, n = 8;
  auto k = random_rows(n, kv_dim, 9), v = random_rows(n, kv_dim, 10);
  k[2 * kv_dim + 5] = std::numeric_limits<float>::quiet_NaN();  // position 2, head 0, channel 5
  v[3 * kv_dim + 7] = std::numeric_limits<float>::quiet_NaN();  // position 3, head 0, channel 7
  Q4Store<float> s(cfg, n, /*group=*/8, /*residual=*/0, /*rotate=*/false);
  append(s, k, v, 0, n, kv_dim);
  const auto g = gather(s, 0, 0, n);
  for (std::size_t p = 0; p < n; ++p)
    for (std::size_t c = 0; c < hs; ++c) {
      EXPECT_EQ(std::isnan(g.keys[p][c]), c == 5) << p << " " << c;
      EXPECT_EQ(std::isnan(g.values[p][c]), p == 3) << p << " " << c;
    }
}

TEST(Int8StoreTest, DequantizesAtMostOneBlockAtATime) {
  const ModelConfig cfg = small_config(4, 2, 1000);
  Int8Store<float> s(cfg, 1000);
  const auto k = random_rows(300, 32, 3);
  append(s, k, k, 0, 300, 32);
  std::vector<float> scratch(s.block_scratch_size());
  std::vector<std::size_t> sizes;
  s.for_each_block(0, 1, 300, std::span<float>(scratch), [&](const KvBlock<float>& b) {
    sizes.push_back(b.n);
    EXPECT_EQ(b.keys, scratch.data());
    EXPECT_EQ(b.first % Int8Store<float>::kBlockRows, 0u);
  });
  EXPECT_EQ(sizes, (std::vector<std::size_t>{64, 64, 64, 64, 44}));
  std::vector<float> small(s.block_scratch_size() - 1);
  EXPECT_THROW(s.for_each_block(0, 0, 10, std::span<float>(small), [](const KvBlock<float>&) {}),
               Error);
}

// Dequantization runs 16 channels at a time (AVX-512 builds) and the rest one at a time: head
// sizes 16, 40 (two chunks and a tail of 8) and 48 (the benchmark shape's) cover both paths.
// Keys must be min + code × step within the f32 rounding of that product and sum, with the
// code and range read back from the store.
TEST(Int8StoreTest, DequantizedKeysAreMinPlusCodeTimesStepAtEveryHeadSize) {
  for (const std::size_t hs : {16u, 40u, 48u}) {
    ModelConfig cfg = small_config(2, 2, 64);
    cfg.dim = static_cast<std::int64_t>(2 * hs);
    const std::size_t kv_dim = 2 * hs, n = 150;  // two blocks of kBlockRows and a partial one
    const auto k = random_rows(n, kv_dim, 11), v = random_rows(n, kv_dim, 12);
    Int8Store<float> s(cfg, n);
    append(s, k, v, 0, n, kv_dim);
    for (std::size_t h = 0; h < 2; ++h) {
      const auto g = gather(s, 1, h, n);
      ASSERT_EQ(g.indices.size(), n);
      for (std::size_t p = 0; p < n; ++p) {
        const auto codes = s.key_codes(1, h, p);
        const double mn = detail::f16_to_float(s.key_min(1, h, p));
        const double step = detail::f16_to_float(s.key_step(1, h, p));
        double vlo = 1e30, vhi = -1e30;
        for (std::size_t c = 0; c < hs; ++c) {
          vlo = std::min(vlo, double{v[p * kv_dim + h * hs + c]});
          vhi = std::max(vhi, double{v[p * kv_dim + h * hs + c]});
        }
        for (std::size_t c = 0; c < hs; ++c) {
          const double want = mn + codes[c] * step;
          ASSERT_LE(std::abs(g.keys[p][c] - want), 0x1p-23 * (std::abs(mn) + codes[c] * step))
              << "head_size " << hs << " position " << p << " channel " << c;
          ASSERT_LE(std::abs(g.values[p][c] - v[p * kv_dim + h * hs + c]),
                    range_half_step(vlo, vhi, 255))
              << "head_size " << hs << " position " << p << " channel " << c;
        }
      }
    }
  }
}

double q4_half_step(double lo, double hi) { return range_half_step(lo, hi, 15); }

// Keys within half the step of their channel over the group, values within half their row's
// step, the open group exact; at head size hs (see the int8 test above for the choice of hs).
void expect_q4_within_half_a_step(std::size_t hs) {
  ModelConfig cfg = small_config(2, 2, 64);
  cfg.dim = static_cast<std::int64_t>(2 * hs);
  const std::size_t kv_dim = 2 * hs, group = 16, n = 53;  // three groups and a residual
  const auto k = random_rows(n, kv_dim, 4), v = random_rows(n, kv_dim, 5);
  Q4Store<float> s(cfg, 64, group, /*residual=*/0, /*rotate=*/false);
  append(s, k, v, 0, 7, kv_dim);
  append(s, k, v, 7, 40, kv_dim);
  for (std::size_t p = 47; p < n; ++p) append(s, k, v, p, 1, kv_dim);
  for (std::size_t h = 0; h < 2; ++h) {
    const auto g = gather(s, 0, h, n);
    ASSERT_EQ(g.indices.size(), n);
    for (std::size_t p = 0; p < n; ++p) {
      const std::size_t g0 = p / group * group;
      double vlo = 1e30, vhi = -1e30;
      for (std::size_t c = 0; c < hs; ++c) {
        vlo = std::min(vlo, double{v[p * kv_dim + h * hs + c]});
        vhi = std::max(vhi, double{v[p * kv_dim + h * hs + c]});
      }
      for (std::size_t c = 0; c < hs; ++c) {
        const float kx = k[p * kv_dim + h * hs + c], vx = v[p * kv_dim + h * hs + c];
        if (p >= 48) {  // the open group: full precision, bit for bit
          ASSERT_EQ(g.keys[p][c], kx);
          ASSERT_EQ(g.values[p][c], vx);
          continue;
        }
        double klo = 1e30, khi = -1e30;  // channel c over the key's group
        for (std::size_t r = g0; r < g0 + group; ++r) {
          klo = std::min(klo, double{k[r * kv_dim + h * hs + c]});
          khi = std::max(khi, double{k[r * kv_dim + h * hs + c]});
        }
        ASSERT_LE(std::abs(g.keys[p][c] - kx), q4_half_step(klo, khi)) << p << " " << c;
        ASSERT_LE(std::abs(g.values[p][c] - vx), q4_half_step(vlo, vhi));
      }
    }
  }
}

TEST(Q4StoreTest, KeysPerChannelValuesPerTokenWithinHalfAStep) {
  for (const std::size_t hs : {16u, 40u, 48u}) {
    SCOPED_TRACE("head_size " + std::to_string(hs));
    expect_q4_within_half_a_step(hs);
  }
}

// Per-channel key ranges are what makes 4 bits usable: with an outlier channel of magnitude ~8
// a per-token range would give every channel a step ≥ 16/15; per channel the others keep ~2/15.
TEST(Q4StoreTest, OutlierChannelDoesNotWidenOtherChannelsSteps) {
  const ModelConfig cfg = small_config(4, 2, 64);
  const auto k = random_rows(32, 32, 6);
  Q4Store<float> s(cfg, 64, 16, /*residual=*/0, /*rotate=*/false);
  append(s, k, k, 0, 32, 32);
  for (std::size_t c = 0; c < 16; ++c) {
    if (c % 11 == 3) continue;  // the outlier channel (c = 3 of head 0)
    EXPECT_LE(s.key_step(0, 0, 0, c), 2 * q4_half_step(-1, 1)) << c;
  }
}

TEST(Q4StoreTest, CancelAcrossAGroupBoundaryRestoresTheResidualExactly) {
  const ModelConfig cfg = small_config(4, 2, 64);
  const auto k = random_rows(64, 32, 7), v = random_rows(64, 32, 8);
  Q4Store<float> s(cfg, 64, 8, /*residual=*/0);
  append(s, k, v, 0, 13, 32);  // one quantized group, 5 residual rows
  const auto before = gather(s, 1, 0, 13);
  s.begin_append(test_tokens(13, 20));  // would complete group 1 and fill groups 2, 3
  const auto junk = random_rows(20, 32, 9);
  for (std::size_t l = 0; l < 2; ++l)
    for (std::size_t i = 0; i < 20; ++i) s.write(l, i, junk.data() + i * 32, junk.data() + i * 32);
  s.cancel_append();
  const auto after = gather(s, 1, 0, 13);
  EXPECT_EQ(after.keys, before.keys);
  EXPECT_EQ(after.values, before.values);
  append(s, k, v, 13, 3, 32);  // and the group completes from the restored rows
  const auto done = gather(s, 1, 0, 16);
  for (std::size_t c = 0; c < 16; ++c) EXPECT_NEAR(done.keys[10][c], k[10 * 32 + c], 0.2);
}

TEST(Q4StoreTest, RowsMustBeWrittenInOrder) {
  const ModelConfig cfg = small_config(4, 2, 64);
  Q4Store<float> s(cfg, 64, 8);
  const auto k = random_rows(2, 32, 1);
  s.begin_append(test_tokens(0, 2));
  EXPECT_THROW(s.write(0, 1, k.data(), k.data()), Error);
  s.write(0, 0, k.data(), k.data());
  EXPECT_THROW(s.write(0, 0, k.data(), k.data()), Error);  // no rewrites either
  s.cancel_append();
  EXPECT_THROW(Q4Store<float>(cfg, 64, 1), Error);
}

// --- Logits over the store's own K/V ------------------------------------------------------

/// The rows a store returns for every kv head of a layer, cache indices [0, end), in
/// double_step's layout [n_kv_heads][end][head_size].
template <class Store>
LayerKv store_rows(const Store& s, std::size_t layer, std::size_t end) {
  const std::size_t hs = s.head_size(), heads = s.n_kv_heads();
  LayerKv out{end, std::vector<double>(heads * end * hs), std::vector<double>(heads * end * hs)};
  for (std::size_t h = 0; h < heads; ++h) {
    const auto g = gather(s, layer, h, end);
    EXPECT_EQ(g.indices, all_indices(end)) << "layer " << layer << " head " << h;
    for (std::size_t t = 0; t < end && t < g.indices.size(); ++t)
      for (std::size_t i = 0; i < hs; ++i) {
        out.keys[(h * end + t) * hs + i] = static_cast<double>(g.keys[t][i]);
        out.values[(h * end + t) * hs + i] = static_cast<double>(g.values[t][i]);
      }
  }
  return out;
}

/// The store's cached decode equals a double-precision forward over the SAME dequantized K/V,
/// read back from the store after each call (what every query of that call read: rows are
/// quantized when written, before attention), at the f32 (or f64) rounding level: quantization
/// error cancels, so a store that hands attention other rows than it holds for that index
/// fails here by far more than the bound. The rows themselves are checked against the
/// reference's own K/V within the store's quantization bound (row_bound), so a store cannot
/// pass by holding the wrong position's rows either.
template <class Store, class RowBound>
void expect_logits_over_own_kv(Store& s, double tolerance, RowBound&& row_bound) {
  using T = typename Store::Scalar;
  const ModelConfig cfg = small_config(4, 2, 48);
  const Model<T> model(random_weights<T>(cfg, 77));
  const DoubleWeights dw = widen_weights(model.weights());
  const auto tokens = random_tokens(40, cfg.vocab_size, 3);
  const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
  const auto kv_dim = static_cast<std::size_t>(cfg.kv_dim());
  const auto n_layers = static_cast<std::size_t>(cfg.n_layers);
  Activations<T> act(cfg, {.max_chunk = 11, .store_scratch = s.block_scratch_size()});
  std::vector<std::vector<double>> own_k(n_layers), own_v(n_layers);  // [layer][index × kv_dim]
  double worst = 0;
  const auto check = [&](std::span<const T> logits, std::size_t p) {
    const std::vector<double> ref = double_step(
        dw, tokens[p], p, [&](std::size_t l, std::span<const double> k, std::span<const double> v) {
          own_k[l].insert(own_k[l].end(), k.begin(), k.end());
          own_v[l].insert(own_v[l].end(), v.begin(), v.end());
          return store_rows(s, l, p + 1);
        });
    for (std::size_t i = 0; i < vocab; ++i) {
      const double d = std::abs(static_cast<double>(logits[i]) - ref[i]) / (1 + std::abs(ref[i]));
      ASSERT_LE(d, tolerance) << "position " << p << " logit " << i;
      worst = std::max(worst, d);
    }
  };
  // A prefill of 11 tokens (its queries read the store as it is after the call), then decode.
  std::vector<T> all(11 * vocab);
  model.prefill(std::span<const std::int32_t>(tokens).first(11), s, act, std::span<T>(all));
  for (std::size_t p = 0; p < 11; ++p) {
    check(std::span<const T>(all).subspan(p * vocab, vocab), p);
    if (::testing::Test::HasFatalFailure()) return;
  }
  for (std::size_t p = 11; p < tokens.size(); ++p) {
    check(model.decode(tokens[p], s, act), p);
    if (::testing::Test::HasFatalFailure()) return;
  }
  // The rows are the reference's own K/V, quantized.
  const std::size_t hs = s.head_size();
  for (std::size_t l = 0; l < n_layers; ++l)
    for (std::size_t h = 0; h < s.n_kv_heads(); ++h) {
      const LayerKv rows = store_rows(s, l, tokens.size());
      for (std::size_t t = 0; t < tokens.size(); ++t)
        for (std::size_t i = 0; i < hs; ++i) {
          const double k = own_k[l][t * kv_dim + h * hs + i];
          const double v = own_v[l][t * kv_dim + h * hs + i];
          ASSERT_LE(std::abs(rows.keys[(h * tokens.size() + t) * hs + i] - k),
                    row_bound(own_k[l], t, h * hs + i, kv_dim, hs, true))
              << "key layer " << l << " head " << h << " index " << t << " channel " << i;
          ASSERT_LE(std::abs(rows.values[(h * tokens.size() + t) * hs + i] - v),
                    row_bound(own_v[l], t, h * hs + i, kv_dim, hs, false))
              << "value layer " << l << " head " << h << " index " << t << " channel " << i;
        }
    }
  std::printf("  logits vs the double forward over the store's K/V: worst |Δ|/(1+|ref|) %.3g\n",
              worst);
}

// f32 arithmetic between the model's K/V and the reference's: 1e-5 of the row's scale.
constexpr double kF32Slack = 1e-5;

/// 8-bit: every element within half the step over its row's range of the reference's own row.
double int8_row_bound(const std::vector<double>& x, std::size_t t, std::size_t col,
                      std::size_t kv_dim, std::size_t hs, bool) {
  const std::size_t h0 = col / hs * hs;
  double lo = 1e30, hi = -1e30;
  for (std::size_t i = 0; i < hs; ++i) {
    lo = std::min(lo, x[t * kv_dim + h0 + i]);
    hi = std::max(hi, x[t * kv_dim + h0 + i]);
  }
  return range_half_step(lo, hi, 255) + kF32Slack * (1 + std::abs(lo) + std::abs(hi));
}

/// 4-bit, groups of G: a key within its channel's range over the group / 30, a value within its
/// row's range / 30; rows of the open group (past the last full group of 40) exact.
template <std::size_t G>
double q4_row_bound(const std::vector<double>& x, std::size_t t, std::size_t col,
                    std::size_t kv_dim, std::size_t hs, bool key) {
  const std::size_t n = x.size() / kv_dim, g0 = t / G * G;
  double lo = 1e30, hi = -1e30;
  if (g0 + G > n) {  // the open group: the f32 row itself
    return kF32Slack * (1 + std::abs(x[t * kv_dim + col]));
  }
  if (key) {
    for (std::size_t r = g0; r < g0 + G; ++r) {
      lo = std::min(lo, x[r * kv_dim + col]);
      hi = std::max(hi, x[r * kv_dim + col]);
    }
  } else {
    const std::size_t h0 = col / hs * hs;
    for (std::size_t i = 0; i < hs; ++i) {
      lo = std::min(lo, x[t * kv_dim + h0 + i]);
      hi = std::max(hi, x[t * kv_dim + h0 + i]);
    }
  }
  return q4_half_step(lo, hi) + kF32Slack * (1 + std::abs(lo) + std::abs(hi));
}

TEST(QuantizedLogitsTest, Int8MatchesDoubleForwardOverItsOwnKv) {
  Int8Store<float> f(small_config(4, 2, 48), 40);
  {
    // The avx512bf16 set's decode rounds the query and the p·v weights to 15 bits (bounded by
    // coded_attention_test); this test checks the rows the store hands attention at the f32
    // rounding level, so there it runs in the avx512 set, whose products are f32.
    std::optional<ForcedKernelSet> f32_products;
    if (active_kernel_set() == KernelSet::kAvx512Bf16) f32_products.emplace(KernelSet::kAvx512);
    expect_logits_over_own_kv(f, 1e-5, int8_row_bound);
  }
  Int8Store<double> d(small_config(4, 2, 48), 40);
  expect_logits_over_own_kv(d, 1e-12, int8_row_bound);
}

TEST(QuantizedLogitsTest, Q4MatchesDoubleForwardOverItsOwnKv) {
  // Groups of 8: the prefill completes one group and decode four more; none stays open.
  Q4Store<float> f(small_config(4, 2, 48), 40, 8, /*residual=*/0, /*rotate=*/false);
  {
    // The avx512bf16 set's 4-bit decode rounds the query to int8 and the p·v weights to 15
    // bits (bounded by coded_attention_test); this test checks the rows the store hands
    // attention at the f32 rounding level, so there it runs in the avx512 set, whose products
    // are f32.
    std::optional<ForcedKernelSet> f32_scores;
    if (active_kernel_set() == KernelSet::kAvx512Bf16) f32_scores.emplace(KernelSet::kAvx512);
    expect_logits_over_own_kv(f, 1e-5, q4_row_bound<8>);
  }
  // 8 rows stay in the open group.
  Q4Store<double> d(small_config(4, 2, 48), 40, 16, /*residual=*/0, /*rotate=*/false);
  expect_logits_over_own_kv(d, 1e-12, q4_row_bound<16>);
}

// --- Memory ---------------------------------------------------------------------------------

/// A Llama-style shape: head_size 128 (Llama 2/3, Mistral), GQA.
ModelConfig llama_shape(std::int64_t head_size) {
  return testing_util::test_config({.dim = 8 * head_size,
                                    .hidden_dim = 32 * head_size,  // 4 × dim
                                    .n_layers = 4,
                                    .n_heads = 8,
                                    .n_kv_heads = 2,
                                    .vocab_size = 256,
                                    .seq_len = 4096});
}

TEST(QuantizedMemoryTest, MemoryBytesFollowTheFormula) {
  for (const std::int64_t hs : {16, 64, 128}) {
    const ModelConfig cfg = llama_shape(hs);
    const std::size_t L = 4, kv = 2, h = static_cast<std::size_t>(hs);
    for (const std::size_t capacity : {64u, 1000u, 4096u}) {
      // int8: codes + one f16 (min, step) per (layer, kv head, position), keys and values,
      // each buffer as allocated, and a 4-byte token id per position.
      using testing_util::allocated;
      const Int8Store<float> i8(cfg, capacity);
      EXPECT_EQ(i8.memory_bytes(), 2 * allocated(L * kv * capacity * h) +
                                       2 * allocated(L * kv * capacity * 4) + 4 * capacity);
      EXPECT_EQ(i8.memory_bytes(), Int8Store<float>::memory_bytes_for(cfg, {capacity}));
      // 4-bit and 2-bit: per full group of G positions, codes (G·h·bits/8 per K and V), an
      // f16 (min, step) per key channel and per value row; the f32 ring of R + G rows and its
      // cancel copy; work rows 2·G·h + 2·h + 2·G floats; signs h floats when rotating; token
      // ids; two size_t counters per layer. Each of those buffers as allocated.
      for (const std::size_t G : {32u, 64u})
        for (const std::size_t R : {0u, 128u})
          for (const bool rot : {false, true}) {
            const auto expect = [&](auto store, std::size_t bits) {
              using S = decltype(store);
              const std::size_t groups = L * kv * (capacity / G);  // of every (layer, kv head)
              const std::size_t per_group = 2 * (G * h * bits / 8) + 2 * 2 * h + 2 * 2 * G;
              const std::size_t residual = 4 * allocated(L * kv * (R + G) * h * sizeof(float));
              const std::size_t fixed = allocated((2 * G * h + 2 * h + 2 * G) * sizeof(float)) +
                                        (rot ? allocated(h * sizeof(float)) : 0) +
                                        L * 2 * sizeof(std::size_t);
              EXPECT_EQ(store.memory_bytes(),
                        2 * allocated(groups * G * h * bits / 8) + 2 * allocated(groups * h * 2) +
                            2 * allocated(groups * G * 2) + residual + fixed + 4 * capacity)
                  << bits << " bits G " << G << " R " << R << " capacity " << capacity;
              EXPECT_EQ(store.residual_bytes(), residual);
              EXPECT_EQ(store.memory_bytes(), S::memory_bytes_for(cfg, {capacity, G, R, rot}));
              EXPECT_DOUBLE_EQ(MemoryPlanner<S>(cfg, {.group = G, .residual = R, .rotate = rot})
                                       .bytes_per_position() *
                                   static_cast<double>(G),
                               static_cast<double>(L * kv * per_group + 4 * G));
            };
            expect(Q4Store<float>(cfg, capacity, G, R, rot), 4);
            expect(Q2Store<float>(cfg, capacity, G, R, rot), 2);
          }
    }
  }
}

// The budgets, bytes per token including scales, relative to the f32 cache
// (2 × n_layers × kv_dim × 4 bytes per token). int8 pays 4/head_size for its range, so the 27 %
// holds from head_size 64 up; 4-bit pays 4/G + 4/head_size of f32 for its f16 (min, step)
// pairs and 4 bytes per position for the token id, so 15 % holds from head_size 64 at G = 64.
TEST(QuantizedMemoryTest, BytesPerTokenWithinTheBudgets) {
  for (const std::int64_t hs : {64, 128}) {
    const ModelConfig cfg = llama_shape(hs);
    const double f32 = static_cast<double>(2 * cfg.n_layers * cfg.kv_dim() * 4);
    EXPECT_LE(MemoryPlanner<Int8Store<float>>(cfg).bytes_per_position() / f32, 0.27) << hs;
  }
  const ModelConfig c128 = llama_shape(128), c64 = llama_shape(64);
  const auto f32 = [](const ModelConfig& c) {
    return static_cast<double>(2 * c.n_layers * c.kv_dim() * 4);
  };
  EXPECT_LE(MemoryPlanner<Q4Store<float>>(c128, {.group = 64}).bytes_per_position() / f32(c128),
            0.15);
  EXPECT_LE(MemoryPlanner<Q4Store<float>>(c64, {.group = 64}).bytes_per_position() / f32(c64),
            0.15);
  // Whole caches at seq_len, the fixed residual included.
  const ContiguousStore<float> full(c128);
  EXPECT_LE(static_cast<double>(Int8Store<float>(c128).memory_bytes()) /
                static_cast<double>(full.memory_bytes()),
            0.27);
  // 4-bit adds its fixed f32 residual (4 × (R + G) rows per kv head: ring and cancel copy).
  const Q4Store<float> q4(c128, 0, 64);
  EXPECT_LE(static_cast<double>(q4.memory_bytes() - q4.residual_bytes()) /
                static_cast<double>(full.memory_bytes()),
            0.15);
}

}  // namespace
}  // namespace kvdecode::testing_util
