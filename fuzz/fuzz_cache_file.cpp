// libFuzzer target: arbitrary bytes as a cache file for restore_cache, into every store kind.
// Byte 0 is a flag: its low bit set, the target recomputes both checksums before restoring, so
// the fuzzer gets past them to the field checks (a forger can do the same); bits 1.. choose the
// store kind (cache_kinds.hpp). restore_cache must either throw kvdecode::Error and leave the
// target store (and its pool) exactly as it was, or fill it with a sequence that then decodes.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cache_kinds.hpp"
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
  static const std::vector<std::int32_t> before = {1, 5, 9};

  std::vector<std::uint8_t> file(data + 1, data + size);
  if ((data[0] & 1) != 0 && file.size() >= cf::kHeaderBytes) {
    const auto put = [&](std::size_t at, std::uint64_t v) {
      for (std::size_t i = 0; i < 8; ++i) file[at + i] = static_cast<std::uint8_t>(v >> (8 * i));
    };
    put(cf::kOffPayloadHash,
        XXH3_64bits(file.data() + cf::kHeaderBytes, file.size() - cf::kHeaderBytes));
    put(cf::kOffHeaderHash, XXH3_64bits(file.data(), cf::kOffHeaderHash));
  }
  const auto& path = kf::scratch_file("cache_file");
  kf::write_scratch(path, file.data(), file.size());

  kf::with_cache_store((data[0] >> 1) % kf::kCacheKinds, model.config(), [&](auto& store) {
    kvdecode::Activations<float> act(
        model.config(), {.max_chunk = kf::kMaxTokens, .store_scratch = store.block_scratch_size()});
    kf::feed(model, store, act, before);
    const kf::StoreState was = kf::store_state(store);
    try {
      kvdecode::restore_cache(fingerprint, store, path);
    } catch (const kvdecode::Error&) {
      kf::require(kf::store_state(store) == was, "a refused restore changed nothing");
      return;
    }
    kf::require(store.size() <= store.capacity(), "restored within capacity");
    if constexpr (requires { store.pool(); }) store.pool()->check_invariants();
    if (kvdecode::detail::append_limit(store) > 0) (void)model.decode(3, store, act);
  });
  return 0;
}
