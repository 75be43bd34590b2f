// GPT-2's byte characters written out from the rule in test code, the independent side the
// byte-level BPE tests compare kGpt2ByteChars and vocabularies with.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace kvdecode::testing_util {

/// GPT-2's byte characters (bytes_to_unicode()) written out from the rule, independently of the
/// library's table: bytes '!'..'~', 0xA1..0xAC and 0xAE..0xFF stand for themselves, the other 68
/// for U+0100.. in byte order; [256] UTF-8 strings.
inline const std::vector<std::string>& gpt2_byte_characters() {
  static const std::vector<std::string> table = [] {
    std::vector<std::string> t(256);
    int next = 0x100;
    for (int c = 0; c < 256; ++c) {
      const bool keep = (c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || c >= 0xAE;
      const int cp = keep ? c : next++;
      std::string s;
      if (cp < 0x80) {
        s += static_cast<char>(cp);
      } else {
        s += static_cast<char>(0xC0 | (cp >> 6));
        s += static_cast<char>(0x80 | (cp & 0x3F));
      }
      t[static_cast<std::size_t>(c)] = s;
    }
    return t;
  }();
  return table;
}

}  // namespace kvdecode::testing_util
