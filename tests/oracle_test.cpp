// PyTorch oracle: the shipped model (models/kjv_tiny.bin + models/tokenizer.bin) against the
// logits that tools/train_tiny.py computed with its own float64 PyTorch model (full-sequence
// causal attention, no cache) for fixed prompts, stored in tests/data/oracle. Checks the prompts'
// encoding, cached decode and prefill logits, and the greedy continuation token for token.
// PyTorch is not needed here: the test only reads the stored files.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "fixture_files.hpp"
#include "kvdecode/io/checkpoint.hpp"
#include "kvdecode/kvdecode.hpp"
#include "kvdecode/text/tokenizer.hpp"
#include "test_instances.hpp"

namespace kvdecode {
namespace {

// tools/train_tiny.py: ORACLE_PROMPTS (4 prompts) and ORACLE_NEW_TOKENS.
constexpr std::size_t kCases = 4;
constexpr std::size_t kNewTokens = 32;

// ---------------------------------------------------------------------------------------------
// Files: the model from models/ (not copied, to keep one 7 MB file in the repository), the
// oracle outputs from tests/data/oracle.

std::filesystem::path oracle_dir() {
  return std::filesystem::path(KVDECODE_TEST_DATA_DIR) / "oracle";
}

std::filesystem::path models_dir() {
  return std::filesystem::path(KVDECODE_TEST_DATA_DIR) / ".." / ".." / "models";
}

using testing_util::read_ids;
using testing_util::read_text;

struct OracleCase {
  std::string prompt;
  std::vector<std::int32_t> prompt_ids;     // [n_prompt] train_tiny.py encode(prompt, bos=True)
  std::vector<std::int32_t> input_ids;      // [n_positions] prompt, then generated minus the last
  std::vector<std::int32_t> generated_ids;  // [kNewTokens] greedy continuation
  std::vector<float> logits;                // [n_positions][vocab_size] float64 forward, as f32
};

struct Fixture {
  Fixture()
      : model(load_checkpoint(models_dir() / "kjv_tiny.bin")),
        tokenizer(Tokenizer::load(models_dir() / "tokenizer.bin", model.config().vocab_size)) {
    for (std::size_t k = 0; k < kCases; ++k) {
      const std::filesystem::path base = oracle_dir() / ("case" + std::to_string(k));
      OracleCase c;
      c.prompt = read_text(base.string() + ".prompt.txt");
      c.prompt_ids = read_ids(base.string() + ".prompt_ids.txt");
      c.input_ids = read_ids(base.string() + ".input_ids.txt");
      c.generated_ids = read_ids(base.string() + ".generated_ids.txt");
      c.logits = testing_util::read_f32_le(base.string() + ".logits.f32");
      cases.push_back(std::move(c));
    }
  }

  std::size_t vocab() const { return static_cast<std::size_t>(model.config().vocab_size); }

  Model<float> model;
  Tokenizer tokenizer;
  std::vector<OracleCase> cases;  // [kCases]
};

// Loaded once: the Model is immutable and the files are only read.
const Fixture& fixture() {
  static const Fixture f;
  return f;
}

void check_shape(const Fixture& f, const OracleCase& c) {
  ASSERT_FALSE(c.prompt_ids.empty());
  ASSERT_EQ(c.generated_ids.size(), kNewTokens);
  ASSERT_EQ(c.input_ids.size(), c.prompt_ids.size() + kNewTokens - 1);
  ASSERT_TRUE(std::equal(c.prompt_ids.begin(), c.prompt_ids.end(), c.input_ids.begin()));
  ASSERT_TRUE(std::equal(c.generated_ids.begin(), c.generated_ids.end() - 1,
                         c.input_ids.begin() + static_cast<std::ptrdiff_t>(c.prompt_ids.size())));
  ASSERT_EQ(c.logits.size(), c.input_ids.size() * f.vocab());
}

// ---------------------------------------------------------------------------------------------
// Logit comparison: |Δ| ≤ 1e-4 + 1e-4·|ref| per logit. The reference is float64 over the same
// f32 weights, so Δ is our f32 rounding alone: docs/FORMATS.md §2 gives ≈ 1e-5 for run.c's
// f32 against float64 on a model of this size, and the bound is ten times that.

struct LogitCheck {
  double max_abs_delta = 0;
  std::size_t compared = 0;
  std::size_t failures = 0;

  void compare(std::span<const float> ours, std::span<const float> ref, std::size_t k,
               std::size_t pos, const char* path) {
    ASSERT_EQ(ours.size(), ref.size());
    for (std::size_t i = 0; i < ref.size(); ++i) {
      const double r = ref[i];
      const double d = std::abs(static_cast<double>(ours[i]) - r);
      max_abs_delta = std::max(max_abs_delta, d);
      ++compared;
      if (!(d <= 1e-4 + 1e-4 * std::abs(r))) {  // also catches NaN
        if (++failures <= 10) {
          ADD_FAILURE() << path << ": case " << k << " position " << pos << " logit " << i
                        << ": ours " << ours[i] << ", PyTorch " << r << ", |Δ| " << d;
        }
      }
    }
  }

  void compare_all(std::span<const float> ours, const OracleCase& c, std::size_t vocab,
                   std::size_t k, const char* path) {
    ASSERT_EQ(ours.size(), c.logits.size());
    const std::span<const float> ref(c.logits);
    for (std::size_t p = 0; p < c.input_ids.size(); ++p)
      compare(ours.subspan(p * vocab, vocab), ref.subspan(p * vocab, vocab), k, p, path);
  }

  void report(const char* path) const {
    EXPECT_EQ(failures, 0u) << path << ": logits outside 1e-4 + 1e-4·|ref|";
    EXPECT_GT(compared, 0u);
    ::testing::Test::RecordProperty("max_abs_delta", std::to_string(max_abs_delta));
    std::cout << "[ oracle   ] " << path << ": max |Δ| vs PyTorch float64 over " << compared
              << " logits = " << max_abs_delta << "\n";
  }
};

// Our logits of every position of a case, token by token through decode().
std::vector<float> decode_all(const Fixture& f, const OracleCase& c) {
  const ModelConfig& cfg = f.model.config();
  ContiguousStore<float> cache(cfg);
  Activations<float> act(cfg, {.max_chunk = 1});
  std::vector<float> out;
  out.reserve(c.logits.size());
  for (const std::int32_t token : c.input_ids) {
    const std::span<const float> logits = f.model.decode(token, cache, act);
    out.insert(out.end(), logits.begin(), logits.end());
  }
  EXPECT_EQ(cache.size(), c.input_ids.size());
  return out;
}

// Our logits of every position through prefill() with chunks of at most `chunk` tokens.
std::vector<float> prefill_all(const Fixture& f, const OracleCase& c, std::size_t chunk) {
  const ModelConfig& cfg = f.model.config();
  ContiguousStore<float> cache(cfg);
  Activations<float> act(cfg, {.max_chunk = chunk});
  std::vector<float> all(c.logits.size());
  f.model.prefill(std::span<const std::int32_t>(c.input_ids), cache, act, std::span<float>(all));
  EXPECT_EQ(cache.size(), c.input_ids.size());
  return all;
}

// ---------------------------------------------------------------------------------------------
// Tests

TEST(OracleTest, ShippedModelHasTheTrainedConfig) {
  // = tools/train_tiny.py CONFIG; models/README.md documents it.
  const ModelConfig& cfg = fixture().model.config();
  EXPECT_EQ(cfg.dim, 192);
  EXPECT_EQ(cfg.hidden_dim, 512);
  EXPECT_EQ(cfg.n_layers, 4);
  EXPECT_EQ(cfg.n_heads, 6);
  EXPECT_EQ(cfg.n_kv_heads, 2);
  EXPECT_EQ(cfg.vocab_size, 4096);
  EXPECT_EQ(cfg.seq_len, 512);
}

TEST(OracleTest, EncodeMatchesTrainingTokenizer) {
  const Fixture& f = fixture();
  for (std::size_t k = 0; k < kCases; ++k) {
    const OracleCase& c = f.cases[k];
    EXPECT_EQ(f.tokenizer.encode(c.prompt, true, false), c.prompt_ids)
        << "case " << k << ": '" << c.prompt << "'";
  }
}

TEST(OracleTest, EncodeOfHeldOutTextMatchesTrainingTokenizer) {
  // 1500 characters of a held-out chapter, as train_tiny.py's run.c re-implementation encoded
  // the training text: a mismatch here means the model is fed ids it was not trained on.
  const Fixture& f = fixture();
  const std::string text = read_text(oracle_dir() / "encode_text.txt");
  const std::vector<std::int32_t> ids = read_ids(oracle_dir() / "encode_ids.txt");
  ASSERT_GT(text.size(), 1000u);
  EXPECT_EQ(f.tokenizer.encode(text, true, false), ids);
}

TEST(OracleTest, DecodeLogitsMatchPyTorch) {
  const Fixture& f = fixture();
  LogitCheck check;
  for (std::size_t k = 0; k < kCases; ++k) {
    const OracleCase& c = f.cases[k];
    check_shape(f, c);
    check.compare_all(decode_all(f, c), c, f.vocab(), k, "decode");
  }
  check.report("decode");
}

TEST(OracleTest, PrefillLogitsMatchPyTorch) {
  const Fixture& f = fixture();
  LogitCheck whole;
  LogitCheck chunked;
  for (std::size_t k = 0; k < kCases; ++k) {
    const OracleCase& c = f.cases[k];
    check_shape(f, c);
    whole.compare_all(prefill_all(f, c, c.input_ids.size()), c, f.vocab(), k, "prefill");
    chunked.compare_all(prefill_all(f, c, 7), c, f.vocab(), k, "prefill (chunks of 7)");
  }
  whole.report("prefill");
  chunked.report("prefill (chunks of 7)");
}

TEST(OracleTest, GreedyContinuationMatchesPyTorch) {
  const Fixture& f = fixture();
  const ModelConfig& cfg = f.model.config();
  const SamplerOptions greedy{0.0, 0.9, 0, 1};
  for (std::size_t k = 0; k < kCases; ++k) {
    const OracleCase& c = f.cases[k];
    check_shape(f, c);
    for (const std::size_t chunk : {std::size_t{1}, std::size_t{16}}) {
      ContiguousStore<float> cache(cfg);
      Activations<float> act(cfg, {.max_chunk = chunk});
      Sampler sampler(cfg.vocab_size, greedy);
      GenerationOptions opt;
      opt.max_new_tokens = kNewTokens;
      std::vector<std::int32_t> got;
      generate(f.model, cache, act, std::span<const std::int32_t>(c.prompt_ids), sampler, opt,
               [&](std::int32_t t) { got.push_back(t); });
      EXPECT_EQ(got, c.generated_ids) << "case " << k << " '" << c.prompt << "', chunk " << chunk;
    }
  }
}

}  // namespace
}  // namespace kvdecode
