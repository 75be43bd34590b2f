// BM_SpeculativeKjv: plain greedy generate() against generate() with prompt lookup
// (GenerationOptions::speculation) on the bundled KJV model, a prompt that quotes a passage, 1
// and 2 threads; each iteration runs both and checks they emit the same tokens. Counters: decode
// tokens/s of each, their ratio (speedup), acceptance rate and tokens per target pass.
// BM_SpeculativeBreakEven: a target and a draft model of llama2.c's stories110M and stories15M
// shapes with random weights (random_weights, seeds 1 and 2; tiny shapes in a smoke run): the
// decode step, verify pass and draft step times, the acceptance rate at which speculation breaks
// even and the one measured.

// Before any Eigen include: GCC 12's false -Wmaybe-uninitialized and -Wuninitialized in its
// own avx512fintrin.h (see bench_model.hpp).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <benchmark/benchmark.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <span>
#include <vector>

#include "kvdecode/kvdecode.hpp"

namespace {

using namespace kvdecode;

const std::filesystem::path kModels =
    std::filesystem::path(KVDECODE_TEST_DATA_DIR) / ".." / ".." / "models";

/// Genesis 1:1-5, then its first verse again: the continuation quotes the passage.
constexpr const char* kPassage =
    "In the beginning God created the heaven and the earth. And the earth was without form, and "
    "void; and darkness was upon the face of the deep. And the Spirit of God moved upon the face "
    "of the waters. And God said, Let there be light: and there was light. And God saw the "
    "light, that it was good: and God divided the light from the darkness. And God called the "
    "light Day, and the darkness he called Night. And the evening and the morning were the first "
    "day.\nIn the beginning God created the heaven and the earth. And the earth was";

bool smoke() {
  const char* v = std::getenv("KVDECODE_BENCH_SMOKE");
  return v != nullptr && *v != '\0' && *v != '0';
}

double ms_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

void BM_SpeculativeKjv(benchmark::State& state) {
  const auto threads = static_cast<std::size_t>(state.range(0));
  const auto max_draft = static_cast<std::size_t>(state.range(1));
  const Model<float> model(load_checkpoint(kModels / "kjv_tiny.bin"));
  const ModelConfig& cfg = model.config();
  const Tokenizer tok = Tokenizer::load(kModels / "tokenizer.bin", cfg.vocab_size);
  const std::vector<std::int32_t> prompt = tok.encode(kPassage);
  const std::size_t room = static_cast<std::size_t>(cfg.seq_len) - prompt.size();
  const std::size_t n_new = std::min<std::size_t>(smoke() ? 16 : 128, room);
  std::unique_ptr<ThreadPool> pool = threads > 1 ? std::make_unique<ThreadPool>(threads) : nullptr;
  ContiguousStore<float> cache(cfg);
  Activations<float> act(cfg, {.max_chunk = 16, .thread_pool = pool.get()});
  const SamplerOptions greedy{.temperature = 0};
  const GenerationOptions options{.max_new_tokens = n_new};
  const GenerationOptions speculative{.max_new_tokens = n_new,
                                      .speculation = Speculation::prompt_lookup(max_draft)};
  double plain_ms = 0, spec_ms = 0;
  std::size_t decode_steps = 0;
  GenerationStats last;
  for (auto _ : state) {
    std::vector<std::int32_t> plain, spec;
    cache.reset();
    Sampler sampler(cfg.vocab_size, greedy);
    const GenerationStats ps = generate(model, cache, act, prompt, sampler, options,
                                        [&](std::int32_t t) { plain.push_back(t); });
    cache.reset();
    last = generate(model, cache, act, prompt, sampler, speculative,
                    [&](std::int32_t t) { spec.push_back(t); });
    if (spec != plain) state.SkipWithError("speculative output differs from plain greedy");
    plain_ms += ps.decode_ms;
    spec_ms += last.decode_ms;
    decode_steps += ps.decode_steps();
  }
  const double plain_tps = 1e3 * static_cast<double>(decode_steps) / plain_ms;
  const double spec_tps = 1e3 * static_cast<double>(decode_steps) / spec_ms;
  state.SetItemsProcessed(static_cast<std::int64_t>(decode_steps));
  state.counters["plain_tok_s"] = plain_tps;
  state.counters["spec_tok_s"] = spec_tps;
  state.counters["speedup"] = spec_tps / plain_tps;
  state.counters["acceptance"] = last.acceptance_rate();
  state.counters["tok_per_pass"] = last.tokens_per_pass();
  state.counters["prompt_tokens"] = static_cast<double>(prompt.size());
}
BENCHMARK(BM_SpeculativeKjv)
    ->ArgNames({"threads", "k"})
    ->Args({1, 4})
    ->Args({1, 8})
    ->Args({2, 4})
    ->Args({2, 8})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

/// Expected tokens a pass emits when each proposal is kept with probability a independently:
/// 1 + a + ... + a^k.
double tokens_per_pass(double a, std::size_t k) {
  double s = 0, p = 1;
  for (std::size_t i = 0; i <= k; ++i, p *= a) s += p;
  return s;
}

/// llama2.c's stories110M and stories15M shapes (vocabulary 32000), or tiny ones in a smoke run.
ModelConfig llama2c_shape(bool large) {
  ModelConfig c;
  if (smoke()) {
    c.dim = large ? 64 : 32;
    c.hidden_dim = large ? 172 : 96;
    c.n_layers = 2;
    c.n_heads = c.n_kv_heads = 4;
    c.vocab_size = 512;
    c.seq_len = 128;
    return c;
  }
  c.dim = large ? 768 : 288;
  c.hidden_dim = large ? 2048 : 768;
  c.n_layers = large ? 12 : 6;
  c.n_heads = c.n_kv_heads = large ? 12 : 6;
  c.vocab_size = 32000;
  c.seq_len = large ? 1024 : 256;
  return c;
}

void BM_SpeculativeBreakEven(benchmark::State& state) {
  const auto threads = static_cast<std::size_t>(state.range(0));
  const auto k = static_cast<std::size_t>(state.range(1));
  // Built once for every argument pair (110M random weights take seconds to draw).
  static const Model<float> target(random_weights<float>(llama2c_shape(true), 1));
  static const Model<float> draft(random_weights<float>(llama2c_shape(false), 2));
  const ModelConfig& cfg = target.config();
  std::unique_ptr<ThreadPool> pool = threads > 1 ? std::make_unique<ThreadPool>(threads) : nullptr;
  ContiguousStore<float> cache(cfg), draft_cache(draft.config());
  Activations<float> act(cfg, {.max_chunk = 16, .thread_pool = pool.get()}),
      draft_act(draft.config(), {.max_chunk = 16, .thread_pool = pool.get()});
  std::vector<std::int32_t> prompt(32);
  for (std::size_t i = 0; i < prompt.size(); ++i)
    prompt[i] =
        static_cast<std::int32_t>((i * 7919 + 1) % static_cast<std::size_t>(cfg.vocab_size));
  std::vector<std::int32_t> pass(k + 1, 5);
  std::vector<float> all((k + 1) * static_cast<std::size_t>(cfg.vocab_size));
  const int reps = 8;
  double decode_ms = 0, verify_ms = 0, draft_ms = 0;
  GenerationStats stats;
  for (auto _ : state) {
    cache.reset();
    target.prefill(prompt, cache, act);
    auto t = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r) target.decode(5, cache, act);
    decode_ms = ms_since(t) / reps;
    cache.truncate(prompt.size());
    t = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r) {
      target.prefill(pass, cache, act, std::span<float>(all));
      cache.truncate(prompt.size());
    }
    verify_ms = ms_since(t) / reps;
    draft_cache.reset();
    draft.prefill(prompt, draft_cache, draft_act);
    t = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r) draft.decode(5, draft_cache, draft_act);
    draft_ms = ms_since(t) / reps;
    // The acceptance rate the random draft reaches on the random target, greedy.
    cache.reset();
    draft_cache.reset();
    DraftModelDrafter<float, float, ContiguousStore<float>> drafter(draft, draft_cache, draft_act,
                                                                    k);
    Sampler greedy(cfg.vocab_size, {.temperature = 0});
    stats = generate(target, cache, act, prompt, greedy,
                     {.max_new_tokens = 32, .speculation = Speculation::with_drafter(drafter, k)},
                     [](std::int32_t) {});
  }
  // A pass costs one verify and k draft steps; plain decoding emits 1 token per decode step.
  const double pass_cost = (verify_ms + static_cast<double>(k) * draft_ms) / decode_ms;
  double lo = 0, hi = 1;  // tokens_per_pass(a, k) = pass_cost, by bisection
  for (int i = 0; i < 60; ++i) {
    const double mid = 0.5 * (lo + hi);
    (tokens_per_pass(mid, k) < pass_cost ? lo : hi) = mid;
  }
  state.counters["decode_ms"] = decode_ms;
  state.counters["verify_ms"] = verify_ms;
  state.counters["draft_ms"] = draft_ms;
  state.counters["pass_cost_steps"] = pass_cost;
  state.counters["break_even_acceptance"] = pass_cost > static_cast<double>(k + 1) ? 1.0 : lo;
  state.counters["measured_acceptance"] = stats.acceptance_rate();
  state.counters["measured_tok_per_pass"] = stats.tokens_per_pass();
}

BENCHMARK(BM_SpeculativeBreakEven)
    ->ArgNames({"threads", "k"})
    ->Args({1, 4})
    ->Args({2, 4})
    ->Args({2, 8})
    ->Unit(benchmark::kMillisecond)
    ->Iterations(1);

}  // namespace

BENCHMARK_MAIN();
