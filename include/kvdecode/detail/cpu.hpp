// The kernel sets: which instruction-set kernels the projections and (de)quantization run with,
// chosen once at run time from what the CPU supports, so a binary built without -march flags
// still runs the AVX-512 kernels. All sets are compiled into every binary (GCC/Clang target
// attributes); KVDECODE_ISA or force_kernel_set() picks another supported set. AMX tiles, for
// prefill with bf16 weights, come on top of the avx512bf16 set with a switch of their own
// (KVDECODE_AMX, force_amx()).
#pragma once

#include <array>
#include <atomic>
#include <cstdlib>
#include <optional>
#include <string_view>

#include "kvdecode/error.hpp"

// x86 kernels need the GCC/Clang target attribute; elsewhere only the portable set exists.
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define KVDECODE_X86_KERNELS 1
#define KVDECODE_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define KVDECODE_TARGET_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")))
#define KVDECODE_TARGET_AVX512BF16 \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni")))
#define KVDECODE_TARGET_AMX                                                            \
  __attribute__((                                                                      \
      target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni,amx-tile," \
             "amx-bf16")))
#else
#define KVDECODE_X86_KERNELS 0
#endif

// AMX tiles exist in 64-bit mode only (GCC declares their intrinsics for x86-64 alone).
#if KVDECODE_X86_KERNELS && defined(__x86_64__)
#define KVDECODE_AMX_KERNELS 1
#else
#define KVDECODE_AMX_KERNELS 0
#endif

// GCC 12 reports its own intrinsics' deliberately undefined vectors (_mm512_undefined_*) as
// uninitialized wherever they are inlined; the kernels are bracketed by these to silence it.
#if defined(__clang__)
#define KVDECODE_INTRINSICS_BEGIN \
  _Pragma("clang diagnostic push") _Pragma("clang diagnostic ignored \"-Wuninitialized\"")
#define KVDECODE_INTRINSICS_END _Pragma("clang diagnostic pop")
#elif defined(__GNUC__)
#define KVDECODE_INTRINSICS_BEGIN                                                      \
  _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wuninitialized\"") \
      _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"")
#define KVDECODE_INTRINSICS_END _Pragma("GCC diagnostic pop")
#else
#define KVDECODE_INTRINSICS_BEGIN
#define KVDECODE_INTRINSICS_END
#endif

#if KVDECODE_X86_KERNELS
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
KVDECODE_INTRINSICS_BEGIN
#include <immintrin.h>
KVDECODE_INTRINSICS_END
#endif

namespace kvdecode {

/// A set of kernels, each needing the instructions of the ones before it plus its own:
/// kPortable plain C++ (and Eigen) only; kAvx2 AVX2 + FMA + F16C; kAvx512 AVX-512 F/BW/VL;
/// kAvx512Bf16 that plus AVX512_BF16's dot product for bf16 weights and AVX512_VNNI's for
/// block-quantized ones (every CPU with AVX512_BF16 has VNNI, so VNNI needs no set of its own).
enum class KernelSet { kPortable, kAvx2, kAvx512, kAvx512Bf16 };

inline constexpr std::array<KernelSet, 4> kKernelSets = {
    KernelSet::kPortable, KernelSet::kAvx2, KernelSet::kAvx512, KernelSet::kAvx512Bf16};

/// "portable", "avx2", "avx512", "avx512bf16": the names KVDECODE_ISA takes.
inline constexpr const char* kernel_set_name(KernelSet s) {
  switch (s) {
    case KernelSet::kAvx2:
      return "avx2";
    case KernelSet::kAvx512:
      return "avx512";
    case KernelSet::kAvx512Bf16:
      return "avx512bf16";
    case KernelSet::kPortable:
      break;
  }
  return "portable";
}

/// The set a name denotes, if any.
inline std::optional<KernelSet> parse_kernel_set(std::string_view name) {
  for (const KernelSet s : kKernelSets)
    if (name == kernel_set_name(s)) return s;
  return std::nullopt;
}

#if KVDECODE_X86_KERNELS
/// CPUID leaf 1, ECX bit 29 (F16C): read directly, as clang 14's __builtin_cpu_supports does not
/// know the name.
inline bool cpu_has_f16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & (1u << 29)) != 0;
}
#endif

/// Whether this CPU (and OS: the features' register state is enabled) can run set s.
inline bool cpu_supports(KernelSet s) {
#if KVDECODE_X86_KERNELS
  switch (s) {
    case KernelSet::kPortable:
      return true;
    case KernelSet::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
    case KernelSet::kAvx512:
      return cpu_supports(KernelSet::kAvx2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
    case KernelSet::kAvx512Bf16:
      return cpu_supports(KernelSet::kAvx512) && __builtin_cpu_supports("avx512bf16") &&
             __builtin_cpu_supports("avx512vnni");
  }
  return false;
#else
  return s == KernelSet::kPortable;
#endif
}

/// The fastest set this CPU supports.
inline KernelSet best_kernel_set() {
  for (auto it = kKernelSets.rbegin(); it != kKernelSets.rend(); ++it)
    if (cpu_supports(*it)) return *it;
  return KernelSet::kPortable;
}

namespace detail {

/// KVDECODE_ISA when set (an unknown name or a set the CPU lacks is an Error), else the best.
inline KernelSet kernel_set_from_environment() {
  const char* env = std::getenv("KVDECODE_ISA");
  if (env == nullptr || *env == '\0') return best_kernel_set();
  const std::optional<KernelSet> s = parse_kernel_set(env);
  KVDECODE_CHECK(s.has_value(), "KVDECODE_ISA=", env,
                 " names no kernel set; expected portable, avx2, avx512 or avx512bf16");
  KVDECODE_CHECK(cpu_supports(*s), "KVDECODE_ISA=", env, ": this CPU lacks its instructions; ",
                 "the best set it supports is ", kernel_set_name(best_kernel_set()));
  return *s;
}

/// The process-wide choice: one value, set on first use, read once per kernel call.
inline std::atomic<KernelSet>& kernel_set_slot() {
  static std::atomic<KernelSet> slot{kernel_set_from_environment()};
  return slot;
}

}  // namespace detail

/// The set every kernel call runs with: KVDECODE_ISA if set, else best_kernel_set(), unless
/// force_kernel_set() chose another. Results differ between sets in f32 summation order, and
/// in the avx512bf16 set's 4-bit attention scores, which round the query to int8
/// (detail/coded_attention.hpp).
inline KernelSet active_kernel_set() {
  return detail::kernel_set_slot().load(std::memory_order_relaxed);
}

/// The active set's name (for reports and logs).
inline const char* active_kernel_set_name() { return kernel_set_name(active_kernel_set()); }

/// Makes every later kernel call use s, process-wide (tests, benchmarks comparing sets). Throws
/// Error, changing nothing, if this CPU cannot run s. A call already running keeps its set: each
/// projection reads the set once, so one region never mixes two.
inline void force_kernel_set(KernelSet s) {
  KVDECODE_CHECK(cpu_supports(s), "force_kernel_set: this CPU cannot run the ", kernel_set_name(s),
                 " kernels; the best set it supports is ", kernel_set_name(best_kernel_set()));
  detail::kernel_set_slot().store(s, std::memory_order_relaxed);
}

// ---------------------------------------------------------------------------------------------
// AMX: tile registers and a bf16 tile dot product, used on top of the avx512bf16 set.
// ---------------------------------------------------------------------------------------------

namespace detail {

/// CPUID: AMX-TILE and AMX-BF16 (leaf 7, EDX bits 24 and 22) with palette 1 holding 8 tiles of
/// 16 rows × 64 bytes (leaf 0x1D); then, on Linux, the process's permission to use the tile
/// data state (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, feature 18), which the kernel
/// grants to the whole process. Anything missing or refused is false, not an error.
inline bool probe_amx_bf16() {
#if KVDECODE_AMX_KERNELS && defined(__linux__) && defined(SYS_arch_prctl)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
  if ((edx & (1u << 24)) == 0 || (edx & (1u << 22)) == 0) return false;
  if (__get_cpuid_max(0, nullptr) < 0x1D) return false;
  __cpuid_count(0x1D, 0, eax, ebx, ecx, edx);
  if (eax < 1) return false;  // highest palette
  __cpuid_count(0x1D, 1, eax, ebx, ecx, edx);
  if ((ebx >> 16) < 8 || (ebx & 0xFFFFu) < 64 || (ecx & 0xFFFFu) < 16) return false;
  if (!cpu_supports(KernelSet::kAvx512Bf16)) return false;
  constexpr long kArchGetXcompPerm = 0x1022;
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return false;
  unsigned long long permitted = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &permitted) != 0) return false;
  return (permitted & (1ull << kXfeatureXtiledata)) != 0;
#else
  return false;
#endif
}

}  // namespace detail

/// Whether this CPU has AMX-BF16 and the OS lets this process use its tiles (asked once, on the
/// first call, thread-safe).
inline bool cpu_supports_amx() {
  static const bool ok = detail::probe_amx_bf16();
  return ok;
}

namespace detail {

/// KVDECODE_AMX=0 or off turns AMX off, 1 or on asks for it (an Error where it is unavailable);
/// unset, AMX is used where available.
inline bool amx_from_environment() {
  const char* env = std::getenv("KVDECODE_AMX");
  if (env == nullptr || *env == '\0') return cpu_supports_amx();
  const std::string_view v(env);
  if (v == "0" || v == "off") return false;
  KVDECODE_CHECK(v == "1" || v == "on", "KVDECODE_AMX=", env, ": expected 0, off, 1 or on");
  KVDECODE_CHECK(cpu_supports_amx(), "KVDECODE_AMX=", env,
                 ": this CPU or OS does not let the process use AMX-BF16 tiles");
  return true;
}

inline std::atomic<bool>& amx_slot() {
  static std::atomic<bool> slot{amx_from_environment()};
  return slot;
}

}  // namespace detail

/// Whether prefill-sized projections of bf16 weights run on AMX tiles while the avx512bf16 set
/// is active: where available unless KVDECODE_AMX=0 or force_amx(false). Results differ from the
/// set's own kernels only in f32 summation order.
inline bool amx_enabled() { return detail::amx_slot().load(std::memory_order_relaxed); }

/// Turns AMX on or off process-wide (tests, benchmarks comparing both). Throws Error, changing
/// nothing, when asked for AMX where cpu_supports_amx() is false.
inline void force_amx(bool on) {
  KVDECODE_CHECK(!on || cpu_supports_amx(),
                 "force_amx: this CPU or OS does not let the process use AMX-BF16 tiles");
  detail::amx_slot().store(on, std::memory_order_relaxed);
}

}  // namespace kvdecode
