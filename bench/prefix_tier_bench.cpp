// The prefix tier (serving/prefix_tier.hpp): time to first token of a request whose 256-token
// system prompt a previous process computed, with the blocks on disk, against computing it and
// against finding it in memory; and the cost of writing block files.
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "kvdecode/model/demo_model.hpp"
#include "kvdecode/serving/prefix_tier.hpp"
#include "kvdecode/store/contiguous_store.hpp"
#include "kvdecode/store/paged_store.hpp"

namespace kvdecode::bench {
namespace {

namespace fs = std::filesystem;

// The generator's shape and weights, as bench/paged_bench.cpp's time to first token.
ModelConfig tier_config() { return demo_config(); }

const Model<float>& tier_model() {
  static const Model<float> model(demo_weights<float>());
  return model;
}

/// n token ids in [1, vocab), fixed by the seed.
std::vector<std::int32_t> tier_tokens(std::size_t n, std::uint64_t seed) {
  detail::SplitMix64 rng(seed);
  std::vector<std::int32_t> t(n);
  const auto vocab = static_cast<std::uint64_t>(tier_config().vocab_size);
  for (auto& id : t) id = static_cast<std::int32_t>(1 + rng.next() % (vocab - 1));
  return t;
}

fs::path bench_dir(const char* name) {
  return fs::temp_directory_path() /
         (std::string("kvdecode_prefix_tier_bench_") + name + "_" + std::to_string(::getpid()));
}

/// A directory holding the system prompt's 16 blocks, written by a tier as a first process
/// would (spill_cached after one request).
void write_system_prompt_blocks(const fs::path& dir, const std::vector<std::int32_t>& earlier) {
  const ModelConfig cfg = tier_config();
  const Model<float>& model = tier_model();
  fs::remove_all(dir);
  BlockPool<float> pool(cfg, 64, 16);
  PrefixTier<float> tier(model_fingerprint(model), {.directory = dir, .max_bytes = 1ull << 30});
  tier.attach(pool);
  Activations<float> act(cfg, {.max_chunk = 128});
  {
    PagedStore<float> s = PagedStore<float>::open(pool, earlier);
    model.prefill(earlier, s, act);
  }
  pool.spill_cached();
}

// Arg 0: nothing cached (288 tokens computed); 1: the system prompt's blocks on disk, loaded by
// a new pool and tier (a restarted process; the files are in the page cache); 2: in memory.
void BM_TimeToFirstTokenAfterRestart(benchmark::State& state) {
  const int source = static_cast<int>(state.range(0));
  const ModelConfig cfg = tier_config();
  const Model<float>& model = tier_model();
  const ModelFingerprint fp = model_fingerprint(model);
  const std::vector<std::int32_t> system = tier_tokens(256, 3);
  std::vector<std::int32_t> earlier = system, prompt = system;
  for (const auto t : tier_tokens(20, 5)) earlier.push_back(t);
  for (const auto t : tier_tokens(32, 4)) prompt.push_back(t);
  const fs::path dir = bench_dir("ttft");
  write_system_prompt_blocks(dir, earlier);
  Activations<float> act(cfg, {.max_chunk = 128});
  std::vector<float> expect;
  {
    ContiguousStore<float> ref(cfg);
    const auto want = model.prefill(prompt, ref, act);
    expect.assign(want.begin(), want.end());
  }
  std::size_t computed = 0;
  std::uint64_t disk_hits = 0;
  bool ok = true;
  for (auto _ : state) {
    state.PauseTiming();
    std::optional<BlockPool<float>> pool;
    std::optional<PrefixTier<float>> tier;
    pool.emplace(cfg, 64, 16, BlockPoolOptions{0, source != 0});
    if (source == 1) {
      tier.emplace(fp, PrefixTierOptions{dir, 1ull << 30});
      tier->attach(*pool);
    }
    if (source == 2) {  // an earlier request in this process
      PagedStore<float> e = PagedStore<float>::open(*pool, earlier);
      model.prefill(earlier, e, act);
    }
    BlockPool<float>& p = *pool;
    state.ResumeTiming();
    PagedStore<float> s = PagedStore<float>::open(p, prompt);
    computed = prompt.size() - s.size();
    const auto logits =
        model.prefill(std::span<const std::int32_t>(prompt).subspan(s.size()), s, act);
    benchmark::DoNotOptimize(logits.data());
    state.PauseTiming();
    for (std::size_t i = 0; i < expect.size(); ++i)
      ok = ok && std::abs(logits[i] - expect[i]) <= 1e-4f * (1 + std::abs(expect[i]));
    if (tier) disk_hits = tier->stats().disk_hits;
    s.release();
    tier.reset();
    pool.reset();
    state.ResumeTiming();
  }
  if (!ok) state.SkipWithError("first-token logits differ from the contiguous store's");
  state.counters["prefilled_tokens"] = static_cast<double>(computed);
  state.counters["disk_hits"] = static_cast<double>(disk_hits);
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()));
  std::error_code ec;
  fs::remove_all(dir, ec);
}
BENCHMARK(BM_TimeToFirstTokenAfterRestart)
    ->ArgName("source")
    ->Arg(0)
    ->Arg(1)
    ->Arg(2)
    ->Unit(benchmark::kMillisecond);

// Writing the system prompt's 16 blocks to an empty directory (temporary file + rename each).
void BM_PrefixTierSpillBlocks(benchmark::State& state) {
  const ModelConfig cfg = tier_config();
  const Model<float>& model = tier_model();
  const fs::path dir = bench_dir("spill");
  fs::remove_all(dir);
  BlockPool<float> pool(cfg, 64, 16);
  Activations<float> act(cfg, {.max_chunk = 128});
  const std::vector<std::int32_t> prompt = tier_tokens(257, 3);
  PagedStore<float> s = PagedStore<float>::open(pool, prompt);
  model.prefill(prompt, s, act);
  const ModelFingerprint fp = model_fingerprint(model);
  std::size_t file_bytes = 0, written = 0;
  for (auto _ : state) {
    state.PauseTiming();
    fs::remove_all(dir);
    PrefixTier<float> tier(fp, {.directory = dir, .max_bytes = 1ull << 30});
    tier.attach(pool);
    state.ResumeTiming();
    pool.spill_cached();
    state.PauseTiming();
    file_bytes = tier.file_bytes();
    written = tier.stats().files_written;
    tier.detach();
    state.ResumeTiming();
  }
  if (written != 16) state.SkipWithError("expected 16 block files");
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * written));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * written * file_bytes));
  std::error_code ec;
  fs::remove_all(dir, ec);
}
BENCHMARK(BM_PrefixTierSpillBlocks)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace kvdecode::bench

BENCHMARK_MAIN();
