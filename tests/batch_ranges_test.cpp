// decode_batch and prefill_batch take any contiguous range of store pointers (a std::vector, a
// std::array, a C array, a span) without template arguments, and give the same logits for each.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "kvdecode/kvdecode.hpp"
#include "test_util.hpp"

namespace kvdecode {
namespace {

using testing_util::random_tokens;
using testing_util::small_config;

TEST(BatchRangesTest, EveryRangeOfStorePointersGivesTheSameLogits) {
  const ModelConfig cfg = small_config(4, 2, 32);
  const Model<float> model(random_weights<float>(cfg, 6));
  const auto prompts = random_tokens(3 * 5, cfg.vocab_size, 2);
  const std::array<std::size_t, 3> lengths{5, 5, 5};
  const std::array<std::int32_t, 3> next{1, 2, 3};
  const auto vocab = static_cast<std::size_t>(cfg.vocab_size);

  // Runs prefill_batch then decode_batch through `as`, a function turning the three stores'
  // pointers into the range under test; returns the decode logits [3][vocab].
  const auto run = [&](auto as) {
    std::array<ContiguousStore<float>, 3> stores{
        ContiguousStore<float>(cfg), ContiguousStore<float>(cfg), ContiguousStore<float>(cfg)};
    Activations<float> act(cfg, {.max_chunk = 8, .max_batch = 3});
    auto range = as(stores);
    model.prefill_batch(prompts, lengths, range, act);
    const auto logits = model.decode_batch(next, range, act);
    return std::vector<float>(logits.begin(), logits.end());
  };
  using Stores = std::array<ContiguousStore<float>, 3>;
  const std::vector<float> from_vector = run([](Stores& s) {
    return std::vector<ContiguousStore<float>*>{&s[0], &s[1], &s[2]};
  });
  const std::vector<float> from_array = run([](Stores& s) {
    return std::array<ContiguousStore<float>*, 3>{&s[0], &s[1], &s[2]};
  });
  ASSERT_EQ(from_vector.size(), 3 * vocab);
  EXPECT_EQ(from_vector, from_array);

  // A C array and a span, and one sequence alone against decode().
  std::array<ContiguousStore<float>, 3> stores{
      ContiguousStore<float>(cfg), ContiguousStore<float>(cfg), ContiguousStore<float>(cfg)};
  ContiguousStore<float>* raw[3] = {&stores[0], &stores[1], &stores[2]};
  Activations<float> act(cfg, {.max_chunk = 8, .max_batch = 3});
  model.prefill_batch(prompts, lengths, raw, act);
  const auto c_array = model.decode_batch(next, raw, act);
  EXPECT_EQ(std::vector<float>(c_array.begin(), c_array.end()), from_vector);
  ContiguousStore<float> alone(cfg);
  Activations<float> single(cfg, {.max_chunk = 8});
  model.prefill(std::span<const std::int32_t>(prompts).first(5), alone, single);
  // The batch's first sequence against it alone (prefilled in other chunks, so to f32 rounding).
  const auto one = model.decode(next[0], alone, single);
  for (std::size_t i = 0; i < vocab; ++i)
    EXPECT_NEAR(one[i], from_vector[i], 1e-5 * (1 + std::abs(one[i]))) << i;
}

}  // namespace
}  // namespace kvdecode
