// kvdecode::Error, the one exception type the library throws, and the check macro that builds
// its messages: what was checked, expected vs actual, the context, and the header's file:line.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace kvdecode {

/// Everything a caller or a file can get wrong is reported as an Error. The message names the
/// object and field, the rule, and the values seen. An operation that throws leaves every object
/// it was given as it was.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {

/// Streams every argument into one string; used only on the error path.
template <class... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

[[noreturn]] inline void throw_error(const char* file, int line, const std::string& message) {
  std::string where = file;
  const auto slash = where.find_last_of('/');
  if (slash != std::string::npos) where = where.substr(slash + 1);
  throw Error("kvdecode: " + message + " [" + where + ":" + std::to_string(line) + "]");
}

}  // namespace detail
}  // namespace kvdecode

/// KVDECODE_CHECK(cond, parts...): when cond is false, throws kvdecode::Error whose message is
/// the parts streamed together (say what was expected and what was seen), plus file:line.
#define KVDECODE_CHECK(cond, ...)                                               \
  do {                                                                          \
    if (!(cond)) [[unlikely]]                                                   \
      ::kvdecode::detail::throw_error(__FILE__, __LINE__,                       \
                                      ::kvdecode::detail::concat(__VA_ARGS__)); \
  } while (false)

/// KVDECODE_FAIL(parts...): throws unconditionally (for switch defaults and parse errors).
#define KVDECODE_FAIL(...) \
  ::kvdecode::detail::throw_error(__FILE__, __LINE__, ::kvdecode::detail::concat(__VA_ARGS__))
