// Model::decode_batch and prefill_batch: per sequence equal to forward_reference of its tokens
// (the f32 / f64 bound), as single-sequence decode is; B = 1 equal to decode() bit for bit; a
// sequence's logits in a batch of 2..16 the same bit for bit whatever the batch and threads; a
// batch that throws (a full store, an exhausted pool, a bad token, a repeated store) leaves every
// store as it was; exact work counters; no allocation in a batched decode step.
// EIGEN_RUNTIME_NO_MALLOC: defined for every test by tests/CMakeLists.txt.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "counting_new.hpp"
#include "kvdecode/kvdecode.hpp"
#include "test_util.hpp"

namespace kvdecode::testing_util {
namespace {

using Tokens = std::vector<std::int32_t>;

/// The bound of the other cached-vs-reference tests: f32 relative 1e-5, f64 absolute 1e-12.
template <class T>
double bound(double ref) {
  return std::is_same_v<T, float> ? 1e-5 * (1.0 + std::abs(ref)) : 1e-12;
}

template <class T>
std::vector<T> last_row(const std::vector<T>& all, std::size_t vocab) {
  return std::vector<T>(all.end() - static_cast<std::ptrdiff_t>(vocab), all.end());
}

/// Row b of batched logits [B][vocab].
template <class T>
std::vector<T> row(std::span<const T> logits, std::size_t b, std::size_t vocab) {
  const auto r = logits.subspan(b * vocab, vocab);
  return std::vector<T>(r.begin(), r.end());
}

/// Checks row b of `logits` against the reference logits of tokens' last position, computed in
/// double on the model's weights (an f32 reference would add its own rounding to the bound).
template <class T>
void expect_reference(const Model<T>& model, const Tokens& tokens, std::span<const T> logits,
                      std::size_t b, const char* what) {
  const auto vocab = static_cast<std::size_t>(model.config().vocab_size);
  const std::vector<double> want =
      last_row(forward_reference(convert_weights<double>(model.weights()),
                                 std::span<const std::int32_t>(tokens)),
               vocab);
  for (std::size_t i = 0; i < vocab; ++i) {
    const double r = want[i];
    ASSERT_LE(std::abs(static_cast<double>(logits[b * vocab + i]) - r), bound<T>(r))
        << what << ": sequence " << b << " (" << tokens.size() << " tokens) logit " << i;
  }
}

// ---------------------------------------------------------------------------------------------
// The sequences of a batch on either store kind: different lengths, built by different prompts;
// on the paged pool, sequences 3 and 4 are forks of sequence 1 and share its prefix blocks.

template <class T, bool Paged>
struct Batch {
  using Store = std::conditional_t<Paged, PagedStore<T>, ContiguousStore<T>>;

  Batch(const ModelConfig& cfg, const Model<T>& model, std::size_t n_blocks = 64)
      : pool(Paged ? std::make_unique<BlockPool<T>>(cfg, n_blocks, 4) : nullptr) {
    Activations<T> act(cfg, {.max_chunk = 8});
    const std::size_t lengths[] = {3, 17, 8, 17, 17};
    for (std::size_t b = 0; b < 5; ++b) {
      if constexpr (Paged) {
        stores.push_back(b >= 3 ? std::make_unique<Store>(stores[1]->fork())
                                : std::make_unique<Store>(*pool));
      } else {
        stores.push_back(std::make_unique<Store>(cfg));
      }
      tokens.push_back(b >= 3 ? tokens[1] : random_tokens(lengths[b], cfg.vocab_size, 100 + b));
      if (b < 3 || !Paged) model.prefill(tokens[b], *stores[b], act);
    }
    // Forks continue with tokens of their own, so they diverge after the shared prefix.
    for (std::size_t b = 3; b < 5; ++b) {
      const Tokens more = random_tokens(2 + b, cfg.vocab_size, 200 + b);
      model.prefill(more, *stores[b], act);
      tokens[b].insert(tokens[b].end(), more.begin(), more.end());
    }
    for (auto& s : stores) ptrs.push_back(s.get());
  }
  /// The same sequences, each in a contiguous store of its own, for one-at-a-time decoding.
  std::vector<ContiguousStore<T>> singles(const ModelConfig& cfg, const Model<T>& model,
                                          Activations<T>& act) const {
    std::vector<ContiguousStore<T>> out;
    for (const Tokens& t : tokens) {
      out.emplace_back(cfg);
      model.prefill(t, out.back(), act);
    }
    return out;
  }

  std::unique_ptr<BlockPool<T>> pool;
  std::vector<std::unique_ptr<Store>> stores;
  std::vector<Store*> ptrs;
  std::vector<Tokens> tokens;
};

template <class T, bool Paged>
void decode_batch_matches_reference_and_single_decode() {
  const ModelConfig cfg = small_config(4, 2, 64);
  const Model<T> model(random_weights<T>(cfg, 31));
  const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
  Batch<T, Paged> batch(cfg, model);
  const std::size_t B = batch.ptrs.size();
  // The same sequences, decoded one at a time in contiguous stores.
  Activations<T> single_act(cfg, {.max_chunk = 8});
  std::vector<ContiguousStore<T>> singles = batch.singles(cfg, model, single_act);
  Activations<T> act(cfg, {.max_chunk = 1, .max_batch = B});
  for (std::size_t step = 0; step < 6; ++step) {
    const Tokens next = random_tokens(B, cfg.vocab_size, 300 + step);
    const auto logits =
        model.decode_batch(std::span<const std::int32_t>(next),
                           std::span<typename Batch<T, Paged>::Store* const>(batch.ptrs), act);
    ASSERT_EQ(logits.size(), B * vocab);
    for (std::size_t b = 0; b < B; ++b) {
      batch.tokens[b].push_back(next[b]);
      EXPECT_EQ(batch.ptrs[b]->size(), batch.tokens[b].size());
      expect_reference(model, batch.tokens[b], logits, b, "decode_batch");
      // Decoded alone (the GEMV's summation order, not the batch's), within the same bound.
      expect_reference(model, batch.tokens[b], model.decode(next[b], singles[b], single_act), 0,
                       "decode");
    }
  }
  if constexpr (Paged) batch.pool->check_invariants();
}

TEST(BatchTest, DecodeBatchMatchesReferenceContiguousFloat) {
  decode_batch_matches_reference_and_single_decode<float, false>();
}
TEST(BatchTest, DecodeBatchMatchesReferenceContiguousDouble) {
  decode_batch_matches_reference_and_single_decode<double, false>();
}
TEST(BatchTest, DecodeBatchMatchesReferencePagedWithForksFloat) {
  decode_batch_matches_reference_and_single_decode<float, true>();
}
TEST(BatchTest, DecodeBatchMatchesReferencePagedWithForksDouble) {
  decode_batch_matches_reference_and_single_decode<double, true>();
}

TEST(BatchTest, BatchOfOneEqualsDecodeBitForBit) {
  const ModelConfig cfg = small_config(4, 2, 64);
  const Model<float> model(random_weights<float>(cfg, 32));
  const Tokens prompt = random_tokens(21, cfg.vocab_size, 5);
  ContiguousStore<float> a(cfg), b(cfg);
  Activations<float> act(cfg, {.max_chunk = 8, .max_batch = 4});
  model.prefill(prompt, a, act);
  model.prefill(prompt, b, act);
  ContiguousStore<float>* const one[] = {&b};
  for (std::int32_t t : {3, 9, 27}) {
    const auto single = model.decode(t, a, act);
    const std::vector<float> want(single.begin(), single.end());
    const auto got = model.decode_batch(std::span<const std::int32_t>(&t, 1),
                                        std::span<ContiguousStore<float>* const>(one), act);
    EXPECT_EQ(std::vector<float>(got.begin(), got.end()), want);
  }
}

// Batched steps sum every output in lanes, one fma chain per output whatever the batch (detail/
// gemm_lanes.hpp), and attend per sequence: sequence 0 gives the same logits bit for bit beside
// sequences 1..4 on one thread and beside a different sequence on two threads.
TEST(BatchTest, SequenceLogitsDoNotDependOnTheBatch) {
  const ModelConfig cfg = small_config(4, 2, 64);
  const Model<float> model(random_weights<float>(cfg, 35));
  const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
  Batch<float, true> batch(cfg, model);
  // Sequence 0's twin and another sequence, on the same pool (the same attention tiles).
  Activations<float> prompt_act(cfg, {.max_chunk = 8});
  PagedStore<float> twin(*batch.pool), other(*batch.pool);
  model.prefill(batch.tokens[0], twin, prompt_act);
  model.prefill(random_tokens(11, cfg.vocab_size, 77), other, prompt_act);
  PagedStore<float>* const pair[] = {&other, &twin};
  ThreadPool pool(2);
  Activations<float> act(cfg, {.max_chunk = 1, .max_batch = batch.ptrs.size()});
  Activations<float> act2(cfg, {.max_chunk = 1, .max_batch = 2, .thread_pool = &pool});
  for (std::size_t step = 0; step < 4; ++step) {
    const Tokens next = random_tokens(batch.ptrs.size(), cfg.vocab_size, 700 + step);
    const auto logits = model.decode_batch(std::span<const std::int32_t>(next),
                                           std::span<PagedStore<float>* const>(batch.ptrs), act);
    const std::vector<float> in_five = row(logits, 0, vocab);
    const std::int32_t two[] = {next[3], next[0]};
    const auto l2 = model.decode_batch(std::span<const std::int32_t>(two),
                                       std::span<PagedStore<float>* const>(pair), act2);
    EXPECT_EQ(row(l2, 1, vocab), in_five) << "step " << step;
  }
}

TEST(BatchTest, DecodeBatchOnTwoThreadsMatchesReference) {
  const ModelConfig cfg = small_config(4, 2, 64);
  const Model<float> model(random_weights<float>(cfg, 33));
  Batch<float, true> batch(cfg, model);
  ThreadPool pool(2);
  Activations<float> act(cfg,
                         {.max_chunk = 1, .max_batch = batch.ptrs.size(), .thread_pool = &pool});
  for (std::size_t step = 0; step < 3; ++step) {
    const Tokens next = random_tokens(batch.ptrs.size(), cfg.vocab_size, 400 + step);
    const auto logits = model.decode_batch(std::span<const std::int32_t>(next),
                                           std::span<PagedStore<float>* const>(batch.ptrs), act);
    for (std::size_t b = 0; b < batch.ptrs.size(); ++b) {
      batch.tokens[b].push_back(next[b]);
      expect_reference(model, batch.tokens[b], logits, b, "decode_batch on 2 threads");
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Batched prefill: chunks of 8 rows span sequence boundaries.

template <class T, bool Paged>
void prefill_batch_matches_reference() {
  const ModelConfig cfg = small_config(4, 2, 64);
  const Model<T> model(random_weights<T>(cfg, 34));
  const std::size_t lengths[] = {5, 1, 23, 12};
  Tokens all;
  std::vector<Tokens> prompts;
  for (std::size_t b = 0; b < 4; ++b) {
    prompts.push_back(random_tokens(lengths[b], cfg.vocab_size, 500 + b));
    all.insert(all.end(), prompts[b].begin(), prompts[b].end());
  }
  using Store = std::conditional_t<Paged, PagedStore<T>, ContiguousStore<T>>;
  BlockPool<T> pool(cfg, 40, 4);
  std::vector<std::unique_ptr<Store>> stores;
  std::vector<Store*> ptrs;
  for (std::size_t b = 0; b < 4; ++b) {
    if constexpr (Paged) {
      stores.push_back(std::make_unique<Store>(pool));
    } else {
      stores.push_back(std::make_unique<Store>(cfg));
    }
    ptrs.push_back(stores.back().get());
  }
  Activations<T> act(cfg, {.max_chunk = 8, .max_batch = 4});
  const auto logits =
      model.prefill_batch(std::span<const std::int32_t>(all), std::span<const std::size_t>(lengths),
                          std::span<Store* const>(ptrs), act);
  for (std::size_t b = 0; b < 4; ++b) {
    EXPECT_EQ(ptrs[b]->size(), lengths[b]);
    EXPECT_EQ(Tokens(ptrs[b]->tokens().begin(), ptrs[b]->tokens().end()), prompts[b]);
    expect_reference(model, prompts[b], logits, b, "prefill_batch");
  }
  // A second call continues every sequence (a new turn), then a decode step.
  const std::size_t more[] = {2, 9, 1, 4};
  Tokens next;
  for (std::size_t b = 0; b < 4; ++b) {
    const Tokens t = random_tokens(more[b], cfg.vocab_size, 600 + b);
    next.insert(next.end(), t.begin(), t.end());
    prompts[b].insert(prompts[b].end(), t.begin(), t.end());
  }
  const auto again =
      model.prefill_batch(std::span<const std::int32_t>(next), std::span<const std::size_t>(more),
                          std::span<Store* const>(ptrs), act);
  for (std::size_t b = 0; b < 4; ++b) expect_reference(model, prompts[b], again, b, "turn 2");
  const Tokens step = {1, 2, 3, 4};
  const auto decoded =
      model.decode_batch(std::span<const std::int32_t>(step), std::span<Store* const>(ptrs), act);
  for (std::size_t b = 0; b < 4; ++b) {
    prompts[b].push_back(step[b]);
    expect_reference(model, prompts[b], decoded, b, "decode after prefill_batch");
  }
  if constexpr (Paged) pool.check_invariants();
}

TEST(BatchTest, PrefillBatchMatchesReferenceContiguousFloat) {
  prefill_batch_matches_reference<float, false>();
}
TEST(BatchTest, PrefillBatchMatchesReferencePagedDouble) {
  prefill_batch_matches_reference<double, true>();
}

// ---------------------------------------------------------------------------------------------
// Transactions: a batch that throws leaves every store as it was.

template <class S>
struct Snapshot {
  explicit Snapshot(const std::vector<S*>& stores) {
    for (const S* s : stores) {
      sizes.push_back(s->size());
      tokens.emplace_back(s->tokens().begin(), s->tokens().end());
      pending.push_back(s->pending());
      if constexpr (std::is_same_v<S, PagedStore<float>>)
        tables.emplace_back(s->block_table().begin(), s->block_table().end());
    }
  }
  bool operator==(const Snapshot&) const = default;
  std::vector<std::size_t> sizes;
  std::vector<Tokens> tokens;
  std::vector<std::size_t> pending;
  std::vector<std::vector<std::size_t>> tables;
};

/// After a failed batch, one more decode step gives every sequence its reference logits.
template <class S>
void expect_decodes_after_failure(const Model<float>& model, std::vector<S*>& stores,
                                  Activations<float>& act) {
  Tokens next;
  for (std::size_t b = 0; b < stores.size(); ++b) next.push_back(static_cast<std::int32_t>(b));
  const auto logits =
      model.decode_batch(std::span<const std::int32_t>(next), std::span<S* const>(stores), act);
  for (std::size_t b = 0; b < stores.size(); ++b) {
    Tokens t(stores[b]->tokens().begin(), stores[b]->tokens().end());
    expect_reference(model, t, logits, b, "decode after a failed batch");
  }
}

TEST(BatchTest, FullStoreInTheBatchChangesNoStore) {
  const ModelConfig cfg = small_config(4, 2, 24);
  const Model<float> model(random_weights<float>(cfg, 35));
  std::vector<std::unique_ptr<ContiguousStore<float>>> owned;
  std::vector<ContiguousStore<float>*> stores;
  Activations<float> act(cfg, {.max_chunk = 8, .max_batch = 3});
  const std::size_t lengths[] = {5, 24, 9};  // sequence 1 is full
  for (std::size_t b = 0; b < 3; ++b) {
    owned.push_back(std::make_unique<ContiguousStore<float>>(cfg));
    stores.push_back(owned.back().get());
    model.prefill(random_tokens(lengths[b], cfg.vocab_size, 700 + b), *stores[b], act);
  }
  const Snapshot before(stores);
  const Tokens next = {1, 2, 3};
  EXPECT_THROW(model.decode_batch(std::span<const std::int32_t>(next),
                                  std::span<ContiguousStore<float>* const>(stores), act),
               Error);
  EXPECT_TRUE(Snapshot(stores) == before);
  stores.erase(stores.begin() + 1);
  expect_decodes_after_failure(model, stores, act);
}

TEST(BatchTest, ExhaustedPoolChangesNoSequence) {
  const ModelConfig cfg = small_config(4, 2, 64);
  const Model<float> model(random_weights<float>(cfg, 36));
  // 4-position blocks: sequences of 4, 8 and 12 tokens fill 6 of 8 blocks; the next decode
  // needs a new block for each of them, and only two are left.
  BlockPool<float> pool(cfg, 8, 4, BlockPoolOptions{0, false});
  std::vector<std::unique_ptr<PagedStore<float>>> owned;
  std::vector<PagedStore<float>*> stores;
  Activations<float> act(cfg, {.max_chunk = 8, .max_batch = 3});
  for (std::size_t b = 0; b < 3; ++b) {
    owned.push_back(std::make_unique<PagedStore<float>>(pool));
    stores.push_back(owned.back().get());
    model.prefill(random_tokens(4 * (b + 1), cfg.vocab_size, 800 + b), *stores[b], act);
  }
  const Snapshot before(stores);
  const std::size_t held = pool.n_held();
  const Tokens next = {1, 2, 3};
  try {
    model.decode_batch(std::span<const std::int32_t>(next),
                       std::span<PagedStore<float>* const>(stores), act);
    ADD_FAILURE() << "decode_batch did not throw on an exhausted pool";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("needs 1 blocks but the pool has 0"), std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(Snapshot(stores) == before);
  EXPECT_EQ(pool.n_held(), held);
  pool.check_invariants();
  stores.pop_back();  // two of them fit
  expect_decodes_after_failure(model, stores, act);
}

TEST(BatchTest, BadInputsThrowAndChangeNothing) {
  const ModelConfig cfg = small_config(4, 2, 64);
  const Model<float> model(random_weights<float>(cfg, 37));
  ContiguousStore<float> a(cfg), b(cfg);
  Activations<float> act(cfg, {.max_chunk = 8, .max_batch = 2});
  model.prefill(random_tokens(6, cfg.vocab_size, 1), a, act);
  model.prefill(random_tokens(3, cfg.vocab_size, 2), b, act);
  std::vector<ContiguousStore<float>*> stores = {&a, &b};
  const Snapshot before(stores);
  const auto decode = [&](Tokens t, std::vector<ContiguousStore<float>*> s) {
    model.decode_batch(std::span<const std::int32_t>(t),
                       std::span<ContiguousStore<float>* const>(s), act);
  };
  EXPECT_THROW(decode({1, 53}, stores), Error);          // token outside the vocabulary
  EXPECT_THROW(decode({1}, stores), Error);              // one token for two sequences
  EXPECT_THROW(decode({1, 2}, {&a, &a}), Error);         // the same store twice
  EXPECT_THROW(decode({1, 2, 3}, {&a, &b, &a}), Error);  // more than max_batch, repeated
  ContiguousStore<float> c(cfg);
  EXPECT_THROW(decode({1, 2, 3}, {&a, &b, &c}), Error);  // more than max_batch
  const std::size_t lengths[] = {2, 2};
  const Tokens three = {1, 2, 3};
  EXPECT_THROW(model.prefill_batch(std::span<const std::int32_t>(three),
                                   std::span<const std::size_t>(lengths),
                                   std::span<ContiguousStore<float>* const>(stores), act),
               Error);  // lengths add up to 4
  EXPECT_TRUE(Snapshot(stores) == before);
  expect_decodes_after_failure(model, stores, act);
}

// ---------------------------------------------------------------------------------------------
// Counters: per-sequence work sums over the batch; weights are read once per step.

TEST(BatchTest, CountersSumTheSequencesAndReadWeightsOnce) {
  const ModelConfig cfg = small_config(4, 2, 64);
  const Model<float> model(random_weights<float>(cfg, 38));
  Batch<float, false> batch(cfg, model);
  const std::size_t B = batch.ptrs.size();
  Activations<float> single_act(cfg, {.max_chunk = 8});
  std::vector<ContiguousStore<float>> singles = batch.singles(cfg, model, single_act);
  WorkCounters batched, single;
  Activations<float> act(cfg, {.max_chunk = 1, .max_batch = B});
  act.counters = &batched;
  single_act.counters = &single;
  const Tokens next = random_tokens(B, cfg.vocab_size, 900);
  model.decode_batch(std::span<const std::int32_t>(next),
                     std::span<ContiguousStore<float>* const>(batch.ptrs), act);
  for (std::size_t b = 0; b < B; ++b) model.decode(next[b], singles[b], single_act);
  const PhaseCounters& c = batched.decode;
  const PhaseCounters& s = single.decode;
  EXPECT_EQ(c.tokens, B);
  EXPECT_EQ(c.kv_projections, s.kv_projections);
  EXPECT_EQ(c.attention_scores, s.attention_scores);
  EXPECT_EQ(c.kv_bytes_written, s.kv_bytes_written);
  EXPECT_EQ(c.kv_bytes_read, s.kv_bytes_read);
  EXPECT_EQ(c.flops, s.flops);
  // One step's weights (every matrix once) plus one embedding row per token: B single steps
  // read every matrix B times.
  const std::uint64_t embedding_row = static_cast<std::uint64_t>(cfg.dim) * sizeof(float);
  const std::uint64_t per_step = (s.weight_bytes_read - B * embedding_row) / B;
  EXPECT_EQ(c.weight_bytes_read, per_step + B * embedding_row);
  EXPECT_EQ(batched.prefill, PhaseCounters{});
}

TEST(BatchTest, DecodeBatchAllocatesNothing) {
  const ModelConfig cfg = small_config(4, 2, 64);
  const Model<float> model(random_weights<float>(cfg, 39));
  Batch<float, true> batch(cfg, model);
  Activations<float> act(cfg, {.max_chunk = 1, .max_batch = batch.ptrs.size()});
  const Tokens next = random_tokens(batch.ptrs.size(), cfg.vocab_size, 1000);
  const auto step = [&] {
    model.decode_batch(std::span<const std::int32_t>(next),
                       std::span<PagedStore<float>* const>(batch.ptrs), act);
  };
  step();  // warm-up outside the counted region
  const long before = g_allocations.load();
  Eigen::internal::set_is_malloc_allowed(false);
  for (int i = 0; i < 10; ++i) step();
  Eigen::internal::set_is_malloc_allowed(true);
  EXPECT_EQ(g_allocations.load() - before, 0) << "heap allocations during decode_batch";
}

}  // namespace
}  // namespace kvdecode::testing_util
