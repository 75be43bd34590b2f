// libFuzzer target: arbitrary bytes as a llama2.c v0 checkpoint file. load_checkpoint must either
// throw kvdecode::Error or return weights whose every tensor has the size the header implies;
// it must never crash, read out of bounds or allocate past CheckpointLimits.
#include <cstddef>
#include <cstdint>

#include "fuzz_util.hpp"
#include "kvdecode/io/checkpoint.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace kf = kvdecode::fuzz;
  const auto& path = kf::scratch_file("checkpoint");
  kf::write_scratch(path, data, size);
  // 16 MiB: far above any input libFuzzer makes, and it keeps a lying header from allocating.
  const kvdecode::CheckpointLimits limits{std::uint64_t{16} << 20};
  try {
    const kvdecode::CheckpointHeader h = kvdecode::read_checkpoint_header(path, limits);
    kf::require(h.file_bytes_expected == size, "the header's file size equals the input's");
    const kvdecode::Weights<float> w = kvdecode::load_checkpoint(path, limits);
    kf::require(w.config == h.config, "load_checkpoint returns the header's config");
    kf::require(w.bytes() == h.weight_bytes, "the tensors hold weight_bytes bytes");
    kf::require(w.layers.size() == static_cast<std::size_t>(h.config.n_layers), "n_layers");
  } catch (const kvdecode::Error&) {
    // A refused file: the expected outcome for almost every input.
  }
  return 0;
}
