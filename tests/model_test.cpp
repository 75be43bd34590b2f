// Cached decode and prefill against the no-cache reference forward, over a table of shapes.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kvdecode/io/checkpoint.hpp"
#include "kvdecode/kvdecode.hpp"
#include "test_util.hpp"

namespace kvdecode {
namespace {

struct Shape {
  std::string name;
  std::int64_t dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len;
  RopeStyle rope;
  bool shared;
  double rope_theta;
  double norm_eps;
};

ModelConfig make_config(const Shape& s) {
  ModelConfig c = testing_util::test_config({.dim = s.dim,
                                             .hidden_dim = s.hidden_dim,
                                             .n_layers = s.n_layers,
                                             .n_heads = s.n_heads,
                                             .n_kv_heads = s.n_kv_heads,
                                             .vocab_size = s.vocab_size,
                                             .seq_len = s.seq_len});
  c.rope_style = s.rope;
  c.shared_classifier = s.shared;
  c.rope_theta = s.rope_theta;
  c.norm_eps = s.norm_eps;
  return c;
}

// MHA, GQA (4/2, 6/2, 8/2), MQA, both RoPE conventions, head sizes 8..64, 1..4 layers, shared
// and separate classifiers; RoPE theta from 100 to 1e6 and RMSNorm eps from 1e-6 to 0.05, so a
// path that ignores either config field (a hard-coded 10000 or 1e-5) fails. The embedding rows'
// mean square is 4 / dim (random_weights), so eps ≥ 1e-3 moves the first norm by ≥ 1e-3
// relative at these widths, a hundred times the f32 bound.
const std::vector<Shape>& shapes() {
  static const std::vector<Shape> table = {
      {"Mha4Hs8", 32, 64, 1, 4, 4, 40, 24, RopeStyle::kAdjacentPairs, true, 1e4, 1e-5},
      {"Gqa4x2Hs16Theta5e5Eps1em3", 64, 96, 2, 4, 2, 50, 32, RopeStyle::kAdjacentPairs, true, 5e5,
       1e-3},
      {"Gqa6x2Hs8HalfSplitTheta1e6Eps1em6", 48, 80, 3, 6, 2, 33, 20, RopeStyle::kHalfSplit, false,
       1e6, 1e-6},
      {"Gqa8x2Hs16Theta100Eps5em2", 128, 160, 2, 8, 2, 64, 40, RopeStyle::kAdjacentPairs, false,
       100, 5e-2},
      {"MqaHs32Eps1em2", 128, 128, 2, 4, 1, 37, 24, RopeStyle::kHalfSplit, true, 1e4, 1e-2},
      {"MhaHs64FourLayersTheta5e5", 128, 192, 4, 2, 2, 29, 18, RopeStyle::kAdjacentPairs, false,
       5e5, 1e-5},
      {"Gqa8x2Hs64HalfSplitTheta3e3Eps3em3", 512, 256, 1, 8, 2, 31, 12, RopeStyle::kHalfSplit, true,
       3e3, 3e-3},
      // Longer than two attention tiles, so the online softmax merges tiles.
      {"Gqa4x2LongContextTheta1e6", 32, 32, 1, 4, 2, 23, 600, RopeStyle::kAdjacentPairs, true, 1e6,
       1e-5},
  };
  return table;
}

using testing_util::random_tokens;

template <class T>
struct Bound;
template <>
struct Bound<float> {
  static double of(double ref) { return 1e-5 * (1.0 + std::abs(ref)); }
};
template <>
struct Bound<double> {
  static double of(double) { return 1e-12; }
};

template <class T>
class CachedMatchesReference : public ::testing::TestWithParam<Shape> {};

/// Decodes every position of the shape one token at a time (decode = true) or prefills them in
/// chunks of 7 (the last one partial), comparing every position's logits with the reference.
template <class T>
double run_all_and_compare(const Shape& shape, bool decode) {
  const ModelConfig cfg = make_config(shape);
  const Model<T> model(random_weights<T>(cfg, 1234));
  const auto n = static_cast<std::size_t>(cfg.seq_len);  // fill the cache to its capacity
  const auto tokens = random_tokens(n, cfg.vocab_size, 99);
  // In double over the same weights, so Δ is the cached path's rounding alone.
  const std::vector<double> ref =
      forward_reference(convert_weights<double>(model.weights()), tokens);
  ContiguousStore<T> cache(cfg);
  Activations<T> act(cfg, {.max_chunk = decode ? std::size_t{1} : std::size_t{7}});
  const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
  std::vector<T> all(decode ? 0 : n * vocab);
  if (!decode) model.prefill(tokens, cache, act, std::span<T>(all));
  double worst = 0;
  for (std::size_t p = 0; p < n; ++p) {
    const std::span<const T> logits = decode ? model.decode(tokens[p], cache, act)
                                             : std::span<const T>(all).subspan(p * vocab, vocab);
    for (std::size_t i = 0; i < vocab; ++i) {
      const double r = ref[p * vocab + i];
      const double d = std::abs(static_cast<double>(logits[i]) - r);
      worst = std::max(worst, d);
      EXPECT_LE(d, Bound<T>::of(r))
          << shape.name << (decode ? " decode" : " prefill") << " position " << p << " logit " << i;
    }
  }
  EXPECT_EQ(cache.size(), n);
  return worst;
}

class ShapeTest : public ::testing::TestWithParam<Shape> {};

TEST_P(ShapeTest, DecodeEqualsReferenceFloat) {
  const double worst = run_all_and_compare<float>(GetParam(), true);
  RecordProperty("max_abs_delta", std::to_string(worst));
}

TEST_P(ShapeTest, DecodeEqualsReferenceDouble) {
  const double worst = run_all_and_compare<double>(GetParam(), true);
  RecordProperty("max_abs_delta", std::to_string(worst));
}

TEST_P(ShapeTest, ChunkedPrefillEqualsReferenceFloat) {
  const double worst = run_all_and_compare<float>(GetParam(), false);
  RecordProperty("max_abs_delta", std::to_string(worst));
}

TEST_P(ShapeTest, ChunkedPrefillEqualsReferenceDouble) {
  const double worst = run_all_and_compare<double>(GetParam(), false);
  RecordProperty("max_abs_delta", std::to_string(worst));
}

INSTANTIATE_TEST_SUITE_P(Shapes, ShapeTest, ::testing::ValuesIn(shapes()),
                         [](const auto& param_info) { return param_info.param.name; });

using testing_util::max_abs_diff;
using testing_util::small_config;

// Prefill in one chunk, in chunks of 1, 3 and 7, and prefill-then-decode all give the
// reference's logits at every position and the same cache contents.
template <class T>
void check_chunkings(double bound) {
  const ModelConfig cfg = small_config(4, 2, 40);
  const Model<T> model(random_weights<T>(cfg, 7));
  const auto tokens = random_tokens(40, cfg.vocab_size, 5);
  const std::vector<T> ref = model.forward_reference(tokens);
  const auto vocab = static_cast<std::size_t>(cfg.vocab_size);

  ContiguousStore<T> whole(cfg);
  Activations<T> big(cfg, {.max_chunk = 64});
  std::vector<T> all(tokens.size() * vocab);
  const std::span<const T> last = model.prefill(tokens, whole, big, std::span<T>(all));
  EXPECT_LE(max_abs_diff(all, ref), bound);
  EXPECT_LE(max_abs_diff(last, std::span<const T>(ref).last(vocab)), bound);

  for (const std::size_t chunk : {std::size_t{1}, std::size_t{3}, std::size_t{7}}) {
    // Chunking inside one prefill call (Activations sized to the chunk) ...
    ContiguousStore<T> inner(cfg);
    Activations<T> act(cfg, {.max_chunk = chunk});
    std::vector<T> got(tokens.size() * vocab);
    model.prefill(tokens, inner, act, std::span<T>(got));
    EXPECT_LE(max_abs_diff(got, ref), bound) << "chunk " << chunk;
    // ... and one prefill call per chunk, as a multi-turn conversation continues.
    ContiguousStore<T> turns(cfg);
    for (std::size_t at = 0; at < tokens.size(); at += chunk) {
      const std::size_t n = std::min(chunk, tokens.size() - at);
      std::vector<T> part(n * vocab);
      model.prefill(std::span<const std::int32_t>(tokens).subspan(at, n), turns, big,
                    std::span<T>(part));
      EXPECT_LE(max_abs_diff(part, std::span<const T>(ref).subspan(at * vocab, n * vocab)), bound)
          << "chunk " << chunk << " at " << at;
    }
    ASSERT_EQ(turns.size(), tokens.size());
    for (std::size_t l = 0; l < turns.n_layers(); ++l)
      for (std::size_t h = 0; h < turns.n_kv_heads(); ++h)
        for (std::size_t p = 0; p < tokens.size(); ++p) {
          EXPECT_LE(max_abs_diff(turns.key(l, h, p), whole.key(l, h, p)), bound);
          EXPECT_LE(max_abs_diff(turns.value(l, h, p), whole.value(l, h, p)), bound);
          EXPECT_LE(max_abs_diff(inner.key(l, h, p), whole.key(l, h, p)), bound);
        }
  }

  // Prefill half, then decode the rest.
  ContiguousStore<T> mixed(cfg);
  model.prefill(std::span<const std::int32_t>(tokens).first(17), mixed, big);
  Activations<T> one(cfg, {.max_chunk = 1});
  for (std::size_t p = 17; p < tokens.size(); ++p) {
    const std::span<const T> logits = model.decode(tokens[p], mixed, one);
    EXPECT_LE(max_abs_diff(logits, std::span<const T>(ref).subspan(p * vocab, vocab)), bound)
        << "position " << p;
  }
}

TEST(PrefillTest, ChunkingsAgreeFloat) { check_chunkings<float>(2e-5); }
TEST(PrefillTest, ChunkingsAgreeDouble) { check_chunkings<double>(1e-12); }

// GQA equals MHA whose every kv head is repeated kv_mul times, built here from the GQA weights.
TEST(GqaTest, EqualsMhaWithRepeatedKvHeads) {
  const ModelConfig gqa_cfg = small_config(8, 2, 24);
  const Weights<double> gqa = random_weights<double>(gqa_cfg, 11);
  ModelConfig mha_cfg = gqa_cfg;
  mha_cfg.n_kv_heads = mha_cfg.n_heads;
  Weights<double> mha(mha_cfg);
  const auto dim = static_cast<std::size_t>(gqa_cfg.dim);
  const auto hs = static_cast<std::size_t>(gqa_cfg.head_size());
  const std::size_t kv_mul = 4;
  std::copy_n(gqa.token_embedding.data(), gqa.token_embedding.size(), mha.token_embedding.data());
  std::copy_n(gqa.rms_final.data(), dim, mha.rms_final.data());
  for (std::size_t l = 0; l < gqa.layers.size(); ++l) {
    const auto& g = gqa.layers[l];
    auto& m = mha.layers[l];
    const auto copy = [](const AlignedBuffer<double>& from, AlignedBuffer<double>& to) {
      std::copy_n(from.data(), from.size(), to.data());
    };
    copy(g.rms_att, m.rms_att);
    copy(g.wq, m.wq);
    copy(g.wo, m.wo);
    copy(g.rms_ffn, m.rms_ffn);
    copy(g.w1, m.w1);
    copy(g.w2, m.w2);
    copy(g.w3, m.w3);
    // Query head h of the MHA model gets kv head h / kv_mul's rows of wk and wv.
    for (std::size_t h = 0; h < static_cast<std::size_t>(mha_cfg.n_heads); ++h) {
      const std::size_t src = (h / kv_mul) * hs * dim;
      std::copy_n(g.wk.data() + src, hs * dim, m.wk.data() + h * hs * dim);
      std::copy_n(g.wv.data() + src, hs * dim, m.wv.data() + h * hs * dim);
    }
  }
  const Model<double> a(random_weights<double>(gqa_cfg, 11));
  const Model<double> b(std::move(mha));
  ContiguousStore<double> ca(gqa_cfg), cb(mha_cfg);
  Activations<double> xa(gqa_cfg, {.max_chunk = 1}), xb(mha_cfg, {.max_chunk = 1});
  // K and V grow with the kv heads; the 4-byte token id of each position does not.
  const std::size_t ids = 4 * ca.capacity();
  EXPECT_EQ(cb.memory_bytes() - ids, (ca.memory_bytes() - ids) * kv_mul);
  for (const std::int32_t t : random_tokens(24, gqa_cfg.vocab_size, 3)) {
    const auto la = a.decode(t, ca, xa);
    const auto lb = b.decode(t, cb, xb);
    EXPECT_LE(max_abs_diff(la, lb), 1e-12);
  }
}

// RoPE: after rotating q by position m and k by position n, q·k depends on m - n only.
TEST(RopeTest, DotProductDependsOnlyOnRelativePosition) {
  for (const RopeStyle style : {RopeStyle::kAdjacentPairs, RopeStyle::kHalfSplit}) {
    const std::size_t hs = 32;
    detail::SplitMix64 rng(17);
    std::vector<double> q0(hs), k0(hs);
    for (std::size_t i = 0; i < hs; ++i) {
      q0[i] = rng.symmetric();
      k0[i] = rng.symmetric();
    }
    const auto rotated_dot = [&](std::size_t m, std::size_t n) {
      std::vector<double> q = q0, k = k0, c(hs / 2), s(hs / 2);
      rope_angles(m, hs, 10000.0, c.data(), s.data());
      apply_rope(q.data(), 1, hs, style, c.data(), s.data());
      rope_angles(n, hs, 10000.0, c.data(), s.data());
      apply_rope(k.data(), 1, hs, style, c.data(), s.data());
      double dot = 0;
      for (std::size_t i = 0; i < hs; ++i) dot += q[i] * k[i];
      return dot;
    };
    for (const std::size_t shift : {1u, 7u, 100u, 4000u}) {
      EXPECT_NEAR(rotated_dot(5, 2), rotated_dot(5 + shift, 2 + shift), 1e-9);
      EXPECT_NEAR(rotated_dot(2, 9), rotated_dot(2 + shift, 9 + shift), 1e-9);
    }
    EXPECT_GT(std::abs(rotated_dot(5, 2) - rotated_dot(5, 3)), 1e-6);  // and it does depend on it
    // Position 0 is the identity.
    std::vector<double> q = q0, c(hs / 2), s(hs / 2);
    rope_angles(0, hs, 10000.0, c.data(), s.data());
    apply_rope(q.data(), 1, hs, style, c.data(), s.data());
    EXPECT_EQ(q, q0);
  }
}

// Rollback: truncate, then decode again, reproduces the logits seen the first time bit for bit,
// and decoding other tokens after the rollback matches the reference of the new sequence.
TEST(TruncateTest, RedecodeReproducesEarlierLogits) {
  const ModelConfig cfg = small_config(4, 2, 32);
  const Model<float> model(random_weights<float>(cfg, 21));
  const auto tokens = random_tokens(24, cfg.vocab_size, 8);
  ContiguousStore<float> cache(cfg);
  Activations<float> act(cfg, {.max_chunk = 1});
  std::vector<std::vector<float>> first;
  for (const auto t : tokens) {
    const auto l = model.decode(t, cache, act);
    first.emplace_back(l.begin(), l.end());
  }
  cache.truncate(10);
  EXPECT_EQ(cache.size(), 10u);
  for (std::size_t p = 10; p < tokens.size(); ++p) {
    const auto l = model.decode(tokens[p], cache, act);
    EXPECT_TRUE(std::equal(l.begin(), l.end(), first[p].begin())) << "position " << p;
  }
  cache.truncate(5);
  auto other = std::vector<std::int32_t>(tokens.begin(), tokens.begin() + 5);
  for (const auto t : random_tokens(9, cfg.vocab_size, 99)) other.push_back(t);
  const std::vector<float> ref = model.forward_reference(other);
  const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
  for (std::size_t p = 5; p < other.size(); ++p) {
    const auto l = model.decode(other[p], cache, act);
    for (std::size_t i = 0; i < vocab; ++i)
      EXPECT_NEAR(l[i], ref[p * vocab + i], 1e-5 * (1 + std::abs(ref[p * vocab + i])));
  }
  EXPECT_THROW(cache.truncate(cache.size() + 1), Error);
  cache.reset();
  EXPECT_EQ(cache.size(), 0u);
}

// A prefill or decode that would pass the capacity throws and leaves the cache as it was.
TEST(CapacityTest, OverflowThrowsAndLeavesCacheIntact) {
  const ModelConfig cfg = small_config(4, 2, 48);
  const Model<float> model(random_weights<float>(cfg, 4));
  const auto tokens = random_tokens(8, cfg.vocab_size, 1);
  ContiguousStore<float> cache(cfg, 6);
  EXPECT_EQ(cache.capacity(), 6u);
  Activations<float> act(cfg, {.max_chunk = 8});
  model.prefill(std::span<const std::int32_t>(tokens).first(5), cache, act);
  ContiguousStore<float> before(cfg, 6);
  before.copy_from(cache);
  try {
    model.prefill(std::span<const std::int32_t>(tokens).subspan(5, 2), cache, act);
    FAIL() << "expected a capacity error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("appending 2 positions to 5 would exceed the "
                                               "capacity of 6"));
  }
  EXPECT_EQ(cache.size(), 5u);
  EXPECT_EQ(cache.pending(), 0u);
  EXPECT_TRUE(testing_util::same_contents(cache, before, 5));
  // The cache still works: the 6th token decodes to the reference's logits, then it is full.
  const auto l = model.decode(tokens[5], cache, act);
  const std::vector<float> ref =
      model.forward_reference(std::span<const std::int32_t>(tokens).first(6));
  const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
  EXPECT_LE(max_abs_diff(l, std::span<const float>(ref).last(vocab)), 2e-5);
  EXPECT_THROW(model.decode(tokens[6], cache, act), Error);
  EXPECT_EQ(cache.size(), 6u);
}

TEST(ModelTest, OutOfRangeTokenThrowsAndChangesNothing) {
  const ModelConfig cfg = small_config();
  const Model<float> model(random_weights<float>(cfg, 4));
  ContiguousStore<float> cache(cfg);
  Activations<float> act(cfg, {.max_chunk = 4});
  model.decode(3, cache, act);
  const std::vector<std::int32_t> bad = {1, 2, 53};
  try {
    model.prefill(bad, cache, act);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr(
                              "token id 53 at input position 2 is outside the vocabulary [0, 53)"));
  }
  EXPECT_THROW(model.decode(-1, cache, act), Error);
  EXPECT_EQ(cache.size(), 1u);
  EXPECT_THROW(model.forward_reference(bad), Error);
  EXPECT_THROW(model.prefill({}, cache, act), Error);
  std::vector<float> wrong(7);
  EXPECT_THROW(model.prefill(std::vector<std::int32_t>{1}, cache, act, std::span<float>(wrong)),
               Error);
  EXPECT_EQ(cache.size(), 1u);
}

TEST(ModelTest, MismatchedStoreOrActivationsThrow) {
  const ModelConfig cfg = small_config(4, 2);
  const Model<float> model(random_weights<float>(cfg, 4));
  ContiguousStore<float> other_store(small_config(4, 4));
  Activations<float> act(cfg, {.max_chunk = 1});
  EXPECT_THROW(model.decode(1, other_store, act), Error);
  ContiguousStore<float> cache(cfg);
  ModelConfig wider = cfg;
  wider.vocab_size = 99;
  Activations<float> other_act(wider, {.max_chunk = 1});
  EXPECT_THROW(model.decode(1, cache, other_act), Error);
  EXPECT_EQ(cache.size(), 0u);
}

// Scores of order 1e4 would overflow exp() without the max subtraction of the online softmax.
TEST(AttentionTest, StableForLargeScores) {
  ModelConfig cfg = small_config(4, 2, 300);
  Weights<double> w = random_weights<double>(cfg, 5);
  for (auto& l : w.layers) {
    for (std::size_t i = 0; i < l.wq.size(); ++i) l.wq[i] *= 60.0;
    for (std::size_t i = 0; i < l.wk.size(); ++i) l.wk[i] *= 60.0;
  }
  const Model<double> model(std::move(w));
  const auto tokens = random_tokens(300, cfg.vocab_size, 2);
  const std::vector<double> ref = model.forward_reference(tokens);
  ContiguousStore<double> cache(cfg);
  Activations<double> act(cfg, {.max_chunk = 300});
  std::vector<double> all(ref.size());
  model.prefill(tokens, cache, act, std::span<double>(all));
  for (const double v : all) ASSERT_TRUE(std::isfinite(v));
  EXPECT_LE(max_abs_diff(all, ref), 1e-9);
}

}  // namespace
}  // namespace kvdecode
