// libFuzzer target: arbitrary bytes as a tokenizer.bin file. The first two bytes pick the
// vocab_size (which a real caller takes from the checkpoint header), the rest is the file.
// from_memory must throw kvdecode::Error or build a tokenizer that round-trips through
// to_bytes(), answers piece/score/decode for every id and encodes its own pieces.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "fuzz_util.hpp"
#include "kvdecode/text/tokenizer.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace kf = kvdecode::fuzz;
  if (size < 2) return 0;
  const std::int64_t vocab_size = data[0] | (data[1] << 8);  // 0..65535: invalid ones too
  const std::span<const std::byte> file(reinterpret_cast<const std::byte*>(data + 2), size - 2);
  try {
    const kvdecode::Tokenizer t = kvdecode::Tokenizer::from_memory(file, vocab_size, "fuzz");
    kf::require(t.vocab_size() == vocab_size, "vocab_size as given");
    const std::vector<std::byte> bytes = t.to_bytes();
    kf::require(bytes.size() <= file.size(), "to_bytes() is no longer than the file");
    kf::require(std::equal(bytes.begin(), bytes.end(), file.begin()),
                "to_bytes() is a prefix of the file");
    const kvdecode::Tokenizer again = kvdecode::Tokenizer::from_memory(bytes, vocab_size);
    kf::require(again.to_bytes() == bytes, "to_bytes() round-trips");
    std::string text;
    for (std::int32_t id = 0; id < vocab_size; ++id) {
      const std::string_view p = t.piece(id);
      kf::require(p.size() <= t.max_token_length(), "pieces fit max_token_length");
      (void)t.score(id);
      (void)t.decode(kvdecode::Tokenizer::kBos, id);
      (void)kvdecode::Tokenizer::printed_text(t.decode(id, id));
      if (text.size() < 256) text += p;  // short texts keep executions fast
    }
    // The vocabulary's own bytes as text: merges over this vocabulary's scores, byte fallback
    // (or its Error when the vocabulary has no id for a byte).
    try {
      const std::vector<std::int32_t> ids = t.encode(text, true, true);
      for (const std::int32_t id : ids) kf::require(id >= 0 && id < vocab_size, "ids in range");
    } catch (const kvdecode::Error&) {
    }
  } catch (const kvdecode::Error&) {
  }
  return 0;
}
