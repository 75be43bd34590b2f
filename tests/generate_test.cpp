// generate(): cached and uncached generation give the tokens a greedy loop over the reference
// forward gives, from an empty cache or after a cached prefix, with f32 and bf16 weights; the
// after-prefill hook sees the prompt in the cache; a streaming window takes a prompt longer than
// S + W; and the loop stops where it should.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kvdecode/io/checkpoint.hpp"
#include "kvdecode/kvdecode.hpp"
#include "test_util.hpp"

namespace kvdecode {
namespace {

using Tokens = std::vector<std::int32_t>;

std::span<const std::int32_t> span_of(const Tokens& t) { return std::span<const std::int32_t>(t); }

Tokens concat(Tokens a, const Tokens& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Greedy continuation computed with nothing but forward_reference and an argmax written here.
// min_margin, if given, receives the smallest gap between the best and the second logit.
template <class T>
Tokens reference_greedy(const Weights<T>& w, Tokens seq, std::size_t n,
                        double* min_margin = nullptr) {
  const auto vocab = static_cast<std::size_t>(w.config.vocab_size);
  Tokens out;
  double margin = INFINITY;
  for (std::size_t i = 0; i < n; ++i) {
    const std::vector<T> logits = forward_reference(w, span_of(seq));
    const T* last = logits.data() + (seq.size() - 1) * vocab;
    std::size_t best = 0;
    for (std::size_t v = 1; v < vocab; ++v)
      if (last[v] > last[best]) best = v;
    for (std::size_t v = 0; v < vocab; ++v)
      if (v != best) margin = std::min(margin, static_cast<double>(last[best] - last[v]));
    out.push_back(static_cast<std::int32_t>(best));
    seq.push_back(static_cast<std::int32_t>(best));
  }
  if (min_margin != nullptr) *min_margin = margin;
  return out;
}

SamplerOptions greedy() { return SamplerOptions{0.0, 0.9, 0, 1}; }

// Generates n greedy tokens after `prompt`, the cache first holding `prefix` (prefilled here,
// outside generate()). Returns the tokens, the stats and what the cache holds at the end.
struct Run {
  Tokens tokens;
  GenerationStats stats;
  Tokens cache_tokens;
};
template <class T, class W>
Run run_greedy(const Model<T, W>& model, const Tokens& prefix, const Tokens& prompt, std::size_t n,
               bool use_cache = true) {
  const ModelConfig& cfg = model.config();
  ContiguousStore<T> cache(cfg);
  Activations<T> act(cfg, {.max_chunk = 8});
  if (!prefix.empty()) model.prefill(span_of(prefix), cache, act);
  Sampler sampler(cfg.vocab_size, greedy());
  GenerationOptions opt;
  opt.max_new_tokens = n;
  opt.use_cache = use_cache;
  Run r;
  r.stats = generate(model, cache, act, span_of(prompt), sampler, opt,
                     [&](std::int32_t t) { r.tokens.push_back(t); });
  r.cache_tokens.assign(cache.tokens().begin(), cache.tokens().end());
  return r;
}

TEST(GenerateTest, CachedAndUncachedMatchReferenceGreedy) {
  const ModelConfig cfg = testing_util::small_config(4, 2, 40);
  const Model<double> model(random_weights<double>(cfg, 13));
  const auto prompt = testing_util::random_tokens(6, cfg.vocab_size, 4);
  const auto expected = reference_greedy(model.weights(), prompt, 20);
  for (const bool use_cache : {true, false}) {
    ContiguousStore<double> cache(cfg);
    Activations<double> act(cfg, {.max_chunk = 8});
    Sampler sampler(cfg.vocab_size, greedy());
    Tokens got;
    GenerationOptions opt;
    opt.max_new_tokens = 20;
    opt.use_cache = use_cache;
    const GenerationStats st = generate(model, cache, act, span_of(prompt), sampler, opt,
                                        [&](std::int32_t t) { got.push_back(t); });
    EXPECT_EQ(got, expected) << "use_cache " << use_cache;
    EXPECT_EQ(st.cached_tokens, 0u);
    EXPECT_EQ(st.prompt_tokens, 6u);
    EXPECT_EQ(st.prompt_tokens_decoded, 0u);
    EXPECT_EQ(st.generated_tokens, 20u);
    EXPECT_EQ(st.decode_steps(), 19u);
    EXPECT_FALSE(st.hit_stop_token);
    EXPECT_FALSE(st.hit_capacity);
    EXPECT_GE(st.ttft_ms, st.prefill_ms);
    EXPECT_EQ(cache.size(), 6u + 19u);  // the last token is never fed back
  }
}

// A cache already holding the first k prompt tokens, continued with the other ones, gives what
// one run over the whole prompt gives (f32: the prefill chunks differ, the argmax must not) and
// what the reference forward's argmax gives.
TEST(GenerateTest, ContinuesFromACachedPrefix) {
  const ModelConfig cfg = testing_util::small_config(4, 2, 48);
  const Model<float> model(random_weights<float>(cfg, 21));
  const Tokens prompt = testing_util::random_tokens(12, cfg.vocab_size, 22);
  const std::size_t n = 16;
  double margin = 0;
  const Tokens expected = reference_greedy(model.weights(), prompt, n, &margin);
  ASSERT_GT(margin, 1e-3);  // far above f32 rounding: chunking cannot flip a token
  const auto whole = run_greedy(model, {}, prompt, n);
  ASSERT_EQ(whole.tokens, expected);
  for (const std::size_t k : {1u, 5u, 8u, 11u}) {
    const Tokens prefix(prompt.begin(), prompt.begin() + static_cast<std::ptrdiff_t>(k));
    const Tokens rest(prompt.begin() + static_cast<std::ptrdiff_t>(k), prompt.end());
    const auto cont = run_greedy(model, prefix, rest, n);
    EXPECT_EQ(cont.tokens, whole.tokens) << "prefix of " << k;
    EXPECT_EQ(cont.stats.cached_tokens, k);
    EXPECT_EQ(cont.stats.prompt_tokens, 12u - k);
    EXPECT_EQ(cont.stats.generated_tokens, n);
    // The cache: the prefix, the rest of the prompt, every generated token but the last.
    EXPECT_EQ(cont.cache_tokens, concat(prompt, Tokens(expected.begin(), expected.end() - 1)));
  }
}

// on_prefilled runs once, with exactly the cached prefix and the prompt in the cache, before
// the first token is sampled.
TEST(GenerateTest, HookSeesTheCacheHoldingExactlyThePrompt) {
  const ModelConfig cfg = testing_util::small_config(4, 2, 40);
  const Model<double> model(random_weights<double>(cfg, 31));
  const Tokens prefix = testing_util::random_tokens(3, cfg.vocab_size, 32);
  const Tokens prompt = testing_util::random_tokens(5, cfg.vocab_size, 33);
  ContiguousStore<double> cache(cfg);
  Activations<double> act(cfg, {.max_chunk = 4});
  model.prefill(span_of(prefix), cache, act);
  Sampler sampler(cfg.vocab_size, greedy());
  GenerationOptions opt;
  opt.max_new_tokens = 6;
  std::vector<std::string> events;
  Tokens seen_by_hook;
  std::vector<double> hook_logits;
  generate(
      model, cache, act, span_of(prompt), sampler, opt,
      [&](std::int32_t) { events.push_back("token"); },
      [&] {
        events.push_back("prefilled");
        seen_by_hook.assign(cache.tokens().begin(), cache.tokens().end());
        hook_logits.assign(act.logits.data(), act.logits.data() + cfg.vocab_size);
      });
  EXPECT_EQ(seen_by_hook, concat(prefix, prompt));
  ASSERT_EQ(events.size(), 7u);
  EXPECT_EQ(events.front(), "prefilled");
  EXPECT_EQ(std::count(events.begin(), events.end(), "prefilled"), 1);
  // The logits the first token comes from are the last prompt token's over the whole sequence.
  const Tokens all = concat(prefix, prompt);
  const std::vector<double> ref = model.forward_reference(span_of(all));
  const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
  for (std::size_t v = 0; v < vocab; ++v)
    EXPECT_NEAR(hook_logits[v], ref[(all.size() - 1) * vocab + v], 1e-9) << "logit " << v;
}

// Model<float, bf16>: the tokens of the reference forward over the same rounded weights, from
// an empty cache and after a cached prefix. Its kernels also round every projection input to
// bf16, which moves the logits by ~0.03 here; the weights are drawn so that the
// reference's best logit leads the second by at least 0.25 at every step, so a different token
// is an error, not rounding. The first logits are checked within bf16's error as well.
TEST(GenerateTest, RunsBf16Weights) {
  const ModelConfig cfg = testing_util::small_config(4, 2, 40);
  const Model<float, bf16> model(convert_weights<bf16>(random_weights<float>(cfg, 53)));
  const Weights<float> rounded = convert_weights<float>(model.weights());
  const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
  const Tokens prompt = testing_util::random_tokens(7, cfg.vocab_size, 42);
  const std::size_t n = 12;
  double margin = 0;
  const Tokens expected = reference_greedy(rounded, prompt, n, &margin);
  ASSERT_GT(margin, 0.25);
  EXPECT_EQ(run_greedy(model, {}, prompt, n).tokens, expected);
  const Tokens prefix(prompt.begin(), prompt.begin() + 4);
  const Tokens rest(prompt.begin() + 4, prompt.end());
  EXPECT_EQ(run_greedy(model, prefix, rest, n).tokens, expected);

  ContiguousStore<float> cache(cfg);
  Activations<float> act(cfg, {.max_chunk = 8});
  Sampler sampler(cfg.vocab_size, greedy());
  GenerationOptions opt;
  opt.max_new_tokens = 1;
  std::vector<float> first;
  generate(
      model, cache, act, span_of(prompt), sampler, opt, [](std::int32_t) {},
      [&] { first.assign(act.logits.data(), act.logits.data() + vocab); });
  const std::vector<float> ref = forward_reference(rounded, span_of(prompt));
  double err = 0, norm = 0;
  for (std::size_t v = 0; v < vocab; ++v) {
    const double r = ref[(prompt.size() - 1) * vocab + v];
    err += (first[v] - r) * (first[v] - r);
    norm += r * r;
  }
  // Normalised error within threads_test's first-order bound: each of the M = 7 n_layers + 1
  // matrices rounds its weights and inputs to bf16 (2u relative, u = 2^-8).
  const double m = 7.0 * static_cast<double>(cfg.n_layers) + 1;
  EXPECT_LT(std::sqrt(err / norm), m * 2 * 0x1p-8);
}

// Without a cache, every step recomputes the cached prefix too: the cached mode's tokens, and
// the store ends holding the whole sequence.
TEST(GenerateTest, NoCacheAfterACachedPrefixGivesTheCachedTokens) {
  const ModelConfig cfg = testing_util::small_config(4, 2, 40);
  const Model<double> model(random_weights<double>(cfg, 51));
  const Tokens prefix = testing_util::random_tokens(6, cfg.vocab_size, 52);
  const Tokens prompt = testing_util::random_tokens(3, cfg.vocab_size, 53);
  const auto cached = run_greedy(model, prefix, prompt, 14, true);
  const auto uncached = run_greedy(model, prefix, prompt, 14, false);
  EXPECT_EQ(cached.tokens, reference_greedy(model.weights(), concat(prefix, prompt), 14));
  EXPECT_EQ(uncached.tokens, cached.tokens);
  EXPECT_EQ(uncached.cache_tokens, cached.cache_tokens);
  EXPECT_EQ(uncached.stats.cached_tokens, 6u);
}

// The streaming policy's kept tokens for query q: the sinks seen so far, then q's W newest
// (StreamingLLM). With one layer a token's K/V depend only on the token and its RoPE slot, so
// the logits of q equal a fresh forward over the kept tokens.
Tokens kept(const Tokens& t, std::size_t q, std::size_t S, std::size_t W) {
  const std::size_t sinks = std::min(S, q + 1);
  Tokens k(t.begin(), t.begin() + static_cast<std::ptrdiff_t>(sinks));
  for (std::size_t i = std::max(S, q + 1 - std::min(q + 1, W)); i <= q; ++i) k.push_back(t[i]);
  return k;
}

// A prompt of 40 tokens into a streaming window of S + W = 14: one append of 40 is refused, so
// generate() prefills 14 and decodes the other 26; every step's logits (the prompt's last
// first) equal the reference over the kept tokens.
TEST(GenerateTest, StreamingWindowTakesAPromptLongerThanItsWindow) {
  ModelConfig cfg = testing_util::small_config(4, 2, 32);
  cfg.n_layers = 1;
  const Model<float> model(random_weights<float>(cfg, 61));
  const std::size_t S = 4, W = 10, n_prompt = 40, n = 30;
  const Tokens prompt = testing_util::random_tokens(n_prompt, cfg.vocab_size, 62);
  const WindowOptions wo{.window = W,
                         .sinks = S,
                         .policy = WindowPolicy::kStreaming,
                         .max_chunk = 8,
                         .capacity = n_prompt + n};
  {
    WindowStore<float> s(cfg, wo);
    Activations<float> act(cfg, {.max_chunk = 8, .store_scratch = s.block_scratch_size()});
    EXPECT_THROW(model.prefill(span_of(prompt), s, act), Error);  // why the loop must split
  }
  WindowStore<float> cache(cfg, wo);
  Activations<float> act(cfg, {.max_chunk = 8, .store_scratch = cache.block_scratch_size()});
  Sampler sampler(cfg.vocab_size, greedy());
  GenerationOptions opt;
  opt.max_new_tokens = n;
  const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
  Tokens seq = prompt;  // the prompt and the tokens generated so far
  std::size_t checked = 0;
  // Compares the logits the next token is sampled from with the reference over seq's kept tokens.
  const auto check_logits = [&](const char* what) {
    const Tokens k = kept(seq, seq.size() - 1, S, W);
    const std::vector<float> ref = forward_reference(model.weights(), span_of(k));
    for (std::size_t v = 0; v < vocab; ++v) {
      const double r = ref[(k.size() - 1) * vocab + v];
      ASSERT_NEAR(act.logits[v], r, 2e-5 * (1 + std::abs(r)))
          << what << " after " << seq.size() << " tokens, logit " << v;
    }
    ++checked;
  };
  bool hooked = false;
  const GenerationStats st = generate(
      model, cache, act, span_of(prompt), sampler, opt,
      [&](std::int32_t t) {
        if (seq.size() > n_prompt) check_logits("decode");
        seq.push_back(t);
      },
      [&] {
        hooked = true;
        EXPECT_EQ(cache.size(), n_prompt);
        check_logits("prompt");
      });
  EXPECT_TRUE(hooked);
  EXPECT_EQ(checked, n);  // the prompt's logits, then one per decode step
  EXPECT_EQ(st.generated_tokens, n);
  EXPECT_EQ(st.prompt_tokens, n_prompt);
  EXPECT_EQ(st.prompt_tokens_decoded, n_prompt - (S + W));
  EXPECT_EQ(cache.size(), n_prompt + n - 1);
  EXPECT_FALSE(st.hit_capacity);
}

// The repetition penalty sees the latest repeat_last_n tokens (the cached prefix, the prompt and
// what was generated): the same tokens as a greedy loop over the reference forward whose
// logits are penalised here with the formula (l / p if l > 0, else l × p) over the last 3.
TEST(GenerateTest, RepetitionPenaltyCoversTheLatestTokens) {
  const ModelConfig cfg = testing_util::small_config(4, 2, 64);
  const Model<double> model(random_weights<double>(cfg, 61));
  const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
  const Tokens prefix = {1, 7, 7}, prompt = {9, 7};
  constexpr double kPenalty = 3.0;
  constexpr std::size_t kLastN = 3, kN = 12;
  Tokens seq = concat(prefix, prompt), expected;
  for (std::size_t i = 0; i < kN; ++i) {
    const std::vector<double> logits = forward_reference(model.weights(), span_of(seq));
    std::vector<double> l(logits.end() - static_cast<std::ptrdiff_t>(vocab), logits.end());
    std::vector<bool> done(vocab, false);
    for (std::size_t k = seq.size() - kLastN; k < seq.size(); ++k) {
      const auto t = static_cast<std::size_t>(seq[k]);
      if (done[t]) continue;
      done[t] = true;
      l[t] = l[t] > 0 ? l[t] / kPenalty : l[t] * kPenalty;
    }
    const auto best = static_cast<std::int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
    expected.push_back(best);
    seq.push_back(best);
  }
  ContiguousStore<double> cache(cfg);
  Activations<double> act(cfg, {.max_chunk = 8});
  model.prefill(span_of(prefix), cache, act);
  SamplerOptions o = greedy();
  o.repeat_penalty = kPenalty;
  o.repeat_last_n = kLastN;
  Sampler sampler(cfg.vocab_size, o);
  GenerationOptions opt;
  opt.max_new_tokens = kN;
  Tokens got;
  generate(model, cache, act, span_of(prompt), sampler, opt,
           [&](std::int32_t t) { got.push_back(t); });
  EXPECT_EQ(got, expected);
  // Without the penalty the greedy continuation differs (the test can fail).
  EXPECT_NE(reference_greedy(model.weights(), concat(prefix, prompt), kN), expected);
}

TEST(GenerateTest, StopsAtStopTokenCallbackAndCapacity) {
  const ModelConfig cfg = testing_util::small_config(4, 2, 12);
  const Model<double> model(random_weights<double>(cfg, 13));
  const auto prompt = testing_util::random_tokens(4, cfg.vocab_size, 4);
  const auto greedy_tokens = reference_greedy(model.weights(), prompt, 8);
  const auto run = [&](GenerationOptions opt, std::size_t stop_after) {
    ContiguousStore<double> cache(cfg);
    Activations<double> act(cfg, {.max_chunk = 4});
    Sampler sampler(cfg.vocab_size, greedy());
    Tokens got;
    const auto st = generate(model, cache, act, span_of(prompt), sampler, opt, [&](std::int32_t t) {
      got.push_back(t);
      return got.size() < stop_after;
    });
    return std::pair{st, got};
  };
  GenerationOptions opt;
  opt.max_new_tokens = 100;
  opt.stop_token = greedy_tokens[2];
  auto [st, got] = run(opt, 100);
  EXPECT_TRUE(st.hit_stop_token);
  EXPECT_EQ(got.back(), greedy_tokens[2]);
  EXPECT_LE(got.size(), 3u);  // stops at the first occurrence of the stop token

  // Any token of stop_tokens ends it too, at the first occurrence of either.
  opt.stop_token = -1;
  opt.stop_tokens = {greedy_tokens[6], greedy_tokens[4]};
  std::tie(st, got) = run(opt, 100);
  const auto first_stop = std::find_if(greedy_tokens.begin(), greedy_tokens.end(), [&](auto t) {
    return t == greedy_tokens[4] || t == greedy_tokens[6];
  });
  EXPECT_TRUE(st.hit_stop_token);
  EXPECT_EQ(got, Tokens(greedy_tokens.begin(), first_stop + 1));
  opt.stop_tokens.clear();

  std::tie(st, got) = run(opt, 3);
  EXPECT_EQ(got.size(), 3u);
  EXPECT_EQ(Tokens(greedy_tokens.begin(), greedy_tokens.begin() + 3), got);

  std::tie(st, got) = run(opt, 100);  // no stop token: on past every token to the full cache
  EXPECT_TRUE(st.hit_capacity);
  EXPECT_EQ(got.size(), 12u - 4u + 1u);  // capacity 12: 8 decodes after the 4-token prompt
  EXPECT_EQ(greedy_tokens, Tokens(got.begin(), got.begin() + 8));

  opt.max_new_tokens = 5;
  std::tie(st, got) = run(opt, 100);
  EXPECT_EQ(got.size(), 5u);
  EXPECT_FALSE(st.hit_capacity);
}

// An empty prompt, or one longer than the room the cache has left, is refused before anything
// changes.
TEST(GenerateTest, RejectsEmptyPromptAndAPromptPastTheRoomLeft) {
  const ModelConfig cfg = testing_util::small_config(4, 2, 10);
  const Model<float> model(random_weights<float>(cfg, 1));
  ContiguousStore<float> cache(cfg);
  Activations<float> act(cfg, {.max_chunk = 1});
  Sampler sampler(cfg.vocab_size, SamplerOptions{});
  const Tokens none;
  EXPECT_THROW(generate(model, cache, act, span_of(none), sampler, {}, [](std::int32_t) {}), Error);
  model.decode(1, cache, act);
  model.decode(2, cache, act);
  const Tokens nine(9, 3);
  bool called = false;
  EXPECT_THAT(
      [&] {
        generate(
            model, cache, act, span_of(nine), sampler, {}, [&](std::int32_t) { called = true; },
            [&] { called = true; });
      },
      ::testing::ThrowsMessage<Error>(::testing::HasSubstr(
          "the prompt has 9 tokens but the cache, holding 2 of at most 10 positions, has room "
          "for 8")));
  EXPECT_FALSE(called);
  EXPECT_EQ(cache.size(), 2u);
  EXPECT_EQ(cache.tokens()[1], 2);
}

}  // namespace
}  // namespace kvdecode
