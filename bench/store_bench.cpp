// BM_StoreDecode: one decode step at a long context T (1024 .. 16384 cached positions) for each
// KV store: ContiguousStore<float> (f32), Int8Store, Q4Store, and WindowStore (W = 1024, S = 4,
// trained-window and streaming policies), on one thread. At long context the cache, not the
// weights, is most of the bytes a step reads, so a store that reads fewer bytes per position
// should decode faster.
//
// Shape: llama2.c's stories15M (dim 288, hidden 768, 6 layers, 6 heads of 48, no GQA) with vocab
// 512, so the classifier (512 × 288) does not hide the cache, and seq_len 16448 (T = 16384 cached
// positions plus the new one, rounded up to a group of 64). BM_StoreDecodeGqa: the same with 2
// kv heads (GQA, 3 query heads each): a third of the bytes per position, the same attention
// arithmetic per query head.
//
// The cache is filled by writing random K/V rows straight into the store (the timing does not
// depend on the values, and a prefill of 16384 tokens would cost minutes); the timed loop is
// model.decode() of position T, then truncate(T), so every iteration sees the same T.
// KVDECODE_BENCH_SMOKE=1 runs T = 256 only.
//
// Each run is paired with a read-bandwidth probe taken just before its timed loop (one thread
// summing a 512 MiB array, the median of 3 passes, as roofline_bench): kv_GB/s is the K/V bytes
// a step reads over the step's time, and kv_probe% that over the probe, both in thread CPU time.

// Before any Eigen include: GCC 12's false -Wmaybe-uninitialized (see bench_model.hpp).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <ctime>
#include <span>
#include <string>
#include <vector>

#include "bench_model.hpp"
#include "kvdecode/kvdecode.hpp"

namespace {

using namespace kvdecode;

constexpr std::size_t kWindowPositions = 1024;  // W of both WindowStore policies
constexpr std::size_t kSinkPositions = 4;       // S, StreamingLLM's choice

/// This thread's CPU time in seconds: on a shared machine, wall time also counts the time the
/// thread waited for a core (the tables quote CPU time too).
double thread_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

/// One thread's read bandwidth now (bytes/s): the median of 3 sums of a 512 MiB array, far
/// past the caches, with eight independent accumulators so loads are the limit.
double probe_bandwidth() {
  static const AlignedBuffer<float> a = [] {
    AlignedBuffer<float> b(std::size_t{1} << 27);  // [2^27] 512 MiB
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>(i & 7);
    return b;
  }();
  const auto pass = [&] {
    const double t0 = thread_seconds();
    float s[8] = {};
    for (std::size_t i = 0; i < a.size(); i += 8)
      for (std::size_t k = 0; k < 8; ++k) s[k] += a[i + k];
    benchmark::DoNotOptimize(s);
    return static_cast<double>(a.bytes()) / (thread_seconds() - t0);
  };
  pass();  // page-in and warm-up
  double passes[3] = {pass(), pass(), pass()};
  std::sort(passes, passes + 3);
  return passes[1];
}

constexpr std::int64_t kMhaKvHeads = 6;  // bench_config()'s heads: one kv head each
constexpr std::int64_t kGqaKvHeads = 2;  // 3 query heads per kv head

/// bench_config()'s 15M shape with a 16448-position context and a small vocabulary.
ModelConfig long_config(std::int64_t kv_heads) {
  ModelConfig c = bench::bench_config(kv_heads);
  c.vocab_size = 512;
  c.seq_len = 16448;
  return c;
}

/// The model of long_config(kv_heads), built at its first use.
const Model<float>& long_model(std::int64_t kv_heads) {
  if (kv_heads == kGqaKvHeads) {
    static const Model<float> gqa(random_weights<float>(long_config(kGqaKvHeads), 42));
    return gqa;
  }
  static const Model<float> mha(random_weights<float>(long_config(kMhaKvHeads), 42));
  return mha;
}

// T positions of random K/V rows, written straight into the store one position per append (a
// streaming window past S + W takes one position at a time, and its ring holds only
// max_chunk = 1 extra slot; the other stores do not mind).
template <class Store>
void fill(Store& store, const ModelConfig& cfg, std::size_t T) {
  const auto kv_dim = static_cast<std::size_t>(cfg.kv_dim());
  const auto L = static_cast<std::size_t>(cfg.n_layers);
  const std::vector<std::int32_t> tokens = bench::bench_tokens(T);
  detail::SplitMix64 rng(3);
  std::vector<float> rows(2 * 64 * kv_dim);  // [2][64][kv_dim] K then V, reused round-robin
  for (float& x : rows) x = static_cast<float>(rng.next() % 2001) / 1000.0f - 1.0f;
  const float* k = rows.data();
  const float* v = rows.data() + 64 * kv_dim;
  for (std::size_t p = 0; p < T; ++p) {
    store.begin_append(std::span<const std::int32_t>(tokens).subspan(p, 1));
    for (std::size_t l = 0; l < L; ++l) {
      const std::size_t r = (p + l) % 64;
      store.write(l, 0, k + r * kv_dim, v + r * kv_dim);
    }
    store.commit_append();
  }
}

/// One decode step at cache index T of store S built with `options` (capacity T + 1). The K/V
/// bytes it reads come from the work counters, which ask the store.
template <class S>
void BM_StoreDecode(benchmark::State& state, typename S::Options options, std::int64_t kv_heads) {
  const Model<float>& model = long_model(kv_heads);
  const ModelConfig& cfg = model.config();
  const auto T = static_cast<std::size_t>(state.range(0));
  options.capacity = T + 1;
  S store(cfg, options);
  fill(store, cfg, T);
  Activations<float> act(cfg, {.max_chunk = 1, .store_scratch = store.block_scratch_size()});
  const std::int32_t token = 7;
  {  // one counted step, outside the timing: the bytes it streams
    WorkCounters c;
    act.counters = &c;
    model.decode(token, store, act);
    store.truncate(T);
    act.counters = nullptr;
    const auto kv_read = static_cast<double>(c.decode.kv_bytes_read);
    const auto weights = static_cast<double>(c.decode.weight_bytes_read);
    state.counters["kv_bytes_per_token"] = MemoryPlanner<S>(cfg, options).bytes_per_position();
    state.counters["store_bytes"] = static_cast<double>(store.memory_bytes());
    state.counters["store_bytes_per_token"] =
        static_cast<double>(store.memory_bytes()) / static_cast<double>(T);
    state.counters["kv_bytes_read"] = kv_read;
    state.counters["weight_bytes_read"] = weights;
    state.counters["bytes_per_step"] = kv_read + weights;
    state.counters["kv_share"] = kv_read / (kv_read + weights);
  }
  const double probe = probe_bandwidth();
  const double t0 = thread_seconds();
  for (auto _ : state) {
    benchmark::DoNotOptimize(model.decode(token, store, act).data());
    store.truncate(T);
  }
  const double seconds = thread_seconds() - t0;
  const double kv_rate =
      state.counters["kv_bytes_read"].value * static_cast<double>(state.iterations()) / seconds;
  state.counters["probe_GB/s"] = probe * 1e-9;
  state.counters["kv_GB/s"] = kv_rate * 1e-9;
  state.counters["kv_probe%"] = 100 * kv_rate / probe;
  state.SetItemsProcessed(state.iterations());  // items/s = tokens/s
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(state.counters["bytes_per_step"].value));
}

void contexts(benchmark::internal::Benchmark* b) {
  if (bench::smoke()) {
    b->Arg(256);
  } else {
    for (const std::int64_t T : {1024, 4096, 8192, 16384}) b->Arg(T);
  }
  b->Unit(benchmark::kMillisecond);
}

constexpr WindowOptions window_options(WindowPolicy policy) {
  return {.window = kWindowPositions, .sinks = kSinkPositions, .policy = policy, .max_chunk = 1};
}

// Registered by hand: BENCHMARK_CAPTURE cannot take a template's name.
const bool kRegistered = [] {
  for (const std::int64_t kv_heads : {kMhaKvHeads, kGqaKvHeads}) {
    const std::string name = kv_heads == kMhaKvHeads ? "BM_StoreDecode" : "BM_StoreDecodeGqa";
    benchmark::RegisterBenchmark((name + "/f32").c_str(), BM_StoreDecode<ContiguousStore<float>>,
                                 ContiguousStore<float>::Options{}, kv_heads)
        ->Apply(contexts);
    benchmark::RegisterBenchmark((name + "/int8").c_str(), BM_StoreDecode<Int8Store<float>>,
                                 Int8Store<float>::Options{}, kv_heads)
        ->Apply(contexts);
    benchmark::RegisterBenchmark((name + "/q4").c_str(), BM_StoreDecode<Q4Store<float>>,
                                 Q4Store<float>::Options{}, kv_heads)
        ->Apply(contexts);
  }
  benchmark::RegisterBenchmark("BM_StoreDecode/window", BM_StoreDecode<WindowStore<float>>,
                               window_options(WindowPolicy::kTrainedWindow), kMhaKvHeads)
      ->Apply(contexts);
  benchmark::RegisterBenchmark("BM_StoreDecode/streaming", BM_StoreDecode<WindowStore<float>>,
                               window_options(WindowPolicy::kStreaming), kMhaKvHeads)
      ->Apply(contexts);
  return true;
}();

}  // namespace

BENCHMARK_MAIN();
