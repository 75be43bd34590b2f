// Command-line parsing the example programs share: a usage error (exit code 2), strict number
// parsing, a walk over argv that hands each flag its value, and main()'s exit-code rules.
#pragma once

#include <charconv>
#include <cstddef>
#include <cstdio>
#include <exception>
#include <initializer_list>
#include <kvdecode/error.hpp>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

namespace cli {

/// A bad command line: main() prints the message and the usage text and exits with code 2.
struct UsageError {
  std::string message;
};

/// The whole of `text` as a number of type N, or UsageError naming the flag. Negative text for
/// an unsigned N, trailing characters and out-of-range values are all refused.
template <class N>
N parse_number(std::string_view flag, std::string_view text) {
  N value{};
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size())
    throw UsageError{std::string(flag) + " expects a number, got '" + std::string(text) + "'"};
  return value;
}

/// Walks argv one flag at a time:
///
///   for (cli::Args args(argc, argv); args.next();) {
///     if (args.flag() == "-n") o.n = args.number<std::size_t>();
///     else if (args.flag() == "--stats") o.stats = true;
///     else args.unknown();
///   }
class Args {
 public:
  Args(int argc, char** argv) : argc_(argc), argv_(argv) {}

  /// Moves to the next argument; false when there is none left.
  bool next() {
    if (i_ + 1 >= argc_) return false;
    flag_ = argv_[++i_];
    return true;
  }
  std::string_view flag() const { return flag_; }
  /// The argument after the flag (consumed), or UsageError "<flag> needs a value".
  std::string_view value() {
    if (i_ + 1 >= argc_) throw UsageError{std::string(flag_) + " needs a value"};
    return argv_[++i_];
  }
  /// value() parsed by parse_number.
  template <class N>
  N number() {
    const std::string_view v = value();
    return parse_number<N>(flag_, v);
  }
  /// value() as one of the named choices, or UsageError "<flag> expects a, b or c, got 'x'".
  template <class E>
  E choice(std::initializer_list<std::pair<std::string_view, E>> choices) {
    const std::string_view v = value();
    std::string names;
    std::size_t i = 0;
    for (const auto& [name, e] : choices) {
      if (name == v) return e;
      names += (i == 0 ? "" : i + 1 == choices.size() ? " or " : ", ") + std::string(name);
      ++i;
    }
    throw UsageError{std::string(flag_) + " expects " + names + ", got '" + std::string(v) + "'"};
  }
  [[noreturn]] void unknown() const {
    throw UsageError{"unknown argument '" + std::string(flag_) + "'"};
  }

 private:
  int argc_;
  char** argv_;
  int i_ = 0;  // argv_[0] is the program
  std::string_view flag_;
};

/// Runs body() with the examples' exit codes: its return value; 2 after a UsageError (thrown
/// while parsing or later, e.g. a flag the loaded model cannot honour); 1 after any other
/// error. Either way stderr gets one line, "<program>: <message>", which a script can match.
template <class Body>
int run_main(const char* program, Body&& body) {
  try {
    return body();
  } catch (const UsageError& e) {
    std::fprintf(stderr, "%s: %s (see %s --help)\n", program, e.message.c_str(), program);
    return 2;
  } catch (const kvdecode::Error& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", program, e.what());
  }
  return 1;
}

}  // namespace cli
