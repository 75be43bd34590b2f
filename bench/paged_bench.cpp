// The paged store against the contiguous one, on the built-in generator's shape (dim 256, 4
// layers, 8/4 heads, head_size 32, seq_len 1024):
//   BM_KvMemoryRandomLengths  KV bytes allocated vs used for 64 sequences of random lengths:
//                             contiguous stores reserved to seq_len (the baseline) vs paged;
//   BM_TimeToFirstToken       a 256-token system prompt + 32-token question, with the system
//                             prompt in the prefix cache (cached:1) or not (cached:0);
//   BM_Decode                 one decode step at B = 1 at a fixed context, contiguous (the
//                             baseline) vs paged with 16-token blocks: one run of adjacent
//                             blocks; beside another growing sequence or among new requests, as
//                             the pool places them; fragmented into single blocks;
//   BM_DecodeInterleaved      the five layouts of BM_Decode stepped in turn in one run: the
//                             median step of each, whatever else the machine runs;
//   BM_DecodeBatch            one Model::decode_batch step of B sequences at ~128 positions of
//                             context each, on the 15M and 42M shapes, 1 or 2 threads: aggregate
//                             tokens/s as items/s (B = 1 is the baseline);
//   BM_DecodeBatchInterleaved B = 1 and B = 16 in turns of a few steps each: the median ratio
//                             of their aggregate tokens/s, whatever else the machine runs, and
//                             the ratio's ceiling: B = 16's projections at the FMA peak measured
//                             in the run (peak_probes.hpp) against B = 1's measured step.
// Every store is checked against the contiguous store's logits before it is timed.
// Before any Eigen include: GCC 12's false -Wmaybe-uninitialized (see bench_model.hpp).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <benchmark/benchmark.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "in_turns.hpp"
#include "kvdecode/kvdecode.hpp"
#include "peak_probes.hpp"

namespace {

using namespace kvdecode;
using kvdecode::bench::fma_pass;
using kvdecode::bench::in_turns;
using kvdecode::bench::measured_peak;
using kvdecode::bench::median_of;

// The examples' demo model (serve_batch runs the same shape and weights).
ModelConfig bench_config() { return demo_config(); }

const Model<float>& bench_model() {
  static const Model<float> model(demo_weights<float>());
  return model;
}

/// The fastest repetition: on a machine shared with other work the least disturbed one.
double min_of(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }

std::vector<std::int32_t> bench_tokens(std::size_t n, std::uint64_t seed) {
  detail::SplitMix64 rng(seed);
  std::vector<std::int32_t> t(n);
  for (auto& id : t) id = static_cast<std::int32_t>(rng.next() % 512);
  return t;
}

// ---------------------------------------------------------------------------------------------
// Memory: what each design allocates for the same workload. The timed part is the paged
// allocation of every sequence's blocks (begin_append + commit, no K/V computed).

void BM_KvMemoryRandomLengths(benchmark::State& state) {
  const ModelConfig cfg = bench_config();
  constexpr std::size_t kSequences = 64;
  const auto block_size = static_cast<std::size_t>(state.range(0));
  detail::SplitMix64 rng(7);
  std::vector<std::size_t> lengths(kSequences);
  std::size_t used_tokens = 0;
  for (auto& n : lengths) {
    n = 1 + static_cast<std::size_t>(rng.next() % static_cast<std::uint64_t>(cfg.seq_len));
    used_tokens += n;
  }
  const std::size_t bytes_per_token =
      2 * static_cast<std::size_t>(cfg.n_layers * cfg.kv_dim()) * sizeof(float);
  // Contiguous: every sequence reserves seq_len positions (one store's bytes × B).
  const std::size_t contiguous = kSequences * ContiguousStore<float>(cfg).memory_bytes();
  const std::size_t n_blocks = kSequences * (static_cast<std::size_t>(cfg.seq_len) / block_size);
  // Memory only: no prefix cache, so released blocks go straight back to the free list.
  BlockPool<float> pool(cfg, n_blocks, block_size, BlockPoolOptions{0, false});
  const std::vector<std::int32_t> tokens = bench_tokens(static_cast<std::size_t>(cfg.seq_len), 1);
  std::size_t paged = 0;
  for (auto _ : state) {
    std::vector<PagedStore<float>> seqs;
    seqs.reserve(kSequences);
    for (const std::size_t n : lengths) {
      seqs.emplace_back(pool);
      seqs.back().begin_append(std::span<const std::int32_t>(tokens).first(n));
      seqs.back().commit_append();
    }
    paged = pool.n_held() * pool.block_bytes();
    benchmark::DoNotOptimize(paged);
  }
  const double used = static_cast<double>(used_tokens * bytes_per_token);
  state.counters["used_MiB"] = used / (1 << 20);
  state.counters["contiguous_MiB"] = static_cast<double>(contiguous) / (1 << 20);
  state.counters["paged_MiB"] = static_cast<double>(paged) / (1 << 20);
  state.counters["contiguous_waste%"] = 100 * (1 - used / static_cast<double>(contiguous));
  state.counters["paged_waste%"] = 100 * (1 - used / static_cast<double>(paged));
  // ≤ 1 by construction: only a sequence's last block is partly empty.
  state.counters["paged_waste_blocks/seq"] =
      (static_cast<double>(paged) - used) / static_cast<double>(pool.block_bytes()) / kSequences;
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * kSequences));
}
BENCHMARK(BM_KvMemoryRandomLengths)->Arg(16)->Arg(64)->Unit(benchmark::kMicrosecond);

// ---------------------------------------------------------------------------------------------
// Time to first token of a request whose first 256 tokens are a shared system prompt.

void BM_TimeToFirstToken(benchmark::State& state) {
  const bool cached = state.range(0) != 0;
  const ModelConfig cfg = bench_config();
  const Model<float>& model = bench_model();
  const std::vector<std::int32_t> system = bench_tokens(256, 3);
  std::vector<std::int32_t> prompt = system;
  for (const auto t : bench_tokens(32, 4)) prompt.push_back(t);
  BlockPool<float> pool(cfg, 64, 16, BlockPoolOptions{0, cached});
  Activations<float> act(cfg, {.max_chunk = 128});
  if (cached) {  // an earlier request with the same system prompt and another question
    std::vector<std::int32_t> earlier = system;
    for (const auto t : bench_tokens(20, 5)) earlier.push_back(t);
    PagedStore<float> s = PagedStore<float>::open(pool, earlier);
    model.prefill(earlier, s, act);
  }
  {  // check: the first token's logits match a fresh contiguous run within f32
    ContiguousStore<float> ref(cfg);
    const auto want = model.prefill(prompt, ref, act);
    const std::vector<float> expect(want.begin(), want.end());
    PagedStore<float> s = PagedStore<float>::open(pool, prompt);
    const auto got = model.prefill(std::span<const std::int32_t>(prompt).subspan(s.size()), s, act);
    for (std::size_t i = 0; i < expect.size(); ++i)
      if (std::abs(got[i] - expect[i]) > 1e-4f * (1 + std::abs(expect[i])))
        throw std::runtime_error("paged TTFT logits differ from the contiguous store's");
  }
  std::size_t computed = 0;
  std::uint64_t round = 0;
  for (auto _ : state) {
    // A new question each time after the same system prompt, so only the system prompt can hit.
    state.PauseTiming();
    const auto question = bench_tokens(32, 1000 + round++);
    std::copy(question.begin(), question.end(), prompt.begin() + 256);
    state.ResumeTiming();
    PagedStore<float> s = PagedStore<float>::open(pool, prompt);
    computed = prompt.size() - s.size();
    const auto logits =
        model.prefill(std::span<const std::int32_t>(prompt).subspan(s.size()), s, act);
    benchmark::DoNotOptimize(logits.data());
  }
  state.counters["prefilled_tokens"] = static_cast<double>(computed);
  state.counters["hit_blocks/request"] =
      static_cast<double>(pool.stats().hits) / static_cast<double>(pool.stats().requests);
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()));
}
BENCHMARK(BM_TimeToFirstToken)->ArgName("cached")->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond);

// ---------------------------------------------------------------------------------------------
// Decode at B = 1: the paging cost is in attention (one KvBlock per 16 positions instead of one
// per 256-row tile) and in write (a table lookup per row).

enum class Layout {
  kContiguous,
  kPagedOneRun,
  kPagedInterleaved,
  kPagedNewRequests,
  kPagedFragmented
};

/// Runs `prompt` into a store of the layout. kPagedOneRun: a fresh pool, so the prefill takes
/// consecutive blocks and attention reads them as one run (the common case after a prefill).
/// kPagedInterleaved: another sequence, growing in turn with this one, takes a block after each
/// of this one's (round-robin decoding of two sequences), on a pool that keeps runs
/// (BlockPoolOptions::keep_runs, the default). kPagedNewRequests: a new one-block request
/// arrives after each of this one's blocks and stays, on a pool that keeps runs: each takes the
/// middle of the longest free run, the room this sequence was growing into, so its runs halve.
/// kPagedFragmented: the same requests without keep_runs, so every block is its own run (one
/// 2 KiB KvBlock per layer and kv head at 16 positions), the worst case for attention.
/// The longest context BM_Decode runs (past the demo model's seq_len: stores allow it).
constexpr std::size_t kMaxDecodeContext = 2048;

struct DecodeSetup {
  DecodeSetup(Layout layout, std::span<const std::int32_t> prompt, Activations<float>& act,
              std::size_t block_size = 16)
      : contiguous(bench_config(), kMaxDecodeContext),
        pool(bench_config(), 2 * kMaxDecodeContext / block_size, block_size,
             BlockPoolOptions{.capacity = kMaxDecodeContext,
                              .keep_runs = layout != Layout::kPagedFragmented}),
        paged(pool),
        other(pool) {
    const Model<float>& model = bench_model();
    if (layout == Layout::kContiguous) {
      model.prefill(prompt, contiguous, act);
      return;
    }
    for (std::size_t p = 0; p < prompt.size(); p += block_size) {
      model.prefill(prompt.subspan(p, std::min(block_size, prompt.size() - p)), paged, act);
      if (layout == Layout::kPagedInterleaved)
        model.prefill(prompt.subspan(p, std::min(block_size, prompt.size() - p)), other, act);
      if (layout == Layout::kPagedNewRequests || layout == Layout::kPagedFragmented) {
        fillers.emplace_back(pool);
        model.decode(1, fillers.back(), act);
      }
    }
  }
  template <class F>
  void with_store(Layout layout, F&& f) {
    if (layout == Layout::kContiguous) {
      f(contiguous);
    } else {
      f(paged);
    }
  }
  ContiguousStore<float> contiguous;
  BlockPool<float> pool;
  PagedStore<float> paged;
  PagedStore<float> other;                 // kPagedInterleaved
  std::vector<PagedStore<float>> fillers;  // kPagedNewRequests, kPagedFragmented
};

void BM_Decode(benchmark::State& state) {
  const auto layout = static_cast<Layout>(state.range(0));
  const auto context = static_cast<std::size_t>(state.range(1));
  const ModelConfig cfg = bench_config();
  const Model<float>& model = bench_model();
  const std::vector<std::int32_t> tokens = bench_tokens(context + 1, 6);
  const std::span<const std::int32_t> prompt = std::span<const std::int32_t>(tokens).first(context);
  Activations<float> prefill_act(cfg, {.max_chunk = 128}), act(cfg, {.max_chunk = 1});
  DecodeSetup setup(layout, prompt, prefill_act);
  {  // check against the contiguous store
    ContiguousStore<float> ref(cfg, kMaxDecodeContext);
    model.prefill(prompt, ref, prefill_act);
    const auto want = model.decode(tokens[context], ref, act);
    const std::vector<float> expect(want.begin(), want.end());
    setup.with_store(layout, [&](auto& store) {
      const auto got = model.decode(tokens[context], store, act);
      for (std::size_t i = 0; i < expect.size(); ++i)
        if (std::abs(got[i] - expect[i]) > 1e-4f * (1 + std::abs(expect[i])))
          throw std::runtime_error("decode logits differ from the contiguous store's");
      store.truncate(context);
    });
  }
  setup.with_store(layout, [&](auto& store) {
    for (auto _ : state) {
      const auto logits = model.decode(tokens[context], store, act);
      benchmark::DoNotOptimize(logits.data());
      store.truncate(context);  // the same context every step
    }
  });
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()));
  state.SetBytesProcessed(static_cast<std::int64_t>(
      state.iterations() * 2 * context * static_cast<std::size_t>(cfg.n_layers * cfg.kv_dim()) *
      sizeof(float)));
}
// Args: layout (0 contiguous = the baseline, 1 paged one run, 2 paged interleaved with another
// growing sequence, 3 paged among new one-block requests, 4 paged fragmented into single
// blocks), context.
BENCHMARK(BM_Decode)
    ->ArgNames({"layout", "context"})
    ->ArgsProduct({{0, 1, 2, 3, 4}, {500, 1000, 2000}})
    ->ComputeStatistics("min", min_of)
    ->Unit(benchmark::kMicrosecond);

/// The five layouts of BM_Decode in one run, a step of each in turn, so that other work on a
/// shared machine slows them alike: counters hold the median step of each layout (µs) and the
/// paged ones' ratio to the contiguous store. The benchmark's own time is the five steps.
void BM_DecodeInterleaved(benchmark::State& state) {
  const auto context = static_cast<std::size_t>(state.range(0));
  const auto block_size = static_cast<std::size_t>(state.range(1));
  const ModelConfig cfg = bench_config();
  const Model<float>& model = bench_model();
  const std::vector<std::int32_t> tokens = bench_tokens(context + 1, 6);
  const std::span<const std::int32_t> prompt = std::span<const std::int32_t>(tokens).first(context);
  Activations<float> prefill_act(cfg, {.max_chunk = 128}), act(cfg, {.max_chunk = 1});
  constexpr std::array<Layout, 5> kLayouts = {Layout::kContiguous, Layout::kPagedOneRun,
                                              Layout::kPagedInterleaved, Layout::kPagedNewRequests,
                                              Layout::kPagedFragmented};
  std::vector<std::unique_ptr<DecodeSetup>> setups;
  for (const Layout layout : kLayouts)
    setups.push_back(std::make_unique<DecodeSetup>(layout, prompt, prefill_act, block_size));
  std::array<std::vector<double>, kLayouts.size()> step_us;  // [layout][iteration]
  for (auto _ : state) {
    for (std::size_t i = 0; i < kLayouts.size(); ++i)
      setups[i]->with_store(kLayouts[i], [&](auto& store) {
        const auto t0 = std::chrono::steady_clock::now();
        const auto logits = model.decode(tokens[context], store, act);
        benchmark::DoNotOptimize(logits.data());
        step_us[i].push_back(
            std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                .count());
        store.truncate(context);
      });
  }
  std::array<double, kLayouts.size()> median{};
  for (std::size_t i = 0; i < kLayouts.size(); ++i) median[i] = median_of(step_us[i]);
  state.counters["contiguous_us"] = median[0];
  state.counters["one_run_us"] = median[1];
  // How many runs (KvBlocks of one layer and kv head) attention reads in each paged layout.
  const auto runs_of = [&](DecodeSetup& setup) {
    std::size_t runs = 0;
    setup.paged.for_each_block(0, 0, context, {}, [&](const KvBlock<float>&) { ++runs; });
    return static_cast<double>(runs);
  };
  state.counters["interleaved_runs"] = runs_of(*setups[2]);
  state.counters["new_requests_runs"] = runs_of(*setups[3]);
  state.counters["fragmented_runs"] = runs_of(*setups[4]);
  state.counters["interleaved_us"] = median[2];
  state.counters["new_requests_us"] = median[3];
  state.counters["fragmented_us"] = median[4];
  state.counters["one_run/contiguous"] = median[1] / median[0];
  state.counters["interleaved/contiguous"] = median[2] / median[0];
  state.counters["new_requests/contiguous"] = median[3] / median[0];
  state.counters["fragmented/contiguous"] = median[4] / median[0];
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * kLayouts.size()));
}
// Args: context, block size.
BENCHMARK(BM_DecodeInterleaved)
    ->ArgNames({"context", "block"})
    ->ArgsProduct({{500, 1000, 2000}, {16, 32, 64}})
    ->Unit(benchmark::kMicrosecond);

// ---------------------------------------------------------------------------------------------
// Batched decode: B sequences, one token each per step, every weight matrix read once per step.

/// llama2.c's stories15M (shape 0) and stories42M (shape 1), random weights.
ModelConfig batch_config(std::int64_t shape) {
  ModelConfig c;
  c.dim = shape == 0 ? 288 : 512;
  c.hidden_dim = shape == 0 ? 768 : 1376;
  c.n_layers = shape == 0 ? 6 : 8;
  c.n_heads = shape == 0 ? 6 : 8;
  c.n_kv_heads = c.n_heads;
  c.vocab_size = 32000;
  c.seq_len = 256;
  return c;
}

const Model<float>& batch_model(std::int64_t shape) {
  static const Model<float> m15(random_weights<float>(batch_config(0), 15));
  static const Model<float> m42(random_weights<float>(batch_config(1), 42));
  return shape == 0 ? m15 : m42;
}

/// B paged sequences of 120..135 positions, filled with synthetic K/V rows (attention costs the
/// same whatever the values) so that setting up 64 sequences does not take a 64 × 128-token
/// prefill, and the scratch of one decode_batch step over them.
class DecodeBatchSetup {
 public:
  DecodeBatchSetup(const ModelConfig& cfg, std::size_t B, ThreadPool* threads)
      : pool_(cfg, B * (144 / 16), 16, BlockPoolOptions{0, false}),
        act_(cfg, {.max_chunk = 1, .max_batch = B, .thread_pool = threads}),
        next_(B) {
    const auto kv_dim = static_cast<std::size_t>(cfg.kv_dim());
    seqs_.reserve(B);
    detail::SplitMix64 rng(11);
    std::vector<float> k(kv_dim), v(kv_dim);
    for (std::size_t b = 0; b < B; ++b) {
      seqs_.emplace_back(pool_);
      const std::size_t context = 120 + b % 16;
      const std::vector<std::int32_t> prompt = bench_tokens(context, 20 + b);
      seqs_.back().begin_append(prompt);
      for (std::size_t l = 0; l < static_cast<std::size_t>(cfg.n_layers); ++l)
        for (std::size_t p = 0; p < context; ++p) {
          for (auto& x : k) x = static_cast<float>(rng.next() % 2001) / 1000.0f - 1.0f;
          for (auto& x : v) x = static_cast<float>(rng.next() % 2001) / 1000.0f - 1.0f;
          seqs_.back().write(l, p, k.data(), v.data());
        }
      seqs_.back().commit_append();
      next_[b] = static_cast<std::int32_t>(1 + b);
    }
    for (auto& s : seqs_) ptrs_.push_back(&s);
  }

  /// One step of every sequence, then each truncated back: the same contexts every step.
  void step(const Model<float>& model) {
    const auto logits = model.decode_batch(std::span<const std::int32_t>(next_),
                                           std::span<PagedStore<float>* const>(ptrs_), act_);
    benchmark::DoNotOptimize(logits.data());
    for (auto& s : seqs_) s.truncate(s.size() - 1);
  }

 private:
  BlockPool<float> pool_;
  std::vector<PagedStore<float>> seqs_;
  std::vector<PagedStore<float>*> ptrs_;
  Activations<float> act_;
  std::vector<std::int32_t> next_;
};

/// Weights one step reads: every matrix, the classifier, no embedding table.
std::size_t step_weights(const ModelConfig& cfg) {
  const auto dim = static_cast<std::size_t>(cfg.dim);
  const auto kv_dim = static_cast<std::size_t>(cfg.kv_dim());
  return static_cast<std::size_t>(cfg.n_layers) *
             (2 * dim * dim + 2 * kv_dim * dim +
              3 * static_cast<std::size_t>(cfg.hidden_dim) * dim) +
         static_cast<std::size_t>(cfg.vocab_size) * dim;
}

void BM_DecodeBatch(benchmark::State& state) {
  const std::int64_t shape = state.range(0);
  const auto B = static_cast<std::size_t>(state.range(1));
  const auto n_threads = static_cast<std::size_t>(state.range(2));
  const ModelConfig cfg = batch_config(shape);
  const Model<float>& model = batch_model(shape);
  ThreadPool threads(n_threads);
  DecodeBatchSetup setup(cfg, B, n_threads > 1 ? &threads : nullptr);
  for (auto _ : state) setup.step(model);
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * B));
  state.SetBytesProcessed(
      static_cast<std::int64_t>(state.iterations() * step_weights(cfg) * sizeof(float)));
}
// Args: shape (0 = 15M, 1 = 42M), B, threads.
BENCHMARK(BM_DecodeBatch)
    ->ArgNames({"shape", "B", "threads"})
    ->ArgsProduct({{0, 1}, {1, 2, 4, 16, 64}, {1, 2}})
    ->ComputeStatistics("min", min_of)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

/// B = 1 and B = 16 in turn in one run, so that whatever else the machine does slows both
/// alike: each turn is a few untimed steps (that configuration's weights and K/V back in the
/// caches as far as they fit, as when it runs alone) and then timed steps, whose median is the
/// turn's step. Reports the median step of each and the median over turns of each pair's
/// throughput ratio, 16 × B = 1's step / B = 16's step (the 8× target of batching).
void BM_DecodeBatchInterleaved(benchmark::State& state) {
  const std::int64_t shape = state.range(0);
  const auto n_threads = static_cast<std::size_t>(state.range(1));
  const Model<float>& model = batch_model(shape);
  ThreadPool threads(n_threads);
  ThreadPool* const pool = n_threads > 1 ? &threads : nullptr;
  DecodeBatchSetup one(batch_config(shape), 1, pool);
  DecodeBatchSetup sixteen(batch_config(shape), 16, pool);
  constexpr int kWarm = 3, kTimed = 5;
  const auto turn = [&](DecodeBatchSetup& s) {
    for (int i = 0; i < kWarm; ++i) s.step(model);
    std::vector<double> ms;
    for (int i = 0; i < kTimed; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      s.step(model);
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    return median_of(ms);
  };
  in_turns(
      state, "B1_ms", [&] { return turn(one); }, "B16_ms", [&] { return turn(sixteen); },
      "B16/B1_tok_s", [](double b1, double b16) { return 16 * b1 / b16; });
  // The step's projections (16 tokens × 2 flops × every matrix weight) against the FMA peak
  // measured now: B = 16 cannot beat B = 1 by more than `ceiling` unless it computes faster
  // than the peak, whatever its attention costs.
  const double flops = 16.0 * 2.0 * static_cast<double>(step_weights(model.config()));
  const double peak = measured_peak<fma_pass>() * 1e9 * static_cast<double>(n_threads);
  if (peak > 0) {
    const double b16_s = state.counters["B16_ms"] * 1e-3;
    state.counters["B16_peak%"] = 100.0 * flops / b16_s / peak;
    state.counters["ceiling"] = 16.0 * state.counters["B1_ms"] * 1e-3 / (flops / peak);
  }
}
// Args: shape (0 = 15M, 1 = 42M), threads.
BENCHMARK(BM_DecodeBatchInterleaved)
    ->ArgNames({"shape", "threads"})
    ->ArgsProduct({{0, 1}, {1, 2}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
