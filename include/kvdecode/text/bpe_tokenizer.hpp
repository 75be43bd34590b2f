// BpeTokenizer: GPT-2's byte-level BPE (the "gpt2" vocabulary of GGUF files): the GPT-2
// pre-tokenizer regex splits the text into words, each word's bytes merge by rank, and decode
// gives back the exact bytes. docs/FORMATS.md §5.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <queue>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvdecode/detail/unicode_classes.hpp"
#include "kvdecode/error.hpp"

namespace kvdecode {
namespace detail {

/// The class of code point `cp` (past U+10FFFF: other), by binary search over the runs.
inline UnicodeClass unicode_class(std::uint32_t cp) {
  if (cp > 0x10FFFF) return UnicodeClass::kOther;
  const auto it =
      std::upper_bound(kUnicodeClassRuns.begin(), kUnicodeClassRuns.end(), (cp << 2) | 3u);
  return static_cast<UnicodeClass>(*(it - 1) & 3u);
}

/// One code point of a byte string and its length in bytes. Decoded as llama.cpp's
/// unicode_cpt_from_utf8 does (the lead byte's length, continuation bytes checked, overlong forms
/// and surrogates accepted), so texts split into the same words; a byte that starts no such
/// sequence is one U+FFFD of length 1.
struct CodePoint {
  std::uint32_t cp = 0;
  std::uint32_t bytes = 1;
};

inline CodePoint code_point_at(std::string_view s, std::size_t at) {
  const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(s[at + k]); };
  const auto continuation = [&](std::size_t k) {
    return at + k < s.size() && (byte(k) & 0xC0) == 0x80;
  };
  const unsigned c = byte(0);
  if (c < 0x80) return {c, 1};
  if ((c & 0xE0) == 0xC0 && continuation(1)) return {((c & 0x1Fu) << 6) | (byte(1) & 0x3Fu), 2};
  if ((c & 0xF0) == 0xE0 && continuation(1) && continuation(2))
    return {((c & 0x0Fu) << 12) | ((byte(1) & 0x3Fu) << 6) | (byte(2) & 0x3Fu), 3};
  if ((c & 0xF8) == 0xF0 && continuation(1) && continuation(2) && continuation(3))
    return {((c & 0x07u) << 18) | ((byte(1) & 0x3Fu) << 12) | ((byte(2) & 0x3Fu) << 6) |
                (byte(3) & 0x3Fu),
            4};
  return {0xFFFD, 1};
}

/// GPT-2's bytes_to_unicode(): the printable bytes '!'..'~', '¡'..'¬', '®'..'ÿ' stand for
/// themselves, the other 68 bytes (controls, space, DEL, 0x80..0xA0, soft hyphen) for U+0100 on,
/// in byte order. Vocabulary entries are stored in these characters.
inline constexpr std::array<std::uint16_t, 256> kGpt2ByteChars = [] {
  std::array<std::uint16_t, 256> chars{};
  std::uint16_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    chars[static_cast<std::size_t>(b)] = printable ? static_cast<std::uint16_t>(b) : next++;
  }
  return chars;
}();

/// The byte a GPT-2 byte character stands for, or -1 (the inverse of kGpt2ByteChars).
inline int gpt2_byte_of(std::uint32_t cp) {
  static constexpr std::array<std::int16_t, 324> kBytes = [] {
    std::array<std::int16_t, 324> bytes{};
    bytes.fill(-1);
    for (int b = 0; b < 256; ++b)
      bytes[kGpt2ByteChars[static_cast<std::size_t>(b)]] = static_cast<std::int16_t>(b);
    return bytes;
  }();
  return cp < kBytes.size() ? kBytes[cp] : -1;
}

inline void append_utf8(std::string& out, std::uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

/// Calls word(begin, end) for each word of `text`, as GPT-2's pre-tokenizer regex
///   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
/// splits it (begin, end are byte offsets; the words tile the text). The alternatives are tried
/// in order at each position, so a run of white space before a non-space keeps its last
/// character for the next word (" ?" takes a space) unless the run is that one character.
/// `classes` is scratch: [code points of text + 1].
template <class Word>
void split_gpt2_words(std::string_view text, std::vector<UnicodeClass>& classes,
                      std::vector<std::uint32_t>& cps, std::vector<std::size_t>& offsets,
                      Word&& word) {
  classes.clear();
  cps.clear();
  offsets.clear();
  for (std::size_t at = 0; at < text.size();) {
    const CodePoint c = code_point_at(text, at);
    cps.push_back(c.cp);
    classes.push_back(unicode_class(c.cp));
    offsets.push_back(at);
    at += c.bytes;
  }
  const std::size_t n = cps.size();
  offsets.push_back(text.size());
  // Past the end there is no character: none of the classes matches it.
  const auto is = [&](std::size_t k, UnicodeClass c) { return k < n && classes[k] == c; };
  std::size_t begin = 0;
  const auto emit = [&](std::size_t end) {
    if (end > begin) word(offsets[begin], offsets[end]);
    begin = end;
  };
  for (std::size_t k = 0; k < n;) {
    const std::uint32_t cp = cps[k];
    if (cp == '\'' && k + 1 < n) {
      const std::uint32_t a = cps[k + 1];
      if (a == 's' || a == 't' || a == 'm' || a == 'd') {
        emit(k += 2);
        continue;
      }
      const std::uint32_t b = k + 2 < n ? cps[k + 2] : 0;
      if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) {
        emit(k += 3);
        continue;
      }
    }
    // " ?X+": the class that decides is the one after an optional leading space.
    const std::size_t lead = k + (cp == ' ' ? 1 : 0);
    if (lead < n && classes[lead] != UnicodeClass::kWhitespace) {
      const UnicodeClass c = classes[lead];
      k = lead;
      while (is(k, c)) ++k;
      emit(k);
      continue;
    }
    std::size_t spaces = 0;
    while (is(k + spaces, UnicodeClass::kWhitespace)) ++spaces;
    // "\s+(?!\S)": a run followed by a non-space leaves its last character to that word.
    if (spaces > 1 && k + spaces < n) {
      emit(k += spaces - 1);
      continue;
    }
    emit(k += std::max<std::size_t>(spaces, 1));  // "\s+" (a lone ' ' at the end included)
  }
}

}  // namespace detail

/// Token types of GGUF's tokenizer.ggml.token_type (llama.cpp's llama_token_type).
enum class BpeTokenType : std::int32_t {
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,
  kUserDefined = 4,
  kUnused = 5,
  kByte = 6,
};

/// A byte-level BPE vocabulary with GPT-2's pre-tokenizer, encoding as llama.cpp's
/// llm_tokenizer_bpe does for the "gpt-2" pre-tokenizer. Immutable after construction, so one
/// BpeTokenizer may be shared across threads.
///
/// Tokens and merges are given as stored (in GPT-2's byte characters, kGpt2ByteChars). Encoding
/// works on raw bytes: a word starts as one token per byte and the adjacent pair of lowest merge
/// rank (leftmost on ties) merges until none does, with a heap of candidate pairs (stale ones are
/// skipped when popped), O(n log n) per word. The construction checks what makes this equal to
/// llama.cpp's text-based merging and decode(encode(text)) == text: every byte has a token, and
/// every merge's left part, right part and result are tokens, none of them a control token.
///
/// Where this class departs from llama.cpp, or decides what llama.cpp leaves open:
/// * Special tokens are never parsed from the text (llama.cpp's parse_special = false); control
///   tokens decode to "" and user-defined or byte-typed tokens are refused, since llama.cpp
///   matches user-defined tokens in the text before BPE and this class does not.
/// * Text that is not UTF-8 splits into the words llama.cpp finds (a stray byte is a U+FFFD), but
///   its bytes are kept, so decode(encode(bytes)) gives every byte string back; llama.cpp
///   encodes U+FFFD in its place.
/// * Duplicate token texts: the highest id wins (llama.cpp's token_to_id); a duplicate merge
///   keeps its first (lowest) rank.
class BpeTokenizer {
 public:
  /// The longest text encode() accepts.
  static constexpr std::size_t kMaxEncodeBytes =
      static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max());

  /// Builds the vocabulary. `token_types` is empty (all normal) or one per token; bos_id and
  /// eos_id are -1 when the vocabulary has none. `context` prefixes every error message.
  /// Throws Error naming the key (tokenizer.ggml.tokens, token_type, merges) and the index.
  BpeTokenizer(std::span<const std::string_view> tokens, std::span<const std::int32_t> token_types,
               std::span<const std::string_view> merges, std::int32_t bos_id, std::int32_t eos_id,
               std::string_view context = "BpeTokenizer") {
    const std::string ctx(context);
    const std::size_t n = tokens.size();
    KVDECODE_CHECK(
        n >= 1 && n <= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()), ctx,
        ": tokenizer.ggml.tokens holds ", n, " tokens, expected 1..2^31-1");
    KVDECODE_CHECK(token_types.empty() || token_types.size() == n, ctx,
                   ": tokenizer.ggml.token_type holds ", token_types.size(),
                   " values, but tokenizer.ggml.tokens holds ", n);
    KVDECODE_CHECK(
        merges.size() <= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()), ctx,
        ": tokenizer.ggml.merges holds ", merges.size(), " merges, more than int32 ranks allow");
    const std::pair<const char*, std::int32_t> specials[] = {{"bos_token_id", bos_id},
                                                             {"eos_token_id", eos_id}};
    for (const auto& [what, id] : specials) {
      KVDECODE_CHECK(id >= -1 && id < static_cast<std::int64_t>(n), ctx, ": tokenizer.ggml.", what,
                     " is ", id, ", outside the vocabulary [0, ", n, ")");
    }

    // Stored text -> id, the highest id winning (llama.cpp assigns token_to_id in id order).
    std::unordered_map<std::string_view, std::int32_t> ids;
    ids.reserve(n);
    offsets_.reserve(n + 1);
    offsets_.push_back(0);
    std::size_t stored_bytes = 0;
    for (const std::string_view t : tokens) stored_bytes += t.size();
    piece_bytes_.reserve(stored_bytes);  // a piece's bytes are never more than its stored text's
    for (std::size_t id = 0; id < n; ++id) {
      const std::string_view text = tokens[id];
      const auto type =
          token_types.empty() ? BpeTokenType::kNormal : static_cast<BpeTokenType>(token_types[id]);
      const std::int32_t t = static_cast<std::int32_t>(type);
      KVDECODE_CHECK(t >= 1 && t <= 6, ctx, ": tokenizer.ggml.token_type[", id, "] is ", t,
                     ", expected 1..6 (normal, unknown, control, user-defined, unused, byte)");
      KVDECODE_CHECK(type != BpeTokenType::kUserDefined && type != BpeTokenType::kByte, ctx,
                     ": token ", id, " '", text, "' has type ", t,
                     " (user-defined or byte); only normal, unknown, control and unused tokens "
                     "are supported in a byte-level BPE vocabulary");
      ids[text] = static_cast<std::int32_t>(id);
      if (type != BpeTokenType::kControl) {
        for (std::size_t at = 0; at < text.size();) {
          const detail::CodePoint c = detail::code_point_at(text, at);
          const int byte = detail::gpt2_byte_of(c.cp);
          KVDECODE_CHECK(byte >= 0, ctx, ": token ", id, " '", text, "': the character at byte ",
                         at, " is not one of GPT-2's 256 byte characters");
          piece_bytes_ += static_cast<char>(byte);
          at += c.bytes;
        }
      }
      offsets_.push_back(piece_bytes_.size());
    }
    for (int b = 0; b < 256; ++b) {
      std::string ch;
      detail::append_utf8(ch, detail::kGpt2ByteChars[static_cast<std::size_t>(b)]);
      const auto it = ids.find(ch);
      KVDECODE_CHECK(it != ids.end(), ctx, ": tokenizer.ggml.tokens has no token '", ch,
                     "' for byte ", b, " (byte-level BPE needs one per byte)");
      KVDECODE_CHECK(!is_control(token_types, it->second), ctx, ": token ", it->second, " '", ch,
                     "' for byte ", b, " is a control token");
      byte_tokens_[static_cast<std::size_t>(b)] = it->second;
    }

    merges_.reserve(merges.size());
    std::string joined;
    for (std::size_t rank = 0; rank < merges.size(); ++rank) {
      const std::string_view m = merges[rank];
      // llama.cpp splits at the first space after the first byte.
      const std::size_t space = m.size() > 1 ? m.find(' ', 1) : std::string_view::npos;
      KVDECODE_CHECK(space != std::string_view::npos && space + 1 < m.size(), ctx,
                     ": tokenizer.ggml.merges[", rank, "] is '", m,
                     "', expected two tokens separated by a space");
      const std::string_view left = m.substr(0, space);
      const std::string_view right = m.substr(space + 1);
      joined.assign(left);
      joined += right;
      std::int32_t part[3];
      const std::string_view names[3] = {left, right, joined};
      for (int k = 0; k < 3; ++k) {
        const auto it = ids.find(names[k]);
        KVDECODE_CHECK(it != ids.end(), ctx, ": tokenizer.ggml.merges[", rank, "] '", m, "': '",
                       names[k], "' is not a token");
        // A control token decodes to "", so text merged into one would not come back.
        KVDECODE_CHECK(!is_control(token_types, it->second), ctx, ": tokenizer.ggml.merges[", rank,
                       "] '", m, "': '", names[k], "' is control token ", it->second);
        part[k] = it->second;
      }
      merges_.try_emplace(pair_key(part[0], part[1]),
                          Merge{static_cast<std::int32_t>(rank), part[2]});
    }

    sorted_ids_.resize(n);
    for (std::size_t i = 0; i < n; ++i) sorted_ids_[i] = static_cast<std::int32_t>(i);
    std::sort(sorted_ids_.begin(), sorted_ids_.end(), [this](std::int32_t a, std::int32_t b) {
      const int c = piece_unchecked(a).compare(piece_unchecked(b));
      return c != 0 ? c < 0 : a < b;
    });
    bos_id_ = bos_id;
    eos_id_ = eos_id;
    types_.assign(token_types.begin(), token_types.end());
  }

  /// The token ids of `text`: BOS first when `bos`, EOS last when `eos` (each must exist).
  std::vector<std::int32_t> encode(std::string_view text, bool bos = false,
                                   bool eos = false) const {
    std::vector<std::int32_t> out;
    encode(text, bos, eos, out);
    return out;
  }

  /// As encode() above, replacing the contents of `out`. On a throw, `out` is unchanged.
  void encode(std::string_view text, bool bos, bool eos, std::vector<std::int32_t>& out) const {
    // merge_word() indexes a word's bytes by int32.
    KVDECODE_CHECK(text.size() <= kMaxEncodeBytes, "BpeTokenizer::encode: text of ", text.size(),
                   " bytes, more than the ", kMaxEncodeBytes, " bytes int32 symbol indices allow");
    KVDECODE_CHECK(!bos || bos_id_ >= 0,
                   "BpeTokenizer::encode: BOS asked for, but the vocabulary "
                   "has no tokenizer.ggml.bos_token_id");
    KVDECODE_CHECK(!eos || eos_id_ >= 0,
                   "BpeTokenizer::encode: EOS asked for, but the vocabulary "
                   "has no tokenizer.ggml.eos_token_id");
    Scratch s;
    std::vector<std::int32_t> result;
    result.reserve(text.size() + 2);
    if (bos) result.push_back(bos_id_);
    detail::split_gpt2_words(text, s.classes, s.cps, s.offsets,
                             [&](std::size_t begin, std::size_t end) {
                               merge_word(text.substr(begin, end - begin), s, result);
                             });
    if (eos) result.push_back(eos_id_);
    out = std::move(result);
  }

  /// The bytes of `token` (prev_token is unused: byte-level BPE strips nothing after BOS; the
  /// parameter keeps Tokenizer's signature). A token may end inside a UTF-8 character; TextStream
  /// holds such bytes back. Control tokens decode to "". The view lives as long as the
  /// BpeTokenizer.
  std::string_view decode(std::int32_t /*prev_token*/, std::int32_t token) const {
    check_id(token, "decode");
    return piece_unchecked(token);
  }

  /// The bytes of all `tokens`, concatenated.
  std::string decode_all(std::span<const std::int32_t> tokens) const {
    std::string out;
    for (const std::int32_t t : tokens) out += decode(-1, t);
    return out;
  }

  /// The lowest id of a normal token whose bytes are exactly `piece`, if any.
  std::optional<std::int32_t> find(std::string_view piece) const {
    auto it = std::lower_bound(
        sorted_ids_.begin(), sorted_ids_.end(), piece,
        [this](std::int32_t id, std::string_view p) { return piece_unchecked(id) < p; });
    for (; it != sorted_ids_.end() && piece_unchecked(*it) == piece; ++it) {
      if (type_of(*it) != BpeTokenType::kControl) return *it;
    }
    return std::nullopt;
  }

  /// The bytes of a token ("" for a control token).
  std::string_view piece(std::int32_t id) const {
    check_id(id, "piece");
    return piece_unchecked(id);
  }

  std::int64_t vocab_size() const { return static_cast<std::int64_t>(offsets_.size()) - 1; }
  std::int32_t bos_id() const { return bos_id_; }  ///< -1 when the vocabulary has none
  std::int32_t eos_id() const { return eos_id_; }  ///< -1 when the vocabulary has none
  std::size_t merge_count() const { return merges_.size(); }

  BpeTokenType type_of(std::int32_t id) const {
    return types_.empty() ? BpeTokenType::kNormal
                          : static_cast<BpeTokenType>(types_[static_cast<std::size_t>(id)]);
  }

 private:
  struct Merge {
    std::int32_t rank;
    std::int32_t result;
  };
  // A candidate merge of symbols (left, right) holding tokens (left_id, right_id); it is stale
  // once either symbol holds another token or they are no longer neighbours.
  struct Candidate {
    std::int32_t rank;
    std::int32_t left;
    std::int32_t right;
    std::int32_t left_id;
    std::int32_t right_id;
    std::int32_t result;
    // Lowest rank first, then leftmost (llama.cpp's llm_bigram_bpe order).
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : left > o.left;
    }
  };
  struct Scratch {
    std::vector<detail::UnicodeClass> classes;  // [code points + 1]
    std::vector<std::uint32_t> cps;             // [code points]
    std::vector<std::size_t> offsets;           // [code points + 1]: byte offset of each
    std::vector<std::int32_t> tokens;  // [word bytes]: token of each symbol, -1 merged away
    std::vector<std::int32_t> next;    // [word bytes]: next live symbol or -1
    std::vector<std::int32_t> prev;    // [word bytes]: previous live symbol or -1
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  };

  static bool is_control(std::span<const std::int32_t> types, std::int32_t id) {
    return !types.empty() &&
           types[static_cast<std::size_t>(id)] == static_cast<std::int32_t>(BpeTokenType::kControl);
  }

  static std::uint64_t pair_key(std::int32_t left, std::int32_t right) {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(left)) << 32) |
           static_cast<std::uint32_t>(right);
  }

  // One word: a symbol per byte, then merges by rank until no pair merges.
  void merge_word(std::string_view word, Scratch& s, std::vector<std::int32_t>& out) const {
    const auto n = static_cast<std::int32_t>(word.size());
    s.tokens.resize(word.size());
    s.next.resize(word.size());
    s.prev.resize(word.size());
    for (std::int32_t i = 0; i < n; ++i) {
      s.tokens[static_cast<std::size_t>(i)] =
          byte_tokens_[static_cast<unsigned char>(word[static_cast<std::size_t>(i)])];
      s.next[static_cast<std::size_t>(i)] = i + 1 < n ? i + 1 : -1;
      s.prev[static_cast<std::size_t>(i)] = i - 1;
    }
    const auto at = [](std::vector<std::int32_t>& v, std::int32_t i) -> std::int32_t& {
      return v[static_cast<std::size_t>(i)];
    };
    const auto consider = [&](std::int32_t left) {
      if (left < 0) return;
      const std::int32_t right = at(s.next, left);
      if (right < 0) return;
      const auto it = merges_.find(pair_key(at(s.tokens, left), at(s.tokens, right)));
      if (it == merges_.end()) return;
      s.heap.push({it->second.rank, left, right, at(s.tokens, left), at(s.tokens, right),
                   it->second.result});
    };
    for (std::int32_t i = 0; i + 1 < n; ++i) consider(i);
    while (!s.heap.empty()) {
      const Candidate c = s.heap.top();
      s.heap.pop();
      if (at(s.tokens, c.left) != c.left_id || at(s.tokens, c.right) != c.right_id ||
          at(s.next, c.left) != c.right) {
        continue;  // stale: one side merged since the candidate was pushed
      }
      at(s.tokens, c.left) = c.result;
      at(s.tokens, c.right) = -1;
      const std::int32_t after = at(s.next, c.right);
      at(s.next, c.left) = after;
      if (after >= 0) at(s.prev, after) = c.left;
      consider(at(s.prev, c.left));
      consider(c.left);
    }
    for (std::int32_t i = 0; i >= 0 && i < n; i = at(s.next, i)) out.push_back(at(s.tokens, i));
  }

  void check_id(std::int32_t id, const char* what) const {
    KVDECODE_CHECK(id >= 0 && id < vocab_size(), "BpeTokenizer::", what, ": token id ", id,
                   " is outside [0, vocab_size ", vocab_size(), ")");
  }

  std::string_view piece_unchecked(std::int32_t id) const {
    const auto i = static_cast<std::size_t>(id);
    return std::string_view(piece_bytes_).substr(offsets_[i], offsets_[i + 1] - offsets_[i]);
  }

  std::string piece_bytes_;  // [sum of piece lengths]: every token's bytes, in id order
  // [vocab_size + 1]: token `id` is piece_bytes_[offsets_[id], offsets_[id + 1])
  std::vector<std::size_t> offsets_;
  std::vector<std::int32_t> types_;                  // [vocab_size] or empty (all normal)
  std::vector<std::int32_t> sorted_ids_;             // [vocab_size]: ids by bytes, then id
  std::array<std::int32_t, 256> byte_tokens_{};      // [256]: the token of each single byte
  std::unordered_map<std::uint64_t, Merge> merges_;  // (left, right) token ids -> rank, result
  std::int32_t bos_id_ = -1;
  std::int32_t eos_id_ = -1;
};

}  // namespace kvdecode
