// TextStream: what a generator may print of its text so far. Holds back the bytes of a UTF-8
// character whose tokens have not all come (byte-fallback tokens split one character over
// several tokens, as llama.cpp holds them) and the start of a possible stop string, and ends
// the text before the first stop string.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvdecode {

class TextStream {
 public:
  TextStream() = default;
  /// Stop strings: the text ends just before the first occurrence of any of them. Empty strings
  /// are ignored.
  explicit TextStream(std::vector<std::string> stop) : stop_(std::move(stop)) {
    std::erase_if(stop_, [](const std::string& s) { return s.empty(); });
  }

  /// Appends a piece of text and returns what may now be shown: everything except an
  /// incomplete UTF-8 character at the end and a suffix that could start a stop string. After a
  /// stop string, returns the text before it, then nothing. The view lives until the next call.
  std::string_view push(std::string_view piece) {
    out_.clear();
    if (stopped_) return out_;
    held_ += piece;
    std::size_t keep = 0;
    for (const std::string& s : stop_) {
      if (const std::size_t at = held_.find(s); at != std::string::npos) {
        out_.assign(held_, 0, at);
        held_.clear();
        stopped_ = true;
        stop_string_ = s;
        return out_;
      }
      keep = std::max(keep, partial_match(held_, s));
    }
    keep = std::max(keep, incomplete_utf8_tail(held_));
    out_.assign(held_, 0, held_.size() - keep);
    held_.erase(0, held_.size() - keep);
    return out_;
  }

  /// Everything still held (the text has ended): an incomplete character or the start of a
  /// stop string that never completed.
  std::string_view flush() {
    out_ = std::exchange(held_, {});
    return out_;
  }

  /// Whether a stop string has ended the text, and which.
  bool stopped() const { return stopped_; }
  const std::string& stop_string() const { return stop_string_; }

  /// Bytes at the end of `text` that begin a UTF-8 character whose remaining bytes have not come:
  /// a lead byte announcing n bytes followed by fewer than n - 1 continuation bytes. 0 when the
  /// text ends on a whole character or on bytes that are not UTF-8 (those are shown as they are).
  static std::size_t incomplete_utf8_tail(std::string_view text) {
    const std::size_t n = text.size();
    for (std::size_t back = 1; back <= std::min<std::size_t>(3, n); ++back) {
      const auto c = static_cast<unsigned char>(text[n - back]);
      if ((c & 0xC0) == 0x80) continue;  // a continuation byte: look further back
      const std::size_t length = (c & 0xE0) == 0xC0   ? 2
                                 : (c & 0xF0) == 0xE0 ? 3
                                 : (c & 0xF8) == 0xF0 ? 4
                                                      : 1;
      return length > back ? back : 0;
    }
    return 0;
  }

 private:
  // The longest proper prefix of `stop` that `text` ends with.
  static std::size_t partial_match(std::string_view text, std::string_view stop) {
    for (std::size_t k = std::min(text.size(), stop.size() - 1); k > 0; --k)
      if (text.substr(text.size() - k) == stop.substr(0, k)) return k;
    return 0;
  }

  std::vector<std::string> stop_;
  std::string held_;  // text not shown yet
  std::string out_;   // what the last call returned
  bool stopped_ = false;
  std::string stop_string_;
};

}  // namespace kvdecode
