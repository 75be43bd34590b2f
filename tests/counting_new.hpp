// Counts every heap allocation of the test binary that includes this header, so that a test can
// prove a region allocates nothing, in every build type: g_allocations counts each call of
// operator new and of the C allocation functions (malloc, calloc, realloc, aligned_alloc,
// posix_memalign, memalign, valloc), which is where Eigen's own allocator ends up.
// Include it in exactly one source file of an executable (the replacements are definitions).
//
// How: operator new allocates with malloc, and malloc and its family are interposed here
// (glibc lets the executable define them) and forwarded to glibc's __libc_* entry points.
// Under AddressSanitizer or ThreadSanitizer the sanitizer owns malloc, so instead its allocation
// hook counts (every allocation of its allocator calls it, operator new included).
#pragma once

// These operators allocate with malloc, so free is the matching release; GCC cannot see that
// through the replacement and warns at every inlined delete.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <new>

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define KVDECODE_TEST_SANITIZER_MALLOC 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define KVDECODE_TEST_SANITIZER_MALLOC 1
#endif
#endif

namespace {
std::atomic<long> g_allocations{0};  // heap allocations so far, of any kind
}  // namespace

#ifdef KVDECODE_TEST_SANITIZER_MALLOC

// Declared as in clang's <sanitizer/allocator_interface.h>, which GCC does not ship; both
// compilers' ASan and TSan runtimes define it.
extern "C" int __sanitizer_install_malloc_and_free_hooks(void (*malloc_hook)(const volatile void*,
                                                                             std::size_t),
                                                         void (*free_hook)(const volatile void*));

namespace {
void count_sanitizer_allocation(const volatile void*, std::size_t) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
}
void ignore_sanitizer_free(const volatile void*) {}
// Installed before main: the sanitizer calls it for every allocation from then on. (It takes
// both hooks or neither.)
[[maybe_unused]] const int g_hook_installed =
    __sanitizer_install_malloc_and_free_hooks(count_sanitizer_allocation, ignore_sanitizer_free);
}  // namespace

#else

extern "C" {
void* __libc_malloc(std::size_t n) noexcept;
void* __libc_calloc(std::size_t count, std::size_t n) noexcept;
void* __libc_realloc(void* p, std::size_t n) noexcept;
void* __libc_memalign(std::size_t align, std::size_t n) noexcept;
void* __libc_valloc(std::size_t n) noexcept;
void __libc_free(void* p) noexcept;

void* malloc(std::size_t n) noexcept {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  return __libc_malloc(n);
}
void* calloc(std::size_t count, std::size_t n) noexcept {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  return __libc_calloc(count, n);
}
void* realloc(void* p, std::size_t n) noexcept {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  return __libc_realloc(p, n);
}
void* memalign(std::size_t align, std::size_t n) noexcept {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  return __libc_memalign(align, n);
}
void* aligned_alloc(std::size_t align, std::size_t n) noexcept {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  return __libc_memalign(align, n);
}
int posix_memalign(void** out, std::size_t align, std::size_t n) noexcept {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (align < sizeof(void*) || (align & (align - 1)) != 0) return EINVAL;
  void* p = __libc_memalign(align, n);
  if (p == nullptr) return ENOMEM;
  *out = p;
  return 0;
}
void* valloc(std::size_t n) noexcept {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  return __libc_valloc(n);
}
void free(void* p) noexcept { __libc_free(p); }
}  // extern "C"

#endif  // KVDECODE_TEST_SANITIZER_MALLOC

// operator new goes through malloc (counted there, so once per call).
void* operator new(std::size_t n) {
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t n, std::align_val_t a) {
  const std::size_t align = static_cast<std::size_t>(a);
  if (void* p = std::aligned_alloc(align, (n + align - 1) / align * align)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
