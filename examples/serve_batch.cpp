// serve_batch: several requests that share a system prompt, served from one BlockPool. Requests
// are admitted in arrival order while the pool has blocks for their whole length (the rest
// wait in a queue); each opens a sequence holding the longest cached prefix of its prompt,
// prefills only the rest, then all admitted requests decode together, one Model::decode_batch
// step per token (every weight read once per step for the whole batch). Prints per-request
// queue wait, time to first token and prefix hits, and aggregate tokens/s. Runs the library's
// demo model (kvdecode/model/demo_model.hpp). `serve_batch --help` lists the flags.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <kvdecode/kvdecode.hpp>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cli.hpp"

#ifndef KVDECODE_VERSION
#define KVDECODE_VERSION "unknown"
#endif

namespace {

struct Options {
  std::size_t requests = 8;
  std::size_t system = 256;
  std::size_t question = 32;
  std::size_t n = 64;
  std::size_t block_size = 16;
  std::size_t blocks = 256;
  bool no_prefix_cache = false;
  bool round_robin = false;
  double temperature = 0.8;
  std::int64_t seed = 7;
  bool verbose = false;
};

void declare(CLI::App& app, Options& o) {
  using cli::number;
  const auto seq_len = static_cast<std::size_t>(kvdecode::demo_config().seq_len);
  app.description(
      "Serves several requests sharing a system prompt through one paged KV pool with a prefix "
      "cache, on the library's demo model (deterministic random weights: its tokens are noise, "
      "the timings and cache counters are real). Requests that do not fit the pool wait until "
      "blocks free up.");
  app.footer(
      "Exit codes: 0 done, 1 an error or a refused request (one larger than the pool), 2 a bad "
      "command line; an error is one line on stderr.");
  app.add_option("--requests", o.requests, "number of requests")
      ->check(number<std::size_t>(1, 100000))
      ->capture_default_str();
  app.add_option("--system", o.system, "tokens of the shared system prompt")
      ->check(number<std::size_t>(0, seq_len - 2))
      ->capture_default_str();
  app.add_option("--question", o.question, "tokens of each request's own question, +-50 %")
      ->check(number<std::size_t>(1, seq_len - 1))
      ->capture_default_str();
  app.add_option("-n,--n-predict", o.n, "tokens to generate per request")
      ->check(number<std::size_t>(1, seq_len - 1))
      ->capture_default_str();
  app.add_option("--block-size", o.block_size, "positions per KV block")
      ->check(number<std::size_t>(1, seq_len))
      ->capture_default_str();
  app.add_option("--blocks", o.blocks,
                 "blocks in the pool (at most what the requests at their longest can use)")
      ->check(number<std::size_t>(1, std::size_t{1} << 20))
      ->capture_default_str();
  app.add_flag("--no-prefix-cache", o.no_prefix_cache, "compute every prompt in full");
  app.add_flag("--round-robin", o.round_robin,
               "decode the requests one at a time instead of in one batched step");
  app.add_option("--temperature,--temp", o.temperature, "0 = greedy")
      ->check(number<double>(0, 100))
      ->capture_default_str();
  app.add_option("-s,--seed", o.seed, "seed of the prompts and the samplers, > 0")
      ->check(number<std::int64_t>(1, std::numeric_limits<std::int64_t>::max()))
      ->capture_default_str();
  app.add_flag("--verbose", o.verbose, "errors name the library header and line");
}

/// The checks between flags, before anything is allocated: the longest request must fit the
/// model's positions, and the pool (no more blocks than every request at its longest can use)
/// the machine's memory. Returns the blocks the pool gets.
std::size_t check(const Options& o) {
  const auto seq_len = static_cast<std::size_t>(kvdecode::demo_config().seq_len);
  const std::size_t longest = o.system + o.question + o.question / 2 + o.n;
  if (longest > seq_len)
    throw cli::UsageError{"--system " + std::to_string(o.system) + " + --question up to " +
                          std::to_string(o.question + o.question / 2) + " + -n " +
                          std::to_string(o.n) + " = " + std::to_string(longest) +
                          " positions, but the model holds " + std::to_string(seq_len)};
  const std::size_t per_request = (longest + o.block_size - 1) / o.block_size;
  const std::size_t blocks =
      o.requests > o.blocks / per_request ? o.blocks : std::min(o.blocks, o.requests * per_request);
  const auto cfg = kvdecode::demo_config();
  const double block_bytes = 2.0 * static_cast<double>(cfg.n_layers * cfg.kv_dim()) *
                             static_cast<double>(o.block_size) * 4;
  const double memory = static_cast<double>(::sysconf(_SC_PHYS_PAGES)) *
                        static_cast<double>(::sysconf(_SC_PAGE_SIZE));
  if (static_cast<double>(blocks) * block_bytes > memory / 2)
    throw cli::UsageError{"--blocks " + std::to_string(blocks) + " of " +
                          std::to_string(static_cast<long long>(block_bytes / 1024)) +
                          " KiB would take more than half of the machine's " +
                          std::to_string(static_cast<long long>(memory / (1 << 30))) + " GiB"};
  return blocks;
}

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

std::vector<std::int32_t> random_ids(std::size_t n, std::uint64_t seed) {
  kvdecode::detail::SplitMix64 rng(seed);
  std::vector<std::int32_t> t(n);
  for (auto& id : t) id = static_cast<std::int32_t>(3 + rng.next() % 509);  // past BOS/EOS
  return t;
}

struct Request {
  std::size_t id = 0;
  std::size_t blocks_needed = 0;  // for its whole length, prompt and answer
  bool refused = false;
  double wait_ms = 0;  // arrival (the start) to admission
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

/// Blocks `r` may still take: its whole need less what its table already holds.
std::size_t outstanding(const Request& r) {
  const std::size_t held = r.seq.block_table().size();
  return r.blocks_needed > held ? r.blocks_needed - held : 0;
}

int run(const Options& o) {
  using namespace kvdecode;
  const std::size_t n_blocks = check(o);
  const ModelConfig cfg = demo_config();
  const Model<float> model(demo_weights<float>());
  BlockPool<float> pool(cfg, n_blocks, o.block_size, BlockPoolOptions{0, !o.no_prefix_cache});
  // Batched decode: logits rows and activations for every request that can be in at once.
  const std::size_t max_batch = std::min(o.requests, n_blocks);
  Activations<float> prefill_act(cfg, {.max_chunk = 128}),
      decode_act(cfg, {.max_chunk = 1, .max_batch = max_batch});

  const std::vector<std::int32_t> system = random_ids(o.system, static_cast<std::uint64_t>(o.seed));
  std::vector<Request> requests(o.requests);
  const auto seed = static_cast<std::uint64_t>(o.seed);
  detail::SplitMix64 rng(seed + 1);
  for (std::size_t i = 0; i < o.requests; ++i) {
    Request& r = requests[i];
    r.id = i;
    const std::size_t q = std::max<std::size_t>(1, o.question / 2 + rng.next() % (o.question + 1));
    r.prompt = system;
    for (const auto t : random_ids(q, seed * 1000 + i)) r.prompt.push_back(t);
    r.blocks_needed = (r.prompt.size() + o.n + o.block_size - 1) / o.block_size;
    r.sampler.emplace(cfg.vocab_size, SamplerOptions{o.temperature, 0.9, 0, seed + i});
  }

  // Admission in arrival order: a request comes in when the pool has blocks for its whole
  // length beyond what the running ones may still take, so no running request ever finds the
  // pool empty; one larger than the whole pool is refused alone. TTFT is its own open +
  // prefill + first sample; the wait before it is reported apart.
  const Clock::time_point start = Clock::now();
  std::deque<Request*> queue;
  for (Request& r : requests) queue.push_back(&r);
  std::vector<Request*> batch;
  std::size_t peak_held = 0, refused = 0, peak_batch = 0;
  double prefill_ms = 0, decode_ms = 0;
  std::vector<std::int32_t> step_tokens;  // [batch] reused each step
  std::vector<PagedStore<float>*> step_seqs;
  step_tokens.reserve(max_batch);
  step_seqs.reserve(max_batch);
  while (!queue.empty() || !batch.empty()) {
    const Clock::time_point admit_start = Clock::now();
    while (!queue.empty()) {
      Request& r = *queue.front();
      if (r.blocks_needed > pool.n_blocks()) {
        std::fprintf(stderr,
                     "serve_batch: request %zu needs %zu blocks of %zu positions (%zu prompt + "
                     "%zu generated tokens) but the pool has %zu; refused (raise --blocks)\n",
                     r.id, r.blocks_needed, o.block_size, r.prompt.size(), o.n, pool.n_blocks());
        r.refused = true;
        ++refused;
        queue.pop_front();
        continue;
      }
      std::size_t promised = 0;
      for (const Request* b : batch) promised += outstanding(*b);
      if (batch.size() == max_batch || pool.n_available() < promised + r.blocks_needed) break;
      queue.pop_front();
      const Clock::time_point t0 = Clock::now();
      r.wait_ms = std::chrono::duration<double, std::milli>(t0 - start).count();
      try {
        const std::uint64_t hits_before = pool.stats().hits;
        r.seq = PagedStore<float>::open(pool, r.prompt);
        r.hit_blocks = pool.stats().hits - hits_before;
        const std::span<const std::int32_t> rest =
            std::span<const std::int32_t>(r.prompt).subspan(r.seq.size());
        r.prefilled = rest.size();
        r.next = r.sampler->sample(model.prefill(rest, r.seq, prefill_act));
      } catch (const Error& e) {
        throw Error("request " + std::to_string(r.id) + ": " + cli::for_a_person(e.what()));
      }
      r.generated = 1;
      r.ttft_ms = ms_since(t0);
      if (r.generated == o.n) {
        r.done = true;
        r.seq.release();
      } else {
        batch.push_back(&r);
      }
      peak_held = std::max(peak_held, pool.n_held());
    }
    prefill_ms += ms_since(admit_start);
    if (batch.empty()) continue;
    peak_batch = std::max(peak_batch, batch.size());
    const Clock::time_point step_start = Clock::now();
    decode_step(model, batch, decode_act, o.n, o.round_robin, step_tokens, step_seqs);
    decode_ms += ms_since(step_start);
    peak_held = std::max(peak_held, pool.n_held());
  }
  const double total_ms = ms_since(start);

  std::printf("%-8s %8s %10s %12s %10s %10s %10s %10s\n", "request", "prompt", "hit_blocks",
              "tokens_saved", "prefilled", "wait_ms", "ttft_ms", "generated");
  std::size_t generated = 0, prompt_tokens = 0, served = 0;
  double longest_wait = 0;
  for (const Request& r : requests) {
    if (r.refused) {
      std::printf("%-8zu %8zu %10s\n", r.id, r.prompt.size(), "refused");
      continue;
    }
    std::printf("%-8zu %8zu %10llu %12zu %10zu %10.2f %10.2f %10zu\n", r.id, r.prompt.size(),
                static_cast<unsigned long long>(r.hit_blocks), r.prompt.size() - r.prefilled,
                r.prefilled, r.wait_ms, r.ttft_ms, r.generated);
    generated += r.generated;
    prompt_tokens += r.prompt.size();
    longest_wait = std::max(longest_wait, r.wait_ms);
    ++served;
  }
  const PrefixCacheStats& st = pool.stats();
  const double mib = 1.0 / (1 << 20);
  // What a ContiguousStore per request would reserve: seq_len positions of K and V each.
  const double contiguous_bytes = static_cast<double>(o.requests) * 2.0 *
                                  static_cast<double>(cfg.n_layers * cfg.seq_len * cfg.kv_dim()) *
                                  sizeof(float);
  std::printf(
      "\nprefix cache       %llu hits, %llu misses, %llu evictions, %llu tokens saved "
      "(%s)\n",
      static_cast<unsigned long long>(st.hits), static_cast<unsigned long long>(st.misses),
      static_cast<unsigned long long>(st.evictions),
      static_cast<unsigned long long>(st.tokens_saved), o.no_prefix_cache ? "off" : "on");
  std::printf(
      "queue              %zu served, %zu refused, at most %zu running at once, longest "
      "wait %.2f ms\n",
      served, refused, peak_batch, longest_wait);
  std::printf("prefill            %zu prompt tokens, %.2f ms for all requests\n", prompt_tokens,
              prefill_ms);
  std::printf("decode             %.1f tok/s aggregate (%zu tokens, %s, %.2f ms)\n",
              decode_ms > 0 ? 1e3 * static_cast<double>(generated - served) / decode_ms : 0,
              generated - served, o.round_robin ? "round-robin" : "batched", decode_ms);
  std::printf("overall            %.1f generated tok/s (%zu tokens in %.2f ms)\n",
              1e3 * static_cast<double>(generated) / total_ms, generated, total_ms);
  std::printf(
      "KV memory          peak %zu of %zu blocks held = %.2f MiB; contiguous stores for "
      "%zu requests reserve %.2f MiB\n",
      peak_held, pool.n_blocks(), static_cast<double>(peak_held * pool.block_bytes()) * mib,
      o.requests, contiguous_bytes * mib);
  return refused > 0 ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"", "serve_batch"};
  cli::configure(app, KVDECODE_VERSION);
  declare(app, o);
  return cli::run_main(app, argc, argv, o.verbose, [&] { return run(o); });
}
