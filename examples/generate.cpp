// generate: text generation with kvdecode, streaming tokens as they are sampled and reporting
// where the time and the memory traffic went. Runs the bundled KJV model by default, any
// llama2.c checkpoint, or a built-in random model; every store and weight type of the library.
//
//   generate [--model FILE|builtin] [--tokenizer FILE] [--prompt TEXT] [-n N]
//            [--temperature T] [--top-p P] [--top-k K] [--seed S] [--ignore-bos]
//            [--threads N] [--chunk N]
//            [--weights f32|bf16] [--kv f32|int8|q4] [--window W] [--sinks S]
//            [--save-cache FILE] [--load-cache FILE] [--no-cache] [--stats] [--help]
//
// The data path: prompt text → token ids → Model::prefill into the KV store → logits → Sampler
// → token → Model::decode (one token against the store) → logits → ... The store and weight
// types are compile-time parameters of the model; the flags pick them once, in run().
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <kvdecode/io/cache_file.hpp>
#include <kvdecode/io/checkpoint.hpp>
#include <kvdecode/kvdecode.hpp>
#include <kvdecode/tokenizer.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cli.hpp"

#ifndef KVDECODE_DEFAULT_MODEL_DIR  // set by examples/CMakeLists.txt to the repository's models/
#define KVDECODE_DEFAULT_MODEL_DIR "models"
#endif

namespace {

constexpr const char* kUsage = R"(usage: generate [options]

Generates text with a KV-cached transformer, streaming it to stdout, then reports the prompt and
decode speed, the bytes a decode step reads (GB/s) and the cache size on stderr.

Model
  --model FILE        llama2.c checkpoint (v0 format), e.g. stories15M.bin. Default: the bundled
                      models/kjv_tiny.bin (2.36M parameters trained on the King James Bible).
                      "builtin": a small model with deterministic random weights (its text is
                      noise, its timings are real); also used when kjv_tiny.bin is missing.
  --tokenizer FILE    llama2.c tokenizer.bin (default: tokenizer.bin beside the model)
  --weights TYPE      f32 (default) or bf16: weights rounded to bfloat16, half the bytes a
                      decode step reads; arithmetic stays f32

Text
  --prompt TEXT       prompt (default "And it came to pass" for the KJV model, "Once upon a
                      time" for the others)
  -n N                tokens to generate; stops earlier at BOS or a full cache. Default 256,
                      then on to the end of the line in progress (a verse of the KJV model;
                      at most 128 tokens more) unless --ignore-bos
  --ignore-bos        go on after a BOS token (not printed) instead of ending the text, so
                      that exactly N tokens are generated (benchmarks, tests)
  --temperature T     0 = greedy (default 0.8: the KJV model invents about 1 word in 250 at
                      0.8, 1 in 110 at 1.0, and still varies)
  --top-p P           nucleus sampling mass, 0 or 1 disables (default 0.9)
  --top-k K           keep the K most likely tokens, 0 disables (default 0)
  --seed S            sampler seed, > 0 (default 42)

KV cache
  --kv TYPE           f32 (default), int8 (one f32 scale per row, ~27 % of f32 at head_size
                      64) or q4 (4-bit, per-channel key groups, ~15 %)
  --window W          streaming window (StreamingLLM): keep the last W positions plus the
                      sinks; generation goes on past the model's seq_len with bounded memory.
                      Needs S + W <= seq_len; f32 only
  --sinks S           first positions kept forever with --window (default 4)
  --save-cache FILE   after the prompt is prefilled, save the cache to FILE (f32 store only)
  --load-cache FILE   start from the cache in FILE: its tokens must be a prefix of the prompt's,
                      and only the rest of the prompt is prefilled (f32 store only)
  --no-cache          recompute the whole sequence for every token (what a KV cache saves)

Run
  --threads N         threads for every forward step (default 1)
  --chunk N           prefill chunk: tokens per forward pass of the prompt (default 128)
  --stats             print the report on stdout instead of stderr
  --help              this text

Exit codes: 0 done, 1 an error (a missing or corrupt file), 2 a bad command line; either
error is one line on stderr.
)";

constexpr std::string_view kBuiltin = "builtin";

enum class WeightType { kF32, kBf16 };
enum class KvType { kF32, kInt8, kQ4 };

struct Options {
  std::string model;  // "" = the bundled KJV model, kBuiltin = the random one, else a file
  std::string tokenizer;
  std::optional<std::string> prompt;  // unset: the model's default prompt
  std::size_t n = 256;
  bool n_given = false;  // -n N: exactly N tokens; default: n, then to the end of the line
  double temperature = 0.8;
  double top_p = 0.9;
  std::int64_t top_k = 0;
  std::uint64_t seed = 42;
  std::size_t threads = 1;
  std::size_t chunk = 128;
  WeightType weights = WeightType::kF32;
  KvType kv = KvType::kF32;
  std::size_t window = 0;  // 0 = no window
  std::optional<std::size_t> sinks;
  std::string save_cache;
  std::string load_cache;
  bool ignore_bos = false;
  bool no_cache = false;
  bool stats_to_stdout = false;
};

Options parse(int argc, char** argv) {
  Options o;
  for (cli::Args args(argc, argv); args.next();) {
    const std::string_view a = args.flag();
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (a == "--model") {
      o.model = args.value();
    } else if (a == "--tokenizer") {
      o.tokenizer = args.value();
    } else if (a == "--prompt") {
      o.prompt = std::string(args.value());
    } else if (a == "-n") {
      o.n = args.number<std::size_t>();
      o.n_given = true;
    } else if (a == "--temperature") {
      o.temperature = args.number<double>();
    } else if (a == "--top-p") {
      o.top_p = args.number<double>();
    } else if (a == "--top-k") {
      o.top_k = args.number<std::int64_t>();
    } else if (a == "--seed") {
      o.seed = args.number<std::uint64_t>();
    } else if (a == "--threads") {
      o.threads = args.number<std::size_t>();
    } else if (a == "--chunk") {
      o.chunk = args.number<std::size_t>();
    } else if (a == "--weights") {
      o.weights = args.choice<WeightType>({{"f32", WeightType::kF32}, {"bf16", WeightType::kBf16}});
    } else if (a == "--kv") {
      o.kv = args.choice<KvType>(
          {{"f32", KvType::kF32}, {"int8", KvType::kInt8}, {"q4", KvType::kQ4}});
    } else if (a == "--window") {
      o.window = args.number<std::size_t>();
      if (o.window == 0) throw cli::UsageError{"--window must be >= 1"};
    } else if (a == "--sinks") {
      o.sinks = args.number<std::size_t>();
    } else if (a == "--save-cache") {
      o.save_cache = args.value();
    } else if (a == "--load-cache") {
      o.load_cache = args.value();
    } else if (a == "--ignore-bos") {
      o.ignore_bos = true;
    } else if (a == "--no-cache") {
      o.no_cache = true;
    } else if (a == "--stats") {
      o.stats_to_stdout = true;
    } else {
      args.unknown();
    }
  }
  using cli::UsageError;
  if (o.temperature < 0) throw UsageError{"--temperature must be >= 0"};
  if (o.top_k < 0) throw UsageError{"--top-k must be >= 0"};
  if (o.seed == 0) throw UsageError{"--seed must be > 0"};
  if (o.threads == 0) throw UsageError{"--threads must be >= 1"};
  if (o.chunk == 0) throw UsageError{"--chunk must be >= 1"};
  if (!o.tokenizer.empty() && (o.model.empty() || o.model == kBuiltin))
    throw UsageError{
        "--tokenizer needs --model FILE (the vocabulary size comes from the checkpoint)"};
  if (o.sinks && o.window == 0) throw UsageError{"--sinks needs --window"};
  if (o.window > 0 && o.kv != KvType::kF32)
    throw UsageError{"--window keeps f32 rows and cannot be combined with --kv int8 or q4"};
  if (o.window > 0 && o.no_cache)
    throw UsageError{"--no-cache recomputes everything; it cannot be combined with --window"};
  const bool cache_file = !o.save_cache.empty() || !o.load_cache.empty();
  if (cache_file && (o.kv != KvType::kF32 || o.window > 0))
    throw UsageError{
        "--save-cache and --load-cache need the f32 store (no --kv int8/q4, no --window)"};
  if (cache_file && o.no_cache)
    throw UsageError{"--save-cache and --load-cache cannot be combined with --no-cache"};
  return o;
}

// ---------------------------------------------------------------------------------------------
// The built-in model: llama2.c's tokenizer layout (<unk>, BOS, EOS, 256 byte tokens, printable
// ASCII) plus common English pieces, and GQA weights drawn from a fixed seed.

kvdecode::ModelConfig builtin_config() {
  kvdecode::ModelConfig c;
  c.dim = 256;
  c.hidden_dim = 768;
  c.n_layers = 4;
  c.n_heads = 8;
  c.n_kv_heads = 4;
  c.vocab_size = 512;
  c.seq_len = 1024;
  return c;
}

kvdecode::Tokenizer builtin_tokenizer(std::int64_t vocab_size) {
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

struct Source {
  std::string name;  // for the report
  kvdecode::Weights<float> weights;
  kvdecode::Tokenizer tokenizer;
  std::vector<std::int32_t> prompt;  // [prompt tokens] BOS, then --prompt or the model's default
};

Source load_source(const Options& o) {
  namespace fs = std::filesystem;
  using kvdecode::Tokenizer;
  fs::path model = o.model;
  std::string default_prompt = "Once upon a time";
  if (o.model.empty()) {
    model = fs::path(KVDECODE_DEFAULT_MODEL_DIR) / "kjv_tiny.bin";
    if (!fs::exists(model)) {
      std::fprintf(stderr, "generate: %s not found; running the built-in random model\n",
                   model.string().c_str());
      model = std::string(kBuiltin);
    } else {
      default_prompt = "And it came to pass";
    }
  }
  const std::string text = o.prompt.value_or(default_prompt);
  if (model == kBuiltin) {
    Tokenizer tokenizer = builtin_tokenizer(builtin_config().vocab_size);
    std::vector<std::int32_t> ids = tokenizer.encode(text, /*bos=*/true);
    return {"built-in random", kvdecode::random_weights<float>(builtin_config(), 2026),
            std::move(tokenizer), std::move(ids)};
  }
  kvdecode::Weights<float> weights = kvdecode::load_checkpoint(model);
  const fs::path tok =
      o.tokenizer.empty() ? model.parent_path() / "tokenizer.bin" : fs::path(o.tokenizer);
  Tokenizer tokenizer = Tokenizer::load(tok, weights.config.vocab_size);
  std::vector<std::int32_t> ids = tokenizer.encode(text, /*bos=*/true);
  return {model.string(), std::move(weights), std::move(tokenizer), std::move(ids)};
}

// ---------------------------------------------------------------------------------------------
// What the report says about each store: its name and the bytes attention reads per step.

using kvdecode::ContiguousStore;
using kvdecode::Int8Store;
using kvdecode::Q4Store;
using kvdecode::WindowStore;

/// Bytes of K and V one cached position holds over all layers and kv heads.
double kv_bytes_per_position(const ContiguousStore<float>&, const kvdecode::ModelConfig& c) {
  return 2.0 * static_cast<double>(c.n_layers * c.kv_dim()) * sizeof(float);
}
double kv_bytes_per_position(const WindowStore<float>&, const kvdecode::ModelConfig& c) {
  return 2.0 * static_cast<double>(c.n_layers * c.kv_dim()) * sizeof(float);
}
double kv_bytes_per_position(const Int8Store<float>&, const kvdecode::ModelConfig& c) {
  return static_cast<double>(Int8Store<float>::bytes_per_token(c));
}
double kv_bytes_per_position(const Q4Store<float>&, const kvdecode::ModelConfig& c) {
  return Q4Store<float>::bytes_per_token(c);  // key-group metadata amortised over a group
}

/// Positions the newest query attends to: the whole cache, or the sinks and the window.
template <class S>
std::size_t positions_attended(const S& store) {
  return store.size();
}
std::size_t positions_attended(const WindowStore<float>& store) {
  return std::min(store.size(), store.sinks() + store.window());
}

/// Tokens per prefill pass: --chunk, or what the window's ring was sized for.
template <class S>
std::size_t prefill_chunk(const S&, std::size_t chunk) {
  return chunk;
}
std::size_t prefill_chunk(const WindowStore<float>& s, std::size_t) { return s.max_chunk(); }

/// What the store's memory_bytes() hold.
template <class S>
std::string reserved_for(const S& store) {
  return std::to_string(store.capacity()) + " positions";
}
std::string reserved_for(const WindowStore<float>& s) {
  return std::to_string(s.sinks() + s.window() - 1 + s.max_chunk()) +
         " rows (S + W - 1 + chunk), whatever the length";
}

std::string describe(const ContiguousStore<float>&) { return "f32 (ContiguousStore)"; }
std::string describe(const Int8Store<float>&) { return "int8 (Int8Store, f32 scale per row)"; }
std::string describe(const Q4Store<float>&) { return "q4 (Q4Store, key groups of 64)"; }
std::string describe(const WindowStore<float>& s) {
  return "f32 window " + std::to_string(s.window()) + " + " + std::to_string(s.sinks()) +
         " sinks (WindowStore, streaming)";
}

// ---------------------------------------------------------------------------------------------
// Generation over one model and store type.

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

/// Restores a saved prompt prefix, runs kvdecode::generate() (saving the cache once the prompt
/// is in), streams the text and reports where the time and the bytes went.
template <class W, kvdecode::KvStore S>
int generate_with(const Options& o, const Source& src, const kvdecode::Model<float, W>& model,
                  S& cache, kvdecode::ThreadPool& pool) {
  using namespace kvdecode;
  const ModelConfig& cfg = model.config();
  const Tokenizer& tokenizer = src.tokenizer;
  const std::vector<std::int32_t>& prompt = src.prompt;
  Activations<float> act(cfg, prefill_chunk(cache, o.chunk), cache.block_scratch_size(), &pool);
  WorkCounters counters;
  act.counters = &counters;
  Sampler sampler(cfg.vocab_size, SamplerOptions{o.temperature, o.top_p, o.top_k, o.seed});

  // Restore a saved prefix of the prompt (checked against the prompt's tokens) and its
  // fingerprint of the weights, computed once for both restore and save.
  std::optional<ModelFingerprint> fingerprint;
  if (!o.load_cache.empty() || !o.save_cache.empty()) fingerprint = model_fingerprint(model);
  std::size_t from_file = 0;
  if (!o.load_cache.empty()) {
    if constexpr (std::is_same_v<S, ContiguousStore<float>>) {
      from_file = restore_prompt_prefix(*fingerprint, cache, prompt, o.load_cache);
    }
  }

  KVDECODE_CHECK(prompt.size() - from_file <= cache.capacity() - cache.size(), "the prompt has ",
                 prompt.size(), " tokens but the cache holds at most ", cache.capacity());

  // Echo the prompt as run.c does: every piece after BOS, through its safe_printf rule.
  for (std::size_t i = 1; i < prompt.size(); ++i)
    std::fputs(
        std::string(Tokenizer::printed_text(tokenizer.decode(prompt[i - 1], prompt[i]))).c_str(),
        stdout);
  std::fflush(stdout);

  // After the prompt: save the cache, then count the decode steps' work only.
  double save_ms = 0;
  std::size_t saved = 0;
  const auto after_prompt = [&] {
    if (!o.save_cache.empty()) {
      if constexpr (std::is_same_v<S, ContiguousStore<float>>) {
        const auto t0 = Clock::now();
        save_cache(*fingerprint, cache, o.save_cache);
        save_ms = ms_since(t0);
      }
    }
    saved = cache.size();
    counters = WorkCounters{};
  };
  // Each token: print it (a BOS ends the text as in run.c, or is skipped with --ignore-bos),
  // and add the K/V bytes the decode step that produced it read (every token but the first).
  // Without -n (and --ignore-bos) the text ends at a line end once n tokens are out: the first
  // piece past n that ends in a newline stops it (the newline printed after the text is that
  // one), at most kLineOvershoot tokens past n.
  constexpr std::size_t kLineOvershoot = 128;
  const bool finish_line = !o.n_given && !o.ignore_bos;
  bool ended_line = false;
  double kv_bytes_read = 0;
  std::size_t tokens_seen = 0;
  std::int32_t prev = prompt.back();
  const auto on_token = [&](std::int32_t token) {
    if (tokens_seen++ > 0 && !o.no_cache)
      kv_bytes_read +=
          static_cast<double>(positions_attended(cache)) * kv_bytes_per_position(cache, cfg);
    if (token != Tokenizer::kBos) {
      const std::string_view text = Tokenizer::printed_text(tokenizer.decode(prev, token));
      ended_line = finish_line && tokens_seen > o.n && text.ends_with('\n');
      const std::string_view shown = ended_line ? text.substr(0, text.size() - 1) : text;
      std::fwrite(shown.data(), 1, shown.size(), stdout);
      std::fflush(stdout);
    }
    prev = token;
    return !ended_line;
  };
  GenerationOptions go;
  go.max_new_tokens = finish_line ? o.n + kLineOvershoot : o.n;
  go.stop_token = o.ignore_bos ? -1 : Tokenizer::kBos;
  go.use_cache = !o.no_cache;
  const GenerationStats st = generate(model, cache, act, std::span(prompt).subspan(from_file),
                                      sampler, go, on_token, after_prompt);
  std::fputs("\n", stdout);
  std::fflush(stdout);

  // ---- report ----
  std::FILE* out = o.stats_to_stdout ? stdout : stderr;
  const auto ll = [](auto v) { return static_cast<long long>(v); };
  std::fprintf(out,
               "model              %s (dim %lld, %lld layers, %lld/%lld heads, vocab %lld, "
               "seq_len %lld)\n",
               src.name.c_str(), ll(cfg.dim), ll(cfg.n_layers), ll(cfg.n_heads), ll(cfg.n_kv_heads),
               ll(cfg.vocab_size), ll(cfg.seq_len));
  std::fprintf(out, "weights            %s, %zu bytes\n", std::is_same_v<W, bf16> ? "bf16" : "f32",
               model.weights().bytes());
  std::fprintf(out, "KV store           %s, %zu bytes reserved for %s\n", describe(cache).c_str(),
               cache.memory_bytes(), reserved_for(cache).c_str());
  if constexpr (std::is_same_v<S, ContiguousStore<float>>) {
    const std::size_t formula = 2 * static_cast<std::size_t>(cfg.n_layers) * cache.capacity() *
                                static_cast<std::size_t>(cfg.kv_dim()) * sizeof(float);
    std::fprintf(out,
                 "                   formula 2 x %lld layers x %zu positions x %lld kv_dim x 4 B "
                 "= %zu\n",
                 ll(cfg.n_layers), cache.capacity(), ll(cfg.kv_dim()), formula);
  }
  std::fprintf(out, "mode               %s, %zu thread(s)\n",
               o.no_cache ? "no cache (full recompute per token)" : "KV cache",
               act.pool == nullptr ? std::size_t{1} : act.pool->size());
  std::fprintf(out, "sampling           temperature %g, top-p %g, top-k %lld, seed %llu\n",
               o.temperature, o.top_p, ll(o.top_k), static_cast<unsigned long long>(o.seed));
  std::fprintf(out, "prompt tokens      %zu", prompt.size());
  if (!o.load_cache.empty())
    std::fprintf(out, " (%zu from cache file %s)", from_file, o.load_cache.c_str());
  std::fputs("\n", out);
  std::fprintf(out, "generated tokens   %zu%s\n", st.generated_tokens,
               st.hit_stop_token ? " (stopped at BOS)"
               : st.hit_capacity ? " (cache full)"
               : ended_line      ? " (end of line)"
                                 : "");
  std::fprintf(out, "prefill            %.2f ms, %.1f tok/s (%zu tokens)\n", st.prefill_ms,
               st.prefill_tokens_per_s(), st.prompt_tokens);
  if (!o.save_cache.empty())
    std::fprintf(out, "cache saved        %s (%zu positions) in %.2f ms\n", o.save_cache.c_str(),
                 saved, save_ms);
  std::fprintf(out, "time to first tok  %.2f ms\n", st.ttft_ms);
  const std::size_t steps = st.decode_steps();  // all but the first token
  const double tok_s = st.decode_tokens_per_s();
  const double decode_ms = st.decode_ms;
  if (o.no_cache) {
    std::fprintf(out, "decode             %.1f tok/s (%zu tokens in %.2f ms)\n", tok_s, steps,
                 decode_ms);
  } else {
    // Bytes the decode steps streamed: every weight once per step (WorkCounters counts them
    // exactly) plus the store's bytes for every position attended. (WorkCounters' own
    // kv_bytes_read counts f32 rows of the whole history, what ContiguousStore reads and equal
    // to kv_bytes_read here for it; the int8, q4 and window stores read fewer bytes.)
    const auto weight_bytes = static_cast<double>(counters.decode.weight_bytes_read);
    const double bytes = weight_bytes + kv_bytes_read;
    const double per_step = steps > 0 ? 1.0 / static_cast<double>(steps) : 0.0;
    std::fprintf(out,
                 "decode             %.1f tok/s, %.2f GB/s (%zu tokens in %.2f ms; per token "
                 "%.3f MB weights + %.3f MB KV)\n",
                 tok_s, decode_ms > 0 ? bytes / (decode_ms * 1e6) : 0.0, steps, decode_ms,
                 weight_bytes * per_step / 1e6, kv_bytes_read * per_step / 1e6);
  }
  return 0;
}

/// Builds the store the flags ask for and runs the generation over it: the one place a runtime
/// choice becomes a type.
template <class W>
int generate_with_store(const Options& o, const Source& src, const kvdecode::Model<float, W>& model,
                        kvdecode::ThreadPool& pool) {
  using namespace kvdecode;
  const ModelConfig& cfg = model.config();
  if (o.window > 0) {
    const std::size_t sinks = o.sinks.value_or(4);
    if (sinks + o.window > static_cast<std::size_t>(cfg.seq_len))
      throw cli::UsageError{"--sinks + --window = " + std::to_string(sinks + o.window) +
                            " exceeds the model's seq_len " + std::to_string(cfg.seq_len)};
    WindowOptions wo;
    wo.window = o.window;
    wo.sinks = sinks;
    wo.policy = WindowPolicy::kStreaming;
    // No prefill chunk is longer than S + W (generate() feeds the rest of a longer prompt
    // one token at a time), and the ring's size grows with the chunk.
    wo.max_chunk = std::min(o.chunk, sinks + o.window);
    // Only the token ids (4 bytes each) grow with the length; K and V stay S + W - 1 + chunk.
    wo.max_positions = src.prompt.size() + o.n;
    WindowStore<float> store(cfg, wo);
    return generate_with(o, src, model, store, pool);
  }
  switch (o.kv) {
    case KvType::kInt8: {
      Int8Store<float> store(cfg);
      return generate_with(o, src, model, store, pool);
    }
    case KvType::kQ4: {
      Q4Store<float> store(cfg);
      return generate_with(o, src, model, store, pool);
    }
    case KvType::kF32:
      break;
  }
  ContiguousStore<float> store(cfg);
  return generate_with(o, src, model, store, pool);
}

int run(const Options& o) {
  using namespace kvdecode;
  Source src = load_source(o);
  ThreadPool pool(o.threads);
  // The model takes the weights over (bf16: rounded copies; the f32 ones are freed here).
  if (o.weights == WeightType::kBf16) {
    const Model<float, bf16> model(convert_weights<bf16>(std::exchange(src.weights, {})));
    return generate_with_store(o, src, model, pool);
  }
  const Model<float> model(std::exchange(src.weights, {}));
  return generate_with_store(o, src, model, pool);
}

}  // namespace

int main(int argc, char** argv) {
  return cli::run_main("generate", [&] { return run(parse(argc, argv)); });
}
