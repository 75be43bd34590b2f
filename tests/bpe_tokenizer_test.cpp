// BpeTokenizer (GPT-2's byte-level BPE) and gguf_bpe_vocabulary().
// Fixtures: llama.cpp's ggml-vocab-gpt-2.gguf with its tokenizer test cases (.inp/.out), in
// tests/data/gpt2-vocab (README there); small vocabularies built here, whose
// encodings are checked against a naive rescanning BPE and a pre-tokenizer written for their
// alphabet; GGUF files written here and damaged one field at a time.
#include "kvdecode/text/bpe_tokenizer.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "fixture_files.hpp"
#include "gpt2_bytes.hpp"
#include "kvdecode/io/gguf.hpp"
#include "kvdecode/io/gguf_tokenizer.hpp"
#include "kvdecode/text/text_stream.hpp"
#include "kvdecode/text/text_tokenizer.hpp"
#include "kvdecode/text/tokenizer.hpp"
#include "test_util.hpp"

namespace kvdecode {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using testing_util::read_text;

using testing_util::error_of;

// GPT-2's byte characters from the rule written in test code (gpt2_bytes.hpp), independently of
// kGpt2ByteChars.
std::string byte_char(unsigned char b) { return testing_util::gpt2_byte_characters()[b]; }
std::string stored(std::string_view raw) {
  std::string s;
  for (const char c : raw) s += byte_char(static_cast<unsigned char>(c));
  return s;
}

std::vector<std::string_view> views(const std::vector<std::string>& v) {
  return {v.begin(), v.end()};
}

// ---------------------------------------------------------------------------------------------
// A small vocabulary: the 256 byte tokens (ids 0..255, byte order), then merges over raw pairs.

struct SmallVocab {
  std::vector<std::string> tokens;                              // stored form
  std::vector<std::string> merges;                              // stored form "left right"
  std::vector<std::pair<std::string, std::string>> raw_merges;  // raw bytes, rank order

  SmallVocab() {
    for (int b = 0; b < 256; ++b) tokens.push_back(byte_char(static_cast<unsigned char>(b)));
  }
  void merge(const std::string& left, const std::string& right) {
    raw_merges.emplace_back(left, right);
    merges.push_back(stored(left) + " " + stored(right));
    const std::string joined = stored(left + right);
    if (std::find(tokens.begin(), tokens.end(), joined) == tokens.end()) tokens.push_back(joined);
  }
  BpeTokenizer build(std::int32_t bos = -1, std::int32_t eos = -1) const {
    const auto t = views(tokens);
    const auto m = views(merges);
    return BpeTokenizer(t, {}, m, bos, eos);
  }
  std::int32_t id_of(const std::string& raw) const {
    const auto it = std::find(tokens.begin(), tokens.end(), stored(raw));
    return it == tokens.end() ? -1 : static_cast<std::int32_t>(it - tokens.begin());
  }
};

// The naive BPE of one word: rescan every adjacent pair, merge the lowest-ranked (leftmost on
// ties), until none merges. O(n²) per word, written from the algorithm's definition.
std::vector<std::string> naive_bpe(const std::string& word, const SmallVocab& v) {
  std::vector<std::string> sym;
  for (const char c : word) sym.emplace_back(1, c);
  while (true) {
    std::size_t best_rank = SIZE_MAX, best_at = 0;
    for (std::size_t i = 0; i + 1 < sym.size(); ++i) {
      for (std::size_t r = 0; r < v.raw_merges.size() && r < best_rank; ++r) {
        if (v.raw_merges[r].first == sym[i] && v.raw_merges[r].second == sym[i + 1]) {
          best_rank = r;
          best_at = i;
          break;
        }
      }
    }
    if (best_rank == SIZE_MAX) return sym;
    sym[best_at] += sym[best_at + 1];
    sym.erase(sym.begin() + static_cast<std::ptrdiff_t>(best_at) + 1);
  }
}

// GPT-2's regex on texts of ASCII letters and spaces only: " ?[a-z]+" or a run of spaces, which
// leaves its last space to the word after it (\s+(?!\S)).
std::vector<std::string> naive_words(const std::string& text) {
  std::vector<std::string> words;
  std::size_t i = 0;
  while (i < text.size()) {
    std::size_t j = i;
    if (text[i] == ' ') {
      while (j < text.size() && text[j] == ' ') ++j;
      if (j == text.size()) {
        words.push_back(text.substr(i));
        break;
      }
      if (j - i > 1) {
        words.push_back(text.substr(i, j - i - 1));
        i = j - 1;
      }
      j = i + 1;  // the space before the letters
    }
    while (j < text.size() && text[j] != ' ') ++j;
    words.push_back(text.substr(i, j - i));
    i = j;
  }
  return words;
}

TEST(BpeTokenizerTest, ByteCharactersFollowGpt2sTable) {
  for (int b = 0; b < 256; ++b) {
    std::string s;
    detail::append_utf8(s, detail::kGpt2ByteChars[static_cast<std::size_t>(b)]);
    EXPECT_EQ(s, byte_char(static_cast<unsigned char>(b))) << b;
  }
  EXPECT_EQ(byte_char(' '), "\xC4\xA0");   // 'Ġ', U+0120
  EXPECT_EQ(byte_char('\n'), "\xC4\x8A");  // 'Ċ', U+010A
  EXPECT_EQ(byte_char(0xAD), "\xC5\x83");  // the soft hyphen is the last remapped byte, U+0143
}

TEST(BpeTokenizerTest, UnicodeClassesOfKnownCodePoints) {
  using detail::UnicodeClass;
  const std::pair<std::uint32_t, UnicodeClass> cases[] = {
      {'a', UnicodeClass::kLetter},        {'Z', UnicodeClass::kLetter},
      {0xE9, UnicodeClass::kLetter},       {0x436, UnicodeClass::kLetter},    // é, ж
      {0x4E2D, UnicodeClass::kLetter},     {0x1D538, UnicodeClass::kLetter},  // 中, 𝔸
      {0x2B0, UnicodeClass::kLetter},                                         // ʰ (Lm)
      {'7', UnicodeClass::kNumber},        {0x663, UnicodeClass::kNumber},    // ٣ (Nd)
      {0x216B, UnicodeClass::kNumber},     {0xBD, UnicodeClass::kNumber},     // Ⅻ (Nl), ½ (No)
      {' ', UnicodeClass::kWhitespace},    {'\t', UnicodeClass::kWhitespace},
      {'\r', UnicodeClass::kWhitespace},   {0x85, UnicodeClass::kWhitespace},
      {0xA0, UnicodeClass::kWhitespace},   {0x3000, UnicodeClass::kWhitespace},
      {0x2028, UnicodeClass::kWhitespace}, {'.', UnicodeClass::kOther},
      {'\'', UnicodeClass::kOther},        {0x0, UnicodeClass::kOther},
      {0x301, UnicodeClass::kOther},  // combining acute (Mn)
      {0x1F999, UnicodeClass::kOther},     {0xFFFD, UnicodeClass::kOther},
      {0x10FFFF, UnicodeClass::kOther},    {0x200B, UnicodeClass::kOther},  // ZWSP is Cf
  };
  for (const auto& [cp, cls] : cases)
    EXPECT_EQ(detail::unicode_class(cp), cls) << std::hex << "U+" << cp;
}

std::vector<std::string> split(std::string_view text) {
  std::vector<std::string> words;
  std::vector<detail::UnicodeClass> c;
  std::vector<std::uint32_t> cps;
  std::vector<std::size_t> off;
  detail::split_gpt2_words(text, c, cps, off, [&](std::size_t b, std::size_t e) {
    words.emplace_back(text.substr(b, e - b));
  });
  return words;
}

// Splits worked out by hand from the regex's alternatives, tried in order at each position.
TEST(BpeTokenizerTest, PreTokenizerSplitsAsGpt2sRegex) {
  using W = std::vector<std::string>;
  EXPECT_EQ(split(""), W{});
  EXPECT_EQ(split("Hello world"), (W{"Hello", " world"}));
  EXPECT_EQ(split("  Hello"), (W{" ", " Hello"}));
  EXPECT_EQ(split("\n\nHello"), (W{"\n", "\n", "Hello"}));
  EXPECT_EQ(split("a  \n b"), (W{"a", "  \n", " b"}));
  EXPECT_EQ(split("hi   "), (W{"hi", "   "}));
  EXPECT_EQ(split("I'm don't we'll they're I've 'S"),
            (W{"I", "'m", " don", "'t", " we", "'ll", " they", "'re", " I", "'ve", " '", "S"}));
  EXPECT_EQ(split("x'"), (W{"x", "'"}));
  EXPECT_EQ(split("abc123 456!!  ?"), (W{"abc", "123", " 456", "!!", " ", " ?"}));
  EXPECT_EQ(split("3.14"), (W{"3", ".", "14"}));
  EXPECT_EQ(split("é中文 ж"), (W{"é中文", " ж"}));
  EXPECT_EQ(split("🦙🦙 🦙"), (W{"🦙🦙", " 🦙"}));
  // A stray byte is a U+FFFD (not a letter) but keeps its byte.
  EXPECT_EQ(split("ab\xFF"
                  "cd"),
            (W{"ab", "\xFF", "cd"}));
  EXPECT_EQ(split(" \xC3"), (W{" \xC3"}));
}

TEST(BpeTokenizerTest, MergesByRankLeftmostFirst) {
  SmallVocab v;
  v.merge("a", "a");   // rank 0
  v.merge("aa", "a");  // rank 1
  v.merge("b", "aa");  // rank 2
  const BpeTokenizer t = v.build();
  // "aaa": (a,a) at 0 and 1 tie on rank; the leftmost merges, then (aa, a).
  EXPECT_EQ(t.encode("aaa"), (std::vector<std::int32_t>{v.id_of("aaa")}));
  // "baa": (a,a) rank 0 before (b,a) which is no merge; then (b, aa) rank 2.
  EXPECT_EQ(t.encode("baa"), (std::vector<std::int32_t>{v.id_of("baa")}));
  // "aaaa": aa|aa, then no (aa, aa) merge and (aa, a) needs a lone a.
  EXPECT_EQ(t.encode("aaaa"), (std::vector<std::int32_t>{v.id_of("aa"), v.id_of("aa")}));
  EXPECT_EQ(t.decode_all(t.encode("aaaa")), "aaaa");
}

// Random vocabularies over a 3-letter alphabet; long texts hit many ties and stale candidates.
TEST(BpeTokenizerTest, MatchesNaiveRescanOnRandomVocabularies) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    SmallVocab v;
    std::vector<std::string> raw = {"a", "b", "c", " "};
    for (int m = 0; m < 40; ++m) {
      const std::string& l = raw[rng() % raw.size()];
      const std::string& r = raw[rng() % raw.size()];
      if (l.back() == ' ' && r[0] != ' ') continue;  // keep merges inside words
      if (r.find(' ') != std::string::npos) continue;
      const bool dup = std::any_of(v.raw_merges.begin(), v.raw_merges.end(),
                                   [&](const auto& p) { return p.first == l && p.second == r; });
      if (dup) continue;
      v.merge(l, r);
      raw.push_back(l + r);
    }
    const BpeTokenizer t = v.build();
    for (int k = 0; k < 30; ++k) {
      std::string text;
      const std::size_t len = rng() % 200;
      for (std::size_t i = 0; i < len; ++i) text += "abc  "[rng() % 5];
      std::vector<std::int32_t> want;
      for (const std::string& w : naive_words(text))
        for (const std::string& s : naive_bpe(w, v)) want.push_back(v.id_of(s));
      ASSERT_EQ(t.encode(text), want) << "trial " << trial << " text '" << text << "'";
    }
  }
}

TEST(BpeTokenizerTest, RoundTripsRandomUtf8AndRandomBytes) {
  SmallVocab v;
  v.merge(" ", "t");
  v.merge("\xC3", "\xA9");  // é
  v.merge("e", "r");
  const BpeTokenizer t = v.build();
  std::mt19937 rng(11);  // 32-bit results
  for (int k = 0; k < 200; ++k) {
    std::string text;
    const std::size_t n = rng() % 60;
    for (std::size_t i = 0; i < n; ++i) {
      if (k % 2 == 0) {
        text += static_cast<char>(rng() % 256);  // any bytes
      } else {
        // Code points of every UTF-8 length, surrogates skipped.
        std::uint32_t cp = 0;
        switch (rng() % 4) {
          case 0:
            cp = static_cast<std::uint32_t>(rng() % 0x80);
            break;
          case 1:
            cp = static_cast<std::uint32_t>(0x80 + rng() % 0x780);
            break;
          case 2:
            cp = static_cast<std::uint32_t>(0x800 + rng() % 0xF800);
            break;
          default:
            cp = static_cast<std::uint32_t>(0x10000 + rng() % 0x100000);
            break;
        }
        if (cp >= 0xD800 && cp < 0xE000) cp = 'x';
        if (cp < 0x80) {
          text += static_cast<char>(cp);
        } else if (cp < 0x800) {
          text += static_cast<char>(0xC0 | (cp >> 6));
          text += static_cast<char>(0x80 | (cp & 0x3F));
        } else if (cp < 0x10000) {
          text += static_cast<char>(0xE0 | (cp >> 12));
          text += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
          text += static_cast<char>(0x80 | (cp & 0x3F));
        } else {
          text += static_cast<char>(0xF0 | (cp >> 18));
          text += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
          text += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
          text += static_cast<char>(0x80 | (cp & 0x3F));
        }
      }
    }
    const std::vector<std::int32_t> ids = t.encode(text);
    ASSERT_EQ(t.decode_all(ids), text) << "case " << k;
  }
}

// A character split over tokens is held back by TextStream until its last byte comes.
TEST(BpeTokenizerTest, StreamedDecodeHoldsPartialCharacters) {
  SmallVocab v;
  v.merge("\xF0", "\x9F");  // the first half of 🦙 (F0 9F A6 99) is one token
  const BpeTokenizer t = v.build();
  const std::string text = "a🦙b";
  const std::vector<std::int32_t> ids = t.encode(text);
  ASSERT_EQ(ids.size(), 5u);  // a, F09F, A6, 99, b
  TextStream stream;
  std::vector<std::string> shown;
  for (const std::int32_t id : ids) shown.emplace_back(stream.push(t.decode(-1, id)));
  EXPECT_EQ(shown, (std::vector<std::string>{"a", "", "", "🦙", "b"}));
  EXPECT_EQ(stream.flush(), "");
}

// Generic code written against TextTokenizer: encode, then stream the decoded pieces.
template <TextTokenizer T>
std::string streamed(const T& t, std::string_view text) {
  std::string shown;
  TextStream stream;
  std::int32_t prev = -1;
  for (const std::int32_t id : t.encode(text, false, false)) {
    shown += stream.push(t.decode(prev, id));
    prev = id;
  }
  return shown + std::string(stream.flush());
}

TEST(BpeTokenizerTest, GenericCodeRunsEitherTokenizer) {
  SmallVocab v;
  v.merge("a", "b");
  EXPECT_EQ(streamed(v.build(), "ab é🦙"), "ab é🦙");
  // SentencePiece (run.c's rules): the dummy prefix " " comes back as a leading space.
  std::vector<std::string> pieces = {"<unk>", "\n<s>\n", "\n</s>\n"};
  for (int b = 0; b < 256; ++b) {
    char hex[8];
    std::snprintf(hex, sizeof hex, "<0x%02X>", b);
    pieces.emplace_back(hex);
  }
  for (const char* p : {" ", "a", "b", "ab"}) pieces.emplace_back(p);
  const Tokenizer sp(pieces, std::vector<float>(pieces.size(), 0.0f), 6);
  EXPECT_EQ(streamed(sp, "ab é🦙"), " ab é🦙");
}

TEST(BpeTokenizerTest, BosEosControlTokensAndFind) {
  SmallVocab v;
  v.merge("h", "i");
  v.tokens.push_back("<|endoftext|>");
  const auto eot = static_cast<std::int32_t>(v.tokens.size() - 1);
  std::vector<std::int32_t> types(v.tokens.size(), 1);
  types.back() = 3;
  const auto tv = views(v.tokens);
  const auto mv = views(v.merges);
  const BpeTokenizer t(tv, types, mv, eot, eot);
  EXPECT_EQ(t.encode("hi", true, true), (std::vector<std::int32_t>{eot, v.id_of("hi"), eot}));
  // The control token's text is not matched in the text, and it decodes to nothing.
  EXPECT_EQ(t.decode_all(t.encode("<|endoftext|>")), "<|endoftext|>");
  EXPECT_EQ(t.decode(-1, eot), "");
  EXPECT_EQ(t.find("hi"), v.id_of("hi"));
  EXPECT_EQ(t.find("\n"), static_cast<std::int32_t>('\n'));
  EXPECT_FALSE(t.find("<|endoftext|>").has_value());
  EXPECT_FALSE(t.find("").has_value());
  EXPECT_THAT(error_of([&] { t.decode(-1, static_cast<std::int32_t>(t.vocab_size())); }),
              HasSubstr("token id 258 is outside [0, vocab_size 258)"));
  const BpeTokenizer none = v.build();
  EXPECT_THAT(error_of([&] { none.encode("x", true); }), HasSubstr("no tokenizer.ggml.bos"));
  std::vector<std::int32_t> out{42};
  EXPECT_THROW(none.encode("x", false, true, out), Error);
  EXPECT_EQ(out, std::vector<std::int32_t>{42});  // unchanged on a throw
}

TEST(BpeTokenizerTest, RefusesBadVocabularies) {
  struct Case {
    const char* name;
    std::function<void(std::vector<std::string>&, std::vector<std::int32_t>&,
                       std::vector<std::string>&)>
        damage;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"no byte token", [](auto& t, auto&, auto&) { t[0x41] = "AA"; },
       "has no token 'A' for byte 65"},
      {"merge without space", [](auto&, auto&, auto& m) { m.push_back("ab"); },
       "tokenizer.ggml.merges[1] is 'ab', expected two tokens separated by a space"},
      {"merge of unknown token", [](auto&, auto&, auto& m) { m.push_back("a xyz"); },
       "tokenizer.ggml.merges[1] 'a xyz': 'xyz' is not a token"},
      {"merge result unknown", [](auto&, auto&, auto& m) { m.push_back("b c"); },
       "tokenizer.ggml.merges[1] 'b c': 'bc' is not a token"},
      {"character outside the byte map",
       [](auto& t, auto& ty, auto&) {
         t.push_back("中");
         ty.push_back(1);
       },
       "token 257 '中': the character at byte 0 is not one of GPT-2's 256 byte characters"},
      {"control byte token", [](auto&, auto& ty, auto&) { ty['b'] = 3; },
       "token 98 'b' for byte 98 is a control token"},
      {"control merge result",
       [](auto& t, auto& ty, auto&) {
         ty.back() = 3;  // "ab"
         (void)t;
       },
       "tokenizer.ggml.merges[0] 'a b': 'ab' is control token 256"},
      {"user-defined token", [](auto&, auto& ty, auto&) { ty['$'] = 4; },
       "token 36 '$' has type 4"},
      {"token type out of range", [](auto&, auto& ty, auto&) { ty[5] = 9; },
       "tokenizer.ggml.token_type[5] is 9"},
      {"short token types", [](auto&, auto& ty, auto&) { ty.pop_back(); },
       "tokenizer.ggml.token_type holds 256 values, but tokenizer.ggml.tokens holds 257"},
  };
  for (const Case& c : cases) {
    SmallVocab v;
    v.merge("a", "b");
    std::vector<std::int32_t> types(v.tokens.size(), 1);
    c.damage(v.tokens, types, v.merges);
    const auto tv = views(v.tokens);
    const auto mv = views(v.merges);
    EXPECT_THAT(error_of([&] { BpeTokenizer(tv, types, mv, -1, -1, "vocab"); }),
                HasSubstr(c.message))
        << c.name;
  }
  SmallVocab v;
  const auto tv = views(v.tokens);
  const auto mv = views(v.merges);
  EXPECT_THAT(error_of([&] { BpeTokenizer(tv, {}, mv, 256, -1); }),
              HasSubstr("tokenizer.ggml.bos_token_id is 256, outside the vocabulary [0, 256)"));
}

// ---------------------------------------------------------------------------------------------
// GGUF files written here: a gpt2 vocabulary's keys, each damaged in turn.

class GgufWriter {
 public:
  void str(std::string_view key, std::string_view v) {
    key_(key, 8);
    string_(v);
  }
  void u32(std::string_view key, std::uint32_t v) {
    key_(key, 4);
    put(v, 4);
  }
  void boolean(std::string_view key, bool v) {
    key_(key, 7);
    put(v ? 1 : 0, 1);
  }
  void strings(std::string_view key, const std::vector<std::string>& v) {
    key_(key, 9);
    put(8, 4);
    put(v.size(), 8);
    for (const std::string& s : v) string_(s);
  }
  void i32s(std::string_view key, const std::vector<std::int32_t>& v) {
    key_(key, 9);
    put(5, 4);
    put(v.size(), 8);
    for (const std::int32_t x : v) put(static_cast<std::uint32_t>(x), 4);
  }
  std::vector<std::byte> bytes() const {
    std::vector<std::byte> out;
    const auto put_out = [&](std::uint64_t v, int n) {
      for (int k = 0; k < n; ++k) out.push_back(static_cast<std::byte>(v >> (8 * k)));
    };
    put_out(0x46554747, 4);
    put_out(3, 4);
    put_out(0, 8);
    put_out(n_, 8);
    out.insert(out.end(), body_.begin(), body_.end());
    return out;
  }

 private:
  void put(std::uint64_t v, int n) {
    for (int k = 0; k < n; ++k) body_.push_back(static_cast<std::byte>(v >> (8 * k)));
  }
  void string_(std::string_view s) {
    put(s.size(), 8);
    for (const char c : s) body_.push_back(static_cast<std::byte>(c));
  }
  void key_(std::string_view key, std::uint32_t type) {
    ++n_;
    string_(key);
    put(type, 4);
  }
  std::vector<std::byte> body_;
  std::uint64_t n_ = 0;
};

TEST(GgufBpeVocabularyTest, ReadsAWrittenFileAndRefusesDamage) {
  SmallVocab v;
  v.merge(" ", "w");
  v.merge("o", "r");
  v.tokens.push_back("<|endoftext|>");
  const auto eot = static_cast<std::uint32_t>(v.tokens.size() - 1);
  std::vector<std::int32_t> types(v.tokens.size(), 1);
  types.back() = 3;
  struct Damage {
    const char* name;
    std::function<void(GgufWriter&)> write;  // writes the keys, one of them wrong
    const char* message;
  };
  const auto good_except = [&](std::string_view skip) {
    return [&, skip](GgufWriter& w) {
      if (skip != "model") w.str("tokenizer.ggml.model", "gpt2");
      if (skip != "pre") w.str("tokenizer.ggml.pre", "gpt-2");
      if (skip != "tokens") w.strings("tokenizer.ggml.tokens", v.tokens);
      if (skip != "types") w.i32s("tokenizer.ggml.token_type", types);
      if (skip != "merges") w.strings("tokenizer.ggml.merges", v.merges);
      if (skip != "bos") w.u32("tokenizer.ggml.bos_token_id", eot);
      w.u32("tokenizer.ggml.eos_token_id", eot);
    };
  };
  {
    GgufWriter w;
    good_except("")(w);
    w.boolean("tokenizer.ggml.add_bos_token", true);
    const std::vector<std::byte> bytes = w.bytes();
    const GgufFile g = GgufFile::parse(bytes, "v.gguf");
    const GgufBpeVocabulary voc = gguf_bpe_vocabulary(g);
    EXPECT_TRUE(voc.add_bos);
    EXPECT_EQ(voc.tokenizer.bos_id(), static_cast<std::int32_t>(eot));
    EXPECT_EQ(voc.tokenizer.encode(" world"),
              (std::vector<std::int32_t>{v.id_of(" w"), v.id_of("or"), 'l', 'd'}));
    EXPECT_THAT(error_of([&] { gguf_vocabulary(g); }),
                HasSubstr("tokenizer.ggml.model is 'gpt2' (byte-level BPE); read it with "
                          "gguf_bpe_vocabulary()"));
  }
  const std::vector<Damage> damages = {
      {"llama model",
       [&](GgufWriter& w) {
         w.str("tokenizer.ggml.model", "llama");
         good_except("model")(w);
       },
       "tokenizer.ggml.model is 'llama', expected 'gpt2'"},
      {"no pre-tokenizer", good_except("pre"), "tokenizer.ggml.pre is missing"},
      {"qwen2 pre-tokenizer",
       [&](GgufWriter& w) {
         w.str("tokenizer.ggml.pre", "qwen2");
         good_except("pre")(w);
       },
       "tokenizer.ggml.pre is 'qwen2'; only GPT-2's pre-tokenizer"},
      {"no merges", good_except("merges"), "tokenizer.ggml.merges"},
      {"merges of wrong type",
       [&](GgufWriter& w) {
         w.i32s("tokenizer.ggml.merges", {1, 2});
         good_except("merges")(w);
       },
       "tokenizer.ggml.merges (at byte"},
      {"merge of unknown token",
       [&](GgufWriter& w) {
         w.strings("tokenizer.ggml.merges", {"o r", "x yz"});
         good_except("merges")(w);
       },
       "tokenizer.ggml.merges[1] 'x yz': 'yz' is not a token"},
      {"token types of wrong type",
       [&](GgufWriter& w) {
         w.strings("tokenizer.ggml.token_type", v.tokens);
         good_except("types")(w);
       },
       "tokenizer.ggml.token_type (at byte"},
      {"short token types",
       [&](GgufWriter& w) {
         w.i32s("tokenizer.ggml.token_type", {1, 1});
         good_except("types")(w);
       },
       "tokenizer.ggml.token_type holds 2 values, but tokenizer.ggml.tokens holds 259"},
      {"bos outside",
       [&](GgufWriter& w) {
         w.u32("tokenizer.ggml.bos_token_id", 259);
         good_except("bos")(w);
       },
       "tokenizer.ggml.bos_token_id"},
      {"add_bos without bos",
       [&](GgufWriter& w) {
         w.boolean("tokenizer.ggml.add_bos_token", true);
         good_except("bos")(w);
       },
       "add_bos_token is true but tokenizer.ggml.bos_token_id is missing"},
  };
  for (const Damage& d : damages) {
    GgufWriter w;
    d.write(w);
    const std::vector<std::byte> bytes = w.bytes();
    const std::string what = error_of([&] {
      const GgufFile g = GgufFile::parse(bytes, "damaged.gguf");
      gguf_bpe_vocabulary(g);
    });
    EXPECT_THAT(what, HasSubstr(d.message)) << d.name;
    EXPECT_THAT(what, HasSubstr("gguf 'damaged.gguf'")) << d.name;
  }
  // A merges array longer than the limits allow fails before it is read.
  GgufWriter w;
  good_except("")(w);
  const std::vector<std::byte> bytes = w.bytes();
  GgufLimits limits;
  limits.max_array_length = 258;  // 259 tokens
  EXPECT_THAT(error_of([&] { GgufFile::parse(bytes, "small.gguf", limits); }), HasSubstr("259"));
}

// ---------------------------------------------------------------------------------------------
// llama.cpp's gpt-2 vocabulary and its tokenizer test cases (tests/test-tokenizer-0: texts
// separated by "\n__ggml_vocab_test__\n", one line of ids per text, add_special false).

fs::path gpt2_dir() { return fs::path(KVDECODE_TEST_DATA_DIR) / "gpt2-vocab"; }

TEST(GgufBpeVocabularyTest, Gpt2VocabularyEncodesAsLlamaCpp) {
  const fs::path file = gpt2_dir() / "ggml-vocab-gpt-2.gguf";
  ASSERT_TRUE(fs::exists(file)) << "fixture missing: " << file;
  const GgufFile g = GgufFile::open(file);
  const GgufBpeVocabulary v = gguf_bpe_vocabulary(g);
  EXPECT_EQ(v.tokenizer.vocab_size(), 50257);
  EXPECT_EQ(v.tokenizer.merge_count(), 50000u);
  EXPECT_EQ(v.tokenizer.bos_id(), 50256);
  EXPECT_EQ(v.tokenizer.eos_id(), 50256);
  EXPECT_FALSE(v.add_bos);

  const std::string inp = read_text(gpt2_dir() / "ggml-vocab-gpt-2.gguf.inp");
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
  std::ifstream out(gpt2_dir() / "ggml-vocab-gpt-2.gguf.out");
  std::vector<std::vector<std::int32_t>> want;
  for (std::string line; std::getline(out, line);) {
    std::istringstream in(line);
    std::vector<std::int32_t> ids;
    for (std::int32_t id = 0; in >> id;) ids.push_back(id);
    want.push_back(ids);
  }
  ASSERT_EQ(texts.size(), want.size());
  ASSERT_GE(texts.size(), 40u);
  for (std::size_t i = 0; i < texts.size(); ++i) {
    const std::vector<std::int32_t> got = v.tokenizer.encode(texts[i]);
    EXPECT_EQ(got, want[i]) << "case " << i << ": '" << texts[i] << "'";
    EXPECT_EQ(v.tokenizer.decode_all(got), texts[i]) << "case " << i;
  }
}

TEST(GgufBpeVocabularyTest, Gpt2VocabularyRoundTripsRandomBytes) {
  const fs::path file = gpt2_dir() / "ggml-vocab-gpt-2.gguf";
  ASSERT_TRUE(fs::exists(file)) << "fixture missing: " << file;
  const GgufBpeVocabulary v = gguf_bpe_vocabulary(GgufFile::open(file));
  std::mt19937 rng(3);
  for (int k = 0; k < 300; ++k) {
    std::string text;
    const std::size_t n = rng() % 100;
    // Half ASCII-heavy text, half any bytes.
    for (std::size_t i = 0; i < n; ++i)
      text += static_cast<char>(k % 2 ? rng() % 256 : "ab cd'\n1.é"[rng() % 10]);
    ASSERT_EQ(v.tokenizer.decode_all(v.tokenizer.encode(text)), text) << "case " << k;
  }
  // A long word (one pre-token of 100 000 letters) merges without quadratic rescans.
  const std::string long_word(100000, 'a');
  EXPECT_EQ(v.tokenizer.decode_all(v.tokenizer.encode(long_word)), long_word);
}

}  // namespace
}  // namespace kvdecode
