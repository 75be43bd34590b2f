// PrefixTier: blocks evicted from a pool go to files, a restarted process (a new pool and tier on
// the same directory) loads them for a prompt with the same prefix and prefills only the rest,
// with the logits of a fresh computation; corrupt, truncated and foreign files are skipped and
// counted; the byte cap evicts the least recently used file; an unwritable directory is an Error.
#include "kvdecode/serving/prefix_tier.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <vector>

#include "kvdecode/store/contiguous_store.hpp"
#include "kvdecode/store/paged_store.hpp"
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
             ("kvdecode_prefix_tier_" + name + "_" + std::to_string(::getpid()))) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

std::set<std::string> block_files(const fs::path& dir) {
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".kvblock") names.insert(e.path().filename().string());
  return names;
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

template <class T>
std::vector<T> copy_of(std::span<const T> s) {
  return {s.begin(), s.end()};
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

/// Runs `prompt` as a request on `pool`: opens it (longest cached prefix), prefills the rest.
template <class T>
void prefill_request(const Model<T>& model, BlockPool<T>& pool, Activations<T>& act,
                     const Tokens& prompt) {
  PagedStore<T> s = PagedStore<T>::open(pool, prompt);
  model.prefill(std::span<const std::int32_t>(prompt).subspan(s.size()), s, act);
}

constexpr std::size_t kBlock = 16;

// ---------------------------------------------------------------------------------------------

TEST(PrefixTierTest, RestartReusesEvictedBlocksAndPrefillsOnlyTheRest) {
  const ModelConfig cfg = small_config(4, 2, 256);
  const Model<float> model(random_weights<float>(cfg, 31));
  const ModelFingerprint fp = model_fingerprint(model);
  ScratchDir dir("restart");
  Activations<float> act(cfg, {.max_chunk = 64});
  WorkCounters counters;
  act.counters = &counters;
  const Tokens prompt = random_tokens(3 * kBlock + 5, cfg.vocab_size, 300);  // 3 full blocks
  const Tokens question = random_tokens(2, cfg.vocab_size, 301);             // decoded after it
  const std::span<const std::int32_t> all(prompt);

  {  // The first process: computes the prompt, then an unrelated request evicts its blocks.
    BlockPool<float> pool(cfg, 8, kBlock);
    PrefixTier<float> tier(fp, {.directory = dir.path, .max_bytes = 1 << 20});
    tier.attach(pool);
    {
      PagedStore<float> s(pool);
      model.prefill(all.first(3 * kBlock), s, act);  // the chunks the check below repeats
      model.prefill(all.subspan(3 * kBlock), s, act);
    }
    EXPECT_EQ(pool.n_evictable(), 3u);
    EXPECT_EQ(tier.stats().files_written, 0u);  // nothing is written before an eviction
    prefill_request(model, pool, act, random_tokens(8 * kBlock, cfg.vocab_size, 302));
    EXPECT_EQ(pool.stats().evictions, 3u);
    EXPECT_EQ(tier.stats().files_written, 3u);
    EXPECT_EQ(tier.stats().files_on_disk, 3u);
    EXPECT_EQ(tier.stats().bytes_on_disk, 3 * tier.file_bytes());
    // header 192 + tokens 16 × 4 + keys and values 2 × 2 layers × 2 kv heads × 16 × 16 × 4.
    EXPECT_EQ(tier.file_bytes(), 192u + 64u + 2u * 2u * 2u * 16u * 16u * 4u);
  }
  EXPECT_EQ(block_files(dir.path).size(), 3u);

  // The second process: a new pool and tier on the same directory.
  BlockPool<float> pool(cfg, 8, kBlock);
  PrefixTier<float> tier(fp, {.directory = dir.path, .max_bytes = 1 << 20});
  tier.attach(pool);
  EXPECT_EQ(tier.stats().files_on_disk, 3u);
  counters = {};
  PagedStore<float> s = PagedStore<float>::open(pool, prompt);
  EXPECT_EQ(s.size(), 3 * kBlock);
  EXPECT_EQ(pool.stats().hits, 0u);    // none in memory
  EXPECT_EQ(pool.stats().misses, 3u);  // all three asked of the tier
  EXPECT_EQ(tier.stats().disk_hits, 3u);
  EXPECT_EQ(tier.stats().disk_misses, 0u);
  EXPECT_EQ(pool.stats().tokens_saved, 3 * kBlock);
  ASSERT_NO_THROW(pool.check_invariants());
  const auto cached = copy_of(model.prefill(all.subspan(s.size()), s, act));
  EXPECT_EQ(counters.prefill.tokens, prompt.size() - 3 * kBlock);  // 5: only the partial block
  const auto decoded = copy_of(model.decode(question[0], s, act));

  // A fresh computation without any cache, in the same chunks: bit for bit.
  BlockPool<float> fresh_pool(cfg, 8, kBlock, BlockPoolOptions{0, false});
  PagedStore<float> fresh(fresh_pool);
  model.prefill(all.first(3 * kBlock), fresh, act);
  EXPECT_EQ(cached, copy_of(model.prefill(all.subspan(3 * kBlock), fresh, act)));
  EXPECT_EQ(decoded, copy_of(model.decode(question[0], fresh, act)));
  // A contiguous store, one prefill: the f32 bound. And the reference forward.
  ContiguousStore<float> contiguous(cfg);
  model.prefill(prompt, contiguous, act);
  const auto contiguous_decoded = copy_of(model.decode(question[0], contiguous, act));
  for (std::size_t i = 0; i < decoded.size(); ++i)
    ASSERT_NEAR(decoded[i], contiguous_decoded[i], 1e-5 * (1 + std::abs(contiguous_decoded[i])));
  Tokens with_question = prompt;
  with_question.push_back(question[0]);
  expect_reference(decoded, model.forward_reference(with_question), prompt.size(), "decode");
}

// The same in double, with the tier's spill_cached() writing the blocks instead of an eviction,
// and a prompt that is exactly its full blocks (the last one is then shared, and copied).
TEST(PrefixTierTest, SpillCachedThenRestartInDouble) {
  const ModelConfig cfg = small_config(4, 1, 256);
  const Model<double> model(random_weights<double>(cfg, 32));
  const ModelFingerprint fp = model_fingerprint(model);
  ScratchDir dir("double");
  Activations<double> act(cfg, {.max_chunk = 64});
  WorkCounters counters;
  act.counters = &counters;
  const Tokens prompt = random_tokens(4 * kBlock, cfg.vocab_size, 310);
  {
    BlockPool<double> pool(cfg, 16, kBlock);
    PrefixTier<double> tier(fp, {.directory = dir.path, .max_bytes = 1 << 22});
    tier.attach(pool);
    prefill_request(model, pool, act, prompt);
    EXPECT_EQ(pool.spill_cached(), 4u);
    EXPECT_EQ(tier.stats().files_written, 4u);
  }
  BlockPool<double> pool(cfg, 16, kBlock);
  PrefixTier<double> tier(fp, {.directory = dir.path, .max_bytes = 1 << 22});
  tier.attach(pool);
  counters = {};
  PagedStore<double> s = PagedStore<double>::open(pool, prompt);
  EXPECT_EQ(s.size(), prompt.size() - 1);  // the last token is always computed
  EXPECT_EQ(tier.stats().disk_hits, 4u);
  const auto logits =
      copy_of(model.prefill(std::span<const std::int32_t>(prompt).subspan(s.size()), s, act));
  EXPECT_EQ(counters.prefill.tokens, 1u);
  expect_reference(logits, model.forward_reference(prompt), prompt.size() - 1, "f64");
}

// ---------------------------------------------------------------------------------------------
// Files the tier must not use. Each case writes one valid block file (a 17-token prompt: one
// full block), replaces its bytes, and starts a new pool and tier on the directory.

class PrefixTierSkipTest : public ::testing::Test {
 protected:
  PrefixTierSkipTest()
      : cfg_(small_config(4, 2, 64)),
        model_(random_weights<float>(cfg_, 33)),
        fp_(model_fingerprint(model_)),
        act_(cfg_, {.max_chunk = 64}),
        dir_("skip"),
        prompt_(random_tokens(kBlock + 1, cfg_.vocab_size, 320)) {}

  /// One block file of `prompt` (block size bs) written by a tier of this model (or `fp`), as
  /// bytes and file name.
  template <class T>
  std::pair<Bytes, std::string> produce(const ModelFingerprint& fp, const Tokens& prompt,
                                        std::size_t bs, const std::string& tag) {
    ScratchDir d("produce_" + tag);
    const Model<T> model(random_weights<T>(cfg_, 33));
    Activations<T> act(cfg_, {.max_chunk = 64});
    BlockPool<T> pool(cfg_, 8, bs);
    PrefixTier<T> tier(fp, {.directory = d.path, .max_bytes = 1 << 20});
    tier.attach(pool);
    prefill_request(model, pool, act, prompt);
    EXPECT_EQ(pool.spill_cached(), (prompt.size()) / bs);
    const auto names = block_files(d.path);
    EXPECT_GE(names.size(), 1u);
    return {read_bytes(d.path / *names.begin()), *names.begin()};
  }

  /// Writes `bytes` as the block file of prompt_, then runs prompt_ on a new pool and tier.
  PrefixTierStats run_with(const Bytes& bytes) {
    fs::remove_all(dir_.path);
    fs::create_directories(dir_.path);
    write_bytes(dir_.path / name_, bytes);
    BlockPool<float> pool(cfg_, 8, kBlock);
    PrefixTier<float> tier(fp_, {.directory = dir_.path, .max_bytes = 1 << 20});
    tier.attach(pool);
    PagedStore<float> s = PagedStore<float>::open(pool, prompt_);
    EXPECT_EQ(s.size(), 0u);  // never used
    EXPECT_NO_THROW(pool.check_invariants());
    // The request still computes the right logits.
    const auto logits = copy_of(model_.prefill(prompt_, s, act_));
    expect_reference(logits, model_.forward_reference(prompt_), prompt_.size() - 1, "after skip");
    return tier.stats();
  }

  void SetUp() override {
    auto [bytes, name] = produce<float>(fp_, prompt_, kBlock, "valid");
    valid_ = std::move(bytes);
    name_ = std::move(name);
  }

  ModelConfig cfg_;
  Model<float> model_;
  ModelFingerprint fp_;
  Activations<float> act_;
  ScratchDir dir_;
  Tokens prompt_;
  Bytes valid_;
  std::string name_;
};

void expect_skipped_once(const PrefixTierStats& st, TierSkip reason) {
  EXPECT_EQ(st.skipped_for(reason), 1u) << kTierSkipNames[static_cast<std::size_t>(reason)];
  EXPECT_EQ(st.files_skipped(), 1u);
  EXPECT_EQ(st.disk_hits, 0u);
  EXPECT_EQ(st.disk_misses, 1u);
}

TEST_F(PrefixTierSkipTest, TheValidFileIsUsed) {
  fs::remove_all(dir_.path);
  fs::create_directories(dir_.path);
  write_bytes(dir_.path / name_, valid_);
  BlockPool<float> pool(cfg_, 8, kBlock);
  PrefixTier<float> tier(fp_, {.directory = dir_.path, .max_bytes = 1 << 20});
  tier.attach(pool);
  PagedStore<float> s = PagedStore<float>::open(pool, prompt_);
  EXPECT_EQ(s.size(), kBlock);
  EXPECT_EQ(tier.stats().disk_hits, 1u);
  EXPECT_EQ(tier.stats().files_skipped(), 0u);
}

TEST_F(PrefixTierSkipTest, CorruptPayloadByte) {
  Bytes b = valid_;
  b[b.size() - 3] ^= 0x20;
  expect_skipped_once(run_with(b), TierSkip::kCorrupt);
  EXPECT_FALSE(fs::exists(dir_.path / name_));  // a useless file is removed
}

TEST_F(PrefixTierSkipTest, CorruptHeaderByte) {
  Bytes b = valid_;
  b[40] ^= 0x01;  // a config field, under the header checksum
  expect_skipped_once(run_with(b), TierSkip::kCorrupt);
}

TEST_F(PrefixTierSkipTest, TruncatedPayload) {
  expect_skipped_once(run_with(Bytes(valid_.begin(), valid_.end() - 100)), TierSkip::kTruncated);
}

TEST_F(PrefixTierSkipTest, TruncatedHeader) {
  expect_skipped_once(run_with(Bytes(valid_.begin(), valid_.begin() + 100)), TierSkip::kTruncated);
  expect_skipped_once(run_with(Bytes{}), TierSkip::kTruncated);
}

TEST_F(PrefixTierSkipTest, TrailingBytes) {
  Bytes b = valid_;
  b.push_back(0);
  expect_skipped_once(run_with(b), TierSkip::kCorrupt);
}

TEST_F(PrefixTierSkipTest, OtherFormatVersion) {
  namespace pt = detail::prefix_tier;
  Bytes b = valid_;
  pt::put_u32(b.data() + pt::kOffVersion, 2);
  pt::put_u64(b.data() + pt::kOffHeaderHash, Checksum::hash(b.data(), pt::kOffHeaderHash));
  expect_skipped_once(run_with(b), TierSkip::kVersion);
}

TEST_F(PrefixTierSkipTest, OtherModelFingerprint) {
  ModelFingerprint other = fp_;
  other.weights_hash ^= 1;  // other weights, same config
  expect_skipped_once(run_with(produce<float>(other, prompt_, kBlock, "model").first),
                      TierSkip::kModel);
  ModelFingerprint longer = fp_;
  longer.config.seq_len = 128;  // another config field
  expect_skipped_once(run_with(produce<float>(longer, prompt_, kBlock, "config").first),
                      TierSkip::kModel);
}

TEST_F(PrefixTierSkipTest, OtherBlockSize) {
  expect_skipped_once(run_with(produce<float>(fp_, prompt_, 8, "block").first),
                      TierSkip::kBlockSize);
}

TEST_F(PrefixTierSkipTest, OtherElementType) {
  expect_skipped_once(run_with(produce<double>(fp_, prompt_, kBlock, "double").first),
                      TierSkip::kElementType);
}

TEST_F(PrefixTierSkipTest, ABlockOfAnotherPrefixUnderThisName) {
  // A valid file of this tier, for another prompt, renamed to this prompt's block name: the
  // prefix hash, parent hash and tokens are checked, not only the name.
  const Tokens other = random_tokens(kBlock + 1, cfg_.vocab_size, 321);
  expect_skipped_once(run_with(produce<float>(fp_, other, kBlock, "other").first),
                      TierSkip::kMismatch);
  EXPECT_TRUE(fs::exists(dir_.path / name_));  // a valid block of another prefix is kept
}

// The token ids are compared, not only the hash: with 1-bit prefix hashes most prompts collide
// with the one on disk, and none of them may load it.
TEST_F(PrefixTierSkipTest, HashCollisionsNeverLoadAnotherPrefix) {
  ScratchDir d("collide");
  BlockPoolOptions one_bit{0, true, 1};
  {
    BlockPool<float> pool(cfg_, 8, kBlock, one_bit);
    PrefixTier<float> tier(fp_, {.directory = d.path, .max_bytes = 1 << 20});
    tier.attach(pool);
    prefill_request(model_, pool, act_, prompt_);
    ASSERT_EQ(pool.spill_cached(), 1u);
  }
  std::uint64_t mismatches = 0;
  for (std::uint64_t seed = 0; seed < 8; ++seed) {
    const Tokens other = random_tokens(kBlock + 1, cfg_.vocab_size, 400 + seed);
    BlockPool<float> pool(cfg_, 8, kBlock, one_bit);
    PrefixTier<float> tier(fp_, {.directory = d.path, .max_bytes = 1 << 20});
    tier.attach(pool);
    PagedStore<float> s = PagedStore<float>::open(pool, other);
    EXPECT_EQ(s.size(), 0u);
    EXPECT_EQ(tier.stats().disk_hits, 0u);
    mismatches += tier.stats().skipped_for(TierSkip::kMismatch);
    const auto logits = copy_of(model_.prefill(other, s, act_));
    expect_reference(logits, model_.forward_reference(other), other.size() - 1, "collision");
  }
  EXPECT_GE(mismatches, 1u);  // some prompt did reach the file (1 bit: about half of them)
}

// ---------------------------------------------------------------------------------------------

// A cap of two files: the third file written evicts the least recently used one, and a load
// counts as a use.
TEST(PrefixTierTest, ByteCapEvictsTheLeastRecentlyUsedFile) {
  const ModelConfig cfg = small_config(4, 2, 64);
  const Model<float> model(random_weights<float>(cfg, 34));
  ScratchDir dir("cap");
  Activations<float> act(cfg, {.max_chunk = 64});
  BlockPool<float> pool(cfg, 2, kBlock);  // a 17-token request takes both blocks
  PrefixTier<float> tier(model_fingerprint(model), {.directory = dir.path, .max_bytes = 0});
  tier.attach(pool);
  const std::size_t fb = tier.file_bytes();
  tier.detach();
  PrefixTier<float> capped(model_fingerprint(model),
                           {.directory = dir.path, .max_bytes = 2 * fb + fb / 2});
  capped.attach(pool);
  const Tokens a = random_tokens(kBlock + 1, cfg.vocab_size, 330);
  const Tokens b = random_tokens(kBlock + 1, cfg.vocab_size, 331);
  const Tokens c = random_tokens(kBlock + 1, cfg.vocab_size, 332);

  const auto new_file = [&](const std::set<std::string>& before) {
    std::set<std::string> now = block_files(dir.path);
    for (const auto& n : before) now.erase(n);
    EXPECT_EQ(now.size(), 1u);
    return now.empty() ? std::string() : *now.begin();
  };
  prefill_request(model, pool, act, a);
  std::set<std::string> files = block_files(dir.path);
  prefill_request(model, pool, act, b);  // evicts a's block: file A
  const std::string file_a = new_file(files);
  files = block_files(dir.path);
  prefill_request(model, pool, act, c);  // evicts b's block: file B
  const std::string file_b = new_file(files);
  EXPECT_EQ(capped.stats().files_written, 2u);
  EXPECT_EQ(capped.stats().bytes_on_disk, 2 * fb);

  // a again: loaded from A (a use of A), then its last token's block evicts c's: file C, and
  // the cap removes B, now the least recently used.
  files = block_files(dir.path);
  {
    PagedStore<float> s = PagedStore<float>::open(pool, a);
    EXPECT_EQ(s.size(), kBlock);
    EXPECT_EQ(capped.stats().disk_hits, 1u);
    model.prefill(std::span<const std::int32_t>(a).subspan(kBlock), s, act);
  }
  const std::string file_c = new_file(files);
  EXPECT_EQ(capped.stats().files_written, 3u);
  EXPECT_EQ(capped.stats().files_evicted, 1u);
  EXPECT_EQ(capped.stats().files_on_disk, 2u);
  EXPECT_EQ(capped.stats().bytes_on_disk, 2 * fb);
  EXPECT_EQ(block_files(dir.path), (std::set<std::string>{file_a, file_c}));
  EXPECT_NO_THROW(pool.check_invariants());

  // A restart with a smaller cap keeps the most recently written file.
  capped.detach();
  PrefixTier<float> smaller(model_fingerprint(model), {.directory = dir.path, .max_bytes = fb});
  smaller.attach(pool);
  EXPECT_EQ(smaller.stats().files_on_disk, 1u);
  EXPECT_EQ(smaller.stats().files_evicted, 1u);
}

TEST(PrefixTierTest, ADirectoryThatCannotBeWrittenIsAnErrorNamingIt) {
  const ModelConfig cfg = small_config();
  const ModelFingerprint fp = model_fingerprint(random_weights<float>(cfg, 35));
  ScratchDir dir("unwritable");
  const fs::path file = dir.path / "a_file";
  write_bytes(file, Bytes{1, 2, 3});
  const fs::path under_file = file / "prefixes";
  try {
    PrefixTier<float> tier(fp, {.directory = under_file, .max_bytes = 1 << 20});
    FAIL() << "a directory under a file was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("directory '" + under_file.string() + "'"),
              std::string::npos)
        << e.what();
  }
  if (::geteuid() != 0) {  // root writes into a read-only directory anyway
    const fs::path read_only = dir.path / "read_only";
    fs::create_directories(read_only);
    fs::permissions(read_only, fs::perms::owner_read | fs::perms::owner_exec);
    EXPECT_THROW((PrefixTier<float>(fp, {.directory = read_only, .max_bytes = 1})), Error);
    fs::permissions(read_only, fs::perms::owner_all);
  }
}

TEST(PrefixTierTest, APoolOfAnotherShapeIsRefused) {
  const ModelConfig cfg = small_config(4, 2);
  const ModelFingerprint fp = model_fingerprint(random_weights<float>(cfg, 36));
  ScratchDir dir("shape");
  BlockPool<float> pool(small_config(4, 1), 4, kBlock);
  PrefixTier<float> tier(fp, {.directory = dir.path, .max_bytes = 1 << 20});
  EXPECT_THROW(tier.attach(pool), Error);
  EXPECT_EQ(pool.tier(), nullptr);
}

}  // namespace
}  // namespace kvdecode::testing_util
