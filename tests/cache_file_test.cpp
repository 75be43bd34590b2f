// Tests for io/cache_file.hpp: a restored cache decodes exactly as the one that was saved, every
// bad file is refused with a message naming the problem and leaves the target store unchanged,
// and a writer killed mid-save never leaves a partial file under the final name.
#include "kvdecode/io/cache_file.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "cache_file_util.hpp"
#include "test_util.hpp"

namespace {

namespace fs = std::filesystem;
namespace cf = kvdecode::detail::cache_file;
using kvdecode::Activations;
using kvdecode::CacheFileInfo;
using kvdecode::ContiguousStore;
using kvdecode::Error;
using kvdecode::Model;
using kvdecode::ModelConfig;
using kvdecode::ModelFingerprint;
using kvdecode::testing_util::error_of;
using kvdecode::testing_util::put_u32;
using kvdecode::testing_util::put_u64;
using kvdecode::testing_util::random_tokens;
using kvdecode::testing_util::read_bytes;
using kvdecode::testing_util::reseal;
using kvdecode::testing_util::same_contents;
using kvdecode::testing_util::small_config;
using kvdecode::testing_util::write_bytes;
using ::testing::AllOf;
using ::testing::HasSubstr;

class CacheFileTest : public ::testing::Test {
 protected:
  CacheFileTest()
      : cfg_(small_config(4, 2, 48)),
        model_(kvdecode::random_weights<float>(cfg_, 11)),
        fingerprint_(kvdecode::model_fingerprint(model_)),
        act_(cfg_, {.max_chunk = 8}),
        tokens_(random_tokens(40, cfg_.vocab_size, 5)) {
    dir_ = fs::temp_directory_path() /
           ("kvdecode_cache_file_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    file_ = dir_ / "prompt.kvc";
  }
  ~CacheFileTest() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  /// A store holding the first n tokens of tokens_.
  ContiguousStore<float> prefilled(std::size_t n, std::size_t capacity = 0) {
    ContiguousStore<float> s(cfg_, capacity);
    if (n > 0) model_.prefill(std::span<const std::int32_t>(tokens_).first(n), s, act_);
    return s;
  }

  void save_prefix(std::size_t n) {
    const ContiguousStore<float> s = prefilled(n);
    kvdecode::save_cache(fingerprint_, s, file_);
  }

  /// Restoring `file` must fail with a message containing every part, and leave a store that
  /// already held 7 other tokens exactly as it was.
  template <class... Parts>
  void expect_rejected(const fs::path& file, const Parts&... parts) {
    ContiguousStore<float> target(cfg_);
    const std::vector<std::int32_t> other = random_tokens(7, cfg_.vocab_size, 99);
    model_.prefill(other, target, act_);
    ContiguousStore<float> before(cfg_);
    before.copy_from(target);
    const std::string message =
        error_of([&] { kvdecode::restore_cache(fingerprint_, target, file); });
    EXPECT_THAT(message, AllOf(HasSubstr(parts)...));
    EXPECT_EQ(target.size(), 7u);
    EXPECT_EQ(target.pending(), 0u);
    const auto t = target.tokens();
    EXPECT_EQ(std::vector<std::int32_t>(t.begin(), t.end()), other);
    EXPECT_TRUE(same_contents(target, before, 7));
  }

  ModelConfig cfg_;
  Model<float> model_;
  ModelFingerprint fingerprint_;
  Activations<float> act_;
  std::vector<std::int32_t> tokens_;
  fs::path dir_;
  fs::path file_;
};

// ---------------------------------------------------------------------------------------------
// The model fingerprint.

TEST(ModelFingerprintTest, DependsOnEveryWeightAndTheConfig) {
  const ModelConfig cfg = small_config(4, 2, 48);
  auto w = kvdecode::random_weights<float>(cfg, 11);
  const ModelFingerprint a = kvdecode::model_fingerprint(w);
  EXPECT_EQ(a, kvdecode::model_fingerprint(kvdecode::random_weights<float>(cfg, 11)));
  EXPECT_NE(a.weights_hash,
            kvdecode::model_fingerprint(kvdecode::random_weights<float>(cfg, 12)).weights_hash);
  w.layers[1].w3[5] = std::nextafter(w.layers[1].w3[5], 1.0f);  // one ulp of one weight
  EXPECT_NE(a.weights_hash, kvdecode::model_fingerprint(w).weights_hash);
  EXPECT_EQ(a.weight_bytes, 4u);
  EXPECT_EQ(kvdecode::model_fingerprint(kvdecode::random_weights<double>(cfg, 11)).weight_bytes,
            8u);
}

// ---------------------------------------------------------------------------------------------
// Round trips.

TEST_F(CacheFileTest, RestoreThenDecodeGivesTheSameLogitsAsNeverSaving) {
  ContiguousStore<float> original = prefilled(25);
  kvdecode::save_cache(model_, original, file_);
  ContiguousStore<float> restored(cfg_);
  kvdecode::restore_cache(model_, restored, file_);
  ASSERT_EQ(restored.size(), 25u);
  EXPECT_TRUE(std::equal(restored.tokens().begin(), restored.tokens().end(), tokens_.begin()));
  EXPECT_TRUE(same_contents(original, restored, 25));
  Activations<float> act2(cfg_, {.max_chunk = 8});
  for (std::size_t p = 25; p < tokens_.size(); ++p) {
    const auto a = model_.decode(tokens_[p], original, act_);
    const std::vector<float> expected(a.begin(), a.end());
    const auto b = model_.decode(tokens_[p], restored, act2);
    ASSERT_EQ(std::vector<float>(b.begin(), b.end()), expected) << "position " << p;
  }
}

TEST_F(CacheFileTest, RoundTripsDoubleStoresAndTheEmptyCache) {
  const Model<double> model(kvdecode::random_weights<double>(cfg_, 3));
  Activations<double> act(cfg_, {.max_chunk = 8});
  ContiguousStore<double> original(cfg_);
  model.prefill(std::span<const std::int32_t>(tokens_).first(9), original, act);
  kvdecode::save_cache(model, original, file_);
  ContiguousStore<double> restored(cfg_, 20);  // a smaller capacity is fine if the tokens fit
  kvdecode::restore_cache(model, restored, file_);
  EXPECT_EQ(restored.size(), 9u);
  EXPECT_TRUE(same_contents(original, restored, 9));

  const ContiguousStore<float> empty(cfg_);
  kvdecode::save_cache(fingerprint_, empty, file_);
  ContiguousStore<float> target = prefilled(3);
  kvdecode::restore_cache(fingerprint_, target, file_);
  EXPECT_EQ(target.size(), 0u);
}

TEST_F(CacheFileTest, HeaderRecordsTheModelStoreAndTokens) {
  save_prefix(12);
  const CacheFileInfo info = kvdecode::read_cache_file_header(file_);
  EXPECT_EQ(info.version, 3u);
  EXPECT_EQ(info.store_tag, 1u);
  EXPECT_EQ(info.store_name, "contiguous");
  EXPECT_EQ(info.scalar_bytes, 4u);
  EXPECT_EQ(info.model, fingerprint_);
  EXPECT_EQ(info.n_layers, 2u);
  EXPECT_EQ(info.n_kv_heads, 2u);
  EXPECT_EQ(info.head_size, 16u);
  EXPECT_EQ(info.capacity, 48u);
  EXPECT_EQ(info.n_tokens, 12u);
  EXPECT_EQ(info.options, (std::array<std::uint64_t, 6>{}));
  // Token ids, then keys and values of 2 layers × 2 kv heads × 12 positions × head size 16.
  EXPECT_EQ(info.payload_bytes, 12u * 4 + 2u * 2 * 2 * 12 * 16 * 4);
  EXPECT_EQ(fs::file_size(file_), cf::kHeaderBytes + info.payload_bytes);
}

TEST_F(CacheFileTest, SaveReplacesAnExistingFileAndLeavesNoTemporary) {
  save_prefix(5);
  save_prefix(8);
  EXPECT_EQ(kvdecode::read_cache_file_header(file_).n_tokens, 8u);
  std::size_t entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir_)) ++entries;
  EXPECT_EQ(entries, 1u);
}

TEST_F(CacheFileTest, RestorePromptPrefixKeepsAtLeastOneTokenToRun) {
  save_prefix(10);
  const std::span<const std::int32_t> prompt(tokens_);
  ContiguousStore<float> store(cfg_);
  EXPECT_EQ(kvdecode::restore_prompt_prefix(fingerprint_, store, prompt.first(30), file_), 10u);
  EXPECT_EQ(store.size(), 10u);
  // The same prompt as saved: one position is given back, so prefill has a token for logits.
  EXPECT_EQ(kvdecode::restore_prompt_prefix(fingerprint_, store, prompt.first(10), file_), 9u);
  EXPECT_EQ(store.size(), 9u);
  // A prompt that differs at position 4: refused, the store unchanged.
  std::vector<std::int32_t> other(tokens_.begin(), tokens_.begin() + 20);
  other[4] = (other[4] + 1) % static_cast<std::int32_t>(cfg_.vocab_size);
  EXPECT_THAT(error_of([&] { kvdecode::restore_prompt_prefix(fingerprint_, store, other, file_); }),
              HasSubstr("holds token " + std::to_string(tokens_[4]) +
                        " at position 4 where the "
                        "prompt has " +
                        std::to_string(other[4]) + "; it was saved for another prompt"));
  EXPECT_EQ(store.size(), 9u);
  EXPECT_THAT(error_of([&] {
                kvdecode::restore_prompt_prefix(fingerprint_, store, prompt.first(6), file_);
              }),
              HasSubstr("holds 10 tokens, more than the prompt's 6"));
  EXPECT_EQ(store.size(), 9u);
  // restore_longest_prefix reuses what the two share: the first 4 tokens, the first 5 of 6.
  EXPECT_EQ(kvdecode::restore_longest_prefix(fingerprint_, store, other, file_), 4u);
  EXPECT_EQ(store.size(), 4u);
  EXPECT_TRUE(same_contents(store, prefilled(10), 4));  // the saved rows, not recomputed ones
  EXPECT_EQ(kvdecode::restore_longest_prefix(fingerprint_, store, prompt.first(6), file_), 5u);
  EXPECT_EQ(store.size(), 5u);
  // A refused file leaves the store as it was.
  write_bytes(file_, {1, 2, 3});
  EXPECT_THAT(error_of([&] {
                kvdecode::restore_prompt_prefix(fingerprint_, store, prompt.first(30), file_);
              }),
              HasSubstr("file is 3 bytes, too short"));
  EXPECT_EQ(store.size(), 5u);
}

// ---------------------------------------------------------------------------------------------
// Refused files: each leaves the target exactly as it was.

TEST_F(CacheFileTest, RejectsAMissingFileADirectoryAndAnEmptyFile) {
  expect_rejected(dir_ / "absent.kvc", "cache file '", "absent.kvc': file does not exist");
  expect_rejected(dir_, "is not a regular file");
  write_bytes(file_, {});
  expect_rejected(file_, "file is 0 bytes, too short to be a kvdecode cache file");
}

TEST_F(CacheFileTest, RejectsAFileThatIsNotACacheFile) {
  expect_rejected(KVDECODE_TEST_DATA_DIR "/llama2c-tiny/tokenizer.bin",
                  "tokenizer.bin': not a kvdecode cache file");
}

TEST_F(CacheFileTest, RejectsAnotherFormatVersion) {
  save_prefix(6);
  auto b = read_bytes(file_);
  put_u32(b, cf::kOffVersion, 1);
  write_bytes(file_, b);
  expect_rejected(file_, "format version 1, this build reads version 3");
}

TEST_F(CacheFileTest, RejectsACorruptedHeader) {
  save_prefix(6);
  auto b = read_bytes(file_);
  b[cf::kOffConfig + 1] ^= 0x40;  // dim
  write_bytes(file_, b);
  expect_rejected(file_, "header checksum", "the header is corrupted");
}

TEST_F(CacheFileTest, RejectsACorruptedPayloadAtEveryByteSampled) {
  save_prefix(6);
  const auto good = read_bytes(file_);
  for (std::size_t at = cf::kHeaderBytes; at < good.size(); at += 97) {
    auto b = good;
    b[at] ^= 0x01;
    write_bytes(file_, b);
    SCOPED_TRACE(at);
    expect_rejected(file_, "payload checksum", "are corrupted");
  }
}

TEST_F(CacheFileTest, RejectsEveryTruncationAndATrailingByte) {
  save_prefix(6);
  const auto good = read_bytes(file_);
  for (std::size_t len = 0; len < good.size(); len += (len < 200 ? 1 : 61)) {
    write_bytes(file_,
                std::vector<unsigned char>(good.begin(), good.begin() + static_cast<long>(len)));
    SCOPED_TRACE(len);
    expect_rejected(file_, "cache file '");
  }
  write_bytes(file_, std::vector<unsigned char>(good.begin(), good.end() - 1));
  expect_rejected(file_,
                  "file is truncated: the header describes 3328 bytes, the file has 3327 (1 "
                  "missing)");
  write_bytes(file_, std::vector<unsigned char>(good.begin(), good.begin() + 100));
  expect_rejected(file_, "truncated inside the 232-byte header");
  auto longer = good;
  longer.push_back(0);
  write_bytes(file_, longer);
  expect_rejected(file_, "1 trailing byte(s) after the payload");
}

TEST_F(CacheFileTest, RejectsACacheOfAnotherModel) {
  // Same shape, other weights: only the hash tells them apart.
  const Model<float> other(kvdecode::random_weights<float>(cfg_, 12));
  ContiguousStore<float> s(cfg_);
  other.prefill(std::span<const std::int32_t>(tokens_).first(5), s, act_);
  kvdecode::save_cache(other, s, file_);
  expect_rejected(file_, "was saved for another model: weights hash 0x",
                  "(same shape, different weights)");
  // Another config: the field is named with both values.
  ModelConfig wider = cfg_;
  wider.vocab_size = 60;
  const Model<float> model60(kvdecode::random_weights<float>(wider, 11));
  ContiguousStore<float> s60(wider);
  Activations<float> act60(wider, {.max_chunk = 8});
  model60.prefill(std::span<const std::int32_t>(tokens_).first(5), s60, act60);
  kvdecode::save_cache(model60, s60, file_);
  expect_rejected(file_, "was saved for another model: vocab_size 60 vs the model's 53");
}

// The element size names the weight format, a block format's as blocks.
TEST(ModelFingerprintTest, WeightFormatsAreNamed) {
  const ModelConfig cfg = small_config(4, 2, 48);
  const auto with = [&](std::uint32_t bytes) { return ModelFingerprint{cfg, bytes, 7}; };
  EXPECT_EQ(cf::fingerprint_difference(with(34), with(4)),
            "q8_0 weights (34-byte blocks of 32) vs the model's f32 weights");
  EXPECT_EQ(cf::fingerprint_difference(with(2), with(18)),
            "bf16 weights vs the model's q4_0 weights (18-byte blocks of 32)");
  EXPECT_EQ(cf::fingerprint_difference(with(8), with(8)), "");
}

TEST_F(CacheFileTest, RejectsAnotherStoreKindAndElementSize) {
  save_prefix(6);
  auto b = read_bytes(file_);
  put_u32(b, cf::kOffStoreTag, 2);
  reseal(b, false);
  write_bytes(file_, b);
  expect_rejected(file_,
                  "saved from a paged store (tag 2), cannot restore into a contiguous "
                  "store (tag 1)");
  put_u32(b, cf::kOffStoreTag, 77);
  reseal(b, false);
  write_bytes(file_, b);
  expect_rejected(file_, "saved from a unknown store (tag 77)");
  b = read_bytes(file_);
  put_u32(b, cf::kOffStoreTag, 1);
  put_u64(b, cf::kOffOptions + 8, 5);  // an option a contiguous store does not have
  reseal(b, false);
  write_bytes(file_, b);
  expect_rejected(file_, "option field 1 is 5, a contiguous store has none there (expected 0)");

  ContiguousStore<double> wide(cfg_);
  kvdecode::save_cache(fingerprint_, wide, file_);
  expect_rejected(file_, "holds 8-byte elements, the store holds 4-byte elements");
}

TEST_F(CacheFileTest, RejectsMoreTokensThanTheTargetHolds) {
  save_prefix(30);
  ContiguousStore<float> small(cfg_, 20);
  EXPECT_THAT(error_of([&] { kvdecode::restore_cache(fingerprint_, small, file_); }),
              HasSubstr("holds 30 positions, more than the target store's capacity 20"));
  EXPECT_EQ(small.size(), 0u);
}

TEST_F(CacheFileTest, RejectsForgedSizesAndTokenIdsEvenWithValidChecksums) {
  save_prefix(6);
  const auto good = read_bytes(file_);
  auto b = good;
  // n_tokens 7, payload for 6: the 7th token id is the first key's bytes, made a valid id, and
  // then the values no longer fit.
  put_u64(b, cf::kOffTokens, 7);
  put_u32(b, cf::kHeaderBytes + 4 * 6, 0);
  reseal(b, true);
  write_bytes(file_, b);
  expect_rejected(file_,
                  "the values need 448 × 4 bytes, more than the 1276 payload bytes left for them: "
                  "the payload is shorter than its sizes say");
  b = good;
  put_u64(b, cf::kOffTokens, 5);  // n_tokens 5: bytes are left over
  reseal(b, false);
  write_bytes(file_, b);
  expect_rejected(file_, "516 payload byte(s) follow the store's data");
  b = good;
  put_u64(b, cf::kOffTokens, std::uint64_t{1} << 60);  // huge: refused before any allocation
  reseal(b, false);
  write_bytes(file_, b);
  expect_rejected(file_,
                  "holds 1152921504606846976 positions, more than the target store's "
                  "capacity 48");
  b = good;
  put_u64(b, cf::kOffPayloadBytes, std::uint64_t{1} << 62);  // the real size decides
  reseal(b, false);
  write_bytes(file_, b);
  expect_rejected(file_, "file is truncated");
  b = good;
  put_u32(b, cf::kHeaderBytes + 4 * 3, 53);  // token 3 = vocab_size
  reseal(b, true);
  write_bytes(file_, b);
  expect_rejected(file_, "token id 53 at position 3 is outside the vocabulary [0, 53)");
}

TEST_F(CacheFileTest, RefusesToRestoreIntoOrSaveFromAnOpenAppend) {
  save_prefix(4);
  ContiguousStore<float> s(cfg_);
  s.begin_append(std::vector<std::int32_t>{1, 2});
  EXPECT_THAT(error_of([&] { kvdecode::restore_cache(fingerprint_, s, file_); }),
              HasSubstr("cannot restore into a store with 2 pending positions"));
  EXPECT_THAT(error_of([&] { kvdecode::save_cache(fingerprint_, s, file_); }),
              HasSubstr("the store has 2 pending positions"));
  EXPECT_EQ(s.pending(), 2u);
  EXPECT_EQ(kvdecode::read_cache_file_header(file_).n_tokens, 4u);  // the file is untouched
}

TEST_F(CacheFileTest, SaveOfAMismatchedStoreFailsAndLeavesTheOldFile) {
  save_prefix(4);
  const ContiguousStore<float> other(small_config(4, 4, 48));
  EXPECT_THAT(error_of([&] { kvdecode::save_cache(fingerprint_, other, file_); }),
              HasSubstr("the store's shape (2 layers, 4 kv heads, head size 16) does not match "
                        "the model (2, 2, 16)"));
  EXPECT_EQ(kvdecode::read_cache_file_header(file_).n_tokens, 4u);
}

TEST_F(CacheFileTest, SaveIntoAMissingDirectoryFailsAndLeavesNothing) {
  const ContiguousStore<float> s = prefilled(3);
  EXPECT_THAT(error_of([&] { kvdecode::save_cache(fingerprint_, s, dir_ / "no" / "x.kvc"); }),
              HasSubstr("cannot create"));
  EXPECT_FALSE(fs::exists(dir_ / "no"));
}

// A writer killed at a random moment: the final name holds either nothing or a complete file.
// The child reports each finished save through a pipe; on odd trials the parent waits for the
// first report before killing, so at least those kills land after a rename whatever the speed
// of the disk: there a complete file must be found. Even trials kill blind, often mid-write.
TEST_F(CacheFileTest, AWriterKilledMidSaveNeverLeavesAPartialFileUnderTheFinalName) {
  ModelConfig big = cfg_;
  big.seq_len = 2048;
  const Model<float> model(kvdecode::random_weights<float>(big, 1));
  ContiguousStore<float> s(big);
  Activations<float> act(big, {.max_chunk = 64});
  model.prefill(random_tokens(2000, big.vocab_size, 2), s, act);  // ≈ 1 MiB of payload
  const ModelFingerprint fp = kvdecode::model_fingerprint(model);
  int complete = 0;
  for (int trial = 0; trial < 12; ++trial) {
    fs::remove(file_);
    int saved[2];
    ASSERT_EQ(::pipe(saved), 0);
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      ::close(saved[0]);
      for (;;) {  // until killed
        kvdecode::save_cache(fp, s, file_);
        const char done = 1;
        if (::write(saved[1], &done, 1) != 1) ::_exit(1);
      }
    }
    ::close(saved[1]);
    const bool after_a_save = trial % 2 == 1;
    if (after_a_save) {
      char done = 0;
      ASSERT_EQ(::read(saved[0], &done, 1), 1) << "trial " << trial;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(300 + 900 * trial));
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
    ::close(saved[0]);
    if (!fs::exists(file_)) {
      EXPECT_FALSE(after_a_save) << "trial " << trial << ": a save had finished";
      continue;
    }
    ContiguousStore<float> restored(big);
    ASSERT_NO_THROW(kvdecode::restore_cache(fp, restored, file_)) << "trial " << trial;
    ASSERT_EQ(restored.size(), 2000u);
    ++complete;
  }
  EXPECT_GE(complete, 6);  // every odd trial at least; the temporaries are the only debris
  std::printf("%d of 12 kills found a complete file, the rest none\n", complete);
}

}  // namespace
