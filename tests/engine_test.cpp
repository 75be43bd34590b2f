// Engine: every request's tokens equal a run of that request alone through generate() on a
// ContiguousStore (the oracle: another store, no batching, no chunking, no preemption), under
// random arrivals, lengths and shared prefixes on a pool small enough to preempt; sampled runs
// too (the per-request seeded sampler); cancellation frees blocks; submissions from several
// threads; exact prefilled-vs-reused counts for a shared prefix and a second turn; chunked
// prefill does not stall decoding; bad requests throw and change nothing; a decode step
// allocates nothing.
// EIGEN_RUNTIME_NO_MALLOC: defined for every test by tests/CMakeLists.txt.
#include "kvdecode/serving/engine.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "counting_new.hpp"
#include "engine_oracle.hpp"
#include "kvdecode/kvdecode.hpp"
#include "test_util.hpp"

namespace kvdecode::testing_util {
namespace {

using Tokens = std::vector<std::int32_t>;

template <class T, class W>
void run_to_completion(Engine<T, W>& engine) {
  for (int i = 0; i < 100000 && engine.step(); ++i) {
  }
}

ModelConfig engine_config() { return small_config(4, 2, 96); }

struct Planned {
  std::size_t arrival_step = 0;
  RequestOptions options;
  std::int32_t stop_token = -1;
  std::shared_ptr<RequestStream> stream;
};

/// Requests arriving at random steps, prompts built from one of three shared prefixes (or none)
/// plus a random tail, random max_tokens; some greedy, some sampled with their own seed.
std::vector<Planned> random_requests(std::size_t n, std::uint64_t seed, std::int64_t vocab,
                                     bool sampled) {
  detail::SplitMix64 rng(seed);
  const std::vector<Tokens> prefixes = {random_tokens(20, vocab, seed + 1),
                                        random_tokens(9, vocab, seed + 2),
                                        random_tokens(33, vocab, seed + 3)};
  std::vector<Planned> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    Planned& p = out[i];
    p.arrival_step = rng.next() % 40;
    const std::size_t which = rng.next() % 4;
    Tokens prompt = which < 3 ? prefixes[which] : Tokens{};
    const Tokens tail = random_tokens(1 + rng.next() % 12, vocab, seed * 100 + i);
    prompt.insert(prompt.end(), tail.begin(), tail.end());
    p.options.prompt = prompt;
    p.options.max_tokens = 1 + rng.next() % 30;
    if (sampled && i % 2 == 1) p.options.sampling = SamplerOptions{0.9, 0.95, 0, 1000 + i};
    if (i % 5 == 4) {  // some stop early at a token they are likely to emit
      p.stop_token = static_cast<std::int32_t>(rng.next() % static_cast<std::uint64_t>(vocab));
      p.options.stop_tokens = {p.stop_token};
    }
  }
  return out;
}

template <class T, class W>
void expect_random_arrivals_match_alone(const Model<T, W>& model, std::uint64_t seed,
                                        bool sampled) {
  const ModelConfig& cfg = model.config();
  // 20 blocks of 4: one request needs at most ceil((45 + 29) / 4) = 19, several at once run
  // out mid-generation.
  Engine<T, W> engine(model,
                      {.n_blocks = 20, .block_size = 4, .max_running = 6, .step_tokens = 16});
  std::vector<Planned> requests = random_requests(24, seed, cfg.vocab_size, sampled);
  for (std::size_t step = 0; step < 100000; ++step) {
    for (Planned& p : requests)
      if (p.arrival_step == step) p.stream = engine.submit(p.options);
    const bool busy = engine.step();
    engine.pool().check_invariants();
    if (!busy && step > 40) break;
  }
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const Planned& p = requests[i];
    ASSERT_TRUE(p.stream->finished()) << "request " << i;
    const Tokens want =
        alone(model, p.options.prompt, p.options.sampling, p.options.max_tokens, p.stop_token);
    EXPECT_EQ(p.stream->tokens(), want)
        << "seed " << seed << " request " << i << " (prompt " << p.options.prompt.size()
        << ", max_tokens " << p.options.max_tokens << ", preempted "
        << p.stream->usage().preemptions << " times)";
  }
  const EngineMetrics m = engine.metrics();
  EXPECT_GT(m.preemptions, 0u) << "the pool was meant to run out";
  EXPECT_GT(m.tokens_reused, 0u) << "the shared prefixes were meant to be reused";
  EXPECT_EQ(m.finished, requests.size());
  EXPECT_EQ(engine.pool().n_held(), 0u);
}

// A reader sleeps on its stream's own condition variable until the first token (a queued
// request waits many passes, which should not wake it) and on the engine's ReaderSignal after
// it: the first push wakes it alone, a later one once the pass wakes all readers, and a finish
// in either phase. A missing wake-up leaves the reader asleep until its deadline, 10 s here,
// where it finds the token all the same; so each wait must end in well under that (the writer
// acts after 20 ms).
TEST(RequestStreamTest, ReadersWakeOnTheFirstTokenThenOncePerPass) {
  using namespace std::chrono_literals;
  using Clock = std::chrono::steady_clock;
  auto readers = std::make_shared<detail::ReaderSignal>();
  RequestStream stream(1, 4, std::make_shared<detail::WakeSignal>(), readers);
  std::int32_t token = -1;
  // The wait of `reader` for what `writer` does 20 ms after it starts, and whether it was woken
  // (returned in less than half of its 10 s).
  const auto woken = [](RequestStream& reader, std::int32_t& t, auto writer) {
    std::jthread engine([&] {
      std::this_thread::sleep_for(20ms);
      writer();
    });
    const Clock::time_point start = Clock::now();
    const RequestStream::Wait w = reader.next_for(t, 10s);
    return std::pair{w, Clock::now() - start < 5s};
  };
  EXPECT_EQ(stream.next_for(token, 1ms), RequestStream::Wait::kTimeout);
  EXPECT_EQ(woken(stream, token, [&] { stream.push(7, {}); }),
            std::pair(RequestStream::Wait::kToken, true));
  EXPECT_EQ(token, 7);
  EXPECT_EQ(woken(stream, token,
                  [&] {
                    stream.push(8, {});
                    stream.push(9, {});
                    readers->wake_all();
                  }),
            std::pair(RequestStream::Wait::kToken, true));
  EXPECT_EQ(token, 8);
  ASSERT_EQ(stream.next_for(token, 0ms), RequestStream::Wait::kToken);
  EXPECT_EQ(token, 9);
  EXPECT_EQ(woken(stream, token, [&] { stream.finish(FinishReason::kMaxTokens, {}); }),
            std::pair(RequestStream::Wait::kFinished, true));
  EXPECT_TRUE(stream.wait_for(0ms));
  // A request finished before its first token wakes its reader too.
  RequestStream queued(2, 4, std::make_shared<detail::WakeSignal>(), readers);
  EXPECT_EQ(woken(queued, token, [&] { queued.finish(FinishReason::kCancelled, {}); }),
            std::pair(RequestStream::Wait::kFinished, true));
}

TEST(EngineTest, RandomArrivalsMatchEachRequestAloneGreedy) {
  const Model<double> model(random_weights<double>(engine_config(), 77));
  for (std::uint64_t seed : {1, 2, 3}) expect_random_arrivals_match_alone(model, seed, false);
}

TEST(EngineTest, RandomArrivalsMatchEachRequestAloneSampled) {
  const Model<double> model(random_weights<double>(engine_config(), 77));
  for (std::uint64_t seed : {4, 5}) expect_random_arrivals_match_alone(model, seed, true);
}

// The same in f32 with weights in each format a model file or the server's --weights gives:
// bf16, and ggml's q8_0 and q4_0 blocks (integer dot products), against the request alone on
// the same weights.
TEST(EngineTest, RandomArrivalsMatchEachRequestAloneOnEveryWeightFormat) {
  const Weights<float> f32 = random_weights<float>(engine_config(), 78);
  expect_random_arrivals_match_alone(Model<float>(random_weights<float>(engine_config(), 78)), 6,
                                     true);
  expect_random_arrivals_match_alone(Model<float, bf16>(convert_weights<bf16>(f32)), 7, true);
  expect_random_arrivals_match_alone(Model<float, Q8_0>(quantize_weights<Q8_0>(f32)), 8, true);
  expect_random_arrivals_match_alone(Model<float, Q4_0>(quantize_weights<Q4_0>(f32)), 9, true);
}

TEST(EngineTest, PreemptedRequestResumesWithNothingLost) {
  const ModelConfig cfg = engine_config();
  const Model<double> model(random_weights<double>(cfg, 5));
  // Two requests of 10-token prompts and 40 tokens each need 13 blocks of 4 apiece at the end;
  // the pool has 16, so the newer one is preempted while the older one finishes.
  Engine<double> engine(model,
                        {.n_blocks = 16, .block_size = 4, .max_running = 2, .step_tokens = 8});
  RequestOptions a{.prompt = random_tokens(10, cfg.vocab_size, 1), .max_tokens = 40};
  RequestOptions b{.prompt = random_tokens(10, cfg.vocab_size, 2),
                   .sampling = SamplerOptions{1.0, 0.9, 0, 99},
                   .max_tokens = 40};
  const auto sa = engine.submit(a);
  const auto sb = engine.submit(b);
  run_to_completion(engine);
  EXPECT_EQ(sa->usage().preemptions, 0u);
  EXPECT_GE(sb->usage().preemptions, 1u);
  EXPECT_GT(sb->usage().recomputed_tokens, 0u);
  EXPECT_EQ(sa->tokens(), alone(model, a.prompt, a.sampling, 40));
  EXPECT_EQ(sb->tokens(), alone(model, b.prompt, b.sampling, 40));
  EXPECT_EQ(sb->finish_reason(), FinishReason::kMaxTokens);
  EXPECT_EQ(engine.metrics().preemptions, sb->usage().preemptions);
}

TEST(EngineTest, CancellationFreesBlocks) {
  const ModelConfig cfg = engine_config();
  const Model<double> model(random_weights<double>(cfg, 9));
  Engine<double> engine(model, {.n_blocks = 32, .block_size = 4, .prefix_cache = false});
  const auto s = engine.submit({.prompt = random_tokens(30, cfg.vocab_size, 3), .max_tokens = 50});
  const auto waiting =
      engine.submit({.prompt = random_tokens(5, cfg.vocab_size, 4), .max_tokens = 50});
  for (int i = 0; i < 5; ++i) engine.step();
  EXPECT_GE(engine.pool().n_held(), 30u / 4);
  EXPECT_FALSE(s->finished());
  const std::size_t got = s->tokens().size();
  s->cancel();
  waiting->cancel();
  EXPECT_FALSE(engine.step());
  EXPECT_EQ(engine.pool().n_held(), 0u);
  EXPECT_EQ(engine.pool().n_free(), 32u);  // no prefix cache: everything back on the free list
  EXPECT_EQ(s->finish_reason(), FinishReason::kCancelled);
  EXPECT_EQ(waiting->finish_reason(), FinishReason::kCancelled);
  EXPECT_EQ(s->tokens().size(), got);
  const EngineMetrics m = engine.metrics();
  EXPECT_EQ(m.cancelled, 2u);
  EXPECT_EQ(m.running, 0u);
  EXPECT_EQ(m.blocks_held, 0u);
}

TEST(EngineTest, AStopFromTheCallerFinishesTheRequestAndFreesBlocks) {
  const ModelConfig cfg = engine_config();
  const Model<double> model(random_weights<double>(cfg, 9));
  Engine<double> engine(model, {.n_blocks = 32, .block_size = 4, .prefix_cache = false});
  const auto s = engine.submit({.prompt = random_tokens(30, cfg.vocab_size, 3), .max_tokens = 50});
  const auto c = engine.submit({.prompt = random_tokens(5, cfg.vocab_size, 4), .max_tokens = 50});
  for (int i = 0; i < 5; ++i) engine.step();
  const std::size_t got = s->tokens().size();
  s->stop();  // e.g. a stop string the caller found in the text
  c->cancel();
  EXPECT_FALSE(engine.step());
  EXPECT_EQ(engine.pool().n_held(), 0u);
  EXPECT_EQ(s->finish_reason(), FinishReason::kStopString);
  EXPECT_EQ(c->finish_reason(), FinishReason::kCancelled);
  EXPECT_EQ(s->tokens().size(), got);
  const EngineMetrics m = engine.metrics();
  EXPECT_EQ(m.finished, 1u);  // a stopped request is complete, not abandoned
  EXPECT_EQ(m.cancelled, 1u);
}

TEST(EngineTest, DestructionEndsWhatIsLeft) {
  const ModelConfig cfg = engine_config();
  const Model<double> model(random_weights<double>(cfg, 9));
  std::shared_ptr<RequestStream> running, queued;
  {
    Engine<double> engine(model, {.n_blocks = 32, .block_size = 4, .max_running = 1});
    running = engine.submit({.prompt = random_tokens(5, cfg.vocab_size, 1), .max_tokens = 40});
    engine.step();
    queued = engine.submit({.prompt = random_tokens(5, cfg.vocab_size, 2), .max_tokens = 40});
  }
  EXPECT_EQ(running->finish_reason(), FinishReason::kCancelled);
  EXPECT_EQ(queued->finish_reason(), FinishReason::kCancelled);
  EXPECT_EQ(running->tokens().size(), 1u);
}

TEST(EngineTest, SubmissionFromSeveralThreads) {
  const ModelConfig cfg = engine_config();
  const Model<double> model(random_weights<double>(cfg, 11));
  ThreadPool threads(2);
  Engine<double> engine(model, {.n_blocks = 40,
                                .block_size = 4,
                                .max_running = 8,
                                .step_tokens = 32,
                                .thread_pool = &threads});
  std::jthread loop([&](std::stop_token st) { engine.run(st); });
  constexpr std::size_t kThreads = 4, kEach = 5;
  std::vector<std::vector<Tokens>> got(kThreads, std::vector<Tokens>(kEach));
  std::vector<std::vector<RequestOptions>> asked(kThreads, std::vector<RequestOptions>(kEach));
  std::vector<std::jthread> clients;
  for (std::size_t t = 0; t < kThreads; ++t)
    clients.emplace_back([&, t] {
      for (std::size_t i = 0; i < kEach; ++i) {
        RequestOptions& r = asked[t][i];
        r.prompt = random_tokens(3 + (t * 7 + i * 3) % 20, cfg.vocab_size, 100 * t + i);
        r.max_tokens = 5 + i * 3;
        const auto stream = engine.submit(r);
        std::int32_t token;
        while (stream->next(token)) got[t][i].push_back(token);
      }
    });
  clients.clear();  // joins
  loop.request_stop();
  loop.join();
  for (std::size_t t = 0; t < kThreads; ++t)
    for (std::size_t i = 0; i < kEach; ++i)
      EXPECT_EQ(got[t][i],
                alone(model, asked[t][i].prompt, asked[t][i].sampling, asked[t][i].max_tokens))
          << "thread " << t << " request " << i;
  const EngineMetrics m = engine.metrics();
  EXPECT_EQ(m.submitted, kThreads * kEach);
  EXPECT_EQ(m.finished, kThreads * kEach);
  EXPECT_EQ(m.ttft.count(), kThreads * kEach);
  EXPECT_EQ(m.blocks_held, 0u);
}

TEST(EngineTest, SharedPrefixAndSecondTurnPrefillOnlyNewTokens) {
  const ModelConfig cfg = engine_config();
  const Model<double> model(random_weights<double>(cfg, 13));
  Engine<double> engine(model, {.n_blocks = 32, .block_size = 16});
  const Tokens system = random_tokens(32, cfg.vocab_size, 21);  // two full blocks
  Tokens pa = system, pb = system;
  for (const auto t : random_tokens(5, cfg.vocab_size, 22)) pa.push_back(t);
  for (const auto t : random_tokens(7, cfg.vocab_size, 23)) pb.push_back(t);
  const auto a = engine.submit({.prompt = pa, .max_tokens = 8});
  run_to_completion(engine);
  const auto b = engine.submit({.prompt = pb, .max_tokens = 8});
  run_to_completion(engine);
  EXPECT_EQ(a->usage().cached_tokens, 0u);
  EXPECT_EQ(a->usage().prefilled_tokens, 37u);
  EXPECT_EQ(b->usage().cached_tokens, 32u);
  EXPECT_EQ(b->usage().prefilled_tokens, 7u);
  // A second turn of the first conversation: its prompt, its answer and 6 new tokens. The first
  // request fed 37 + 8 - 1 = 44 positions (the last token is never fed back): 2 full blocks.
  Tokens turn2 = pa;
  const Tokens answer = a->tokens();
  turn2.insert(turn2.end(), answer.begin(), answer.end());
  for (const auto t : random_tokens(6, cfg.vocab_size, 24)) turn2.push_back(t);
  const auto c = engine.submit({.prompt = turn2, .max_tokens = 4});
  run_to_completion(engine);
  EXPECT_EQ(c->usage().cached_tokens, 32u);
  EXPECT_EQ(c->usage().prefilled_tokens, turn2.size() - 32u);
  EXPECT_EQ(c->tokens(), alone(model, turn2, {.temperature = 0}, 4));
  EXPECT_EQ(b->tokens(), alone(model, pb, {.temperature = 0}, 8));
  const EngineMetrics m = engine.metrics();
  EXPECT_EQ(m.prompt_tokens, pa.size() + pb.size() + turn2.size());
  EXPECT_EQ(m.tokens_reused, 64u);
  EXPECT_EQ(m.tokens_prefilled, 37u + 7u + (turn2.size() - 32u));
  EXPECT_EQ(m.tokens_recomputed, 0u);
  EXPECT_EQ(m.prefix_block_hits, 4u);
  EXPECT_DOUBLE_EQ(m.prefix_hit_rate(), 64.0 / static_cast<double>(m.prompt_tokens));
}

TEST(EngineTest, ChunkedPrefillDoesNotStallDecoding) {
  const ModelConfig cfg = engine_config();
  const Model<double> model(random_weights<double>(cfg, 15));
  Engine<double> engine(model,
                        {.n_blocks = 64, .block_size = 4, .max_running = 4, .step_tokens = 8});
  const auto a = engine.submit({.prompt = random_tokens(4, cfg.vocab_size, 1), .max_tokens = 30});
  engine.step();  // a's prompt and first token
  ASSERT_EQ(a->tokens().size(), 1u);
  const Tokens long_prompt = random_tokens(63, cfg.vocab_size, 2);
  const auto b = engine.submit({.prompt = long_prompt, .max_tokens = 3});
  // Each step: one token for a, the other 7 of the budget for b's prompt: 63 = 9 × 7.
  for (std::size_t k = 1; k <= 9; ++k) {
    engine.step();
    EXPECT_EQ(a->tokens().size(), 1 + k) << "step " << k;
    EXPECT_EQ(b->tokens().size(), k == 9 ? 1u : 0u) << "step " << k;
  }
  run_to_completion(engine);
  EXPECT_EQ(b->tokens(), alone(model, long_prompt, {.temperature = 0}, 3));
  EXPECT_EQ(a->tokens(), alone(model, random_tokens(4, cfg.vocab_size, 1), {.temperature = 0}, 30));
}

TEST(EngineTest, StopTokenEndsTheRequestAndIsEmittedToCallbackAndStream) {
  const ModelConfig cfg = engine_config();
  const Model<double> model(random_weights<double>(cfg, 17));
  Engine<double> engine(model, {.n_blocks = 32, .block_size = 4});
  const Tokens prompt = random_tokens(6, cfg.vocab_size, 5);
  const Tokens free_run = alone(model, prompt, {.temperature = 0}, 10);
  const std::int32_t stop = free_run[3];
  Tokens seen;  // through the callback, on the step thread
  const auto s = engine.submit(
      {.prompt = prompt, .max_tokens = 10, .stop_tokens = {stop}, .on_token = [&](std::int32_t t) {
         seen.push_back(t);
       }});
  run_to_completion(engine);
  EXPECT_EQ(s->tokens(), alone(model, prompt, {.temperature = 0}, 10, stop));
  EXPECT_EQ(seen, s->tokens());
  EXPECT_EQ(s->tokens().back(), stop);
  EXPECT_EQ(s->finish_reason(), FinishReason::kStopToken);
}

void expect_error(const std::function<void()>& f, const std::string& part) {
  try {
    f();
    ADD_FAILURE() << "no Error; expected one saying '" << part << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

TEST(EngineTest, RejectsBadRequestsLeavingTheEngineUnchanged) {
  const ModelConfig cfg = engine_config();  // vocab 53, seq_len 96
  const Model<double> model(random_weights<double>(cfg, 19));
  Engine<double> engine(model, {.n_blocks = 8, .block_size = 4});  // 32 positions
  const Tokens ok = random_tokens(5, cfg.vocab_size, 1);
  expect_error([&] { engine.submit({.prompt = {}}); }, "the prompt has no tokens");
  expect_error(
      [&] {
        engine.submit({.prompt = {1, 2, 53}});
      },
      "prompt token 53 at position 2 is outside the vocabulary [0, 53)");
  expect_error([&] { engine.submit({.prompt = {1, -1}}); }, "prompt token -1 at position 1");
  expect_error([&] { engine.submit({.prompt = ok, .max_tokens = 0}); }, "max_tokens is 0");
  expect_error([&] { engine.submit({.prompt = ok, .max_tokens = 92}); },
               "5 prompt tokens + max_tokens 92 exceed the context of 96 positions");
  expect_error([&] { engine.submit({.prompt = ok, .max_tokens = 29}); },
               "5 prompt tokens + 29 generated need 9 blocks of 4 positions, but the whole pool "
               "has 8");
  expect_error([&] { engine.submit({.prompt = ok, .stop_tokens = {60}}); },
               "stop token 60 is outside the vocabulary");
  expect_error([&] { engine.submit({.prompt = ok, .sampling = {.temperature = -1}}); },
               "temperature must be a finite number >= 0");
  EXPECT_FALSE(engine.step());
  EXPECT_EQ(engine.metrics().submitted, 0u);
  EXPECT_EQ(engine.metrics().queued, 0u);
  // The largest request the pool takes: 5 + 28 - 1 = 32 positions, all 8 blocks.
  const auto s = engine.submit({.prompt = ok, .max_tokens = 28});
  EXPECT_EQ(s->id(), 1u);
  run_to_completion(engine);
  EXPECT_EQ(s->tokens(), alone(model, ok, {.temperature = 0}, 28));
}

TEST(EngineTest, RejectsBadOptions) {
  const ModelConfig cfg = engine_config();
  const Model<double> model(random_weights<double>(cfg, 19));
  expect_error([&] { Engine<double>(model, {.max_running = 8, .step_tokens = 4}); },
               "step_tokens 4 must be at least max_running 8");
  expect_error([&] { Engine<double>(model, {.capacity = 97}); },
               "capacity 97 exceeds the model's seq_len 96");
  expect_error(
      [&] {
        Engine<double>(model, {.pass_cost = PassCost{-1, 0.1}});
      },
      "pass_cost must be finite and >= 0, got fixed_ms -1 and token_ms 0.1");
  expect_error(
      [&] {
        Engine<double>(model, {.pass_cost = PassCost{1, std::nan("")}});
      },
      "pass_cost must be finite and >= 0, got fixed_ms 1 and token_ms nan");
}

#ifdef NDEBUG
TEST(EngineTest, DecodeStepsAllocateNothing) {
  const ModelConfig cfg = engine_config();
  const Model<double> model(random_weights<double>(cfg, 23));
  ThreadPool threads(2);  // the step's threads run the model and the draws
  Engine<double> engine(model, {.n_blocks = 64,
                                .block_size = 4,
                                .max_running = 4,
                                .step_tokens = 16,
                                .thread_pool = &threads});
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (std::uint64_t i = 0; i < 4; ++i)
    streams.push_back(engine.submit({.prompt = random_tokens(6 + i, cfg.vocab_size, i),
                                     .sampling = {.temperature = 0.8, .seed = 3 + i},
                                     .max_tokens = 40}));
  for (int i = 0; i < 3; ++i) engine.step();  // admitted and prefilled
  std::vector<std::size_t> had;
  for (const auto& s : streams) had.push_back(s->tokens().size());
  const long before = g_allocations.load();
  Eigen::internal::set_is_malloc_allowed(false);
  for (int i = 0; i < 20; ++i) engine.step();  // decode steps, some taking new blocks
  Eigen::internal::set_is_malloc_allowed(true);
  EXPECT_EQ(g_allocations.load() - before, 0) << "heap allocations during decode steps";
  for (std::size_t i = 0; i < streams.size(); ++i) {
    EXPECT_GE(had[i], 1u);
    EXPECT_EQ(streams[i]->tokens().size(), had[i] + 20) << "one token per step";
  }
}
#endif

}  // namespace
}  // namespace kvdecode::testing_util
