// Vocabulary: a model's tokenizer of either kind, SentencePiece (Tokenizer) or byte-level BPE
// (BpeTokenizer), with the special tokens a generator needs: whether a prompt starts with BOS,
// and which generated tokens end the text. A program that runs any model file holds one; each
// call visits the tokenizer it holds (no virtual calls, one copy of the generation loop).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "kvdecode/error.hpp"
#include "kvdecode/text/bpe_tokenizer.hpp"
#include "kvdecode/text/text_tokenizer.hpp"
#include "kvdecode/text/tokenizer.hpp"

namespace kvdecode {

/// The special tokens of a vocabulary as a generator uses them; -1 where there is none.
struct SpecialTokens {
  std::int32_t bos_id = -1;
  std::int32_t eos_id = -1;
  bool add_bos = false;  ///< a prompt starts with BOS
  bool add_eos = false;  ///< as stored (tokenizer.ggml.add_eos_token); prompts get no EOS
  /// The tokens that end a generated text (not shown), -1 where unused: BOS for llama2.c's
  /// conventions, as run.c stops (its models separate training texts with BOS); BOS and EOS for a
  /// GGUF "llama" vocabulary (a chat model ends its answer with EOS, where llama.cpp stops); EOS
  /// for a GGUF "gpt2" vocabulary (<|endoftext|>).
  std::array<std::int32_t, 2> end_ids{-1, -1};

  /// Whether a generated `token` ends the text.
  constexpr bool ends(std::int32_t token) const {
    return token >= 0 && (token == end_ids[0] || token == end_ids[1]);
  }
  /// The end tokens in use, as a stop list (GenerationOptions::stop_tokens, Request::stop_tokens).
  std::vector<std::int32_t> end_tokens() const {
    std::vector<std::int32_t> out;
    for (const std::int32_t id : end_ids)
      if (id >= 0 && (out.empty() || out[0] != id)) out.push_back(id);
    return out;
  }

  /// run.c's: BOS 1 first, EOS 2, a generated BOS ends the text. Used for tokenizer.bin and the
  /// demo vocabulary.
  static constexpr SpecialTokens run_c() {
    return {Tokenizer::kBos, Tokenizer::kEos, true, false, {Tokenizer::kBos, -1}};
  }
};

class Vocabulary {
 public:
  /// Which tokenizer a vocabulary holds, named as GGUF's tokenizer.ggml.model names it.
  enum class Kind { kSentencePiece, kBytePairs };

  /// A SentencePiece vocabulary; its BOS and EOS are run.c's 1 and 2 (Tokenizer::encode puts
  /// 1 first and 2 last), so `specials` must name those or none. Throws Error otherwise.
  explicit Vocabulary(Tokenizer tokenizer, SpecialTokens specials = SpecialTokens::run_c())
      : tokenizer_(std::move(tokenizer)), specials_(specials) {
    KVDECODE_CHECK(specials.bos_id == -1 || specials.bos_id == Tokenizer::kBos,
                   "Vocabulary: a SentencePiece BOS is ", Tokenizer::kBos, " (run.c), got ",
                   specials.bos_id);
    KVDECODE_CHECK(specials.eos_id == -1 || specials.eos_id == Tokenizer::kEos,
                   "Vocabulary: a SentencePiece EOS is ", Tokenizer::kEos, " (run.c), got ",
                   specials.eos_id);
    check(specials);
  }

  /// A byte-level BPE vocabulary; `specials` ids must be the tokenizer's own bos_id()/eos_id()
  /// (or -1). Throws Error otherwise.
  Vocabulary(BpeTokenizer tokenizer, SpecialTokens specials)
      : tokenizer_(std::move(tokenizer)), specials_(specials) {
    const BpeTokenizer& t = std::get<BpeTokenizer>(tokenizer_);
    KVDECODE_CHECK(specials.bos_id == -1 || specials.bos_id == t.bos_id(), "Vocabulary: BOS ",
                   specials.bos_id, " is not the tokenizer's ", t.bos_id());
    KVDECODE_CHECK(specials.eos_id == -1 || specials.eos_id == t.eos_id(), "Vocabulary: EOS ",
                   specials.eos_id, " is not the tokenizer's ", t.eos_id());
    check(specials);
  }

  // ---- TextTokenizer: each call goes to the tokenizer held ----
  std::vector<std::int32_t> encode(std::string_view text, bool bos, bool eos) const {
    return std::visit([&](const auto& t) { return t.encode(text, bos, eos); }, tokenizer_);
  }
  void encode(std::string_view text, bool bos, bool eos, std::vector<std::int32_t>& out) const {
    std::visit([&](const auto& t) { t.encode(text, bos, eos, out); }, tokenizer_);
  }
  std::string_view decode(std::int32_t prev_token, std::int32_t token) const {
    return std::visit([&](const auto& t) { return t.decode(prev_token, token); }, tokenizer_);
  }
  std::optional<std::int32_t> find(std::string_view piece) const {
    return std::visit([&](const auto& t) { return t.find(piece); }, tokenizer_);
  }
  std::int64_t vocab_size() const {
    return std::visit([](const auto& t) { return t.vocab_size(); }, tokenizer_);
  }

  /// A prompt's tokens: BOS first when the vocabulary adds one, no EOS. An empty text with no
  /// BOS added starts from the vocabulary's BOS (a model needs one token to go on from), or is
  /// refused (Error) when it has none.
  std::vector<std::int32_t> encode_prompt(std::string_view text) const {
    std::vector<std::int32_t> out = encode(text, specials_.add_bos, false);
    if (out.empty() && specials_.bos_id >= 0) out.push_back(specials_.bos_id);
    KVDECODE_CHECK(!out.empty(),
                   "the prompt is empty and the vocabulary has no BOS token to start from");
    return out;
  }

  /// The text of `token` after `prev_token` as a terminal should get it. SentencePiece: run.c's
  /// safe_printf rule (a lone control byte is dropped) except that a raw byte >= 0x80 is kept,
  /// being part of a UTF-8 character that TextStream assembles. Byte-level BPE: the token's bytes
  /// as they are (they are the text; control tokens are "").
  std::string_view shown_text(std::int32_t prev_token, std::int32_t token) const {
    const std::string_view piece = decode(prev_token, token);
    if (kind() == Kind::kBytePairs) return piece;
    if (piece.size() == 1 && static_cast<unsigned char>(piece[0]) >= 0x80) return piece;
    return Tokenizer::printed_text(piece);
  }

  Kind kind() const {
    return std::holds_alternative<Tokenizer>(tokenizer_) ? Kind::kSentencePiece : Kind::kBytePairs;
  }
  const SpecialTokens& specials() const { return specials_; }

  /// The SentencePiece tokenizer, or nullptr for a byte-level BPE vocabulary.
  const Tokenizer* sentencepiece() const { return std::get_if<Tokenizer>(&tokenizer_); }
  /// The byte-level BPE tokenizer, or nullptr for a SentencePiece vocabulary.
  const BpeTokenizer* byte_pairs() const { return std::get_if<BpeTokenizer>(&tokenizer_); }

 private:
  void check(const SpecialTokens& s) const {
    const std::int64_t n = vocab_size();
    const std::pair<const char*, std::int32_t> ids[] = {
        {"BOS", s.bos_id}, {"EOS", s.eos_id}, {"end", s.end_ids[0]}, {"end", s.end_ids[1]}};
    for (const auto& [what, id] : ids) {
      KVDECODE_CHECK(id >= -1 && id < n, "Vocabulary: ", what, " token ", id,
                     " is outside the vocabulary [0, ", n, ")");
    }
    KVDECODE_CHECK(!s.add_bos || s.bos_id >= 0, "Vocabulary: add_bos without a BOS token");
  }

  std::variant<Tokenizer, BpeTokenizer> tokenizer_;
  SpecialTokens specials_;
};

static_assert(TextTokenizer<Vocabulary>);

}  // namespace kvdecode
