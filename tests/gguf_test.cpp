// GGUF: the container reader, the llama model and vocabulary on top of it, and load_model().
// Fixtures: llama.cpp's own llama-spm vocabulary file with its tokenizer test cases
// (tests/data/llama-vocab), and the llama2c-tiny checkpoint converted at build time by
// tools/llama2c_to_gguf.py (KVDECODE_GGUF_DIR), compared with run.c's outputs for that checkpoint.
#include "kvdecode/io/gguf.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "fixture_files.hpp"
#include "kvdecode/io/checkpoint.hpp"
#include "kvdecode/io/gguf_model.hpp"
#include "kvdecode/io/gguf_tokenizer.hpp"
#include "kvdecode/io/load_model.hpp"
#include "kvdecode/kvdecode.hpp"
#include "test_util.hpp"

namespace kvdecode {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::HasSubstr;
using testing_util::read_f32_le;
using testing_util::read_ids;
using testing_util::read_text;

fs::path tiny_dir() { return fs::path(KVDECODE_TEST_DATA_DIR) / "llama2c-tiny"; }
fs::path vocab_dir() { return fs::path(KVDECODE_TEST_DATA_DIR) / "llama-vocab"; }
fs::path gguf(std::string_view variant) {
  return fs::path(KVDECODE_GGUF_DIR) / ("tiny_" + std::string(variant) + ".gguf");
}

std::vector<std::byte> file_bytes(const fs::path& p) {
  const std::string s = read_text(p);
  std::vector<std::byte> b(s.size());
  std::memcpy(b.data(), s.data(), s.size());
  return b;
}
void put_u32(std::vector<std::byte>& b, std::uint64_t at, std::uint32_t v) {
  for (int k = 0; k < 4; ++k)
    b[at + static_cast<std::uint64_t>(k)] = static_cast<std::byte>(v >> (8 * k));
}
void put_u64(std::vector<std::byte>& b, std::uint64_t at, std::uint64_t v) {
  for (int k = 0; k < 8; ++k)
    b[at + static_cast<std::uint64_t>(k)] = static_cast<std::byte>(v >> (8 * k));
}

using testing_util::error_of;

// ---------------------------------------------------------------------------------------------
// The container, on llama.cpp's vocabulary file (written by gguf-py, not by this project)

TEST(GgufTest, ReadsLlamaCppsLlamaSpmVocabularyFile) {
  const GgufFile g = GgufFile::open(vocab_dir() / "ggml-vocab-llama-spm.gguf");
  EXPECT_EQ(g.version(), 3u);
  EXPECT_EQ(g.tensors().size(), 0u);
  EXPECT_EQ(g.metadata().size(), 22u);
  EXPECT_EQ(g.get_string("general.architecture"), "llama");
  EXPECT_EQ(g.get_int("llama.embedding_length", 0, 1 << 24), 4096);
  EXPECT_EQ(g.get_int("llama.vocab_size", 0, 1 << 24), 32000);
  EXPECT_FLOAT_EQ(static_cast<float>(g.get_float("llama.attention.layer_norm_rms_epsilon")), 1e-5f);
  const GgufValue& tokens = g.get("tokenizer.ggml.tokens");
  ASSERT_EQ(tokens.count, 32000u);
  EXPECT_EQ(tokens.strings[0], "<unk>");
  EXPECT_EQ(tokens.strings[3], "<0x00>");
  EXPECT_EQ(tokens.strings[29871], "\xE2\x96\x81");                 // "▁"
  EXPECT_EQ(g.get("tokenizer.ggml.token_type").number_at(1), 3.0);  // CONTROL
  EXPECT_TRUE(g.get_bool("tokenizer.ggml.add_bos_token"));
  // A vocabulary-only file has no model to load, and says so.
  EXPECT_THAT(error_of([&] { gguf_model_config(g); }), HasSubstr("vocabulary-only"));
}

// llama.cpp's tests/test-tokenizer-0 cases: .inp holds texts separated by
// "\n__ggml_vocab_test__\n", .out one line of ids per text (tokenized with add_special false).
TEST(GgufTest, LlamaSpmVocabularyEncodesAsLlamaCpp) {
  const GgufFile g = GgufFile::open(vocab_dir() / "ggml-vocab-llama-spm.gguf");
  const GgufVocabulary v = gguf_vocabulary(g);
  EXPECT_EQ(v.tokenizer.vocab_size(), 32000);
  EXPECT_TRUE(v.add_bos);
  EXPECT_FALSE(v.add_eos);
  const std::string inp = read_text(vocab_dir() / "ggml-vocab-llama-spm.gguf.inp");
  const std::string sep = "\n__ggml_vocab_test__\n";
  std::vector<std::string> texts;
  for (std::size_t pos = 0; pos < inp.size();) {
    const std::size_t next = inp.find(sep, pos);
    if (next == std::string::npos) {
      texts.push_back(inp.substr(pos));
      break;
    }
    texts.push_back(inp.substr(pos, next - pos));
    pos = next + sep.size();
  }
  std::ifstream out(vocab_dir() / "ggml-vocab-llama-spm.gguf.out");
  std::vector<std::vector<std::int32_t>> expected;
  for (std::string line; std::getline(out, line);) {
    std::istringstream ids(line);
    expected.emplace_back();
    for (std::int32_t id = 0; ids >> id;) expected.back().push_back(id);
  }
  ASSERT_EQ(texts.size(), expected.size());
  ASSERT_EQ(texts.size(), 46u);
  for (std::size_t k = 0; k < texts.size(); ++k)
    EXPECT_EQ(v.tokenizer.encode(texts[k], false, false), expected[k])
        << "case " << k << ": '" << texts[k] << "'";
}

// ---------------------------------------------------------------------------------------------
// The converted llama2c-tiny checkpoint

struct Reference {
  Weights<float> weights = load_checkpoint(tiny_dir() / "model.bin");
};
const Reference& reference() {
  static const Reference r;
  return r;
}

TEST(GgufModelTest, ConfigEqualsTheCheckpointsConfig) {
  const GgufFile g = GgufFile::open(gguf("f32"));
  ModelConfig cfg = gguf_model_config(g);
  // GGUF stores the epsilon as float32 (llama.cpp's type); v0 implies 1e-5 exactly.
  EXPECT_EQ(cfg.norm_eps, static_cast<double>(1e-5f));
  cfg.norm_eps = 1e-5;
  EXPECT_EQ(cfg, reference().weights.config);
  EXPECT_EQ(g.alignment(), 32u);
  EXPECT_EQ(g.data_offset() % 32, 0u);
  const GgufFile g64 = GgufFile::open(gguf("align64"));
  EXPECT_EQ(g64.alignment(), 64u);
  for (const GgufTensorInfo& t : g64.tensors()) EXPECT_EQ((g64.data_offset() + t.offset) % 64, 0u);
}

// f32 tensors are the checkpoint's bytes; tensor by tensor, bit for bit.
TEST(GgufModelTest, F32TensorsAreTheCheckpointsValues) {
  const Weights<float> w = load_gguf_weights<float>(GgufFile::open(gguf("f32")));
  const Weights<float>& r = reference().weights;
  std::vector<const AlignedBuffer<float>*> ref;
  r.for_each_tensor(
      [&](const char*, std::int64_t, const AlignedBuffer<float>& b) { ref.push_back(&b); });
  std::size_t k = 0;
  w.for_each_tensor([&](const char* name, std::int64_t layer, const AlignedBuffer<float>& b) {
    ASSERT_EQ(b.size(), ref[k]->size()) << name << " " << layer;
    EXPECT_EQ(std::memcmp(b.data(), ref[k]->data(), b.bytes()), 0) << name << " " << layer;
    ++k;
  });
}

// Every stored type against the f32 checkpoint, with the type's own rounding rule written here:
// f16 and bf16 round to nearest even; q8_0 and q4_0 stay within their block's step.
TEST(GgufModelTest, StoredTypesDecodeWithinTheirRoundingBounds) {
  const Weights<float>& r = reference().weights;
  for (const char* variant : {"f16", "bf16", "q8_0", "q4_0"}) {
    const GgufFile g = GgufFile::open(gguf(variant));
    const Weights<float> w = load_gguf_weights<float>(g);
    std::vector<const AlignedBuffer<float>*> ref;
    r.for_each_tensor(
        [&](const char*, std::int64_t, const AlignedBuffer<float>& b) { ref.push_back(&b); });
    std::size_t k = 0, checked = 0;
    w.for_each_tensor([&](const char* name, std::int64_t layer, const AlignedBuffer<float>& b) {
      const GgufTensorInfo& t = *g.find_tensor(detail::gguf::tensor_name(name, layer));
      const AlignedBuffer<float>& x = *ref[k++];
      for (std::size_t i = 0; i < b.size(); ++i) {
        double bound = 0;
        switch (t.type) {
          case GgmlType::kF32:
            bound = 0;
            break;
          case GgmlType::kF16:
            EXPECT_EQ(b[i], static_cast<float>(static_cast<_Float16>(x[i]))) << name << " " << i;
            continue;
          case GgmlType::kBf16:
            EXPECT_EQ(b[i], static_cast<float>(bf16(x[i]))) << name << " " << i;
            continue;
          case GgmlType::kQ8_0:
          case GgmlType::kQ4_0: {
            const std::size_t block = i / 32 * 32;
            double amax = 0;
            for (std::size_t j = block; j < block + 32; ++j)
              amax = std::max(amax, std::abs(double{x[j]}));
            // q8_0: step d = amax/127, |error| <= d/2, plus 127 * (f16 rounding of d <= d 2^-11).
            // q4_0: step d = amax/8, |error| <= d (the top code 15 stands for +7d when x = +8d),
            // plus 8 * (f16 rounding of d).
            bound = t.type == GgmlType::kQ8_0 ? amax / 127 * (0.5 + 127 * 0x1p-11)
                                              : amax / 8 * (1 + 8 * 0x1p-11);
            break;
          }
        }
        const double err = std::abs(double{b[i]} - double{x[i]});
        EXPECT_LE(err, bound + 1e-7) << variant << " " << name << "[" << layer << "] " << i;
        ++checked;
      }
    });
    if (std::string_view(variant).starts_with("q")) {
      EXPECT_GT(checked, 50000u) << variant;
    }
  }
}

// One block of each quantized type, built by hand: the layouts as ggml's block_q8_0/block_q4_0.
TEST(GgufModelTest, QuantizedBlockLayouts) {
  std::vector<std::byte> q8(34), q4(18);
  const std::uint16_t half_quarter = 0x3400;  // 0.25 in binary16
  for (auto* b : {&q8, &q4}) {
    (*b)[0] = std::byte{half_quarter & 0xFF};
    (*b)[1] = std::byte{half_quarter >> 8};
  }
  for (int j = 0; j < 32; ++j)
    q8[static_cast<std::size_t>(2 + j)] = static_cast<std::byte>(static_cast<std::int8_t>(j - 16));
  for (int j = 0; j < 16; ++j)
    q4[static_cast<std::size_t>(2 + j)] = static_cast<std::byte>(j | ((15 - j) << 4));
  std::vector<float> out(32);
  detail::gguf::decode_tensor<float>(GgmlType::kQ8_0, q8, 32, out.data());
  for (int j = 0; j < 32; ++j)
    EXPECT_EQ(out[static_cast<std::size_t>(j)], 0.25f * static_cast<float>(j - 16)) << j;
  detail::gguf::decode_tensor<float>(GgmlType::kQ4_0, q4, 32, out.data());
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(out[static_cast<std::size_t>(j)], 0.25f * static_cast<float>(j - 8)) << j;
    EXPECT_EQ(out[static_cast<std::size_t>(j + 16)], 0.25f * static_cast<float>(15 - j - 8)) << j;
  }
}

// run.c's logits for the fixture (tests/data/llama2c-tiny/logits.f32) from the GGUF conversion,
// with the vocabulary taken from the GGUF file, within interop_test's bound 1e-4 + 1e-4·|ref|.
TEST(GgufModelTest, ConvertedCheckpointGivesRunCsLogits) {
  LoadedModel<float> loaded = load_model(gguf("f32"));
  ASSERT_EQ(loaded.format, ModelFormat::kGguf);
  ASSERT_TRUE(loaded.vocabulary.has_value());
  const Model<float> model(std::move(loaded.weights));
  const std::vector<std::int32_t> input = read_ids(tiny_dir() / "input_ids.txt");
  const std::vector<float> ref = read_f32_le(tiny_dir() / "logits.f32");
  const auto vocab = static_cast<std::size_t>(model.config().vocab_size);
  ASSERT_EQ(ref.size(), input.size() * vocab);
  ContiguousStore<float> cache(model.config());
  Activations<float> act(model.config(), {.max_chunk = 1});
  double max_delta = 0;
  for (std::size_t p = 0; p < input.size(); ++p) {
    const std::span<const float> logits = model.decode(input[p], cache, act);
    for (std::size_t i = 0; i < vocab; ++i) {
      const double r = ref[p * vocab + i];
      const double d = std::abs(double{logits[i]} - r);
      max_delta = std::max(max_delta, d);
      ASSERT_TRUE(d <= 1e-4 + 1e-4 * std::abs(r)) << "position " << p << " logit " << i;
    }
  }
  std::cout << "[ gguf     ] max |Δ| vs run.c = " << max_delta << "\n";
}

// The GGUF's own vocabulary encodes the prompt as run.c did, and greedy decoding prints run.c's
// text (expected_output.txt).
TEST(GgufModelTest, ConvertedCheckpointReproducesRunCsGreedyText) {
  LoadedModel<float> loaded = load_model(gguf("f32"));
  ASSERT_TRUE(loaded.vocabulary.has_value());
  const Tokenizer& tok = loaded.vocabulary->tokenizer;
  const Model<float> model(std::move(loaded.weights));
  const std::vector<std::int32_t> prompt_ids = tok.encode(read_text(tiny_dir() / "prompt.txt"));
  EXPECT_EQ(prompt_ids, read_ids(tiny_dir() / "prompt_ids.txt"));
  const std::vector<std::int32_t> generated = read_ids(tiny_dir() / "generated_ids.txt");
  ContiguousStore<float> cache(model.config());
  Activations<float> act(model.config(), {.max_chunk = 8});
  Sampler sampler(model.config().vocab_size, SamplerOptions{0.0, 0.9, 0, 1});
  GenerationOptions opt;
  opt.max_new_tokens = generated.size();
  opt.stop_token = Tokenizer::kBos;
  std::vector<std::int32_t> ids = prompt_ids;
  generate(model, cache, act, std::span<const std::int32_t>(prompt_ids), sampler, opt,
           [&](std::int32_t t) { ids.push_back(t); });
  EXPECT_TRUE(std::equal(generated.begin(), generated.end(),
                         ids.begin() + static_cast<std::ptrdiff_t>(prompt_ids.size())));
  std::string text;
  for (std::size_t pos = 0; pos + 1 < ids.size(); ++pos) {
    if (ids[pos + 1] == Tokenizer::kBos) break;
    text += Tokenizer::printed_text(tok.decode(ids[pos], ids[pos + 1]));
  }
  EXPECT_EQ(text + "\n", read_text(tiny_dir() / "expected_output.txt"));
}

TEST(GgufModelTest, Bf16WeightsRoundAsConvertWeights) {
  const Weights<bf16> w = load_gguf_weights<bf16>(GgufFile::open(gguf("f32")));
  const Weights<bf16> r = convert_weights<bf16>(reference().weights);
  std::vector<const AlignedBuffer<bf16>*> ref;
  r.for_each_tensor(
      [&](const char*, std::int64_t, const AlignedBuffer<bf16>& b) { ref.push_back(&b); });
  std::size_t k = 0;
  w.for_each_tensor([&](const char* name, std::int64_t, const AlignedBuffer<bf16>& b) {
    EXPECT_EQ(std::memcmp(b.data(), ref[k++]->data(), b.bytes()), 0) << name;
  });
}

TEST(GgufModelTest, LoadModelDetectsEitherFormat) {
  const LoadedModel<float> ck = load_model(tiny_dir() / "model.bin");
  EXPECT_EQ(ck.format, ModelFormat::kLlama2cCheckpoint);
  EXPECT_FALSE(ck.vocabulary.has_value());
  EXPECT_EQ(ck.weights.config, reference().weights.config);
  const LoadedModel<float> no_tok = load_model(gguf("notok"));
  EXPECT_EQ(no_tok.format, ModelFormat::kGguf);
  EXPECT_FALSE(no_tok.vocabulary.has_value());
  EXPECT_THAT(error_of([] { load_model(tiny_dir() / "missing.gguf"); }),
              HasSubstr("does not exist"));
}

TEST(GgufModelTest, RefusesFeaturesTheLibraryDoesNotRun) {
  EXPECT_THAT(error_of([] { gguf_model_config(GgufFile::open(gguf("ropescaled"))); }),
              HasSubstr("llama.rope.scaling.type is 'linear'"));
  EXPECT_THAT(error_of([] { gguf_model_config(GgufFile::open(gguf("moe"))); }),
              HasSubstr("llama.expert_count is 8; mixture-of-experts"));
}

// ---------------------------------------------------------------------------------------------
// A llama model with GPT-2's vocabulary (tests/CMakeLists.txt): random weights for 50 257 tokens,
// the tokenizer.* metadata copied from llama.cpp's ggml-vocab-gpt-2.gguf (tests/data/gpt2-vocab).

fs::path gpt2_vocab_dir() { return fs::path(KVDECODE_TEST_DATA_DIR) / "gpt2-vocab"; }
fs::path gpt2_model() { return fs::path(KVDECODE_GGUF_DIR) / "gpt2_tiny.gguf"; }

// llama.cpp's tokenizer test cases: texts separated by "\n__ggml_vocab_test__\n", one line of
// ids per text.
std::vector<std::pair<std::string, std::vector<std::int32_t>>> gpt2_cases() {
  const std::string inp = read_text(gpt2_vocab_dir() / "ggml-vocab-gpt-2.gguf.inp");
  const std::string sep = "\n__ggml_vocab_test__\n";
  std::vector<std::pair<std::string, std::vector<std::int32_t>>> cases;
  for (std::size_t pos = 0; pos < inp.size();) {  // the file ends with a separator
    const std::size_t next = std::min(inp.find(sep, pos), inp.size());
    cases.emplace_back(inp.substr(pos, next - pos), std::vector<std::int32_t>{});
    pos = next + sep.size();
  }
  std::ifstream out(gpt2_vocab_dir() / "ggml-vocab-gpt-2.gguf.out");
  std::size_t k = 0;
  for (std::string line; std::getline(out, line) && k < cases.size(); ++k) {
    std::istringstream in(line);
    for (std::int32_t id = 0; in >> id;) cases[k].second.push_back(id);
  }
  EXPECT_EQ(k, cases.size());
  return cases;
}

TEST(GgufBpeModelTest, LoadModelGivesTheGpt2Vocabulary) {
  LoadedModel<float> loaded = load_model(gpt2_model());
  EXPECT_EQ(loaded.format, ModelFormat::kGguf);
  EXPECT_EQ(loaded.weights.config.vocab_size, 50257);
  EXPECT_FALSE(loaded.vocabulary.has_value());
  ASSERT_TRUE(loaded.bpe_vocabulary.has_value());
  const BpeTokenizer& tok = loaded.bpe_vocabulary->tokenizer;
  const auto cases = gpt2_cases();
  ASSERT_GE(cases.size(), 40u);
  for (const auto& [text, ids] : cases) EXPECT_EQ(tok.encode(text), ids) << "'" << text << "'";

  // The special tokens as the vocabulary file stores them, read through the container: BOS and
  // EOS 50256 (<|endoftext|>), no add_bos_token key (llama.cpp's default for gpt2: no BOS).
  const GgufFile vf = GgufFile::open(gpt2_vocab_dir() / "ggml-vocab-gpt-2.gguf");
  const std::int64_t bos = vf.get_int("tokenizer.ggml.bos_token_id", 0, 50256);
  const std::int64_t eos = vf.get_int("tokenizer.ggml.eos_token_id", 0, 50256);
  EXPECT_EQ(bos, 50256);
  EXPECT_EQ(eos, 50256);
  EXPECT_EQ(vf.find("tokenizer.ggml.add_bos_token"), nullptr);
  EXPECT_EQ(tok.bos_id(), bos);
  EXPECT_EQ(tok.eos_id(), eos);
  EXPECT_FALSE(loaded.bpe_vocabulary->add_bos);
  EXPECT_FALSE(loaded.bpe_vocabulary->add_eos);

  // As a Vocabulary: the same ids, no BOS before a prompt, EOS ends a text.
  const std::optional<Vocabulary> v = take_vocabulary(loaded);
  ASSERT_TRUE(v.has_value());
  EXPECT_FALSE(loaded.bpe_vocabulary.has_value());
  EXPECT_EQ(v->kind(), Vocabulary::Kind::kBytePairs);
  EXPECT_EQ(v->vocab_size(), 50257);
  EXPECT_EQ(v->specials().bos_id, bos);
  EXPECT_EQ(v->specials().eos_id, eos);
  EXPECT_FALSE(v->specials().add_bos);
  EXPECT_EQ(v->specials().end_tokens(), std::vector<std::int32_t>{static_cast<std::int32_t>(eos)});
  for (const auto& [text, ids] : cases) {
    if (ids.empty()) continue;
    EXPECT_EQ(v->encode_prompt(text), ids) << "'" << text << "'";
  }
  // An empty prompt starts from BOS, the one token the model can go on from.
  EXPECT_EQ(v->encode_prompt(""), std::vector<std::int32_t>{50256});
}

TEST(GgufBpeModelTest, GreedyTokensMatchTheReferenceForward) {
  LoadedModel<float> loaded = load_model(gpt2_model());
  const std::optional<Vocabulary> vocab = take_vocabulary(loaded);
  ASSERT_TRUE(vocab.has_value());
  const Model<float> model(std::move(loaded.weights));
  // "Hello, world!" is case 16 of llama.cpp's .out: 15496 11 995 0.
  const std::vector<std::int32_t> prompt = vocab->encode_prompt("Hello, world!");
  ASSERT_EQ(prompt, (std::vector<std::int32_t>{15496, 11, 995, 0}));

  // The reference: each next token the argmax (written here) of forward_reference over the whole
  // sequence so far, no cache.
  constexpr std::size_t kTokens = 12;
  const auto vocab_size = static_cast<std::size_t>(model.config().vocab_size);
  std::vector<std::int32_t> seq = prompt, expected;
  double margin = INFINITY;
  for (std::size_t i = 0; i < kTokens; ++i) {
    const std::vector<float> logits = model.forward_reference(seq);
    const float* last = logits.data() + (seq.size() - 1) * vocab_size;
    std::size_t best = 0;
    for (std::size_t t = 1; t < vocab_size; ++t)
      if (last[t] > last[best]) best = t;
    for (std::size_t t = 0; t < vocab_size; ++t)
      if (t != best) margin = std::min(margin, static_cast<double>(last[best] - last[t]));
    expected.push_back(static_cast<std::int32_t>(best));
    seq.push_back(static_cast<std::int32_t>(best));
  }
  // Ties would make the comparison depend on rounding: the random model has none this close.
  EXPECT_GT(margin, 1e-4);

  ContiguousStore<float> cache(model.config());
  Activations<float> act(model.config(), {.max_chunk = 3});
  Sampler sampler(model.config().vocab_size, SamplerOptions{0.0, 0.9, 0, 1});
  GenerationOptions opt;
  opt.max_new_tokens = kTokens;
  opt.stop_token = -1;  // the comparison is over kTokens tokens, whatever they are
  std::vector<std::int32_t> got;
  generate(model, cache, act, std::span<const std::int32_t>(prompt), sampler, opt,
           [&](std::int32_t t) { got.push_back(t); });
  EXPECT_EQ(got, expected);
}

TEST(GgufBpeModelTest, RefusesAVocabularyOfAnotherSize) {
  // The tiny fixture (512 rows of token_embd.weight) with GPT-2's 50 257 tokens.
  EXPECT_THAT(error_of([] { load_model(gguf("gpt2vocab")); }),
              AllOf(HasSubstr("tiny_gpt2vocab.gguf"),
                    HasSubstr("tokenizer.ggml.tokens holds 50257 tokens but the model's "
                              "vocab_size (rows of token_embd.weight) is 512")));
}

TEST(GgufModelTest, TakeVocabularyOfALlamaFileKeepsRunCsConventionsAndEndsAtEos) {
  LoadedModel<float> loaded = load_model(gguf("f32"));
  EXPECT_FALSE(loaded.bpe_vocabulary.has_value());
  const std::optional<Vocabulary> v = take_vocabulary(loaded);
  ASSERT_TRUE(v.has_value());
  EXPECT_EQ(v->kind(), Vocabulary::Kind::kSentencePiece);
  EXPECT_EQ(v->specials().bos_id, 1);
  EXPECT_EQ(v->specials().eos_id, 2);
  EXPECT_TRUE(v->specials().add_bos);  // the converter writes add_bos_token true
  // run.c stops at BOS; a chat model's answer ends at EOS, where llama.cpp stops.
  EXPECT_EQ(v->specials().end_tokens(), (std::vector<std::int32_t>{1, 2}));
  EXPECT_TRUE(v->specials().ends(1));
  EXPECT_TRUE(v->specials().ends(2));
  EXPECT_FALSE(v->specials().ends(0));
  EXPECT_FALSE(v->specials().ends(-1));
  EXPECT_EQ(v->encode_prompt(read_text(tiny_dir() / "prompt.txt")),
            read_ids(tiny_dir() / "prompt_ids.txt"));
  LoadedModel<float> checkpoint = load_model(tiny_dir() / "model.bin");
  EXPECT_FALSE(take_vocabulary(checkpoint).has_value());
}

// ---------------------------------------------------------------------------------------------
// Block formats as stored: q8_0 / q4_0 tensors loaded into Weights<Q8_0> / Weights<Q4_0>.

fs::path models_dir() { return fs::path(KVDECODE_TEST_DATA_DIR) / ".." / ".." / "models"; }
fs::path kjv_gguf(std::string_view type) {
  return fs::path(KVDECODE_GGUF_DIR) / ("kjv_" + std::string(type) + ".gguf");
}
const Weights<float>& kjv_reference() {
  static const Weights<float> w = load_checkpoint(models_dir() / "kjv_tiny.bin");
  return w;
}

std::uint16_t f16_bits(float x) { return std::bit_cast<std::uint16_t>(static_cast<_Float16>(x)); }

/// ggml's quantize_row_q8_0_ref / quantize_row_q4_0_ref for a row x [n], in f32 as ggml computes:
/// q8_0 d = max|x| / 127, q = roundf(x / d); q4_0 d = m / -8 with m the value of largest
/// magnitude (the first such), code = min(15, (int8)(x / d + 8.5)), element j in the low nibble
/// of byte j and element j + 16 in its high nibble; d stored as binary16 (nearest even).
std::vector<std::byte> ggml_quantize(GgmlType type, const float* x, std::size_t n) {
  std::vector<std::byte> out;
  for (std::size_t b = 0; b < n; b += 32) {
    const float* v = x + b;
    float amax = 0, m = 0;
    for (int j = 0; j < 32; ++j) {
      if (std::fabs(v[j]) > amax) {
        amax = std::fabs(v[j]);
        m = v[j];
      }
    }
    const float d = type == GgmlType::kQ8_0 ? amax / 127.0f : m / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const std::uint16_t h = f16_bits(d);
    out.push_back(static_cast<std::byte>(h & 0xFF));
    out.push_back(static_cast<std::byte>(h >> 8));
    if (type == GgmlType::kQ8_0) {
      for (int j = 0; j < 32; ++j)
        out.push_back(static_cast<std::byte>(static_cast<std::int8_t>(std::roundf(v[j] * id))));
    } else {
      const auto code = [&](float e) {
        return std::min(15, static_cast<int>(static_cast<std::int8_t>(e * id + 8.5f)));
      };
      for (int j = 0; j < 16; ++j)
        out.push_back(static_cast<std::byte>(code(v[j]) | (code(v[j + 16]) << 4)));
    }
  }
  return out;
}

/// The bytes [offset, offset + n) of a file, read on their own (not through the GGUF reader).
std::vector<std::byte> bytes_at(const fs::path& file, std::uint64_t offset, std::uint64_t n) {
  std::ifstream in(file, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(offset));
  std::vector<std::byte> b(static_cast<std::size_t>(n));
  in.read(reinterpret_cast<char*>(b.data()), static_cast<std::streamsize>(n));
  EXPECT_EQ(in.gcount(), static_cast<std::streamsize>(n)) << file;
  return b;
}

/// Every matrix of `file` stored as B's type, loaded as B: the blocks are the file's bytes at the
/// tensor's offset, and ggml's quantization of the checkpoint's f32 tensor `ref`. With `whole`,
/// through load_gguf_weights<B>(); else tensor by tensor (the tiny fixture's w2 rows are 172
/// wide, so it has no Weights<B>). Returns the tensors compared.
template <class B>
std::size_t expect_blocks_as_stored(const fs::path& file, const Weights<float>& ref, bool whole) {
  const GgmlType type = detail::gguf::block_type<B>();
  const GgufFile g = GgufFile::open(file);
  std::optional<Weights<B>> loaded;
  if (whole) loaded.emplace(load_gguf_weights<B>(g));
  std::vector<const AlignedBuffer<B>*> matrices;
  if (loaded) {
    loaded->for_each_tensor([&](const char*, std::int64_t, const auto& b) {
      if constexpr (std::is_same_v<std::remove_cvref_t<decltype(b)>, AlignedBuffer<B>>)
        matrices.push_back(&b);
    });
  }
  std::size_t k = 0, compared = 0;
  ref.for_each_tensor([&](const char* name, std::int64_t layer, const AlignedBuffer<float>& x) {
    const std::string gname = detail::gguf::tensor_name(name, layer);
    const GgufTensorInfo& t = *g.find_tensor(gname);
    if (t.n_dims != 2) return;
    const AlignedBuffer<B>* blocks = loaded ? matrices[k++] : nullptr;
    if (t.type != type) return;
    AlignedBuffer<B> own(x.size() / 32);
    if (!loaded) {
      detail::gguf::load_tensor(t, own);
      blocks = &own;
    }
    const std::uint64_t n_bytes = t.dims[0] * t.dims[1] / 32 * sizeof(B);
    ASSERT_EQ(blocks->bytes(), n_bytes) << gname;
    const std::vector<std::byte> stored = bytes_at(file, g.data_offset() + t.offset, n_bytes);
    EXPECT_EQ(std::memcmp(blocks->data(), stored.data(), n_bytes), 0) << file << " " << gname;
    const std::vector<std::byte> formula = ggml_quantize(type, x.data(), x.size());
    EXPECT_EQ(std::memcmp(blocks->data(), formula.data(), n_bytes), 0) << file << " " << gname;
    ++compared;
  });
  return compared;
}

TEST(GgufBlocksTest, TinyQuantizedTensorsLoadAsStored) {
  // Every matrix but the two w2 (f16: rows of 172 are not whole blocks).
  EXPECT_EQ(expect_blocks_as_stored<Q8_0>(gguf("q8_0"), reference().weights, false), 13u);
  EXPECT_EQ(expect_blocks_as_stored<Q4_0>(gguf("q4_0"), reference().weights, false), 13u);
}

TEST(GgufBlocksTest, KjvWeightsLoadAsStored) {
  const std::size_t matrices = 1 + 7 * 4;  // the shared embedding/classifier, 7 per layer
  EXPECT_EQ(expect_blocks_as_stored<Q8_0>(kjv_gguf("q8_0"), kjv_reference(), true), matrices);
  EXPECT_EQ(expect_blocks_as_stored<Q4_0>(kjv_gguf("q4_0"), kjv_reference(), true), matrices);
}

// Another stored type is converted: q4_0 blocks as Q8_0 are ggml's q8_0 of the q4_0 values, as
// f32 the q4_0 values; the gains are the file's f32 values either way.
TEST(GgufBlocksTest, OtherTypesAreConvertedToTheModelsFormat) {
  const GgufFile g = GgufFile::open(kjv_gguf("q4_0"));
  const Weights<Q8_0> q8 = load_gguf_weights<Q8_0>(g);
  const Weights<float> f = load_gguf_weights<float>(g);
  const std::vector<std::byte> want =
      ggml_quantize(GgmlType::kQ8_0, f.layers[2].w2.data(), f.layers[2].w2.size());
  ASSERT_EQ(q8.layers[2].w2.bytes(), want.size());
  EXPECT_EQ(std::memcmp(q8.layers[2].w2.data(), want.data(), want.size()), 0);
  EXPECT_EQ(std::memcmp(q8.layers[3].rms_ffn.data(), f.layers[3].rms_ffn.data(),
                        f.layers[3].rms_ffn.bytes()),
            0);
  EXPECT_EQ(std::memcmp(q8.layers[3].rms_ffn.data(), kjv_reference().layers[3].rms_ffn.data(),
                        f.layers[3].rms_ffn.bytes()),
            0);
}

/// Relative RMS difference of two logit rows.
double relative_rms(std::span<const float> a, std::span<const float> ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    num += (double{a[i]} - ref[i]) * (double{a[i]} - ref[i]);
    den += double{ref[i]} * ref[i];
  }
  return std::sqrt(num / den);
}

/// The model as stored in `file` against the PyTorch float64 oracle of the f32 checkpoint
/// (tests/data/oracle): the worst relative RMS logit difference over every case's positions, and
/// the greedy continuation's agreement with the oracle's 32 tokens (summed prefix lengths).
template <class B>
void expect_near_oracle(const fs::path& file, double max_rms, std::size_t min_prefix_sum) {
  LoadedModel<B> loaded = load_model<B>(file);
  ASSERT_EQ(loaded.format, ModelFormat::kGguf);
  const Model<float, B> model(std::move(loaded.weights));
  const ModelConfig& c = model.config();
  const auto vocab = static_cast<std::size_t>(c.vocab_size);
  const fs::path oracle = fs::path(KVDECODE_TEST_DATA_DIR) / "oracle";
  double worst = 0;
  std::size_t prefix_sum = 0;
  std::string prefixes;
  for (int k = 0; k < 4; ++k) {
    const std::string base = "case" + std::to_string(k);
    const auto input = read_ids(oracle / (base + ".input_ids.txt"));
    const auto ref = read_f32_le(oracle / (base + ".logits.f32"));
    ASSERT_EQ(ref.size(), input.size() * vocab);
    ContiguousStore<float> cache(c);
    Activations<float> act(c, {.max_chunk = 1});
    for (std::size_t p = 0; p < input.size(); ++p) {
      const auto logits = model.decode(input[p], cache, act);
      worst = std::max(worst, relative_rms(logits, std::span(ref).subspan(p * vocab, vocab)));
    }
    const auto prompt = read_ids(oracle / (base + ".prompt_ids.txt"));
    const auto expected = read_ids(oracle / (base + ".generated_ids.txt"));
    ContiguousStore<float> gen(c);
    Activations<float> gact(c);
    auto logits = model.prefill(prompt, gen, gact);
    std::size_t agree = 0;
    while (agree < expected.size()) {
      const auto t = static_cast<std::int32_t>(std::max_element(logits.begin(), logits.end()) -
                                               logits.begin());
      if (t != expected[agree]) break;
      ++agree;
      logits = model.decode(t, gen, gact);
    }
    prefix_sum += agree;
    prefixes += " " + std::to_string(agree);
  }
  std::cout << "[ gguf     ] " << file.filename().string() << " as stored ("
            << block_format_name<B>() << ", " << active_kernel_set_name()
            << "): worst relative RMS logit difference vs the PyTorch oracle " << worst
            << "; greedy agreement with the oracle's 32 tokens:" << prefixes << "\n";
  EXPECT_LE(worst, max_rms);
  EXPECT_GE(prefix_sum, min_prefix_sum);
}

// Bounds: the measured figures (docs/QUANTIZATION.md §5, "As stored in a GGUF file") with
// margin, in every kernel set the CPU has.
TEST(GgufBlocksTest, StoredModelsTrackThePyTorchOracle) {
  for (const KernelSet ks : kKernelSets) {
    if (!cpu_supports(ks)) continue;
    const testing_util::ForcedKernelSet forced(ks);
    expect_near_oracle<Q8_0>(kjv_gguf("q8_0"), 0.06, 100);  // measured 0.030, 128 of 128
    expect_near_oracle<Q4_0>(kjv_gguf("q4_0"), 0.45, 10);   // measured 0.281, 27 of 128
  }
}

TEST(GgufBlocksTest, TensorsThatCannotBeHeldAreNamed) {
  // The tiny fixture's w2 rows (hidden_dim 172) are not whole blocks: stored as f16.
  EXPECT_THAT(error_of([] { load_model<Q8_0>(gguf("q8_0")); }),
              HasSubstr("tensor 'blk.0.ffn_down.weight' (f16, dims {172, 64}) has rows of 172 "
                        "weights, which cannot be held in q8_0 blocks of 32"));
  const std::vector<std::byte> good = file_bytes(kjv_gguf("q8_0"));
  const GgufFile g = GgufFile::parse(good, "kjv");
  const GgufTensorInfo t = *g.find_tensor("blk.1.attn_v.weight");
  const std::uint64_t dims_at = t.info_offset + 8 + t.name.size() + 4;
  {
    std::vector<std::byte> b = good;  // a type the library has no decoder for
    put_u32(b, dims_at + 16, 3);
    EXPECT_THAT(error_of([&] { load_gguf_weights<Q8_0>(GgufFile::parse(b, "kjv")); }),
                AllOf(HasSubstr("blk.1.attn_v.weight"), HasSubstr("q4_1")));
  }
  {
    std::vector<std::byte> b = good;  // wv [kv_dim = 64][dim] stored with 32 rows
    put_u64(b, dims_at + 8, 32);
    EXPECT_THAT(
        error_of([&] { load_gguf_weights<Q8_0>(GgufFile::parse(b, "kjv")); }),
        HasSubstr("tensor 'blk.1.attn_v.weight' (info at byte " + std::to_string(t.info_offset) +
                  ") has dims {192, 32}, expected {192, "
                  "64}"));
  }
}

// The format a file runs in unchanged: its layer matrices' type when a model can hold it.
TEST(GgufBlocksTest, StoredWeightsNameTheFilesFormat) {
  const auto expect = [](const fs::path& file, WeightFormat format, const char* type) {
    const StoredWeights s = stored_weights(file);
    EXPECT_EQ(s.format, format) << file;
    EXPECT_EQ(s.matrix_type, type) << file;
  };
  expect(kjv_gguf("q8_0"), WeightFormat::kQ8_0, "q8_0");
  expect(kjv_gguf("q4_0"), WeightFormat::kQ4_0, "q4_0");
  expect(gguf("q8_0"), WeightFormat::kF32, "q8_0");  // w2 rows of 172: f16, no Weights<Q8_0>
  expect(gguf("bf16"), WeightFormat::kBf16, "bf16");
  expect(gguf("f16"), WeightFormat::kF32, "f16");
  expect(gguf("f32"), WeightFormat::kF32, "f32");
  expect(tiny_dir() / "model.bin", WeightFormat::kF32, "f32");
}

// The planner's weight bytes are the loaded models' bytes (blocks of 34 / 18 bytes, f32 gains).
TEST(GgufBlocksTest, PlannerCountsTheLoadedBlocks) {
  const ModelConfig& c = kjv_reference().config;
  EXPECT_EQ(weight_bytes<Q8_0>(c), load_model<Q8_0>(kjv_gguf("q8_0")).weights.bytes());
  EXPECT_EQ(weight_bytes<Q4_0>(c), load_model<Q4_0>(kjv_gguf("q4_0")).weights.bytes());
  EXPECT_EQ(weight_bytes<float>(c), kjv_reference().bytes());
}

// v2 differs from v3 only in allowing big-endian files, so the same bytes read as v2.
TEST(GgufTest, ReadsVersion2) {
  std::vector<std::byte> bytes = file_bytes(gguf("f32"));
  bytes[4] = std::byte{2};
  const GgufFile g = GgufFile::parse(bytes, "v2.gguf");
  EXPECT_EQ(g.version(), 2u);
  EXPECT_EQ(load_gguf_weights<float>(g).bytes(), reference().weights.bytes());
}

// Each limit refuses the fixture before its field is read into memory.
TEST(GgufTest, LimitsRefuseBeforeReading) {
  const auto open_with = [](GgufLimits limits) {
    return error_of([&] { GgufFile::open(gguf("f32"), limits); });
  };
  GgufLimits l;
  l.max_tensors = 10;  // the fixture has 20
  EXPECT_THAT(open_with(l),
              HasSubstr("tensor count at byte 8 is 20, more than GgufLimits::max_tensors = 10"));
  l = {};
  l.max_kv = 5;
  EXPECT_THAT(open_with(l), HasSubstr("GgufLimits::max_kv = 5"));
  l = {};
  l.max_array_length = 511;  // the vocabulary has 512 tokens
  EXPECT_THAT(open_with(l), HasSubstr("'tokenizer.ggml.tokens': array length at byte"));
  l = {};
  l.max_string_bytes = 8;
  EXPECT_THAT(open_with(l), HasSubstr("more than GgufLimits::max_string_bytes = 8"));
  l = {};
  l.max_dim = 100;  // vocab_size is 512
  EXPECT_THAT(open_with(l), HasSubstr("tensor 'token_embd.weight'"));
  EXPECT_THAT(error_of([] { load_model(gguf("f32"), GgufLimits{.max_tensors = 1}); }),
              HasSubstr("max_tensors = 1"));
}

// ---------------------------------------------------------------------------------------------
// Malformed files: each damage to the converted f32 file gives an Error naming it.

struct Damage {
  const char* name;
  std::function<void(std::vector<std::byte>&, const GgufFile&)> apply;
  const char* message;  // a substring the Error must contain
};

TEST(GgufMalformedTest, EachDamageGivesAnErrorNamingIt) {
  const std::vector<std::byte> good = file_bytes(gguf("f32"));
  const GgufFile g = GgufFile::parse(good, "good");
  const auto kv_at = [&](std::string_view key) {
    for (const GgufKeyValue& kv : g.metadata())
      if (kv.key == key) return kv;
    ADD_FAILURE() << key;
    return GgufKeyValue{};
  };
  const auto tensor_at = [&](std::string_view name) { return *g.find_tensor(name); };
  const std::vector<Damage> damages = {
      {"magic", [](auto& b, auto&) { b[0] = std::byte{'X'}; }, "expected 0x46554747 ('GGUF')"},
      {"big-endian", [](auto& b, auto&) { put_u32(b, 0, 0x47475546u); }, "big-endian GGUF"},
      {"version 1", [](auto& b, auto&) { put_u32(b, 4, 1); }, "version at byte 4 is 1"},
      {"tensor count", [](auto& b, auto&) { put_u64(b, 8, std::uint64_t{1} << 40); },
       "more than GgufLimits::max_tensors"},
      {"kv count", [](auto& b, auto&) { put_u64(b, 16, ~std::uint64_t{0}); },
       "more than GgufLimits::max_kv"},
      {"more tensors than infos", [](auto& b, auto&) { put_u64(b, 8, 1000); },
       "name is 0 bytes"},  // the zero padding after the last info, read as a name
      {"key length", [&](auto& b, auto&) { put_u64(b, kv_at("general.name").offset, 1u << 30); },
       "max_string_bytes"},
      {"duplicate key",
       [&](auto& b, auto&) {  // tokenizer.ggml.bos_token_id -> tokenizer.ggml.eos_token_id
         b[kv_at("tokenizer.ggml.bos_token_id").offset + 8 + 15] = std::byte{'e'};
       },
       "metadata key 'tokenizer.ggml.eos_token_id' at byte"},
      {"duplicate tensor name",
       [&](auto& b, auto&) {  // blk.0.attn_q.weight -> blk.0.attn_k.weight
         b[tensor_at("blk.0.attn_q.weight").info_offset + 8 + 11] = std::byte{'k'};
       },
       "repeats a tensor name"},
      {"value type",
       [&](auto& b, auto&) { put_u32(b, kv_at("llama.block_count").value.offset - 4, 13); },
       "value type at byte"},
      {"bool value",
       [&](auto& b, auto&) {
         b[kv_at("tokenizer.ggml.add_bos_token").value.offset] = std::byte{2};
       },
       "expected 0 or 1"},
      {"nested array",
       [&](auto& b, auto&) { put_u32(b, kv_at("tokenizer.ggml.scores").value.offset - 12, 9); },
       "array element type"},
      {"array length",
       [&](auto& b, auto&) {
         put_u64(b, kv_at("tokenizer.ggml.scores").value.offset - 8, 1u << 30);
       },
       "max_array_length"},
      {"n_dims",
       [&](auto& b, auto&) {
         const auto& t = tensor_at("output_norm.weight");
         put_u32(b, t.info_offset + 8 + t.name.size(), 5);
       },
       "n_dims at byte"},
      {"zero dim",
       [&](auto& b, auto&) {
         const auto& t = tensor_at("output_norm.weight");
         put_u64(b, t.info_offset + 12 + t.name.size(), 0);
       },
       "dimension 0 at byte"},
      {"tensor type",
       [&](auto& b, auto&) {
         const auto& t = tensor_at("output_norm.weight");
         put_u32(b, t.info_offset + 20 + t.name.size(), 12);
       },
       "ggml type 12 (q4_K)"},
      {"unaligned offset",
       [&](auto& b, auto&) {
         const auto& t = tensor_at("output_norm.weight");
         put_u64(b, t.info_offset + 24 + t.name.size(), t.offset + 4);
       },
       "is not a multiple of the alignment 32"},
      {"offset past the end",
       [&](auto& b, auto&) {
         const auto& t = tensor_at("output_norm.weight");
         put_u64(b, t.info_offset + 24 + t.name.size(), t.offset + (std::uint64_t{1} << 40));
       },
       "of the data section, which holds"},
      {"overlapping tensors",
       [&](auto& b, auto&) {
         const auto& t = tensor_at("output_norm.weight");
         put_u64(b, t.info_offset + 24 + t.name.size(), 0);
       },
       "inside tensor"},
      {"truncated data", [](auto& b, auto&) { b.erase(b.end() - 300, b.end()); }, "which holds"},
      {"array past the end",
       [&](auto& b, auto&) {
         put_u64(b, kv_at("tokenizer.ggml.scores").value.offset - 8, 1u << 20);
       },
       "1048576 float32 values at byte"},
      {"strings past the end",
       [&](auto& b, auto&) {
         put_u64(b, kv_at("tokenizer.ggml.tokens").value.offset - 8, 1u << 20);
       },
       "1048576 strings (each >= 8 bytes)"},
      {"truncated header",
       [&](auto& b, auto&) { b.resize(kv_at("tokenizer.ggml.scores").offset + 10); },
       "file ends at byte"},
      {"architecture",
       [&](auto& b, auto&) {
         std::memcpy(&b[kv_at("general.architecture").value.offset + 8], "gemma", 5);
       },
       "general.architecture is 'gemma'"},
      {"missing key",
       [&](auto& b, auto&) { b[kv_at("llama.block_count").offset + 8 + 6] = std::byte{'X'}; },
       "metadata key 'llama.block_count' is missing"},
      {"key type",
       [&](auto& b, auto&) {
         put_u32(b, kv_at("llama.block_count").value.offset - 4, 6);  // float32
       },
       "'llama.block_count' (value at byte"},
      {"block count beyond the tensors",
       [&](auto& b, auto&) { put_u32(b, kv_at("llama.block_count").value.offset, 100000); },
       "llama.block_count is 100000 but the file lists"},
      {"head count",
       [&](auto& b, auto&) { put_u32(b, kv_at("llama.attention.head_count").value.offset, 3); },
       "must be divisible by llama.attention.head_count (3)"},
      {"tensor dims",
       [&](auto& b, auto&) {
         const auto& t = tensor_at("blk.1.attn_k.weight");
         put_u64(b, t.info_offset + 20 + t.name.size(), 16);
       },
       "tensor 'blk.1.attn_k.weight'"},
      {"missing tensor",
       [&](auto& b, auto&) {
         const auto& t = tensor_at("blk.1.ffn_up.weight");
         b[t.info_offset + 8 + 6] = std::byte{'X'};
       },
       "tensor 'blk.1.ffn_up.weight' is missing"},
      {"byte piece",
       [&](auto& b, auto&) {
         // Token 3 "<0x00>" becomes "<0x01>": byte fallback would emit the wrong id.
         const GgufValue& v = g.get("tokenizer.ggml.tokens");
         const auto at = static_cast<std::uint64_t>(
             reinterpret_cast<const std::byte*>(v.strings[3].data()) - good.data());
         b[at + 4] = std::byte{'1'};
       },
       "token 3 is '<0x01>'"},
  };
  for (const Damage& d : damages) {
    std::vector<std::byte> bytes = good;
    d.apply(bytes, g);
    const std::string what = error_of([&] {
      const GgufFile bad = GgufFile::parse(bytes, "damaged.gguf");
      load_gguf_weights<float>(bad);
      gguf_vocabulary(bad);
    });
    EXPECT_THAT(what, HasSubstr(d.message)) << d.name;
    EXPECT_THAT(what, HasSubstr("gguf 'damaged.gguf'")) << d.name;
  }
}

}  // namespace
}  // namespace kvdecode
