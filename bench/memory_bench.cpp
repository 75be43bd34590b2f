// KV memory per token for MHA / GQA / MQA shapes: BM_KvAppend appends one position (every
// layer's K and V rows) to a ContiguousStore of the benchmark shape and reports the planner's
// bytes per position, checked against what the store reserved; BM_KvPlan reports the plan of
// larger published shapes (no allocation) and the context at which the cache outgrows f32
// weights. The chart script draws KV bytes against context from these counters.

// Before any Eigen include: GCC 12's false -Wmaybe-uninitialized (see bench_model.hpp).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <benchmark/benchmark.h>

#include <cstdint>
#include <string>
#include <vector>

#include "bench_model.hpp"
#include "kvdecode/kvdecode.hpp"

namespace {

using namespace kvdecode;

/// Planner counters shared by both benchmarks: bytes per position, the cache at seq_len, the
/// f32 weights, and the shortest context whose cache (batch 1) is larger than the weights.
void set_plan_counters(benchmark::State& state, const ModelConfig& cfg) {
  const MemoryPlanner<ContiguousStore<float>> plan(cfg);
  const std::uint64_t weights = weight_bytes<float>(cfg);
  state.counters["kv_bytes_per_token"] = plan.bytes_per_position();
  state.counters["kv_MiB_at_seq_len"] =
      static_cast<double>(plan.kv_bytes(static_cast<std::uint64_t>(cfg.seq_len))) / (1 << 20);
  state.counters["weights_MiB"] = static_cast<double>(weights) / (1 << 20);
  state.counters["kv_exceeds_weights_at"] = static_cast<double>(plan.max_context(weights) + 1);
  state.counters["n_heads/n_kv_heads"] = static_cast<double>(cfg.kv_mul());
  state.counters["n_layers"] = static_cast<double>(cfg.n_layers);
  state.counters["seq_len"] = static_cast<double>(cfg.seq_len);
}

void BM_KvAppend(benchmark::State& state, std::int64_t n_kv_heads) {
  const ModelConfig cfg = kvdecode::bench::bench_config(n_kv_heads);
  ContiguousStore<float> store(cfg);
  const MemoryPlanner<ContiguousStore<float>> plan(cfg);
  if (plan.kv_bytes(store.capacity()) != store.memory_bytes()) {
    state.SkipWithError("MemoryPlanner disagrees with ContiguousStore::memory_bytes()");
    return;
  }
  const auto kv_dim = static_cast<std::size_t>(cfg.kv_dim());
  const std::vector<float> k(kv_dim, 0.5f), v(kv_dim, -0.5f);
  const std::int32_t id = 1;
  const std::size_t n_layers = store.n_layers();
  for (auto _ : state) {
    if (store.size() == store.capacity()) store.reset();  // O(1); rows are overwritten
    store.begin_append(std::span<const std::int32_t>(&id, 1));
    for (std::size_t l = 0; l < n_layers; ++l) store.write(l, 0, k.data(), v.data());
    store.commit_append();
  }
  benchmark::DoNotOptimize(store.key(0, 0, 0).data());
  state.SetItemsProcessed(state.iterations());  // positions appended
  state.SetBytesProcessed(state.iterations() *
                          static_cast<std::int64_t>(plan.bytes_per_position()));
  set_plan_counters(state, cfg);
}

/// Llama-2-7B (MHA) and Llama-3-8B (GQA 4) shapes: the cache in f32 outgrows the weights at a
/// long context or a modest batch. Times only the planner (a few divisions).
ModelConfig llama_shape(std::int64_t n_kv_heads, std::int64_t hidden, std::int64_t vocab,
                        std::int64_t seq_len) {
  ModelConfig c;
  c.dim = 4096;
  c.hidden_dim = hidden;
  c.n_layers = 32;
  c.n_heads = 32;
  c.n_kv_heads = n_kv_heads;
  c.vocab_size = vocab;
  c.seq_len = seq_len;
  return c;
}

void BM_KvPlan(benchmark::State& state, const ModelConfig& cfg) {
  const MemoryPlanner<ContiguousStore<float>> plan(cfg);
  std::uint64_t budget = std::uint64_t{24} << 30;  // this machine's RAM
  for (auto _ : state) {
    benchmark::DoNotOptimize(budget);
    benchmark::DoNotOptimize(plan.max_context(budget, 1));
  }
  set_plan_counters(state, cfg);
  state.counters["max_context_in_24GiB"] = static_cast<double>(plan.max_context(budget));
}

const bool registered = [] {
  for (const auto& [name, kv] : {std::pair{"MHA", 6}, std::pair{"GQA3", 2}, std::pair{"MQA", 1}}) {
    benchmark::RegisterBenchmark((std::string("BM_KvAppend/15M_") + name).c_str(), BM_KvAppend,
                                 std::int64_t{kv});
  }
  benchmark::RegisterBenchmark("BM_KvPlan/7B_MHA", BM_KvPlan, llama_shape(32, 11008, 32000, 4096));
  benchmark::RegisterBenchmark("BM_KvPlan/8B_GQA4", BM_KvPlan, llama_shape(8, 14336, 128256, 8192));
  benchmark::RegisterBenchmark("BM_KvPlan/8B_MQA", BM_KvPlan, llama_shape(1, 14336, 128256, 8192));
  return true;
}();

}  // namespace

BENCHMARK_MAIN();
