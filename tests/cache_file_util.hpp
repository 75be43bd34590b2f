// Helpers of the cache-file tests: a file's bytes read and written whole, little-endian fields
// patched in place, and checksums recomputed after an edit, as a forger (or a buggy writer)
// would, so that the checks behind them are the ones tested.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvdecode/io/cache_file.hpp"

namespace kvdecode::testing_util {

using FileBytes = std::vector<unsigned char>;

inline FileBytes read_bytes(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline void write_bytes(const std::filesystem::path& p, const FileBytes& b) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

/// b [at, at + bytes) = v, little-endian; a field past the end is a broken test, not a patch.
template <std::size_t bytes, class U>
void put_le(FileBytes& b, std::size_t at, U v) {
  if (at > b.size() || b.size() - at < bytes)
    throw std::out_of_range("a " + std::to_string(bytes) + "-byte field at offset " +
                            std::to_string(at) + " of a " + std::to_string(b.size()) +
                            "-byte file");
  for (std::size_t i = 0; i < bytes; ++i) b[at + i] = static_cast<unsigned char>(v >> (8 * i));
}
inline void put_u32(FileBytes& b, std::size_t at, std::uint32_t v) { put_le<4>(b, at, v); }
inline void put_u64(FileBytes& b, std::size_t at, std::uint64_t v) { put_le<8>(b, at, v); }

/// Recomputes the header checksum (XXH3-64 of the bytes before it) after an edit and, with
/// payload_too, first the payload's (XXH3-64 of every byte after the header).
inline void reseal(FileBytes& b, bool payload_too = false) {
  namespace cf = detail::cache_file;
  if (payload_too) {
    put_u64(b, cf::kOffPayloadHash,
            XXH3_64bits(b.data() + cf::kHeaderBytes, b.size() - cf::kHeaderBytes));
  }
  put_u64(b, cf::kOffHeaderHash, XXH3_64bits(b.data(), cf::kOffHeaderHash));
}

}  // namespace kvdecode::testing_util
