// The serving engine alone (serving/engine.hpp, no HTTP), on the bundled model
// (models/kjv_tiny.bin) with the load benchmark's workload (tools/load_bench.py): 32 requests
// of a shared 256-token system prompt (BOS included, already in the prefix cache) and a
// 13-token question each, 64 tokens sampled at temperature 0.8, top-p 0.9, a seed per request.
//   BM_EngineInterleaved  a batched engine (16 sequences a step) and a one-at-a-time engine
//                         (one) run the workload in turns: the median of each one's generated
//                         tokens/s and of the turns' ratio, batched / one at a time (the
//                         serving issue's 3× target without the HTTP side).
// Each engine's 32 outputs are checked against the other's (a request's tokens are its own
// whatever runs beside it) before anything is timed.
// Before any Eigen include: GCC 12's false -Wmaybe-uninitialized (see bench_model.hpp).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "in_turns.hpp"
#include "kvdecode/kvdecode.hpp"

namespace {

using namespace kvdecode;

constexpr std::size_t kRequests = 32;
constexpr std::size_t kSystemTokens = 256;
constexpr std::size_t kQuestionTokens = 13;
constexpr std::size_t kGenerated = 64;

const Model<float>& bundled_model() {
  static const Model<float> model(
      load_model<float>(std::string(KVDECODE_MODEL_DIR) + "/kjv_tiny.bin").weights);
  return model;
}

/// The workload's prompts: one random system prompt, then a random question per request.
std::vector<std::vector<std::int32_t>> workload_prompts(std::int64_t vocab) {
  detail::SplitMix64 rng(2026);
  const auto ids = static_cast<std::uint64_t>(vocab - 3);  // 0-2 are <unk>, BOS, EOS
  const auto token = [&] { return static_cast<std::int32_t>(3 + rng.next() % ids); };
  std::vector<std::int32_t> system{1};  // BOS
  while (system.size() < kSystemTokens) system.push_back(token());
  std::vector<std::vector<std::int32_t>> prompts(kRequests, system);
  for (auto& p : prompts)
    for (std::size_t i = 0; i < kQuestionTokens; ++i) p.push_back(token());
  return prompts;
}

/// An engine with the system prompt in its prefix cache.
struct EngineSetup {
  Engine<float> engine;
  EngineSetup(const Model<float>& model, std::size_t max_running, ThreadPool* pool,
              const std::vector<std::int32_t>& system)
      : engine(model, {.n_blocks = 2048,
                       .block_size = 16,
                       .max_running = max_running,
                       .step_tokens = 256,
                       .thread_pool = pool}) {
    std::vector<std::int32_t> warm = system;
    warm.push_back(system[1]);
    run({RequestOptions{.prompt = warm, .max_tokens = 1}});
  }
  /// Submits every request at once and steps until all have finished; their tokens.
  std::vector<std::vector<std::int32_t>> run(std::vector<RequestOptions> requests) {
    std::vector<std::shared_ptr<RequestStream>> streams;
    for (RequestOptions& r : requests) streams.push_back(engine.submit(std::move(r)));
    for (bool busy = true; busy;) {
      engine.step();
      busy =
          std::any_of(streams.begin(), streams.end(), [](const auto& s) { return !s->finished(); });
    }
    std::vector<std::vector<std::int32_t>> out;
    for (const auto& s : streams) out.push_back(s->tokens());
    return out;
  }
};

std::vector<RequestOptions> workload(const std::vector<std::vector<std::int32_t>>& prompts) {
  std::vector<RequestOptions> requests;
  for (std::size_t i = 0; i < prompts.size(); ++i)
    requests.push_back({.prompt = prompts[i],
                        .sampling = {.temperature = 0.8, .top_p = 0.9, .seed = 100 + i},
                        .max_tokens = kGenerated});
  return requests;
}

void BM_EngineInterleaved(benchmark::State& state) {
  const auto n_threads = static_cast<std::size_t>(state.range(0));
  const Model<float>& model = bundled_model();
  const auto prompts = workload_prompts(model.config().vocab_size);
  ThreadPool threads(n_threads);
  ThreadPool* const pool = n_threads > 1 ? &threads : nullptr;
  EngineSetup batched(model, 16, pool, prompts[0]);
  EngineSetup one(model, 1, pool, prompts[0]);
  if (batched.run(workload(prompts)) != one.run(workload(prompts))) {
    state.SkipWithError("a request's tokens differ between the batched and the lone engine");
    return;
  }
  const auto timed = [&](EngineSetup& s) {  // generated tokens/s
    const auto t0 = std::chrono::steady_clock::now();
    const auto out = s.run(workload(prompts));
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::size_t tokens = 0;
    for (const auto& o : out) tokens += o.size();
    return static_cast<double>(tokens) / seconds;
  };
  bench::in_turns(
      state, "one_tok_s", [&] { return timed(one); }, "batched_tok_s",
      [&] { return timed(batched); }, "batched/one",
      [](double lone, double batch) { return batch / lone; });
}
BENCHMARK(BM_EngineInterleaved)
    ->ArgName("threads")
    ->Arg(1)
    ->Arg(2)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
