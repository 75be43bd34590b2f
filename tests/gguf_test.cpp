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
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "fixture_files.hpp"
#include "kvdecode/io/checkpoint.hpp"
#include "kvdecode/io/gguf_model.hpp"
#include "kvdecode/io/gguf_tokenizer.hpp"
#include "kvdecode/io/load_model.hpp"
#include "kvdecode/kvdecode.hpp"

namespace kvdecode {
namespace {

namespace fs = std::filesystem;
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

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no Error thrown)";
}

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
      {"truncated data", [](auto& b, auto&) { b.resize(b.size() - 300); }, "which holds"},
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
