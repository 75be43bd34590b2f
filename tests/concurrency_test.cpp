// Concurrency: one read-only Model (and Tokenizer) shared by several threads, each decoding its
// own sequence with its own store, Activations and Sampler, gives exactly the tokens and logits
// of serial runs. Run under ThreadSanitizer by the tsan preset (cmake --workflow --preset tsan).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "kvdecode/kvdecode.hpp"
#include "kvdecode/text/tokenizer.hpp"
#include "test_util.hpp"

namespace {

using kvdecode::Activations;
using kvdecode::ContiguousStore;
using kvdecode::Model;
using kvdecode::ModelConfig;
using kvdecode::testing_util::random_tokens;
using kvdecode::testing_util::small_config;

struct SequenceRun {
  std::vector<std::int32_t> tokens;  // the generated ids
  std::vector<float> last_logits;    // [vocab_size] of the final step
};

/// One sequence, everything but the model owned here: what each thread does.
SequenceRun generate_one(const Model<float>& model, std::uint64_t seed, std::size_t n_new) {
  const ModelConfig& cfg = model.config();
  ContiguousStore<float> store(cfg);
  Activations<float> act(cfg, {.max_chunk = 8});
  kvdecode::SamplerOptions so;
  so.temperature = 0.9;
  so.seed = seed;
  kvdecode::Sampler sampler(cfg.vocab_size, so);
  const std::vector<std::int32_t> prompt = random_tokens(5 + seed % 7, cfg.vocab_size, seed);
  kvdecode::GenerationOptions options;
  options.max_new_tokens = n_new;
  SequenceRun run;
  kvdecode::generate(model, store, act, std::span<const std::int32_t>(prompt), sampler, options,
                     [&](std::int32_t t) { run.tokens.push_back(t); });
  // One more step, so the logits of the final state are compared too.
  const auto logits = model.decode(run.tokens.back(), store, act);
  run.last_logits.assign(logits.begin(), logits.end());
  return run;
}

TEST(ConcurrencyTest, SharedModelGivesEachThreadTheTokensOfASerialRun) {
  const ModelConfig cfg = small_config(4, 2, 64);
  const Model<float> model(kvdecode::random_weights<float>(cfg, 21));
  constexpr std::size_t kThreads = 4;
  constexpr std::size_t kNew = 24;
  std::vector<SequenceRun> serial;
  for (std::size_t t = 0; t < kThreads; ++t) serial.push_back(generate_one(model, 100 + t, kNew));

  for (int round = 0; round < 3; ++round) {  // a few rounds: different interleavings
    std::vector<SequenceRun> parallel(kThreads);
    std::vector<std::thread> threads;
    for (std::size_t t = 0; t < kThreads; ++t)
      threads.emplace_back([&, t] { parallel[t] = generate_one(model, 100 + t, kNew); });
    for (auto& th : threads) th.join();
    for (std::size_t t = 0; t < kThreads; ++t) {
      EXPECT_EQ(parallel[t].tokens, serial[t].tokens) << "thread " << t << " round " << round;
      EXPECT_EQ(parallel[t].last_logits, serial[t].last_logits) << "thread " << t;
    }
  }
  // The sequences differ from each other, so a mix-up between threads could not pass.
  EXPECT_NE(serial[0].tokens, serial[1].tokens);
}

TEST(ConcurrencyTest, ThreadsPrefillingAndDecodingInLockstepMatchSerial) {
  // Every thread runs the same prompt in different chunkings: the shared model is read by all
  // of them at the same positions at once.
  const ModelConfig cfg = small_config(4, 4, 48);
  const Model<float> model(kvdecode::random_weights<float>(cfg, 5));
  const std::vector<std::int32_t> prompt = random_tokens(40, cfg.vocab_size, 8);
  const std::vector<float> ref = model.forward_reference(prompt);
  const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
  constexpr std::size_t kThreads = 3;
  std::vector<std::vector<float>> logits(kThreads);
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      ContiguousStore<float> store(cfg);
      Activations<float> act(cfg, {.max_chunk = 1 + 5 * t});
      const std::size_t split = 10 + 7 * t;
      model.prefill(std::span<const std::int32_t>(prompt).first(split), store, act);
      std::span<const float> out;
      for (std::size_t p = split; p < prompt.size(); ++p) out = model.decode(prompt[p], store, act);
      logits[t].assign(out.begin(), out.end());
    });
  }
  for (auto& th : threads) th.join();
  for (std::size_t t = 0; t < kThreads; ++t) {
    ASSERT_EQ(logits[t].size(), vocab);
    for (std::size_t i = 0; i < vocab; ++i) {
      const double r = ref[(prompt.size() - 1) * vocab + i];
      EXPECT_NEAR(logits[t][i], r, 1e-5 * (1 + std::abs(r))) << "thread " << t << " logit " << i;
    }
  }
}

TEST(ConcurrencyTest, ASharedTokenizerEncodesTheSameIdsInEveryThread) {
  const auto tokenizer = kvdecode::Tokenizer::load(
      std::string(KVDECODE_TEST_DATA_DIR) + "/llama2c-tiny/tokenizer.bin", 512);
  const std::vector<std::string> texts = {"Once upon a time", "there was a little girl",
                                          "caf\xc3\xa9 \xe2\x82\xac", "  spaces  and\ttabs"};
  std::vector<std::vector<std::int32_t>> serial;
  for (const auto& s : texts) serial.push_back(tokenizer.encode(s));
  std::vector<std::vector<std::vector<std::int32_t>>> got(texts.size());
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < texts.size(); ++t) {
    threads.emplace_back([&, t] {
      std::vector<std::int32_t> out;
      for (int i = 0; i < 50; ++i) {
        tokenizer.encode(texts[t], true, false, out);
        got[t].push_back(out);
        for (std::size_t k = 1; k < out.size(); ++k) (void)tokenizer.decode(out[k - 1], out[k]);
      }
    });
  }
  for (auto& th : threads) th.join();
  for (std::size_t t = 0; t < texts.size(); ++t)
    for (const auto& ids : got[t]) EXPECT_EQ(ids, serial[t]) << texts[t];
}

}  // namespace
