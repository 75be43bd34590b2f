// WorkCounters: exact counts from real prefill / decode / generate runs, cached and uncached,
// against closed-form sums written out here as plain loops (not the arithmetic of count()).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "kvdecode/io/checkpoint.hpp"
#include "kvdecode/kvdecode.hpp"
#include "test_util.hpp"

namespace kvdecode {
namespace {

using testing_util::random_tokens;
using testing_util::small_config;

/// The shape numbers the formulas use, as 64-bit unsigned values.
struct Shape {
  std::uint64_t L, H, n_kv, hs, dim, vocab;
  explicit Shape(const ModelConfig& c)
      : L(static_cast<std::uint64_t>(c.n_layers)),
        H(static_cast<std::uint64_t>(c.n_heads)),
        n_kv(static_cast<std::uint64_t>(c.n_kv_heads)),
        hs(static_cast<std::uint64_t>(c.head_size())),
        dim(static_cast<std::uint64_t>(c.dim)),
        vocab(static_cast<std::uint64_t>(c.vocab_size)) {}
};

/// Σ_{i=1..k} i: the causal triangle of one k-token prefill (query i sees keys 1..i).
std::uint64_t triangle(std::uint64_t k) {
  std::uint64_t s = 0;
  for (std::uint64_t i = 1; i <= k; ++i) s += i;
  return s;
}

/// Runs generate() for n tokens after prompt and returns its counters.
WorkCounters run_generate(const Model<double>& model, ContiguousStore<double>& cache,
                          const std::vector<std::int32_t>& prompt, std::size_t n, bool use_cache) {
  const ModelConfig& cfg = model.config();
  Activations<double> act(
      cfg, {.max_chunk = static_cast<std::size_t>(cfg.seq_len)});  // one chunk per call
  WorkCounters counters;
  act.counters = &counters;
  Sampler sampler(cfg.vocab_size, SamplerOptions{0.0, 0.9, 0, 1});
  GenerationOptions opt;
  opt.max_new_tokens = n;
  opt.use_cache = use_cache;
  const GenerationStats st = generate(model, cache, act, std::span<const std::int32_t>(prompt),
                                      sampler, opt, [](std::int32_t) {});
  EXPECT_EQ(st.generated_tokens, n);
  return counters;
}

// generate() prefills the p-token prompt (its logits give token 1), then feeds tokens 1 .. n-1
// back: the n-th token is sampled but never fed. So the loop runs n - 1 steps; step t (1-based)
// runs the token at cache index p + t - 1, which sees p + t keys.
TEST(CountersTest, CachedGenerateMatchesClosedForms) {
  const ModelConfig cfg = small_config(4, 2, 64);
  const Shape s(cfg);
  const Model<double> model(random_weights<double>(cfg, 3));
  const std::uint64_t p = 5, n = 12;
  // Capacity exactly p + n - 1, so the store is full at the end and its size is the formula's T.
  ContiguousStore<double> cache(cfg, p + n - 1);
  const auto prompt = random_tokens(p, cfg.vocab_size, 1);
  const WorkCounters c = run_generate(model, cache, prompt, n, true);

  std::uint64_t decode_scores = 0, decode_rows_read = 0;
  for (std::uint64_t t = 1; t <= n - 1; ++t) {
    decode_scores += p + t;
    decode_rows_read += p + t;
  }
  EXPECT_EQ(c.prefill.tokens, p);
  EXPECT_EQ(c.decode.tokens, n - 1);
  // K/V projections: p + (n - 1) per layer, each token once.
  EXPECT_EQ(c.prefill.kv_projections, p * s.L);
  EXPECT_EQ(c.decode.kv_projections, (n - 1) * s.L);
  EXPECT_EQ(c.total().kv_projections, (p + n - 1) * s.L);
  // Scores per layer and query head: the prompt's triangle, then p + t per step.
  EXPECT_EQ(c.prefill.attention_scores, triangle(p) * s.H * s.L);
  EXPECT_EQ(c.decode.attention_scores, decode_scores * s.H * s.L);
  // KV bytes written = 2 × n_layers × n_kv_heads × head_size × T × sizeof(T), T = p + n - 1,
  // which is exactly what the store reserved for K and V (whole 64-byte lines here), beside a
  // 4-byte token id per position.
  const std::uint64_t T = p + n - 1;
  EXPECT_EQ(c.total().kv_bytes_written, 2 * s.L * s.n_kv * s.hs * T * sizeof(double));
  EXPECT_EQ(c.total().kv_bytes_written + 4 * T, cache.memory_bytes());
  // Each step reads every cached row of every kv head once.
  EXPECT_EQ(c.decode.kv_bytes_read, 2 * s.L * s.n_kv * s.hs * decode_rows_read * sizeof(double));
  EXPECT_EQ(c.prefill.kv_bytes_read, 2 * s.L * s.n_kv * s.hs * p * sizeof(double));
}

// Without the cache, step t re-runs all p + t tokens (prefill into a reset store): every K/V is
// recomputed and each step pays the whole causal triangle.
TEST(CountersTest, UncachedGenerateMatchesClosedForms) {
  const ModelConfig cfg = small_config(4, 2, 64);
  const Shape s(cfg);
  const Model<double> model(random_weights<double>(cfg, 3));
  const std::uint64_t p = 5, n = 12;
  ContiguousStore<double> cache(cfg);
  const auto prompt = random_tokens(p, cfg.vocab_size, 1);
  const WorkCounters c = run_generate(model, cache, prompt, n, false);

  std::uint64_t tokens = p, scores = triangle(p), rows_read = p;
  for (std::uint64_t t = 1; t <= n - 1; ++t) {
    tokens += p + t;
    scores += (p + t) * (p + t + 1) / 2;
    rows_read += p + t;
  }
  EXPECT_EQ(c.decode, PhaseCounters{});  // the uncached loop never calls decode()
  EXPECT_EQ(c.prefill.tokens, tokens);
  EXPECT_EQ(c.prefill.kv_projections, tokens * s.L);
  EXPECT_EQ(c.prefill.attention_scores, scores * s.H * s.L);
  EXPECT_EQ(c.prefill.kv_bytes_written, 2 * s.L * s.n_kv * s.hs * tokens * sizeof(double));
  EXPECT_EQ(c.prefill.kv_bytes_read, 2 * s.L * s.n_kv * s.hs * rows_read * sizeof(double));
}

// The closed forms, for n tokens fed after a p-token prompt with prefill()/decode() directly:
// cached, p + n K/V projections per layer and Σ_{t=1..n} (p+t) scores per layer and head;
// uncached (re-running p + t tokens for each t), Σ (p+t) projections and Σ (p+t)(p+t+1)/2 scores
// (the causal triangle of p + t tokens, ~ (p+t)²/2).
TEST(CountersTest, ClosedFormsForNFedTokens) {
  const ModelConfig cfg = small_config(4, 1, 64);  // MQA: reads scale with n_kv_heads = 1
  const Shape s(cfg);
  const Model<double> model(random_weights<double>(cfg, 5));
  const std::uint64_t p = 7, n = 9;
  const auto seq = random_tokens(p + n, cfg.vocab_size, 2);
  const std::span<const std::int32_t> all(seq);
  Activations<double> act(cfg, {.max_chunk = 64});

  WorkCounters cached;
  act.counters = &cached;
  ContiguousStore<double> cache(cfg);
  model.prefill(all.first(p), cache, act);
  for (std::uint64_t t = 1; t <= n; ++t) model.decode(seq[p + t - 1], cache, act);

  WorkCounters uncached;
  act.counters = &uncached;
  for (std::uint64_t t = 1; t <= n; ++t) {
    cache.reset();
    model.prefill(all.first(p + t), cache, act);
  }

  std::uint64_t sum_pt = 0, sum_tri = 0;
  for (std::uint64_t t = 1; t <= n; ++t) {
    sum_pt += p + t;
    sum_tri += (p + t) * (p + t + 1) / 2;
  }
  EXPECT_EQ(cached.total().kv_projections, (p + n) * s.L);
  EXPECT_EQ(uncached.total().kv_projections, sum_pt * s.L);
  EXPECT_EQ(cached.decode.attention_scores, sum_pt * s.H * s.L);
  EXPECT_EQ(uncached.total().attention_scores, sum_tri * s.H * s.L);
  EXPECT_EQ(cached.total().kv_bytes_written, 2 * s.L * s.n_kv * s.hs * (p + n) * sizeof(double));
}

// A decode step streams every layer matrix, gain and the classifier once, plus its token's
// embedding row; FLOPs are 2 per multiply-add of the layer matrices, the classifier and attention.
TEST(CountersTest, DecodeStepWeightBytesAndFlops) {
  for (const bool shared : {true, false}) {
    ModelConfig cfg = small_config(4, 2, 64);
    cfg.shared_classifier = shared;
    const Shape s(cfg);
    const Model<double> model(random_weights<double>(cfg, 7));
    const auto prompt = random_tokens(10, cfg.vocab_size, 3);
    ContiguousStore<double> cache(cfg);
    Activations<double> act(cfg, {.max_chunk = 16});
    model.prefill(prompt, cache, act);
    WorkCounters c;
    act.counters = &c;
    model.decode(4, cache, act);  // cache index 10: sees 11 keys

    std::uint64_t matrix_params = 0;  // multiply-adds per token of the layer projections
    for (const auto& lw : model.weights().layers)
      matrix_params += lw.wq.size() + lw.wk.size() + lw.wv.size() + lw.wo.size() + lw.w1.size() +
                       lw.w2.size() + lw.w3.size();
    const std::uint64_t keys = 11;
    // With a separate classifier the embedding table is not streamed, only the token's row.
    const std::uint64_t unread = shared ? 0 : model.weights().token_embedding.bytes();
    EXPECT_EQ(c.decode.weight_bytes_read, model.weights().bytes() - unread + s.dim * sizeof(double))
        << "shared " << shared;
    EXPECT_EQ(c.decode.flops,
              2 * matrix_params + 2 * s.vocab * s.dim + 2 * 2 * keys * s.hs * s.H * s.L)
        << "shared " << shared;
    EXPECT_EQ(c.decode.attention_scores, keys * s.H * s.L);
    EXPECT_EQ(c.decode.kv_bytes_read, 2 * keys * s.n_kv * s.hs * s.L * sizeof(double));
  }
}

// With bf16 weights a decode step reads half the weight bytes; the cache stays in f32.
TEST(CountersTest, Bf16WeightsCountTheirOwnBytes) {
  const ModelConfig cfg = small_config(4, 2, 32);
  const Shape s(cfg);
  const Model<float, bf16> model(convert_weights<bf16>(random_weights<float>(cfg, 9)));
  ContiguousStore<float> cache(cfg);
  Activations<float> act(cfg, {.max_chunk = 4});
  WorkCounters c;
  act.counters = &c;
  model.decode(1, cache, act);
  EXPECT_EQ(c.decode.weight_bytes_read, model.weights().bytes() + s.dim * sizeof(bf16));
  EXPECT_EQ(c.decode.kv_bytes_written, 2 * s.n_kv * s.hs * s.L * sizeof(float));
}

// Chunking a prefill changes neither which K/V are computed nor which scores are visible.
TEST(CountersTest, ChunkedPrefillCountsTheSameProjectionsAndScores) {
  const ModelConfig cfg = small_config(4, 2, 64);
  const Shape s(cfg);
  const Model<double> model(random_weights<double>(cfg, 11));
  const auto prompt = random_tokens(29, cfg.vocab_size, 4);
  WorkCounters whole, chunked;
  for (auto [chunk, counters] :
       {std::pair{std::size_t{64}, &whole}, std::pair{std::size_t{8}, &chunked}}) {
    ContiguousStore<double> cache(cfg);
    Activations<double> act(cfg, {.max_chunk = chunk});
    act.counters = counters;
    model.prefill(prompt, cache, act);
  }
  EXPECT_EQ(chunked.prefill.tokens, whole.prefill.tokens);
  EXPECT_EQ(chunked.prefill.kv_projections, 29 * s.L);
  EXPECT_EQ(chunked.prefill.attention_scores, triangle(29) * s.H * s.L);
  EXPECT_EQ(chunked.prefill.attention_scores, whole.prefill.attention_scores);
  EXPECT_EQ(chunked.prefill.kv_bytes_written, whole.prefill.kv_bytes_written);
  EXPECT_EQ(chunked.prefill.flops, whole.prefill.flops);
}

// Counting is observation only: the logits are bit-identical with and without counters, and
// without a counters object nothing is recorded anywhere.
TEST(CountersTest, CountingDoesNotChangeResults) {
  const ModelConfig cfg = small_config(4, 2, 32);
  const Model<float> model(random_weights<float>(cfg, 13));
  const auto prompt = random_tokens(6, cfg.vocab_size, 5);
  std::vector<std::vector<float>> logits[2];
  for (const bool counted : {false, true}) {
    ContiguousStore<float> cache(cfg);
    Activations<float> act(cfg, {.max_chunk = 8});
    WorkCounters c;
    if (counted) act.counters = &c;
    auto l = model.prefill(prompt, cache, act);
    logits[counted].emplace_back(l.begin(), l.end());
    l = model.decode(2, cache, act);
    logits[counted].emplace_back(l.begin(), l.end());
    EXPECT_EQ(c.total().tokens, counted ? 7u : 0u);
  }
  EXPECT_EQ(logits[0], logits[1]);
}

// A failed call (full cache) counts nothing, as it changes nothing.
TEST(CountersTest, FailedCallCountsNothing) {
  const ModelConfig cfg = small_config(4, 2, 4);
  const Model<float> model(random_weights<float>(cfg, 13));
  ContiguousStore<float> cache(cfg);
  Activations<float> act(cfg, {.max_chunk = 4});
  WorkCounters c;
  act.counters = &c;
  const std::vector<std::int32_t> four{1, 2, 3, 4};
  model.prefill(four, cache, act);
  const WorkCounters before = c;
  EXPECT_THROW(model.decode(1, cache, act), Error);
  EXPECT_EQ(c.prefill, before.prefill);
  EXPECT_EQ(c.decode, before.decode);
}

// ---------------------------------------------------------------------------------------------
// K/V bytes read, per store: what attention really asks each store for (measured by a wrapper
// that counts the rows every for_each_block hands out), and what the counters report (the bytes
// of the store's own representation), both against formulas written here.

/// A store that forwards everything to S and counts the rows attention is handed.
template <class S>
class CountingStore {
 public:
  using Scalar = typename S::Scalar;
  using Options = typename S::Options;
  static constexpr std::string_view kName = S::kName;
  static constexpr std::uint32_t kFileTag = S::kFileTag;
  static std::uint64_t memory_bytes_for(const ModelConfig& c, const Options& o) {
    return S::memory_bytes_for(c, o);
  }
  template <class... A>
  explicit CountingStore(A&&... a) : s_(std::forward<A>(a)...) {}

  std::size_t size() const { return s_.size(); }
  std::size_t pending() const { return s_.pending(); }
  std::size_t capacity() const { return s_.capacity(); }
  std::size_t n_layers() const { return s_.n_layers(); }
  std::size_t n_kv_heads() const { return s_.n_kv_heads(); }
  std::size_t head_size() const { return s_.head_size(); }
  std::size_t memory_bytes() const { return s_.memory_bytes(); }
  Options options() const { return s_.options(); }
  std::size_t max_append() const { return s_.max_append(); }
  std::uint64_t read_bytes(std::size_t end) const { return s_.read_bytes(end); }
  std::size_t max_exact_rollback() const { return s_.max_exact_rollback(); }
  std::size_t rope_position(std::size_t i) const { return s_.rope_position(i); }
  std::size_t block_scratch_size() const { return s_.block_scratch_size(); }
  void begin_append(std::span<const std::int32_t> t) { s_.begin_append(t); }
  std::span<const std::int32_t> tokens() const { return s_.tokens(); }
  void write(std::size_t l, std::size_t i, const Scalar* k, const Scalar* v) {
    s_.write(l, i, k, v);
  }
  void commit_append() { s_.commit_append(); }
  void cancel_append() noexcept { s_.cancel_append(); }
  void truncate(std::size_t n) { s_.truncate(n); }
  void reset() { s_.reset(); }
  bool masks(std::size_t q, std::size_t k) const requires MaskingKvStore<S> {
    return s_.masks(q, k);
  }
  template <class Sink>
  void for_each_block(std::size_t l, std::size_t h, std::size_t end, std::span<Scalar> scratch,
                      Sink&& sink) const {
    s_.for_each_block(l, h, end, scratch, [&](const KvBlock<Scalar>& b) {
      rows += b.n;
      past_end = past_end || b.first + b.n > end;
      sink(b);
    });
  }

  mutable std::uint64_t rows = 0;  ///< rows handed to attention, over every (layer, kv head)
  mutable bool past_end = false;   ///< whether a block reached past the end asked for
  S s_;
};

/// Prefills p tokens in chunks of `chunk`, then decodes n more, on store `s`; returns the cache
/// index each attention pass ended at (the chunk's or the token's end) and the counters.
template <class S>
std::vector<std::uint64_t> run_counted(const Model<float>& model, S& s, std::size_t p,
                                       std::size_t n, std::size_t chunk, WorkCounters& c) {
  const ModelConfig& cfg = model.config();
  const auto seq = random_tokens(p + n, cfg.vocab_size, 4);
  Activations<float> act(cfg, {.max_chunk = chunk, .store_scratch = s.block_scratch_size()});
  act.counters = &c;
  std::vector<std::uint64_t> ends;
  // The prompt in appends of at most `chunk` positions, as generate() feeds a store whose
  // max_append() is smaller (a window's ring): one pass each.
  for (std::size_t done = 0; done < p;) {
    const std::size_t m = std::min({chunk, p - done, s.max_append()});
    model.prefill(std::span<const std::int32_t>(seq).subspan(done, m), s, act);
    done += m;
    ends.push_back(done);
  }
  for (std::size_t t = p; t < p + n; ++t) {
    model.decode(seq[t], s, act);
    ends.push_back(t + 1);
  }
  return ends;
}

/// Checks the measured rows and the counted bytes of one store against rows(end) (positions
/// attention must see for cache indices [0, end)) and bytes(end) (their bytes in the store).
template <class S, class Rows, class Bytes>
void expect_reads(const char* what, const Model<float>& model, S& s, Rows rows, Bytes bytes) {
  const Shape sh(model.config());
  WorkCounters c;
  const std::vector<std::uint64_t> ends = run_counted(model, s, 13, 9, 4, c);
  std::uint64_t want_rows = 0, want_bytes = 0;
  for (const std::uint64_t e : ends) {
    want_rows += rows(e) * sh.L * sh.n_kv;
    want_bytes += bytes(e);
  }
  EXPECT_EQ(s.rows, want_rows) << what;
  EXPECT_FALSE(s.past_end) << what;
  EXPECT_EQ(c.total().kv_bytes_read, want_bytes) << what;
}

TEST(CountersTest, KvBytesReadAreWhatEachStoreHoldsForTheAttendedPositions) {
  const ModelConfig cfg = small_config(4, 2, 64);
  const Shape sh(cfg);
  const Model<float> model(random_weights<float>(cfg, 8));
  const std::uint64_t f32_row = 2 * sh.L * sh.n_kv * sh.hs * sizeof(float);  // K and V
  const auto all = [](std::uint64_t e) { return e; };

  CountingStore<ContiguousStore<float>> contiguous(cfg);
  expect_reads("contiguous", model, contiguous, all, [&](std::uint64_t e) { return e * f32_row; });

  // int8: a code per element and an f32 scale per row.
  CountingStore<Int8Store<float>> int8(cfg);
  expect_reads("int8", model, int8, all,
               [&](std::uint64_t e) { return e * 2 * sh.L * sh.n_kv * (sh.hs + sizeof(float)); });

  // 4-bit, G = 8, no residual window: full groups as codes (G·hs/2 bytes for each of K and V)
  // with an f16 (min, step) per key channel and per value row; the open group's rows in f32.
  const std::uint64_t G = 8;
  CountingStore<Q4Store<float>> q4(cfg, 0, G, 0);
  expect_reads("q4", model, q4, all, [&](std::uint64_t e) {
    const std::uint64_t groups = e / G;
    return groups * sh.L * sh.n_kv * (G * sh.hs + 4 * sh.hs + 4 * G) + (e - groups * G) * f32_row;
  });

  // A trained window of W = 6 with S = 2 sinks and a ring of W - 1 + 4 rows: the sinks and
  // whatever of the ring holds its index, min(end, S + R) positions.
  const WindowOptions wo{.window = 6, .sinks = 2, .max_chunk = 4};
  CountingStore<WindowStore<float>> window(cfg, wo);
  const std::uint64_t resident = wo.sinks + wo.window - 1 + wo.max_chunk;
  const auto window_rows = [&](std::uint64_t e) { return std::min(e, resident); };
  expect_reads("window", model, window, window_rows,
               [&](std::uint64_t e) { return window_rows(e) * f32_row; });

  // Paged blocks of 5: every position, read in place.
  BlockPool<float> pool(cfg, 8, 5);
  CountingStore<PagedStore<float>> paged(pool);
  expect_reads("paged", model, paged, all, [&](std::uint64_t e) { return e * f32_row; });
}

}  // namespace
}  // namespace kvdecode
