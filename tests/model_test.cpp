// Cached decode and prefill against the no-cache reference forward, over a table of shapes.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kvdecode/kvdecode.hpp"

namespace kvdecode {
namespace {

struct Shape {
  std::string name;
  std::int64_t dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len;
  RopeStyle rope;
  bool shared;
};

ModelConfig make_config(const Shape& s) {
  ModelConfig c;
  c.dim = s.dim;
  c.hidden_dim = s.hidden_dim;
  c.n_layers = s.n_layers;
  c.n_heads = s.n_heads;
  c.n_kv_heads = s.n_kv_heads;
  c.vocab_size = s.vocab_size;
  c.seq_len = s.seq_len;
  c.rope_style = s.rope;
  c.shared_classifier = s.shared;
  return c;
}

// MHA, GQA (4/2, 6/2, 8/2), MQA, both RoPE conventions, head sizes 8..64, 1..4 layers, shared
// and separate classifiers.
const std::vector<Shape>& shapes() {
  static const std::vector<Shape> table = {
      {"Mha4Hs8", 32, 64, 1, 4, 4, 40, 24, RopeStyle::kAdjacentPairs, true},
      {"Gqa4x2Hs16", 64, 96, 2, 4, 2, 50, 32, RopeStyle::kAdjacentPairs, true},
      {"Gqa6x2Hs8HalfSplit", 48, 80, 3, 6, 2, 33, 20, RopeStyle::kHalfSplit, false},
      {"Gqa8x2Hs16", 128, 160, 2, 8, 2, 64, 40, RopeStyle::kAdjacentPairs, false},
      {"MqaHs32", 128, 128, 2, 4, 1, 37, 24, RopeStyle::kHalfSplit, true},
      {"MhaHs64FourLayers", 128, 192, 4, 2, 2, 29, 18, RopeStyle::kAdjacentPairs, false},
      {"Gqa8x2Hs64HalfSplit", 512, 256, 1, 8, 2, 31, 12, RopeStyle::kHalfSplit, true},
  };
  return table;
}

std::vector<std::int32_t> random_tokens(std::size_t n, std::int64_t vocab, std::uint64_t seed) {
  detail::SplitMix64 rng(seed);
  std::vector<std::int32_t> t(n);
  for (auto& id : t) id = static_cast<std::int32_t>(rng.next() % static_cast<std::uint64_t>(vocab));
  return t;
}

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

template <class T>
double decode_all_and_compare(const Shape& shape) {
  const ModelConfig cfg = make_config(shape);
  const Model<T> model(random_weights<T>(cfg, 1234));
  const auto n = static_cast<std::size_t>(cfg.seq_len);  // fill the cache to its capacity
  const auto tokens = random_tokens(n, cfg.vocab_size, 99);
  const std::vector<T> ref = model.forward_reference(tokens);
  ContiguousStore<T> cache(cfg);
  Activations<T> act(cfg);
  const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
  double worst = 0;
  for (std::size_t p = 0; p < n; ++p) {
    const std::span<const T> logits = model.decode(tokens[p], cache, act);
    for (std::size_t i = 0; i < vocab; ++i) {
      const double r = ref[p * vocab + i];
      const double d = std::abs(static_cast<double>(logits[i]) - r);
      worst = std::max(worst, d);
      EXPECT_LE(d, Bound<T>::of(r)) << shape.name << " position " << p << " logit " << i;
    }
  }
  EXPECT_EQ(cache.size(), n);
  return worst;
}

class ShapeTest : public ::testing::TestWithParam<Shape> {};

TEST_P(ShapeTest, DecodeEqualsReferenceFloat) {
  const double worst = decode_all_and_compare<float>(GetParam());
  RecordProperty("max_abs_delta", std::to_string(worst));
}

TEST_P(ShapeTest, DecodeEqualsReferenceDouble) {
  const double worst = decode_all_and_compare<double>(GetParam());
  RecordProperty("max_abs_delta", std::to_string(worst));
}

INSTANTIATE_TEST_SUITE_P(Shapes, ShapeTest, ::testing::ValuesIn(shapes()),
                         [](const auto& param_info) { return param_info.param.name; });

}  // namespace
}  // namespace kvdecode
