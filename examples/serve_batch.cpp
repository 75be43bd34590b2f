// serve_batch: several requests that share a system prompt, served from one BlockPool. Each
// request opens a sequence holding the longest cached prefix of its prompt, prefills only the
// rest, then all requests decode together, one Model::decode_batch step per token (every weight
// read once per step for the whole batch). Prints per-request time to first token and prefix
// hits, and aggregate tokens/s. Runs the built-in random model.
//
//   serve_batch [--requests N] [--system N] [--question N] [-n N] [--block-size N]
//               [--blocks N] [--no-prefix-cache] [--round-robin] [--temperature T] [--seed S]
//               [--help]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <kvdecode/kvdecode.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cli.hpp"

namespace {

constexpr const char* kUsage = R"(usage: serve_batch [options]

Serves several requests sharing a system prompt through one paged KV pool with a prefix cache,
on a small built-in model with deterministic random weights (its tokens are noise, the timings
and cache counters are real).

  --requests N        number of requests (default 8)
  --system N          tokens of the shared system prompt (default 256)
  --question N        tokens of each request's own question, ±50 % (default 32)
  -n N                tokens to generate per request (default 64)
  --block-size N      positions per KV block (default 16)
  --blocks N          blocks in the pool (default 256)
  --no-prefix-cache   compute every prompt in full
  --round-robin       decode the requests one at a time instead of in one batched step
  --temperature T     0 = greedy (default 0.8)
  --seed S            seed of the prompts and the samplers, > 0 (default 7)
  --help              this text
)";

struct Options {
  std::size_t requests = 8;
  std::size_t system = 256;
  std::size_t question = 32;
  std::size_t n = 64;
  std::size_t block_size = 16;
  std::size_t blocks = 256;
  bool prefix_cache = true;
  bool round_robin = false;
  double temperature = 0.8;
  std::uint64_t seed = 7;
};

Options parse(int argc, char** argv) {
  Options o;
  for (cli::Args args(argc, argv); args.next();) {
    const std::string_view a = args.flag();
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (a == "--requests") {
      o.requests = args.number<std::size_t>();
    } else if (a == "--system") {
      o.system = args.number<std::size_t>();
    } else if (a == "--question") {
      o.question = args.number<std::size_t>();
    } else if (a == "-n") {
      o.n = args.number<std::size_t>();
    } else if (a == "--block-size") {
      o.block_size = args.number<std::size_t>();
    } else if (a == "--blocks") {
      o.blocks = args.number<std::size_t>();
    } else if (a == "--round-robin") {
      o.round_robin = true;
    } else if (a == "--no-prefix-cache") {
      o.prefix_cache = false;
    } else if (a == "--temperature") {
      o.temperature = args.number<double>();
    } else if (a == "--seed") {
      o.seed = args.number<std::uint64_t>();
    } else {
      args.unknown();
    }
  }
  if (o.requests == 0) throw cli::UsageError{"--requests must be >= 1"};
  if (o.question == 0) throw cli::UsageError{"--question must be >= 1"};
  if (o.n == 0) throw cli::UsageError{"-n must be >= 1"};
  if (o.block_size == 0) throw cli::UsageError{"--block-size must be >= 1"};
  if (o.blocks == 0) throw cli::UsageError{"--blocks must be >= 1"};
  if (o.temperature < 0) throw cli::UsageError{"--temperature must be >= 0"};
  if (o.seed == 0) throw cli::UsageError{"--seed must be > 0"};
  return o;
}

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

/// The built-in generator's model shape (examples/generate.cpp).
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

std::vector<std::int32_t> random_ids(std::size_t n, std::uint64_t seed) {
  kvdecode::detail::SplitMix64 rng(seed);
  std::vector<std::int32_t> t(n);
  for (auto& id : t) id = static_cast<std::int32_t>(3 + rng.next() % 509);  // past BOS/EOS
  return t;
}

struct Request {
  std::size_t id = 0;
  std::vector<std::int32_t> prompt;
  kvdecode::PagedStore<float> seq;
  std::optional<kvdecode::Sampler> sampler;  // set when the request is built
  std::int32_t next = 0;                     // sampled, not yet fed back
  std::size_t generated = 0;
  std::uint64_t hit_blocks = 0;
  std::size_t prefilled = 0;
  double ttft_ms = 0;
  bool done = false;
};

/// One decode step for every request of the batch: feeds each its last sampled token and
/// samples the next. Batched: one Model::decode_batch over every sequence's PagedStore, so each
/// weight matrix is read once per step; round-robin: one Model::decode per sequence.
void decode_step(const kvdecode::Model<float>& model, std::vector<Request*>& batch,
                 kvdecode::Activations<float>& act, std::size_t max_new, bool round_robin,
                 std::vector<std::int32_t>& tokens,
                 std::vector<kvdecode::PagedStore<float>*>& seqs) {
  const std::size_t vocab = act.logits.size();
  if (round_robin) {
    for (Request* r : batch) r->next = r->sampler->sample(model.decode(r->next, r->seq, act));
  } else {
    tokens.clear();
    seqs.clear();
    for (Request* r : batch) {
      tokens.push_back(r->next);
      seqs.push_back(&r->seq);
    }
    const auto logits =
        model.decode_batch(std::span<const std::int32_t>(tokens),
                           std::span<kvdecode::PagedStore<float>* const>(seqs), act);
    for (std::size_t b = 0; b < batch.size(); ++b)
      batch[b]->next = batch[b]->sampler->sample(logits.subspan(b * vocab, vocab));
  }
  for (Request* r : batch) {
    if (++r->generated == max_new) {
      r->done = true;
      r->seq.release();  // its full blocks stay in the prefix cache
    }
  }
  std::erase_if(batch, [](const Request* r) { return r->done; });
}

int run(const Options& o) {
  using namespace kvdecode;
  const ModelConfig cfg = builtin_config();
  const Model<float> model(random_weights<float>(cfg, 2026));
  BlockPool<float> pool(cfg, o.blocks, o.block_size, BlockPoolOptions{0, o.prefix_cache});
  // Batched decode: logits rows and activations for every request at once.
  Activations<float> prefill_act(cfg, 128), decode_act(cfg, 1, 0, nullptr, o.requests);

  const std::vector<std::int32_t> system = random_ids(o.system, o.seed);
  std::vector<Request> requests(o.requests);
  detail::SplitMix64 rng(o.seed + 1);
  for (std::size_t i = 0; i < o.requests; ++i) {
    Request& r = requests[i];
    r.id = i;
    const std::size_t q = std::max<std::size_t>(1, o.question / 2 + rng.next() % (o.question + 1));
    r.prompt = system;
    for (const auto t : random_ids(q, o.seed * 1000 + i)) r.prompt.push_back(t);
    KVDECODE_CHECK(r.prompt.size() + o.n <= static_cast<std::size_t>(cfg.seq_len),
                   "serve_batch: request ", i, " needs ", r.prompt.size() + o.n,
                   " positions, the model holds ", cfg.seq_len);
    r.sampler.emplace(cfg.vocab_size, SamplerOptions{o.temperature, 0.9, 0, o.seed + i});
  }

  // Admission: every request prefills in arrival order; TTFT is its own open + prefill + the
  // first sample (the queue before it is not counted).
  const Clock::time_point start = Clock::now();
  std::vector<Request*> batch;
  for (Request& r : requests) {
    const Clock::time_point t0 = Clock::now();
    const std::uint64_t hits_before = pool.stats().hits;
    r.seq = PagedStore<float>::open(pool, r.prompt);
    r.hit_blocks = pool.stats().hits - hits_before;
    const std::span<const std::int32_t> rest =
        std::span<const std::int32_t>(r.prompt).subspan(r.seq.size());
    r.prefilled = rest.size();
    r.next = r.sampler->sample(model.prefill(rest, r.seq, prefill_act));
    r.generated = 1;
    r.ttft_ms = ms_since(t0);
    if (r.generated == o.n) {
      r.done = true;
      r.seq.release();
    } else {
      batch.push_back(&r);
    }
  }
  const double prefill_ms = ms_since(start);

  std::size_t peak_held = pool.n_held();
  std::vector<std::int32_t> step_tokens;  // [batch] reused each step
  std::vector<PagedStore<float>*> step_seqs;
  step_tokens.reserve(batch.size());
  step_seqs.reserve(batch.size());
  const Clock::time_point decode_start = Clock::now();
  while (!batch.empty()) {
    decode_step(model, batch, decode_act, o.n, o.round_robin, step_tokens, step_seqs);
    peak_held = std::max(peak_held, pool.n_held());
  }
  const double decode_ms = ms_since(decode_start);
  const double total_ms = ms_since(start);

  std::printf("%-8s %8s %10s %12s %10s %10s %10s\n", "request", "prompt", "hit_blocks",
              "tokens_saved", "prefilled", "ttft_ms", "generated");
  std::size_t generated = 0, prompt_tokens = 0;
  for (const Request& r : requests) {
    std::printf("%-8zu %8zu %10llu %12zu %10zu %10.2f %10zu\n", r.id, r.prompt.size(),
                static_cast<unsigned long long>(r.hit_blocks), r.prompt.size() - r.prefilled,
                r.prefilled, r.ttft_ms, r.generated);
    generated += r.generated;
    prompt_tokens += r.prompt.size();
  }
  const PrefixCacheStats& st = pool.stats();
  const double mib = 1.0 / (1 << 20);
  const std::size_t contiguous_bytes = o.requests * ContiguousStore<float>(cfg).memory_bytes();
  std::printf(
      "\nprefix cache       %llu hits, %llu misses, %llu evictions, %llu tokens saved "
      "(%s)\n",
      static_cast<unsigned long long>(st.hits), static_cast<unsigned long long>(st.misses),
      static_cast<unsigned long long>(st.evictions),
      static_cast<unsigned long long>(st.tokens_saved), o.prefix_cache ? "on" : "off");
  std::printf("prefill            %zu prompt tokens, %.2f ms for all requests\n", prompt_tokens,
              prefill_ms);
  std::printf(
      "decode             %.1f tok/s aggregate (%zu tokens, %s, %.2f ms)\n",
      decode_ms > 0 ? 1e3 * static_cast<double>(generated - requests.size()) / decode_ms : 0,
      generated - requests.size(), o.round_robin ? "round-robin" : "batched", decode_ms);
  std::printf("overall            %.1f generated tok/s (%zu tokens in %.2f ms)\n",
              1e3 * static_cast<double>(generated) / total_ms, generated, total_ms);
  std::printf(
      "KV memory          peak %zu of %zu blocks held = %.2f MiB; contiguous stores for "
      "%zu requests reserve %.2f MiB\n",
      peak_held, pool.n_blocks(), static_cast<double>(peak_held * pool.block_bytes()) * mib,
      o.requests, static_cast<double>(contiguous_bytes) * mib);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return cli::run_main("serve_batch", [&] { return run(parse(argc, argv)); });
}
