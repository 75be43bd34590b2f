// generate(): cached and uncached generation give the tokens a greedy loop over the reference
// forward gives, and the loop stops where it should.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

#include "kvdecode/kvdecode.hpp"
#include "test_util.hpp"

namespace kvdecode {
namespace {

// Greedy continuation computed with nothing but forward_reference and an argmax written here.
std::vector<std::int32_t> reference_greedy(const Model<double>& model,
                                           std::vector<std::int32_t> seq, std::size_t n) {
  const auto vocab = static_cast<std::size_t>(model.config().vocab_size);
  std::vector<std::int32_t> out;
  for (std::size_t i = 0; i < n; ++i) {
    const std::vector<double> logits = model.forward_reference(seq);
    const double* last = logits.data() + (seq.size() - 1) * vocab;
    std::size_t best = 0;
    for (std::size_t v = 1; v < vocab; ++v)
      if (last[v] > last[best]) best = v;
    out.push_back(static_cast<std::int32_t>(best));
    seq.push_back(static_cast<std::int32_t>(best));
  }
  return out;
}

TEST(GenerateTest, CachedAndUncachedMatchReferenceGreedy) {
  const ModelConfig cfg = testing_util::small_config(4, 2, 40);
  const Model<double> model(random_weights<double>(cfg, 13));
  const auto prompt = testing_util::random_tokens(6, cfg.vocab_size, 4);
  const auto expected = reference_greedy(model, prompt, 20);
  for (const bool use_cache : {true, false}) {
    ContiguousStore<double> cache(cfg);
    Activations<double> act(cfg, 8);
    Sampler sampler(cfg.vocab_size, SamplerOptions{0.0, 0.9, 0, 1});
    std::vector<std::int32_t> got;
    GenerationOptions opt;
    opt.max_new_tokens = 20;
    opt.use_cache = use_cache;
    const GenerationStats st = generate(model, cache, act, std::span<const std::int32_t>(prompt),
                                        sampler, opt, [&](std::int32_t t) { got.push_back(t); });
    EXPECT_EQ(got, expected) << "use_cache " << use_cache;
    EXPECT_EQ(st.prompt_tokens, 6u);
    EXPECT_EQ(st.generated_tokens, 20u);
    EXPECT_FALSE(st.hit_stop_token);
    EXPECT_FALSE(st.hit_capacity);
    EXPECT_GE(st.ttft_ms, st.prefill_ms);
    EXPECT_EQ(cache.size(), 6u + 19u);  // the last token is never fed back
  }
}

TEST(GenerateTest, StopsAtStopTokenCallbackAndCapacity) {
  const ModelConfig cfg = testing_util::small_config(4, 2, 12);
  const Model<double> model(random_weights<double>(cfg, 13));
  const auto prompt = testing_util::random_tokens(4, cfg.vocab_size, 4);
  const auto greedy = reference_greedy(model, prompt, 8);
  const auto run = [&](GenerationOptions opt, std::size_t stop_after) {
    ContiguousStore<double> cache(cfg);
    Activations<double> act(cfg, 4);
    Sampler sampler(cfg.vocab_size, SamplerOptions{0.0, 0.9, 0, 1});
    std::vector<std::int32_t> got;
    const auto st = generate(model, cache, act, std::span<const std::int32_t>(prompt), sampler, opt,
                             [&](std::int32_t t) {
                               got.push_back(t);
                               return got.size() < stop_after;
                             });
    return std::pair{st, got};
  };
  GenerationOptions opt;
  opt.max_new_tokens = 100;
  opt.stop_token = greedy[2];
  auto [st, got] = run(opt, 100);
  EXPECT_TRUE(st.hit_stop_token);
  EXPECT_EQ(got.back(), greedy[2]);
  EXPECT_LE(got.size(), 3u);  // stops at the first occurrence of the stop token

  opt.stop_token = -1;
  std::tie(st, got) = run(opt, 3);
  EXPECT_EQ(got.size(), 3u);
  EXPECT_EQ(std::vector<std::int32_t>(greedy.begin(), greedy.begin() + 3), got);

  std::tie(st, got) = run(opt, 100);
  EXPECT_TRUE(st.hit_capacity);
  EXPECT_EQ(got.size(), 12u - 4u + 1u);  // capacity 12: 8 decodes after the 4-token prompt
  EXPECT_EQ(std::vector<std::int32_t>(greedy.begin(), greedy.end()),
            std::vector<std::int32_t>(got.begin(), got.begin() + 8));
}

TEST(GenerateTest, RejectsEmptyPromptAndUsedCache) {
  const ModelConfig cfg = testing_util::small_config();
  const Model<float> model(random_weights<float>(cfg, 1));
  ContiguousStore<float> cache(cfg);
  Activations<float> act(cfg);
  Sampler sampler(cfg.vocab_size, SamplerOptions{});
  const std::vector<std::int32_t> none;
  EXPECT_THROW(generate(model, cache, act, std::span<const std::int32_t>(none), sampler, {},
                        [](std::int32_t) {}),
               Error);
  model.decode(1, cache, act);
  const std::vector<std::int32_t> one = {1};
  EXPECT_THAT(
      [&] {
        generate(model, cache, act, std::span<const std::int32_t>(one), sampler, {},
                 [](std::int32_t) {});
      },
      ::testing::ThrowsMessage<Error>(::testing::HasSubstr("already holds 1 positions")));
}

}  // namespace
}  // namespace kvdecode
