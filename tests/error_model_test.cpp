// The error model (docs/ERRORS.md): every public operation that throws leaves every object it
// was given exactly as it was, and its message names what was wrong, expected vs actual, and the
// file / sequence / position. One test per operation; the exact wording is part of the contract.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "kvdecode/io/cache_file.hpp"
#include "kvdecode/io/checkpoint.hpp"
#include "kvdecode/kvdecode.hpp"
#include "kvdecode/text/tokenizer.hpp"
#include "test_util.hpp"

namespace {

namespace fs = std::filesystem;
using kvdecode::Activations;
using kvdecode::ContiguousStore;
using kvdecode::Error;
using kvdecode::Model;
using kvdecode::ModelConfig;
using kvdecode::testing_util::error_of;
using kvdecode::testing_util::random_tokens;
using kvdecode::testing_util::same_contents;
using kvdecode::testing_util::small_config;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::MatchesRegex;

/// A store with 9 positions, an Activations that ran them, and snapshots of both, so a test can
/// prove a failed call changed nothing: not the store's size, tokens or rows, not the logits.
class ErrorModelTest : public ::testing::Test {
 protected:
  ErrorModelTest()
      : cfg_(small_config(4, 2, 16)),
        model_(kvdecode::random_weights<float>(cfg_, 4)),
        store_(cfg_),
        snapshot_(cfg_),
        act_(cfg_, {.max_chunk = 4}) {
    tokens_ = random_tokens(9, cfg_.vocab_size, 1);
    model_.prefill(tokens_, store_, act_);
    snapshot_.copy_from(store_);
    logits_.assign(act_.logits.data(), act_.logits.data() + act_.logits.size());
  }

  void expect_unchanged() {
    EXPECT_EQ(store_.size(), tokens_.size());
    EXPECT_EQ(store_.pending(), 0u);
    const auto t = store_.tokens();
    EXPECT_EQ(std::vector<std::int32_t>(t.begin(), t.end()), tokens_);
    EXPECT_TRUE(same_contents(store_, snapshot_, tokens_.size()));
    EXPECT_EQ(std::vector<float>(act_.logits.data(), act_.logits.data() + act_.logits.size()),
              logits_);
  }

  ModelConfig cfg_;
  Model<float> model_;
  ContiguousStore<float> store_, snapshot_;
  Activations<float> act_;
  std::vector<std::int32_t> tokens_;
  std::vector<float> logits_;
};

// Every message has the form "kvdecode: <what> [<header>:<line>]".
TEST_F(ErrorModelTest, MessagesCarryThePrefixAndTheHeaderLine) {
  EXPECT_THAT(error_of([&] { model_.decode(-1, store_, act_); }),
              MatchesRegex("kvdecode: .* \\[model\\.hpp:[0-9]+\\]"));
}

TEST_F(ErrorModelTest, AFailedAppendChangesNothing) {
  std::vector<std::int32_t> too_many(8, 1);  // 9 + 8 > 16
  EXPECT_THAT(error_of([&] { store_.begin_append(too_many); }),
              HasSubstr("appending 8 positions to 9 would exceed the capacity of 16"));
  expect_unchanged();
}

TEST_F(ErrorModelTest, AFailedPrefillChangesNothing) {
  std::vector<std::int32_t> bad = {1, 2, 53, 4};
  EXPECT_THAT(error_of([&] { model_.prefill(bad, store_, act_); }),
              HasSubstr("token id 53 at input position 2 is outside the vocabulary [0, 53)"));
  expect_unchanged();
  EXPECT_THAT(error_of([&] { model_.prefill(std::vector<std::int32_t>(8, 1), store_, act_); }),
              HasSubstr("appending 8 positions to 9 would exceed the capacity of 16"));
  expect_unchanged();
  EXPECT_THAT(error_of([&] { model_.prefill({}, store_, act_); }), HasSubstr("no tokens given"));
  expect_unchanged();
  std::vector<float> wrong(3);
  EXPECT_THAT(
      error_of([&] {
        model_.prefill(std::vector<std::int32_t>{1, 2}, store_, act_, std::span<float>(wrong));
      }),
      HasSubstr("all_logits holds 3 values, expected 2 × 53 = 106"));
  expect_unchanged();
  ContiguousStore<float> other(small_config(4, 4, 16));
  EXPECT_THAT(error_of([&] { model_.prefill(std::vector<std::int32_t>{1}, other, act_); }),
              HasSubstr("the store's shape (2 layers, 4 kv heads, head size 16) does not match "
                        "the model (2, 2, 16)"));
  expect_unchanged();
  EXPECT_EQ(other.size(), 0u);
}

TEST_F(ErrorModelTest, AFailedDecodeChangesNothing) {
  EXPECT_THAT(error_of([&] { model_.decode(1000, store_, act_); }),
              HasSubstr("token id 1000 at input position 0 is outside the vocabulary [0, 53)"));
  expect_unchanged();
  // Fill the cache to its capacity, then one more.
  ContiguousStore<float> full(cfg_);
  model_.prefill(random_tokens(16, cfg_.vocab_size, 2), full, act_);
  ContiguousStore<float> full_snapshot(cfg_);
  full_snapshot.copy_from(full);
  EXPECT_THAT(error_of([&] { model_.decode(3, full, act_); }),
              HasSubstr("appending 1 positions to 16 would exceed the capacity of 16"));
  EXPECT_EQ(full.size(), 16u);
  EXPECT_TRUE(same_contents(full, full_snapshot, 16));
}

// ContiguousStore has no fork(); copy_from is its named copy (the fork of a sequence).
TEST_F(ErrorModelTest, AFailedForkChangesNothing) {
  ContiguousStore<float> other(cfg_, 8);
  EXPECT_THAT(error_of([&] { other.copy_from(store_); }), HasSubstr("copy_from: shapes differ"));
  EXPECT_EQ(other.size(), 0u);
  expect_unchanged();
}

TEST_F(ErrorModelTest, AFailedTruncateChangesNothing) {
  EXPECT_THAT(error_of([&] { store_.truncate(10); }), HasSubstr("truncate(10) beyond size 9"));
  expect_unchanged();
  store_.begin_append(std::vector<std::int32_t>{1});
  EXPECT_THAT(error_of([&] { store_.truncate(3); }), HasSubstr("truncate during an append"));
  store_.cancel_append();
  expect_unchanged();
}

TEST_F(ErrorModelTest, AFailedLoadLeavesTheCallersObjectsAsTheyWere) {
  const fs::path dir =
      fs::temp_directory_path() / ("kvdecode_error_model_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path bad = dir / "bad.bin";
  {
    std::ofstream out(bad, std::ios::binary);
    const std::int32_t header[7] = {64, 172, 2, 4, 2, 512, 128};  // the fixture's, no tensors
    out.write(reinterpret_cast<const char*>(header), sizeof(header));
  }
  // The caller's weights are only replaced when the load succeeds.
  kvdecode::Weights<float> w = kvdecode::random_weights<float>(cfg_, 4);
  const auto hash = kvdecode::model_fingerprint(w).weights_hash;
  EXPECT_THAT(error_of([&] { w = kvdecode::load_checkpoint(bad); }),
              AllOf(HasSubstr("checkpoint '"), HasSubstr("bad.bin': file is truncated"),
                    HasSubstr("expects 503068 bytes, the file has 28")));
  EXPECT_EQ(kvdecode::model_fingerprint(w).weights_hash, hash);
  // The tokenizer likewise; and a bad encode leaves its output vector as it was.
  auto tok = kvdecode::Tokenizer({"<unk>", "<s>", "</s>", " ", "a"}, {0, 0, 0, 0, 0}, 5);
  EXPECT_THAT(error_of([&] { tok = kvdecode::Tokenizer::load(bad, 512); }),
              HasSubstr("tokenizer.bin '"));
  EXPECT_EQ(tok.vocab_size(), 5);
  std::vector<std::int32_t> out = {7, 7};
  EXPECT_THAT(error_of([&] { tok.encode("ab", true, false, out); }),
              HasSubstr("byte 98 at text offset 1 is not in a piece and needs the byte-fallback "
                        "id 101"));
  EXPECT_EQ(out, (std::vector<std::int32_t>{7, 7}));
  fs::remove_all(dir);
}

TEST_F(ErrorModelTest, AFailedRestoreChangesNothing) {
  const fs::path file =
      fs::temp_directory_path() / ("kvdecode_error_model_" + std::to_string(::getpid()) + ".kvc");
  const Model<float> other(kvdecode::random_weights<float>(cfg_, 5));
  kvdecode::save_cache(other, store_, file);  // this model's cache under another's fingerprint
  EXPECT_THAT(error_of([&] { kvdecode::restore_cache(model_, store_, file); }),
              AllOf(HasSubstr("kvc': was saved for another model: weights hash"),
                    HasSubstr("(same shape, different weights)")));
  expect_unchanged();
  fs::remove(file);
}

// Resource limits: a header asking for more than the caller's limit is refused
// before anything is allocated (checkpoint_test.cpp counts the allocations to prove "before").
TEST(ResourceLimitTest, ACheckpointOverTheCallersLimitIsRefusedBeforeAllocating) {
  const fs::path fixture = KVDECODE_TEST_DATA_DIR "/llama2c-tiny/model.bin";
  const std::uint64_t need = kvdecode::read_checkpoint_header(fixture).weight_bytes;
  EXPECT_THAT(
      error_of([&] { (void)kvdecode::load_checkpoint(fixture, {need - 1}); }),
      AllOf(HasSubstr("model.bin': header dim=64"),
            HasSubstr(" needs " + std::to_string(need) + " bytes of weights"),
            HasSubstr("more than CheckpointLimits::max_bytes = " + std::to_string(need - 1))));
  EXPECT_EQ(need, 494848u);
  EXPECT_EQ(kvdecode::load_checkpoint(fixture, {need}).bytes(), need);
}

}  // namespace
