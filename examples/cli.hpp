// Command-line handling the example programs share, on CLI11: each flag is declared once (names,
// default, help, validation) and --help is generated from those declarations. Adds strict number
// validators (CLI11 2.1 wraps "-2" into a huge unsigned value and takes "nan"), a usage error
// for checks that need the loaded model, and main()'s exit-code and message rules.
#pragma once

#include <CLI/CLI.hpp>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <exception>
#include <kvdecode/error.hpp>
#include <kvdecode/store/low_bit_store.hpp>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

namespace cli {

/// A bad command line found after parsing (a flag the loaded model cannot honour): main()
/// prints the message and exits with code 2, as for a parse error.
struct UsageError {
  std::string message;
};

/// The whole of `text` as an N (no sign for an unsigned N, no trailing characters, finite for
/// a floating-point N), or nothing.
template <class N>
bool parse_number(std::string_view text, N& value) {
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size()) return false;
  if constexpr (std::is_floating_point_v<N>) return std::isfinite(value);
  return true;
}

template <class N>
std::string to_text(N v) {
  if constexpr (std::is_floating_point_v<N>) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", static_cast<double>(v));
    return buf;
  } else {
    return std::to_string(v);
  }
}

/// Accepts a number of type N in [lo, hi] (or exactly `special`, when given: -1 for "no limit"
/// or "random"). The message names the range and the text, and CLI11 puts the flag before it.
/// With open_lo, lo itself is refused: (lo, hi].
template <class N>
CLI::Validator number(N lo, N hi, std::optional<N> special = std::nullopt, bool open_lo = false) {
  std::string range = (open_lo ? "(" : "[") + to_text(lo) + ", " + to_text(hi) + "]";
  if (special) range = to_text(*special) + " or " + range;
  const std::string name = std::is_floating_point_v<N> ? "a finite number" : "an integer";
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        N v{};
        if (!parse_number(text, v))
          return "expects " + name + " in " + range + ", got '" + text + "'";
        if (special && v == *special) return {};
        if (!(v >= lo && v <= hi) || (open_lo && v == lo))
          return "expects " + name + " in " + range + ", got " + text;
        return {};
      },
      "in " + range);
}

/// An option that names one of a few values, stored as the enum E they map to. A wrong name
/// gives "expects a, b or c, got 'x'".
template <class E>
CLI::Option* choice(CLI::App& app, const std::string& names, E& target,
                    std::vector<std::pair<std::string, E>> choices, const std::string& help) {
  std::string list, type, default_name;
  for (std::size_t i = 0; i < choices.size(); ++i) {
    list += (i == 0 ? "" : i + 1 == choices.size() ? " or " : ", ") + choices[i].first;
    type += (i == 0 ? "" : "|") + choices[i].first;
    if (choices[i].second == target) default_name = choices[i].first;
  }
  return app
      .add_option_function<std::string>(
          names,
          [&target, choices](const std::string& v) {
            for (const auto& [name, e] : choices)
              if (name == v) target = e;
          },
          help)
      ->check(CLI::Validator(
          [choices, list](std::string& v) -> std::string {
            for (const auto& c : choices)
              if (c.first == v) return {};
            return "expects " + list + ", got '" + v + "'";
          },
          ""))
      ->type_name(type)
      ->default_str(default_name);
}

/// The 2- and 4-bit stores' settings (--kv q4 or q2), declared once for every program that
/// offers those stores; the defaults are the store's own.
struct LowBitFlags {
  std::size_t group = kvdecode::Q4Store<float>::kDefaultGroup;
  std::size_t residual = kvdecode::Q4Store<float>::kDefaultResidual;
  bool rotate = false;

  void declare(CLI::App& app, const std::string& group_name) {
    app.add_option("--kv-group", group,
                   "with --kv q4 or q2: positions per key group (per-channel key ranges)")
        ->check(number<std::size_t>(2, 4096))
        ->capture_default_str()
        ->group(group_name);
    app.add_option("--kv-residual", residual,
                   "with --kv q4 or q2: newest positions kept exact in f32, a multiple of "
                   "--kv-group (0 for none)")
        ->check(number<std::size_t>(0, std::size_t{1} << 20))
        ->capture_default_str()
        ->group(group_name);
    app.add_flag("--kv-rotate", rotate,
                 "with --kv q4 or q2: quantize rows Hadamard-rotated (spreads outlier channels)")
        ->group(group_name);
  }
  /// A usage message when the residual is not a multiple of the group, else empty.
  std::string check() const {
    if (residual % group == 0) return {};
    return "--kv-residual " + std::to_string(residual) + " is not a multiple of --kv-group " +
           std::to_string(group);
  }
  /// Sets a store's options that hold a group, a residual and a rotation.
  template <class O>
  void apply(O& o) const {
    o.group = group;
    o.residual = residual;
    o.rotate = rotate;
  }
};

/// An option that names a mode alone or with a count: "name" sets `count` to `fallback`,
/// "name:N" to N in [lo, hi]. Anything else gives "expects name or name:N with N in [lo, hi],
/// got 'x'".
inline CLI::Option* name_with_count(CLI::App& app, const std::string& names,
                                    const std::string& name, std::size_t& count,
                                    std::size_t fallback, std::size_t lo, std::size_t hi,
                                    const std::string& help) {
  const std::string prefix = name + ":";
  const auto parse = [=](std::string_view v, std::size_t& n) {
    if (v == name) {
      n = fallback;
      return true;
    }
    return v.starts_with(prefix) && parse_number(v.substr(prefix.size()), n) && n >= lo && n <= hi;
  };
  const std::string expects = "expects " + name + " or " + prefix + "N with N in [" + to_text(lo) +
                              ", " + to_text(hi) + "], got '";
  return app
      .add_option_function<std::string>(
          names, [&count, parse](const std::string& v) { parse(v, count); }, help)
      ->check(CLI::Validator(
          [parse, expects](std::string& v) -> std::string {
            std::size_t n = 0;
            return parse(v, n) ? std::string() : expects + v + "'";
          },
          ""))
      ->type_name(name + "[:N]");
}

/// An App with the examples' conventions: the last of a repeated flag wins (as in llama.cpp),
/// --flag=value works, --help and --version are generated.
inline void configure(CLI::App& app, const char* version) {
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.set_version_flag("--version", version);
  app.get_formatter()->column_width(30);
}

/// A kvdecode::Error's message for a person: without the "kvdecode: " prefix and the header's
/// " [file.hpp:NNN]" suffix (kept with --verbose, for a debugger).
inline std::string for_a_person(std::string message) {
  constexpr std::string_view prefix = "kvdecode: ";
  if (message.starts_with(prefix)) message.erase(0, prefix.size());
  // Every " [name.hpp:123]", wherever a caller's context put it.
  for (std::size_t at = message.find(" ["); at != std::string::npos; at = message.find(" [", at)) {
    const std::size_t close = message.find(']', at);
    const std::size_t hpp = message.find(".hpp:", at);
    if (close != std::string::npos && hpp < close &&
        message.find_first_not_of("0123456789", hpp + 5) == close)
      message.erase(at, close + 1 - at);
    else
      at += 2;
  }
  return message;
}

/// Parses argv into `app`'s variables, then runs body() with the examples' exit codes: its
/// return value; 0 after --help or --version; 2 after a parse error or a UsageError (thrown
/// later, e.g. a flag the loaded model cannot honour); 1 after any other error. An error is one
/// line on stderr, "<program>: <message>", which a script can match.
template <class Body>
int run_main(CLI::App& app, int argc, char** argv, const bool& verbose, Body&& body) {
  const std::string program = app.get_name();
  try {
    try {
      app.parse(argc, argv);
    } catch (const CLI::CallForHelp&) {
      std::fputs(app.help().c_str(), stdout);
      return 0;
    } catch (const CLI::CallForVersion& e) {
      std::printf("%s %s\n", program.c_str(), e.what());
      return 0;
    } catch (const CLI::ParseError& e) {
      throw UsageError{e.what()};
    }
    return body();
  } catch (const UsageError& e) {
    std::fprintf(stderr, "%s: %s (see %s --help)\n", program.c_str(), e.message.c_str(),
                 program.c_str());
    return 2;
  } catch (const kvdecode::Error& e) {
    std::fprintf(stderr, "%s: %s\n", program.c_str(),
                 verbose ? e.what() : for_a_person(e.what()).c_str());
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "%s: out of memory\n", program.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", program.c_str(), e.what());
  }
  return 1;
}

}  // namespace cli
