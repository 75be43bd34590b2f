// load_client: the load benchmark's clients (tools/load_bench.py --client) in C++. N threads,
// each with its own HTTP client, send R streamed /v1/completions requests one after another (a
// shared system prompt, then a question of their own) and time them with steady_clock: TTFT is
// request sent (connection included) -> first event with non-empty text received, then the gaps
// between text events. Prints one JSON object on stdout: a record per request and the run's wall
// and CPU time. Measuring costs little next to the server's own work on the same cores, which
// the Python threads' per-line JSON parsing under one interpreter lock did not.
#include <httplib.h>
// <resolv.h>, which httplib.h includes, defines _res as a macro; Eigen names parameters _res.
#undef _res

#include <signal.h>
#include <sys/resource.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "cli.hpp"

#ifndef KVDECODE_VERSION
#define KVDECODE_VERSION "unknown"
#endif

namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

struct Options {
  std::string host = "127.0.0.1";
  int port = 0;
  std::size_t clients = 16;
  std::size_t requests = 2;
  std::size_t max_tokens = 64;
  bool vary_lengths = false;
  std::string system;  // a file holding the system prompt, "-" for stdin
  double timeout_s = 300;
  bool verbose = false;
};

void declare(CLI::App& app, Options& o) {
  using cli::number;
  app.description(
      "The load benchmark's clients: CLIENTS threads each send REQUESTS streamed "
      "/v1/completions requests in sequence (the system prompt, a newline, a question of their "
      "own; temperature 0.8, seed 1 + 100 * client + request), one connection per request. "
      "Prints one JSON object: per request its TTFT, the gaps between text events and the usage "
      "numbers of its last event (the engine's own TTFT among them).");
  app.footer(
      "Exit codes: 0 when every request was answered, 1 when one failed (the JSON lists the "
      "errors) or the system prompt cannot be read, 2 a bad command line.");
  app.add_option("--host", o.host, "the server's address")->capture_default_str();
  app.add_option("--port", o.port, "the server's TCP port")
      ->required()
      ->check(number<int>(1, 65535));
  app.add_option("--clients", o.clients, "concurrent clients, one thread each")
      ->check(number<std::size_t>(1, 4096))
      ->capture_default_str();
  app.add_option("--requests", o.requests, "requests per client, in sequence")
      ->check(number<std::size_t>(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--max-tokens", o.max_tokens, "max_tokens of every request")
      ->check(number<std::size_t>(1, 1 << 20))
      ->capture_default_str();
  app.add_flag("--vary-lengths", o.vary_lengths,
               "request r of client c asks for MAX/2 + (37c + 11r) mod MAX tokens instead (about "
               "MAX on average), so the clients do not all finish in the same step");
  app.add_option("--system", o.system,
                 "file holding the system prompt, taken exactly (a trailing newline included); "
                 "- reads standard input")
      ->required();
  app.add_option("--timeout", o.timeout_s, "seconds each read or connection may wait")
      ->check(number<double>(0, 86400, std::nullopt, true))
      ->capture_default_str();
  app.add_flag("--verbose", o.verbose, "errors name the library header and line");
}

// The questions of tools/load_bench.py (QUESTIONS), in its order.
constexpr std::array<std::string_view, 8> kQuestions = {
    "And the LORD said unto Moses",    "Then answered Peter and said",      "And David arose",
    "Now the serpent was more subtil", "And Jesus went up into a mountain", "Hear, O Israel",
    "In the beginning was the Word",   "And Abraham rose up early"};

/// What one request measured.
struct Record {
  std::size_t client = 0, request = 0;
  double ttft_ms = -1;          // request sent -> first non-empty text event; -1 = none came
  std::vector<double> gaps_ms;  // [text events - 1] between consecutive text events
  std::size_t text_events = 0;  // events with non-empty text
  std::optional<json> usage;    // the last event's "usage"
};

/// Reads one streamed response's server-sent events as they arrive. Only the events that need
/// it are parsed in full: an event's text is found by its key (keys are sorted by the server's
/// JSON writer and a quote inside a string value is escaped, so the first `"text":"` is the key),
/// and only an event carrying "usage" (the last) or an unexpected one goes to the JSON parser.
class EventReader {
 public:
  EventReader(Record& r, Clock::time_point sent) : r_(r), sent_(sent) {}

  /// Takes the next bytes of the body; false to abandon the response (an error, see error()).
  bool feed(const char* data, std::size_t n) {
    const Clock::time_point now = Clock::now();
    pending_.append(data, n);
    std::size_t start = 0;
    for (std::size_t end; (end = pending_.find('\n', start)) != std::string::npos;
         start = end + 1) {
      if (!line(std::string_view(pending_).substr(start, end - start), now)) return false;
    }
    pending_.erase(0, start);
    return true;
  }
  bool done() const { return done_; }
  const std::string& error() const { return error_; }

 private:
  bool line(std::string_view l, Clock::time_point now) {
    if (!l.empty() && l.back() == '\r') l.remove_suffix(1);
    constexpr std::string_view data = "data: ";
    if (!l.starts_with(data)) return true;  // the blank line between events
    l.remove_prefix(data.size());
    if (l == "[DONE]") {
      done_ = true;
      return true;
    }
    constexpr std::string_view text_key = "\"text\":\"";
    const std::size_t at = l.find(text_key);
    if (at != std::string_view::npos && l.find("\"usage\":") == std::string_view::npos) {
      const std::size_t begin = at + text_key.size();
      if (begin < l.size() && l[begin] != '"') text_event(now);
      return true;
    }
    json event = json::parse(l, nullptr, false);
    if (event.is_discarded() || !event.contains("choices")) {
      error_ = "an event that is not a completion chunk: " + std::string(l.substr(0, 200));
      return false;
    }
    const json& text = event["choices"][0]["text"];
    if (text.is_string() && !text.get_ref<const std::string&>().empty()) text_event(now);
    if (event.contains("usage")) r_.usage = std::move(event["usage"]);
    return true;
  }

  void text_event(Clock::time_point now) {
    if (r_.text_events == 0)
      r_.ttft_ms = std::chrono::duration<double, std::milli>(now - sent_).count();
    else
      r_.gaps_ms.push_back(std::chrono::duration<double, std::milli>(now - last_).count());
    last_ = now;
    ++r_.text_events;
  }

  Record& r_;
  Clock::time_point sent_, last_;
  std::string pending_;  // bytes received after the last complete line
  bool done_ = false;
  std::string error_;
};

/// The max_tokens of request r of client c (tools/load_bench.py's max_tokens_of).
std::size_t max_tokens_of(const Options& o, std::size_t c, std::size_t r) {
  return o.vary_lengths ? o.max_tokens / 2 + (37 * c + 11 * r) % o.max_tokens : o.max_tokens;
}

/// One streamed request; an empty string, or what went wrong.
std::string stream_one(const Options& o, const std::string& system, Record& r) {
  const std::string question = std::string(kQuestions[(r.client + r.request) % kQuestions.size()]) +
                               " (" + std::to_string(r.client) + "." + std::to_string(r.request) +
                               ")";
  const json body = {{"prompt", system + "\n" + question},
                     {"max_tokens", max_tokens_of(o, r.client, r.request)},
                     {"temperature", 0.8},
                     {"seed", 1 + r.client * 100 + r.request},
                     {"stop", json::array()},
                     {"stream", true}};
  // A client per request, as the Python client's one connection per request: the connection is
  // part of the time to first token.
  httplib::Client http(o.host, o.port);
  http.set_keep_alive(false);
  http.set_tcp_nodelay(true);  // the body is not held back waiting for the headers' ACK
  const auto timeout = std::chrono::duration<double>(o.timeout_s);
  http.set_connection_timeout(std::chrono::duration_cast<std::chrono::microseconds>(timeout));
  http.set_read_timeout(std::chrono::duration_cast<std::chrono::microseconds>(timeout));
  http.set_write_timeout(std::chrono::duration_cast<std::chrono::microseconds>(timeout));

  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  const Clock::time_point sent = Clock::now();
  EventReader reader(r, sent);
  std::string error_body;
  int status = 0;
  req.response_handler = [&](const httplib::Response& res) {
    status = res.status;
    return true;
  };
  req.content_receiver = [&](const char* data, std::size_t n, std::uint64_t, std::uint64_t) {
    if (status != 200) {
      error_body.append(data, n);
      return true;
    }
    return reader.feed(data, n);
  };
  const httplib::Result res = http.send(req);
  if (!reader.error().empty()) return reader.error();
  if (!res) return "HTTP: " + httplib::to_string(res.error());
  if (status != 200) return "HTTP status " + std::to_string(status) + ": " + error_body;
  if (!reader.done()) return "the stream ended without data: [DONE]";
  if (!r.usage) return "no event carried the usage";
  return {};
}

double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

std::string read_system(const std::string& name) {
  if (name == "-") {
    std::ostringstream text;
    text << std::cin.rdbuf();
    return text.str();
  }
  std::ifstream in(name, std::ios::binary);
  if (!in) throw kvdecode::Error("--system: cannot read '" + name + "'");
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

int run(const Options& o) {
  if (o.vary_lengths && o.max_tokens < 2)
    throw cli::UsageError{"--vary-lengths needs --max-tokens 2 or more, got " +
                          std::to_string(o.max_tokens)};
  const std::string system = read_system(o.system);
  std::vector<Record> records(o.clients * o.requests);  // [clients][requests]
  std::vector<std::string> errors(records.size());      // [clients][requests], "" = answered
  for (std::size_t c = 0; c < o.clients; ++c)
    for (std::size_t r = 0; r < o.requests; ++r) {
      records[c * o.requests + r].client = c;
      records[c * o.requests + r].request = r;
    }

  const double cpu0 = cpu_seconds();
  const Clock::time_point t0 = Clock::now();
  {
    std::vector<std::jthread> threads;
    threads.reserve(o.clients);
    for (std::size_t c = 0; c < o.clients; ++c)
      threads.emplace_back([&, c] {
        for (std::size_t r = 0; r < o.requests; ++r) {
          const std::size_t k = c * o.requests + r;
          try {
            errors[k] = stream_one(o, system, records[k]);
          } catch (const std::exception& e) {
            errors[k] = e.what();
          }
        }
      });
  }
  const double wall_s = std::chrono::duration<double>(Clock::now() - t0).count();
  const double cpu_s = cpu_seconds() - cpu0;

  json out_records = json::array(), out_errors = json::array();
  std::size_t tokens = 0;
  for (std::size_t k = 0; k < records.size(); ++k) {
    const Record& r = records[k];
    if (!errors[k].empty()) {
      out_errors.push_back("client " + std::to_string(r.client) + " request " +
                           std::to_string(r.request) + ": " + errors[k]);
      continue;
    }
    const json& u = *r.usage;
    tokens += u.value("completion_tokens", std::size_t{0});
    out_records.push_back(
        {{"client", r.client},
         {"request", r.request},
         {"max_tokens", max_tokens_of(o, r.client, r.request)},
         {"ttft_ms", r.ttft_ms >= 0 ? json(r.ttft_ms) : json(nullptr)},
         {"gaps_ms", r.gaps_ms},
         {"text_events", r.text_events},
         {"completion_tokens", u.value("completion_tokens", std::size_t{0})},
         {"prompt_tokens", u.value("prompt_tokens", std::size_t{0})},
         {"cached_tokens",
          u.value(json::json_pointer("/prompt_tokens_details/cached_tokens"), std::size_t{0})},
         // The engine's own time (submission -> first token): the rest of ttft_ms is the
         // connection, the HTTP handling, the tokenizer and the event's way back.
         {"engine_ttft_ms", u.value("ttft_ms", 0.0)}});
  }
  const json out = {{"client", "load_client"},
                    {"clients", o.clients},
                    {"requests_per_client", o.requests},
                    {"max_tokens", o.max_tokens},
                    {"vary_lengths", o.vary_lengths},
                    {"wall_s", wall_s},
                    {"cpu_s", cpu_s},
                    {"completion_tokens", tokens},
                    {"requests", out_records},
                    {"errors", out_errors}};
  // An error may quote a cut UTF-8 sequence: replaced, not thrown on.
  std::printf("%s\n", out.dump(-1, ' ', false, json::error_handler_t::replace).c_str());
  std::fflush(stdout);
  if (out_errors.empty()) return 0;
  std::fprintf(stderr, "load_client: %zu of %zu requests failed, the first: %s\n",
               out_errors.size(), records.size(), out_errors[0].get<std::string>().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  ::signal(SIGPIPE, SIG_IGN);  // a server that went away fails the write, not the process
  Options o;
  CLI::App app{"", "load_client"};
  cli::configure(app, KVDECODE_VERSION);
  declare(app, o);
  return cli::run_main(app, argc, argv, o.verbose, [&] { return run(o); });
}
