// server: an OpenAI-compatible HTTP server over kvdecode's serving Engine. POST
// /v1/completions and /v1/chat/completions (a one-verse-per-turn chat template for the bundled
// KJV model; a llama2.c checkpoint or a GGUF file of either vocabulary kind), streamed as
// server-sent events when "stream" is true; GET /health and /metrics. Requests from every
// connection share one paged KV pool and its prefix cache, so a shared system prompt or an earlier
// turn of a conversation is computed once; with --prefix-dir the prefix cache is kept on disk too,
// so a restarted server reuses it. Listens on 127.0.0.1 unless told otherwise. `server --help`
// lists the flags.
#include <httplib.h>
// <resolv.h>, which httplib.h includes, defines _res as a macro; Eigen names parameters _res.
#undef _res

#include <signal.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <deque>
#include <filesystem>
#include <kvdecode/kvdecode.hpp>
#include <kvdecode/serving/engine.hpp>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "cli.hpp"
#include "weight_choice.hpp"

#ifndef KVDECODE_VERSION
#define KVDECODE_VERSION "unknown"
#endif
#ifndef KVDECODE_DEFAULT_MODEL_DIR  // set by examples/CMakeLists.txt to the repository's models/
#define KVDECODE_DEFAULT_MODEL_DIR "models"
#endif

namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

struct Options {
  std::string model;  // "" = the bundled KJV model
  std::string tokenizer;
  cli::WeightType weights = cli::WeightType::kStored;
  std::string host = "127.0.0.1";
  int port = 8080;
  std::size_t blocks = 1024;
  std::size_t block_size = 16;
  std::size_t max_running = 16;
  std::size_t step_tokens = 256;
  std::size_t threads = 2;
  std::size_t http_threads = 64;
  std::size_t max_body_bytes = 1 << 20;
  bool no_prefix_cache = false;
  bool no_sub_passes = false;
  std::string prefix_dir;  // "" = the prefix cache is in memory only
  std::uint64_t prefix_max_bytes = std::uint64_t{1} << 30;
  bool prefix_max_bytes_given = false;
  bool verbose = false;
};

void declare(CLI::App& app, Options& o) {
  using cli::number;
  app.description(
      "OpenAI-compatible HTTP server over the serving engine: POST /v1/completions and "
      "/v1/chat/completions (\"stream\": true for server-sent events), GET /v1/models, /health "
      "and /metrics. Prints 'listening on http://HOST:PORT' once it accepts connections.");
  app.footer(
      "Exit codes: 0 after SIGINT or SIGTERM, 1 an error (a missing model, a port in use), 2 a "
      "bad command line.");
  app.add_option("-m,--model", o.model,
                 "llama2.c checkpoint or GGUF file of the llama architecture (default: the "
                 "bundled models/kjv_tiny.bin)");
  app.add_option("--tokenizer", o.tokenizer,
                 "tokenizer.bin (default: the GGUF file's vocabulary, or tokenizer.bin beside "
                 "the model); refused for a GGUF file with a gpt2 (byte-level BPE) vocabulary");
  cli::weights_option(app, o.weights);
  app.add_option("--host", o.host, "address to bind; 0.0.0.0 exposes the server to the network")
      ->capture_default_str();
  app.add_option("--port", o.port, "TCP port; 0 picks a free one (printed)")
      ->check(number<int>(0, 65535))
      ->capture_default_str();
  app.add_option("--blocks", o.blocks, "KV blocks in the pool")
      ->check(number<std::size_t>(1, std::size_t{1} << 20))
      ->capture_default_str();
  app.add_option("--block-size", o.block_size, "positions per KV block")
      ->check(number<std::size_t>(1, 4096))
      ->capture_default_str();
  app.add_option("--max-running", o.max_running, "sequences decoded together in one step")
      ->check(number<std::size_t>(1, 1024))
      ->capture_default_str();
  app.add_option("--step-tokens", o.step_tokens,
                 "tokens per step: one per decoding sequence, the rest prefill chunks")
      ->check(number<std::size_t>(1, 65536))
      ->capture_default_str();
  app.add_option("-t,--threads", o.threads, "threads of each engine step")
      ->check(number<std::size_t>(1, 1024))
      ->capture_default_str();
  app.add_option("--http-threads", o.http_threads,
                 "connections served at once (a streaming request holds one)")
      ->check(number<std::size_t>(1, 4096))
      ->capture_default_str();
  app.add_option("--max-body-bytes", o.max_body_bytes, "largest request body accepted")
      ->check(number<std::size_t>(16, std::size_t{1} << 30))
      ->capture_default_str();
  app.add_flag("--no-prefix-cache", o.no_prefix_cache, "compute every prompt in full");
  app.add_flag("--no-sub-passes", o.no_sub_passes,
               "run each step as one pass (no early first tokens for prompts completing early)");
  app.add_option("--prefix-dir", o.prefix_dir,
                 "keep the prefix cache's blocks in files in DIR too (created if needed): blocks "
                 "evicted from memory, and every cached block at shutdown; a restarted server "
                 "loads a prompt's blocks from there");
  app.add_option("--prefix-max-bytes", o.prefix_max_bytes,
                 "the most bytes of block files kept in --prefix-dir (least recently used go "
                 "first); at least one block file")
      ->check(number<std::uint64_t>(1, std::uint64_t{1} << 50))
      ->capture_default_str();
  app.add_flag("--verbose", o.verbose, "errors name the library header and line");
}

// ---------------------------------------------------------------------------------------------
// Requests: parsing and validation. Every problem is a BadRequest, answered 400 with its text.

struct BadRequest {
  std::string message;
};

constexpr std::uint64_t kMaxCount = std::uint64_t{1} << 31;  // bound of every count field
constexpr std::int64_t kMaxSeed = std::int64_t{1} << 53;     // |seed| bound: exact in doubles

/// A number field of `body`, absent or null → fallback; wrong type or range → BadRequest. The
/// range is [lo, hi], or (lo, hi] with open_lo.
double number_field(const json& body, const char* name, double fallback, double lo, double hi,
                    bool open_lo = false) {
  if (!body.contains(name) || body[name].is_null()) return fallback;
  if (!body[name].is_number())
    throw BadRequest{std::string("'") + name + "' must be a number, got " + body[name].dump()};
  const double v = body[name].get<double>();
  if (!((open_lo ? v > lo : v >= lo) && v <= hi))
    throw BadRequest{std::string("'") + name + "' must be in " + (open_lo ? "(" : "[") +
                     cli::to_text(lo) + ", " + cli::to_text(hi) + "], got " + body[name].dump()};
  return v;
}

/// An integer field (a JSON number with no fraction) in [lo, hi]; none when absent or null,
/// BadRequest when of another type or out of range.
std::optional<std::int64_t> integer_value(const json& body, const char* name, std::int64_t lo,
                                          std::int64_t hi) {
  if (!body.contains(name) || body[name].is_null()) return std::nullopt;
  const json& v = body[name];
  const auto range = [&] {
    return BadRequest{std::string("'") + name + "' must be an integer in [" + std::to_string(lo) +
                      ", " + std::to_string(hi) + "], got " + v.dump()};
  };
  if (v.is_number_unsigned()) {
    const auto u = v.get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(hi) || static_cast<std::int64_t>(u) < lo) throw range();
    return static_cast<std::int64_t>(u);
  }
  if (v.is_number_integer()) {
    const auto i = v.get<std::int64_t>();
    if (i < lo || i > hi) throw range();
    return i;
  }
  if (!v.is_number_float()) throw range();
  const double d = v.get<double>();
  if (!(d == std::floor(d) && d >= static_cast<double>(lo) && d <= static_cast<double>(hi)))
    throw range();
  return static_cast<std::int64_t>(d);
}

/// A count field in [lo, hi] (both at most kMaxCount), absent or null → fallback.
std::uint64_t integer_field(const json& body, const char* name, std::uint64_t fallback,
                            std::uint64_t lo, std::uint64_t hi) {
  const auto v =
      integer_value(body, name, static_cast<std::int64_t>(lo), static_cast<std::int64_t>(hi));
  return v ? static_cast<std::uint64_t>(*v) : fallback;
}

/// The xorshift64* state a request's seed samples with. A positive seed is the state itself, as
/// the generator's --seed; 0 (which would freeze the generator) and negative seeds take the
/// states above kMaxSeed, so no two seeds share a state.
std::uint64_t seed_state(std::int64_t seed) {
  return seed > 0 ? static_cast<std::uint64_t>(seed)
                  : static_cast<std::uint64_t>(kMaxSeed) + 1 + static_cast<std::uint64_t>(-seed);
}

// What the server does with each request field: it honours it, or accepts it only at the value
// that leaves it off, or refuses it with 400 naming it, so that no option a client sets is
// silently ignored. "model" and "user" are read and not used: one model is served, and every
// answer's "model" names it.

/// The fields an endpoint honours (the chat endpoint reads "messages" instead of "prompt" and
/// also "max_completion_tokens", OpenAI's newer name of "max_tokens").
constexpr std::array<std::string_view, 14> kSamplingFields = {
    "max_tokens",    "temperature", "top_p", "top_k",  "min_p",          "repeat_penalty",
    "repeat_last_n", "seed",        "stop",  "stream", "stream_options", "n",
    "model",         "user"};

/// A field accepted only at the value that turns it off (or null).
struct OffOnly {
  std::string_view name;
  std::string_view off;   // the accepted value, as the message shows it
  std::string_view hint;  // what to use instead, or ""
  bool (*is_off)(const json&);
  bool chat, completions;  // the endpoints that know it
};
bool is_zero(const json& v) { return v.is_number() && v.get<double>() == 0; }
bool is_one(const json& v) { return v.is_number() && v.get<double>() == 1; }
bool is_false(const json& v) { return v.is_boolean() && !v.get<bool>(); }
bool is_empty(const json& v) {  // json::empty() is false for every string
  return v.is_string() ? v.get_ref<const std::string&>().empty()
                       : (v.is_object() || v.is_array()) && v.empty();
}
bool is_none(const json& v) { return v == "none"; }
bool is_text_format(const json& v) { return v == json{{"type", "text"}}; }
constexpr std::string_view kPenaltyHint = "this server's penalty is 'repeat_penalty'";
const std::array<OffOnly, 12> kOffOnly = {{
    {"best_of", "1", "", is_one, false, true},
    {"echo", "false", "", is_false, false, true},
    {"suffix", "\"\"", "", is_empty, false, true},
    {"logprobs", "false", "", is_false, true, true},
    {"top_logprobs", "0", "", is_zero, true, false},
    {"presence_penalty", "0", kPenaltyHint, is_zero, true, true},
    {"frequency_penalty", "0", kPenaltyHint, is_zero, true, true},
    {"logit_bias", "{}", "", is_empty, true, true},
    {"tools", "[]", "", is_empty, true, false},
    {"tool_choice", "\"none\"", "", is_none, true, false},
    {"response_format", "{\"type\": \"text\"}", "", is_text_format, true, false},
    {"parallel_tool_calls", "false", "", is_false, true, false},
}};

/// Refuses a field the endpoint does not know, and one it knows only switched off at another
/// value; checks the types of the fields that are read and not used.
void check_fields(const json& body, bool chat) {
  const std::string_view own = chat ? "messages" : "prompt";
  for (const auto& [key, value] : body.items()) {
    if (key == own || (chat && key == "max_completion_tokens") ||
        std::find(kSamplingFields.begin(), kSamplingFields.end(), key) != kSamplingFields.end())
      continue;
    const auto f = std::find_if(kOffOnly.begin(), kOffOnly.end(), [&](const OffOnly& o) {
      return o.name == key && (chat ? o.chat : o.completions);
    });
    if (f == kOffOnly.end()) {
      std::string known(own);
      if (chat) known += ", max_completion_tokens";
      for (const std::string_view k : kSamplingFields) known += ", " + std::string(k);
      throw BadRequest{"unknown field '" + key + "' (" + (chat ? "chat " : "") +
                       "completions read " + known + ")"};
    }
    if (!value.is_null() && !f->is_off(value))
      throw BadRequest{"'" + key + "' is not supported: only " + std::string(f->off) +
                       " is accepted, got " + value.dump() +
                       (f->hint.empty() ? "" : " (" + std::string(f->hint) + ")")};
  }
  for (const char* name : {"model", "user"})
    if (body.contains(name) && !body[name].is_null() && !body[name].is_string())
      throw BadRequest{std::string("'") + name + "' must be a string, got " + body[name].dump()};
  if (body.contains("stream_options") && !body["stream_options"].is_null()) {
    const json& so = body["stream_options"];
    // The last event always carries the usage, as "include_usage" asks.
    if (!so.is_object() || so.size() > 1 || (so.size() == 1 && !so.contains("include_usage")) ||
        (so.contains("include_usage") && !so["include_usage"].is_boolean()))
      throw BadRequest{"'stream_options' must be {\"include_usage\": true or false}, got " +
                       so.dump()};
  }
}

struct Sampling {
  kvdecode::SamplerOptions sampler;
  std::int64_t seed = 1;  // as the request gave it, or drawn; sampler.seed is seed_state(seed)
  std::size_t max_tokens = 16;
  bool stream = false;
  std::vector<std::string> stop;
};

/// The sampling fields of a request whose fields check_fields accepted. Without "seed" the
/// request takes draw_seed() (the server draws one per request, reported in its usage).
template <class DrawSeed>
Sampling read_sampling(const json& body, std::size_t default_max_tokens, DrawSeed&& draw_seed,
                       bool chat) {
  Sampling s;
  s.sampler.temperature = number_field(body, "temperature", 1.0, 0.0, 100.0);
  s.sampler.top_p = number_field(body, "top_p", 1.0, 0.0, 1.0);
  s.sampler.top_k = static_cast<std::int64_t>(integer_field(body, "top_k", 0, 0, kMaxCount));
  s.sampler.min_p = number_field(body, "min_p", 0.0, 0.0, 1.0);
  s.sampler.repeat_penalty = number_field(body, "repeat_penalty", 1.0, 0.0, 100.0, true);
  s.sampler.repeat_last_n = integer_field(body, "repeat_last_n", 64, 0, kMaxCount);
  // Any integer, as OpenAI takes (0 and negative ones included), within what doubles hold exactly.
  const std::optional<std::int64_t> given = integer_value(body, "seed", -kMaxSeed, kMaxSeed);
  s.seed = given ? *given : draw_seed();
  s.sampler.seed = seed_state(s.seed);
  s.max_tokens = integer_field(body, "max_tokens", default_max_tokens, 1, kMaxCount);
  if (chat && body.contains("max_completion_tokens") && !body["max_completion_tokens"].is_null()) {
    const std::size_t n = integer_field(body, "max_completion_tokens", 0, 1, kMaxCount);
    if (body.contains("max_tokens") && !body["max_tokens"].is_null() && n != s.max_tokens)
      throw BadRequest{"'max_tokens' " + std::to_string(s.max_tokens) +
                       " and 'max_completion_tokens' " + std::to_string(n) + " differ"};
    s.max_tokens = n;
  }
  if (body.contains("n") && !body["n"].is_null() &&
      !(body["n"].is_number_integer() && body["n"].get<long>() == 1))
    throw BadRequest{"only 'n': 1 is supported"};
  if (body.contains("stream") && !body["stream"].is_null()) {
    if (!body["stream"].is_boolean()) throw BadRequest{"'stream' must be true or false"};
    s.stream = body["stream"].get<bool>();
  }
  if (body.contains("stop") && !body["stop"].is_null()) {
    const json& st = body["stop"];
    if (st.is_string()) {
      s.stop.push_back(st.get<std::string>());
    } else if (st.is_array() && st.size() <= 4) {
      for (const json& x : st) {
        if (!x.is_string()) throw BadRequest{"'stop' must be a string or up to 4 strings"};
        s.stop.push_back(x.get<std::string>());
      }
    } else {
      throw BadRequest{"'stop' must be a string or up to 4 strings"};
    }
  }
  return s;
}

std::string required_string(const json& j, const char* name, const char* where) {
  if (!j.contains(name) || !j[name].is_string())
    throw BadRequest{std::string(where) + " needs a string '" + name + "'"};
  return j[name].get<std::string>();
}

// ---------------------------------------------------------------------------------------------
// The model and its engine, in the weight format the model runs on (--weights): the rest of the
// server submits requests, reads metrics, runs the step loop and flushes the prefix tier.

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::shared_ptr<kvdecode::RequestStream> submit(kvdecode::RequestOptions request) = 0;
  virtual kvdecode::EngineMetrics metrics() const = 0;
  virtual void run(std::stop_token stop) = 0;
  virtual std::size_t flush_prefix_tier() = 0;
};

template <class W>
class BackendOf final : public Backend {
 public:
  /// Throws what Engine throws for options the model or the pool refuse.
  BackendOf(kvdecode::Weights<W> weights, const kvdecode::EngineOptions& options)
      : model_(std::move(weights)), engine_(model_, options) {}
  std::shared_ptr<kvdecode::RequestStream> submit(kvdecode::RequestOptions request) override {
    return engine_.submit(std::move(request));
  }
  kvdecode::EngineMetrics metrics() const override { return engine_.metrics(); }
  void run(std::stop_token stop) override { engine_.run(stop); }
  std::size_t flush_prefix_tier() override { return engine_.flush_prefix_tier(); }

 private:
  kvdecode::Model<float, W> model_;
  kvdecode::Engine<float, W> engine_;
};

template <class W>
std::unique_ptr<Backend> make_backend(kvdecode::Weights<W>&& weights,
                                      const kvdecode::EngineOptions& options) {
  return std::make_unique<BackendOf<W>>(std::move(weights), options);
}

// ---------------------------------------------------------------------------------------------
// The server's state shared by every connection.

struct Server {
  Server(const Options& options, std::string name, kvdecode::Vocabulary vocab)
      : o(options), model_name(std::move(name)), vocabulary(std::move(vocab)) {}
  const Options& o;
  std::string model_name;
  const char* weights = "f32";  // the format the model runs in (--weights, resolved)
  kvdecode::Vocabulary vocabulary;
  std::unique_ptr<kvdecode::ThreadPool> threads;
  std::unique_ptr<Backend> engine;
  std::vector<std::int32_t> newline_ids;  // every token whose piece holds '\n'
  std::int32_t newline = 0;               // the token of "\n" itself
  std::atomic<std::uint64_t> http_requests{0}, bad_requests{0};
  const long long started = static_cast<long long>(std::time(nullptr));  // /v1/models' "created"

  /// A seed for a request that gives none: different for every request and every run (as
  /// OpenAI's and llama.cpp's servers sample), in [1, kMaxSeed], reported in the usage.
  std::int64_t draw_seed() {
    kvdecode::detail::SplitMix64 mix(seed_base + seed_count.fetch_add(1));
    return 1 + static_cast<std::int64_t>(mix.next() % static_cast<std::uint64_t>(kMaxSeed));
  }
  const std::uint64_t seed_base =
      (std::uint64_t{std::random_device{}()} << 32) ^ std::random_device{}();
  std::atomic<std::uint64_t> seed_count{0};

  // The chat template's memory of its own answers: an assistant message's text → the tokens
  // that produced it, so the next turn's prompt repeats them exactly and finds them cached.
  std::mutex memo_mutex;
  std::map<std::string, std::vector<std::int32_t>> memo;
  std::deque<std::string> memo_order;  // oldest first, for the bound below
  static constexpr std::size_t kMemoEntries = 4096;

  void remember(const std::string& text, std::vector<std::int32_t> tokens) {
    std::lock_guard lock(memo_mutex);
    if (memo.emplace(text, std::move(tokens)).second) memo_order.push_back(text);
    if (memo_order.size() > kMemoEntries) {
      memo.erase(memo_order.front());
      memo_order.pop_front();
    }
  }
  std::optional<std::vector<std::int32_t>> recall(const std::string& text) {
    std::lock_guard lock(memo_mutex);
    const auto it = memo.find(text);
    if (it == memo.end()) return std::nullopt;
    return it->second;
  }

  /// The chat template: BOS (when the vocabulary adds one), then each message's text (a
  /// SentencePiece tokenizer's dummy space before it) followed by a newline token — one verse
  /// per turn, as the KJV model writes them. An assistant message the server wrote is repeated
  /// as the tokens it generated.
  std::vector<std::int32_t> chat_prompt(const json& messages) {
    if (!messages.is_array() || messages.empty())
      throw BadRequest{"'messages' must be a non-empty array"};
    const kvdecode::SpecialTokens& specials = vocabulary.specials();
    std::vector<std::int32_t> tokens;
    if (specials.add_bos) tokens.push_back(specials.bos_id);
    for (const json& m : messages) {
      if (!m.is_object()) throw BadRequest{"every message must be an object"};
      const std::string role = required_string(m, "role", "a message");
      if (role != "system" && role != "user" && role != "assistant")
        throw BadRequest{"a message's 'role' must be system, user or assistant, got '" + role +
                         "'"};
      const std::string content = required_string(m, "content", "a message");
      if (role == "assistant") {
        if (auto known = recall(content)) {
          tokens.insert(tokens.end(), known->begin(), known->end());
          continue;
        }
      }
      const auto ids = vocabulary.encode(content, false, false);
      tokens.insert(tokens.end(), ids.begin(), ids.end());
      tokens.push_back(newline);
    }
    return tokens;
  }

  /// The text of a generated token after `prev`, as generate shows it.
  std::string_view piece(std::int32_t prev, std::int32_t token) const {
    return vocabulary.shown_text(prev, token);
  }
};

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

void send_error(httplib::Response& res, int status, const std::string& message,
                const char* type = "invalid_request_error") {
  res.status = status;
  res.set_content(dump({{"error", {{"message", message}, {"type", type}}}}), "application/json");
}

json usage_json(const kvdecode::RequestUsage& u, std::int64_t seed) {
  return {{"prompt_tokens", u.prompt_tokens},
          {"completion_tokens", u.generated_tokens},
          {"total_tokens", u.prompt_tokens + u.generated_tokens},
          {"prompt_tokens_details",
           {{"cached_tokens", u.cached_tokens},
            {"cached_from_disk_tokens", u.cached_from_disk_tokens}}},
          {"prefilled_tokens", u.prefilled_tokens},
          {"recomputed_tokens", u.recomputed_tokens},
          {"preemptions", u.preemptions},
          {"queue_ms", u.queue_ms},
          {"ttft_ms", u.ttft_ms},
          {"seed", seed}};
}

/// One generation: the engine's stream turned into text, stopping at the stop strings (and, for
/// chat, at the end of the line).
struct Generation {
  Server& server;
  std::shared_ptr<kvdecode::RequestStream> stream;
  kvdecode::TextStream text;
  std::int32_t prev;
  std::vector<std::int32_t> tokens;  // generated so far
  bool stopped_by_text = false;

  Generation(Server& s, std::shared_ptr<kvdecode::RequestStream> st, std::vector<std::string> stop,
             std::int32_t last_prompt_token)
      : server(s), stream(std::move(st)), text(std::move(stop)), prev(last_prompt_token) {}

  /// Waits up to `timeout` for the next token; returns the text it adds ("" too when nothing
  /// came). `done` turns true when the generation has ended.
  std::string next(std::chrono::milliseconds timeout, bool& done) {
    std::int32_t token = 0;
    const auto w = stream->next_for(token, timeout);
    if (w == kvdecode::RequestStream::Wait::kTimeout) return {};
    if (w == kvdecode::RequestStream::Wait::kFinished) {
      done = true;
      return std::string(text.flush());
    }
    tokens.push_back(token);
    std::string out;
    if (!server.vocabulary.specials().ends(token))
      out = std::string(text.push(server.piece(prev, token)));
    prev = token;
    if (text.stopped()) {
      stopped_by_text = true;
      stream->stop();  // the text is complete: the engine frees its blocks
      done = true;
    }
    return out;
  }

  std::string finish_reason() const {
    if (stopped_by_text) return "stop";
    const auto r = stream->finish_reason();
    if (r == kvdecode::FinishReason::kStopToken || r == kvdecode::FinishReason::kStopString)
      return "stop";
    if (r == kvdecode::FinishReason::kMaxTokens || r == kvdecode::FinishReason::kContextFull)
      return "length";
    return std::string(kvdecode::to_string(r));
  }
};

long long unix_time() { return static_cast<long long>(std::time(nullptr)); }

/// Serves one completion (chat or not) after its prompt is built: submits it, then answers
/// with the whole text, or streams it as server-sent events.
void serve_generation(Server& s, httplib::Response& res, std::vector<std::int32_t> prompt,
                      const Sampling& sp, bool chat) {
  kvdecode::RequestOptions req;
  req.prompt = std::move(prompt);
  req.sampling = sp.sampler;
  req.max_tokens = sp.max_tokens;
  // The vocabulary's end tokens: BOS for llama2.c's conventions, a GGUF vocabulary's EOS.
  req.stop_tokens = s.vocabulary.specials().end_tokens();
  std::vector<std::string> stop = sp.stop;
  if (chat) {
    // One verse per turn: a token holding a newline ends the answer.
    req.stop_tokens.insert(req.stop_tokens.end(), s.newline_ids.begin(), s.newline_ids.end());
    stop.push_back("\n");
  }
  const std::int32_t last = req.prompt.back();
  std::shared_ptr<kvdecode::RequestStream> stream;
  try {
    stream = s.engine->submit(std::move(req));
  } catch (const kvdecode::Error& e) {
    ++s.bad_requests;
    send_error(res, 400, cli::for_a_person(e.what()));
    return;
  }
  const std::string id = (chat ? "chatcmpl-" : "cmpl-") + std::to_string(stream->id());
  const long long created = unix_time();
  const char* object = chat ? "chat.completion" : "text_completion";
  auto gen = std::make_shared<Generation>(s, stream, std::move(stop), last);
  const auto remember_answer = [&s, chat](const std::string& text, const Generation& g) {
    if (!chat) return;
    std::vector<std::int32_t> t = g.tokens;
    if (!t.empty() && s.vocabulary.specials().ends(t.back())) t.pop_back();
    // The next turn's template puts a newline token after the answer: one ends it already
    // when a newline stopped it.
    if (t.empty() ||
        std::find(s.newline_ids.begin(), s.newline_ids.end(), t.back()) == s.newline_ids.end())
      t.push_back(s.newline);
    s.remember(text, std::move(t));
  };

  if (!sp.stream) {
    std::string text;
    for (bool done = false; !done;) text += gen->next(std::chrono::milliseconds(1000), done);
    stream->wait();
    remember_answer(text, *gen);
    json choice = {{"index", 0}, {"finish_reason", gen->finish_reason()}};
    if (chat) {
      choice["message"] = {{"role", "assistant"}, {"content", text}};
    } else {
      choice["text"] = text;
    }
    res.set_content(dump({{"id", id},
                          {"object", object},
                          {"created", created},
                          {"model", s.model_name},
                          {"choices", json::array({choice})},
                          {"usage", usage_json(stream->usage(), sp.seed)}}),
                    "application/json");
    return;
  }

  // Streaming: one event per piece of text, then a last event with the finish reason and the
  // usage, then [DONE]. A client that goes away cancels the request (its blocks are freed).
  const std::string chunk_object = chat ? "chat.completion.chunk" : "text_completion";
  auto all_text = std::make_shared<std::string>();
  auto sent_role = std::make_shared<bool>(false);
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [=, &s](std::size_t, httplib::DataSink& sink) {
        const auto event = [&](const std::string& delta, const json& finish,
                               const json* usage) -> bool {
          json choice = {{"index", 0}, {"finish_reason", finish}};
          if (chat) {
            json d = {{"content", delta}};
            if (!*sent_role) d["role"] = "assistant";
            *sent_role = true;
            choice["delta"] = d;
          } else {
            choice["text"] = delta;
          }
          json chunk = {{"id", id},
                        {"object", chunk_object},
                        {"created", created},
                        {"model", s.model_name},
                        {"choices", json::array({choice})}};
          if (usage != nullptr) chunk["usage"] = *usage;
          const std::string line = "data: " + dump(chunk) + "\n\n";
          return sink.write(line.data(), line.size());
        };
        // Every token already there goes into one event: under load, a stream that fell behind
        // catches up in one write instead of one per token.
        bool done = false;
        std::string delta = gen->next(std::chrono::milliseconds(50), done);
        for (std::size_t n = gen->tokens.size(), k = 0; !done && k < 64; ++k) {
          delta += gen->next(std::chrono::milliseconds(0), done);
          if (gen->tokens.size() == n) break;  // nothing more yet
          n = gen->tokens.size();
        }
        if (!delta.empty()) {
          *all_text += delta;
          if (!event(delta, nullptr, nullptr)) {
            stream->cancel();
            return false;
          }
        } else if (!done && !sink.is_writable()) {
          stream->cancel();
          return false;
        }
        if (!done) return true;
        stream->wait();
        remember_answer(*all_text, *gen);
        const json usage = usage_json(stream->usage(), sp.seed);
        if (!event("", gen->finish_reason(), &usage)) return false;
        const std::string end = "data: [DONE]\n\n";
        sink.write(end.data(), end.size());
        sink.done();
        return true;
      },
      [stream](bool) { stream->cancel(); });  // a no-op once the request has finished
}

/// The prefix tier's counters, or null without --prefix-dir.
json tier_json(const kvdecode::EngineMetrics& m) {
  if (!m.prefix_tier) return nullptr;
  json skipped = json::object();
  for (std::size_t r = 0; r < kvdecode::kTierSkipReasons; ++r) {
    std::string name(kvdecode::kTierSkipNames[r]);
    std::replace(name.begin(), name.end(), ' ', '_');  // "block size" → "block_size"
    skipped[name] = m.tier.skipped[r];
  }
  return {{"disk_hits", m.tier.disk_hits},
          {"disk_misses", m.tier.disk_misses},
          {"files_written", m.tier.files_written},
          {"files_evicted", m.tier.files_evicted},
          {"write_failures", m.tier.write_failures},
          {"files_skipped", m.tier.files_skipped()},
          {"skipped", skipped},
          {"files_on_disk", m.tier.files_on_disk},
          {"bytes_on_disk", m.tier.bytes_on_disk}};
}

json metrics_json(Server& s) {
  const kvdecode::EngineMetrics m = s.engine->metrics();
  const auto lat = [](const kvdecode::LatencyHistogram& h) {
    return json{{"count", h.count()},
                {"mean_ms", h.mean_ms()},
                {"p50_ms", h.percentile_ms(0.50)},
                {"p90_ms", h.percentile_ms(0.90)},
                {"p99_ms", h.percentile_ms(0.99)},
                {"max_ms", h.max_ms()}};
  };
  return {{"model", s.model_name},
          {"weights", s.weights},
          {"queued", m.queued},
          {"running", m.running},
          {"blocks_total", m.blocks_total},
          {"blocks_held", m.blocks_held},
          {"blocks_free", m.blocks_free},
          {"blocks_cached", m.blocks_cached},
          {"steps", m.steps},
          {"passes", m.passes},
          {"requests_submitted", m.submitted},
          {"requests_finished", m.finished},
          {"requests_cancelled", m.cancelled},
          {"requests_failed", m.failed},
          {"bad_requests", s.bad_requests.load()},
          {"http_requests", s.http_requests.load()},
          {"preemptions", m.preemptions},
          {"prompt_tokens", m.prompt_tokens},
          {"tokens_reused", m.tokens_reused},
          {"tokens_prefilled", m.tokens_prefilled},
          {"tokens_recomputed", m.tokens_recomputed},
          {"tokens_generated", m.tokens_generated},
          {"prefix_hit_rate", m.prefix_hit_rate()},
          {"prefix_block_hits", m.prefix_block_hits},
          {"prefix_block_disk_hits", m.prefix_block_disk_hits},
          {"prefix_block_misses", m.prefix_block_misses},
          {"tokens_from_disk", m.tokens_from_disk},
          {"evictions", m.evictions},
          {"prefix_cache", !s.o.no_prefix_cache},
          {"prefix_tier", tier_json(m)},
          {"ttft", lat(m.ttft)},
          {"itl", lat(m.itl)}};
}

/// Parses a POST body as a JSON object, or answers 400 and returns nothing.
std::optional<json> parse_body(Server& s, const httplib::Request& req, httplib::Response& res) {
  ++s.http_requests;
  json body = json::parse(req.body, nullptr, false);
  if (body.is_discarded()) {
    ++s.bad_requests;
    send_error(res, 400, "the body is not valid JSON");
    return std::nullopt;
  }
  if (!body.is_object()) {
    ++s.bad_requests;
    send_error(res, 400, "the body must be a JSON object");
    return std::nullopt;
  }
  return body;
}

template <class F>
void answer(Server& s, httplib::Response& res, F&& f) {
  try {
    f();
  } catch (const BadRequest& e) {
    ++s.bad_requests;
    send_error(res, 400, e.message);
  } catch (const kvdecode::Error& e) {
    ++s.bad_requests;
    send_error(res, 400, cli::for_a_person(e.what()));
  }
}

int run(const Options& o) {
  namespace fs = std::filesystem;
  if (o.prefix_max_bytes_given && o.prefix_dir.empty())
    throw cli::UsageError{"--prefix-max-bytes needs --prefix-dir"};
  if (!o.prefix_dir.empty() && o.no_prefix_cache)
    throw cli::UsageError{"--prefix-dir needs the prefix cache (drop --no-prefix-cache)"};
  if (!o.prefix_dir.empty()) {
    try {  // creates the directory and writes a probe file, as the engine will
      kvdecode::PrefixTier<float> probe(kvdecode::ModelFingerprint{}, {.directory = o.prefix_dir});
    } catch (const kvdecode::Error& e) {
      throw cli::UsageError{"--prefix-dir: " + cli::for_a_person(e.what())};
    }
  }
  const fs::path model_path =
      o.model.empty() ? fs::path(KVDECODE_DEFAULT_MODEL_DIR) / "kjv_tiny.bin" : fs::path(o.model);
  std::optional<kvdecode::Vocabulary> vocabulary;
  cli::AnyWeights loaded = cli::load_as(model_path, o.weights, vocabulary);
  const kvdecode::ModelConfig cfg = std::visit([](const auto& w) { return w.config; }, loaded);
  // A tokenizer.bin (run.c's ids) may stand in for a GGUF file's "llama" vocabulary, not for a
  // byte-level BPE one.
  if (vocabulary && vocabulary->kind() == kvdecode::Vocabulary::Kind::kBytePairs &&
      !o.tokenizer.empty())
    throw cli::UsageError{"--tokenizer '" + o.tokenizer + "' is a llama2.c tokenizer.bin, but '" +
                          model_path.string() +
                          "' has a gpt2 (byte-level BPE) vocabulary of its own; drop --tokenizer"};
  if (!vocabulary || !o.tokenizer.empty()) {
    const fs::path tok_path =
        o.tokenizer.empty() ? model_path.parent_path() / "tokenizer.bin" : fs::path(o.tokenizer);
    vocabulary.emplace(kvdecode::Tokenizer::load(tok_path, cfg.vocab_size));
  }
  Server s(o, model_path.filename().string(), std::move(*vocabulary));
  s.weights = cli::weight_name(loaded);
  s.threads = std::make_unique<kvdecode::ThreadPool>(o.threads);
  if (o.step_tokens < o.max_running)
    throw cli::UsageError{"--step-tokens " + std::to_string(o.step_tokens) +
                          " must be at least --max-running " + std::to_string(o.max_running)};
  const std::size_t block_file = kvdecode::PrefixTier<float>::file_bytes_for(
      static_cast<std::size_t>(cfg.n_layers), static_cast<std::size_t>(cfg.n_kv_heads),
      static_cast<std::size_t>(cfg.head_size()), o.block_size);
  if (!o.prefix_dir.empty() && o.prefix_max_bytes < block_file)
    throw cli::UsageError{"--prefix-max-bytes: " + std::to_string(o.prefix_max_bytes) +
                          " is smaller than one block file of this model (" +
                          std::to_string(block_file) + " bytes at --block-size " +
                          std::to_string(o.block_size) + ")"};
  const kvdecode::EngineOptions engine_options{.n_blocks = o.blocks,
                                               .block_size = o.block_size,
                                               .max_running = o.max_running,
                                               .step_tokens = o.step_tokens,
                                               .prefix_cache = !o.no_prefix_cache,
                                               .thread_pool = s.threads.get(),
                                               .prefix_dir = o.prefix_dir,
                                               .prefix_max_bytes = o.prefix_max_bytes,
                                               .sub_passes = !o.no_sub_passes};
  s.engine =
      std::visit([&](auto& w) { return make_backend(std::move(w), engine_options); }, loaded);
  for (std::int32_t id = 0; id < cfg.vocab_size; ++id) {
    const std::string_view p = s.vocabulary.decode(0, id);
    if (p.find('\n') != std::string_view::npos) s.newline_ids.push_back(id);
    if (p == "\n" && s.newline == 0) s.newline = id;
  }
  if (s.newline == 0) throw kvdecode::Error("the tokenizer has no piece \"\\n\" for the chat");

  httplib::Server http;
  http.new_task_queue = [n = o.http_threads] { return new httplib::ThreadPool(n); };
  http.set_payload_max_length(o.max_body_bytes);
  http.set_tcp_nodelay(true);  // each streamed event goes out as written (no Nagle wait for an ACK)
  http.set_read_timeout(10, 0);
  http.set_write_timeout(10, 0);
  http.Get("/health", [&](const httplib::Request&, httplib::Response& res) {
    ++s.http_requests;
    res.set_content(R"({"status":"ok"})", "application/json");
  });
  http.Get("/metrics", [&](const httplib::Request&, httplib::Response& res) {
    ++s.http_requests;
    res.set_content(dump(metrics_json(s)), "application/json");
  });
  // OpenAI's model list (clients ask for it before anything else): the one model served.
  const auto model_json = [&] {
    return json{{"id", s.model_name},
                {"object", "model"},
                {"created", s.started},
                {"owned_by", "kvdecode"}};
  };
  http.Get("/v1/models", [&](const httplib::Request&, httplib::Response& res) {
    ++s.http_requests;
    res.set_content(dump({{"object", "list"}, {"data", json::array({model_json()})}}),
                    "application/json");
  });
  http.Get(R"(/v1/models/(.+))", [&](const httplib::Request& req, httplib::Response& res) {
    ++s.http_requests;
    if (req.matches[1] == s.model_name) {
      res.set_content(dump(model_json()), "application/json");
    } else {
      send_error(res, 404,
                 "no model '" + std::string(req.matches[1]) + "': this server serves '" +
                     s.model_name + "'",
                 "not_found_error");
    }
  });
  http.Post("/v1/completions", [&](const httplib::Request& req, httplib::Response& res) {
    const auto body = parse_body(s, req, res);
    if (!body) return;
    answer(s, res, [&] {
      check_fields(*body, false);
      const std::string prompt = required_string(*body, "prompt", "the request");
      const Sampling sp = read_sampling(
          *body, 16, [&] { return s.draw_seed(); }, false);
      serve_generation(s, res, s.vocabulary.encode_prompt(prompt), sp, false);
    });
  });
  http.Post("/v1/chat/completions", [&](const httplib::Request& req, httplib::Response& res) {
    const auto body = parse_body(s, req, res);
    if (!body) return;
    answer(s, res, [&] {
      check_fields(*body, true);
      if (!body->contains("messages")) throw BadRequest{"the request needs 'messages'"};
      const Sampling sp = read_sampling(
          *body, 64, [&] { return s.draw_seed(); }, true);
      serve_generation(s, res, s.chat_prompt((*body)["messages"]), sp, true);
    });
  });
  http.set_error_handler([&](const httplib::Request&, httplib::Response& res) {
    // Called for every status from 400 on: an answer that has its own message keeps it.
    if (res.status == 404 && res.body.empty())
      send_error(res, 404, "no such endpoint", "not_found_error");
    if (res.status == 413)
      send_error(res, 413, "the body exceeds " + std::to_string(o.max_body_bytes) + " bytes");
  });

  // httplib 0.11 listens with a backlog of 5: more clients connecting at once than its accept
  // loop takes in time (a busy machine) overflow it, the kernel drops their SYNs and they resend
  // after 1 s. The listening socket is listened on again with the system's largest backlog.
  int listen_fd = -1;
  http.set_socket_options([&listen_fd](socket_t sock) {
    httplib::default_socket_options(sock);
    listen_fd = sock;
  });
  const int port = o.port == 0 ? http.bind_to_any_port(o.host) : o.port;
  if (port < 0 || (o.port != 0 && !http.bind_to_port(o.host, o.port)))
    throw kvdecode::Error("cannot listen on " + o.host + ":" + std::to_string(o.port));
  if (listen_fd >= 0 && ::listen(listen_fd, SOMAXCONN) != 0)
    throw kvdecode::Error("cannot listen on " + o.host + ":" + std::to_string(port) +
                          " with a backlog of " + std::to_string(SOMAXCONN));

  // SIGINT / SIGTERM stop the server; a thread waits for them (no work in a signal handler).
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  // A signal that comes before listen_after_bind() has started would find stop() a no-op and the
  // server would listen on: the waiter stops it once it runs (or once listening has ended).
  std::atomic<bool> listen_ended{false};
  std::jthread signals([&] {
    int sig = 0;
    sigwait(&stop_signals, &sig);
    while (!http.is_running() && !listen_ended)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    http.stop();
  });
  std::jthread engine_loop([&](std::stop_token st) { s.engine->run(st); });
  std::string tier;
  if (!o.prefix_dir.empty())
    tier = ", prefix dir " + o.prefix_dir + " with " +
           std::to_string(s.engine->metrics().tier.files_on_disk) + " block files";
  std::printf(
      "listening on http://%s:%d (model %s, weights %s, %zu blocks of %zu, prefix cache %s%s)\n",
      o.host.c_str(), port, s.model_name.c_str(), s.weights, o.blocks, o.block_size,
      o.no_prefix_cache ? "off" : "on", tier.c_str());
  std::fflush(stdout);
  http.listen_after_bind();
  listen_ended = true;
  pthread_kill(signals.native_handle(), SIGTERM);  // listen ended another way: end the waiter
  // A clean shutdown: no connection is served any more; the step loop stops, then every block
  // still cached in memory goes to the prefix directory for the next start.
  engine_loop.request_stop();
  engine_loop.join();
  if (!o.prefix_dir.empty()) {
    s.engine->flush_prefix_tier();
    const kvdecode::EngineMetrics m = s.engine->metrics();
    std::printf("prefix dir %s: %llu block files written, %llu on disk\n", o.prefix_dir.c_str(),
                static_cast<unsigned long long>(m.tier.files_written),
                static_cast<unsigned long long>(m.tier.files_on_disk));
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Writes to a client that went away must fail, not kill the process; the stop signals are
  // taken by the waiting thread only (blocked here, before any thread starts).
  ::signal(SIGPIPE, SIG_IGN);
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  Options o;
  CLI::App app{"", "server"};
  cli::configure(app, KVDECODE_VERSION);
  declare(app, o);
  return cli::run_main(app, argc, argv, o.verbose, [&] {
    o.prefix_max_bytes_given = app.get_option("--prefix-max-bytes")->count() > 0;
    return run(o);
  });
}
