// TextTokenizer: what a generator needs of a vocabulary (text to ids, an id back to its bytes),
// met by the SentencePiece Tokenizer and the byte-level BpeTokenizer alike, so code written
// against it runs either without virtual calls.
#pragma once

#include <concepts>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "kvdecode/text/bpe_tokenizer.hpp"
#include "kvdecode/text/tokenizer.hpp"

namespace kvdecode {

/// encode(text, bos, eos) and its form that reuses `out`; decode(prev, token) gives the token's
/// bytes, which may end inside a UTF-8 character (TextStream holds those back); find(piece) the
/// id whose bytes are exactly `piece`; vocab_size().
template <class T>
concept TextTokenizer = requires(const T& t, std::string_view text, std::int32_t id,
                                 std::vector<std::int32_t>& out) {
  { t.encode(text, true, false) } -> std::same_as<std::vector<std::int32_t>>;
  t.encode(text, true, false, out);
  { t.decode(id, id) } -> std::convertible_to<std::string_view>;
  { t.find(text) } -> std::same_as<std::optional<std::int32_t>>;
  { t.vocab_size() } -> std::convertible_to<std::int64_t>;
};

static_assert(TextTokenizer<Tokenizer>);
static_assert(TextTokenizer<BpeTokenizer>);

}  // namespace kvdecode
