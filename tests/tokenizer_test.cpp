// Tokenizer against llama2.c run.c: the fixture's encode cases, prompt and stdout, a literal
// transcription of run.c's encode as the naive reference, glibc's sscanf for byte pieces, and
// malformed tokenizer.bin files.
#include "kvdecode/text/tokenizer.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cctype>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <optional>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvdecode {
namespace {

using ::testing::HasSubstr;
using namespace std::string_view_literals;

constexpr std::int64_t kFixtureVocabSize = 512;  // from the fixture checkpoint's header

// ---------------------------------------------------------------------------------------------
// Fixture files (copied from shared/fixtures/llama2c-tiny into tests/data/llama2c-tiny)

std::filesystem::path data_dir() {
  return std::filesystem::path(KVDECODE_TEST_DATA_DIR) / "llama2c-tiny";
}

std::string read_text(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  EXPECT_TRUE(in) << "cannot open " << file;
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::vector<std::byte> read_bytes(const std::filesystem::path& file) {
  const std::string text = read_text(file);
  std::vector<std::byte> bytes(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) bytes[i] = static_cast<std::byte>(text[i]);
  return bytes;
}

std::vector<std::int32_t> read_ids(const std::filesystem::path& file) {
  std::istringstream in(read_text(file));
  std::vector<std::int32_t> ids;
  for (std::int32_t id = 0; in >> id;) ids.push_back(id);
  return ids;
}

Tokenizer load_fixture() {
  return Tokenizer::load(data_dir() / "tokenizer.bin", kFixtureVocabSize);
}

struct EncodeCase {
  std::string text;
  std::vector<std::int32_t> ids;
};

// encode_cases.json is kept as the fixture ships it. This reads only what the test needs and
// relies on its layout: each case has "utf8_hex" (the text's bytes, which avoids decoding JSON
// string escapes) before its "ids" array of integers.
std::vector<EncodeCase> read_encode_cases() {
  const std::string json = read_text(data_dir() / "encode_cases.json");
  std::vector<EncodeCase> cases;
  for (std::size_t pos = json.find("\"utf8_hex\""); pos != std::string::npos;
       pos = json.find("\"utf8_hex\"", pos)) {
    const std::size_t open = json.find('"', json.find(':', pos) + 1);
    const std::size_t close = json.find('"', open + 1);
    const std::string hex = json.substr(open + 1, close - open - 1);
    EncodeCase c;
    for (std::size_t i = 0; i + 1 < hex.size(); i += 2) {
      c.text.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
    }
    const std::size_t begin = json.find('[', json.find("\"ids\"", close));
    const std::size_t end = json.find(']', begin);
    std::string numbers = json.substr(begin + 1, end - begin - 1);
    for (char& ch : numbers) {
      if (ch == ',') ch = ' ';
    }
    std::istringstream in(numbers);
    for (std::int32_t id = 0; in >> id;) c.ids.push_back(id);
    cases.push_back(std::move(c));
    pos = end;
  }
  return cases;
}

std::filesystem::path temp_path(std::string_view name) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return std::filesystem::temp_directory_path() /
         ("kvdecode_tokenizer_test_" + std::to_string(::getpid()) + "_" + info->name() + "_" +
          std::string(name));
}

// ---------------------------------------------------------------------------------------------
// Hand-built vocabularies and raw files

// The Llama layout run.c assumes: <unk>, BOS, EOS, the 256 byte tokens, then " " (id 259).
struct Vocab {
  std::vector<std::string> pieces;
  std::vector<float> scores;

  std::int32_t add(std::string piece, float score) {
    pieces.push_back(std::move(piece));
    scores.push_back(score);
    return static_cast<std::int32_t>(pieces.size() - 1);
  }
  Tokenizer build(std::uint32_t max_token_length = 16) const {
    return Tokenizer(pieces, scores, max_token_length);
  }
};

Vocab llama_base_vocab() {
  Vocab v;
  v.add("<unk>", 0.0f);
  v.add("\n<s>\n", 0.0f);
  v.add("\n</s>\n", 0.0f);
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    v.add(name, 0.0f);
  }
  v.add(" ", -1e9f);  // id 259, as in the fixture and in Llama's tokenizer.bin
  return v;
}

constexpr std::int32_t kSpace = 259;
constexpr std::int32_t byte_id(int b) { return b + Tokenizer::kByteIdOffset; }

// Writes tokenizer.bin fields little-endian, including ones a valid file never has.
struct RawFile {
  std::vector<std::byte> bytes;

  RawFile& u32(std::uint32_t v) {
    for (int shift = 0; shift < 32; shift += 8) bytes.push_back(static_cast<std::byte>(v >> shift));
    return *this;
  }
  RawFile& i32(std::int32_t v) { return u32(static_cast<std::uint32_t>(v)); }
  RawFile& f32(float v) { return u32(std::bit_cast<std::uint32_t>(v)); }
  RawFile& text(std::string_view s) {
    for (const char c : s) bytes.push_back(static_cast<std::byte>(c));
    return *this;
  }
  RawFile& entry(float score, std::string_view piece) {
    return f32(score).i32(static_cast<std::int32_t>(piece.size())).text(piece);
  }
};

// A 7-entry vocabulary small enough to truncate at every byte; entry 5 is an empty piece.
const std::vector<std::string> kSmallPieces = {"<unk>", "\n<s>\n", "\n</s>\n", " ", "a", "", "ab"};

RawFile small_file_header_and_entries(std::size_t n_entries, std::uint32_t max_token_length = 8) {
  RawFile f;
  f.u32(max_token_length);
  for (std::size_t i = 0; i < n_entries; ++i) f.entry(-static_cast<float>(i), kSmallPieces[i]);
  return f;
}

std::string error_message(const std::function<void()>& action) {
  try {
    action();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected kvdecode::Error";
  return {};
}

// ---------------------------------------------------------------------------------------------
// Naive reference: run.c's encode() transcribed literally (a fresh concatenation per pair,
// every pair looked up again after every merge, the whole list rescanned for the best merge:
// O(n²) in the text length). str_lookup is a hash map from piece to its lowest id, so that
// texts of a few thousand bytes stay affordable.

std::vector<std::int32_t> naive_run_c_encode(const Tokenizer& t, std::string_view text, bool bos,
                                             bool eos) {
  std::vector<std::string_view> vocab;
  std::unordered_map<std::string_view, std::int32_t> ids;
  for (std::int32_t i = 0; i < t.vocab_size(); ++i) {
    vocab.push_back(t.piece(i));
    ids.emplace(vocab.back(), i);  // keeps the first, lowest id of a duplicate piece
  }
  auto str_lookup = [&](const std::string& s) {
    const auto it = ids.find(s);
    return it == ids.end() ? std::int32_t{-1} : it->second;
  };
  std::vector<std::int32_t> tokens;
  if (bos) tokens.push_back(1);
  if (!text.empty()) tokens.push_back(str_lookup(" "));
  std::string str_buffer;
  for (std::size_t c = 0; c < text.size(); ++c) {
    if ((text[c] & 0xC0) != 0x80) str_buffer.clear();
    str_buffer += text[c];
    if (c + 1 < text.size() && (text[c + 1] & 0xC0) == 0x80 && str_buffer.size() < 4) continue;
    const std::int32_t id = str_lookup(str_buffer);
    if (id != -1) {
      tokens.push_back(id);
    } else {
      for (const char b : str_buffer) tokens.push_back(static_cast<unsigned char>(b) + 3);
    }
    str_buffer.clear();
  }
  while (true) {
    float best_score = -1e10f;
    std::int32_t best_id = -1;
    std::ptrdiff_t best_idx = -1;
    for (std::size_t i = 0; i + 1 < tokens.size(); ++i) {
      std::string merged(vocab[static_cast<std::size_t>(tokens[i])]);
      merged += vocab[static_cast<std::size_t>(tokens[i + 1])];
      const std::int32_t id = str_lookup(merged);
      if (id != -1 && t.score(id) > best_score) {
        best_score = t.score(id);
        best_id = id;
        best_idx = static_cast<std::ptrdiff_t>(i);
      }
    }
    if (best_idx == -1) break;
    tokens[static_cast<std::size_t>(best_idx)] = best_id;
    tokens.erase(tokens.begin() + best_idx + 1);
  }
  if (eos) tokens.push_back(2);
  return tokens;
}

// Texts mixing vocabulary pieces, UTF-8 (2- and 4-byte), stray continuation bytes, lone lead
// bytes, control characters, literal byte-token text and arbitrary bytes.
std::vector<std::string> random_texts(std::uint32_t seed, int count) {
  static const std::vector<std::string> kFragments = {"a",
                                                      "b",
                                                      "c",
                                                      " ",
                                                      "  ",
                                                      "e",
                                                      "the",
                                                      " the",
                                                      "he",
                                                      "Once",
                                                      " upon",
                                                      "é",
                                                      "ê",
                                                      "€",
                                                      "🙂",
                                                      "\x80",
                                                      "\xC3",
                                                      "\n",
                                                      "\t",
                                                      "<0x41>",
                                                      "aa",
                                                      "abc",
                                                      "cc",
                                                      "Lily",
                                                      ".",
                                                      "\"",
                                                      "ing",
                                                      "\xF0\x9F",
                                                      "\x80\x80\x80\x80\x80"};
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> length(0, 24);
  std::uniform_int_distribution<std::size_t> pick(0, kFragments.size());
  std::uniform_int_distribution<int> any_byte(1, 255);
  std::vector<std::string> texts;
  for (int i = 0; i < count; ++i) {
    std::string text;
    for (int n = length(rng); n > 0; --n) {
      const std::size_t k = pick(rng);
      if (k == kFragments.size()) {
        text.push_back(static_cast<char>(any_byte(rng)));
      } else {
        text += kFragments[k];
      }
    }
    texts.push_back(std::move(text));
  }
  return texts;
}

// ---------------------------------------------------------------------------------------------
// Loading the fixture

TEST(TokenizerTest, LoadsFixtureVocabulary) {
  const Tokenizer t = load_fixture();
  EXPECT_EQ(t.vocab_size(), 512);
  EXPECT_EQ(t.max_token_length(), 7u);
  EXPECT_EQ(t.piece(0), "<unk>");
  EXPECT_EQ(t.piece(Tokenizer::kBos), "\n<s>\n");
  EXPECT_EQ(t.piece(Tokenizer::kEos), "\n</s>\n");
  EXPECT_EQ(t.piece(byte_id(0x00)), "<0x00>");
  EXPECT_EQ(t.piece(byte_id(0xFF)), "<0xFF>");
  EXPECT_EQ(t.piece(kSpace), " ");
  EXPECT_EQ(t.score(kSpace), -1e9f);
  EXPECT_EQ(t.piece(354), "he");  // the first merge (README: 354..511 are merges -1, -2, ...)
  EXPECT_EQ(t.score(354), -1.0f);
  EXPECT_EQ(t.score(511), -158.0f);
  EXPECT_EQ(t.find(" "), kSpace);
  EXPECT_EQ(t.find(" the"), 357);
  EXPECT_EQ(t.find("not a piece"), std::nullopt);
}

// ---------------------------------------------------------------------------------------------
// Encode

TEST(TokenizerTest, EncodeMatchesRunCForAllFixtureCases) {
  const Tokenizer t = load_fixture();
  const std::vector<EncodeCase> cases = read_encode_cases();
  ASSERT_EQ(cases.size(), 12u);
  for (const EncodeCase& c : cases) {
    EXPECT_EQ(t.encode(c.text), c.ids) << "text: \"" << c.text << "\"";
  }
}

TEST(TokenizerTest, EncodePromptMatchesPromptIds) {
  const Tokenizer t = load_fixture();
  const std::vector<std::int32_t> prompt_ids = read_ids(data_dir() / "prompt_ids.txt");
  ASSERT_EQ(prompt_ids.size(), 24u);
  EXPECT_EQ(t.encode(read_text(data_dir() / "prompt.txt"), true, false), prompt_ids);
}

TEST(TokenizerTest, EncodeMatchesNaiveRunCTranscriptionOnRandomText) {
  Vocab tiny = llama_base_vocab();
  for (const char* p : {"a", "b", "c", "e", "ab", "bc", "abc", " a", "aa", "cc", "é", "he"}) {
    tiny.add(p, -static_cast<float>(tiny.pieces.size() % 7));  // many equal scores: ties matter
  }
  tiny.add("\x80\x80\x80\x80", -2.0f);
  tiny.add("<0xC3><0xA9>", -1.0f);
  const Tokenizer tokenizers[] = {load_fixture(), tiny.build()};
  for (const Tokenizer& t : tokenizers) {
    for (const std::string& text : random_texts(1234, 200)) {
      for (const bool bos : {true, false}) {
        const bool eos = !bos;
        ASSERT_EQ(t.encode(text, bos, eos), naive_run_c_encode(t, text, bos, eos))
            << "vocab_size " << t.vocab_size() << ", text: \"" << text << "\"";
      }
    }
  }
}

// A vocabulary made for ties: every merge of a, b and c up to 4 letters, scored by length
// alone (so all merges of one length tie), plus a few pieces scored higher that a merge of
// shorter pieces can create later, which run.c finds only because it rescores after each merge.
Vocab tie_vocab() {
  Vocab v = llama_base_vocab();
  const std::string letters = "abc";
  std::vector<std::string> level = {""};
  for (int len = 1; len <= 4; ++len) {
    std::vector<std::string> longer;
    for (const std::string& p : level)
      for (const char c : letters) longer.push_back(p + c);
    for (const std::string& p : longer) v.add(p, len == 1 ? -100.0f : -static_cast<float>(len));
    level = std::move(longer);
  }
  for (const char* p : {"abcab", "ccccc", " a", " ab", " abc", "é", "éé", "<0xC3>a"})
    v.add(p, 0.0f);
  v.add("bbbbb", -1e10f);  // never merges (run.c needs a score above -1e10)
  v.add("aaaaa", std::numeric_limits<float>::quiet_NaN());  // never merges (NaN > x is false)
  return v;
}

// Random texts of up to `max_bytes` bytes in one of four styles: arbitrary bytes (stray
// continuation bytes, lone lead bytes, NUL); valid UTF-8 of 1 to 4 bytes a code point; letters
// a-c only (long runs of equal-score ties); and repeats of a short random piece.
std::vector<std::string> long_random_texts(std::uint32_t seed, int count, std::size_t max_bytes) {
  std::mt19937 rng(seed);
  std::vector<std::string> texts;
  for (int i = 0; i < count; ++i) {
    const std::size_t bytes = std::uniform_int_distribution<std::size_t>(0, max_bytes)(rng);
    std::string text;
    switch (i % 4) {
      case 0:
        while (text.size() < bytes) text.push_back(static_cast<char>(rng() & 0xFF));
        break;
      case 1: {
        static const std::vector<std::string> kCodePoints = {
            "a", "b", " ", "e", "\n", "\xC3\xA9", "\xC3\xAA", "\xE2\x82\xAC", "\xF0\x9F\x99\x82"};
        while (text.size() < bytes) text += kCodePoints[rng() % kCodePoints.size()];
        break;
      }
      case 2:
        while (text.size() < bytes) text.push_back(static_cast<char>('a' + rng() % 3));
        break;
      default: {
        static const std::vector<std::string> kPieces = {"a",   "ab",   "abc",   "c", " ",
                                                         "the", "Once", " upon", "é", "<0x41>"};
        std::string unit;
        for (int k = 1 + static_cast<int>(rng() % 4); k > 0; --k)
          unit += kPieces[rng() % kPieces.size()];
        while (text.size() < bytes) text += unit;
        break;
      }
    }
    texts.push_back(std::move(text));
  }
  return texts;
}

// The heap-based merge loop against the O(n²) transcription of run.c on texts long enough for
// many merges to interact: ties between far-apart pairs, merges that rescore their neighbours,
// and pairs that become mergeable only after an earlier merge.
TEST(TokenizerTest, EncodeEqualsTheQuadraticRunCLoopOnLongRandomTexts) {
  const Tokenizer tokenizers[] = {load_fixture(), tie_vocab().build()};
  for (const Tokenizer& t : tokenizers) {
    for (const std::string& text : long_random_texts(99, 120, 600)) {
      ASSERT_EQ(t.encode(text), naive_run_c_encode(t, text, true, false))
          << "vocab_size " << t.vocab_size() << ", " << text.size() << " bytes: \"" << text << "\"";
    }
  }
}

// A few texts of several thousand bytes, so the heap grows deep.
TEST(TokenizerTest, EncodeEqualsTheQuadraticRunCLoopOnAFewKilobytes) {
  const Tokenizer tokenizers[] = {load_fixture(), tie_vocab().build()};
  for (const Tokenizer& t : tokenizers) {
    for (const std::string& text : long_random_texts(7, 8, 4000)) {
      ASSERT_EQ(t.encode(text, true, true), naive_run_c_encode(t, text, true, true))
          << "vocab_size " << t.vocab_size() << ", " << text.size() << " bytes";
    }
  }
}

// Words merge alone (a heap each) only when no piece holds a byte other than ' ' followed by
// ' '. Against run.c's loop over the whole text: a vocabulary that allows it, with runs of
// spaces as Llama's has and an empty piece; and the same plus pieces that join words ("b a",
// "a  ", a byte piece before a space), which must merge across the space as run.c does.
TEST(TokenizerTest, WordsMergeAloneOnlyWhereNoPieceJoinsThem) {
  Vocab words = llama_base_vocab();
  for (const char* p : {"a", "b", "ab", " b", " ab", "  ", "   ", "    a", "", "ba", "aba"})
    words.add(p, -static_cast<float>(words.pieces.size() % 5));
  words.add(" a", 5.0f);
  Vocab joined = words;
  const std::int32_t b_a = joined.add("b a", 10.0f);
  joined.add("a  ", 0.0f);
  joined.add("<0xC3> a", 0.0f);
  const Tokenizer split = words.build(), whole = joined.build();
  for (const Tokenizer* t : {&split, &whole}) {
    for (const std::string& text : long_random_texts(5, 80, 400)) {
      ASSERT_EQ(t->encode(text), naive_run_c_encode(*t, text, true, false))
          << "vocab_size " << t->vocab_size() << ", " << text.size() << " bytes: \"" << text
          << "\"";
    }
    for (const std::string& text : random_texts(77, 200)) {
      ASSERT_EQ(t->encode(text, false, true), naive_run_c_encode(*t, text, false, true))
          << "vocab_size " << t->vocab_size() << ", text: \"" << text << "\"";
    }
  }
  // Hand-derived: " a" (5) merges first, then "b" + " a" into "b a" (10) across the space;
  // without that piece the dummy prefix and "b" merge into " b" instead.
  EXPECT_EQ(whole.encode("b a", false, false), (std::vector<std::int32_t>{kSpace, b_a}));
  EXPECT_EQ(split.encode("b a", false, false),
            (std::vector<std::int32_t>{*split.find(" b"), *split.find(" a")}));
}

// Hand-derived: all ties of one length go left to right, and a higher-scored piece formed by
// earlier merges is taken as soon as it exists.
TEST(TokenizerTest, TieVocabularyMergesLeftToRightByLength) {
  const Vocab v = tie_vocab();
  const Tokenizer t = v.build();
  const auto id = [&](std::string_view p) { return *t.find(p); };
  // "aaaaaa" → [BOS, " ", a × 6]: " a" (0) is the best pair; then "aa" (-2) ties at every
  // pair and the leftmost merges: [" a", aa, a, a, a]; then (aa, a) "aaa" (-3) loses to the
  // later (a, a) "aa" (-2): [" a", aa, aa, a]; then "aaa" (-3) at (aa, a) beats "aaaa" (-4) at
  // (aa, aa): [" a", aa, aaa]; "aaaaa" scores NaN and never merges.
  EXPECT_EQ(t.encode("aaaaaa"), (std::vector<std::int32_t>{1, id(" a"), id("aa"), id("aaa")}));
  // "abcab": " a" (0) beats the -2 pairs, then " ab" (0), then " abc" (0), then "ab" (-2).
  EXPECT_EQ(t.encode("abcab"), (std::vector<std::int32_t>{1, id(" abc"), id("ab")}));
  // "bbbbb": bb, then bb (-2) beats bbb (-3), then bbb (-3) beats bbbb (-4); "bbbbb" scores
  // -1e10, not above run.c's starting best, so (bb, bbb) stays.
  EXPECT_EQ(t.encode("bbbbb"), (std::vector<std::int32_t>{1, kSpace, id("bb"), id("bbb")}));
}

TEST(TokenizerTest, EncodeEmptyTextHasNoDummyPrefix) {
  const Tokenizer t = load_fixture();
  EXPECT_EQ(t.encode(""), (std::vector<std::int32_t>{Tokenizer::kBos}));
  EXPECT_EQ(t.encode("", false, false), std::vector<std::int32_t>{});
  EXPECT_EQ(t.encode("", true, true),
            (std::vector<std::int32_t>{Tokenizer::kBos, Tokenizer::kEos}));
}

TEST(TokenizerTest, EncodeOverloadReplacesOutputAndReusesItsCapacity) {
  const Tokenizer t = load_fixture();
  const std::string prompt = read_text(data_dir() / "prompt.txt");
  std::vector<std::int32_t> out(100, 7);
  t.encode(prompt, true, false, out);
  EXPECT_EQ(out, read_ids(data_dir() / "prompt_ids.txt"));
  const std::int32_t* data = out.data();
  const std::size_t capacity = out.capacity();
  t.encode(prompt, true, true, out);
  EXPECT_EQ(out.back(), Tokenizer::kEos);
  EXPECT_EQ(out.data(), data);
  EXPECT_EQ(out.capacity(), capacity);
}

// Tiny vocabulary: a, b, c and merges whose order is derived by hand below.
struct TinyVocab {
  Vocab v = llama_base_vocab();
  std::int32_t a = v.add("a", -100.0f);
  std::int32_t b = v.add("b", -100.0f);
  std::int32_t c = v.add("c", -100.0f);
  std::int32_t ab = v.add("ab", -3.0f);
  std::int32_t bc = v.add("bc", -2.0f);
  std::int32_t abc = v.add("abc", -1.0f);
  std::int32_t space_a = v.add(" a", -5.0f);
  std::int32_t aa = v.add("aa", -2.0f);
  std::int32_t cc = v.add("cc", -1e10f);  // exactly run.c's starting best_score
  std::int32_t e_acute_bytes = v.add("<0xC3><0xA9>", -1.0f);
  std::int32_t four_continuations = v.add("\x80\x80\x80\x80", -100.0f);
};

TEST(TokenizerTest, MergePriorityFollowsScores) {
  const TinyVocab tv;
  const Tokenizer t = tv.v.build();
  // "abc" -> [BOS, " ", a, b, c]. Candidates: " a" -5, "ab" -3, "bc" -2: "bc" is best, giving
  // [BOS, " ", a, bc]. Candidates: " a" -5, "abc" -1: "abc" wins, and " abc" is no piece.
  // (Leftmost-first merging would take " a" first and end in [BOS, " a", bc].)
  EXPECT_EQ(t.encode("abc"), (std::vector<std::int32_t>{1, kSpace, tv.abc}));
  // Without "abc", the same text stops at the best first merge.
  for (const bool ab_first : {true, false}) {
    Vocab v = llama_base_vocab();
    const std::int32_t a = v.add("a", -100.0f);
    v.add("b", -100.0f);
    const std::int32_t c = v.add("c", -100.0f);
    const std::int32_t ab = v.add("ab", ab_first ? -1.0f : -2.0f);
    const std::int32_t bc = v.add("bc", ab_first ? -2.0f : -1.0f);
    const std::vector<std::int32_t> expected = ab_first
                                                   ? std::vector<std::int32_t>{1, kSpace, ab, c}
                                                   : std::vector<std::int32_t>{1, kSpace, a, bc};
    EXPECT_EQ(v.build().encode("abc"), expected) << "ab_first " << ab_first;
  }
}

TEST(TokenizerTest, MergeTiesGoToTheLeftmostPair) {
  const TinyVocab tv;
  const Tokenizer t = tv.v.build();
  // "aaa" -> [BOS, " ", a, a, a]: "aa" scores -2 at positions 2 and 3; the leftmost merges,
  // giving [BOS, " ", aa, a]; " aa" and "aaa" are no pieces.
  EXPECT_EQ(t.encode("aaa"), (std::vector<std::int32_t>{1, kSpace, tv.aa, tv.a}));
}

TEST(TokenizerTest, MergesScoringMinusTenBillionOrLessNeverHappen) {
  const TinyVocab tv;
  // "cc" has score -1e10, not strictly greater than run.c's starting best_score of -1e10.
  EXPECT_EQ(tv.v.build().encode("cc"), (std::vector<std::int32_t>{1, kSpace, tv.c, tv.c}));
}

TEST(TokenizerTest, ByteFallbackUsesByteIdPlusThree) {
  const TinyVocab tv;
  Vocab without_merge = tv.v;
  without_merge.pieces[static_cast<std::size_t>(tv.e_acute_bytes)] = "unused";
  // "é" = C3 A9 is no piece, so each byte becomes id byte + 3: 0xC3 + 3 = 198, 0xA9 + 3 = 172.
  // [BOS, " ", a, 198, 172]: only " a" merges ("a<0xC3>" and "<0xC3><0xA9>" are no pieces).
  EXPECT_EQ(without_merge.build().encode("a\xC3\xA9", true, true),
            (std::vector<std::int32_t>{1, tv.space_a, 198, 172, 2}));
  EXPECT_EQ(without_merge.build().encode("\x01"), (std::vector<std::int32_t>{1, kSpace, 4}));
  // A NUL is an ordinary byte here (run.c's C strings would end at it).
  EXPECT_EQ(without_merge.build().encode("\0"sv), (std::vector<std::int32_t>{1, kSpace, 3}));
}

TEST(TokenizerTest, MergesUseByteTokenTextNotTheRawBytes) {
  const TinyVocab tv;
  // The fallback ids 198, 172 have the pieces "<0xC3>", "<0xA9>"; their concatenation is a
  // piece of this vocabulary, so run.c merges them.
  EXPECT_EQ(tv.v.build().encode("\xC3\xA9"),
            (std::vector<std::int32_t>{1, kSpace, tv.e_acute_bytes}));
}

TEST(TokenizerTest, CodePointGroupsStopAtFourBytes) {
  const TinyVocab tv;
  // Five continuation bytes: run.c groups the first four (a piece here) and the fifth alone
  // (no piece: byte fallback 0x80 + 3 = 131).
  EXPECT_EQ(tv.v.build().encode("\x80\x80\x80\x80\x80"),
            (std::vector<std::int32_t>{1, kSpace, tv.four_continuations, 131}));
}

TEST(TokenizerTest, MergeLoopIncludesBosLikeRunC) {
  TinyVocab tv;
  const std::int32_t bos_space = tv.v.add("\n<s>\n ", 0.0f);
  // [BOS, " ", a]: "\n<s>\n " (0) beats " a" (-5), then "\n<s>\n a" is no piece.
  EXPECT_EQ(tv.v.build().encode("a"), (std::vector<std::int32_t>{bos_space, tv.a}));
}

TEST(TokenizerTest, EncodeWithoutByteTokensThrowsOnlyWhenFallbackIsNeeded) {
  const Tokenizer t({"<unk>", "\n<s>\n", "\n</s>\n", " ", "a"}, {0, 0, 0, 0, 0}, 6);
  EXPECT_EQ(t.encode("a"), (std::vector<std::int32_t>{1, 3, 4}));
  std::vector<std::int32_t> out = {9, 9};
  const std::string message = error_message([&] { t.encode("az", true, false, out); });
  EXPECT_THAT(message, HasSubstr("byte 122 at text offset 1"));
  EXPECT_THAT(message, HasSubstr("byte-fallback id 125"));
  EXPECT_THAT(message, HasSubstr("vocab_size is 5"));
  EXPECT_EQ(out, (std::vector<std::int32_t>{9, 9}));  // unchanged by the failed call
}

TEST(TokenizerTest, DuplicatePiecesResolveToTheLowestId) {
  Vocab v = llama_base_vocab();
  const std::int32_t first = v.add("x", -1.0f);
  v.add("x", 5.0f);
  EXPECT_EQ(v.build().find("x"), first);
  EXPECT_EQ(v.build().encode("x"), (std::vector<std::int32_t>{1, kSpace, first}));
}

// ---------------------------------------------------------------------------------------------
// Decode and safe_printf

TEST(TokenizerTest, DecodeOfFixtureIdsReproducesRunCStdout) {
  const Tokenizer t = load_fixture();
  const std::vector<std::int32_t> input_ids = read_ids(data_dir() / "input_ids.txt");
  const std::vector<std::int32_t> generated = read_ids(data_dir() / "generated_ids.txt");
  ASSERT_EQ(input_ids.size(), 87u);
  ASSERT_EQ(generated.size(), 64u);
  // input_ids = the 24 prompt ids then the first 63 generated ids; append the last generated.
  std::vector<std::int32_t> ids = input_ids;
  ids.push_back(generated.back());
  ASSERT_TRUE(std::equal(generated.begin(), generated.end(), ids.begin() + 24));

  // = run.c generate(): print decode(token, next) through safe_printf, stop at BOS, then "\n".
  std::string out;
  for (std::size_t pos = 0; pos + 1 < ids.size(); ++pos) {
    if (ids[pos + 1] == Tokenizer::kBos) break;
    out += Tokenizer::printed_text(t.decode(ids[pos], ids[pos + 1]));
  }
  out += '\n';
  EXPECT_EQ(out, read_text(data_dir() / "expected_output.txt"));
}

TEST(TokenizerTest, DecodeStripsTheLeadingSpaceOnlyAfterBos) {
  const Tokenizer t = load_fixture();
  const std::int32_t the = *t.find(" the");
  EXPECT_EQ(t.decode(Tokenizer::kBos, the), "the");
  EXPECT_EQ(t.decode(0, the), " the");
  EXPECT_EQ(t.decode(Tokenizer::kEos, the), " the");
  EXPECT_EQ(t.decode(Tokenizer::kBos, kSpace), "");
  EXPECT_FALSE(Tokenizer::is_printable_piece(t.decode(Tokenizer::kBos, kSpace)));
  EXPECT_EQ(t.decode(Tokenizer::kBos, *t.find("he")), "he");
}

TEST(TokenizerTest, DecodeTurnsBytePiecesIntoRawBytes) {
  const Tokenizer t = load_fixture();
  for (int b = 0; b < 256; ++b) {
    const std::string_view s = t.decode(0, byte_id(b));
    ASSERT_EQ(s.size(), 1u) << b;
    EXPECT_EQ(static_cast<unsigned char>(s[0]), b);
  }
  EXPECT_EQ(t.decode(Tokenizer::kBos, byte_id('A')), "A");
  EXPECT_EQ(Tokenizer::printed_text(t.decode(0, byte_id(0xC3))), "");  // dropped, as "crpe"
  EXPECT_EQ(Tokenizer::printed_text(t.decode(0, byte_id('\n'))), "\n");
  EXPECT_EQ(Tokenizer::printed_text(t.decode(0, byte_id(0x07))), "");
}

TEST(TokenizerTest, BytePieceParsingMatchesGlibcSscanf) {
  std::vector<std::string> pieces = {
      "<0x41>", "<0x4",   "<0x4G",   "<0xAbc", "<0x+1>", "<0x-1>", "<0x 41>", "<0x\t\n7",
      "<0x0x5", "<0x0x",  "<0x0X>",  "<0x+0x", "<0x-F",  "<0x",    "<0x>",    "<0xG1",
      "<0X41>", "<0x+",   "<0x-",    "< 0x41", "<0x0",   "<0x00x", "<0x 0x4", "<0x+-1",
      "<0xff>", "<0x1 2", "<0x  -3", "x<0x41", "",       "<",      "<0",      "<0x41>tail"};
  for (int b = 0; b < 256; ++b) {
    char upper[8];
    char lower[8];
    std::snprintf(upper, sizeof(upper), "<0x%02X>", b);
    std::snprintf(lower, sizeof(lower), "<0x%02x", b);
    pieces.push_back(upper);
    pieces.push_back(lower);
  }
  std::mt19937 rng(7);
  const std::string alphabet = " \t+-0xX19aAfFgG>";
  std::uniform_int_distribution<std::size_t> pick(0, alphabet.size() - 1);
  for (int i = 0; i < 5000; ++i) {
    std::string p = "<0x";
    for (int n = static_cast<int>(rng() % 5); n > 0; --n) p += alphabet[pick(rng)];
    pieces.push_back(p);
  }
  for (const std::string& p : pieces) {
    unsigned char byte = 0;
    const int expected = std::sscanf(p.c_str(), "<0x%02hhX>", &byte) == 1 ? byte : -1;
    EXPECT_EQ(detail::parse_byte_piece(p), expected) << "piece \"" << p << "\"";
  }
}

TEST(TokenizerTest, PrintableRuleMatchesCLocaleSafePrintf) {
  // The test never calls setlocale, so <cctype> uses the C locale here.
  for (int c = 0; c < 256; ++c) {
    const std::string piece(1, static_cast<char>(c));
    EXPECT_EQ(Tokenizer::is_printable_piece(piece), std::isprint(c) != 0 || std::isspace(c) != 0)
        << "byte " << c;
  }
  EXPECT_FALSE(Tokenizer::is_printable_piece(""));
  EXPECT_FALSE(Tokenizer::is_printable_piece("\x7F"));
  EXPECT_FALSE(Tokenizer::is_printable_piece("\xC3"));
  EXPECT_TRUE(Tokenizer::is_printable_piece("\xC3\xAA"));  // multi-byte pieces always print
  EXPECT_TRUE(Tokenizer::is_printable_piece("<unk>"));
  EXPECT_EQ(Tokenizer::printed_text("\n</s>\n"), "\n</s>\n");
  // printf("%s") stops at a NUL inside a piece.
  EXPECT_EQ(Tokenizer::printed_text("ab\0cd"sv), "ab");
  EXPECT_EQ(Tokenizer::printed_text("\x01\0cd"sv), "");
  EXPECT_EQ(Tokenizer::printed_text("\0cd"sv), "");
}

TEST(TokenizerTest, OutOfRangeIdsThrowNamingIdAndVocabSize) {
  const Tokenizer t = load_fixture();
  EXPECT_THAT(error_message([&] { t.decode(0, 512); }),
              HasSubstr("Tokenizer::decode: token id 512 is outside [0, vocab_size 512)"));
  EXPECT_THAT(error_message([&] { t.decode(Tokenizer::kBos, -1); }), HasSubstr("token id -1"));
  EXPECT_THAT(error_message([&] { t.piece(600); }), HasSubstr("Tokenizer::piece: token id 600"));
  EXPECT_THAT(error_message([&] { t.score(-5); }), HasSubstr("Tokenizer::score: token id -5"));
  // prev_token is only compared with BOS; 356 is " a".
  EXPECT_EQ(t.decode(-1, 356), " a");
  EXPECT_EQ(t.decode(Tokenizer::kBos, 356), "a");
}

TEST(TokenizerTest, CopiesOutliveTheOriginal) {
  std::optional<Tokenizer> original = load_fixture();
  const Tokenizer copy = *original;
  Tokenizer moved = std::move(*original);
  original.reset();
  const std::vector<std::int32_t> prompt_ids = read_ids(data_dir() / "prompt_ids.txt");
  EXPECT_EQ(copy.encode(read_text(data_dir() / "prompt.txt")), prompt_ids);
  EXPECT_EQ(moved.encode(read_text(data_dir() / "prompt.txt")), prompt_ids);
  EXPECT_EQ(copy.to_bytes(), read_bytes(data_dir() / "tokenizer.bin"));
}

// ---------------------------------------------------------------------------------------------
// Save / load

TEST(TokenizerTest, SaveLoadRoundTripIsIdentical) {
  const std::vector<std::byte> original = read_bytes(data_dir() / "tokenizer.bin");
  const Tokenizer t = load_fixture();
  EXPECT_EQ(t.to_bytes(), original);
  const std::filesystem::path file = temp_path("tokenizer.bin");
  t.save(file);
  EXPECT_EQ(read_bytes(file), original);
  const Tokenizer again = Tokenizer::load(file, kFixtureVocabSize);
  std::filesystem::remove(file);
  ASSERT_EQ(again.vocab_size(), t.vocab_size());
  EXPECT_EQ(again.max_token_length(), t.max_token_length());
  std::vector<std::string> pieces;
  std::vector<float> scores;
  for (std::int32_t id = 0; id < t.vocab_size(); ++id) {
    EXPECT_EQ(again.piece(id), t.piece(id));
    EXPECT_EQ(std::bit_cast<std::uint32_t>(again.score(id)),
              std::bit_cast<std::uint32_t>(t.score(id)));
    pieces.emplace_back(t.piece(id));
    scores.push_back(t.score(id));
  }
  EXPECT_EQ(Tokenizer(pieces, scores, t.max_token_length()).to_bytes(), original);
}

TEST(TokenizerTest, TrailingBytesAreIgnoredLikeRunC) {
  std::vector<std::byte> bytes = read_bytes(data_dir() / "tokenizer.bin");
  const std::vector<std::byte> original = bytes;
  bytes.insert(bytes.end(), 37, std::byte{0xAB});
  EXPECT_EQ(Tokenizer::from_memory(bytes, kFixtureVocabSize).to_bytes(), original);
}

// run.c reads vocab_size entries and ignores the rest, so a larger tokenizer (llama2.c's 32000
// pieces with a 512-piece model) printed wrong text without an error. Both directions are now
// refused, naming both counts.
TEST(TokenizerTest, AVocabularyOfAnotherSizeIsRefusedNamingBothCounts) {
  const std::vector<std::byte> bytes = read_bytes(data_dir() / "tokenizer.bin");
  EXPECT_THAT(
      error_message([&] { Tokenizer::from_memory(bytes, 300, "fixture"); }),
      HasSubstr("tokenizer.bin 'fixture': the file holds " + std::to_string(kFixtureVocabSize) +
                " entries but the model's vocab_size is 300"));
  // One entry short: the file ends cleanly between entries.
  const RawFile small = small_file_header_and_entries(kSmallPieces.size());
  EXPECT_THAT(error_message([&] { Tokenizer::from_memory(small.bytes, 8, "small.bin"); }),
              HasSubstr("the file holds 7 entries but the model's vocab_size is 8"));
  EXPECT_THAT(error_message([&] { Tokenizer::from_memory(small.bytes, 6, "small.bin"); }),
              HasSubstr("the file holds 7 entries but the model's vocab_size is 6"));
}

TEST(TokenizerTest, SaveToUnwritablePathThrowsNamingTheFile) {
  const Tokenizer t = load_fixture();
  const std::string message = error_message([&] { t.save("/nonexistent-dir/tokenizer.bin"); });
  EXPECT_THAT(message, HasSubstr("tokenizer.bin '/nonexistent-dir/tokenizer.bin'"));
  EXPECT_THAT(message, HasSubstr("cannot open for writing"));
}

// ---------------------------------------------------------------------------------------------
// Malformed files

TEST(TokenizerTest, SmallFileParsesWithItsEmptyPiece) {
  const RawFile f = small_file_header_and_entries(kSmallPieces.size());
  const Tokenizer t = Tokenizer::from_memory(f.bytes, 7, "small.bin");
  EXPECT_EQ(t.piece(5), "");
  EXPECT_EQ(t.piece(6), "ab");
  EXPECT_EQ(t.score(6), -6.0f);
  EXPECT_EQ(t.to_bytes(), f.bytes);
}

TEST(TokenizerTest, EveryTruncationOfASmallFileThrowsNamingWhereItEnds) {
  const RawFile full = small_file_header_and_entries(kSmallPieces.size());
  // Entry i starts at offsets[i]: score (4 bytes), length (4 bytes), piece.
  std::vector<std::size_t> offsets = {4};
  for (const std::string& p : kSmallPieces) offsets.push_back(offsets.back() + 8 + p.size());
  ASSERT_EQ(offsets.back(), full.bytes.size());
  for (std::size_t size = 0; size < full.bytes.size(); ++size) {
    const std::span<const std::byte> prefix(full.bytes.data(), size);
    const std::string message =
        error_message([&] { Tokenizer::from_memory(prefix, 7, "small.bin"); });
    std::ostringstream expected;
    expected << "tokenizer.bin 'small.bin': ";
    if (size < 4) {
      expected << "file ends at byte " << size << " while reading max_token_length (needs "
               << 4 - size << " more bytes)";
    } else {
      std::size_t i = 0;
      while (offsets[i + 1] <= size) ++i;
      const std::size_t start = offsets[i];
      if (size == start) {
        // Between two entries: a vocabulary of i entries, not a damaged file.
        expected << "the file holds " << i << " entries but the model's vocab_size is 7";
        EXPECT_THAT(message, HasSubstr(expected.str())) << "prefix of " << size << " bytes";
        continue;
      }
      expected << "entry " << i << " of 7: file ends at byte " << size << " while reading ";
      if (size < start + 4) {
        expected << "the score (needs " << start + 4 - size;
      } else if (size < start + 8) {
        expected << "the piece length (needs " << start + 8 - size;
      } else {
        expected << "the " << kSmallPieces[i].size() << "-byte piece (needs "
                 << start + 8 + kSmallPieces[i].size() - size;
      }
      expected << " more bytes)";
    }
    EXPECT_THAT(message, HasSubstr(expected.str())) << "prefix of " << size << " bytes";
  }
}

TEST(TokenizerTest, EveryTruncationOfTheFixtureThrows) {
  const std::vector<std::byte> bytes = read_bytes(data_dir() / "tokenizer.bin");
  for (std::size_t size = 0; size < bytes.size(); ++size) {
    const std::string message = error_message([&] {
      Tokenizer::from_memory(std::span(bytes.data(), size), kFixtureVocabSize, "fixture");
    });
    ASSERT_THAT(message,
                ::testing::AnyOf(HasSubstr("file ends at byte " + std::to_string(size) + " while"),
                                 HasSubstr(" entries but the model's vocab_size is ")));
  }
}

TEST(TokenizerTest, NegativePieceLengthThrows) {
  for (const std::int32_t len : {-3, -1, std::numeric_limits<std::int32_t>::min()}) {
    RawFile f = small_file_header_and_entries(4);
    f.f32(-4.0f).i32(len).text("aaaa");
    const std::string message =
        error_message([&] { Tokenizer::from_memory(f.bytes, 7, "neg.bin"); });
    EXPECT_THAT(message, HasSubstr("tokenizer.bin 'neg.bin': entry 4 of 7: piece length " +
                                   std::to_string(len) + " is negative"));
  }
}

TEST(TokenizerTest, PieceLengthPastEndOfFileThrows) {
  RawFile f = small_file_header_and_entries(4);
  f.f32(-4.0f).i32(1000000).text("abc");
  const std::size_t piece_start = f.bytes.size() - 3;
  const std::string message =
      error_message([&] { Tokenizer::from_memory(f.bytes, 7, "long.bin"); });
  EXPECT_THAT(message,
              HasSubstr("tokenizer.bin 'long.bin': entry 4 of 7: file ends at byte " +
                        std::to_string(piece_start + 3) +
                        " while reading the 1000000-byte piece (needs 999997 more bytes)"));
}

TEST(TokenizerTest, MaxTokenLengthShorterThanAPieceThrows) {
  RawFile f = small_file_header_and_entries(6, 6);  // "\n</s>\n" (6 bytes) is the longest so far
  f.entry(-6.0f, "abcdefg");
  const std::string message = error_message([&] { Tokenizer::from_memory(f.bytes, 7, "mtl.bin"); });
  EXPECT_THAT(
      message,
      HasSubstr("tokenizer.bin 'mtl.bin': max_token_length 6 is shorter than piece 6 (7 bytes)"));
  Vocab v = llama_base_vocab();
  EXPECT_THAT(error_message([&] { v.build(5); }),
              HasSubstr("Tokenizer: max_token_length 5 is shorter than piece 2 (6 bytes)"));
}

TEST(TokenizerTest, VocabularyWithoutSpacePieceThrows) {
  RawFile f;
  f.u32(8).entry(0, "<unk>").entry(0, "\n<s>\n").entry(0, "\n</s>\n").entry(0, "  ").entry(0, "a");
  const std::string message =
      error_message([&] { Tokenizer::from_memory(f.bytes, 5, "nospace.bin"); });
  EXPECT_THAT(message, HasSubstr("tokenizer.bin 'nospace.bin': vocabulary lacks the one-character "
                                 "piece \" \" needed as the dummy prefix"));
  Vocab v = llama_base_vocab();
  v.pieces[kSpace] = "_";
  EXPECT_THAT(error_message([&] { v.build(); }), HasSubstr("Tokenizer: vocabulary lacks"));
}

TEST(TokenizerTest, BadVocabSizeThrows) {
  const std::filesystem::path file = data_dir() / "tokenizer.bin";
  for (const std::int64_t vocab_size : {std::int64_t{0}, std::int64_t{-512}, std::int64_t{2}}) {
    const std::string message = error_message([&] { Tokenizer::load(file, vocab_size); });
    EXPECT_THAT(message, HasSubstr("tokenizer.bin '" + file.string() + "': vocab_size " +
                                   std::to_string(vocab_size) + " must be at least 3"));
  }
  EXPECT_THAT(error_message([&] { Tokenizer::load(file, std::int64_t{1} << 40); }),
              HasSubstr("vocab_size 1099511627776 does not fit the int32 token ids"));
  // One entry more than the file holds: a vocabulary of another size, with both counts.
  EXPECT_THAT(error_message([&] { Tokenizer::load(file, 513); }),
              HasSubstr("the file holds 512 entries but the model's vocab_size is 513"));
}

TEST(TokenizerTest, NonexistentFileThrowsNamingIt) {
  const std::filesystem::path file = temp_path("does-not-exist.bin");
  const std::string message = error_message([&] { Tokenizer::load(file, kFixtureVocabSize); });
  EXPECT_THAT(message, HasSubstr("tokenizer.bin '" + file.string() + "': cannot read"));
  EXPECT_THAT(message, HasSubstr("No such file or directory"));
  EXPECT_THAT(error_message([&] { Tokenizer::load(data_dir(), kFixtureVocabSize); }),
              HasSubstr("tokenizer.bin '" + data_dir().string() + "'"));
}

TEST(TokenizerTest, ConstructorRejectsMismatchedPiecesAndScores) {
  EXPECT_THAT(error_message([] {
                Tokenizer({"<unk>", "\n<s>\n", "\n</s>\n", " "}, {0, 0, 0}, 8);
              }),
              HasSubstr("Tokenizer: 4 pieces but 3 scores"));
  EXPECT_THAT(error_message([] {
                Tokenizer({"<unk>", " "}, {0, 0}, 8);
              }),
              HasSubstr("Tokenizer: vocab_size 2 must be at least 3"));
}

}  // namespace
}  // namespace kvdecode
