// Sub-passes of an Engine step: SubPassPlanner's plan is the cheapest of every way to split a
// step (checked by enumerating them with a timeline written here); PassCostModel recovers a line
// from timed passes; an engine that splits its steps publishes the first token of a short prompt
// before a long one's pass runs, and every request's tokens still equal a run of it alone; steps
// that admit nothing (decoding, a prompt's last chunk) allocate nothing.
// EIGEN_RUNTIME_NO_MALLOC: defined for every test by tests/CMakeLists.txt.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "counting_new.hpp"
#include "engine_oracle.hpp"
#include "kvdecode/kvdecode.hpp"
#include "kvdecode/serving/pass_cost_model.hpp"
#include "kvdecode/serving/sub_pass_planner.hpp"
#include "test_util.hpp"

namespace kvdecode::testing_util {
namespace {

using Tokens = std::vector<std::int32_t>;

/// The sum the planner minimises, for the split after the given items (ascending, the last one
/// the item count), simulated pass by pass: each pass lasts fixed + token × its tokens (the
/// decoders' in the first); a prompt waits until its pass ends, the decoders, the rest and the
/// waiting until the last one ends.
double timeline_cost(const SubPassWork& w, const std::vector<std::size_t>& ends, PassCost c) {
  const std::size_t n = w.prompts.size();
  double t = 0, sum = 0;
  std::size_t begin = 0;
  for (std::size_t g = 0; g < ends.size(); ++g) {
    std::size_t tokens = g == 0 ? w.decoders : 0;
    for (std::size_t i = begin; i < ends[g]; ++i) tokens += i < n ? w.prompts[i] : w.rest_tokens;
    t += c.fixed_ms + c.token_ms * static_cast<double>(tokens);
    for (std::size_t i = begin; i < std::min(ends[g], n); ++i) sum += t;
    begin = ends[g];
  }
  return sum + t * static_cast<double>(w.waiting + w.decoders);
}

TEST(SubPassPlannerTest, PlanIsTheCheapestOfEverySplit) {
  detail::SplitMix64 rng(7);
  SubPassPlanner planner(16);
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<std::size_t> prompts(1 + rng.next() % 9);
    for (auto& p : prompts) p = 1 + rng.next() % 40;
    std::sort(prompts.begin(), prompts.end());
    const SubPassWork w{.decoders = rng.next() % 17,
                        .prompts = prompts,
                        .rest_tokens = rng.next() % 2 == 0 ? 0 : 1 + rng.next() % 200,
                        .waiting = rng.next() % 20};
    const PassCost c{.fixed_ms = static_cast<double>(rng.next() % 1000) / 100.0,
                     .token_ms = 0.01 + static_cast<double>(rng.next() % 100) / 100.0};
    const std::size_t items = prompts.size() + (w.rest_tokens > 0 ? 1 : 0);
    // Every subset of the split points 1 .. items-1.
    double best = std::numeric_limits<double>::infinity();
    for (std::uint64_t mask = 0; mask < (std::uint64_t{1} << (items - 1)); ++mask) {
      std::vector<std::size_t> ends;
      for (std::size_t j = 1; j < items; ++j)
        if (mask >> (j - 1) & 1) ends.push_back(j);
      ends.push_back(items);
      best = std::min(best, timeline_cost(w, ends, c));
    }
    const auto plan = planner.plan(w, c);
    const std::vector<std::size_t> ends(plan.begin(), plan.end());
    ASSERT_FALSE(ends.empty());
    EXPECT_EQ(ends.back(), items) << "trial " << trial;
    EXPECT_TRUE(std::is_sorted(ends.begin(), ends.end()));
    EXPECT_NEAR(timeline_cost(w, ends, c), best, 1e-9 * best) << "trial " << trial;
    EXPECT_NEAR(planner.cost(), best, 1e-9 * best) << "trial " << trial;
  }
}

TEST(SubPassPlannerTest, OnePassWithoutCompletingPromptsOrWhenAPassCostsTooMuch) {
  SubPassPlanner planner(16);
  const PassCost cheap{.fixed_ms = 0.01, .token_ms = 1};
  const auto decoders_only = planner.plan({.decoders = 16}, cheap);
  EXPECT_EQ(std::vector<std::size_t>(decoders_only.begin(), decoders_only.end()),
            std::vector<std::size_t>{0});
  const auto chunk_only = planner.plan({.decoders = 16, .rest_tokens = 240, .waiting = 3}, cheap);
  EXPECT_EQ(std::vector<std::size_t>(chunk_only.begin(), chunk_only.end()),
            std::vector<std::size_t>{1});
  const std::vector<std::size_t> prompts(16, 13);
  const auto split = planner.plan({.prompts = prompts}, cheap);
  EXPECT_EQ(split.size(), 16u) << "a free pass: each prompt alone";
  // Two passes, the first with k of the 16 prompts, save (16 - k)(13 k - fixed) over one: none
  // pays from fixed = 13 × 15 tokens' worth (nor do more passes: the enumeration above).
  const auto one = planner.plan({.prompts = prompts}, {.fixed_ms = 13 * 15, .token_ms = 1});
  EXPECT_EQ(std::vector<std::size_t>(one.begin(), one.end()), std::vector<std::size_t>{16});
}

TEST(PassCostModelTest, RecoversALineFromTimedPasses) {
  PassCostModel model;
  EXPECT_FALSE(model.estimate().has_value());
  for (int i = 0; i < 5; ++i) model.add(16, 0.4 + 0.02 * 16);
  EXPECT_FALSE(model.estimate().has_value()) << "one size class fixes no slope";
  for (int i = 0; i < 5; ++i) {
    model.add(1, 0.4 + 0.02 * 1);
    model.add(208, 0.4 + 0.02 * 208);
    model.add(200, 0.4 + 0.02 * 200);  // the same class as 208: its mean size is fitted
  }
  const auto c = model.estimate();
  ASSERT_TRUE(c.has_value());
  EXPECT_NEAR(c->fixed_ms, 0.4, 1e-9);
  EXPECT_NEAR(c->token_ms, 0.02, 1e-12);
  // Time that does not grow with the tokens: no estimate (one pass is then always best).
  PassCostModel flat;
  flat.add(1, 1.0);
  flat.add(100, 0.5);
  EXPECT_FALSE(flat.estimate().has_value());
}

TEST(PassCostModelTest, AClassFollowsItsLatestPasses) {
  PassCostModel model;
  model.add(1, 1.0);
  for (int i = 0; i < 200; ++i) model.add(100, 5.0);  // a loaded machine
  for (int i = 0; i < 200; ++i) model.add(100, 2.0);  // the load gone
  const auto c = model.estimate();
  ASSERT_TRUE(c.has_value());
  EXPECT_NEAR(c->token_ms, 1.0 / 99.0, 1e-9);
  EXPECT_NEAR(c->fixed_ms, 1.0 - 1.0 / 99.0, 1e-9);
}

// A fixed cost of one token: every split that helps a first token pays.
constexpr PassCost kCheapPass{.fixed_ms = 1, .token_ms = 1};

TEST(EngineSubPassTest, ShortPromptsPublishTheirFirstTokenBeforeLongerOnesRun) {
  const ModelConfig cfg = small_config(4, 2, 96);
  const Model<double> model(random_weights<double>(cfg, 31));
  const std::vector<std::size_t> lengths = {12, 3, 7, 5};  // submission order
  for (const bool sub_passes : {true, false}) {
    Engine<double> engine(model, {.n_blocks = 64,
                                  .block_size = 4,
                                  .max_running = 4,
                                  .step_tokens = 64,
                                  .sub_passes = sub_passes,
                                  .pass_cost = kCheapPass});
    std::vector<std::size_t> first_tokens;  // lengths, in the order their first token came
    std::vector<std::shared_ptr<RequestStream>> streams;
    for (std::size_t k = 0; k < lengths.size(); ++k) {
      const std::size_t len = lengths[k];
      streams.push_back(engine.submit({.prompt = random_tokens(len, cfg.vocab_size, 40 + k),
                                       .max_tokens = 4,
                                       .on_token = [&first_tokens, &streams, len, k](std::int32_t) {
                                         if (streams[k]->tokens().empty())
                                           first_tokens.push_back(len);
                                       }}));
    }
    engine.step();  // all four admitted and prefilled in one step
    ASSERT_EQ(first_tokens.size(), 4u);
    const EngineMetrics m = engine.metrics();
    EXPECT_EQ(m.steps, 1u);
    if (sub_passes) {
      EXPECT_EQ(first_tokens, (std::vector<std::size_t>{3, 5, 7, 12}));
      EXPECT_EQ(m.passes, 4u) << "one pass per prompt when a pass costs one token";
    } else {
      EXPECT_EQ(first_tokens, lengths);
      EXPECT_EQ(m.passes, 1u);
    }
    while (engine.step()) {
    }
    for (std::size_t k = 0; k < lengths.size(); ++k)
      EXPECT_EQ(
          streams[k]->tokens(),
          alone(model, random_tokens(lengths[k], cfg.vocab_size, 40 + k), {.temperature = 0}, 4))
          << "request " << k << ", sub_passes " << sub_passes;
  }
}

TEST(EngineSubPassTest, RandomArrivalsMatchEachRequestAloneWithSubPasses) {
  const ModelConfig cfg = small_config(4, 2, 96);
  const Model<double> model(random_weights<double>(cfg, 37));
  ThreadPool threads(2);
  Engine<double> engine(model, {.n_blocks = 48,
                                .block_size = 4,
                                .max_running = 6,
                                .step_tokens = 24,
                                .thread_pool = &threads,
                                .pass_cost = kCheapPass});
  detail::SplitMix64 rng(5);
  const Tokens system = random_tokens(10, cfg.vocab_size, 6);
  struct Req {
    std::size_t arrival;
    Tokens prompt;
    SamplerOptions sampling;
    std::size_t max_tokens;
    std::shared_ptr<RequestStream> stream;
  };
  std::vector<Req> reqs(24);
  for (std::size_t i = 0; i < reqs.size(); ++i) {
    Req& r = reqs[i];
    r.arrival = rng.next() % 30;
    r.prompt = rng.next() % 2 == 0 ? system : Tokens{};
    const Tokens tail = random_tokens(1 + rng.next() % 20, cfg.vocab_size, 100 + i);
    r.prompt.insert(r.prompt.end(), tail.begin(), tail.end());
    r.sampling = i % 3 == 0 ? SamplerOptions{0.9, 0.95, 0, 500 + i} : SamplerOptions{0.0};
    r.max_tokens = 1 + rng.next() % 20;
  }
  for (std::size_t step = 0; step < 100000; ++step) {
    for (Req& r : reqs)
      if (r.arrival == step)
        r.stream =
            engine.submit({.prompt = r.prompt, .sampling = r.sampling, .max_tokens = r.max_tokens});
    if (!engine.step() && step >= 30) break;
  }
  const EngineMetrics m = engine.metrics();
  EXPECT_GT(m.passes, m.steps) << "some steps ran in sub-passes";
  EXPECT_EQ(m.finished, reqs.size());
  std::uint64_t generated = 0;
  for (std::size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(reqs[i].stream->tokens(),
              alone(model, reqs[i].prompt, reqs[i].sampling, reqs[i].max_tokens))
        << "request " << i;
    generated += reqs[i].stream->tokens().size();
  }
  EXPECT_EQ(m.tokens_generated, generated);
  EXPECT_EQ(m.ttft.count(), reqs.size());
}

#ifdef NDEBUG  // as engine_test's: the counting allocator's figure is exact only without asserts
TEST(EngineSubPassTest, StepsThatAdmitNothingAllocateNothing) {
  const ModelConfig cfg = small_config(4, 2, 96);
  const Model<double> model(random_weights<double>(cfg, 41));
  ThreadPool threads(2);
  Engine<double> engine(model, {.n_blocks = 64,
                                .block_size = 4,
                                .max_running = 4,
                                .step_tokens = 8,
                                .thread_pool = &threads,
                                .pass_cost = kCheapPass});
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (std::uint64_t i = 0; i < 4; ++i)
    streams.push_back(engine.submit({.prompt = random_tokens(11 + 4 * i, cfg.vocab_size, i),
                                     .sampling = {.temperature = 0.8, .seed = 3 + i},
                                     .max_tokens = 30}));
  // Admission steps: until nothing is queued. The last prompt admitted completes in the steps
  // measured below, beside the decoding sequences.
  while (engine.metrics().queued > 0) engine.step();
  std::size_t without_token = 0;
  for (const auto& s : streams) without_token += s->tokens().empty() ? 1 : 0;
  ASSERT_GT(without_token, 0u);
  const long before = g_allocations.load();
  Eigen::internal::set_is_malloc_allowed(false);
  for (int i = 0; i < 12; ++i) engine.step();
  Eigen::internal::set_is_malloc_allowed(true);
  EXPECT_EQ(g_allocations.load() - before, 0) << "heap allocations during steps admitting nothing";
  for (const auto& s : streams) EXPECT_FALSE(s->tokens().empty());
}
#endif

}  // namespace
}  // namespace kvdecode::testing_util
