// Vocabulary: either tokenizer with its special tokens, as the generator and the server use it.
// Small vocabularies built here: the 256 GPT-2 byte characters (no merges) plus <|endoftext|>,
// and a run.c layout (<unk>, BOS, EOS, 256 byte pieces, a space).
#include "kvdecode/text/vocabulary.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "gpt2_bytes.hpp"
#include "test_util.hpp"

namespace kvdecode {
namespace {

using ::testing::HasSubstr;

using testing_util::error_of;

// GPT-2's 256 byte characters (gpt2_bytes.hpp), then <|endoftext|>.
std::vector<std::string> byte_tokens() {
  std::vector<std::string> tokens = testing_util::gpt2_byte_characters();
  tokens.push_back("<|endoftext|>");  // id 256, control
  return tokens;
}

BpeTokenizer byte_level(std::int32_t bos, std::int32_t eos) {
  const std::vector<std::string> tokens = byte_tokens();
  const std::vector<std::string_view> views(tokens.begin(), tokens.end());
  std::vector<std::int32_t> types(tokens.size(), 1);
  types.back() = 3;
  return BpeTokenizer(views, types, {}, bos, eos);
}

Tokenizer run_c_layout() {
  std::vector<std::string> pieces = {"<unk>", "\n<s>\n", "\n</s>\n"};
  for (int b = 0; b < 256; ++b) {
    char hex[8];
    std::snprintf(hex, sizeof hex, "<0x%02X>", b);
    pieces.emplace_back(hex);
  }
  pieces.emplace_back(" ");
  return Tokenizer(pieces, std::vector<float>(pieces.size(), 0.0f), 6);
}

TEST(VocabularyTest, BytePairsFollowTheirSpecialTokens) {
  const Vocabulary v(byte_level(256, 256), {256, 256, false, false, {256, -1}});
  EXPECT_EQ(v.kind(), Vocabulary::Kind::kBytePairs);
  EXPECT_EQ(v.vocab_size(), 257);
  // No BOS added: one token per byte of the text.
  EXPECT_EQ(v.encode_prompt("Hi!"), (std::vector<std::int32_t>{'H', 'i', '!'}));
  EXPECT_EQ(v.encode_prompt(""), std::vector<std::int32_t>{256});
  const Vocabulary with_bos(byte_level(256, 256), {256, 256, true, false, {256, -1}});
  EXPECT_EQ(with_bos.encode_prompt("Hi"), (std::vector<std::int32_t>{256, 'H', 'i'}));
  const Vocabulary no_bos(byte_level(-1, 256), {-1, 256, false, false, {256, -1}});
  EXPECT_THAT(error_of([&] { no_bos.encode_prompt(""); }),
              HasSubstr("the prompt is empty and the vocabulary has no BOS token"));
}

TEST(VocabularyTest, ShownTextIsTheBytesForBytePairsAndRunCsRuleForSentencePiece) {
  const Vocabulary bpe(byte_level(256, 256), {256, 256, false, false, {256, -1}});
  // A lone control byte and a lone byte >= 0x80 are text like any other.
  const std::int32_t bell = 0x07, high = 0xE9;
  EXPECT_EQ(bpe.shown_text(-1, bell), "\x07");
  EXPECT_EQ(bpe.shown_text(-1, high), "\xE9");
  EXPECT_EQ(bpe.shown_text(-1, 256), "");  // control: no bytes

  const Vocabulary spm(run_c_layout());
  EXPECT_EQ(spm.kind(), Vocabulary::Kind::kSentencePiece);
  EXPECT_EQ(spm.specials().end_tokens(), std::vector<std::int32_t>{Tokenizer::kBos});
  EXPECT_TRUE(spm.specials().ends(Tokenizer::kBos));
  EXPECT_FALSE(spm.specials().ends(Tokenizer::kEos));                 // run.c goes on past EOS
  EXPECT_EQ(spm.shown_text(5, Tokenizer::kByteIdOffset + bell), "");  // run.c's safe_printf
  EXPECT_EQ(spm.shown_text(5, Tokenizer::kByteIdOffset + high), "\xE9");
  EXPECT_EQ(spm.shown_text(5, Tokenizer::kByteIdOffset + 'A'), "A");
  EXPECT_EQ(spm.encode_prompt("A").front(), Tokenizer::kBos);
}

TEST(VocabularyTest, RefusesSpecialTokensTheTokenizerDoesNotHave) {
  EXPECT_THAT(error_of([] {
                Vocabulary(byte_level(256, 256), {5, 256, false, false, {256, -1}});
              }),
              HasSubstr("BOS 5 is not the tokenizer's 256"));
  EXPECT_THAT(error_of([] {
                Vocabulary(byte_level(256, 256), {256, 256, false, false, {300, -1}});
              }),
              HasSubstr("end token 300 is outside the vocabulary [0, 257)"));
  EXPECT_THAT(error_of([] {
                Vocabulary(byte_level(-1, 256), {-1, 256, true, false, {256, -1}});
              }),
              HasSubstr("add_bos without a BOS token"));
  EXPECT_THAT(error_of([] {
                Vocabulary(run_c_layout(), {3, 2, true, false, 1});
              }),
              HasSubstr("a SentencePiece BOS is 1 (run.c), got 3"));
}

}  // namespace
}  // namespace kvdecode
