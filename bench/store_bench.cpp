// BM_StoreDecode: one decode step at a long context T (4096 .. 16384 cached positions) for each
// KV store: ContiguousStore<float> (f32), Int8Store, Q4Store, and WindowStore (W = 1024, S = 4,
// trained-window and streaming policies), on one thread. At long context the cache, not the
// weights, is most of the bytes a step reads, so a store that reads fewer bytes per position
// should decode faster.
//
// Shape: llama2.c's stories15M (dim 288, hidden 768, 6 layers, 6 heads of 48, no GQA) with vocab
// 512, so the classifier (512 × 288) does not hide the cache, and seq_len 16448 (T = 16384 cached
// positions plus the new one, rounded up to a group of 64).
//
// The cache is filled by writing random K/V rows straight into the store (the timing does not
// depend on the values, and a prefill of 16384 tokens would cost minutes); the timed loop is
// model.decode() of position T, then truncate(T), so every iteration sees the same T.
// KVDECODE_BENCH_SMOKE=1 runs T = 256 only.

// Before any Eigen include: GCC 12's false -Wmaybe-uninitialized (see bench_model.hpp).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <benchmark/benchmark.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "bench_model.hpp"
#include "kvdecode/kvdecode.hpp"

namespace {

using namespace kvdecode;

constexpr std::size_t kWindowPositions = 1024;  // W of both WindowStore policies
constexpr std::size_t kSinkPositions = 4;       // S, StreamingLLM's choice

ModelConfig long_config() {
  ModelConfig c;
  c.dim = 288;
  c.hidden_dim = 768;
  c.n_layers = 6;
  c.n_heads = 6;
  c.n_kv_heads = 6;
  c.vocab_size = 512;
  c.seq_len = 16448;
  return c;
}

const Model<float>& long_model() {
  static const Model<float> model(random_weights<float>(long_config(), 42));
  return model;
}

enum class Kind { kF32, kInt8, kQ4, kWindow, kStreaming };

// The store of each kind for `capacity` positions.
template <Kind K>
auto make_store(const ModelConfig& cfg, std::size_t capacity) {
  if constexpr (K == Kind::kF32) {
    return ContiguousStore<float>(cfg, capacity);
  } else if constexpr (K == Kind::kInt8) {
    return Int8Store<float>(cfg, capacity);
  } else if constexpr (K == Kind::kQ4) {
    return Q4Store<float>(cfg, capacity);
  } else {
    return WindowStore<float>(cfg, {.window = kWindowPositions,
                                    .sinks = kSinkPositions,
                                    .policy = K == Kind::kWindow ? WindowPolicy::kTrainedWindow
                                                                 : WindowPolicy::kStreaming,
                                    .max_chunk = 1,
                                    .max_positions = capacity});
  }
}

// Bytes of K and V one position costs in the store (scales included), as its class states it.
template <Kind K>
double bytes_per_position(const ModelConfig& cfg) {
  const double f32 = 2.0 * static_cast<double>(cfg.n_layers * cfg.kv_dim()) * sizeof(float);
  if constexpr (K == Kind::kInt8) {
    return static_cast<double>(Int8Store<float>::bytes_per_token(cfg));
  } else if constexpr (K == Kind::kQ4) {
    return Q4Store<float>::bytes_per_token(cfg);
  } else {
    return f32;
  }
}

// T positions of random K/V rows, written straight into the store: one append for the full
// stores, one position per append for the window stores (streaming past S + W takes one
// position at a time, and the ring holds only max_chunk = 1 extra slot).
template <class Store>
void fill(Store& store, const ModelConfig& cfg, std::size_t T, bool one_at_a_time) {
  const auto kv_dim = static_cast<std::size_t>(cfg.kv_dim());
  const auto L = static_cast<std::size_t>(cfg.n_layers);
  const std::vector<std::int32_t> tokens = bench::bench_tokens(T);
  detail::SplitMix64 rng(3);
  std::vector<float> rows(2 * 64 * kv_dim);  // [2][64][kv_dim] K then V, reused round-robin
  for (float& x : rows) x = static_cast<float>(rng.next() % 2001) / 1000.0f - 1.0f;
  const float* k = rows.data();
  const float* v = rows.data() + 64 * kv_dim;
  const std::size_t step = one_at_a_time ? 1 : T;
  for (std::size_t first = 0; first < T; first += step) {
    const std::size_t n = std::min(step, T - first);
    store.begin_append(std::span<const std::int32_t>(tokens).subspan(first, n));
    for (std::size_t l = 0; l < L; ++l)
      for (std::size_t i = 0; i < n; ++i) {
        const std::size_t r = (first + i + l) % 64;
        store.write(l, i, k + r * kv_dim, v + r * kv_dim);
      }
    store.commit_append();
  }
}

template <Kind K>
void BM_StoreDecode(benchmark::State& state) {
  const Model<float>& model = long_model();
  const ModelConfig& cfg = model.config();
  const auto T = static_cast<std::size_t>(state.range(0));
  auto store = make_store<K>(cfg, T + 1);
  fill(store, cfg, T, K == Kind::kWindow || K == Kind::kStreaming);
  Activations<float> act(cfg, 1, store.block_scratch_size());
  const std::int32_t token = 7;
  // Positions attention reads for the new token at index T: all T + 1, or the S sinks and the
  // W newest under a window.
  const std::size_t rows_read = K == Kind::kWindow || K == Kind::kStreaming
                                    ? std::min(T + 1, kSinkPositions + kWindowPositions)
                                    : T + 1;
  {  // one counted step, outside the timing: the weight bytes it streams
    WorkCounters c;
    act.counters = &c;
    model.decode(token, store, act);
    store.truncate(T);
    act.counters = nullptr;
    const double kv_read = bytes_per_position<K>(cfg) * static_cast<double>(rows_read);
    const auto weights = static_cast<double>(c.decode.weight_bytes_read);
    state.counters["kv_bytes_per_token"] = bytes_per_position<K>(cfg);
    state.counters["store_bytes"] = static_cast<double>(store.memory_bytes());
    state.counters["store_bytes_per_token"] =
        static_cast<double>(store.memory_bytes()) / static_cast<double>(T);
    state.counters["kv_bytes_read"] = kv_read;
    state.counters["weight_bytes_read"] = weights;
    state.counters["bytes_per_step"] = kv_read + weights;
    state.counters["kv_share"] = kv_read / (kv_read + weights);
  }
  for (auto _ : state) {
    benchmark::DoNotOptimize(model.decode(token, store, act).data());
    store.truncate(T);
  }
  state.SetItemsProcessed(state.iterations());  // items/s = tokens/s
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(state.counters["bytes_per_step"].value));
}

void contexts(benchmark::internal::Benchmark* b) {
  if (bench::smoke()) {
    b->Arg(256);
  } else {
    for (const std::int64_t T : {4096, 8192, 16384}) b->Arg(T);
  }
  b->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_StoreDecode<Kind::kF32>)->Name("BM_StoreDecode/f32")->Apply(contexts);
BENCHMARK(BM_StoreDecode<Kind::kInt8>)->Name("BM_StoreDecode/int8")->Apply(contexts);
BENCHMARK(BM_StoreDecode<Kind::kQ4>)->Name("BM_StoreDecode/q4")->Apply(contexts);
BENCHMARK(BM_StoreDecode<Kind::kWindow>)->Name("BM_StoreDecode/window")->Apply(contexts);
BENCHMARK(BM_StoreDecode<Kind::kStreaming>)->Name("BM_StoreDecode/streaming")->Apply(contexts);

}  // namespace

BENCHMARK_MAIN();
