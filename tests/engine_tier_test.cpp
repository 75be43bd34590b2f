// Engine with a prefix directory: an engine serves requests sharing a long prefix and is
// destroyed; a new engine on the same directory loads the prefix's full blocks from disk and
// prefills exactly the rest, with the tokens of an engine without a tier; memory and disk hits
// are counted apart; a corrupt or foreign block file is skipped and counted, and the output stays
// exact; bad tier options are errors naming what is wrong.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "kvdecode/serving/engine.hpp"
#include "test_util.hpp"

namespace kvdecode::testing_util {
namespace {

namespace fs = std::filesystem;
using Tokens = std::vector<std::int32_t>;
using Bytes = std::vector<unsigned char>;

/// A fresh, empty directory for one test, removed again at its end.
struct ScratchDir {
  fs::path path;
  explicit ScratchDir(const std::string& name)
      : path(fs::temp_directory_path() /
             ("kvdecode_engine_tier_" + name + "_" + std::to_string(::getpid()))) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

std::vector<fs::path> block_files(const fs::path& dir) {
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".kvblock") files.push_back(e.path());
  return files;
}

Bytes read_bytes(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), {});
}

void write_bytes(const fs::path& file, const Bytes& bytes) {
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

/// The block file whose payload starts with `tokens` (docs/FORMATS.md §4: a 192-byte header,
/// then the block's token ids as little-endian int32).
fs::path file_holding(const fs::path& dir, std::span<const std::int32_t> tokens) {
  for (const fs::path& f : block_files(dir)) {
    const Bytes b = read_bytes(f);
    bool same = b.size() >= 192 + 4 * tokens.size();
    for (std::size_t i = 0; same && i < tokens.size(); ++i) {
      std::uint32_t v = 0;
      for (std::size_t k = 4; k-- > 0;) v = (v << 8) | b[192 + 4 * i + k];
      same = static_cast<std::int32_t>(v) == tokens[i];
    }
    if (same) return f;
  }
  return {};
}

void run_to_completion(Engine<double>& engine) {
  for (int i = 0; i < 100000 && engine.step(); ++i) {
  }
}

constexpr std::size_t kBlock = 16;

class EngineTierTest : public ::testing::Test {
 protected:
  EngineTierTest()
      : cfg_(small_config(4, 2, 128)),
        model_(random_weights<double>(cfg_, 41)),
        dir_("restart"),
        prefix_(random_tokens(3 * kBlock + 5, cfg_.vocab_size, 500)) {}

  /// prefix_ followed by n tokens of their own.
  Tokens with_tail(std::size_t n, std::uint64_t seed) const {
    Tokens t = prefix_;
    for (const auto x : random_tokens(n, cfg_.vocab_size, seed)) t.push_back(x);
    return t;
  }

  EngineOptions options(bool tier) const {
    EngineOptions o{.n_blocks = 32, .block_size = kBlock, .max_running = 4, .step_tokens = 64};
    if (tier) o.prefix_dir = dir_.path;
    return o;
  }

  /// The first process: two requests sharing prefix_, served together, then the engine is
  /// destroyed. Each feeds 53 + 7 + 8 - 1 = 67 positions, 4 full blocks; the first 3 are the
  /// shared prefix's: 5 distinct blocks, all written to disk by the destructor.
  void serve_first_process() {
    {
      Engine<double> engine(model_, options(true));
      const auto a = engine.submit({.prompt = with_tail(7, 501), .max_tokens = 8});
      const auto b = engine.submit({.prompt = with_tail(7, 502), .max_tokens = 8});
      run_to_completion(engine);
      ASSERT_EQ(a->tokens().size(), 8u);
      ASSERT_EQ(b->tokens().size(), 8u);
      EXPECT_EQ(engine.metrics().tier.files_written, 0u);  // nothing evicted yet
    }
    ASSERT_EQ(block_files(dir_.path).size(), 5u);
  }

  /// `prompt` alone on an engine without a tier.
  Tokens without_tier(const Tokens& prompt, std::size_t max_tokens) {
    Engine<double> engine(model_, options(false));
    const auto s = engine.submit({.prompt = prompt, .max_tokens = max_tokens});
    run_to_completion(engine);
    return s->tokens();
  }

  ModelConfig cfg_;
  Model<double> model_;
  ScratchDir dir_;
  Tokens prefix_;  // [53] three full blocks and 5 tokens
};

TEST_F(EngineTierTest, RestartedEngineLoadsTheSharedPrefixFromDisk) {
  serve_first_process();
  Engine<double> engine(model_, options(true));
  EXPECT_EQ(engine.metrics().tier.files_on_disk, 5u);  // listed at construction
  const Tokens q = with_tail(9, 503);
  const auto s = engine.submit({.prompt = q, .max_tokens = 10});
  run_to_completion(engine);
  // The full blocks q shares with the first process: 53 / 16 = 3 (the fourth holds other tails).
  const std::size_t shared = (prefix_.size() / kBlock) * kBlock;
  EXPECT_EQ(s->usage().cached_tokens, shared);
  EXPECT_EQ(s->usage().cached_from_disk_tokens, shared);
  EXPECT_EQ(s->usage().prefilled_tokens, q.size() - shared);
  EXPECT_EQ(s->tokens(), without_tier(q, 10));
  EngineMetrics m = engine.metrics();
  EXPECT_TRUE(m.prefix_tier);
  EXPECT_EQ(m.prefix_block_hits, 0u);
  EXPECT_EQ(m.prefix_block_disk_hits, prefix_.size() / kBlock);
  EXPECT_EQ(m.prefix_block_misses, q.size() / kBlock - prefix_.size() / kBlock);
  EXPECT_EQ(m.tokens_reused, shared);
  EXPECT_EQ(m.tokens_from_disk, shared);
  EXPECT_EQ(m.tokens_prefilled, q.size() - shared);
  EXPECT_EQ(m.tier.files_skipped(), 0u);
  EXPECT_EQ(m.tier.files_on_disk, 5u);

  // The same prefix again: now from memory, nothing more from disk.
  const Tokens r = with_tail(4, 504);
  const auto t = engine.submit({.prompt = r, .max_tokens = 6});
  run_to_completion(engine);
  EXPECT_EQ(t->usage().cached_tokens, shared);
  EXPECT_EQ(t->usage().cached_from_disk_tokens, 0u);
  EXPECT_EQ(t->tokens(), without_tier(r, 6));
  m = engine.metrics();
  EXPECT_EQ(m.prefix_block_hits, prefix_.size() / kBlock);
  EXPECT_EQ(m.prefix_block_disk_hits, prefix_.size() / kBlock);
  EXPECT_EQ(m.tokens_from_disk, shared);

  // An explicit flush offers every cached block and writes those not on disk yet: q fed
  // 62 + 10 - 1 = 71 positions, 4 full blocks, the fourth new; r fed 57 + 6 - 1 = 62, 3 blocks.
  EXPECT_EQ(engine.flush_prefix_tier(), 4u);
  EXPECT_EQ(engine.metrics().tier.files_written, 1u);
  EXPECT_EQ(block_files(dir_.path).size(), 6u);
}

TEST_F(EngineTierTest, ACorruptFileIsSkippedCountedAndTheOutputStaysExact) {
  serve_first_process();
  // The file of the prefix's second block: one payload byte flipped.
  const fs::path second =
      file_holding(dir_.path, std::span<const std::int32_t>(prefix_).subspan(kBlock, kBlock));
  ASSERT_FALSE(second.empty());
  Bytes b = read_bytes(second);
  b[b.size() - 7] ^= 0x10;
  write_bytes(second, b);

  Engine<double> engine(model_, options(true));
  const Tokens q = with_tail(9, 505);
  const auto s = engine.submit({.prompt = q, .max_tokens = 10});
  run_to_completion(engine);
  // The first block loads; the second is skipped, so the match ends there.
  EXPECT_EQ(s->usage().cached_from_disk_tokens, kBlock);
  EXPECT_EQ(s->usage().prefilled_tokens, q.size() - kBlock);
  EXPECT_EQ(s->tokens(), without_tier(q, 10));
  const EngineMetrics m = engine.metrics();
  EXPECT_EQ(m.prefix_block_disk_hits, 1u);
  EXPECT_EQ(m.tier.skipped_for(TierSkip::kCorrupt), 1u);
  EXPECT_EQ(m.tier.files_skipped(), 1u);
  EXPECT_FALSE(fs::exists(second));  // a corrupt file is removed
}

TEST_F(EngineTierTest, AForeignModelsFileIsSkippedCountedAndTheOutputStaysExact) {
  serve_first_process();
  // The prefix's first block as another model's weights would have written it: a valid file
  // (header checksum recomputed) whose fingerprint differs.
  const fs::path first =
      file_holding(dir_.path, std::span<const std::int32_t>(prefix_).first(kBlock));
  ASSERT_FALSE(first.empty());
  namespace pt = detail::prefix_tier;
  Bytes b = read_bytes(first);
  pt::put_u64(b.data() + pt::kOffWeightsHash, pt::get_u64(b.data() + pt::kOffWeightsHash) ^ 1);
  pt::put_u64(b.data() + pt::kOffHeaderHash, Checksum::hash(b.data(), pt::kOffHeaderHash));
  write_bytes(first, b);

  Engine<double> engine(model_, options(true));
  const Tokens q = with_tail(9, 506);
  const auto s = engine.submit({.prompt = q, .max_tokens = 10});
  run_to_completion(engine);
  EXPECT_EQ(s->usage().cached_tokens, 0u);
  EXPECT_EQ(s->usage().prefilled_tokens, q.size());
  EXPECT_EQ(s->tokens(), without_tier(q, 10));
  const EngineMetrics m = engine.metrics();
  EXPECT_EQ(m.prefix_block_disk_hits, 0u);
  EXPECT_EQ(m.tier.skipped_for(TierSkip::kModel), 1u);
  EXPECT_EQ(m.tier.files_skipped(), 1u);
}

TEST_F(EngineTierTest, AnEngineWithoutADirectoryHasNoTier) {
  Engine<double> engine(model_, options(false));
  const auto s = engine.submit({.prompt = with_tail(3, 507), .max_tokens = 4});
  run_to_completion(engine);
  EXPECT_EQ(engine.prefix_tier(), nullptr);
  EXPECT_EQ(engine.flush_prefix_tier(), 0u);
  const EngineMetrics m = engine.metrics();
  EXPECT_FALSE(m.prefix_tier);
  EXPECT_EQ(m.prefix_block_disk_hits, 0u);
  EXPECT_EQ(m.prefix_block_misses, 3u);
  EXPECT_EQ(m.tier.files_written, 0u);
  EXPECT_TRUE(block_files(dir_.path).empty());
}

void expect_error(const std::function<void()>& f, const std::string& part) {
  try {
    f();
    ADD_FAILURE() << "no Error; expected one saying '" << part << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

TEST_F(EngineTierTest, BadTierOptionsAreErrorsNamingThem) {
  // One block file of this model in double: header, 16 tokens, keys and values of 2 layers ×
  // 2 kv heads × 16 positions × head size 16.
  const std::size_t file = 192 + 4 * kBlock + 2 * 2 * 2 * kBlock * 16 * sizeof(double);
  const fs::path fresh = dir_.path / "not_yet";
  EngineOptions o = options(true);
  o.prefix_dir = fresh;
  o.prefix_max_bytes = file - 1;
  expect_error([&] { Engine<double>(model_, o); }, "prefix_max_bytes " + std::to_string(file - 1) +
                                                       " is smaller than one block file (" +
                                                       std::to_string(file) +
                                                       " bytes at block_size 16)");
  EXPECT_FALSE(fs::exists(fresh));  // refused before the directory was made
  o.prefix_max_bytes = file;
  o.prefix_cache = false;
  expect_error([&] { Engine<double>(model_, o); }, "needs prefix_cache");
  o.prefix_cache = true;
  write_bytes(dir_.path / "a_file", Bytes{1, 2, 3});
  o.prefix_dir = dir_.path / "a_file" / "prefixes";
  expect_error([&] { Engine<double>(model_, o); },
               "directory '" + o.prefix_dir.string() + "' cannot be created");
  o.prefix_dir = fresh;
  Engine<double> ok(model_, o);  // exactly one file fits
  EXPECT_EQ(ok.prefix_tier()->file_bytes(), file);
}

}  // namespace
}  // namespace kvdecode::testing_util
