// WindowStore: the conformance suite for both policies; a trained window equals
// forward_reference(w, tokens, W) under chunked prefill and decode, through eviction, cancel and
// rollback; streaming keeps its memory bounded past seq_len and gives kept tokens the positions
// of a fresh forward over them.
#include "kvdecode/store/window_store.hpp"

#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <vector>

#include "kvdecode/io/cache_file.hpp"
#include "kvdecode/io/checkpoint.hpp"
#include "store_conformance.hpp"

namespace kvdecode::testing_util {

/// The streaming policy as a type of its own, so the typed suite can run both.
template <class T>
struct StreamingWindowStore : WindowStore<T> {
  using WindowStore<T>::WindowStore;
};

// The suite's decode test compares with the unwindowed reference, so these windows cover its 40
// positions; eviction is tested below.
template <class T>
struct StoreTraits<WindowStore<T>> {
  struct Holder {
    WindowStore<T> s;
    WindowStore<T>& store() { return s; }
  };
  static std::unique_ptr<Holder> make(const ModelConfig& cfg, std::size_t capacity) {
    return std::make_unique<Holder>(Holder{WindowStore<T>(
        cfg, {.window = capacity, .sinks = 0, .max_chunk = 16, .capacity = capacity})});
  }
  static constexpr bool kExactRows = true;
  static constexpr double kRowTolerance = 0;
  static constexpr double kLogitTolerance = std::is_same_v<T, float> ? 1e-5 : 1e-12;
  // The windows cover the capacity (S + W = capacity): every position stays resident.
  static std::vector<std::size_t> expected_resident(std::size_t end) { return all_indices(end); }
};
template <class T>
struct StoreTraits<StreamingWindowStore<T>> {
  struct Holder {
    StreamingWindowStore<T> s;
    StreamingWindowStore<T>& store() { return s; }
  };
  static std::unique_ptr<Holder> make(const ModelConfig& cfg, std::size_t capacity) {
    return std::make_unique<Holder>(
        Holder{StreamingWindowStore<T>(cfg, {.window = capacity - 4,
                                             .sinks = 4,
                                             .policy = WindowPolicy::kStreaming,
                                             .max_chunk = 16,
                                             .capacity = capacity})});
  }
  static constexpr bool kExactRows = true;
  static constexpr double kRowTolerance = 0;
  static constexpr double kLogitTolerance = std::is_same_v<T, float> ? 1e-5 : 1e-12;
  // The windows cover the capacity (S + W = capacity): every position stays resident.
  static std::vector<std::size_t> expected_resident(std::size_t end) { return all_indices(end); }
};

using WindowStores = ::testing::Types<WindowStore<float>, WindowStore<double>,
                                      StreamingWindowStore<float>, StreamingWindowStore<double>>;
INSTANTIATE_TYPED_TEST_SUITE_P(Window, StoreConformance, WindowStores);

namespace {

template <class T>
void expect_logits_near(std::span<const T> got, const std::vector<T>& ref, std::size_t row,
                        std::size_t vocab, double tol, const std::string& what) {
  for (std::size_t i = 0; i < vocab; ++i) {
    const double r = ref[row * vocab + i];
    ASSERT_NEAR(got[i], r, tol * (1 + std::abs(r)))
        << what << " position " << row << " logit " << i;
  }
}

// Prefill in chunks of `chunk` (one prefill call each, so each chunk is its own append), then
// decode; every position's logits against forward_reference(w, tokens, W).
template <class T>
void run_trained_window(const Model<T>& model, std::span<const std::int32_t> tokens,
                        std::size_t window, std::size_t chunk, std::size_t n_prefill, double tol) {
  const ModelConfig& cfg = model.config();
  const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
  const std::vector<T> ref = forward_reference(model.weights(), tokens, window);
  WindowStore<T> s(cfg, {.window = window, .max_chunk = chunk, .capacity = tokens.size()});
  Activations<T> act(cfg, {.max_chunk = chunk, .store_scratch = s.block_scratch_size()});
  const std::string what = "W=" + std::to_string(window) + " chunk=" + std::to_string(chunk);
  std::vector<T> logits(chunk * vocab);
  for (std::size_t p = 0; p < n_prefill; p += chunk) {
    const std::size_t m = std::min(chunk, n_prefill - p);
    model.prefill(tokens.subspan(p, m), s, act, std::span<T>(logits).first(m * vocab));
    for (std::size_t i = 0; i < m; ++i)
      expect_logits_near<T>(std::span<const T>(logits).subspan(i * vocab, vocab), ref, p + i, vocab,
                            tol, what);
  }
  for (std::size_t p = n_prefill; p < tokens.size(); ++p)
    expect_logits_near<T>(model.decode(tokens[p], s, act), ref, p, vocab, tol, what);
  // Memory stays that of W - 1 + chunk ring slots however long the sequence.
  EXPECT_EQ(s.memory_bytes(),
            WindowStore<T>::memory_bytes_for(cfg, {.window = window, .max_chunk = chunk}));
}

TEST(WindowStoreTest, TrainedWindowEqualsTheWindowedReference) {
  for (const auto& [heads, kv] : {std::pair{4, 2}, std::pair{4, 4}, std::pair{4, 1}}) {
    ModelConfig cfg = small_config(heads, kv, 64);
    if (kv == 1) cfg.rope_style = RopeStyle::kHalfSplit;
    const Model<float> model(random_weights<float>(cfg, 40 + static_cast<std::uint64_t>(kv)));
    const auto tokens = random_tokens(45, cfg.vocab_size, 7);
    for (const std::size_t window : {1u, 6u, 16u}) {
      for (const std::size_t chunk : {1u, 5u, 12u})
        run_trained_window<float>(model, tokens, window, chunk, 30, 1e-5);
    }
  }
  const ModelConfig cfg = small_config(4, 2, 64);
  const Model<double> model(random_weights<double>(cfg, 5));
  run_trained_window<double>(model, random_tokens(40, cfg.vocab_size, 8), 7, 4, 21, 1e-12);
}

TEST(WindowStoreTest, FixtureModelWithAWindow) {
  const Model<float> model(load_checkpoint(std::filesystem::path(KVDECODE_TEST_DATA_DIR) /
                                           "llama2c-tiny" / "model.bin"));
  const auto tokens = random_tokens(100, model.config().vocab_size, 9);
  run_trained_window<float>(model, tokens, 24, 16, 60, 1e-4);
}

TEST(WindowStoreTest, CancelAndRollbackAfterEviction) {
  const ModelConfig cfg = small_config(4, 2, 64);
  const Model<float> model(random_weights<float>(cfg, 6));
  const auto tokens = random_tokens(40, cfg.vocab_size, 5);
  const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
  const std::vector<float> ref = forward_reference(model.weights(), tokens, 6);
  WindowStore<float> s(cfg, {.window = 6, .max_chunk = 4, .capacity = 64});
  Activations<float> act(cfg, {.max_chunk = 4});
  const std::span<const std::int32_t> t(tokens);
  for (std::size_t p = 0; p < 24; p += 4) model.prefill(t.subspan(p, 4), s, act);
  // A failed chunk: junk rows written to every layer, then cancelled.
  s.begin_append(t.subspan(24, 4));
  const std::vector<float> junk(32, 50.0f);
  for (std::size_t l = 0; l < 2; ++l)
    for (std::size_t i = 0; i < 4; ++i) s.write(l, i, junk.data(), junk.data());
  s.cancel_append();
  EXPECT_EQ(s.size(), 24u);
  expect_logits_near<float>(model.decode(tokens[24], s, act), ref, 24, vocab, 1e-5, "after cancel");
  for (std::size_t p = 25; p < 30; ++p) (void)model.decode(tokens[p], s, act);
  s.truncate(26);  // back 4 = max_chunk: the keys position 26 needs are still resident
  for (std::size_t p = 26; p < 40; ++p)
    expect_logits_near<float>(model.decode(tokens[p], s, act), ref, p, vocab, 1e-5, "rollback");
  EXPECT_THROW(s.truncate(35), Error);  // back 5 > max_chunk
  EXPECT_EQ(s.size(), 40u);
}

// --- Streaming ------------------------------------------------------------------------------

/// The kept tokens of query q under the streaming policy: the sinks seen so far (positions
/// 0 .. min(S, q+1) - 1: before position S - 1 arrives there are fewer than S), then q's W newest.
std::vector<std::int32_t> kept(const std::vector<std::int32_t>& t, std::size_t q, std::size_t S,
                               std::size_t W) {
  const std::size_t sinks = std::min(S, q + 1);
  std::vector<std::int32_t> k(t.begin(), t.begin() + static_cast<std::ptrdiff_t>(sinks));
  for (std::size_t i = std::max(S, q + 1 - std::min(q + 1, W)); i <= q; ++i) k.push_back(t[i]);
  return k;
}

// Feeds `tokens` into `s` in appends of max_append() (what generate() does): prefill for more
// than one, decode for one. Returns the last token's logits.
template <class T>
std::vector<T> feed_by_max_append(const Model<T>& model, WindowStore<T>& s, Activations<T>& act,
                                  std::span<const std::int32_t> tokens) {
  std::span<const T> logits;
  for (std::size_t done = 0; done < tokens.size();) {
    const std::size_t m = std::min(tokens.size() - done, s.max_append());
    logits = m == 1 ? model.decode(tokens[done], s, act)
                    : model.prefill(tokens.subspan(done, m), s, act);
    done += m;
  }
  return {logits.begin(), logits.end()};
}

// Every combination of window, sinks, policy, the store's max_chunk, the Activations' chunk and
// the prompt length either gives the reference's logits or throws Error naming the append and
// max_chunk, changing nothing. (A ring of W - 1 + max_chunk rows once took a 44-token append
// in one 64-token chunk and overwrote keys its own queries read: NaN logits, no error.) Fed in
// appends of max_append(), every combination works. One layer, so that a streaming store's
// logits are those of a fresh forward over the kept tokens (see below).
TEST(WindowStoreTest, EveryChunkCombinationMatchesTheReferenceOrThrows) {
  ModelConfig cfg = small_config(4, 2, 64);
  cfg.n_layers = 1;
  const Model<float> model(random_weights<float>(cfg, 31));
  const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
  std::size_t refused = 0, ran = 0;
  for (const WindowPolicy policy : {WindowPolicy::kTrainedWindow, WindowPolicy::kStreaming})
    for (const std::size_t S : {0u, 4u})
      for (const std::size_t W : {1u, 4u, 16u})
        for (const std::size_t max_chunk : {1u, 3u, 64u})
          for (const std::size_t chunk : {1u, 5u, 64u})
            for (const std::size_t n : {1u, 10u, 44u}) {
              if (policy == WindowPolicy::kTrainedWindow && S > 0) continue;  // no reference
              const auto tokens = random_tokens(n, cfg.vocab_size, 100 + n);
              const std::vector<float> ref =
                  policy == WindowPolicy::kTrainedWindow
                      ? forward_reference(model.weights(), tokens, W)
                      : forward_reference(model.weights(), kept(tokens, n - 1, S, W));
              const std::size_t last = ref.size() / vocab - 1;
              const WindowOptions o{.window = W,
                                    .sinks = S,
                                    .policy = policy,
                                    .max_chunk = max_chunk,
                                    .capacity = 64};
              const std::string what =
                  "policy " + std::to_string(static_cast<int>(policy)) + " S=" + std::to_string(S) +
                  " W=" + std::to_string(W) + " max_chunk=" + std::to_string(max_chunk) +
                  " chunk=" + std::to_string(chunk) + " n=" + std::to_string(n);
              {
                WindowStore<float> s(cfg, o);
                Activations<float> act(
                    cfg, {.max_chunk = chunk, .store_scratch = s.block_scratch_size()});
                try {
                  const auto logits = model.prefill(tokens, s, act);
                  expect_logits_near<float>(logits, ref, last, vocab, 2e-5, what + " (prefill)");
                  ++ran;
                } catch (const Error& e) {
                  const std::string m = e.what();
                  if (m.find("max_chunk = ") != std::string::npos) {
                    EXPECT_NE(m.find("appending " + std::to_string(n) + " positions"),
                              std::string::npos)
                        << m;
                    EXPECT_NE(m.find("max_chunk = " + std::to_string(max_chunk)), std::string::npos)
                        << m;
                  }
                  EXPECT_EQ(s.size(), 0u) << what;
                  EXPECT_EQ(s.pending(), 0u) << what;
                  ++refused;
                }
              }
              WindowStore<float> s(cfg, o);
              Activations<float> act(cfg,
                                     {.max_chunk = chunk, .store_scratch = s.block_scratch_size()});
              const auto logits = feed_by_max_append(model, s, act, tokens);
              expect_logits_near<float>(logits, ref, last, vocab, 2e-5, what + " (max_append)");
            }
  EXPECT_GT(refused, 0u);
  EXPECT_GT(ran, 0u);
}

// The case that gave NaN: W = 16, max_chunk = 1, a 64-token chunk, a 44-token prefill.
TEST(WindowStoreTest, AnAppendThatWrapsTheRingIsRefusedNamingMaxChunk) {
  const ModelConfig cfg = small_config(4, 2, 64);
  const Model<float> model(random_weights<float>(cfg, 3));
  WindowStore<float> s(cfg, {.window = 16, .max_chunk = 1});
  Activations<float> act(cfg, {.max_chunk = 64, .store_scratch = s.block_scratch_size()});
  const auto tokens = random_tokens(44, cfg.vocab_size, 4);
  try {
    (void)model.prefill(tokens, s, act);
    FAIL() << "a 44-position append to a ring of 16 rows was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("appending 44 positions to 0 wraps the ring of 16 rows "
                                         "(W - 1 + max_chunk), so an append may hold at most "
                                         "max_chunk = 1 positions (or 16 before the ring wraps)"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(s.max_append(), 16u);
  const auto logits = feed_by_max_append(model, s, act, tokens);
  const std::vector<float> ref = forward_reference(model.weights(), tokens, 16);
  expect_logits_near<float>(logits, ref, 43, static_cast<std::size_t>(cfg.vocab_size), 1e-5,
                            "max_append");
  for (const float l : logits) ASSERT_TRUE(std::isfinite(l));
}

// Until the cache is full: without sinks, both policies give ContiguousStore's logits bit for
// bit (the keys are the same rows, read in one block); with sinks the keys come in two blocks
// (sinks, ring), so attention's sums round differently, within f32 rounding.
TEST(WindowStoreTest, BeforeItFillsTheStoreMatchesThePlainCache) {
  const ModelConfig cfg = small_config(4, 2, 64);
  const Model<float> model(random_weights<float>(cfg, 21));
  const auto tokens = random_tokens(24, cfg.vocab_size, 22);
  const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
  for (const WindowPolicy policy : {WindowPolicy::kTrainedWindow, WindowPolicy::kStreaming})
    for (const std::size_t S : {0u, 4u}) {
      // S + W = 28 > 24 tokens: nothing is evicted or re-rotated.
      WindowStore<float> s(cfg, {.window = 24, .sinks = S, .policy = policy, .max_chunk = 8});
      ContiguousStore<float> plain(cfg);
      Activations<float> act(cfg, {.max_chunk = 8, .store_scratch = s.block_scratch_size()}),
          plain_act(cfg, {.max_chunk = 8});
      const auto first = std::span<const std::int32_t>(tokens).first(8);
      std::vector<float> got(8 * vocab), want(8 * vocab);
      model.prefill(first, s, act, got);
      model.prefill(first, plain, plain_act, want);
      for (std::size_t p = 8; p < tokens.size(); ++p) {
        const auto g = model.decode(tokens[p], s, act);
        const auto w = model.decode(tokens[p], plain, plain_act);
        got.insert(got.end(), g.begin(), g.end());
        want.insert(want.end(), w.begin(), w.end());
      }
      const std::string what =
          "policy " + std::to_string(static_cast<int>(policy)) + " S=" + std::to_string(S);
      if (S == 0) {
        EXPECT_EQ(got, want) << what;
      } else {
        for (std::size_t i = 0; i < got.size(); ++i)
          ASSERT_NEAR(got[i], want[i], 1e-5 * (1 + std::abs(want[i]))) << what << " logit " << i;
      }
    }
}

// Sizes are checked against the model before anything is reserved.
TEST(WindowStoreTest, RefusesSizesBeyondTheModel) {
  const ModelConfig cfg = small_config(4, 2, 64);
  const auto streaming = WindowPolicy::kStreaming;
  EXPECT_THROW(WindowStore<float>(cfg, {.window = 65, .policy = streaming}), Error);
  EXPECT_THROW(WindowStore<float>(cfg, {.window = 60, .sinks = 5, .policy = streaming}), Error);
  EXPECT_THROW(WindowStore<float>(cfg, {.window = 8, .max_chunk = 65}), Error);
  EXPECT_THROW(WindowStore<float>(
                   cfg, {.window = static_cast<std::size_t>(-2), .capacity = kUnboundedPositions}),
               Error);
  // Unbounded streaming: the K/V reservation is that of any length.
  WindowStore<float> s(cfg, {.window = 8,
                             .sinks = 2,
                             .policy = streaming,
                             .max_chunk = 4,
                             .capacity = kUnboundedPositions});
  EXPECT_EQ(s.memory_bytes(),
            WindowStore<float>::memory_bytes_for(
                cfg, {.window = 8, .sinks = 2, .policy = streaming, .max_chunk = 4}));
  EXPECT_EQ(s.capacity(), kUnboundedPositions);
}

// Far past its window a store keeps the ids of its sinks and of at least R + max_chunk newest
// positions, in S + 2(R + max_chunk) slots: tokens() is the tail of R ids of what was fed. Rollback
// within max_chunk still works, and a saved cache restores into a fresh store that continues bit
// for bit, holding the same ids; matched against a prompt, such a file offers only its sinks, whose
// ids it still holds.
TEST(WindowStoreTest, FarPastItsWindowItKeepsTheNewestIdsRollsBackAndRestores) {
  const ModelConfig cfg = small_config(4, 2, 64);
  const Model<float> model(random_weights<float>(cfg, 21));
  const std::size_t S = 3, W = 6, chunk = 2, R = W - 1 + chunk, n = 20 * (S + 2 * R);
  const WindowOptions o{.window = W,
                        .sinks = S,
                        .policy = WindowPolicy::kStreaming,
                        .max_chunk = chunk,
                        .capacity = kUnboundedPositions};
  const auto fed = random_tokens(n + 1, cfg.vocab_size, 22);
  WindowStore<float> s(cfg, o);
  Activations<float> act(cfg, {.max_chunk = chunk, .store_scratch = s.block_scratch_size()});
  for (std::size_t p = 0; p < n; ++p) model.decode(fed[p], s, act);
  const auto tail_of = [&](std::size_t end, std::span<const std::int32_t> held) {
    return std::vector<std::int32_t>(fed.begin() + static_cast<long>(end - held.size()),
                                     fed.begin() + static_cast<long>(end));
  };
  ASSERT_EQ(s.size(), n);
  EXPECT_EQ(s.tokens().size(), R);
  EXPECT_GT(s.dropped_tokens(), 0u);
  EXPECT_EQ(std::vector<std::int32_t>(s.tokens().begin(), s.tokens().end()),
            tail_of(n, s.tokens()));

  // Rollback of max_chunk = 2 positions, and the same token again: as if never rolled back.
  const auto first = model.decode(fed[n], s, act);
  const std::vector<float> next(first.begin(), first.end());
  model.decode(fed[n], s, act);
  EXPECT_EQ(s.max_exact_rollback(), chunk);
  s.truncate(n);
  EXPECT_EQ(std::vector<std::int32_t>(s.tokens().begin(), s.tokens().end()),
            tail_of(n, s.tokens()));
  const auto again = model.decode(fed[n], s, act);
  EXPECT_EQ(std::vector<float>(again.begin(), again.end()), next);  // bit for bit
  s.truncate(n);

  const std::filesystem::path file =
      std::filesystem::temp_directory_path() / "kvdecode_window_far_past.kvc";
  save_cache(model, s, file);
  WindowStore<float> restored(cfg, o);
  restore_cache(model, restored, file);
  EXPECT_EQ(restored.size(), n);
  EXPECT_EQ(restored.dropped_tokens(), s.dropped_tokens());
  EXPECT_EQ(std::vector<std::int32_t>(restored.tokens().begin(), restored.tokens().end()),
            std::vector<std::int32_t>(s.tokens().begin(), s.tokens().end()));
  EXPECT_EQ(restored.memory_bytes(), s.memory_bytes());
  Activations<float> act2(cfg, {.max_chunk = chunk, .store_scratch = s.block_scratch_size()});
  const auto a = model.decode(fed[n], s, act);
  const auto b = model.decode(fed[n], restored, act2);
  EXPECT_EQ(std::vector<float>(a.begin(), a.end()), std::vector<float>(b.begin(), b.end()));

  // The prompt is everything fed: only the sinks' ids can be checked against it.
  WindowStore<float> matched(cfg, o);
  EXPECT_EQ(restore_longest_prefix(model_fingerprint(model), matched, fed, file), S);
  EXPECT_EQ(matched.size(), S);
  EXPECT_EQ(std::vector<std::int32_t>(matched.tokens().begin(), matched.tokens().end()),
            std::vector<std::int32_t>(fed.begin(), fed.begin() + static_cast<long>(S)));
  std::filesystem::remove(file);
}

// With one layer the K/V of a token depend on nothing but the token and its RoPE position, so
// the logits of query q must equal those of a fresh forward over the kept tokens at slot
// positions 0 .. S+W-1 (StreamingLLM's assignment): this checks the re-rotation after every
// eviction, in both RoPE conventions.
TEST(WindowStoreTest, StreamingPositionsMatchAFreshForwardOverTheKeptTokens) {
  for (const RopeStyle style : {RopeStyle::kAdjacentPairs, RopeStyle::kHalfSplit}) {
    ModelConfig cfg = small_config(4, 2, 32);
    cfg.n_layers = 1;
    cfg.rope_style = style;
    const Model<float> model(random_weights<float>(cfg, 12));
    const std::size_t S = 4, W = 10, n = 3 * 32;  // three times seq_len
    const auto tokens = random_tokens(n, cfg.vocab_size, 13);
    const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
    WindowStore<float> s(cfg, {.window = W,
                               .sinks = S,
                               .policy = WindowPolicy::kStreaming,
                               .max_chunk = 8,
                               .capacity = n});
    Activations<float> act(cfg, {.max_chunk = 8, .store_scratch = s.block_scratch_size()});
    const std::size_t bytes = s.memory_bytes();
    model.prefill(std::span<const std::int32_t>(tokens).first(8), s, act);
    for (std::size_t q = 8; q < n; ++q) {
      const auto logits = model.decode(tokens[q], s, act);
      const auto k = kept(tokens, q, S, W);
      const std::vector<float> ref = forward_reference(model.weights(), k);
      expect_logits_near<float>(logits, ref, k.size() - 1, vocab, 2e-5, "streaming");
    }
    EXPECT_EQ(s.memory_bytes(), bytes);  // bounded: nothing grows past seq_len
    EXPECT_EQ(s.size(), n);
    EXPECT_EQ(s.rope_position(n - 1), S + W - 1);
  }
}

// With several layers the kept keys of layer 0 still depend only on token and position: the
// keys the store serves query q must be those a fresh cache of the kept tokens holds. The fresh
// cache is filled by decode, one token at a time as the store was, so its values come from the
// same matrix-vector kernel and must match bit for bit (a multi-token prefill takes the
// matrix-matrix path, whose sums round differently); keys went through one extra rotation.
TEST(WindowStoreTest, StreamingLayerZeroKeysEqualAFreshCacheOfTheKeptTokens) {
  const ModelConfig cfg = small_config(4, 2, 64);
  const Model<double> model(random_weights<double>(cfg, 14));
  const std::size_t S = 2, W = 7, n = 60;
  const auto tokens = random_tokens(n, cfg.vocab_size, 15);
  WindowStore<double> s(
      cfg,
      {.window = W, .sinks = S, .policy = WindowPolicy::kStreaming, .max_chunk = 1, .capacity = n});
  Activations<double> act(cfg, {.max_chunk = 1, .store_scratch = s.block_scratch_size()});
  for (std::size_t q = 0; q < n; ++q) {
    (void)model.decode(tokens[q], s, act);
    const auto k = kept(tokens, q, S, W);
    ContiguousStore<double> fresh(cfg, k.size());
    Activations<double> fa(cfg, {.max_chunk = 1});
    for (const std::int32_t token : k) (void)model.decode(token, fresh, fa);
    for (std::size_t h = 0; h < 2; ++h) {
      const auto g = gather(s, 0, h, q + 1);
      ASSERT_EQ(g.indices.size(), k.size()) << "query " << q;
      for (std::size_t r = 0; r < k.size(); ++r)
        for (std::size_t i = 0; i < 16; ++i) {
          ASSERT_NEAR(g.keys[r][i], fresh.key(0, h, r)[i], 1e-12) << "query " << q << " row " << r;
          ASSERT_EQ(g.values[r][i], fresh.value(0, h, r)[i]) << "query " << q << " row " << r;
        }
    }
  }
}

// max_append() is exactly the most begin_append accepts: that many (or any fewer) are taken,
// one more is refused, for both policies over random appends and rollbacks.
TEST(WindowStoreTest, MaxAppendIsExactlyWhatBeginAppendAccepts) {
  const ModelConfig cfg = small_config(4, 2, 64);
  const std::vector<float> row(static_cast<std::size_t>(cfg.kv_dim()), 0.5f);
  for (const WindowPolicy policy : {WindowPolicy::kTrainedWindow, WindowPolicy::kStreaming}) {
    WindowStore<float> s(
        cfg, {.window = 6, .sinks = 2, .policy = policy, .max_chunk = 3, .capacity = 60});
    detail::SplitMix64 rng(17);
    std::size_t appends = 0;
    while (s.size() < s.capacity()) {
      const std::size_t m = s.max_append();
      ASSERT_GE(m, 1u) << "size " << s.size();
      EXPECT_THROW(s.begin_append(test_tokens(s.size(), m + 1)), Error) << "size " << s.size();
      EXPECT_EQ(s.pending(), 0u);
      const std::size_t n = 1 + rng.next() % m;
      s.begin_append(test_tokens(s.size(), n));
      for (std::size_t l = 0; l < s.n_layers(); ++l)
        for (std::size_t i = 0; i < n; ++i) s.write(l, i, row.data(), row.data());
      s.commit_append();
      ++appends;
      if (rng.next() % 4 == 0 && s.size() > 1) s.truncate(s.size() - 1);  // within max_chunk
    }
    EXPECT_GT(appends, 10u);
  }
}

TEST(WindowStoreTest, StreamingRefusesChunksPastAFullCacheAndBadOptions) {
  const ModelConfig cfg = small_config(4, 2, 64);
  WindowStore<float> s(cfg, {.window = 6,
                             .sinks = 2,
                             .policy = WindowPolicy::kStreaming,
                             .max_chunk = 8,
                             .capacity = 100});
  EXPECT_THROW(s.begin_append(test_tokens(0, 9)), Error);  // 9 > S + W
  s.begin_append(test_tokens(0, 8));                       // = S + W: nothing evicted yet
  s.cancel_append();
  EXPECT_THROW(WindowStore<float>(cfg, {.window = 0}), Error);
  EXPECT_THROW(WindowStore<float>(cfg, {.window = 4, .max_chunk = 0}), Error);
}

}  // namespace
}  // namespace kvdecode::testing_util
