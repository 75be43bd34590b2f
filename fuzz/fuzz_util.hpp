// Helpers for the libFuzzer targets: a per-process scratch file for readers that take a path.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

namespace kvdecode::fuzz {

/// A file that holds the current input: in /dev/shm when it exists (no disk I/O per run), named
/// by the process id so parallel fuzzers (-jobs) never share one.
inline const std::filesystem::path& scratch_file(const char* tag) {
  static const std::filesystem::path path = [&] {
    const std::filesystem::path dir = std::filesystem::is_directory("/dev/shm")
                                          ? "/dev/shm"
                                          : std::filesystem::temp_directory_path();
    return dir / ("kvdecode_fuzz_" + std::string(tag) + "_" + std::to_string(::getpid()));
  }();
  return path;
}

/// Replaces the scratch file's contents with data[0, size); aborts if it cannot (a broken setup
/// is not a finding).
inline void write_scratch(const std::filesystem::path& path, const std::uint8_t* data,
                          std::size_t size) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr || std::fwrite(data, 1, size, f) != size || std::fclose(f) != 0) {
    std::fprintf(stderr, "fuzz: cannot write %s\n", path.c_str());
    std::abort();
  }
}

/// Fails the run (libFuzzer reports a crash with the input) when an invariant does not hold.
inline void require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz invariant violated: %s\n", what);
    std::abort();
  }
}

}  // namespace kvdecode::fuzz
