// TextStream: what a generator may print so far, with UTF-8 characters split over byte tokens
// held until whole and text ended before a stop string.
#include "kvdecode/text/text_stream.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace kvdecode {
namespace {

// The bytes of U+1F600 (😀) and U+4E2D (中) one token each, as byte-fallback tokens come.
TEST(TextStreamTest, HoldsAUtf8CharacterUntilItsLastByte) {
  TextStream t;
  std::string shown;
  const std::string emoji = "\xF0\x9F\x98\x80", cjk = "\xE4\xB8\xAD";
  for (const char c : emoji.substr(0, 3)) EXPECT_EQ(t.push(std::string(1, c)), "");
  EXPECT_EQ(t.push(emoji.substr(3)), emoji);
  EXPECT_EQ(t.push("a" + cjk.substr(0, 1)), "a");
  EXPECT_EQ(t.push(cjk.substr(1)), cjk);
  // Bytes that are not UTF-8 (a lone continuation byte) are shown as they come.
  EXPECT_EQ(t.push("\x80"), "\x80");
  // An incomplete character at the end comes out on flush.
  EXPECT_EQ(t.push("\xE4"), "");
  EXPECT_EQ(t.flush(), "\xE4");
  EXPECT_EQ(TextStream::incomplete_utf8_tail("x\xF0\x9F"), 2u);
  EXPECT_EQ(TextStream::incomplete_utf8_tail("x\xC3\xA9"), 0u);
}

TEST(TextStreamTest, EndsBeforeAStopStringSplitOverPieces) {
  TextStream t({"\n\n", "The End"});
  std::string shown;
  for (const char* piece : {"Once", " upon", " a time. The", " E", "nd of it"})
    shown += t.push(piece);
  EXPECT_EQ(shown, "Once upon a time. ");
  EXPECT_TRUE(t.stopped());
  EXPECT_EQ(t.stop_string(), "The End");
  EXPECT_EQ(t.push("more"), "");
  // A prefix that does not complete is shown once it cannot match any more.
  TextStream u({"abc"});
  EXPECT_EQ(u.push("xab"), "x");
  EXPECT_EQ(u.push("d"), "abd");
  EXPECT_FALSE(u.stopped());
  EXPECT_EQ(u.push("ab"), "");
  EXPECT_EQ(u.flush(), "ab");
}

}  // namespace
}  // namespace kvdecode
