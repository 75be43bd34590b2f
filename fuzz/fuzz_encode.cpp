// libFuzzer target: arbitrary bytes as text for Tokenizer::encode with the llama2c-tiny fixture's
// 512-piece vocabulary (all 256 byte-fallback ids present). Checks that every id is in range,
// that the out-parameter overload gives the same ids, and that decoding the ids after BOS gives
// back the text (run.c's decode rules: the dummy prefix's space is dropped after BOS).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_util.hpp"
#include "kvdecode/text/tokenizer.hpp"

#ifndef KVDECODE_FUZZ_TOKENIZER
#error "define KVDECODE_FUZZ_TOKENIZER as the path of the fixture tokenizer.bin"
#endif

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace kf = kvdecode::fuzz;
  static const kvdecode::Tokenizer tokenizer =
      kvdecode::Tokenizer::load(KVDECODE_FUZZ_TOKENIZER, 512);
  static std::vector<std::int32_t> reused;  // the allocation-free overload, reused across runs
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const std::vector<std::int32_t> ids = tokenizer.encode(text, true, false);
  kf::require(!ids.empty() && ids[0] == kvdecode::Tokenizer::kBos, "starts with BOS");
  kf::require(ids.size() <= text.size() + 2, "at most one id per byte plus BOS and the prefix");
  for (const std::int32_t id : ids) kf::require(id >= 0 && id < 512, "ids in range");
  tokenizer.encode(text, true, false, reused);
  kf::require(reused == ids, "both overloads agree");
  // A byte piece "<0xNN>" can also be formed by merging the text's own '<', '0', 'x' ...; decode
  // then yields the byte, not the text, so the round trip holds only for text without '<'.
  if (text.find('<') == std::string_view::npos) {
    std::string back;
    for (std::size_t i = 1; i < ids.size(); ++i) back += tokenizer.decode(ids[i - 1], ids[i]);
    kf::require(back == text, "decode(encode(text)) == text");
  }
  return 0;
}
