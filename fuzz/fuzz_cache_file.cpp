// libFuzzer target: arbitrary bytes as a cache file for restore_cache. Byte 0 is a flag: when
// its low bit is set the target recomputes both checksums before restoring, so the fuzzer gets
// past them to the field checks (a forger can do the same). restore_cache must either throw
// kvdecode::Error and leave the target store exactly as it was, or fill it with a sequence that
// then decodes.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "fuzz_util.hpp"
#include "kvdecode/io/cache_file.hpp"
#include "kvdecode/kvdecode.hpp"
#include "seed_model.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace kf = kvdecode::fuzz;
  namespace cf = kvdecode::detail::cache_file;
  if (size < 1) return 0;
  static const kvdecode::Model<float> model(kf::seed_weights());
  static const kvdecode::ModelFingerprint fingerprint = kvdecode::model_fingerprint(model);
  static kvdecode::Activations<float> act(model.config(), 4);
  static const std::vector<std::int32_t> before = {1, 5, 9};

  std::vector<std::uint8_t> file(data + 1, data + size);
  if ((data[0] & 1) != 0 && file.size() >= cf::kHeaderBytes) {
    const auto put = [&](std::size_t at, std::uint64_t v) {
      for (std::size_t i = 0; i < 8; ++i) file[at + i] = static_cast<std::uint8_t>(v >> (8 * i));
    };
    put(cf::kOffPayloadHash,
        kvdecode::Xxh64::hash(file.data() + cf::kHeaderBytes, file.size() - cf::kHeaderBytes));
    put(cf::kOffHeaderHash, kvdecode::Xxh64::hash(file.data(), cf::kOffHeaderHash));
  }
  const auto& path = kf::scratch_file("cache_file");
  kf::write_scratch(path, file.data(), file.size());

  kvdecode::ContiguousStore<float> store(model.config());
  model.prefill(before, store, act);
  const std::vector<float> key0(store.key(0, 0, 2).begin(), store.key(0, 0, 2).end());
  try {
    kvdecode::restore_cache(fingerprint, store, path);
  } catch (const kvdecode::Error&) {
    kf::require(store.size() == before.size() && store.pending() == 0, "size unchanged");
    kf::require(std::equal(before.begin(), before.end(), store.tokens().begin()),
                "tokens unchanged");
    kf::require(std::equal(key0.begin(), key0.end(), store.key(0, 0, 2).begin()), "rows unchanged");
    return 0;
  }
  kf::require(store.size() <= store.capacity(), "restored within capacity");
  if (store.size() < store.capacity()) (void)model.decode(3, store, act);
  return 0;
}
