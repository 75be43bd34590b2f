// generate: text generation with kvdecode, streaming tokens as they are sampled and reporting
// where the time and the memory traffic went. Runs the bundled KJV model by default, any
// llama2.c checkpoint, or the library's demo model; every store and weight type of the library.
// `generate --help` lists the flags (declared once, in declare()).
//
// The data path: prompt text → token ids → Model::prefill into the KV store → logits → Sampler
// → token → Model::decode (one token against the store) → logits → ... The store and weight
// types are compile-time parameters of the model; the flags pick them once, in with_store().
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <kvdecode/io/cache_file.hpp>
#include <kvdecode/io/checkpoint.hpp>
#include <kvdecode/io/load_model.hpp>
#include <kvdecode/kvdecode.hpp>
#include <kvdecode/text/tokenizer.hpp>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "cli.hpp"
#include "weight_choice.hpp"

#ifndef KVDECODE_DEFAULT_MODEL_DIR  // set by examples/CMakeLists.txt to the repository's models/
#define KVDECODE_DEFAULT_MODEL_DIR "models"
#endif
#ifndef KVDECODE_VERSION
#define KVDECODE_VERSION "unknown"
#endif

namespace {

constexpr std::string_view kDemo = "demo";
constexpr const char* kKjvPrompt = "And it came to pass";
constexpr const char* kStoriesPrompt = "Once upon a time";

using cli::AnyWeights;
using cli::WeightType;
enum class KvType { kF32, kInt8, kQ4, kQ2, kPaged };

struct Options {
  std::string model;  // "" = the bundled KJV model, kDemo = the demo model, else a file
  std::string tokenizer;
  std::optional<std::string> prompt;  // unset: the model's default prompt
  std::string prompt_file;
  std::int64_t n = 256;  // -1: until the context (or, with a window, never) ends
  bool n_given = false;  // -n N: exactly N tokens; default: n, then to the end of the line
  double temperature = 0.8;
  double top_p = 0.9;
  std::int64_t top_k = 0;
  double min_p = 0.0;
  double repeat_penalty = 1.0;
  std::size_t repeat_last_n = 64;
  std::vector<std::string> stop;
  std::int64_t seed = 42;  // -1: random
  std::size_t threads = std::max(1u, std::thread::hardware_concurrency());
  std::size_t chunk = 128;
  std::size_t ctx = 0;                       // 0 = the model's seq_len
  WeightType weights = WeightType::kStored;  // as the model file stores its matrices
  KvType kv = KvType::kF32;
  std::size_t block_size = 16;
  cli::LowBitFlags low_bit;  // --kv q4 / q2 settings
  std::size_t window = 0;    // 0 = no window
  std::optional<std::size_t> sinks;
  std::string save_cache;
  std::string load_cache;
  bool ignore_bos = false;
  bool no_cache = false;
  bool interactive = false;
  bool stats_to_stdout = false;
  bool verbose = false;
  std::size_t speculate = 0;  // --speculate lookup[:N]: N proposals per pass; 0 = off
  std::string draft;          // --draft FILE: a draft checkpoint ("demo": the demo model)
  std::size_t draft_k = 4;    // --draft-k
  bool draft_k_given = false;
  WeightType draft_weights = WeightType::kStored;  // --draft-weights
  bool draft_weights_given = false;
};

// ---------------------------------------------------------------------------------------------
// The flags: each declared once, with its names, default, help and validation.

constexpr std::size_t kMaxCount = std::size_t{1} << 31;  // bound of every count flag
constexpr std::size_t kDefaultDraft = 4;  // proposals per pass of --speculate lookup and --draft

void declare(CLI::App& app, Options& o) {
  using cli::number;
  const auto hw = static_cast<std::size_t>(std::max(1u, std::thread::hardware_concurrency()));
  app.description(
      "Generates text with a KV-cached transformer, streaming it to stdout, then reports load, "
      "prompt and decode times, the bytes a decode step reads (GB/s) and the cache size on "
      "stderr.");
  app.footer(
      "Exit codes: 0 done, 1 an error (a missing or corrupt file), 2 a bad command line, 130 "
      "stopped by Ctrl-C (the report is still printed). An error is one line on stderr.");

  const char* model = "Model";
  app.add_option("-m,--model", o.model,
                 "llama2.c checkpoint (v0 format), e.g. stories15M.bin, or a GGUF file of the "
                 "llama architecture (f32, f16, bf16, q8_0 or q4_0 tensors; a llama or gpt2 "
                 "vocabulary). Default: the bundled "
                 "models/kjv_tiny.bin (2.36M parameters trained on the King James Bible). "
                 "\"demo\": the library's demo model, deterministic random weights (its text is "
                 "noise, its timings are real); also used when kjv_tiny.bin is missing")
      ->group(model);
  app.add_option("--tokenizer", o.tokenizer,
                 "llama2.c tokenizer.bin (default: the GGUF file's vocabulary, or tokenizer.bin "
                 "beside a checkpoint); must have the checkpoint's vocabulary size. Refused for a "
                 "GGUF file with a gpt2 (byte-level BPE) vocabulary")
      ->group(model);
  cli::weights_option(app, o.weights)->group(model);

  const char* text = "Text";
  app.add_option("-p,--prompt", o.prompt,
                 "prompt (default \"And it came to pass\" for the KJV model, \"Once upon a "
                 "time\" for the others); UTF-8 is echoed as written")
      ->group(text);
  app.add_option("-f,--file", o.prompt_file, "read the prompt from a file")
      ->check(CLI::ExistingFile)
      ->group(text);
  app.add_option("-n,--n-predict", o.n,
                 "tokens to generate; -1: until the context ends (with --window: until BOS, a "
                 "stop string or Ctrl-C). Stops earlier at BOS (and at EOS for a GGUF vocabulary; "
                 "a gpt2 vocabulary only at EOS) or a full cache. Not given: 256, "
                 "then on to the end of the line in progress (a verse of the KJV model; at most "
                 "128 tokens more) unless --ignore-bos")
      ->check(number<std::int64_t>(1, std::numeric_limits<std::int64_t>::max(), -1))
      ->capture_default_str()
      ->group(text);
  app.add_flag("--ignore-bos", o.ignore_bos,
               "go on after a BOS token (or a GGUF vocabulary's EOS; not printed) instead of "
               "ending the text, so that exactly N tokens are generated (benchmarks, tests)")
      ->group(text);
  app.add_option("--stop", o.stop, "stop string: the text ends before it (repeatable)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)
      ->group(text);
  app.add_flag("-i,--interactive", o.interactive,
               "chat: each line on stdin is a turn, answered from one cache kept across turns; "
               "stderr says per turn how many tokens were prefilled and reused")
      ->group(text);

  const char* sampling = "Sampling";
  app.add_option("--temperature,--temp", o.temperature,
                 "0 = greedy (0.8: the KJV model invents about 1 word in 250 at 0.8, 1 in 110 "
                 "at 1.0, and still varies)")
      ->check(number<double>(0, 100))
      ->capture_default_str()
      ->group(sampling);
  app.add_option("--top-p", o.top_p, "nucleus sampling mass in (0, 1]; 1 disables it")
      ->check(number<double>(0, 1, std::nullopt, /*open_lo=*/true))
      ->capture_default_str()
      ->group(sampling);
  app.add_option("--top-k", o.top_k, "keep the K most likely tokens, 0 disables it")
      ->check(number<std::int64_t>(0, static_cast<std::int64_t>(kMaxCount)))
      ->capture_default_str()
      ->group(sampling);
  app.add_option("--min-p", o.min_p,
                 "drop tokens less likely than min-p x the most likely one; 0 disables it")
      ->check(number<double>(0, 1))
      ->capture_default_str()
      ->group(sampling);
  app.add_option("--repeat-penalty", o.repeat_penalty,
                 "divide a recent token's positive logit by this (multiply a negative one); 1 "
                 "disables it. Greedy KJV output loops without it (1.3 breaks the loops)")
      ->check(number<double>(0, 100, std::nullopt, /*open_lo=*/true))
      ->capture_default_str()
      ->group(sampling);
  app.add_option("--repeat-last-n", o.repeat_last_n, "how many recent tokens are penalised")
      ->check(number<std::size_t>(0, 1 << 20))
      ->capture_default_str()
      ->group(sampling);
  app.add_option("-s,--seed", o.seed, "sampler seed, > 0, or -1 for a random one")
      ->check(number<std::int64_t>(1, std::numeric_limits<std::int64_t>::max(), -1))
      ->capture_default_str()
      ->group(sampling);

  const char* kv = "KV cache";
  cli::choice(app, "--kv", o.kv,
              {{"f32", KvType::kF32},
               {"int8", KvType::kInt8},
               {"q4", KvType::kQ4},
               {"q2", KvType::kQ2},
               {"paged", KvType::kPaged}},
              "f32 (ContiguousStore), int8 (one f32 scale per row), q4 or q2 (4- or 2-bit, "
              "per-channel key groups, the newest positions exact) or paged (PagedStore on a "
              "BlockPool); the report gives each one's bytes per position")
      ->group(kv);
  o.low_bit.declare(app, kv);
  app.add_option("-c,--ctx-size", o.ctx,
                 "positions the cache holds, at most the model's seq_len (default: seq_len)")
      ->check(number<std::size_t>(1, kMaxCount))
      ->group(kv);
  app.add_option("--block-size", o.block_size, "positions per block with --kv paged")
      ->check(number<std::size_t>(1, 4096))
      ->capture_default_str()
      ->group(kv);
  app.add_option("--window", o.window,
                 "streaming window (StreamingLLM): keep the last W positions plus the sinks; "
                 "generation goes on past the model's seq_len with bounded memory. Needs S + W <= "
                 "seq_len; f32 only")
      ->check(number<std::size_t>(1, kMaxCount))
      ->group(kv);
  app.add_option("--sinks", o.sinks, "first positions kept forever with --window (default 4)")
      ->check(number<std::size_t>(0, kMaxCount))
      ->group(kv);
  app.add_option("--save-cache", o.save_cache,
                 "after the prompt is prefilled, save the cache to FILE (checked writable first)")
      ->group(kv);
  app.add_option("--load-cache", o.load_cache,
                 "start from the cache in FILE: the longest prefix it shares with the prompt is "
                 "reused, the rest of the prompt prefilled")
      ->check(CLI::ExistingFile)
      ->group(kv);
  app.add_flag("--no-cache", o.no_cache,
               "recompute the whole sequence for every token (what a KV cache saves)")
      ->group(kv);

  const char* run = "Run";
  app.add_option("-t,--threads", o.threads, "threads for every forward step (default: the cores)")
      ->check(number<std::size_t>(1, hw))
      ->group(run);
  app.add_option("--chunk", o.chunk,
                 "prefill chunk: tokens per forward pass of the prompt (at most the prompt and "
                 "the context are used)")
      ->check(number<std::size_t>(1, kMaxCount))
      ->capture_default_str()
      ->group(run);
  app.add_flag("--stats", o.stats_to_stdout,
               "print the report on stdout instead of stderr; with --speculate or --draft, then "
               "time a plain decode of as many tokens (same store, threads and sampling) and "
               "report the speedup")
      ->group(run);
  app.add_flag("--verbose", o.verbose, "errors name the library header and line")->group(run);

  // Speculative decoding: a drafter proposes tokens, one target pass of k + 1 verifies them.
  const char* spec = "Speculative decoding (same tokens as plain greedy decoding)";
  cli::name_with_count(
      app, "--speculate", "lookup", o.speculate, kDefaultDraft, 1, kvdecode::kMaxSpeculativeDraft,
      "lookup: prompt lookup drafts the tokens that followed the latest earlier occurrence of the "
      "text's last words; lookup:N drafts N per pass, N in [1, " +
          std::to_string(kvdecode::kMaxSpeculativeDraft) + "] (lookup: " +
          std::to_string(kDefaultDraft) + "). Pays where the text repeats the prompt or itself")
      ->group(spec);
  app.add_option("--draft", o.draft,
                 "a smaller model with the target's vocabulary (a llama2.c checkpoint or a GGUF "
                 "file of any weight type) drafts the tokens (on its own f32 cache, its weights "
                 "as --draft-weights says); \"demo\": the demo model")
      ->group(spec);
  cli::weights_option(app, o.draft_weights, "--draft-weights")->group(spec);
  app.add_option("--draft-k", o.draft_k, "tokens --draft proposes per pass")
      ->check(number<std::size_t>(1, kvdecode::kMaxSpeculativeDraft))
      ->capture_default_str()
      ->group(spec);
}

/// The store kinds the flags can ask for, each a type: the one place a runtime choice becomes
/// a type. f(std::type_identity<S>{}) for the kind `o` asks for.
template <class F>
decltype(auto) with_store_type(const Options& o, F&& f) {
  using namespace kvdecode;
  if (o.window > 0) return f(std::type_identity<WindowStore<float>>{});
  switch (o.kv) {
    case KvType::kInt8:
      return f(std::type_identity<Int8Store<float>>{});
    case KvType::kQ4:
      return f(std::type_identity<Q4Store<float>>{});
    case KvType::kQ2:
      return f(std::type_identity<Q2Store<float>>{});
    case KvType::kPaged:
      return f(std::type_identity<PagedStore<float>>{});
    case KvType::kF32:
      break;
  }
  return f(std::type_identity<ContiguousStore<float>>{});
}

/// Whether `path` can be written: an existing writable file, or a new one in a writable folder.
bool writable(const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(path, ec)) return false;
  if (fs::exists(path, ec)) return ::access(path.c_str(), W_OK) == 0;
  const fs::path dir = path.has_parent_path() ? path.parent_path() : fs::path(".");
  return fs::is_directory(dir, ec) && ::access(dir.c_str(), W_OK) == 0;
}

/// The checks between flags, before any file is read.
void check(const Options& o) {
  using cli::UsageError;
  if (!o.tokenizer.empty() && (o.model.empty() || o.model == kDemo))
    throw UsageError{
        "--tokenizer needs --model FILE (the vocabulary size comes from the checkpoint)"};
  if (o.prompt && !o.prompt_file.empty())
    throw UsageError{"--prompt and --file both give the prompt; pass one"};
  if (o.interactive && (o.prompt || !o.prompt_file.empty()))
    throw UsageError{"--interactive reads its turns from stdin; it takes no --prompt or --file"};
  if (o.interactive && (!o.save_cache.empty() || !o.load_cache.empty()))
    throw UsageError{"--interactive does not save or load cache files yet"};
  if (o.interactive && o.no_cache)
    throw UsageError{"--interactive keeps one cache across turns; it cannot use --no-cache"};
  if (o.sinks && o.window == 0) throw UsageError{"--sinks needs --window"};
  if (o.window > 0 && o.kv != KvType::kF32)
    throw UsageError{
        "--window keeps f32 rows and cannot be combined with --kv int8, q4, q2 or paged"};
  if (const std::string m = o.low_bit.check(); !m.empty()) throw UsageError{m};
  if (o.window > 0 && o.no_cache)
    throw UsageError{"--no-cache recomputes everything; it cannot be combined with --window"};
  if (o.window > 0 && o.ctx > 0)
    throw UsageError{"--ctx-size bounds a whole-history cache; --window bounds its own memory"};
  if ((!o.save_cache.empty() || !o.load_cache.empty()) && o.no_cache)
    throw UsageError{"--save-cache and --load-cache cannot be combined with --no-cache"};
  if (!o.save_cache.empty() && !writable(o.save_cache))
    throw UsageError{"--save-cache: cannot write '" + o.save_cache + "'"};
  // Speculation verifies proposals against the cache, under plain greedy's or the sampler's
  // distribution as speculative sampling defines it (temperature, top-k, top-p).
  const bool speculating = o.speculate > 0 || !o.draft.empty();
  if (o.speculate > 0 && !o.draft.empty())
    throw UsageError{"--speculate lookup and --draft both choose the drafter; pass one"};
  if (o.draft_k_given && o.draft.empty()) throw UsageError{"--draft-k needs --draft"};
  if (o.draft_weights_given && o.draft.empty()) throw UsageError{"--draft-weights needs --draft"};
  if (speculating && o.no_cache)
    throw UsageError{
        "--speculate and --draft verify proposals against the KV cache; they "
        "cannot be combined with --no-cache"};
}

// ---------------------------------------------------------------------------------------------
// The demo model's vocabulary: llama2.c's tokenizer layout (<unk>, BOS, EOS, 256 byte tokens,
// printable ASCII) plus common English pieces.

kvdecode::Tokenizer demo_tokenizer(std::int64_t vocab_size) {
  static constexpr const char* kWords[] = {
      "the",     "and",   "was",    "to",     "a",      "he",      "she",    "they",    "it",
      "of",      "in",    "day",    "time",   "once",   "upon",    "there",  "little",  "big",
      "girl",    "boy",   "dog",    "cat",    "bird",   "tree",    "house",  "park",    "ball",
      "sun",     "sky",   "happy",  "sad",    "friend", "friends", "play",   "played",  "went",
      "saw",     "said",  "wanted", "liked",  "had",    "with",    "her",    "his",     "mom",
      "dad",     "one",   "very",   "so",     "but",    "then",    "all",    "not",     "is",
      "you",     "we",    "on",     "at",     "up",     "out",     "red",    "blue",    "green",
      "small",   "old",   "new",    "good",   "fun",    "run",     "ran",    "see",     "look",
      "home",    "water", "food",   "toy",    "car",    "book",    "name",   "named",   "lily",
      "tom",     "ben",   "mia",    "sam",    "lived",  "loved",   "found",  "came",    "made",
      "asked",   "help",  "helped", "nice",   "kind",   "brave",   "smiled", "laughed", "every",
      "morning", "night", "garden", "forest", "flower", "fish",    "boat",   "rain",    "snow",
      "cake",    "bear",  "duck"};
  std::vector<std::string> pieces = {"<unk>", "\n<s>\n", "\n</s>\n"};
  std::vector<float> scores = {0, 0, 0};
  char hex[8];
  for (int b = 0; b < 256; ++b) {
    std::snprintf(hex, sizeof hex, "<0x%02X>", b);
    pieces.emplace_back(hex);
    scores.push_back(0);
  }
  for (char c = ' '; c <= '~'; ++c) {
    pieces.emplace_back(1, c);
    scores.push_back(-1e6f);
  }
  float score = -1;
  for (const char* w : kWords) {
    for (const std::string& p : {std::string(" ") + w, std::string(w)}) {
      if (static_cast<std::int64_t>(pieces.size()) >= vocab_size) break;
      pieces.push_back(p);
      scores.push_back(score--);
    }
  }
  for (int i = 0; static_cast<std::int64_t>(pieces.size()) < vocab_size; ++i) {
    pieces.push_back("<pad" + std::to_string(i) + ">");  // never produced by encode
    scores.push_back(-1e9f);
  }
  return kvdecode::Tokenizer(pieces, std::move(scores), 16);
}

// ---------------------------------------------------------------------------------------------
// Where the weights and the vocabulary come from.

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

struct Source {
  std::string name;  // for the report
  AnyWeights weights;
  std::string stored;  // the format the file keeps its layer matrices in, for the report
  kvdecode::Vocabulary vocabulary;
  std::string default_prompt;
  double load_ms = 0;

  const kvdecode::ModelConfig& config() const {
    return std::visit([](const auto& w) -> const kvdecode::ModelConfig& { return w.config; },
                      weights);
  }
};

/// Whether two files hold the same bytes (the bundled KJV model under any name or path).
bool same_contents(const std::filesystem::path& a, const std::filesystem::path& b) {
  std::error_code ec;
  if (std::filesystem::file_size(a, ec) != std::filesystem::file_size(b, ec) || ec) return false;
  std::ifstream fa(a, std::ios::binary), fb(b, std::ios::binary);
  return std::equal(std::istreambuf_iterator<char>(fa), std::istreambuf_iterator<char>(),
                    std::istreambuf_iterator<char>(fb), std::istreambuf_iterator<char>());
}

Source load_source(const Options& o) {
  namespace fs = std::filesystem;
  using kvdecode::Tokenizer;
  const auto t0 = Clock::now();
  const fs::path kjv = fs::path(KVDECODE_DEFAULT_MODEL_DIR) / "kjv_tiny.bin";
  fs::path model = o.model;
  if (o.model.empty()) {
    model = kjv;
    if (!fs::exists(model)) {
      std::fprintf(stderr, "generate: %s not found; running the demo model\n",
                   model.string().c_str());
      model = std::string(kDemo);
    }
  }
  if (model == kDemo) {
    Tokenizer tokenizer = demo_tokenizer(kvdecode::demo_config().vocab_size);
    return {"demo (random weights)",
            cli::convert_to(kvdecode::demo_weights<float>(), o.weights),
            "f32",
            kvdecode::Vocabulary(std::move(tokenizer)),
            kStoriesPrompt,
            ms_since(t0)};
  }
  const kvdecode::StoredWeights stored = kvdecode::stored_weights(model);
  std::optional<kvdecode::Vocabulary> vocabulary;
  AnyWeights weights = cli::load_as(
      model, o.weights == WeightType::kStored ? cli::weight_type(stored.format) : o.weights,
      vocabulary);
  const std::int64_t vocab_size =
      std::visit([](const auto& w) { return w.config.vocab_size; }, weights);
  // A tokenizer.bin is SentencePiece with run.c's ids: it may stand in for a GGUF file's own
  // "llama" vocabulary, not for a byte-level BPE one (other ids, other special tokens).
  if (vocabulary && vocabulary->kind() == kvdecode::Vocabulary::Kind::kBytePairs &&
      !o.tokenizer.empty())
    throw cli::UsageError{"--tokenizer '" + o.tokenizer + "' is a llama2.c tokenizer.bin, but '" +
                          model.string() +
                          "' has a gpt2 (byte-level BPE) vocabulary of its own; drop --tokenizer"};
  if (vocabulary && o.tokenizer.empty()) {
    return {model.string(),         std::move(weights), stored.matrix_type,
            std::move(*vocabulary), kStoriesPrompt,     ms_since(t0)};
  }
  const fs::path tok =
      o.tokenizer.empty() ? model.parent_path() / "tokenizer.bin" : fs::path(o.tokenizer);
  std::optional<Tokenizer> tokenizer;
  try {
    tokenizer.emplace(Tokenizer::load(tok, vocab_size));
  } catch (const kvdecode::Error& e) {
    throw kvdecode::Error(std::string(e.what()) + " (the checkpoint '" + model.string() +
                          "' has vocab_size " + std::to_string(vocab_size) +
                          "; pass its tokenizer with --tokenizer)");
  }
  // The model's identity, not its path, picks the default prompt (read only when needed).
  std::error_code ec;
  const bool needs_default = !o.prompt && o.prompt_file.empty() && !o.interactive;
  const bool is_kjv = needs_default && fs::exists(kjv, ec) &&
                      (fs::equivalent(model, kjv, ec) || same_contents(model, kjv));
  return {model.string(),
          std::move(weights),
          stored.matrix_type,
          kvdecode::Vocabulary(std::move(*tokenizer)),
          is_kjv ? kKjvPrompt : kStoriesPrompt,
          ms_since(t0)};
}

std::string prompt_text(const Options& o, const Source& src) {
  if (o.prompt) return *o.prompt;
  if (o.prompt_file.empty()) return src.default_prompt;
  std::ifstream f(o.prompt_file, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (text.ends_with('\n')) text.pop_back();  // the newline an editor ends a file with
  KVDECODE_CHECK(!text.empty(), "prompt file '", o.prompt_file, "' is empty");
  return text;
}

// ---------------------------------------------------------------------------------------------
// What the report says about each store: its name and the bytes attention reads per step.

using kvdecode::ContiguousStore;
using kvdecode::Int8Store;
using kvdecode::PagedStore;
using kvdecode::Q2Store;
using kvdecode::Q4Store;
using kvdecode::WindowStore;

/// What the store's memory_bytes() hold.
/// What the report says of a store, from its description: its name, the options that shape it,
/// and what its memory_bytes() hold.
template <class S>
std::string describe(const S& store) {
  const auto o = store.options();
  std::string s(S::kName);
  if constexpr (requires { o.window; })
    s += " " + std::to_string(o.window) + " + " + std::to_string(o.sinks) + " sinks";
  if constexpr (requires { o.group; }) s += ", key groups of " + std::to_string(o.group);
  if constexpr (requires { o.residual; })
    s += ", " + std::to_string(o.residual) + " newest exact" + (o.rotate ? ", rotated" : "");
  if constexpr (requires { o.block_size; }) s += ", blocks of " + std::to_string(o.block_size);
  return s;
}
template <class S>
std::string reserved_for(const S& store) {
  const auto o = store.options();
  if constexpr (requires { o.window; })
    return std::to_string(o.sinks + o.window - 1 + o.max_chunk) +
           " rows (S + W - 1 + chunk), whatever the length";
  return std::to_string(store.capacity()) + " positions";
}

// ---------------------------------------------------------------------------------------------
// Ctrl-C: the generation stops after the current token, the report is printed, exit code 130.

volatile std::sig_atomic_t g_interrupted = 0;
extern "C" void on_sigint(int) { g_interrupted = 1; }

void write_out(std::string_view text) {
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
}

// ---------------------------------------------------------------------------------------------
// Generation over one model and store type.

struct Run {
  const Options& o;
  const Source& src;
  std::vector<std::int32_t> prompt;  // BOS when the vocabulary adds one, the prompt's tokens
  std::uint64_t seed = 0;
  Clock::time_point start;
  const cli::AnyModel* draft = nullptr;  // --draft's model, else none
  std::string draft_name;                // for the report
};

/// The speculation the flags ask for, handed to f(const kvdecode::Speculation&): none, prompt
/// lookup, or the draft model on a contiguous f32 store of its own (the target's context, at
/// most the draft's seq_len; past it the draft proposes nothing).
template <class F>
int with_speculation(const Run& run, std::size_t ctx, std::size_t chunk, kvdecode::ThreadPool& pool,
                     F&& f) {
  using namespace kvdecode;
  const Options& o = run.o;
  if (o.speculate > 0) return f(Speculation::prompt_lookup(o.speculate));
  if (run.draft == nullptr) return f(Speculation{});
  return std::visit(
      [&]<class W>(const Model<float, W>& draft) {
        const ModelConfig& dc = draft.config();
        ContiguousStore<float> store(dc, std::min(ctx, static_cast<std::size_t>(dc.seq_len)));
        Activations<float> act(dc, {.max_chunk = chunk, .thread_pool = &pool});
        DraftModelDrafter<float, W, ContiguousStore<float>> drafter(draft, store, act, o.draft_k);
        return f(Speculation::with_drafter(drafter, o.draft_k));
      },
      *run.draft);
}

/// Restores a saved prompt prefix, runs kvdecode::generate() (saving the cache once the prompt
/// is in), streams the text and reports where the time and the bytes went. One path for every
/// store.
template <class W, kvdecode::KvStore S>
int generate_with(const Run& run, const kvdecode::Model<float, W>& model, S& cache,
                  kvdecode::ThreadPool& pool, std::size_t chunk,
                  const kvdecode::Speculation& speculation) {
  using namespace kvdecode;
  const Options& o = run.o;
  const ModelConfig& cfg = model.config();
  const Vocabulary& vocabulary = run.src.vocabulary;
  const SpecialTokens& specials = vocabulary.specials();
  const std::vector<std::int32_t>& prompt = run.prompt;
  Activations<float> act(
      cfg, {.max_chunk = chunk, .store_scratch = cache.block_scratch_size(), .thread_pool = &pool});
  WorkCounters counters;
  act.counters = &counters;
  SamplerOptions so{o.temperature, o.top_p, o.top_k, run.seed};
  so.min_p = o.min_p;
  so.repeat_penalty = o.repeat_penalty;
  so.repeat_last_n = o.repeat_last_n;
  Sampler sampler(cfg.vocab_size, so);
  std::FILE* out = o.stats_to_stdout ? stdout : stderr;

  // The cache file: the fingerprint of the weights, computed once for restore and save.
  std::optional<ModelFingerprint> fingerprint;
  std::size_t from_file = 0, in_file = 0;
  double load_cache_ms = 0;
  if (!o.load_cache.empty() || !o.save_cache.empty()) fingerprint = model_fingerprint(model);
  if (!o.load_cache.empty()) {
    // The longest common prefix of the saved tokens and the prompt, at most all but the
    // prompt's last token (its logits start the generation).
    const auto t0 = Clock::now();
    in_file = read_cache_file_header(o.load_cache).n_tokens;
    from_file = restore_longest_prefix(*fingerprint, cache, prompt, o.load_cache);
    load_cache_ms = ms_since(t0);
  }

  // Echo the prompt: every piece after BOS (when the vocabulary adds one), whole UTF-8
  // characters only.
  TextStream echo;
  const std::size_t first = !prompt.empty() && prompt[0] == specials.bos_id ? 1 : 0;
  for (std::size_t i = first; i < prompt.size(); ++i)
    write_out(echo.push(vocabulary.shown_text(i > 0 ? prompt[i - 1] : -1, prompt[i])));
  write_out(echo.flush());

  // After the prompt: save the cache, then count the decode steps' work only.
  double save_ms = 0;
  std::size_t saved = 0;
  const auto after_prompt = [&] {
    if (!o.save_cache.empty()) {
      const auto t0 = Clock::now();
      save_cache(*fingerprint, cache, o.save_cache);
      save_ms = ms_since(t0);
    }
    saved = cache.size();
    counters = WorkCounters{};
  };
  // Each token: shown through the TextStream (whole UTF-8 characters, the text before a stop
  // string; the vocabulary's end tokens, BOS as in run.c, a GGUF vocabulary's EOS, end the
  // text, or are skipped with --ignore-bos). Without -n (and
  // --ignore-bos) the text ends at a line end once n tokens are out: the first piece past n that
  // ends in a newline stops it (the newline printed after the text is that one), at most
  // kLineOvershoot tokens past n.
  constexpr std::size_t kLineOvershoot = 128;
  const bool finish_line = !o.n_given && !o.ignore_bos && o.n > 0;
  bool ended_line = false;
  std::size_t tokens_seen = 0;
  std::int32_t prev = prompt.back();
  TextStream text(o.stop);
  // With --stats, the speculative run's tokens, for the plain run that follows it.
  const bool speculating = speculation.kind != Speculation::Kind::kNone;
  const bool compare = speculating && o.stats_to_stdout;
  std::vector<std::int32_t> emitted;
  const auto on_token = [&](std::int32_t token) {
    if (compare) emitted.push_back(token);
    ++tokens_seen;
    if (!specials.ends(token)) {
      const std::string_view piece = vocabulary.shown_text(prev, token);
      ended_line =
          finish_line && tokens_seen > static_cast<std::size_t>(o.n) && piece.ends_with('\n');
      write_out(text.push(ended_line ? piece.substr(0, piece.size() - 1) : piece));
    }
    prev = token;
    return !ended_line && !text.stopped() && g_interrupted == 0;
  };
  GenerationOptions go;
  go.max_new_tokens = o.n < 0       ? std::numeric_limits<std::size_t>::max()
                      : finish_line ? static_cast<std::size_t>(o.n) + kLineOvershoot
                                    : static_cast<std::size_t>(o.n);
  if (!o.ignore_bos) go.stop_tokens = specials.end_tokens();
  go.use_cache = !o.no_cache;
  go.speculation = speculation;
  const GenerationStats st = generate(model, cache, act, std::span(prompt).subspan(from_file),
                                      sampler, go, on_token, after_prompt);
  write_out(text.flush());
  write_out("\n");

  // ---- report ----
  const auto ll = [](auto v) { return static_cast<long long>(v); };
  std::fprintf(out,
               "model              %s (dim %lld, %lld layers, %lld/%lld heads, vocab %lld, "
               "seq_len %lld)\n",
               run.src.name.c_str(), ll(cfg.dim), ll(cfg.n_layers), ll(cfg.n_heads),
               ll(cfg.n_kv_heads), ll(cfg.vocab_size), ll(cfg.seq_len));
  const char* format = std::is_same_v<W, bf16> ? "bf16"
                       : kIsBlockFormat<W>     ? block_format_name<W>()
                                               : "f32";
  std::fprintf(out, "weights            %s, %zu bytes (%s)\n", format, model.weights().bytes(),
               run.src.stored != format ? ("converted on load from " + run.src.stored).c_str()
               : kIsBlockFormat<W>      ? "as stored, rows repacked in groups of 8 on load"
                                        : "as stored");
  std::fprintf(out, "load               %.2f ms (weights and tokenizer)\n", run.src.load_ms);
  const Vocabulary& vocab = run.src.vocabulary;
  const SpecialTokens& sp = vocab.specials();
  std::string ends;
  for (const std::int32_t id : sp.end_tokens())
    ends += (ends.empty() ? "" : " or ") + std::to_string(id);
  std::fprintf(out, "vocabulary         %s, %lld tokens, BOS %d%s, EOS %d; a text ends at %s\n",
               vocab.kind() == Vocabulary::Kind::kBytePairs ? "gpt2 (byte-level BPE)"
                                                            : "llama (SentencePiece)",
               ll(vocab.vocab_size()), sp.bos_id, sp.add_bos ? " (put first)" : "", sp.eos_id,
               ends.empty() ? "no token" : ends.c_str());
  const bool amx =
      std::is_same_v<W, bf16> && active_kernel_set() == KernelSet::kAvx512Bf16 && amx_enabled();
  const std::string panels = model.amx_panel_bytes() > 0
                                 ? " (" + std::to_string(model.amx_panel_bytes()) +
                                       " bytes of weight panels re-laid on load)"
                                 : "";
  const bool pairs =
      detail::packed_pairs_apply<float, W>(active_kernel_set(), static_cast<std::size_t>(cfg.dim));
  std::fprintf(out, "kernels            %s%s\n", active_kernel_set_name(),
               amx     ? (", prefill on AMX tiles" + panels).c_str()
               : pairs ? ", prefill on bf16 pairs (vdpbf16ps)"
                       : "");
  std::fprintf(out, "KV store           %s, %zu bytes reserved for %s\n", describe(cache).c_str(),
               cache.memory_bytes(), reserved_for(cache).c_str());
  {
    // The store's bytes against the f32 cache, per position and for a whole seq_len context.
    const MemoryPlanner<S> plan(cfg, cache.options());
    const MemoryPlanner<ContiguousStore<float>> f32(cfg);
    const auto seq_len = static_cast<std::uint64_t>(cfg.seq_len);
    std::fprintf(out,
                 "                   %.1f bytes per position, %.1f %% of f32; %llu fixed bytes; "
                 "%.1f %% of f32 at seq_len %llu\n",
                 plan.bytes_per_position(),
                 100.0 * plan.bytes_per_position() / f32.bytes_per_position(),
                 static_cast<unsigned long long>(plan.fixed_bytes()),
                 100.0 * static_cast<double>(plan.kv_bytes(seq_len)) /
                     static_cast<double>(f32.kv_bytes(seq_len)),
                 static_cast<unsigned long long>(seq_len));
  }
  std::fprintf(out, "mode               %s, %zu thread(s), prefill chunk %zu\n",
               o.no_cache ? "no cache (full recompute per token)" : "KV cache",
               act.pool == nullptr ? std::size_t{1} : act.pool->size(), act.max_chunk);
  std::fprintf(out,
               "sampling           temperature %g, top-p %g, top-k %lld, min-p %g, repeat "
               "penalty %g (last %zu), seed %llu\n",
               o.temperature, o.top_p, ll(o.top_k), o.min_p, o.repeat_penalty, o.repeat_last_n,
               static_cast<unsigned long long>(run.seed));
  std::fprintf(out, "prompt tokens      %zu", prompt.size());
  if (!o.load_cache.empty())
    std::fprintf(out, " (%zu reused from cache file %s, which held %zu)", from_file,
                 o.load_cache.c_str(), in_file);
  std::fputs("\n", out);
  if (!o.load_cache.empty())
    std::fprintf(out, "cache loaded       in %.2f ms (not in time to first token)\n",
                 load_cache_ms);
  std::fprintf(out, "generated tokens   %zu%s\n", st.generated_tokens,
               g_interrupted    ? " (interrupted)"
               : text.stopped() ? " (stop string)"
               : st.hit_stop_token
                   ? (prev == specials.eos_id ? " (stopped at EOS)" : " (stopped at BOS)")
               : st.hit_capacity ? " (cache full)"
               : ended_line      ? " (end of line)"
                                 : "");
  std::fprintf(out, "prefill            %.2f ms, %.1f tok/s (%zu tokens)\n", st.prefill_ms,
               st.prefill_tokens_per_s(), st.prompt_tokens);
  if (!o.save_cache.empty())
    std::fprintf(out,
                 "cache saved        %s (%zu positions) in %.2f ms (not in time to first token)\n",
                 o.save_cache.c_str(), saved, save_ms);
  std::fprintf(out, "time to first tok  %.2f ms\n", st.ttft_ms - save_ms);
  const std::size_t steps = st.decode_steps();  // all but the first token
  const double tok_s = st.decode_tokens_per_s();
  const double decode_ms = st.decode_ms;
  const double ms_per_token = steps > 0 ? decode_ms / static_cast<double>(steps) : 0.0;
  if (o.no_cache || speculating) {
    // (A verify pass is a prefill of k + 1 tokens: the decode-step byte counts do not cover it.)
    std::fprintf(out, "decode             %.1f tok/s, %.3f ms per token (%zu tokens in %.2f ms)\n",
                 tok_s, ms_per_token, steps, decode_ms);
  } else {
    // Bytes the decode steps streamed, as WorkCounters count them: every weight once per step
    // and the K/V bytes each store says attention read.
    const auto weight_bytes = static_cast<double>(counters.decode.weight_bytes_read);
    const auto kv_bytes_read = static_cast<double>(counters.decode.kv_bytes_read);
    const double bytes = weight_bytes + kv_bytes_read;
    const double per_step = steps > 0 ? 1.0 / static_cast<double>(steps) : 0.0;
    std::fprintf(out,
                 "decode             %.1f tok/s, %.2f GB/s, %.3f ms per token (%zu tokens in "
                 "%.2f ms; per token %.3f MB weights + %.3f MB KV)\n",
                 tok_s, decode_ms > 0 ? bytes / (decode_ms * 1e6) : 0.0, ms_per_token, steps,
                 decode_ms, weight_bytes * per_step / 1e6, kv_bytes_read * per_step / 1e6);
  }
  if (speculating) {
    const std::string drafter = speculation.kind == Speculation::Kind::kPromptLookup
                                    ? "prompt lookup"
                                    : "draft model " + run.draft_name;
    std::fprintf(out,
                 "speculation        %s, k %zu: %zu drafted, %zu accepted (acceptance %.2f), %zu "
                 "target passes, %.2f tokens per pass, drafting %.2f ms\n",
                 drafter.c_str(), std::min(speculation.max_draft, act.max_chunk - 1), st.drafted,
                 st.accepted, st.acceptance_rate(), st.target_passes, st.tokens_per_pass(),
                 st.draft_ms);
  }
  if (compare && g_interrupted == 0 && steps > 0) {
    // Plain decoding of as many tokens, from the same prompt on the same store and threads.
    cache.reset();
    Sampler plain_sampler(cfg.vocab_size, so);
    GenerationOptions plain{.max_new_tokens = st.generated_tokens, .stop_token = -1};
    std::size_t i = 0;
    bool same = true;
    const GenerationStats ps =
        generate(model, cache, act, std::span(prompt), plain_sampler, plain,
                 [&](std::int32_t t) { same = same && i < emitted.size() && emitted[i++] == t; });
    const double plain_tok_s = ps.decode_tokens_per_s();
    std::fprintf(out,
                 "plain decode       %.1f tok/s, %.3f ms per token (%zu tokens in %.2f ms; same "
                 "store and threads, after the run%s)\n",
                 plain_tok_s, ps.decode_ms / static_cast<double>(ps.decode_steps()),
                 ps.decode_steps(), ps.decode_ms,
                 o.temperature > 0 ? ""
                 : same            ? "; identical tokens"
                                   : "; DIFFERENT tokens");
    std::fprintf(out, "speedup            %.2fx decode tok/s with speculation\n",
                 plain_tok_s > 0 ? tok_s / plain_tok_s : 0.0);
  }
  std::fprintf(out, "total              %.2f ms\n", ms_since(run.start));
  return g_interrupted ? 130 : 0;
}

/// Chat: each stdin line is a turn appended to one cache; the answer is generated after it.
template <class W, kvdecode::KvStore S>
int chat_with(const Run& run, const kvdecode::Model<float, W>& model, S& cache,
              kvdecode::ThreadPool& pool, std::size_t chunk,
              const kvdecode::Speculation& speculation) {
  using namespace kvdecode;
  const Options& o = run.o;
  const ModelConfig& cfg = model.config();
  const Vocabulary& vocabulary = run.src.vocabulary;
  const SpecialTokens& specials = vocabulary.specials();
  Activations<float> act(
      cfg, {.max_chunk = chunk, .store_scratch = cache.block_scratch_size(), .thread_pool = &pool});
  SamplerOptions so{o.temperature, o.top_p, o.top_k, run.seed};
  so.min_p = o.min_p;
  so.repeat_penalty = o.repeat_penalty;
  so.repeat_last_n = o.repeat_last_n;
  Sampler sampler(cfg.vocab_size, so);
  GenerationOptions go;
  go.max_new_tokens =
      o.n < 0 ? std::numeric_limits<std::size_t>::max() : static_cast<std::size_t>(o.n);
  if (!o.ignore_bos) go.stop_tokens = specials.end_tokens();
  go.speculation = speculation;
  std::optional<std::int32_t> last;  // the last answer's final token, sampled but not yet fed
  std::string line;
  for (std::size_t turn = 1; std::getline(std::cin, line) && g_interrupted == 0; ++turn) {
    if (line.empty()) continue;
    // The first turn starts as a prompt does; later ones go on from the last answer.
    std::vector<std::int32_t> tokens =
        last ? vocabulary.encode(line, false, false) : vocabulary.encode_prompt(line);
    if (last) tokens.insert(tokens.begin(), *last);
    const std::size_t reused = cache.size();
    if (tokens.size() + 1 > cache.capacity() - cache.size()) {
      std::fprintf(stderr, "[turn %zu: %zu tokens do not fit the %zu positions left; ending]\n",
                   turn, tokens.size(), cache.capacity() - cache.size());
      break;
    }
    std::int32_t prev = tokens.back();
    TextStream text(o.stop);
    const auto on_token = [&](std::int32_t token) {
      if (!specials.ends(token)) write_out(text.push(vocabulary.shown_text(prev, token)));
      prev = token;
      last = token;
      return !text.stopped() && g_interrupted == 0;
    };
    const GenerationStats st = generate(model, cache, act, tokens, sampler, go, on_token);
    write_out(text.flush());
    write_out("\n");
    std::fprintf(stderr,
                 "[turn %zu: %zu tokens prefilled, %zu reused from the cache, %zu generated in "
                 "%.1f ms]\n",
                 turn, st.prompt_tokens, reused, st.generated_tokens, st.prefill_ms + st.decode_ms);
    if (st.hit_capacity) {
      std::fprintf(stderr, "[the cache is full after %zu positions; ending]\n", cache.size());
      break;
    }
  }
  return g_interrupted ? 130 : 0;
}

/// Builds the store the flags ask for and runs the generation over it.
template <class W>
int with_store(const Run& run, const kvdecode::Model<float, W>& model, kvdecode::ThreadPool& pool) {
  using namespace kvdecode;
  const Options& o = run.o;
  const ModelConfig& cfg = model.config();
  const auto seq_len = static_cast<std::size_t>(cfg.seq_len);
  if (o.ctx > seq_len)
    throw cli::UsageError{"--ctx-size " + std::to_string(o.ctx) + " exceeds the model's seq_len " +
                          std::to_string(seq_len)};
  const std::size_t ctx = o.ctx > 0 ? o.ctx : seq_len;
  // A chunk longer than the prompt or the context reserves activations nothing uses.
  const std::size_t longest = o.interactive ? ctx : std::min(ctx, run.prompt.size());
  std::size_t chunk = std::max<std::size_t>(1, std::min(o.chunk, longest));
  if (!o.interactive && run.prompt.size() > ctx)
    throw cli::UsageError{"the prompt has " + std::to_string(run.prompt.size()) +
                          " tokens but the context holds " + std::to_string(ctx) +
                          " (see --ctx-size, or use --window)"};
  // A verification pass runs k + 1 tokens through the Activations (and a window's ring).
  const std::size_t k = o.speculate > 0 ? o.speculate : run.draft != nullptr ? o.draft_k : 0;
  if (k > 0 && o.window == 0 && k + 1 > ctx)
    throw cli::UsageError{"--speculate and --draft run k + 1 = " + std::to_string(k + 1) +
                          " tokens per pass but the context holds " + std::to_string(ctx)};
  const auto go = [&](auto& store) {
    return with_speculation(run, ctx, chunk, pool, [&](const Speculation& speculation) {
      return o.interactive ? chat_with(run, model, store, pool, chunk, speculation)
                           : generate_with(run, model, store, pool, chunk, speculation);
    });
  };
  if (o.window > 0) {
    const std::size_t sinks = o.sinks.value_or(4);
    if (o.window > seq_len || sinks > seq_len - o.window)
      throw cli::UsageError{"--sinks + --window = " + std::to_string(sinks + o.window) +
                            " exceeds the model's seq_len " + std::to_string(seq_len)};
    // No prefill chunk is longer than S + W (generate() feeds the rest of a longer prompt one
    // token at a time), and the ring's size grows with the chunk. It does not depend on the
    // prompt, so a saved window cache restores for any prompt (its ring has the same shape).
    chunk = std::max<std::size_t>(1, std::min(o.chunk, sinks + o.window));
    if (k + 1 > sinks + o.window)
      throw cli::UsageError{
          "--speculate and --draft run k + 1 = " + std::to_string(k + 1) +
          " tokens per pass but --sinks + --window = " + std::to_string(sinks + o.window)};
  }
  chunk = std::max(chunk, k + 1);
  return with_store_type(o, [&]<class S>(std::type_identity<S>) -> int {
    // The store's options from the flags, by what the options hold (not by the store's type).
    typename S::Options so{};
    so.capacity = ctx;
    if constexpr (requires { so.window; }) {
      so.window = o.window;
      so.sinks = o.sinks.value_or(4);
      so.policy = WindowPolicy::kStreaming;
      so.max_chunk = chunk;
      // No length limit: only the token ids grow (4 bytes a position), never reserved ahead.
      so.capacity = kUnboundedPositions;
    }
    if constexpr (requires { so.block_size; }) so.block_size = o.block_size;
    if constexpr (requires { so.residual; }) o.low_bit.apply(so);
    S store(cfg, so);
    return go(store);
  });
}

int run(const Options& o) {
  using namespace kvdecode;
  const auto start = Clock::now();
  check(o);
  Source src = load_source(o);
  Run r{o, src, {}, 0, start, nullptr, {}};
  if (!o.interactive) {
    r.prompt = src.vocabulary.encode_prompt(prompt_text(o, src));
  }
  r.seed = o.seed > 0 ? static_cast<std::uint64_t>(o.seed)
                      : (std::uint64_t{std::random_device{}()} << 32 | std::random_device{}()) | 1;
  // The draft model, checked against the target's vocabulary before anything runs.
  std::optional<cli::AnyModel> draft;
  if (!o.draft.empty()) {
    cli::AnyWeights dw;
    if (o.draft == kDemo) {
      dw = cli::convert_to(demo_weights<float>(), o.draft_weights);
    } else {
      try {
        std::optional<Vocabulary> unused;  // a draft shares the target's vocabulary
        dw = cli::load_as(o.draft, o.draft_weights, unused);
      } catch (const Error& e) {
        std::string message = e.what();  // "kvdecode: <what> [file:line]", kept for --verbose
        if (message.starts_with("kvdecode: ")) message.erase(0, 10);
        throw Error("kvdecode: --draft: " + message);
      }
    }
    const ModelConfig dc = std::visit([](const auto& w) { return w.config; }, dw);
    if (dc.vocab_size != src.config().vocab_size)
      throw Error("--draft: the draft model '" + o.draft + "' has vocab_size " +
                  std::to_string(dc.vocab_size) + " but the model '" + src.name +
                  "' has vocab_size " + std::to_string(src.config().vocab_size) +
                  "; a draft must share the target's vocabulary");
    r.draft_name = o.draft + " (dim " + std::to_string(dc.dim) + ", " +
                   std::to_string(dc.n_layers) + " layers, weights " + cli::weight_name(dw) + ")";
    cli::emplace_model(draft, std::move(dw));
    r.draft = &*draft;
  }
  ThreadPool pool(o.threads);
  // No SA_RESTART: a Ctrl-C while the chat waits for a line ends the wait too.
  struct sigaction sa = {};
  sa.sa_handler = on_sigint;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, nullptr);
  // The model takes the weights over, in the format they were loaded in.
  return std::visit(
      [&]<class W>(Weights<W>& w) {
        const Model<float, W> model(std::exchange(w, {}));
        return with_store(r, model, pool);
      },
      src.weights);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"", "generate"};
  cli::configure(app, KVDECODE_VERSION);
  declare(app, o);
  return cli::run_main(app, argc, argv, o.verbose, [&] {
    o.n_given = app.get_option("-n")->count() > 0;
    o.draft_k_given = app.get_option("--draft-k")->count() > 0;
    o.draft_weights_given = app.get_option("--draft-weights")->count() > 0;
    return run(o);
  });
}
