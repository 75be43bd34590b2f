// generate: text generation with kvdecode, streaming tokens as they are sampled and reporting
// where the time went. Runs llama2.c checkpoints, or a built-in model when given none.
//
//   generate [--model FILE --tokenizer FILE] [--prompt TEXT] [-n N] [--temperature T]
//            [--top-p P] [--top-k K] [--seed S] [--threads N] [--chunk N] [--no-cache]
//            [--stats] [--help]
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <kvdecode/io/checkpoint.hpp>
#include <kvdecode/kvdecode.hpp>
#include <kvdecode/tokenizer.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace {

constexpr const char* kUsage = R"(usage: generate [options]

Generates text with a KV-cached transformer. Without --model it runs a small built-in model with
deterministic random weights (its text is noise, but the timings are real).

  --model FILE        llama2.c checkpoint (v0 format), e.g. stories15M.bin
  --tokenizer FILE    llama2.c tokenizer.bin (default: tokenizer.bin beside the model)
  --prompt TEXT       prompt (default "Once upon a time")
  -n N                tokens to generate (default 256); stops earlier at BOS or a full cache
  --temperature T     0 = greedy (default 1.0)
  --top-p P           nucleus sampling mass, 0 or 1 disables (default 0.9)
  --top-k K           keep the K most likely tokens, 0 disables (default 0)
  --seed S            sampler seed, > 0 (default 42)
  --threads N         worker threads (default 1)
  --chunk N           prefill chunk: tokens per forward pass of the prompt (default 128)
  --no-cache          recompute the whole sequence for every token (what a KV cache saves)
  --stats             print the report on stdout instead of stderr
  --help              this text
)";

struct Options {
  std::string model;
  std::string tokenizer;
  std::string prompt = "Once upon a time";
  std::size_t n = 256;
  double temperature = 1.0;
  double top_p = 0.9;
  std::int64_t top_k = 0;
  std::uint64_t seed = 42;
  std::size_t threads = 1;
  std::size_t chunk = 128;
  bool no_cache = false;
  bool stats_to_stdout = false;
};

struct UsageError {
  std::string message;
};

template <class N>
N parse_number(std::string_view flag, std::string_view text) {
  N value{};
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size())
    throw UsageError{std::string(flag) + " expects a number, got '" + std::string(text) + "'"};
  return value;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    const auto value = [&]() -> std::string_view {
      if (i + 1 >= argc) throw UsageError{std::string(a) + " needs a value"};
      return argv[++i];
    };
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (a == "--model") {
      o.model = value();
    } else if (a == "--tokenizer") {
      o.tokenizer = value();
    } else if (a == "--prompt") {
      o.prompt = value();
    } else if (a == "-n") {
      o.n = parse_number<std::size_t>(a, value());
    } else if (a == "--temperature") {
      o.temperature = parse_number<double>(a, value());
    } else if (a == "--top-p") {
      o.top_p = parse_number<double>(a, value());
    } else if (a == "--top-k") {
      o.top_k = parse_number<std::int64_t>(a, value());
    } else if (a == "--seed") {
      o.seed = parse_number<std::uint64_t>(a, value());
    } else if (a == "--threads") {
      o.threads = parse_number<std::size_t>(a, value());
    } else if (a == "--chunk") {
      o.chunk = parse_number<std::size_t>(a, value());
    } else if (a == "--no-cache") {
      o.no_cache = true;
    } else if (a == "--stats") {
      o.stats_to_stdout = true;
    } else {
      throw UsageError{"unknown argument '" + std::string(a) + "'"};
    }
  }
  if (o.temperature < 0) throw UsageError{"--temperature must be >= 0"};
  if (o.top_k < 0) throw UsageError{"--top-k must be >= 0"};
  if (o.seed == 0) throw UsageError{"--seed must be > 0"};
  if (o.threads == 0) throw UsageError{"--threads must be >= 1"};
  if (o.chunk == 0) throw UsageError{"--chunk must be >= 1"};
  if (!o.tokenizer.empty() && o.model.empty())
    throw UsageError{"--tokenizer needs --model (the vocabulary size comes from the checkpoint)"};
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

int run(const Options& o) {
  using namespace kvdecode;
  std::optional<Model<float>> model;
  std::optional<Tokenizer> tokenizer;
  if (o.model.empty()) {
    model.emplace(random_weights<float>(builtin_config(), 2026));
    tokenizer.emplace(builtin_tokenizer(builtin_config().vocab_size));
  } else {
    model.emplace(load_checkpoint(o.model));
    const std::filesystem::path tok =
        o.tokenizer.empty() ? std::filesystem::path(o.model).parent_path() / "tokenizer.bin"
                            : std::filesystem::path(o.tokenizer);
    tokenizer.emplace(Tokenizer::load(tok, model->config().vocab_size));
  }
  const ModelConfig& cfg = model->config();

  const std::vector<std::int32_t> prompt = tokenizer->encode(o.prompt, /*bos=*/true);
  ContiguousStore<float> cache(cfg);
  Activations<float> act(cfg, o.chunk);
  Sampler sampler(cfg.vocab_size, SamplerOptions{o.temperature, o.top_p, o.top_k, o.seed});
  GenerationOptions gen;
  gen.max_new_tokens = o.n;
  gen.stop_token = Tokenizer::kBos;  // as run.c: a BOS ends the text
  gen.use_cache = !o.no_cache;

  // Echo the prompt as run.c does: every piece after BOS, through its safe_printf rule.
  for (std::size_t i = 1; i < prompt.size(); ++i)
    std::fputs(
        std::string(Tokenizer::printed_text(tokenizer->decode(prompt[i - 1], prompt[i]))).c_str(),
        stdout);
  std::fflush(stdout);
  std::int32_t prev = prompt.back();
  const GenerationStats st = generate(*model, cache, act, std::span<const std::int32_t>(prompt),
                                      sampler, gen, [&](std::int32_t token) {
                                        if (token == Tokenizer::kBos) return;
                                        const std::string_view text =
                                            Tokenizer::printed_text(tokenizer->decode(prev, token));
                                        std::fwrite(text.data(), 1, text.size(), stdout);
                                        std::fflush(stdout);
                                        prev = token;
                                      });
  std::fputs("\n", stdout);
  std::fflush(stdout);

  const std::size_t formula = 2 * static_cast<std::size_t>(cfg.n_layers) * cache.capacity() *
                              static_cast<std::size_t>(cfg.kv_dim()) * sizeof(float);
  std::FILE* out = o.stats_to_stdout ? stdout : stderr;
  std::fprintf(out, "model              %s (dim %lld, %lld layers, %lld/%lld heads, vocab %lld)\n",
               o.model.empty() ? "built-in random" : o.model.c_str(),
               static_cast<long long>(cfg.dim), static_cast<long long>(cfg.n_layers),
               static_cast<long long>(cfg.n_heads), static_cast<long long>(cfg.n_kv_heads),
               static_cast<long long>(cfg.vocab_size));
  std::fprintf(out, "mode               %s, %zu thread(s), seed %llu\n",
               o.no_cache ? "no cache (full recompute per token)" : "KV cache", o.threads,
               static_cast<unsigned long long>(o.seed));
  std::fprintf(out, "prompt tokens      %zu\n", st.prompt_tokens);
  std::fprintf(out, "generated tokens   %zu%s\n", st.generated_tokens,
               st.hit_stop_token ? " (stopped at BOS)"
               : st.hit_capacity ? " (cache full)"
                                 : "");
  std::fprintf(out, "prefill            %.2f ms, %.1f tok/s\n", st.prefill_ms,
               st.prefill_tokens_per_s());
  std::fprintf(out, "time to first tok  %.2f ms\n", st.ttft_ms);
  std::fprintf(out, "decode             %.1f tok/s (%zu tokens in %.2f ms)\n",
               st.decode_tokens_per_s(), st.generated_tokens > 0 ? st.generated_tokens - 1 : 0,
               st.decode_ms);
  std::fprintf(out,
               "KV cache           %zu bytes allocated; formula 2 x %lld layers x %zu positions x "
               "%lld kv_dim x 4 B = %zu\n",
               cache.memory_bytes(), static_cast<long long>(cfg.n_layers), cache.capacity(),
               static_cast<long long>(cfg.kv_dim()), formula);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  try {
    options = parse(argc, argv);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "generate: %s\n\n%s", e.message.c_str(), kUsage);
    return 2;
  }
  try {
    return run(options);
  } catch (const kvdecode::Error& e) {
    std::fprintf(stderr, "generate: %s\n", e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "generate: error: %s\n", e.what());
  }
  return 1;
}
