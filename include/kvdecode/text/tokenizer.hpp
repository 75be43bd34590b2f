// Tokenizer: llama2.c's tokenizer.bin vocabulary with run.c's exact encode (dummy prefix, UTF-8
// code points, byte fallback, best-score pair merges), decode and safe_printf rules.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "kvdecode/error.hpp"

namespace kvdecode {
namespace detail {

/// isprint() in the C locale: 0x20..0x7E. Written out so that no global locale can change it.
constexpr bool is_c_print(unsigned char c) { return c >= 0x20 && c <= 0x7E; }

/// isspace() in the C locale: ' ', \t, \n, \v, \f, \r.
constexpr bool is_c_space(unsigned char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }

constexpr int hex_digit_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

/// The byte that run.c's decode() finds in `piece`, or -1 when there is none. run.c tests
/// `sscanf(piece, "<0x%02hhX>", &byte) == 1`, so this follows glibc's %2X, not just "<0xNN>":
/// leading white space is skipped (outside the width), then at most 2 characters of an optional
/// sign, an optional "0x" prefix whose 0 counts as a digit, and hex digits; a minus negates modulo
/// 256; the closing '>' and anything after it are never checked.
constexpr int parse_byte_piece(std::string_view piece) {
  if (!piece.starts_with("<0x")) return -1;
  std::size_t i = 3;
  while (i < piece.size() && is_c_space(static_cast<unsigned char>(piece[i]))) ++i;
  int width = 2;
  bool negative = false;
  if (i < piece.size() && (piece[i] == '+' || piece[i] == '-')) {
    negative = piece[i] == '-';
    ++i;
    --width;
  }
  unsigned value = 0;
  int digits = 0;
  if (width > 0 && i < piece.size() && piece[i] == '0') {
    ++i;
    --width;
    ++digits;
    if (width > 0 && i < piece.size() && (piece[i] == 'x' || piece[i] == 'X')) {
      ++i;
      --width;
    }
  }
  for (; width > 0 && i < piece.size() && hex_digit_value(piece[i]) >= 0; ++i, --width) {
    value = value * 16 + static_cast<unsigned>(hex_digit_value(piece[i]));
    ++digits;
  }
  if (digits == 0) return -1;
  if (negative) value = 0u - value;
  return static_cast<int>(value & 0xFFu);
}

/// One single-byte string per byte value, so decode() can return a view of a raw byte the way
/// run.c returns `byte_pieces + 2 * byte`.
inline constexpr std::array<char, 256> kBytePieces = [] {
  std::array<char, 256> bytes{};
  for (int b = 0; b < 256; ++b) bytes[static_cast<std::size_t>(b)] = static_cast<char>(b);
  return bytes;
}();

inline void append_u32_le(std::vector<std::byte>& out, std::uint32_t v) {
  for (int shift = 0; shift < 32; shift += 8) out.push_back(static_cast<std::byte>(v >> shift));
}

inline std::uint32_t read_u32_le(const std::byte* p) {
  return static_cast<std::uint32_t>(p[0]) | (static_cast<std::uint32_t>(p[1]) << 8) |
         (static_cast<std::uint32_t>(p[2]) << 16) | (static_cast<std::uint32_t>(p[3]) << 24);
}

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};

}  // namespace detail

/// A llama2.c vocabulary: piece bytes and merge scores per token id, plus run.c's encode and
/// decode. Immutable after construction, so one Tokenizer may be shared across threads.
///
/// Where run.c leaves behaviour open, this class decides:
/// * The file must hold exactly vocab_size entries. run.c reads vocab_size entries and ignores
///   the rest, so a tokenizer of a larger vocabulary gives wrong text without an error; here a
///   file that ends after fewer entries, or holds more whole entries, is refused naming both
///   counts. Trailing bytes that are not whole entries are still ignored, as in run.c.
/// * Duplicate pieces are accepted; a lookup finds the lowest id (run.c's bsearch finds any).
/// * Pieces and text are byte strings. run.c handles NUL-terminated C strings, so it never sees a
///   NUL byte in the text; here a NUL is an ordinary byte (byte fallback gives id 3).
/// * Empty pieces are accepted (run.c's fread of 0 bytes fails, so it rejects them), and scores
///   are taken as they are, NaN included (a NaN-scored merge is never chosen, as in run.c).
/// * The vocabulary must hold the BOS and EOS ids (vocab_size >= 3) and the piece " ".
class Tokenizer {
 public:
  static constexpr std::int32_t kBos = 1;  ///< run.c hard-codes BOS = 1 (stored as "\n<s>\n")
  static constexpr std::int32_t kEos = 2;  ///< run.c hard-codes EOS = 2 (stored as "\n</s>\n")
  /// run.c's byte fallback emits id = byte + kByteIdOffset (after <unk>, <s>, </s>).
  static constexpr std::int32_t kByteIdOffset = 3;
  /// Scratch int32s the merge loop needs per symbol besides its token (see merge_pairs()).
  static constexpr std::size_t kMergeScratchPerSymbol = 5;
  /// The longest text encode() accepts: the merge loop indexes its text bytes + 2 symbols by
  /// int32.
  static constexpr std::size_t kMaxEncodeBytes =
      static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()) - 2;

  /// Reads a tokenizer.bin file. vocab_size comes from the checkpoint header (the file does not
  /// store it). Throws Error naming the file, the entry and the expected vs actual value.
  static Tokenizer load(const std::filesystem::path& file, std::int64_t vocab_size) {
    const std::string name = file.string();
    std::error_code ec;
    const std::uintmax_t size = std::filesystem::file_size(file, ec);
    KVDECODE_CHECK(!ec, "tokenizer.bin '", name, "': cannot read: ", ec.message());
    std::unique_ptr<std::FILE, detail::FileCloser> f(std::fopen(name.c_str(), "rb"));
    KVDECODE_CHECK(f != nullptr, "tokenizer.bin '", name,
                   "': cannot open: ", std::generic_category().message(errno));
    std::vector<std::byte> bytes(static_cast<std::size_t>(size));
    const std::size_t got = std::fread(bytes.data(), 1, bytes.size(), f.get());
    KVDECODE_CHECK(got == bytes.size(), "tokenizer.bin '", name, "': read ", got, " of ",
                   bytes.size(), " bytes");
    return from_memory(bytes, vocab_size, name);
  }

  /// Parses tokenizer.bin bytes (see load()); `name` labels the error messages.
  static Tokenizer from_memory(std::span<const std::byte> bytes, std::int64_t vocab_size,
                               std::string_view name = "<memory>") {
    const std::string context = detail::concat("tokenizer.bin '", name, "'");
    check_vocab_size(vocab_size, context);
    const std::uint64_t file_size = bytes.size();
    std::uint64_t pos = 0;
    // Every read names the field, so a truncated file says where it ends and what was missing.
    // piece_len >= 0 names the field "the <piece_len>-byte piece"; entry < 0 means the header.
    auto need = [&](std::uint64_t n, std::int64_t entry, const char* field,
                    std::int64_t piece_len = -1) {
      if (file_size - pos >= n) return;
      const std::string what =
          piece_len >= 0 ? detail::concat("the ", piece_len, "-byte piece") : std::string(field);
      const std::string where =
          entry >= 0 ? detail::concat(": entry ", entry, " of ", vocab_size) : std::string();
      // Ending cleanly between entries is a smaller vocabulary, not a damaged file.
      if (entry >= 0 && pos == file_size && piece_len < 0 && std::string_view(field) == "the score")
        KVDECODE_FAIL(context, ": the file holds ", entry,
                      " entries but the model's vocab_size is ", vocab_size,
                      " (a tokenizer of another model?)");
      KVDECODE_FAIL(context, where, ": file ends at byte ", file_size, " while reading ", what,
                    " (needs ", n - (file_size - pos), " more bytes)");
    };
    need(4, -1, "max_token_length");
    const std::uint32_t max_token_length = detail::read_u32_le(bytes.data() + pos);
    pos += 4;

    std::string piece_bytes;
    std::vector<std::size_t> offsets;
    std::vector<float> scores;
    // Reserve no more than the file can hold (>= 8 bytes an entry), so that a wrong vocab_size
    // fails on the truncation check instead of on a huge allocation.
    const auto max_entries = static_cast<std::int64_t>((file_size - 4) / 8);
    offsets.reserve(static_cast<std::size_t>(std::min(vocab_size, max_entries)) + 1);
    scores.reserve(static_cast<std::size_t>(std::min(vocab_size, max_entries)));
    piece_bytes.reserve(static_cast<std::size_t>(file_size - 4));
    offsets.push_back(0);
    for (std::int64_t i = 0; i < vocab_size; ++i) {
      need(4, i, "the score");
      scores.push_back(std::bit_cast<float>(detail::read_u32_le(bytes.data() + pos)));
      pos += 4;
      need(4, i, "the piece length");
      const auto len = static_cast<std::int32_t>(detail::read_u32_le(bytes.data() + pos));
      pos += 4;
      KVDECODE_CHECK(len >= 0, context, ": entry ", i, " of ", vocab_size, ": piece length ", len,
                     " is negative");
      need(static_cast<std::uint64_t>(len), i, "the piece", len);
      piece_bytes.append(reinterpret_cast<const char*>(bytes.data() + pos),
                         static_cast<std::size_t>(len));
      pos += static_cast<std::uint64_t>(len);
      offsets.push_back(piece_bytes.size());
    }
    // More whole entries after the vocabulary: a tokenizer of a larger vocabulary.
    if (const std::uint64_t more = whole_entries(bytes.subspan(pos)); more > 0)
      KVDECODE_FAIL(context, ": the file holds ", vocab_size + static_cast<std::int64_t>(more),
                    " entries but the model's vocab_size is ", vocab_size,
                    " (a tokenizer of another model?)");
    return Tokenizer(std::move(piece_bytes), std::move(offsets), std::move(scores),
                     max_token_length, context);
  }

  /// Builds a vocabulary from pieces (id = index) and their scores; validated like a file.
  Tokenizer(const std::vector<std::string>& pieces, std::vector<float> scores,
            std::uint32_t max_token_length)
      : Tokenizer(join(pieces), piece_offsets(pieces), std::move(scores), max_token_length,
                  "Tokenizer") {}

  /// run.c encode(text, bos, eos): BOS, the dummy prefix " " (for non-empty text), one token per
  /// UTF-8 code point (or one byte token per byte), then best-score pair merges, then EOS.
  std::vector<std::int32_t> encode(std::string_view text, bool bos = true, bool eos = false) const {
    std::vector<std::int32_t> out;
    encode(text, bos, eos, out);
    return out;
  }

  /// As encode() above, but replaces the contents of `out` and reuses its capacity: a call
  /// allocates nothing when out.capacity() >= 6 * (text.size() + 2), which the merge loop needs
  /// for its scratch (encode_scratch_size()). On a throw, `out` is unchanged.
  void encode(std::string_view text, bool bos, bool eos, std::vector<std::int32_t>& out) const {
    // The merge loop keeps symbol indices as int32 in `out`: at most text.size() + 2 symbols.
    KVDECODE_CHECK(text.size() <= kMaxEncodeBytes, "Tokenizer::encode: text of ", text.size(),
                   " bytes, more than the ", kMaxEncodeBytes,
                   " bytes the int32 symbol indices allow");
    // Byte fallback hard-codes id = byte + 3 (run.c); only a vocabulary without all 256 byte ids
    // can fail it, so only then is the text scanned first (to throw before touching `out`).
    if (vocab_size() < 256 + kByteIdOffset) check_byte_fallback(text);
    out.reserve(encode_scratch_size(text.size()));
    out.clear();
    if (bos) out.push_back(kBos);
    // run.c: "add_dummy_prefix is true by default", but only if text != "".
    if (!text.empty()) out.push_back(space_id_);
    for (std::size_t begin = 0; begin < text.size();) {
      const std::size_t end = code_point_end(text, begin);
      const std::string_view code_point = text.substr(begin, end - begin);
      const std::int32_t id = code_point.size() == 1
                                  ? byte_ids_[static_cast<unsigned char>(code_point[0])]
                                  : lookup(code_point, {});
      if (id >= 0) {
        out.push_back(id);
      } else {
        for (const char c : code_point) {
          out.push_back(static_cast<unsigned char>(c) + kByteIdOffset);
        }
      }
      begin = end;
    }
    merge_pairs(out);
    if (eos) out.push_back(kEos);
  }

  /// The int32s encode(text, bos, eos, out) uses in `out` for a text of `text_bytes` bytes: one
  /// token and kMergeScratchPerSymbol scratch values per symbol, text_bytes + 2 symbols at most
  /// (BOS, the dummy prefix, one per byte).
  static constexpr std::size_t encode_scratch_size(std::size_t text_bytes) {
    return (1 + kMergeScratchPerSymbol) * (text_bytes + 2);
  }

  /// run.c decode(prev_token, token): the piece of `token`, without its leading space when
  /// prev_token is BOS, and a byte piece "<0xNN>" as that one raw byte. The view lives as long as
  /// the Tokenizer (or forever, for a raw byte). Only `token` must be a valid id.
  std::string_view decode(std::int32_t prev_token, std::int32_t token) const {
    check_id(token, "decode");
    std::string_view p = piece_unchecked(token);
    // run.c: "following BOS (1) token, sentencepiece decoder strips any leading whitespace".
    if (prev_token == kBos && p.starts_with(' ')) p.remove_prefix(1);
    if (const int byte = detail::parse_byte_piece(p); byte >= 0) {
      return {&detail::kBytePieces[static_cast<std::size_t>(byte)], 1};
    }
    return p;
  }

  /// What run.c's safe_printf(piece) writes: the piece up to its first NUL (printf "%s"),
  /// except that an empty piece, or a single byte that is neither isprint nor isspace in the C
  /// locale, writes nothing. So raw bytes >= 0x80 from byte tokens vanish; multi-byte pieces
  /// are written whole.
  static std::string_view printed_text(std::string_view piece) {
    piece = piece.substr(0, piece.find('\0'));
    if (piece.size() == 1) {
      const auto c = static_cast<unsigned char>(piece[0]);
      if (!detail::is_c_print(c) && !detail::is_c_space(c)) return {};
    }
    return piece;
  }

  /// Whether run.c's safe_printf(piece) writes anything (see printed_text()).
  static bool is_printable_piece(std::string_view piece) { return !printed_text(piece).empty(); }

  /// The lowest id whose piece is exactly `piece` (run.c's str_lookup), if any.
  std::optional<std::int32_t> find(std::string_view piece) const {
    const std::int32_t id = lookup(piece, {});
    if (id < 0) return std::nullopt;
    return id;
  }

  std::int64_t vocab_size() const { return static_cast<std::int64_t>(scores_.size()); }

  /// The stored bytes of a piece (" " stands for sentencepiece's U+2581).
  std::string_view piece(std::int32_t id) const {
    check_id(id, "piece");
    return piece_unchecked(id);
  }

  /// The merge score of a piece: among candidate pairs, the merge with the highest score wins.
  float score(std::int32_t id) const {
    check_id(id, "score");
    return scores_[static_cast<std::size_t>(id)];
  }

  /// The header field; at least as long as the longest piece.
  std::uint32_t max_token_length() const { return max_token_length_; }

  /// The tokenizer.bin bytes of this vocabulary (no trailing bytes).
  std::vector<std::byte> to_bytes() const {
    std::vector<std::byte> out;
    out.reserve(4 + 8 * scores_.size() + piece_bytes_.size());
    detail::append_u32_le(out, max_token_length_);
    for (std::size_t i = 0; i < scores_.size(); ++i) {
      const std::string_view p = piece_unchecked(static_cast<std::int32_t>(i));
      detail::append_u32_le(out, std::bit_cast<std::uint32_t>(scores_[i]));
      detail::append_u32_le(out, static_cast<std::uint32_t>(p.size()));
      for (const char c : p) out.push_back(static_cast<std::byte>(c));
    }
    return out;
  }

  /// Writes to_bytes() to `file`, replacing it. Throws Error naming the file on failure.
  void save(const std::filesystem::path& file) const {
    const std::string name = file.string();
    const std::vector<std::byte> bytes = to_bytes();
    std::unique_ptr<std::FILE, detail::FileCloser> f(std::fopen(name.c_str(), "wb"));
    KVDECODE_CHECK(f != nullptr, "tokenizer.bin '", name,
                   "': cannot open for writing: ", std::generic_category().message(errno));
    const std::size_t written = std::fwrite(bytes.data(), 1, bytes.size(), f.get());
    const int close_result = std::fclose(f.release());
    KVDECODE_CHECK(written == bytes.size() && close_result == 0, "tokenizer.bin '", name,
                   "': wrote ", written, " of ", bytes.size(), " bytes",
                   close_result == 0 ? "" : " and closing failed");
  }

 private:
  Tokenizer(std::string piece_bytes, std::vector<std::size_t> offsets, std::vector<float> scores,
            std::uint32_t max_token_length, const std::string& context)
      : piece_bytes_(std::move(piece_bytes)),
        offsets_(std::move(offsets)),
        scores_(std::move(scores)),
        max_token_length_(max_token_length) {
    KVDECODE_CHECK(offsets_.size() == scores_.size() + 1, context, ": ", offsets_.size() - 1,
                   " pieces but ", scores_.size(), " scores");
    check_vocab_size(static_cast<std::int64_t>(scores_.size()), context);
    for (std::size_t i = 0; i < scores_.size(); ++i) {
      const std::size_t len = offsets_[i + 1] - offsets_[i];
      // run.c merges into a buffer of 2 * max_token_length + 3 bytes, so no piece may be longer.
      KVDECODE_CHECK(len <= max_token_length_, context, ": max_token_length ", max_token_length_,
                     " is shorter than piece ", i, " (", len, " bytes)");
      KVDECODE_CHECK(len <= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()),
                     context, ": piece ", i, " has ", len,
                     " bytes, more than the file's int32 length field holds");
    }
    piece_hashes_.resize(scores_.size());
    for (std::size_t i = 0; i < scores_.size(); ++i) {
      const std::string_view p = piece_unchecked(static_cast<std::int32_t>(i));
      piece_hashes_[i] = {.hash = hash_of(p, {}), .power = power_of(p.size())};
    }
    // At most half full, so a probe ends after a slot or two; ids go in ascending, and a
    // duplicate piece is left out, so a lookup finds the lowest id.
    const std::size_t slots = std::bit_ceil(2 * scores_.size());
    piece_table_.assign(slots, Slot{});
    slot_shift_ = 64 - std::countr_zero(slots);
    for (std::size_t i = 0; i < scores_.size(); ++i) {
      const std::string_view p = piece_unchecked(static_cast<std::int32_t>(i));
      const std::uint64_t mixed = piece_hashes_[i].hash * kHashMix;
      for (std::size_t slot = first_slot(mixed);; slot = (slot + 1) & (slots - 1)) {
        Slot& at = piece_table_[slot];
        if (at.id < 0) {
          at = {.tag = tag_of(mixed), .id = static_cast<std::int32_t>(i)};
          break;
        }
        if (piece_unchecked(at.id) == p) break;  // a duplicate: keep the lower id
      }
    }
    // No piece holds a byte other than ' ' followed by ' ' (llama2.c's vocabularies: a space
    // only starts a piece or follows another space), so words merge alone (merge_pairs()).
    splits_words_ = true;
    for (std::size_t i = 0; i < scores_.size() && splits_words_; ++i) {
      const std::string_view p = piece_unchecked(static_cast<std::int32_t>(i));
      for (std::size_t k = 1; k < p.size(); ++k) {
        if (p[k] == ' ' && p[k - 1] != ' ') {
          splits_words_ = false;
          break;
        }
      }
    }
    for (int c = 0; c < 256; ++c) {
      const char byte = static_cast<char>(c);
      byte_ids_[static_cast<std::size_t>(c)] = lookup(std::string_view(&byte, 1), {});
    }
    space_id_ = byte_ids_[static_cast<unsigned char>(' ')];
    // run.c would silently push id -1 as the dummy prefix of every non-empty text.
    KVDECODE_CHECK(space_id_ >= 0, context,
                   ": vocabulary lacks the one-character piece \" \" needed as the dummy prefix");
  }

  /// How many whole entries (score, length >= 0, piece) `bytes` holds exactly, or 0 when they
  /// do not end on an entry boundary (trailing bytes, which run.c ignores too).
  static std::uint64_t whole_entries(std::span<const std::byte> bytes) {
    std::uint64_t pos = 0, n = 0;
    while (bytes.size() - pos >= 8) {
      const auto len = static_cast<std::int32_t>(detail::read_u32_le(bytes.data() + pos + 4));
      if (len < 0 || bytes.size() - pos - 8 < static_cast<std::uint64_t>(len)) return 0;
      pos += 8 + static_cast<std::uint64_t>(len);
      ++n;
    }
    return pos == bytes.size() ? n : 0;
  }

  static void check_vocab_size(std::int64_t vocab_size, const std::string& context) {
    KVDECODE_CHECK(vocab_size >= 3, context, ": vocab_size ", vocab_size,
                   " must be at least 3 (ids 0 <unk>, 1 BOS and 2 EOS)");
    KVDECODE_CHECK(vocab_size <= std::numeric_limits<std::int32_t>::max(), context, ": vocab_size ",
                   vocab_size, " does not fit the int32 token ids");
  }

  static std::string join(const std::vector<std::string>& pieces) {
    std::string out;
    for (const std::string& p : pieces) out += p;
    return out;
  }

  static std::vector<std::size_t> piece_offsets(const std::vector<std::string>& pieces) {
    std::vector<std::size_t> offsets(1, 0);
    offsets.reserve(pieces.size() + 1);
    for (const std::string& p : pieces) offsets.push_back(offsets.back() + p.size());
    return offsets;
  }

  void check_id(std::int32_t id, const char* what) const {
    KVDECODE_CHECK(id >= 0 && id < vocab_size(), "Tokenizer::", what, ": token id ", id,
                   " is outside [0, vocab_size ", vocab_size(), ")");
  }

  std::string_view piece_unchecked(std::int32_t id) const {
    const auto i = static_cast<std::size_t>(id);
    return std::string_view(piece_bytes_).substr(offsets_[i], offsets_[i + 1] - offsets_[i]);
  }

  /// Three-way byte comparison of `p` with the concatenation a ++ b, without building it.
  static int compare_with_concat(std::string_view p, std::string_view a, std::string_view b) {
    if (p.size() < a.size()) {
      const int c = p.compare(a.substr(0, p.size()));
      return c != 0 ? c : -1;  // p is a proper prefix of a, hence shorter than a ++ b
    }
    const int c = p.substr(0, a.size()).compare(a);
    return c != 0 ? c : p.substr(a.size()).compare(b);
  }

  // Pieces are found by a polynomial hash, H(s) = sum over i of (s[i] + 1) * kHashBase^(n-1-i)
  // mod 2^64, because it composes: H(a ++ b) = H(a) * kHashBase^|b| + H(b). With each piece's
  // H and kHashBase^length kept, the merge loop hashes a candidate pair from its two ids in one
  // multiply-add instead of a pass over its bytes. The product with kHashMix spreads the hash
  // over the bits: its top bits pick the slot, its low 32 bits are the slot's tag, so a probe
  // compares bytes only when the tags agree.
  static constexpr std::uint64_t kHashBase = 0x100000001b3ull;      // odd; FNV's 64-bit prime
  static constexpr std::uint64_t kHashMix = 0x9e3779b97f4a7c15ull;  // 2^64 / golden ratio, odd

  static std::uint64_t hash_of(std::string_view a, std::string_view b) {
    std::uint64_t h = 0;
    for (const char c : a) h = h * kHashBase + static_cast<unsigned char>(c) + 1;
    for (const char c : b) h = h * kHashBase + static_cast<unsigned char>(c) + 1;
    return h;
  }
  static std::uint64_t power_of(std::size_t length) {
    std::uint64_t p = 1;
    for (std::size_t i = 0; i < length; ++i) p *= kHashBase;
    return p;
  }
  std::size_t first_slot(std::uint64_t mixed) const {
    return static_cast<std::size_t>(mixed >> slot_shift_);
  }
  static std::uint32_t tag_of(std::uint64_t mixed) { return static_cast<std::uint32_t>(mixed); }

  /// The lowest id whose piece equals a ++ b, given H(a ++ b), or -1.
  std::int32_t find_hashed(std::uint64_t hash, std::string_view a, std::string_view b) const {
    const std::uint64_t mixed = hash * kHashMix;
    const std::uint32_t tag = tag_of(mixed);
    const std::size_t mask = piece_table_.size() - 1;
    for (std::size_t slot = first_slot(mixed);; slot = (slot + 1) & mask) {
      const Slot at = piece_table_[slot];
      if (at.id < 0) return -1;
      if (at.tag != tag) continue;
      const std::string_view p = piece_unchecked(at.id);
      if (p.size() == a.size() + b.size() && compare_with_concat(p, a, b) == 0) return at.id;
    }
  }

  /// The lowest id whose piece equals a ++ b, or -1 (run.c's sprintf("%s%s") + str_lookup, a
  /// binary search there; a hash probe here).
  std::int32_t lookup(std::string_view a, std::string_view b) const {
    if (a.size() + b.size() > max_token_length_) return -1;  // longer than every piece
    return find_hashed(hash_of(a, b), a, b);
  }

  /// lookup() of the pieces of ids a and b: the merge loop's question, about two per byte of
  /// text, answered from the pieces' stored hashes.
  std::int32_t lookup_pair(std::int32_t a, std::int32_t b) const {
    const PieceHash& ha = piece_hashes_[static_cast<std::size_t>(a)];
    const PieceHash& hb = piece_hashes_[static_cast<std::size_t>(b)];
    return find_hashed(ha.hash * hb.power + hb.hash, piece_unchecked(a), piece_unchecked(b));
  }

  /// run.c's code point split: a byte plus the continuation bytes (10xxxxxx) after it, at most
  /// 4 bytes in all; a stray continuation byte starts a group of its own.
  static std::size_t code_point_end(std::string_view text, std::size_t begin) {
    std::size_t end = begin + 1;
    while (end < text.size() && end - begin < 4 &&
           (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) {
      ++end;
    }
    return end;
  }

  void check_byte_fallback(std::string_view text) const {
    for (std::size_t begin = 0; begin < text.size();) {
      const std::size_t end = code_point_end(text, begin);
      if (lookup(text.substr(begin, end - begin), {}) < 0) {
        for (std::size_t i = begin; i < end; ++i) {
          const int byte = static_cast<unsigned char>(text[i]);
          KVDECODE_CHECK(byte + kByteIdOffset < vocab_size(), "Tokenizer::encode: byte ", byte,
                         " at text offset ", i,
                         " is not in a piece and needs the byte-fallback id ", byte + kByteIdOffset,
                         " (= byte + 3, as in run.c), but vocab_size is ", vocab_size());
        }
      }
      begin = end;
    }
  }

  /// run.c's merge loop over tokens = out[0, n0): repeatedly merge the adjacent pair whose
  /// merged piece has the highest score (strictly greater than -1e10, run.c's starting best, and
  /// not NaN), the leftmost pair on ties, until no pair merges. run.c rescans every pair after
  /// each merge, O(n) per merge and O(n²) in all. Here the symbols form a linked list (a merge
  /// keeps the left symbol's index, so list order is index order and "leftmost" is "lowest
  /// index"), and the mergeable pairs, keyed by their left symbol, sit in an indexed binary heap
  /// ordered by (score descending, index ascending), whose top is exactly run.c's choice. A merge
  /// changes two pairs (the merged symbol's left and right ones) and removes one, each an
  /// O(log n) heap update, so encode is O(n log n) with 2 lookups per merge. (sentencepiece
  /// pushes new pairs and skips stale ones when popped; updating in place instead bounds the
  /// heap at n entries, so all scratch fits in `out`'s tail and reused capacity allocates
  /// nothing.)
  ///
  /// Words merge alone where the vocabulary allows it (splits_words_): then no merge ever joins
  /// a symbol ending in a byte other than ' ' to one starting with ' ', so the symbols between
  /// two such boundaries merge exactly as they would in the whole text (the best pair of the
  /// text is the best of its word, and a merge changes no pair of another word). Each word gets
  /// a heap of its own, a few entries deep instead of the text's.
  void merge_pairs(std::vector<std::int32_t>& out) const {
    const std::size_t n0 = out.size();
    if (n0 < 2) return;
    out.resize((1 + kMergeScratchPerSymbol) * n0);
    std::int32_t* tokens = out.data();   // [n0]: token of each live symbol
    std::int32_t* next = tokens + n0;    // [n0]: next live symbol, or the word's end
    std::int32_t* prev = next + n0;      // [n0]: previous live symbol, or -1
    std::int32_t* pair_ids = prev + n0;  // [n0]: merge of (i, next[i]), or -1
    std::int32_t* heap = pair_ids + n0;  // [heap_size]: symbols with a mergeable pair
    std::int32_t* heap_pos = heap + n0;  // [n0]: where i sits in heap, or -1
    const auto n = static_cast<std::int32_t>(n0);
    std::int32_t end = n;  // the current word's end
    std::size_t heap_size = 0;

    auto score_of = [&](std::int32_t i) { return scores_[static_cast<std::size_t>(pair_ids[i])]; };
    // Whether symbol i's pair merges before symbol j's: run.c's strict `>` scan from the left.
    auto before = [&](std::int32_t i, std::int32_t j) {
      const float a = score_of(i);
      const float b = score_of(j);
      return a > b || (a == b && i < j);
    };
    auto place = [&](std::size_t at, std::int32_t i) {
      heap[at] = i;
      heap_pos[i] = static_cast<std::int32_t>(at);
    };
    auto sift_up = [&](std::size_t at) {
      const std::int32_t i = heap[at];
      while (at > 0 && before(i, heap[(at - 1) / 2])) {
        place(at, heap[(at - 1) / 2]);
        at = (at - 1) / 2;
      }
      place(at, i);
    };
    auto sift_down = [&](std::size_t at) {
      const std::int32_t i = heap[at];
      while (true) {
        std::size_t child = 2 * at + 1;
        if (child >= heap_size) break;
        if (child + 1 < heap_size && before(heap[child + 1], heap[child])) ++child;
        if (!before(heap[child], i)) break;
        place(at, heap[child]);
        at = child;
      }
      place(at, i);
    };
    auto remove = [&](std::int32_t i) {
      if (heap_pos[i] < 0) return;
      const auto at = static_cast<std::size_t>(heap_pos[i]);
      heap_pos[i] = -1;
      if (--heap_size == at) return;
      const std::int32_t moved = heap[heap_size];  // the last entry fills the hole
      place(at, moved);
      sift_up(at);
      sift_down(static_cast<std::size_t>(heap_pos[moved]));
    };
    // Looks up the pair (i, next[i]) again and moves i in, out of or within the heap.
    auto refresh = [&](std::int32_t i) {
      const std::int32_t j = next[i];
      pair_ids[i] = j == end ? -1 : lookup_pair(tokens[i], tokens[j]);
      // run.c: `vocab_scores[id] > best_score` with best_score = -1e10 (false for NaN).
      const bool mergeable = pair_ids[i] >= 0 && score_of(i) > -1e10f;
      if (!mergeable) {
        remove(i);
        return;
      }
      if (heap_pos[i] < 0) {
        place(heap_size++, i);
        sift_up(heap_size - 1);
      } else {
        const auto at = static_cast<std::size_t>(heap_pos[i]);
        sift_up(at);
        sift_down(static_cast<std::size_t>(heap_pos[i]));
      }
    };
    // Whether no merge can join symbol j - 1 to symbol j (their tokens as encode() made them).
    auto word_starts = [&](std::int32_t j) {
      const std::string_view left = piece_unchecked(tokens[j - 1]);
      const std::string_view right = piece_unchecked(tokens[j]);
      return !left.empty() && left.back() != ' ' && !right.empty() && right.front() == ' ';
    };

    std::size_t kept = 0;  // live symbols of the words done, compacted to tokens[0, kept)
    for (std::int32_t begin = 0; begin < n; begin = end) {
      end = begin + 1;
      if (splits_words_) {
        while (end < n && !word_starts(end)) ++end;
      } else {
        end = n;
      }
      for (std::int32_t i = begin; i < end; ++i) {
        next[i] = i + 1;
        prev[i] = i == begin ? -1 : i - 1;
        heap_pos[i] = -1;
      }
      for (std::int32_t i = begin; i < end; ++i) refresh(i);
      while (heap_size > 0) {
        const std::int32_t a = heap[0];  // merge (a, b) into a
        const std::int32_t b = next[a];
        tokens[a] = pair_ids[a];
        remove(b);
        next[a] = next[b];
        if (next[b] != end) prev[next[b]] = a;
        refresh(a);
        if (prev[a] >= 0) refresh(prev[a]);
      }
      // Live symbols in list order are in index order, and kept <= begin, so compacting in
      // place never overwrites a symbol not yet read.
      for (std::int32_t i = begin; i != end; i = next[i]) tokens[kept++] = tokens[i];
    }
    out.resize(kept);
  }

  // Pieces live in one string and are found through offsets (not views), so copies and moves
  // of a Tokenizer stay valid without fixing up pointers.
  std::string piece_bytes_;  // [sum of piece lengths]: every piece, in id order
  // [vocab_size + 1]: piece `id` is piece_bytes_[offsets_[id], offsets_[id + 1])
  std::vector<std::size_t> offsets_;
  std::vector<float> scores_;  // [vocab_size]: merge score per id
  struct PieceHash {
    std::uint64_t hash = 0;   // hash_of(piece)
    std::uint64_t power = 1;  // kHashBase^(piece length)
  };
  std::vector<PieceHash> piece_hashes_;  // [vocab_size]
  struct Slot {
    std::uint32_t tag = 0;  // tag_of() of the piece's mixed hash
    std::int32_t id = -1;   // the lowest id of the piece, or -1 for an empty slot
  };
  // [bit_ceil(2 * vocab_size)]: open addressing by first_slot(), linear probing
  std::vector<Slot> piece_table_;
  int slot_shift_ = 64;                       // 64 - log2(piece_table_.size())
  std::array<std::int32_t, 256> byte_ids_{};  // the lowest id of each one-byte piece, or -1
  bool splits_words_ = false;  // no piece holds "c " with c != ' ': words merge alone
  std::uint32_t max_token_length_ = 0;
  std::int32_t space_id_ = -1;  // id of " ", the dummy prefix
};

}  // namespace kvdecode
