// Cache files (io/cache_file.hpp): the checksum XXH3-64 against XXH64 (both from libxxhash-dev)
// on a buffer larger than the caches, and a save and a restore of a contiguous cache, whose
// bytes/s say what the checksums and the copies cost next to the disk.
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "kvdecode/io/cache_file.hpp"
#include "kvdecode/kvdecode.hpp"

namespace {

std::vector<unsigned char> pattern(std::size_t bytes) {
  std::vector<unsigned char> b(bytes);  // [bytes]
  for (std::size_t i = 0; i < b.size(); ++i)
    b[i] = static_cast<unsigned char>((i * 2654435761u) >> 13);
  return b;
}

// Streaming in 1 MiB pieces, as a restore's first pass does.
void BM_ChecksumXxh3(benchmark::State& state) {
  const auto data = pattern(static_cast<std::size_t>(state.range(0)) << 20);
  for (auto _ : state) {
    kvdecode::Checksum h;
    for (std::size_t at = 0; at < data.size(); at += 1 << 20) h.update(data.data() + at, 1 << 20);
    benchmark::DoNotOptimize(h.digest());
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(data.size()));
}
BENCHMARK(BM_ChecksumXxh3)->Arg(8)->Arg(256);

// The baseline: XXH64, the hash the library used before XXH3.
void BM_ChecksumXxh64(benchmark::State& state) {
  const auto data = pattern(static_cast<std::size_t>(state.range(0)) << 20);
  for (auto _ : state) {
    XXH64_state_t h;
    XXH64_reset(&h, 0);
    for (std::size_t at = 0; at < data.size(); at += 1 << 20)
      XXH64_update(&h, data.data() + at, 1 << 20);
    benchmark::DoNotOptimize(XXH64_digest(&h));
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(data.size()));
}
BENCHMARK(BM_ChecksumXxh64)->Arg(8)->Arg(256);

/// A contiguous cache of n positions of a 6-layer model (kv_dim 288, the 15M shape's cache).
struct SavedCache {
  kvdecode::ModelConfig cfg;
  kvdecode::ModelFingerprint fingerprint;
  kvdecode::ContiguousStore<float> store;
  std::filesystem::path file;
  explicit SavedCache(std::size_t n) {
    cfg.dim = 288;
    cfg.hidden_dim = 768;
    cfg.n_layers = 6;
    cfg.n_heads = 6;
    cfg.n_kv_heads = 6;
    cfg.vocab_size = 512;
    cfg.seq_len = static_cast<std::int64_t>(n);
    fingerprint.config = cfg;
    fingerprint.weight_bytes = 4;
    store = kvdecode::ContiguousStore<float>(cfg);
    std::vector<std::int32_t> tokens(n, 1);
    std::vector<float> row(static_cast<std::size_t>(cfg.kv_dim()), 0.5f);
    store.begin_append(tokens);
    for (std::size_t l = 0; l < store.n_layers(); ++l)
      for (std::size_t i = 0; i < n; ++i) store.write(l, i, row.data(), row.data());
    store.commit_append();
    file = std::filesystem::temp_directory_path() /
           ("kvdecode_cache_bench_" + std::to_string(::getpid()) + ".kvc");
  }
  ~SavedCache() {
    std::error_code ec;
    std::filesystem::remove(file, ec);
  }
  std::int64_t bytes() const { return static_cast<std::int64_t>(std::filesystem::file_size(file)); }
};

void BM_SaveCache(benchmark::State& state) {
  SavedCache c(static_cast<std::size_t>(state.range(0)));
  for (auto _ : state) kvdecode::save_cache(c.fingerprint, c.store, c.file);
  state.SetBytesProcessed(state.iterations() * c.bytes());
  state.SetItemsProcessed(state.iterations() * state.range(0));
}
BENCHMARK(BM_SaveCache)->Arg(1024)->Unit(benchmark::kMillisecond);

void BM_RestoreCache(benchmark::State& state) {
  SavedCache c(static_cast<std::size_t>(state.range(0)));
  kvdecode::save_cache(c.fingerprint, c.store, c.file);
  kvdecode::ContiguousStore<float> target(c.cfg);
  for (auto _ : state) kvdecode::restore_cache(c.fingerprint, target, c.file);
  state.SetBytesProcessed(state.iterations() * c.bytes());
  state.SetItemsProcessed(state.iterations() * state.range(0));
}
BENCHMARK(BM_RestoreCache)->Arg(1024)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
