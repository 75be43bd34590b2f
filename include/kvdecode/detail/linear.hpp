// linear_group: the projections of one forward step, y [n][out] = x [n][in] · w [out][in]ᵀ for
// each weight matrix sharing an input, scheduled onto a ThreadPool with the kernel set chosen
// once per call. The model, the tests and the benchmarks all project through it.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <initializer_list>
#include <type_traits>

#include "kvdecode/bf16.hpp"
#include "kvdecode/detail/cpu.hpp"
#include "kvdecode/detail/gemm.hpp"
#include "kvdecode/detail/gemm_amx.hpp"
#include "kvdecode/detail/gemm_lanes.hpp"
#include "kvdecode/detail/gemm_packed.hpp"
#include "kvdecode/detail/gemv.hpp"
#include "kvdecode/detail/qgemv.hpp"
#include "kvdecode/thread_pool.hpp"

namespace kvdecode::detail {

/// One output of a projection region: y [n][out] = x [n][in] · w [out][in]ᵀ.
template <class T, class W>
struct Projection {
  T* y;
  const W* w;
  std::size_t out;
  // [amx_packed_size(out, in)] w re-laid once for the AMX tiles (pack_weights_amx), or null:
  // the AMX path then re-lays each panel per call.
  const bf16* amx_panels = nullptr;
};

/// The scratch a multi-token projection needs (none for one token).
template <class T>
struct LinearScratch {
  // [threads][kPanelRows × in] a thread's packed weights: f32 panels, or (W ≠ T) bf16 widened,
  // bf16 pairs or AMX panels in the same bytes
  T* panels = nullptr;
  std::size_t panel_stride = 0;  // elements between two threads' panels
  // [n][in] x rounded to bf16 (W ≠ T); the bf16 pairs and AMX paths keep their bf16 rows
  // ([n][pair_depth(in)], [n][amx_lda(in)]) in the same bytes
  T* x_rounded = nullptr;
  std::int8_t* x_codes = nullptr;  // [n][in] x quantized (block-format W)
  float* x_scales = nullptr;       // [n][in / 32] their scales (block-format W)
  std::int32_t* x_sums = nullptr;  // [n][in / 32] each code block's sum (block-format W)
};

/// How a projection of 2..kMaxFewTokens tokens sums each output: kGemv as that token's GEMV
/// (gemm_few: one sequence's prefill, and so speculative verification, equals decode() bit for
/// bit), kLanes one fma chain per output whatever the batch (gemm_lanes: batched steps).
enum class FewTokenOrder { kGemv, kLanes };

/// Below this many weights a projection runs on one thread: waking the pool (~1-2 µs) would
/// cost more than the ~1 µs of work it shares out.
inline constexpr std::size_t kMinParallelWeights = std::size_t{1} << 15;

/// One token (GEMV, memory bound): threads claim chunks of ~64 KiB of weight rows of every
/// projection (ThreadPool::run_items: a thread's own share first, then the others'), so a thread
/// the OS delays holds the others up by one chunk at most. rows(p, r0, r1) computes rows [r0, r1)
/// of projection p.
template <class T, class W, class Rows>
void run_row_chunks(ThreadPool& threads, std::initializer_list<Projection<T, W>> ps,
                    std::size_t row_bytes, Rows&& rows) {
  const std::size_t chunk = std::max<std::size_t>(16, (std::size_t{1} << 16) / row_bytes / 16 * 16);
  std::size_t n_chunks = 0;
  for (const Projection<T, W>& p : ps) n_chunks += (p.out + chunk - 1) / chunk;
  threads.run_items(n_chunks, [&](std::size_t c, std::size_t) {
    for (const Projection<T, W>& p : ps) {  // chunk index → (projection, rows)
      const std::size_t here = (p.out + chunk - 1) / chunk;
      if (c < here) {
        const std::size_t r0 = c * chunk;
        rows(p, r0, std::min(p.out, r0 + chunk));
        return;
      }
      c -= here;
    }
  });
}

/// Block-format weights (W = Q8_0, Q4_0, in row_groups.hpp's layout): x is quantized once into
/// the scratch for every projection and thread (qgemv.hpp); then run_row_chunks for one token,
/// or for several tokens a static split of rows (slices of 16, whole groups), every thread
/// running all n tokens over its rows with the same kernel (qgemm_rows: tiles of tokens over
/// each group), so every token's outputs are its GEMV's.
template <class T, class W>
void linear_group_blocks(std::initializer_list<Projection<T, W>> ps, const T* x, std::size_t n,
                         std::size_t in, ThreadPool* pool, const LinearScratch<T>& scratch,
                         KernelSet ks) {
  static_assert(std::is_same_v<T, float>, "block-format weights compute in f32");
  quantize_activations(ks, x, n, in, scratch.x_codes, scratch.x_scales, scratch.x_sums);
  const std::int8_t* const xc = scratch.x_codes;
  const float* const xs = scratch.x_scales;
  const std::int32_t* const xsum = scratch.x_sums;
  std::size_t weights = 0;
  for (const Projection<T, W>& p : ps) weights += p.out * in;
  ThreadPool* const threads = weights >= kMinParallelWeights ? pool : nullptr;
  if (n == 1 && threads != nullptr && threads->size() > 1) {
    run_row_chunks(*threads, ps, in / kWeightBlock * sizeof(W),
                   [&](const Projection<T, W>& p, std::size_t r0, std::size_t r1) {
                     qgemm_rows(ks, p.y, p.w, xc, xs, xsum, 1, in, p.out, r0, r1);
                   });
    return;
  }
  parallel_run(threads, [&](std::size_t t, std::size_t nt) {
    for (const Projection<T, W>& p : ps) {
      const auto [r0, r1] = ThreadPool::share(p.out, nt, t, 16);
      if (r1 > r0) qgemm_rows(ks, p.y, p.w, xc, xs, xsum, n, in, p.out, r0, r1);
    }
  });
}

/// Whether prefill-sized products (more than kMaxFewTokens tokens) of these types with depth in
/// run on bf16 pairs (gemm_packed_pairs) in set ks: the avx512bf16 set, where AMX does not apply.
template <class T, class W>
bool packed_pairs_apply(KernelSet ks, std::size_t in) {
  return has_gemm_packed_pairs<T, W>(ks) && !amx_applies<T, W>(ks, in);
}

/// Runs projections that share their input x [n][in] in one parallel region of pool, so one
/// wake-up covers q, k and v (or gate and up). Small projections stay on the caller.
/// One token: run_row_chunks. Several tokens (GEMM, compute bound): a static split into one slice
/// per thread (slices of 16 rows); up to kMaxFewTokens tokens with a gemm_few kernel, each weight
/// row is streamed once for all of them and summed as the GEMV sums it (or, for order kLanes,
/// gemm_lanes with outputs in vector lanes); more tokens run the set's packed GEMM
/// (gemm_packed), which matches or beats Eigen's GEMM even where Eigen is compiled as wide, so
/// builds with and without -march flags run the same kernels; the portable set keeps Eigen's
/// GEMM (gemm_cols). With bf16 weights and several tokens, x is rounded once into scratch.x_rounded
/// for every thread (the rule in gemv.hpp); more than kMaxFewTokens run on AMX tiles where
/// amx_applies (gemm_amx.hpp), x rounded to bf16 rows in that scratch, reading a projection's
/// amx_panels where given (slices of 16 rows start at a block of the re-laid matrix), else, in
/// the avx512bf16 set, on bf16 pairs (gemm_packed_pairs, x as bf16 rows in that scratch).
template <class T, class W>
void linear_group_values(std::initializer_list<Projection<T, W>> ps, const T* x, std::size_t n,
                         std::size_t in, ThreadPool* pool, const LinearScratch<T>& scratch,
                         KernelSet ks, FewTokenOrder order) {
  std::size_t weights = 0;
  for (const Projection<T, W>& p : ps) weights += p.out * in;
  ThreadPool* const threads = weights >= kMinParallelWeights ? pool : nullptr;
  if (n == 1 && threads != nullptr && threads->size() > 1) {
    run_row_chunks(*threads, ps, in * sizeof(W),
                   [&](const Projection<T, W>& p, std::size_t r0, std::size_t r1) {
                     gemv_rows(ks, p.y, p.w, x, r0, r1, in);
                   });
    return;
  }
  const bool amx = n > kMaxFewTokens && amx_applies<T, W>(ks, in);
  const bool pairs = n > kMaxFewTokens && packed_pairs_apply<T, W>(ks, in);
  const T* xg = x;     // the GEMMs' input
  bf16* xa = nullptr;  // [n][amx_lda(in)] or [n][pair_depth(in)] x as bf16, in x_rounded's place
  if constexpr (!std::is_same_v<T, W>) {
    if (amx) {
      xa = reinterpret_cast<bf16*>(scratch.x_rounded);
      if constexpr (std::is_same_v<T, float>) pack_x_amx(xa, x, n, in);
    } else if (pairs) {
      xa = reinterpret_cast<bf16*>(scratch.x_rounded);
      if constexpr (std::is_same_v<T, float>) round_rows_to_pairs(xa, x, n, in);
    } else if (n > 1) {
      round_to_bf16(x, scratch.x_rounded, n * in);
      xg = scratch.x_rounded;
    }
  }
  const bool few = has_gemm_few<T, W>(ks) && n <= kMaxFewTokens;
  const bool lanes =
      order == FewTokenOrder::kLanes && has_gemm_lanes<T, W>(ks) && n <= kMaxFewTokens;
  const bool packed = !few && has_gemm_packed<T, W>(ks);
  parallel_run(threads, [&](std::size_t t, std::size_t nt) {
    for (const Projection<T, W>& p : ps) {
      const auto [r0, r1] = ThreadPool::share(p.out, nt, t, 16);
      if (r1 <= r0) continue;
      T* const panel =
          scratch.panels == nullptr ? nullptr : scratch.panels + t * scratch.panel_stride;
      if (n == 1) {
        gemv_rows(ks, p.y, p.w, x, r0, r1, in);
      } else if (amx) {
        if constexpr (std::is_same_v<T, float> && std::is_same_v<W, bf16>)
          gemm_amx(p.y, xa, p.w, n, in, p.out, r0, r1, reinterpret_cast<bf16*>(panel),
                   p.amx_panels);
      } else if (pairs) {
        if constexpr (std::is_same_v<T, float> && std::is_same_v<W, bf16>)
          gemm_packed_pairs(p.y, xa, p.w, n, in, p.out, r0, r1, reinterpret_cast<bf16*>(panel));
      } else if (lanes) {
        gemm_lanes(ks, p.y, xg, p.w, n, in, p.out, r0, r1, panel);
      } else if (few) {
        gemm_few(ks, p.y, xg, p.w, n, in, p.out, r0, r1, panel);
      } else if (packed) {
        if constexpr (std::is_same_v<T, float>)
          gemm_packed(ks, p.y, xg, p.w, n, in, p.out, r0, r1, panel);
      } else {
        gemm_cols(p.y, xg, p.w, n, in, p.out, r0, r1, panel);
      }
    }
  });
}

/// The projections of one step sharing x [n][in]: linear_group_values for f32 / bf16 weights,
/// linear_group_blocks for block formats.
template <class T, class W>
void linear_group(std::initializer_list<Projection<T, W>> ps, const T* x, std::size_t n,
                  std::size_t in, ThreadPool* pool, const LinearScratch<T>& scratch,
                  KernelSet ks = active_kernel_set(), FewTokenOrder order = FewTokenOrder::kGemv) {
  if constexpr (kIsBlockFormat<W>) {
    linear_group_blocks(ps, x, n, in, pool, scratch, ks);
  } else {
    linear_group_values(ps, x, n, in, pool, scratch, ks, order);
  }
}

}  // namespace kvdecode::detail
