// PagedStore and BlockPool: the store conformance suite at several block sizes, paging against
// the contiguous store (bit-identical; the f32 bound where the kernel set's attention products
// sum a fragmented tile per block), keep_runs placing sequences appended in turn,
// fork / copy-on-write, truncate, exhaustion, the prefix cache (hits, collisions, LRU eviction),
// multi-turn continuation, and a decode step that allocates nothing.
// EIGEN_RUNTIME_NO_MALLOC: defined for every test by tests/CMakeLists.txt.
#include "kvdecode/store/paged_store.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "counting_new.hpp"
#include "kvdecode/store/block_pool.hpp"
#include "kvdecode/store/contiguous_store.hpp"
#include "store_conformance.hpp"

namespace kvdecode::testing_util {

/// PagedStore<T> on a pool of BlockSize-position blocks: a distinct type per block size, so the
/// conformance suite runs at each.
template <class T, std::size_t BlockSize>
struct PagedStoreOf : PagedStore<T> {
  explicit PagedStoreOf(BlockPool<T>& pool) : PagedStore<T>(pool) {}
};

template <class T, std::size_t BlockSize>
struct StoreTraits<PagedStoreOf<T, BlockSize>> {
  struct Holder {
    std::unique_ptr<BlockPool<T>> pool;  // declared first: it outlives the sequence
    PagedStoreOf<T, BlockSize> s;
    PagedStoreOf<T, BlockSize>& store() { return s; }
  };
  static std::unique_ptr<Holder> make(const ModelConfig& cfg, std::size_t capacity) {
    // Exactly the blocks one full sequence needs, so the capacity check is the one that trips.
    auto pool = std::make_unique<BlockPool<T>>(cfg, (capacity + BlockSize - 1) / BlockSize,
                                               BlockSize, BlockPoolOptions{capacity});
    BlockPool<T>& p = *pool;
    return std::make_unique<Holder>(Holder{std::move(pool), PagedStoreOf<T, BlockSize>(p)});
  }
  static constexpr bool kExactRows = true;
  static constexpr double kRowTolerance = 0;
  // Blocks change where the online softmax rescales; the f32 bound of the contiguous store holds.
  static constexpr double kLogitTolerance = std::is_same_v<T, float> ? 1e-5 : 1e-12;
  static std::vector<std::size_t> expected_resident(std::size_t end) { return all_indices(end); }
};

using PagedStores = ::testing::Types<PagedStoreOf<float, 16>, PagedStoreOf<double, 16>,
                                     PagedStoreOf<float, 5>, PagedStoreOf<double, 1>>;
INSTANTIATE_TYPED_TEST_SUITE_P(Paged, StoreConformance, PagedStores);

namespace {

using Tokens = std::vector<std::int32_t>;

template <class T>
std::vector<T> copy_of(std::span<const T> s) {
  return {s.begin(), s.end()};
}

/// Logits of the last of `tokens` after they ran through `store`, as prefill then decodes.
template <class T, class S>
std::vector<T> run(const Model<T>& model, S& store, Activations<T>& act, const Tokens& tokens) {
  const std::span<const std::int32_t> all(tokens);
  std::span<const T> logits;
  if (tokens.size() > store.size() + 1)
    logits = model.prefill(all.subspan(store.size(), tokens.size() - 1 - store.size()), store, act);
  logits = model.decode(tokens.back(), store, act);
  return copy_of(logits);
}

/// Expects logits within 1e-5·(1 + |ref|) (f32) or 1e-12 (f64) of row `row` of the reference.
template <class T>
void expect_reference(const std::vector<T>& logits, const std::vector<T>& ref, std::size_t row,
                      const std::string& what) {
  const double tol = std::is_same_v<T, float> ? 1e-5 : 1e-12;
  for (std::size_t i = 0; i < logits.size(); ++i) {
    const double r = ref[row * logits.size() + i];
    ASSERT_NEAR(logits[i], r, tol * (1 + std::abs(r))) << what << ", logit " << i;
  }
}

/// Every block's reference count is the number of listed sequences holding it, and the pool's
/// own invariants hold.
template <class T>
void expect_accounting(const BlockPool<T>& pool, std::initializer_list<const PagedStore<T>*> seqs) {
  std::vector<std::size_t> refs(pool.n_blocks(), 0);
  for (const PagedStore<T>* s : seqs)
    for (const std::size_t b : s->block_table()) ++refs[b];
  for (std::size_t b = 0; b < pool.n_blocks(); ++b) ASSERT_EQ(pool.ref_count(b), refs[b]) << b;
  ASSERT_NO_THROW(pool.check_invariants());
}

void write_rows(PagedStore<float>& s, std::size_t first, std::size_t n) {
  s.begin_append(test_tokens(first, n));
  for (std::size_t l = 0; l < 2; ++l)
    for (std::size_t i = 0; i < n; ++i) {
      const auto k = test_row<float>(l, first + i, 32, false);
      const auto v = test_row<float>(l, first + i, 32, true);
      s.write(l, i, k.data(), v.data());
    }
  s.commit_append();
}

std::vector<KvBlock<float>> blocks_of(const PagedStore<float>& s, std::size_t end) {
  std::vector<KvBlock<float>> blocks;
  s.for_each_block(1, 1, end, {}, [&](const KvBlock<float>& b) { blocks.push_back(b); });
  return blocks;
}

TEST(PagedStoreTest, AppendCrossesPageBoundary) {
  const ModelConfig cfg = small_config(4, 2, 64);
  BlockPool<float> pool(cfg, 8, 4, BlockPoolOptions{.keep_runs = false});
  PagedStore<float> s(pool), other(pool);
  write_rows(s, 0, 6);  // positions 0..5: blocks 0 and 1, 4 + 2 rows
  EXPECT_EQ(s.block_table().size(), 2u);
  EXPECT_EQ(pool.n_free(), 6u);
  // Blocks 0 and 1 are adjacent in the pool, so attention sees one run of 6 rows.
  auto blocks = blocks_of(s, 6);
  ASSERT_EQ(blocks.size(), 1u);
  EXPECT_EQ(blocks[0].n, 6u);
  EXPECT_EQ(blocks[0].stride, 16u);  // a page of one (layer, kv head) is dense [4][head_size]
  EXPECT_EQ(blocks[0].keys[5 * 16 + 3], test_row<float>(1, 5, 32, false)[16 + 3]);  // row 5, head 1
  // Another sequence takes block 2, so this one's third block is 3: two runs.
  write_rows(other, 0, 1);
  write_rows(s, 6, 5);
  EXPECT_EQ(std::vector<std::size_t>(s.block_table().begin(), s.block_table().end()),
            (std::vector<std::size_t>{0, 1, 3}));
  blocks = blocks_of(s, 11);
  ASSERT_EQ(blocks.size(), 2u);
  EXPECT_EQ(blocks[0].first, 0u);
  EXPECT_EQ(blocks[0].n, 8u);
  EXPECT_EQ(blocks[1].first, 8u);
  EXPECT_EQ(blocks[1].n, 3u);
  EXPECT_EQ(blocks[1].keys, pool.keys(3, 1, 1));
  EXPECT_EQ(blocks[1].values[2 * 16], test_row<float>(1, 10, 32, true)[16]);
  EXPECT_EQ(blocks_of(s, 8).size(), 1u);  // end on a block boundary: the second run is unread
  EXPECT_EQ(s.memory_bytes(), 3 * pool.block_bytes() + 4 * 64);  // and an id per position
  EXPECT_EQ(pool.block_bytes(), 2 * 2 * 2 * 4 * 16 * sizeof(float));
  s.release();
  other.release();
  EXPECT_EQ(pool.n_free(), 6u);
  EXPECT_EQ(pool.n_evictable(), 2u);  // the full blocks stay cached for later requests
  expect_accounting(pool, {&s});
}

// Attention's online softmax rescales at every 256-row tile whatever the blocks. A table that is
// one run (a fresh pool) is the contiguous layout, so the logits are bit-identical; so are any
// tables whose breaks fall on tile boundaries (blocks of a multiple of 256 positions). A
// fragmented table of 16-position blocks is bit-identical too where attention takes Eigen's
// products (a tile of several blocks is gathered into one [256][head_size] copy, the contiguous
// store's tile) or the f32 row kernels (the AVX-512 sets, for these chunks of at most
// kMaxRowQueries: no sum depends on the blocks); the kernel set's own products sum per block,
// within the f32 bound.
TEST(PagedStoreTest, MatchesContiguousBitForBitUnlessRunsBreakTiles) {
  const ModelConfig cfg = small_config(4, 2, 700);
  const Model<float> model(random_weights<float>(cfg, 5));
  const Tokens tokens = random_tokens(560, cfg.vocab_size, 9);
  constexpr std::size_t kTile = AttentionScratch<float>::kTile;
  BlockPool<float> one_run_pool(cfg, 700 / 16 + 1, 16);
  // Without keep_runs a filler takes the block after each of a sequence's.
  const BlockPoolOptions interleave{.keep_runs = false};
  BlockPool<float> small_pool(cfg, 2 * (700 / 16 + 1), 16, interleave);
  BlockPool<float> tile_pool(cfg, 2 * (700 / kTile + 1), kTile, interleave);
  ContiguousStore<float> contiguous(cfg);
  PagedStore<float> one_run(one_run_pool), small(small_pool), tiled(tile_pool);
  std::vector<PagedStore<float>> fillers;  // each takes one block between two of a sequence's
  Activations<float> act(cfg, {.max_chunk = 16});
  const auto feed = [&](auto& store, BlockPool<float>* fragment, std::size_t p, std::size_t n) {
    if (fragment != nullptr && store.size() % fragment->block_size() == 0) {
      fillers.emplace_back(*fragment);
      model.decode(1, fillers.back(), act);
    }
    const std::span<const std::int32_t> t = std::span<const std::int32_t>(tokens).subspan(p, n);
    return copy_of(n == 1 ? model.decode(t[0], store, act) : model.prefill(t, store, act));
  };
  // The same calls for every store: 16-token prefills to 512, then decodes.
  for (std::size_t p = 0; p < tokens.size();) {
    const std::size_t n = p < 512 ? 16 : 1;
    const auto c = feed(contiguous, nullptr, p, n);
    const auto o = feed(one_run, nullptr, p, n);
    const auto s = feed(small, &small_pool, p, n);
    const auto t = feed(tiled, &tile_pool, p, n);
    ASSERT_EQ(o, c) << "position " << p;
    ASSERT_EQ(t, c) << "position " << p;
    double scale = 1;
    for (const float x : c) scale = std::max(scale, static_cast<double>(std::abs(x)));
    static_assert(16 <= kMaxRowQueries, "the chunks above take the row kernels where they exist");
    const KernelSet ks = active_kernel_set();
    if (detail::attention_uses_kernels<float>(ks) && !detail::coded_attention_kernels(ks)) {
      ASSERT_LT(max_abs_diff(s, c), 1e-5 * scale) << "position " << p;
    } else {
      ASSERT_EQ(s, c) << "position " << p;
    }
    p += n;
  }
  EXPECT_EQ(one_run.block_table().back(), one_run.block_table().size() - 1);  // one run
  EXPECT_EQ(small.block_table()[1], small.block_table()[0] + 2);              // fragmented
  EXPECT_EQ(tiled.block_table()[1], tiled.block_table()[0] + 2);
}

// In double attention always takes Eigen's products, so a fragmented table of 16-position blocks
// (another sequence's block between every two of its own) gives the contiguous store's bits in
// every build: 16-token prefills whose queries read tiles of 16 blocks, then decodes.
TEST(PagedStoreTest, FragmentedTableMatchesContiguousBitForBitInDouble) {
  const ModelConfig cfg = small_config(4, 2, 600);
  const Model<double> model(random_weights<double>(cfg, 6));
  const Tokens tokens = random_tokens(560, cfg.vocab_size, 10);
  BlockPool<double> pool(cfg, 2 * (600 / 16 + 1), 16, BlockPoolOptions{.keep_runs = false});
  ContiguousStore<double> contiguous(cfg);
  PagedStore<double> paged(pool);
  std::vector<PagedStore<double>> fillers;
  Activations<double> act(cfg, {.max_chunk = 16});
  for (std::size_t p = 0; p < tokens.size();) {
    const std::size_t n = p < 512 ? 16 : 1;
    const std::span<const std::int32_t> t = std::span<const std::int32_t>(tokens).subspan(p, n);
    const auto c =
        copy_of(n == 1 ? model.decode(t[0], contiguous, act) : model.prefill(t, contiguous, act));
    if (paged.size() % 16 == 0) {
      fillers.emplace_back(pool);
      model.decode(1, fillers.back(), act);
    }
    const auto g = copy_of(n == 1 ? model.decode(t[0], paged, act) : model.prefill(t, paged, act));
    ASSERT_EQ(g, c) << "position " << p;
    p += n;
  }
  const auto table = paged.block_table();
  for (std::size_t i = 1; i < table.size(); ++i)
    ASSERT_NE(table[i], table[i - 1] + 1) << "block " << i << " is adjacent to the previous one";
}

// Four sequences taking a position each in turn: with keep_runs each grows into its own part of
// the pool (A from block 0, B from the middle of the rest, C and D in the middles of the halves
// left), so each table is one run; without it they take every fourth block.
TEST(PagedStoreTest, SequencesAppendedInTurnKeepTheirBlocksInOneRun) {
  const ModelConfig cfg = small_config(4, 2, 64);
  for (const bool keep_runs : {true, false}) {
    BlockPool<float> pool(cfg, 64, 4, BlockPoolOptions{.keep_runs = keep_runs});
    std::vector<PagedStore<float>> seqs;
    for (int i = 0; i < 4; ++i) seqs.emplace_back(pool);
    for (std::size_t p = 0; p < 40; ++p)
      for (auto& s : seqs) write_rows(s, p, 1);
    const std::vector<std::size_t> first = {0, 32, 16, 48};
    for (std::size_t q = 0; q < seqs.size(); ++q) {
      const auto table = seqs[q].block_table();
      ASSERT_EQ(table.size(), 10u);
      for (std::size_t i = 0; i < table.size(); ++i)
        EXPECT_EQ(table[i], keep_runs ? first[q] + i : q + 4 * i)
            << "sequence " << q << ", block " << i << ", keep_runs " << keep_runs;
      EXPECT_EQ(blocks_of(seqs[q], 40).size(), keep_runs ? 1u : 10u);
    }
    pool.check_invariants();
  }
}

// Prompts of two blocks opened one after another in a pool with one block of slack per
// sequence, then each grows by a block in turn. A new run of `want` blocks goes in the longest
// free run [s, s + len), centred: at s + (len - want) / 2. A at 0 (the pool's start); B in
// [2, 12) at 2 + 4 = 6; C in [2, 6) at 2 + 1 = 3; D in [8, 12) at 8 + 1 = 9. Each then grows
// into the free block after its last, so every table stays one run. (Placing the run at the
// middle of the free run instead, s + len / 2, puts D at 10 and leaves it no block to grow into.)
TEST(PagedStoreTest, PromptsTakenTogetherLeaveEachSequenceRoomToGrow) {
  const ModelConfig cfg = small_config(4, 2, 64);
  BlockPool<float> pool(cfg, 12, 4);
  std::vector<PagedStore<float>> seqs;
  for (int i = 0; i < 4; ++i) seqs.emplace_back(pool);
  for (auto& s : seqs) write_rows(s, 0, 8);
  for (auto& s : seqs) write_rows(s, 8, 1);
  const std::vector<std::size_t> first = {0, 6, 3, 9};
  for (std::size_t q = 0; q < seqs.size(); ++q) {
    const auto table = seqs[q].block_table();
    ASSERT_EQ(table.size(), 3u);
    for (std::size_t i = 0; i < table.size(); ++i)
      EXPECT_EQ(table[i], first[q] + i) << "sequence " << q << ", block " << i;
    EXPECT_EQ(blocks_of(seqs[q], 9).size(), 1u);
  }
  EXPECT_EQ(pool.n_free(), 0u);
  pool.check_invariants();
}

// A fork's first append copies the shared partial last block and takes fresh blocks after it:
// the copy asks for all of them (want = copy + fresh), so the run is centred as one. Parent at
// blocks 0-1 (6 rows of 4), the child appends 9 rows (positions 6..14): the copy and 2 fresh
// blocks, 3 in all, in the free run [2, 20), which block 1 (held) precedes: at 2 + (18 - 3) / 2
// = 9. (A copy that asked for itself alone would sit at 2 + (18 - 1) / 2 = 10.)
TEST(PagedStoreTest, CopyOnWriteAppendIsCentredWithItsFreshBlocks) {
  const ModelConfig cfg = small_config(4, 2, 64);
  BlockPool<float> pool(cfg, 20, 4);
  PagedStore<float> parent(pool);
  write_rows(parent, 0, 6);
  PagedStore<float> child = parent.fork();
  write_rows(child, 6, 9);
  const std::size_t first = 2 + (18 - 3) / 2;
  const std::vector<std::size_t> expected = {0, first, first + 1, first + 2};
  const auto table = child.block_table();
  EXPECT_EQ(std::vector<std::size_t>(table.begin(), table.end()), expected);
  EXPECT_EQ(parent.block_table()[1], 1u);  // the parent keeps the original
  pool.check_invariants();
}

// A batch of sequences whose contexts straddle a block boundary (16..31 rows past 7 full blocks
// of 16), set up one after another in a pool of exactly 9 blocks per sequence, then decoding in
// turn and rolled back after each step: every sequence's table stays one run throughout, so
// attention reads each sequence's keys in place.
TEST(PagedStoreTest, BatchInAnExactlySizedPoolKeepsEverySequenceOneRun) {
  const ModelConfig cfg = small_config(4, 2, 256);
  constexpr std::size_t kBatch = 16;
  BlockPool<float> pool(cfg, kBatch * 9, 16, BlockPoolOptions{0, false});
  std::vector<PagedStore<float>> seqs;
  seqs.reserve(kBatch);
  for (std::size_t b = 0; b < kBatch; ++b) {
    seqs.emplace_back(pool);
    write_rows(seqs.back(), 0, 120 + b);
  }
  for (int step = 0; step < 3; ++step) {
    for (auto& s : seqs) write_rows(s, s.size(), 1);
    for (std::size_t b = 0; b < kBatch; ++b) {
      const std::size_t end = seqs[b].size();
      ASSERT_EQ(seqs[b].block_table().size(), (end + 15) / 16) << "sequence " << b;
      EXPECT_EQ(blocks_of(seqs[b], end).size(), 1u) << "sequence " << b << ", step " << step;
    }
    for (auto& s : seqs) s.truncate(s.size() - 1);
  }
  pool.check_invariants();
}

TEST(PagedStoreTest, ForkSharesEveryBlockAndCopiesOnWrite) {
  const ModelConfig cfg = small_config(4, 2, 64);
  const Model<double> model(random_weights<double>(cfg, 11));
  BlockPool<double> pool(cfg, 16, 8);
  Activations<double> act(cfg, {.max_chunk = 16});
  const Tokens prompt = random_tokens(13, cfg.vocab_size, 1);  // 1 full block + 5 rows
  PagedStore<double> parent(pool);
  model.prefill(prompt, parent, act);
  PagedStore<double> child = parent.fork();
  EXPECT_EQ(pool.n_held(), 2u);  // no block was copied by the fork
  EXPECT_EQ(pool.ref_count(parent.block_table()[1]), 2u);
  expect_accounting(pool, {&parent, &child});

  // Parallel sampling: each continues with its own token. The first write to the shared partial
  // block copies it; the second sequence then owns the original and writes in place.
  Tokens a = prompt, b = prompt;
  a.push_back(3);
  b.push_back(40);
  const auto la = copy_of(model.decode(a.back(), child, act));
  EXPECT_EQ(pool.n_held(), 3u);
  EXPECT_NE(child.block_table()[1], parent.block_table()[1]);
  EXPECT_EQ(child.block_table()[0], parent.block_table()[0]);  // full blocks stay shared
  expect_accounting(pool, {&parent, &child});
  const auto lb = copy_of(model.decode(b.back(), parent, act));
  EXPECT_EQ(pool.n_held(), 3u);
  expect_reference(la, model.forward_reference(a), a.size() - 1, "child");
  expect_reference(lb, model.forward_reference(b), b.size() - 1, "parent");
  EXPECT_EQ(copy_of(child.tokens()), a);
  EXPECT_EQ(copy_of(parent.tokens()), b);
  parent.begin_append(Tokens{1});
  EXPECT_THROW(parent.fork(), Error);  // no fork during an append
  parent.cancel_append();
  expect_accounting(pool, {&parent, &child});
}

TEST(PagedStoreTest, TruncateReturnsBlocksAndRollsBack) {
  const ModelConfig cfg = small_config(4, 2, 64);
  const Model<double> model(random_weights<double>(cfg, 12));
  BlockPool<double> pool(cfg, 16, 4);
  Activations<double> act(cfg, {.max_chunk = 16});
  Tokens tokens = random_tokens(30, cfg.vocab_size, 2);
  PagedStore<double> s(pool);
  model.prefill(tokens, s, act);
  EXPECT_EQ(pool.n_held(), 8u);
  // Speculative decoding: 30 tokens, of which the last 9 were a rejected draft.
  s.truncate(21);
  EXPECT_EQ(pool.n_held(), 6u);
  EXPECT_FALSE(pool.is_cached(s.block_table()[5]));  // partial, ours alone: writable in place
  EXPECT_EQ(pool.n_evictable(), 1u);                 // the dropped full block 6 stays cached
  EXPECT_THROW(s.truncate(22), Error);
  tokens.resize(21);
  tokens.push_back(7);
  const auto logits = copy_of(model.decode(7, s, act));
  EXPECT_EQ(pool.n_held(), 6u);  // no copy-on-write: the block was ours alone
  expect_reference(logits, model.forward_reference(tokens), 21, "after rollback");
  s.truncate(0);
  EXPECT_EQ(pool.n_held(), 0u);
  expect_accounting(pool, {&s});
}

TEST(PagedStoreTest, ExhaustedPoolThrowsAndLeavesEverySequenceIntact) {
  const ModelConfig cfg = small_config(4, 2, 64);
  const Model<double> model(random_weights<double>(cfg, 13));
  BlockPool<double> pool(cfg, 5, 4, BlockPoolOptions{0, false});
  Activations<double> act(cfg, {.max_chunk = 16});
  PagedStore<double> a(pool), b(pool);
  model.prefill(random_tokens(10, cfg.vocab_size, 3), a, act);  // 3 blocks
  model.prefill(random_tokens(3, cfg.vocab_size, 4), b, act);   // 1 block
  const Tokens a_tokens = copy_of(a.tokens());
  const std::vector<std::size_t> a_table(a.block_table().begin(), a.block_table().end());
  try {
    model.prefill(random_tokens(7, cfg.vocab_size, 5), a, act);  // 10 + 7 → 5 blocks, 2 new
    FAIL() << "expected the pool to be exhausted";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("appending 7 tokens at position 10 needs 2 blocks but the pool has 1 "
                        "available (1 free, 0 cached evictable) of 5"),
              std::string::npos)
        << what;
  }
  EXPECT_EQ(copy_of(a.tokens()), a_tokens);
  EXPECT_EQ(std::vector<std::size_t>(a.block_table().begin(), a.block_table().end()), a_table);
  EXPECT_EQ(a.pending(), 0u);
  EXPECT_EQ(pool.n_free(), 1u);
  expect_accounting(pool, {&a, &b});
  // A fork whose first write needs a copy fails the same way once the pool is full.
  PagedStore<double> c = b.fork();
  for (const std::int32_t t : {1, 2, 3}) model.decode(t, a, act);  // the third takes a block
  EXPECT_EQ(pool.n_available(), 0u);
  EXPECT_THROW(model.decode(2, c, act), Error);
  EXPECT_EQ(c.size(), 3u);
  expect_accounting(pool, {&a, &b, &c});
}

TEST(PagedStoreTest, SecondRequestWithTheSameSystemPromptPrefillsOnlyItsSuffix) {
  ModelConfig cfg = small_config(4, 2, 512);
  const Model<float> model(random_weights<float>(cfg, 21));
  BlockPool<float> pool(cfg, 64, 16);
  BlockPool<float> fresh_pool(cfg, 64, 16, BlockPoolOptions{0, false});
  Activations<float> act(cfg, {.max_chunk = 64});
  WorkCounters counters;
  act.counters = &counters;
  const Tokens system = random_tokens(256, cfg.vocab_size, 100);
  Tokens first = system, second = system;
  for (const auto t : random_tokens(21, cfg.vocab_size, 101)) first.push_back(t);
  for (const auto t : random_tokens(13, cfg.vocab_size, 102)) second.push_back(t);

  {
    PagedStore<float> r1 = PagedStore<float>::open(pool, first);
    EXPECT_EQ(r1.size(), 0u);
    model.prefill(first, r1, act);
    EXPECT_EQ(pool.stats().misses, 17u);  // 277 tokens: 17 full blocks, none cached yet
  }                                       // r1 released: its blocks stay cached
  EXPECT_EQ(pool.n_evictable(), 17u);

  counters = {};
  PagedStore<float> r2 = PagedStore<float>::open(pool, second);
  EXPECT_EQ(r2.size(), 256u);
  EXPECT_EQ(pool.stats().hits, 16u);
  EXPECT_EQ(pool.stats().misses, 17u);  // 269 tokens hold 16 full blocks: all hits
  EXPECT_EQ(pool.stats().tokens_saved, 256u);
  const std::span<const std::int32_t> all(second);
  const auto cached = copy_of(model.prefill(all.subspan(r2.size()), r2, act));
  EXPECT_EQ(counters.prefill.tokens, 13u);  // only the suffix ran through the model

  // The same logits as a fresh run: bit for bit against a paged store without the cache (the
  // prefix's K/V were computed in the same 64-token chunks), within f32 of the reference.
  PagedStore<float> fresh(fresh_pool);
  model.prefill(all.first(256), fresh, act);
  const auto uncached = copy_of(model.prefill(all.subspan(256), fresh, act));
  EXPECT_EQ(cached, uncached);
  const auto ref = model.forward_reference(second);
  expect_reference(cached, ref, second.size() - 1, "cached request");
  // And within f32 of a single-call contiguous prefill.
  ContiguousStore<float> contiguous(cfg);
  EXPECT_LT(max_abs_diff(cached, copy_of(model.prefill(second, contiguous, act))), 1e-4);
}

// A prompt that is all cached blocks: the sequence holds all but its last token, in a block that
// stays shared, so the first append copies that block instead of recomputing 16 tokens.
TEST(PagedStoreTest, WholePromptHitCopiesTheLastBlock) {
  const ModelConfig cfg = small_config(4, 2, 128);
  const Model<double> model(random_weights<double>(cfg, 22));
  BlockPool<double> pool(cfg, 16, 16);
  Activations<double> act(cfg, {.max_chunk = 32});
  const Tokens prompt = random_tokens(32, cfg.vocab_size, 7);
  PagedStore<double> r1 = PagedStore<double>::open(pool, prompt);
  model.prefill(prompt, r1, act);
  PagedStore<double> r2 = PagedStore<double>::open(pool, prompt);
  EXPECT_EQ(r2.size(), 31u);
  EXPECT_EQ(pool.stats().tokens_saved, 31u);
  EXPECT_EQ(r2.block_table()[1], r1.block_table()[1]);
  const auto logits = copy_of(model.decode(prompt.back(), r2, act));
  EXPECT_NE(r2.block_table()[1], r1.block_table()[1]);
  expect_reference(logits, model.forward_reference(prompt), 31, "whole-prompt hit");
  expect_accounting(pool, {&r1, &r2});
}

// With 2-bit hashes nearly every lookup collides; a match must still be the same prefix, which
// the K/V show: every request's logits equal the reference of its own tokens.
TEST(PagedStoreTest, HashCollisionsNeverMatchADifferentPrefix) {
  const ModelConfig cfg = small_config(4, 2, 64);
  const Model<double> model(random_weights<double>(cfg, 23));
  BlockPool<double> pool(cfg, 128, 4, BlockPoolOptions{0, true, 2});
  Activations<double> act(cfg, {.max_chunk = 16});
  const Tokens base = random_tokens(16, cfg.vocab_size, 8);
  std::vector<PagedStore<double>> live;
  for (std::uint64_t r = 0; r < 12; ++r) {
    // Requests share 0..3 leading blocks with base, then differ.
    const std::size_t shared = r % 4 * 4;
    Tokens prompt(base.begin(), base.begin() + static_cast<std::ptrdiff_t>(shared));
    for (const auto t : random_tokens(14 - shared % 8, cfg.vocab_size, 200 + r))
      prompt.push_back(t);
    const std::uint64_t hits_before = pool.stats().hits;
    PagedStore<double> s = PagedStore<double>::open(pool, prompt);
    // From the fifth request on, base's leading blocks were cached by request r % 4.
    if (r >= 4) {
      EXPECT_GE(pool.stats().hits - hits_before, shared / 4) << "request " << r;
    }
    const auto logits = run(model, s, act, prompt);
    expect_reference(logits, model.forward_reference(prompt), prompt.size() - 1,
                     "request " + std::to_string(r));
    live.push_back(std::move(s));
  }
  ASSERT_NO_THROW(pool.check_invariants());
}

TEST(PagedStoreTest, EvictsTheLeastRecentlyUsedCachedBlocksLastBlockFirst) {
  const ModelConfig cfg = small_config(4, 2, 64);
  const Model<double> model(random_weights<double>(cfg, 24));
  BlockPool<double> pool(cfg, 6, 4);
  Activations<double> act(cfg, {.max_chunk = 16});
  const Tokens a = random_tokens(13, cfg.vocab_size, 30);  // 3 full blocks + 1 row
  const Tokens b = random_tokens(9, cfg.vocab_size, 31);   // 2 full blocks + 1 row
  std::vector<std::size_t> a_blocks, b_blocks;
  {
    PagedStore<double> s = PagedStore<double>::open(pool, a);
    model.prefill(a, s, act);
    a_blocks.assign(s.block_table().begin(), s.block_table().end());
  }
  {
    PagedStore<double> s = PagedStore<double>::open(pool, b);
    model.prefill(b, s, act);
    b_blocks.assign(s.block_table().begin(), s.block_table().end());
  }
  EXPECT_EQ(pool.n_evictable(), 5u);  // the partial last blocks went back to the free list
  EXPECT_EQ(pool.n_free(), 1u);
  // A request for 8 new tokens needs 2 blocks: the free one, then a's last full block (a is
  // older than b, and a prefix's later blocks go first).
  PagedStore<double> c(pool);
  model.prefill(random_tokens(8, cfg.vocab_size, 32), c, act);
  EXPECT_EQ(pool.stats().evictions, 1u);
  EXPECT_EQ(c.block_table()[1], a_blocks[2]);
  EXPECT_TRUE(pool.is_cached(a_blocks[1]));
  EXPECT_TRUE(pool.is_cached(b_blocks[1]));
  // a's first two blocks are still a prefix hit.
  PagedStore<double> again = PagedStore<double>::open(pool, a);
  EXPECT_EQ(again.size(), 8u);
  const auto logits = run(model, again, act, a);
  expect_reference(logits, model.forward_reference(a), a.size() - 1, "after eviction");
  expect_accounting(pool, {&c, &again});
}

TEST(PagedStoreTest, MultiTurnContinuationPrefillsOnlyTheNewTurn) {
  const ModelConfig cfg = small_config(4, 2, 128);
  const Model<double> model(random_weights<double>(cfg, 25));
  BlockPool<double> pool(cfg, 16, 16);
  Activations<double> act(cfg, {.max_chunk = 32});
  WorkCounters counters;
  act.counters = &counters;
  Tokens conversation = random_tokens(20, cfg.vocab_size, 40);
  PagedStore<double> s = PagedStore<double>::open(pool, conversation);
  model.prefill(conversation, s, act);
  for (const std::int32_t t : {5, 9, 17}) {  // the reply, token by token
    model.decode(t, s, act);
    conversation.push_back(t);
  }
  const Tokens turn2 = random_tokens(11, cfg.vocab_size, 41);
  counters = {};
  const auto logits = copy_of(model.prefill(turn2, s, act));
  conversation.insert(conversation.end(), turn2.begin(), turn2.end());
  EXPECT_EQ(counters.prefill.tokens, 11u);
  EXPECT_EQ(copy_of(s.tokens()), conversation);
  expect_reference(logits, model.forward_reference(conversation), conversation.size() - 1,
                   "second turn");
}

TEST(PagedStoreTest, DecodeAllocatesNothingEvenWhenItTakesABlock) {
  const ModelConfig cfg = small_config(4, 2, 200);
  const Model<float> model(random_weights<float>(cfg, 26));
  BlockPool<float> pool(cfg, 13, 16);
  Activations<float> act(cfg, {.max_chunk = 1});
  const Tokens tokens = random_tokens(200, cfg.vocab_size, 50);
  PagedStore<float> s = PagedStore<float>::open(pool, tokens);
  model.decode(tokens[0], s, act);  // warm-up outside the counted region
  const long before = g_allocations.load();
  Eigen::internal::set_is_malloc_allowed(false);
  for (std::size_t p = 1; p < tokens.size(); ++p) model.decode(tokens[p], s, act);
  Eigen::internal::set_is_malloc_allowed(true);
  EXPECT_EQ(g_allocations.load() - before, 0) << "heap allocations during decode";
  EXPECT_EQ(s.size(), 200u);
  EXPECT_EQ(pool.n_held(), 13u);  // 12 of them entered the prefix cache on the way
}

TEST(PagedStoreTest, RejectsBadPoolsAndSequencesWithoutAPool) {
  const ModelConfig cfg = small_config(4, 2, 64);
  EXPECT_THROW(BlockPool<float>(cfg, 0, 16), Error);
  EXPECT_THROW(BlockPool<float>(cfg, 4, 0), Error);
  EXPECT_THROW(BlockPool<float>(cfg, 4, 16, BlockPoolOptions{0, true, 0}), Error);
  PagedStore<float> none;
  EXPECT_EQ(none.capacity(), 0u);
  EXPECT_THROW(none.begin_append(Tokens{1}), Error);
  BlockPool<float> pool(cfg, 4, 16);
  PagedStore<float> s(pool);
  s.begin_append(test_tokens(0, 3));
  EXPECT_THROW(s.begin_append(test_tokens(0, 1)), Error);  // one append at a time
  EXPECT_THROW(s.truncate(0), Error);
  s.cancel_append();
  EXPECT_EQ(pool.n_free(), 4u);
}

}  // namespace
}  // namespace kvdecode::testing_util
