// A request that memory be brought into the cache ahead of its use, where the reader knows its
// next address but the hardware prefetchers would not catch it in time (short arrays read a
// few lines at a time beside longer streams).
#pragma once

#include <cstddef>

// A function whose only effect is prefetches has no effect GCC 12 counts (the built-in touches
// no memory it models), so GCC may take it for const and drop its calls before inlining it:
// every prefetch-only helper is inlined first.
#if defined(__GNUC__) || defined(__clang__)
#define KVDECODE_PREFETCH_INLINE inline __attribute__((always_inline))
#else
#define KVDECODE_PREFETCH_INLINE inline
#endif

namespace kvdecode::detail {

/// Where a request brings its lines: the L1 (and the levels below) for lines read next, the L2
/// for lines wanted a while from now, which in the L1 would only push nearer ones out.
enum class PrefetchTo { kL1 = 3, kL2 = 2 };  // __builtin_prefetch's locality

/// Requests the lines of [p, p + bytes) for reading (a no-op where the compiler has no
/// prefetch built-in; a request never faults).
template <PrefetchTo kTo = PrefetchTo::kL1>
KVDECODE_PREFETCH_INLINE void prefetch_bytes(const void* p, std::size_t bytes) {
#if defined(__GNUC__) || defined(__clang__)
  const auto* c = static_cast<const char*>(p);
  for (std::size_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, static_cast<int>(kTo));
#else
  static_cast<void>(p), static_cast<void>(bytes);
#endif
}

}  // namespace kvdecode::detail
