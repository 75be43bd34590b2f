// The vocabulary of a GGUF file (tokenizer.ggml.* metadata): the "llama" model (SentencePiece:
// pieces, scores, byte fallback <0xXX>) with llama2.c's layout as a Tokenizer, so run.c's encode
// applies unchanged; the "gpt2" model (byte-level BPE with GPT-2's pre-tokenizer) as a
// BpeTokenizer; either as a Vocabulary with its special tokens. docs/FORMATS.md §5.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvdecode/error.hpp"
#include "kvdecode/io/gguf.hpp"
#include "kvdecode/text/bpe_tokenizer.hpp"
#include "kvdecode/text/tokenizer.hpp"
#include "kvdecode/text/vocabulary.hpp"

namespace kvdecode {

/// A GGUF file's vocabulary and the special-token settings stored with it.
struct GgufVocabulary {
  Tokenizer tokenizer;
  std::int32_t bos_id = Tokenizer::kBos;
  std::int32_t eos_id = Tokenizer::kEos;
  bool add_bos = true;   ///< tokenizer.ggml.add_bos_token (default true for "llama")
  bool add_eos = false;  ///< tokenizer.ggml.add_eos_token
};

namespace detail::gguf {

// SentencePiece marks a space as U+2581 ("▁"); llama2.c's tokenizer.bin stores it as ' '.
inline constexpr std::string_view kSpaceMark = "\xE2\x96\x81";

inline std::string spaces_from_marks(std::string_view piece) {
  std::string out;
  out.reserve(piece.size());
  for (std::size_t k = 0; k < piece.size();) {
    if (piece.substr(k, kSpaceMark.size()) == kSpaceMark) {
      out += ' ';
      k += kSpaceMark.size();
    } else {
      out += piece[k++];
    }
  }
  return out;
}

}  // namespace detail::gguf

/// Builds the Tokenizer of a GGUF file whose tokenizer.ggml.model is "llama". The existing
/// Tokenizer implements run.c's rules, so the vocabulary must have run.c's layout; throws Error
/// naming the file and the key when it does not: another tokenizer model (e.g. "gpt2"),
/// tokens/scores/token_type arrays of the wrong type or length, BOS/EOS ids other than 1/2, ids
/// 3..258 not the byte pieces <0x00>..<0xFF>, or add_space_prefix false. "▁" becomes ' '.
inline GgufVocabulary gguf_vocabulary(const GgufFile& g) {
  namespace gg = detail::gguf;
  const std::string ctx = g.context();
  const std::string_view model = g.get_string("tokenizer.ggml.model");
  KVDECODE_CHECK(model != "gpt2", ctx,
                 ": tokenizer.ggml.model is 'gpt2' (byte-level BPE); read it with "
                 "gguf_bpe_vocabulary()");
  KVDECODE_CHECK(model == "llama", ctx, ": tokenizer.ggml.model is '", model,
                 "'; only 'llama' (SentencePiece with byte fallback) and 'gpt2' (byte-level BPE) "
                 "are supported");
  const GgufValue& tokens = g.get("tokenizer.ggml.tokens");
  KVDECODE_CHECK(
      tokens.type == GgufValueType::kArray && tokens.element_type == GgufValueType::kString, ctx,
      ": tokenizer.ggml.tokens (at byte ", tokens.offset, ") has type ",
      GgufFile::type_label(tokens), ", expected array of string");
  const std::uint64_t n = tokens.count;
  KVDECODE_CHECK(
      n >= 3 && n <= static_cast<std::uint64_t>(std::numeric_limits<std::int32_t>::max()), ctx,
      ": tokenizer.ggml.tokens holds ", n, " tokens, expected 3..2^31-1");
  const auto numeric_array = [&](const char* key) -> const GgufValue* {
    const GgufValue* v = g.find(key);
    if (v == nullptr) return nullptr;
    KVDECODE_CHECK(v->type == GgufValueType::kArray && v->element_type != GgufValueType::kString,
                   ctx, ": ", key, " (at byte ", v->offset, ") has type ", GgufFile::type_label(*v),
                   ", expected a numeric array");
    KVDECODE_CHECK(v->count == n, ctx, ": ", key, " holds ", v->count,
                   " values, but tokenizer.ggml.tokens holds ", n);
    return v;
  };
  const GgufValue* scores = numeric_array("tokenizer.ggml.scores");
  numeric_array("tokenizer.ggml.token_type");

  const auto special = [&](const char* key, std::int32_t run_c_id) {
    if (!g.find(key)) return run_c_id;
    const auto id = static_cast<std::int32_t>(g.get_int(key, 0, static_cast<std::int64_t>(n) - 1));
    KVDECODE_CHECK(id == run_c_id, ctx, ": ", key, " is ", id, "; the tokenizer needs ", run_c_id,
                   " (llama2.c's layout: <unk> 0, BOS 1, EOS 2)");
    return id;
  };
  const std::int32_t bos_id = special("tokenizer.ggml.bos_token_id", Tokenizer::kBos);
  const std::int32_t eos_id = special("tokenizer.ggml.eos_token_id", Tokenizer::kEos);
  const bool add_bos =
      g.find("tokenizer.ggml.add_bos_token") ? g.get_bool("tokenizer.ggml.add_bos_token") : true;
  const bool add_eos =
      g.find("tokenizer.ggml.add_eos_token") ? g.get_bool("tokenizer.ggml.add_eos_token") : false;
  if (g.find("tokenizer.ggml.add_space_prefix")) {
    KVDECODE_CHECK(g.get_bool("tokenizer.ggml.add_space_prefix"), ctx,
                   ": tokenizer.ggml.add_space_prefix is false; the tokenizer always adds the "
                   "dummy prefix (as run.c)");
  }

  std::vector<std::string> pieces;
  std::vector<float> piece_scores;
  pieces.reserve(static_cast<std::size_t>(n));
  piece_scores.reserve(static_cast<std::size_t>(n));
  std::size_t longest = 1;
  for (std::uint64_t id = 0; id < n; ++id) {
    std::string piece = gg::spaces_from_marks(tokens.strings[static_cast<std::size_t>(id)]);
    if (id >= Tokenizer::kByteIdOffset && id < Tokenizer::kByteIdOffset + 256) {
      const auto byte = static_cast<int>(id) - Tokenizer::kByteIdOffset;
      const bool is_byte = piece.size() == 6 && detail::parse_byte_piece(piece) == byte;
      KVDECODE_CHECK(is_byte, ctx, ": token ", id, " is '", piece, "', expected the byte piece <0x",
                     "0123456789ABCDEF"[byte >> 4], "0123456789ABCDEF"[byte & 15],
                     "> (byte fallback needs id = byte + 3, as llama2.c)");
    }
    longest = std::max(longest, piece.size());
    pieces.push_back(std::move(piece));
    piece_scores.push_back(scores ? static_cast<float>(scores->number_at(id)) : 0.0f);
  }
  try {
    return {Tokenizer(pieces, std::move(piece_scores), static_cast<std::uint32_t>(longest)), bos_id,
            eos_id, add_bos, add_eos};
  } catch (const Error& e) {
    std::string_view m = e.what();
    if (m.starts_with("kvdecode: ")) m.remove_prefix(10);
    KVDECODE_FAIL(ctx, ": tokenizer.ggml.tokens: ", m);
  }
}

/// A GGUF file's byte-level BPE vocabulary and the special-token settings stored with it.
struct GgufBpeVocabulary {
  BpeTokenizer tokenizer;
  bool add_bos = false;  ///< tokenizer.ggml.add_bos_token (llama.cpp's default for "gpt2": false)
  bool add_eos = false;  ///< tokenizer.ggml.add_eos_token
};

namespace detail::gguf {

/// tokenizer.ggml.pre values for which llama.cpp runs GPT-2's regex and nothing else (no added
/// separator, no ignored merges, no BOS by default).
inline constexpr std::string_view kGpt2PreTokenizers[] = {
    "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0"};

}  // namespace detail::gguf

/// Builds the BpeTokenizer of a GGUF file whose tokenizer.ggml.model is "gpt2" and whose
/// tokenizer.ggml.pre names GPT-2's pre-tokenizer (kGpt2PreTokenizers). Other pre-tokenizers
/// (llama-bpe, qwen2, starcoder, deepseek-*, falcon, ...) split text differently and are refused
/// by name, as is a missing one (llama.cpp then uses its "default" regexes). Throws Error naming
/// the file, the key and the index: missing or mistyped tokens/merges, a token_type array of
/// another length, a merge naming an unknown token, a token outside GPT-2's byte characters,
/// BOS/EOS ids outside the vocabulary. Arrays and strings are bounded by the GgufLimits the file
/// was opened with before anything is allocated for them.
inline GgufBpeVocabulary gguf_bpe_vocabulary(const GgufFile& g) {
  namespace gg = detail::gguf;
  const std::string ctx = g.context();
  const std::string_view model = g.get_string("tokenizer.ggml.model");
  KVDECODE_CHECK(model == "gpt2", ctx, ": tokenizer.ggml.model is '", model,
                 "', expected 'gpt2' (byte-level BPE)");
  KVDECODE_CHECK(g.find("tokenizer.ggml.pre") != nullptr, ctx,
                 ": tokenizer.ggml.pre is missing (llama.cpp then uses its 'default' BPE "
                 "pre-tokenizer, which kvdecode does not implement); expected 'gpt-2'");
  const std::string_view pre = g.get_string("tokenizer.ggml.pre");
  KVDECODE_CHECK(std::find(std::begin(gg::kGpt2PreTokenizers), std::end(gg::kGpt2PreTokenizers),
                           pre) != std::end(gg::kGpt2PreTokenizers),
                 ctx, ": tokenizer.ggml.pre is '", pre,
                 "'; only GPT-2's pre-tokenizer ('gpt-2' and the names llama.cpp runs with it) "
                 "is implemented");
  const auto string_array = [&](const char* key) -> const GgufValue& {
    const GgufValue& v = g.get(key);
    KVDECODE_CHECK(v.type == GgufValueType::kArray && v.element_type == GgufValueType::kString, ctx,
                   ": ", key, " (at byte ", v.offset, ") has type ", GgufFile::type_label(v),
                   ", expected array of string");
    return v;
  };
  const GgufValue& tokens = string_array("tokenizer.ggml.tokens");
  const GgufValue& merges = string_array("tokenizer.ggml.merges");
  std::vector<std::int32_t> types;
  if (const GgufValue* t = g.find("tokenizer.ggml.token_type")) {
    GgufValue element;
    element.type = t->element_type;
    KVDECODE_CHECK(t->type == GgufValueType::kArray && element.is_integer(), ctx,
                   ": tokenizer.ggml.token_type (at byte ", t->offset, ") has type ",
                   GgufFile::type_label(*t), ", expected an integer array");
    KVDECODE_CHECK(t->count == tokens.count, ctx, ": tokenizer.ggml.token_type holds ", t->count,
                   " values, but tokenizer.ggml.tokens holds ", tokens.count);
    types.reserve(static_cast<std::size_t>(t->count));
    for (std::uint64_t k = 0; k < t->count; ++k) {
      const double v = t->number_at(k);
      KVDECODE_CHECK(v >= 1 && v <= 6, ctx, ": tokenizer.ggml.token_type[", k, "] is ", v,
                     ", expected 1..6");
      types.push_back(static_cast<std::int32_t>(v));
    }
  }
  const auto special = [&](const char* key) -> std::int32_t {
    if (!g.find(key)) return -1;
    return static_cast<std::int32_t>(
        g.get_int(key, 0, static_cast<std::int64_t>(tokens.count) - 1));
  };
  const std::int32_t bos_id = special("tokenizer.ggml.bos_token_id");
  const std::int32_t eos_id = special("tokenizer.ggml.eos_token_id");
  const bool add_bos =
      g.find("tokenizer.ggml.add_bos_token") ? g.get_bool("tokenizer.ggml.add_bos_token") : false;
  const bool add_eos =
      g.find("tokenizer.ggml.add_eos_token") ? g.get_bool("tokenizer.ggml.add_eos_token") : false;
  KVDECODE_CHECK(
      !add_bos || bos_id >= 0, ctx,
      ": tokenizer.ggml.add_bos_token is true but tokenizer.ggml.bos_token_id is missing");
  KVDECODE_CHECK(
      !add_eos || eos_id >= 0, ctx,
      ": tokenizer.ggml.add_eos_token is true but tokenizer.ggml.eos_token_id is missing");
  return {BpeTokenizer(tokens.strings, types, merges.strings, bos_id, eos_id, ctx), add_bos,
          add_eos};
}

/// A "llama" vocabulary as a Vocabulary: add_bos and add_eos as stored; BOS 1, EOS 2 (checked
/// by gguf_vocabulary()). A generated EOS ends the text (a chat model's answer ends there, and
/// llama.cpp stops), and so does BOS, as run.c (and this library for llama2.c checkpoints)
/// stops. So a file converted from a llama2.c checkpoint ends its texts at BOS as the
/// checkpoint does, and at EOS too, where run.c would print "</s>" and go on.
inline Vocabulary to_vocabulary(GgufVocabulary v) {
  SpecialTokens s = SpecialTokens::run_c();
  s.bos_id = v.bos_id;
  s.eos_id = v.eos_id;
  s.add_bos = v.add_bos;
  s.add_eos = v.add_eos;
  s.end_ids = {v.bos_id, v.eos_id};
  return Vocabulary(std::move(v.tokenizer), s);
}

/// A "gpt2" vocabulary as a Vocabulary: BOS and EOS ids, add_bos and add_eos as stored (BOS
/// only where add_bos says so; llama.cpp's default for gpt2 is none); a generated EOS (GPT-2's
/// <|endoftext|>) ends the text, or nothing does when the vocabulary has no EOS.
inline Vocabulary to_vocabulary(GgufBpeVocabulary v) {
  const SpecialTokens s{
      v.tokenizer.bos_id(), v.tokenizer.eos_id(), v.add_bos, v.add_eos, {v.tokenizer.eos_id(), -1}};
  return Vocabulary(std::move(v.tokenizer), s);
}

}  // namespace kvdecode
