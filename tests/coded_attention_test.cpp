// Attention on rows read in place (detail/coded_attention.hpp and the coded path of
// model/attention.hpp) against attention written here in double over rows decoded from the
// codes with the formats' formulas: the kernels one by one in every kernel set this CPU runs
// (the f32 rows' too), then whole attention over Int8Store, Q4Store (rotated or not, with and
// without an exact residual) and Q2Store at head sizes 16, 48, 64 and 128 and sizes with a tail.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "kvdecode/kvdecode.hpp"
#include "test_util.hpp"

namespace kvdecode::testing_util {
namespace {

constexpr double kUnit = 0x1p-24;  // f32 unit roundoff

/// The sets this CPU runs.
std::vector<KernelSet> supported_sets() {
  std::vector<KernelSet> out;
  for (const KernelSet ks : kKernelSets)
    if (cpu_supports(ks)) out.push_back(ks);
  return out;
}

/// An f16 bit pattern's value: (-1)^s 2^(e-15) (1 + m/1024), or 2^-14 m/1024 when e = 0.
double f16(std::uint16_t h) {
  const int e = (h >> 10) & 0x1F, m = h & 0x3FF;
  const double v = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return (h & 0x8000) != 0 ? -v : v;
}

/// A normal f16 pattern of magnitude in [2^-4, 2) and random sign (if `sign`).
std::uint16_t random_f16(detail::SplitMix64& rng, bool sign) {
  const auto e = static_cast<std::uint16_t>(11 + rng.next() % 5);
  const auto m = static_cast<std::uint16_t>(rng.next() % 1024);
  const auto s = static_cast<std::uint16_t>(sign && rng.next() % 2 == 1 ? 0x8000 : 0);
  return static_cast<std::uint16_t>(s | (e << 10) | m);
}

float uniform(detail::SplitMix64& rng) {
  return static_cast<float>(rng.next() % 20001) / 10000.0f - 1.0f;
}

// ---------------------------------------------------------------------------------------------
// The kernels, one block at a time. Bounds: a sum of k f32 products (in any order, fused or
// not) errs by at most γ_k Σ|terms|, γ_k = k·u / (1 - k·u); each further f32 product or sum of
// the formula adds one u. The bounds below take k + 6 units over the terms' absolute sum.
// ---------------------------------------------------------------------------------------------

struct Shape {
  std::size_t hs, rows;
};
// The last two pass the VNNI kernels' limits (kMaxVnniInt8HeadSize, kMaxVnniRows), where the
// avx512bf16 set takes the f32 kernels.
constexpr Shape kShapes[] = {{16, 1},   {16, 17}, {48, 64}, {48, 15}, {64, 16}, {64, 70},
                             {128, 33}, {40, 9},  {24, 31}, {8, 3},   {96, 20}, {80, 7},
                             {6, 4},    {4, 5},   {2, 3},   {288, 5}, {16, 260}};

/// The weight of each row's value codes, p[r] · vstep[r], as the avx512bf16 set's p·v takes it
/// when `rounded`: to 15 bits of the largest, d · round(w · (16383 / max w)), d = max w / 16383,
/// each step in f32 as the kernel computes it.
std::vector<double> code_weights(const std::vector<float>& p,
                                 const std::vector<std::uint16_t>& vstep, bool rounded) {
  std::vector<double> pw(p.size());
  float top = 0.0f;
  for (std::size_t r = 0; r < p.size(); ++r) {
    pw[r] = double{p[r]} * f16(vstep[r]);
    top = std::max(top, p[r] * static_cast<float>(f16(vstep[r])));
  }
  if (rounded)
    for (std::size_t r = 0; r < p.size(); ++r)
      pw[r] = double{top / 16383.0f} *
              std::nearbyint(p[r] * static_cast<float>(f16(vstep[r])) * (16383.0f / top));
  return pw;
}

TEST(CodedAttentionTest, Int8KernelsMatchTheFormula) {
  for (const KernelSet ks : supported_sets())
    for (const Shape sh : kShapes) {
      detail::SplitMix64 rng(sh.hs * 131 + sh.rows);
      const std::size_t hs = sh.hs, rows = sh.rows;
      std::vector<float> q(hs), p(rows), w((rows + 15) / 16 * 16);
      std::vector<std::uint16_t> kmin(rows), kstep(rows), vmin(rows), vstep(rows);  // f16
      std::vector<std::uint8_t> kc(rows * hs), vc(rows * hs);                       // [rows][hs]
      for (float& x : q) x = uniform(rng);
      for (std::size_t r = 0; r < rows; ++r) {
        kmin[r] = random_f16(rng, true);
        kstep[r] = random_f16(rng, false);
        vmin[r] = random_f16(rng, true);
        vstep[r] = random_f16(rng, false);
        p[r] = std::abs(uniform(rng));
      }
      for (auto& c : kc) c = static_cast<std::uint8_t>(rng.next());
      for (auto& c : vc) c = static_cast<std::uint8_t>(rng.next());
      const float scale = 0.3f;
      std::vector<float> s(rows, -1.0f), qv(detail::int8_query_floats(hs));
      float qs = 0;  // Σ q, which the caller passes (in f32; the bound below covers its rounding)
      for (const float x : q) qs += x;
      detail::int8_query(ks, qv.data(), q.data(), hs);
      detail::coded_scores_int8(ks, s.data(), q.data(), qv.data(), qs, kc.data(), kmin.data(),
                                kstep.data(), rows, hs, scale);
      // The avx512bf16 set's scores take the query rounded to 15 bits: i = round(q · (16383 /
      // max|q|)), d = max|q| / 16383, each step in f32 as written; Σ i · code is exact.
      const bool rounded = ks == KernelSet::kAvx512Bf16 && hs <= detail::kMaxVnniInt8HeadSize;
      std::vector<double> qr(q.begin(), q.end());
      if (rounded) {
        float top = 0.0f;
        for (const float x : q) top = std::max(top, std::abs(x));
        const float inv = 16383.0f / top, d = top / 16383.0f;
        for (std::size_t c = 0; c < hs; ++c) qr[c] = double{d} * std::nearbyint(q[c] * inv);
      }
      for (std::size_t r = 0; r < rows; ++r) {
        // (step · Σ q c + min · Σ q) · scale: each sum of hs terms, then three operations.
        double dot = 0, dot_mag = 0, qsum = 0, qsum_mag = 0;
        for (std::size_t c = 0; c < hs; ++c) {
          dot += qr[c] * kc[r * hs + c];
          dot_mag += std::abs(qr[c] * kc[r * hs + c]);
          qsum += q[c];
          qsum_mag += std::abs(q[c]);
        }
        const double want = (f16(kstep[r]) * dot + f16(kmin[r]) * qsum) * scale;
        const double mag = (f16(kstep[r]) * dot_mag + std::abs(f16(kmin[r])) * qsum_mag) * scale;
        ASSERT_NEAR(s[r], want, static_cast<double>(hs + 6) * kUnit * mag)
            << kernel_set_name(ks) << " hs " << hs << " row " << r;
      }
      std::vector<float> o(hs);
      for (float& x : o) x = uniform(rng);
      const std::vector<float> o0 = o;
      detail::coded_pv_int8(ks, o.data(), p.data(), w.data(), vc.data(), vmin.data(), vstep.data(),
                            rows, hs);
      const std::vector<double> pw =
          code_weights(p, vstep, ks == KernelSet::kAvx512Bf16 && rows <= detail::kMaxVnniRows);
      for (std::size_t c = 0; c < hs; ++c) {
        double want = o0[c], mag = std::abs(double{o0[c]});
        for (std::size_t r = 0; r < rows; ++r) {
          want += double{p[r]} * f16(vmin[r]) + pw[r] * vc[r * hs + c];
          mag += std::abs(double{p[r]} * f16(vmin[r])) + pw[r] * vc[r * hs + c];
        }
        ASSERT_NEAR(o[c], want, static_cast<double>(2 * rows + 6) * kUnit * mag)
            << kernel_set_name(ks) << " hs " << hs << " rows " << rows << " channel " << c;
      }
    }
}

// The VNNI kernels' int32 sums at their largest (one head and several): every code 255 and every
// rounded query channel or weight at ±16383, head size kMaxVnniInt8HeadSize and kMaxVnniRows rows.
// A sum that overflowed would be off by 2^32, not by rounding.
TEST(CodedAttentionTest, IntegerSumsHoldAtTheirLimits) {
  for (const KernelSet ks : supported_sets()) {
    const std::size_t hs = detail::kMaxVnniInt8HeadSize, rows = 16;
    const std::vector<float> q(hs, -1.0f);
    const std::vector<std::uint8_t> kc(rows * hs, 255);
    const std::vector<std::uint16_t> zero(rows, detail::f16_from_float(0.0f)),
        one(rows, detail::f16_from_float(1.0f));
    std::vector<float> qv(detail::int8_query_floats(hs)), s(rows);
    detail::int8_query(ks, qv.data(), q.data(), hs);
    detail::coded_scores_int8(ks, s.data(), q.data(), qv.data(), -static_cast<float>(hs), kc.data(),
                              zero.data(), one.data(), rows, hs, 1.0f);
    for (const float x : s)
      ASSERT_NEAR(x, -255.0 * static_cast<double>(hs), 1e-6 * 255 * static_cast<double>(hs))
          << kernel_set_name(ks);

    const std::size_t n = detail::kMaxVnniRows, ch = 16;
    const std::vector<float> p(n, 1.0f);
    const std::vector<std::uint8_t> vc(n * ch, 255);
    const std::vector<std::uint16_t> vmin(n, detail::f16_from_float(0.0f)),
        vstep(n, detail::f16_from_float(1.0f));
    std::vector<float> w((n + 15) / 16 * 16), o(ch, 0.0f);
    detail::coded_pv_int8(ks, o.data(), p.data(), w.data(), vc.data(), vmin.data(), vstep.data(), n,
                          ch);
    for (const float x : o)
      ASSERT_NEAR(x, 255.0 * static_cast<double>(n), 1e-6 * 255 * static_cast<double>(n))
          << kernel_set_name(ks);
    // The heads' 16-bit weights (coded_heads_pv_int8), four heads over two passes.
    const std::size_t heads = 4;
    const std::vector<float> ph(heads * n, 1.0f);
    std::vector<float> wh(detail::coded_pv_scratch_floats(n)), oh(heads * ch, 0.0f);
    detail::coded_heads_pv_int8(ks, oh.data(), ch, ph.data(), n, heads, wh.data(), vc.data(),
                                vmin.data(), vstep.data(), n, ch);
    for (const float x : oh)
      ASSERT_NEAR(x, 255.0 * static_cast<double>(n), 1e-6 * 255 * static_cast<double>(n))
          << kernel_set_name(ks);
  }
}

// f32 rows in place (a decode step over a store of floats), with a row stride past head_size
// as a store's rows may have. Scores: a sum of hs products, then the scale. p·v: o plus a sum of
// rows products, and the sum over rows [0, rows) equals the sum over [0, b) then [b, rows) bit
// for bit (one chain per channel in row order), which is what lets a paged table's blocks give
// a contiguous store's attention.
TEST(CodedAttentionTest, F32RowKernelsMatchTheFormula) {
  for (const KernelSet ks : supported_sets())
    for (const Shape sh : kShapes) {
      detail::SplitMix64 rng(sh.hs * 97 + sh.rows);
      const std::size_t hs = sh.hs, rows = sh.rows, stride = hs + 3;
      std::vector<float> q(hs), p(rows), keys(rows * stride), values(rows * stride);
      for (float& x : q) x = uniform(rng);
      for (float& x : p) x = std::abs(uniform(rng));
      for (float& x : keys) x = uniform(rng);
      for (float& x : values) x = uniform(rng);
      const float scale = 0.3f;
      std::vector<float> s(rows, -1.0f);
      detail::f32_row_scores(ks, s.data(), q.data(), keys.data(), values.data(),
                             sh.rows % 2 == 0 ? values.data() : nullptr, stride, rows, hs, scale);
      for (std::size_t r = 0; r < rows; ++r) {
        double dot = 0, mag = 0;
        for (std::size_t c = 0; c < hs; ++c) {
          dot += double{q[c]} * keys[r * stride + c];
          mag += std::abs(double{q[c]} * keys[r * stride + c]);
        }
        ASSERT_NEAR(s[r], dot * scale, static_cast<double>(hs + 2) * kUnit * mag * scale)
            << kernel_set_name(ks) << " hs " << hs << " row " << r;
      }
      std::vector<float> o(hs);
      for (float& x : o) x = uniform(rng);
      const std::vector<float> o0 = o;
      detail::f32_row_pv(ks, o.data(), p.data(), values.data(), stride, rows, hs);
      for (std::size_t c = 0; c < hs; ++c) {
        double want = o0[c], mag = std::abs(double{o0[c]});
        for (std::size_t r = 0; r < rows; ++r) {
          want += double{p[r]} * values[r * stride + c];
          mag += std::abs(double{p[r]} * values[r * stride + c]);
        }
        ASSERT_NEAR(o[c], want, static_cast<double>(2 * rows + 2) * kUnit * mag)
            << kernel_set_name(ks) << " hs " << hs << " rows " << rows << " channel " << c;
      }
      const std::size_t b = rows / 3;
      std::vector<float> split = o0;
      detail::f32_row_pv(ks, split.data(), p.data(), values.data(), stride, b, hs);
      detail::f32_row_pv(ks, split.data(), p.data() + b, values.data() + b * stride, stride,
                         rows - b, hs);
      ASSERT_EQ(split, o) << kernel_set_name(ks) << " hs " << hs << " rows " << rows << " split at "
                          << b;
    }
}

/// Whether a and b hold the same bits (so -0 differs from +0, and a NaN matches itself).
bool same_bits(std::span<const float> a, std::span<const float> b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end(), [](float x, float y) {
    return std::bit_cast<std::uint32_t>(x) == std::bit_cast<std::uint32_t>(y);
  });
}

// 8-bit keys scored for the query heads that share a kv head (coded_heads_scores_int8): each
// head bit for bit coded_scores_int8 alone (checked against the formula above), for head
// counts that fill, split and leave part of the kernel's passes of kVnniHeadsAtOnce heads, with
// nothing written past a head's rows; and at the integer sums' limits (every code 255, every
// rounded query channel -16383, head size kMaxVnniInt8HeadSize).
TEST(CodedAttentionTest, Int8HeadScoresAreEachHeadAlone) {
  std::vector<Shape> shapes(std::begin(kShapes), std::end(kShapes));
  shapes.push_back({256, 33});  // four 64-channel chunks
  for (const KernelSet ks : supported_sets())
    for (const Shape sh : shapes)
      for (const std::size_t heads : {1, 2, 3, 4, 5, 8}) {
        detail::SplitMix64 rng(sh.hs * 53 + sh.rows * 11 + heads);
        const std::size_t hs = sh.hs, rows = sh.rows, cols = rows + 3,
                          qv_size = detail::int8_query_floats(hs) + 7;
        std::vector<float> q(heads * hs), qv(heads * qv_size), qsum(2 * heads);
        std::vector<std::uint16_t> kmin(rows), kstep(rows);  // f16
        std::vector<std::uint8_t> kc(rows * hs);             // [rows][hs]
        for (float& x : q) x = uniform(rng);
        for (std::size_t r = 0; r < rows; ++r) {
          kmin[r] = random_f16(rng, true);
          kstep[r] = random_f16(rng, false);
        }
        for (auto& c : kc) c = static_cast<std::uint8_t>(rng.next());
        for (std::size_t h = 0; h < heads; ++h) {
          detail::int8_query(ks, qv.data() + h * qv_size, q.data() + h * hs, hs);
          for (std::size_t c = 0; c < hs; ++c) qsum[2 * h] += q[h * hs + c];
        }
        const float scale = 0.3f;
        std::vector<float> s(heads * cols, -1.0f), alone(rows);
        detail::coded_heads_scores_int8(ks, s.data(), cols, q.data(), hs, qv.data(), qv_size,
                                        qsum.data(), 2, heads, kc.data(), kmin.data(), kstep.data(),
                                        rows, hs, scale);
        for (std::size_t h = 0; h < heads; ++h) {
          const std::string where = std::string(kernel_set_name(ks)) + " hs " + std::to_string(hs) +
                                    " rows " + std::to_string(rows) + " head " + std::to_string(h) +
                                    " of " + std::to_string(heads);
          detail::coded_scores_int8(ks, alone.data(), q.data() + h * hs, qv.data() + h * qv_size,
                                    qsum[2 * h], kc.data(), kmin.data(), kstep.data(), rows, hs,
                                    scale);
          ASSERT_TRUE(same_bits(alone, std::span<const float>(s.data() + h * cols, rows)))
              << where << ": scores differ from the head alone";
          for (std::size_t c = rows; c < cols; ++c)
            ASSERT_EQ(s[h * cols + c], -1.0f) << where << ": wrote past its rows";
        }
      }
  for (const KernelSet ks : supported_sets()) {
    const std::size_t hs = detail::kMaxVnniInt8HeadSize, rows = 16, heads = 5;
    const std::vector<float> q(heads * hs, -1.0f), qsum(heads, -static_cast<float>(hs));
    const std::vector<std::uint8_t> kc(rows * hs, 255);
    const std::vector<std::uint16_t> zero(rows, detail::f16_from_float(0.0f)),
        one(rows, detail::f16_from_float(1.0f));
    const std::size_t qv_size = detail::int8_query_floats(hs);
    std::vector<float> qv(heads * qv_size), s(heads * rows);
    for (std::size_t h = 0; h < heads; ++h)
      detail::int8_query(ks, qv.data() + h * qv_size, q.data() + h * hs, hs);
    detail::coded_heads_scores_int8(ks, s.data(), rows, q.data(), hs, qv.data(), qv_size,
                                    qsum.data(), 1, heads, kc.data(), zero.data(), one.data(), rows,
                                    hs, 1.0f);
    for (const float x : s)
      ASSERT_NEAR(x, -255.0 * static_cast<double>(hs), 1e-6 * 255 * static_cast<double>(hs))
          << kernel_set_name(ks);
  }
}

// The query heads that share a kv head, scored and summed together (f32_heads_scores,
// f32_heads_pv): each head against the formula in double; bit for bit the same head alone (a
// head's attention does not depend on the heads beside it); and in the AVX-512 sets bit for bit
// the arithmetic they promise, written out here: scores as F32RowDot's chains reduced by
// coded_scores_avx512 (the one-query kernel they replaced), p·v as one f32 fused multiply-add
// chain per channel from o's value, rows in order.
TEST(CodedAttentionTest, F32HeadKernelsMatchTheFormulaAndOneHeadAtATime) {
  std::vector<Shape> shapes(std::begin(kShapes), std::end(kShapes));
  shapes.push_back({100, 21});  // seven 16-lane chunks, the last partial
  shapes.push_back({112, 16});
  for (const KernelSet ks : supported_sets())
    for (const Shape sh : shapes)
      for (const std::size_t heads : {1, 2, 3, 4, 5, 8}) {
        detail::SplitMix64 rng(sh.hs * 89 + sh.rows * 7 + heads);
        const std::size_t hs = sh.hs, rows = sh.rows, stride = hs + 5, cols = rows + 3;
        std::vector<float> q(heads * hs), p(heads * cols), keys(rows * stride),
            values(rows * stride), next(rows * stride);
        for (float& x : q) x = uniform(rng);
        for (float& x : p) x = std::abs(uniform(rng));
        for (float& x : keys) x = uniform(rng);
        for (float& x : values) x = uniform(rng);
        const float scale = 0.7f;
        const float* next_keys = heads % 2 == 0 ? next.data() : nullptr;
        std::vector<float> s(heads * cols, -1.0f), one(rows);
        detail::f32_heads_scores(ks, s.data(), cols, q.data(), heads, keys.data(), values.data(),
                                 next_keys, stride, rows, hs, scale);
        std::vector<float> o(heads * hs);
        for (float& x : o) x = uniform(rng);
        const std::vector<float> o0 = o;
        detail::f32_heads_pv(ks, o.data(), p.data(), cols, values.data(), stride, rows, hs, heads);
        for (std::size_t h = 0; h < heads; ++h) {
          const auto where = [&] {
            return std::string(kernel_set_name(ks)) + " hs " + std::to_string(hs) + " rows " +
                   std::to_string(rows) + " head " + std::to_string(h) + " of " +
                   std::to_string(heads);
          };
          const std::span<const float> sh_scores(s.data() + h * cols, rows);
          const std::span<const float> sh_out(o.data() + h * hs, hs);
          for (std::size_t r = 0; r < rows; ++r) {
            double dot = 0, mag = 0;
            for (std::size_t c = 0; c < hs; ++c) {
              dot += double{q[h * hs + c]} * keys[r * stride + c];
              mag += std::abs(double{q[h * hs + c]} * keys[r * stride + c]);
            }
            ASSERT_NEAR(sh_scores[r], dot * scale,
                        static_cast<double>(hs + 2) * kUnit * mag * scale)
                << where() << " row " << r;
          }
          for (std::size_t c = rows; c < cols; ++c)
            ASSERT_EQ(s[h * cols + c], -1.0f) << where() << ": wrote past its rows";
          detail::f32_row_scores(ks, one.data(), q.data() + h * hs, keys.data(), values.data(),
                                 next_keys, stride, rows, hs, scale);
          ASSERT_TRUE(same_bits(one, sh_scores))
              << where() << ": scores differ from the head alone";
          for (std::size_t c = 0; c < hs; ++c) {
            double want = o0[h * hs + c], mag = std::abs(want);
            for (std::size_t r = 0; r < rows; ++r) {
              want += double{p[h * cols + r]} * values[r * stride + c];
              mag += std::abs(double{p[h * cols + r]} * values[r * stride + c]);
            }
            ASSERT_NEAR(sh_out[c], want, static_cast<double>(2 * rows + 2) * kUnit * mag)
                << where() << " channel " << c;
          }
          std::vector<float> alone(o0.begin() + static_cast<long>(h * hs),
                                   o0.begin() + static_cast<long>((h + 1) * hs));
          detail::f32_row_pv(ks, alone.data(), p.data() + h * cols, values.data(), stride, rows,
                             hs);
          ASSERT_TRUE(same_bits(alone, sh_out)) << where() << ": p·v differs from the head alone";
          if (!detail::coded_attention_kernels(ks)) continue;
          std::vector<float> chain(o0.begin() + static_cast<long>(h * hs),
                                   o0.begin() + static_cast<long>((h + 1) * hs));
          for (std::size_t c = 0; c < hs; ++c)
            for (std::size_t r = 0; r < rows; ++r)
              chain[c] = std::fma(p[h * cols + r], values[r * stride + c], chain[c]);
          ASSERT_TRUE(same_bits(chain, sh_out)) << where() << ": p·v is not one chain per channel";
#if KVDECODE_X86_KERNELS
          std::vector<float> reduced(rows);
          detail::coded_scores_avx512(
              reduced.data(), 0.0f, nullptr, nullptr, 0.0f, rows, scale,
              detail::F32RowDot{q.data() + h * hs, keys.data(), values.data(), next_keys, rows,
                                stride, hs, 1});
          ASSERT_TRUE(same_bits(reduced, sh_scores))
              << where() << ": scores differ from F32RowDot's reduction";
#endif
        }
      }
}

TEST(CodedAttentionTest, LowBitKernelsMatchTheFormula) {
  for (const unsigned bits : {4u, 2u})
    for (const KernelSet ks : supported_sets())
      for (const Shape sh : kShapes) {
        detail::SplitMix64 rng(sh.hs * 17 + sh.rows + bits);
        const std::size_t hs = sh.hs, rows = sh.rows, row_bytes = hs * bits / 8;
        if (hs * bits % 8 != 0) continue;
        std::vector<float> q(hs), qs((hs + 31) / 32 * 32), p(rows), w((rows + 15) / 16 * 16);
        std::vector<std::uint16_t> kmin(hs), kstep(hs), vmin(rows), vstep(rows);
        std::vector<std::uint8_t> kc(rows * row_bytes), vc(rows * row_bytes);
        for (float& x : q) x = uniform(rng);
        for (std::size_t c = 0; c < hs; ++c) {
          kmin[c] = random_f16(rng, true);
          kstep[c] = random_f16(rng, false);
        }
        for (std::size_t r = 0; r < rows; ++r) {
          vmin[r] = random_f16(rng, true);
          vstep[r] = random_f16(rng, false);
          p[r] = std::abs(uniform(rng));
        }
        for (auto& b : kc) b = static_cast<std::uint8_t>(rng.next());
        for (auto& b : vc) b = static_cast<std::uint8_t>(rng.next());
        // Channel c of a row: bits·(c mod 8/bits) of byte c / (8/bits).
        const auto code = [&](const std::vector<std::uint8_t>& codes, std::size_t r,
                              std::size_t c) {
          const std::size_t per = 8 / bits;
          return static_cast<double>((codes[r * row_bytes + c / per] >> (bits * (c % per))) &
                                     ((1u << bits) - 1));
        };
        const float scale = 0.3f;
        const float qm =
            detail::low_bit_query(ks, qs.data(), q.data(), kmin.data(), kstep.data(), bits, hs);
        std::vector<float> s(rows, -1.0f);
        detail::coded_scores_low_bit(ks, s.data(), qs.data(), qm, kc.data(), bits, rows, hs, scale);
        // The avx512bf16 set's 4-bit scores take the folded query a = q ⊙ kstep rounded to
        // int8: i = round(a · (127 / max|a|)), d = max|a| / 127, each step in f32 as written
        // (a max|a| below 2^-100 counting as 0).
        const bool vnni = ks == KernelSet::kAvx512Bf16 && bits == 4;
        std::vector<float> a(hs), qi(hs);
        float top = 0.0f;
        for (std::size_t c = 0; c < hs; ++c) {
          a[c] = q[c] * static_cast<float>(f16(kstep[c]));
          top = std::max(top, std::abs(a[c]));
        }
        const bool zero = top < 0x1p-100f;
        const float inv = zero ? 0.0f : 127.0f / top, d = zero ? 0.0f : top / 127.0f;
        for (std::size_t c = 0; c < hs; ++c) qi[c] = std::nearbyint(a[c] * inv);
        for (std::size_t r = 0; r < rows; ++r) {
          double want = 0, mag = 0;
          for (std::size_t c = 0; c < hs; ++c) {
            const double k = code(kc, r, c);
            want += vnni ? q[c] * f16(kmin[c]) + double{d} * qi[c] * k
                         : double{q[c]} * (f16(kmin[c]) + k * f16(kstep[c]));
            mag += std::abs(q[c] * f16(kmin[c])) +
                   (vnni ? std::abs(double{d} * qi[c] * k) : std::abs(q[c] * k * f16(kstep[c])));
          }
          ASSERT_NEAR(s[r], want * scale, static_cast<double>(2 * hs + 6) * kUnit * mag * scale)
              << bits << " bits, " << kernel_set_name(ks) << " hs " << hs << " row " << r;
        }
        std::vector<float> o(hs);
        for (float& x : o) x = uniform(rng);
        const std::vector<float> o0 = o;
        detail::coded_pv_low_bit(ks, o.data(), p.data(), w.data(), vc.data(), bits, vmin.data(),
                                 vstep.data(), rows, hs);
        // The avx512bf16 set's 4-bit p·v rounds the weights as the 8-bit one.
        const std::vector<double> pw = code_weights(p, vstep, vnni && rows <= detail::kMaxVnniRows);
        for (std::size_t c = 0; c < hs; ++c) {
          double want = o0[c], mag = std::abs(double{o0[c]});
          for (std::size_t r = 0; r < rows; ++r) {
            want += p[r] * f16(vmin[r]) + pw[r] * code(vc, r, c);
            mag += std::abs(p[r] * f16(vmin[r])) + pw[r] * code(vc, r, c);
          }
          ASSERT_NEAR(o[c], want, static_cast<double>(2 * rows + 6) * kUnit * mag)
              << bits << " bits, " << kernel_set_name(ks) << " hs " << hs << " channel " << c;
        }
      }
}

// 8-, 4- and 2-bit values summed for the query heads that share a kv head (coded_heads_pv_int8,
// coded_heads_pv_low_bit): each head bit for bit the one-head kernel alone (checked against the
// formula above), for head counts that fill and split the kernel's passes, odd row counts,
// weights of 0, rows past the VNNI kernels' limit, and nothing written past a head's channels.
// A head whose weights are all 0 (a head that saw no row of the tile: attention passes every
// head's weights whenever one head saw a row) is left exactly as it was.
TEST(CodedAttentionTest, HeadPvIsEachHeadAlone) {
  std::vector<Shape> shapes(std::begin(kShapes), std::end(kShapes));
  shapes.push_back({256, 33});
  shapes.push_back({48, 256});
  for (const unsigned bits : {8u, 4u, 2u})
    for (const KernelSet ks : supported_sets())
      for (const Shape sh : shapes)
        for (const std::size_t heads : {1, 2, 3, 4, 5, 8}) {
          detail::SplitMix64 rng(sh.hs * 61 + sh.rows * 3 + heads + bits);
          const std::size_t hs = sh.hs, rows = sh.rows, o_stride = hs + 5, p_stride = rows + 7,
                            row_bytes = hs * bits / 8;
          if (hs * bits % 8 != 0) continue;
          std::vector<float> p(heads * p_stride), o(heads * o_stride),
              w(detail::coded_pv_scratch_floats(rows));
          std::vector<std::uint16_t> vmin(rows), vstep(rows);  // f16
          std::vector<std::uint8_t> vc(rows * row_bytes);      // [rows][row_bytes]
          for (std::size_t r = 0; r < rows; ++r) {
            vmin[r] = random_f16(rng, true);
            vstep[r] = random_f16(rng, false);
          }
          for (auto& c : vc) c = static_cast<std::uint8_t>(rng.next());
          for (float& x : p) x = rng.next() % 5 == 0 ? 0.0f : std::abs(uniform(rng));
          const std::size_t blind = heads > 1 ? heads / 2 : heads;  // all weights 0 (none at 1)
          if (blind < heads)
            std::fill_n(p.begin() + static_cast<std::ptrdiff_t>(blind * p_stride), rows, 0.0f);
          for (float& x : o) x = uniform(rng);
          const std::vector<float> o0 = o;
          if (bits == 8)
            detail::coded_heads_pv_int8(ks, o.data(), o_stride, p.data(), p_stride, heads, w.data(),
                                        vc.data(), vmin.data(), vstep.data(), rows, hs);
          else
            detail::coded_heads_pv_low_bit(ks, o.data(), o_stride, p.data(), p_stride, heads,
                                           w.data(), vc.data(), bits, vmin.data(), vstep.data(),
                                           rows, hs);
          for (std::size_t h = 0; h < heads; ++h) {
            const std::string where = std::string(kernel_set_name(ks)) + " bits " +
                                      std::to_string(bits) + " hs " + std::to_string(hs) +
                                      " rows " + std::to_string(rows) + " head " +
                                      std::to_string(h) + " of " + std::to_string(heads);
            const auto before = o0.begin() + static_cast<std::ptrdiff_t>(h * o_stride);
            std::vector<float> alone(before, before + static_cast<std::ptrdiff_t>(hs));
            if (h != blind && bits == 8)
              detail::coded_pv_int8(ks, alone.data(), p.data() + h * p_stride, w.data(), vc.data(),
                                    vmin.data(), vstep.data(), rows, hs);
            else if (h != blind)
              detail::coded_pv_low_bit(ks, alone.data(), p.data() + h * p_stride, w.data(),
                                       vc.data(), bits, vmin.data(), vstep.data(), rows, hs);
            ASSERT_TRUE(same_bits(alone, std::span<const float>(o.data() + h * o_stride, hs)))
                << where
                << (h == blind ? ": a head with no weight changed"
                               : ": p·v differs from the head alone");
            for (std::size_t c = hs; c < o_stride; ++c)
              ASSERT_EQ(o[h * o_stride + c], o0[h * o_stride + c]) << where << ": wrote past hs";
          }
        }
}

// Low-bit keys scored for the query heads that share a kv head (coded_heads_scores_low_bit):
// each head bit for bit coded_scores_low_bit alone (checked against the formula above), at
// head counts that fill, split and leave part of the kernel's passes, with nothing written past
// a head's rows.
TEST(CodedAttentionTest, LowBitHeadScoresAreEachHeadAlone) {
  std::vector<Shape> shapes(std::begin(kShapes), std::end(kShapes));
  shapes.push_back({256, 33});
  for (const unsigned bits : {4u, 2u})
    for (const KernelSet ks : supported_sets())
      for (const Shape sh : shapes)
        for (const std::size_t heads : {1, 2, 3, 4, 5, 8}) {
          detail::SplitMix64 rng(sh.hs * 29 + sh.rows * 5 + heads + bits);
          const std::size_t hs = sh.hs, rows = sh.rows, row_bytes = hs * bits / 8, cols = rows + 3,
                            qs_size = (hs + 31) / 32 * 32 + 16;
          if (hs * bits % 8 != 0) continue;
          std::vector<float> q(hs), qs(heads * qs_size), qm(2 * heads);
          std::vector<std::uint16_t> kmin(hs), kstep(hs);  // f16, one group's
          std::vector<std::uint8_t> kc(rows * row_bytes);
          for (std::size_t c = 0; c < hs; ++c) {
            kmin[c] = random_f16(rng, true);
            kstep[c] = random_f16(rng, false);
          }
          for (auto& b : kc) b = static_cast<std::uint8_t>(rng.next());
          for (std::size_t h = 0; h < heads; ++h) {
            for (float& x : q) x = uniform(rng);
            qm[2 * h] = detail::low_bit_query(ks, qs.data() + h * qs_size, q.data(), kmin.data(),
                                              kstep.data(), bits, hs);
          }
          const float scale = 0.3f;
          std::vector<float> s(heads * cols, -1.0f), alone(rows);
          detail::coded_heads_scores_low_bit(ks, s.data(), cols, qs.data(), qs_size, qm.data(), 2,
                                             heads, kc.data(), bits, rows, hs, scale);
          for (std::size_t h = 0; h < heads; ++h) {
            const std::string where = std::string(kernel_set_name(ks)) + " bits " +
                                      std::to_string(bits) + " hs " + std::to_string(hs) +
                                      " rows " + std::to_string(rows) + " head " +
                                      std::to_string(h) + " of " + std::to_string(heads);
            detail::coded_scores_low_bit(ks, alone.data(), qs.data() + h * qs_size, qm[2 * h],
                                         kc.data(), bits, rows, hs, scale);
            ASSERT_TRUE(same_bits(alone, std::span<const float>(s.data() + h * cols, rows)))
                << where << ": scores differ from the head alone";
            for (std::size_t c = rows; c < cols; ++c)
              ASSERT_EQ(s[h * cols + c], -1.0f) << where << ": wrote past its rows";
          }
        }
}

// A group whose key range is not finite (a NaN or infinite min, a NaN or infinite step, as a
// range beyond f16 or a corrupt file gives) scores every row non-finite in every set, never a
// finite wrong value.
TEST(CodedAttentionTest, LowBitNonFiniteRangesGiveNonFiniteScores) {
  constexpr std::uint16_t kNan = 0x7E00, kInf = 0x7C00, kMinusInf = 0xFC00;
  struct Range {
    std::uint16_t min, step;
  };
  for (const unsigned bits : {4u, 2u})
    for (const KernelSet ks : supported_sets())
      for (const Range bad : {Range{kNan, 0x3C00}, Range{kMinusInf, kInf}, Range{0x3C00, kNan},
                              Range{0x3C00, kInf}}) {
        const std::size_t hs = 48, rows = 20, row_bytes = hs * bits / 8;
        detail::SplitMix64 rng(bits + 3);
        std::vector<float> q(hs), qs((hs + 31) / 32 * 32), s(rows);
        std::vector<std::uint16_t> kmin(hs), kstep(hs);
        std::vector<std::uint8_t> kc(rows * row_bytes);
        for (float& x : q) x = uniform(rng);
        for (std::size_t c = 0; c < hs; ++c) {
          kmin[c] = random_f16(rng, true);
          kstep[c] = random_f16(rng, false);
        }
        for (auto& b : kc) b = static_cast<std::uint8_t>(rng.next() | 0x11);  // no zero codes
        kmin[7] = bad.min;
        kstep[7] = bad.step;
        const float qm =
            detail::low_bit_query(ks, qs.data(), q.data(), kmin.data(), kstep.data(), bits, hs);
        detail::coded_scores_low_bit(ks, s.data(), qs.data(), qm, kc.data(), bits, rows, hs, 0.3f);
        for (std::size_t r = 0; r < rows; ++r)
          EXPECT_FALSE(std::isfinite(s[r]))
              << bits << " bits, " << kernel_set_name(ks) << " min " << bad.min << " step "
              << bad.step << " row " << r << ": " << s[r];
      }
}

// ---------------------------------------------------------------------------------------------
// Whole attention over a store: the rows decoded here from what for_each_coded_block hands,
// softmax(q kᵀ / √hs) v in double, causal over the queries at cache indices [end - n, end).
// ---------------------------------------------------------------------------------------------

/// Every row of [0, end) of (layer, kv head) decoded in double: [end][hs] keys and values.
/// steps [end]: what rounding the query in the avx512bf16 set can cost a row's score, per unit
/// of max |query| (half a rounding step times Σ_c code[c] · the channels' largest key step):
/// for a 4-bit key row Σ_c code[c] · max_c kstep[c] of its group / 254, for an 8-bit one
/// Σ_c code[c] · kstep / 32766, else 0; rotated [end]: whether the row is rotated; vsteps
/// [end]: for an 8- or 4-bit value row, its step times the largest code (and √b for a row
/// rotated in blocks of b channels: what an error of e per rotated channel can become in one
/// channel), else 0; blocks [end]: the first row of each row's block; group_min, group_step
/// [end]: for an unrotated 4-bit key row, its group's f16 ranges [hs], else null.
template <class S>
void decode_rows(const S& s, std::size_t l, std::size_t g, std::size_t end,
                 std::vector<double>& keys, std::vector<double>& values, std::vector<double>& steps,
                 std::vector<bool>& rotated, std::vector<double>& vsteps,
                 std::vector<std::size_t>& blocks, std::vector<const std::uint16_t*>& group_min,
                 std::vector<const std::uint16_t*>& group_step) {
  const std::size_t hs = s.head_size();
  keys.assign(end * hs, 0.0);
  values.assign(end * hs, 0.0);
  steps.assign(end, 0.0);
  rotated.assign(end, false);
  vsteps.assign(end, 0.0);
  blocks.assign(end, 0);
  group_min.assign(end, nullptr);
  group_step.assign(end, nullptr);
  s.for_each_coded_block(l, g, end, [&](const auto& b) {
    using B = std::remove_cvref_t<decltype(b)>;
    for (std::size_t r = 0; r < b.n; ++r) {
      double* k = keys.data() + (b.first + r) * hs;
      double* v = values.data() + (b.first + r) * hs;
      blocks[b.first + r] = b.first;
      if constexpr (std::is_same_v<B, Int8KvBlock>) {
        vsteps[b.first + r] = f16(b.value_step[r]) * 255;
        double codes = 0;
        for (std::size_t c = 0; c < hs; ++c) {
          k[c] = f16(b.key_min[r]) + static_cast<double>(b.keys[r * hs + c]) * f16(b.key_step[r]);
          v[c] = f16(b.value_min[r]) +
                 static_cast<double>(b.values[r * hs + c]) * f16(b.value_step[r]);
          codes += b.keys[r * hs + c];
        }
        steps[b.first + r] = codes * f16(b.key_step[r]) / 32766;
      } else if constexpr (std::is_same_v<B, LowBitKvBlock>) {
        const std::size_t per = 8 / b.bits, row_bytes = hs / per;
        const auto code = [&](const std::uint8_t* codes, std::size_t c) {
          return static_cast<double>((codes[r * row_bytes + c / per] >> (b.bits * (c % per))) &
                                     ((1u << b.bits) - 1));
        };
        std::vector<double> kr(hs), vr(hs);  // in rotated coordinates when rotated
        double codes = 0, top_step = 0;
        for (std::size_t c = 0; c < hs; ++c) {
          kr[c] = f16(b.key_min[c]) + code(b.keys, c) * f16(b.key_step[c]);
          vr[c] = f16(b.value_min[r]) + code(b.values, c) * f16(b.value_step[r]);
          codes += code(b.keys, c);
          top_step = std::max(top_step, f16(b.key_step[c]));
        }
        if (b.bits == 4) steps[b.first + r] = codes * top_step / 254;
        std::size_t blk = 1;  // the rotation's block
        while (hs % (2 * blk) == 0) blk *= 2;
        if (b.bits == 4)
          vsteps[b.first + r] = f16(b.value_step[r]) * 15 *
                                (b.signs != nullptr ? std::sqrt(static_cast<double>(blk)) : 1.0);
        rotated[b.first + r] = b.signs != nullptr;
        if (b.bits == 4 && b.signs == nullptr) {
          group_min[b.first + r] = b.key_min;
          group_step[b.first + r] = b.key_step;
        }
        for (std::size_t c = 0; c < hs; ++c) {
          if (b.signs == nullptr) {
            k[c] = kr[c];
            v[c] = vr[c];
            continue;
          }
          // x = D H y / √blk, H[c][j] = (-1)^popcount(c & j) within blocks of blk channels.
          const std::size_t c0 = c / blk * blk;
          for (std::size_t j = c0; j < c0 + blk; ++j) {
            const double hcj = std::popcount((c - c0) & (j - c0)) % 2 == 0 ? 1.0 : -1.0;
            k[c] += hcj * kr[j];
            v[c] += hcj * vr[j];
          }
          k[c] *= b.signs[c] / std::sqrt(static_cast<double>(blk));
          v[c] *= b.signs[c] / std::sqrt(static_cast<double>(blk));
        }
      } else {
        for (std::size_t c = 0; c < hs; ++c) {
          k[c] = b.keys[r * b.stride + c];
          v[c] = b.values[r * b.stride + c];
        }
      }
    }
  });
}

/// Fills a store with `end` positions of random rows, `chunk` at a time.
template <class S>
void fill(const ModelConfig& cfg, S& s, std::size_t end, std::size_t chunk, std::uint64_t seed) {
  detail::SplitMix64 rng(seed);
  const auto kv_dim = static_cast<std::size_t>(cfg.kv_dim());
  std::vector<float> k(kv_dim), v(kv_dim);
  for (std::size_t done = 0; done < end;) {
    const std::size_t m = std::min(chunk, end - done);
    const std::vector<std::int32_t> tokens(m, 3);
    s.begin_append(tokens);
    for (std::size_t l = 0; l < s.n_layers(); ++l)
      for (std::size_t i = 0; i < m; ++i) {
        for (std::size_t c = 0; c < kv_dim; ++c) {
          // Channel 3 of each head is an outlier, as real keys have (KIVI §3).
          const float big = c % static_cast<std::size_t>(cfg.head_size()) == 3 ? 6.0f : 1.0f;
          k[c] = big * uniform(rng);
          v[c] = uniform(rng);
        }
        s.write(l, i, k.data(), v.data());
      }
    s.commit_append();
    done += m;
  }
}

/// attend_kv_head_coded with set ks, for n queries ending at cache index end - 1, against the
/// double attention over decoded rows. The bound: a score errs by at most ε = (2·hs + 2·log2 hs
/// + 12)·u·Σ|q k|/√hs (the sums of the kernel tests, the folded ranges and a rotation of the
/// query), plus, in the avx512bf16 set, what rounding the query costs: an unrotated 4-bit
/// row's score is taken with the folded query rounded as the kernel rounds it (nothing to
/// add); for a rotated one each channel's a = q·kstep moves by at most d/2, d = max|a|/127 ≤
/// max|q|·max kstep / 127 (max|q| of the rotated query, at most |q|₂), so the score by d/2 ·
/// Σ code / √hs; for an 8-bit row q moves by max|q| / 32766 a channel, the score by that ·
/// kstep · Σ code / √hs; the probabilities then err relatively by at most e^{2ε} - 1 plus (end +
/// 8)·u for exp and the running sums, and the output, a convex mix of value rows with its own sum
/// of end products, by that times max|v| plus (end + 2·log2 hs + 8)·u·max|v|, plus in the
/// avx512bf16 set what rounding an 8- or 4-bit block's weights costs (below).
template <class S>
void expect_attention_matches(const char* what, const ModelConfig& cfg, const S& s, std::size_t end,
                              std::size_t n, KernelSet ks) {
  const auto dim = static_cast<std::size_t>(cfg.dim);
  const auto hs = static_cast<std::size_t>(cfg.head_size());
  const auto kv_mul = static_cast<std::size_t>(cfg.kv_mul());
  detail::SplitMix64 rng(end * 7 + n);
  std::vector<float> q(n * dim), out(n * dim, 123.0f);  // [n][dim]
  for (float& x : q) x = uniform(rng);
  AttentionScratch<float> scratch(cfg, n, s.block_scratch_size(), 1);
  const double log_hs = std::log2(static_cast<double>(hs));
  for (std::size_t l = 0; l < s.n_layers(); ++l) {
    for (std::size_t g = 0; g < s.n_kv_heads(); ++g) {
      detail::attend_kv_head_coded(cfg, s, l, g, end - n, n, q.data(), out.data(), scratch, 0, ks);
      std::vector<double> keys, values, steps, vsteps;
      std::vector<bool> rotated;
      std::vector<std::size_t> blocks;
      std::vector<const std::uint16_t*> group_min, group_step;
      decode_rows(s, l, g, end, keys, values, steps, rotated, vsteps, blocks, group_min,
                  group_step);
      std::vector<float> folded(hs);  // an unrotated 4-bit row's q ⊙ kstep, as the kernel folds it
      double vmax = 0;
      for (const double x : values) vmax = std::max(vmax, std::abs(x));
      for (std::size_t j = 0; j < kv_mul; ++j) {
        const std::size_t h = g * kv_mul + j;
        for (std::size_t r = 0; r < n; ++r) {
          const std::size_t visible = end - n + r + 1;
          const float* qh = q.data() + r * dim + h * hs;
          double qtop = 0, qnorm = 0;  // max |q|, |q|₂
          for (std::size_t c = 0; c < hs; ++c) {
            qtop = std::max(qtop, std::abs(double{qh[c]}));
            qnorm += double{qh[c]} * qh[c];
          }
          qnorm = std::sqrt(qnorm);
          const bool rounded_query = ks == KernelSet::kAvx512Bf16;
          std::vector<double> score(visible);
          double smax = -1e300, emax = 0;
          for (std::size_t i = 0; i < visible; ++i) {
            double dot = 0, mag = 0;
            // The rounded query's d / 2 per unit of steps[i], with room for the f32 roundings
            // of a, 127 / max|a| (16383 / max|q|) and d.
            double half_d = rounded_query ? (rotated[i] ? qnorm : qtop) * (1 + 1e-4) : 0;
            if (rounded_query && group_step[i] != nullptr) {
              // An unrotated 4-bit row's score with the folded query rounded as §1 gives it (a =
              // q ⊙ kstep in f32, i = round(a · 127 / max|a|), d = max|a| / 127): the sum of
              // the kernel, so only its f32 rounding is left to bound.
              float top = 0.0f;
              for (std::size_t c = 0; c < hs; ++c) {
                folded[c] = qh[c] * static_cast<float>(f16(group_step[i][c]));
                top = std::max(top, std::abs(folded[c]));
              }
              const bool zero = !(top >= 0x1p-100f);
              const float inv = zero ? 0.0f : 127.0f / top, d = zero ? 0.0f : top / 127.0f;
              for (std::size_t c = 0; c < hs; ++c) {
                const double kmin = f16(group_min[i][c]), kstep = f16(group_step[i][c]);
                const double code =
                    kstep > 0 ? std::nearbyint((keys[i * hs + c] - kmin) / kstep) : 0.0;
                const double qi = std::nearbyint(folded[c] * inv);
                dot += qh[c] * kmin + double{d} * qi * code;
                mag += std::abs(qh[c] * kmin) + std::abs(double{d} * qi * code);
              }
              half_d = 0;
            } else {
              for (std::size_t c = 0; c < hs; ++c) {
                dot += qh[c] * keys[i * hs + c];
                mag += std::abs(qh[c] * keys[i * hs + c]);
              }
            }
            score[i] = dot / std::sqrt(static_cast<double>(hs));
            smax = std::max(smax, score[i]);
            emax = std::max(emax, ((2 * static_cast<double>(hs) + 2 * log_hs + 12) * kUnit * mag +
                                   half_d * steps[i]) /
                                      std::sqrt(static_cast<double>(hs)));
          }
          double sum = 0;
          for (double& x : score) sum += (x = std::exp(x - smax));
          const double rel = std::expm1(2 * emax) + static_cast<double>(visible + 8) * kUnit;
          // In the avx512bf16 set an 8- or 4-bit block's weights p · vstep are rounded to 15
          // bits: each moves by at most max of the block's / 32766, times a code (vsteps), over
          // the final sum of p (the kernel's p within e^{2ε} of these, its sum likewise).
          double pv_round = 0;
          for (std::size_t i = 0; rounded_query && i < visible;) {
            std::size_t e = i;
            double wmax = 0;
            for (; e < visible && blocks[e] == blocks[i]; ++e)
              wmax = std::max(wmax, score[e] * vsteps[e]);
            pv_round += wmax / 32766 * static_cast<double>(e - i);
            i = e;
          }
          pv_round *= std::exp(4 * emax) * (1 + 1e-4) / sum;
          const double bound =
              (rel + (static_cast<double>(visible) + 2 * log_hs + 8) * kUnit) * vmax + pv_round;
          for (std::size_t c = 0; c < hs; ++c) {
            double want = 0;
            for (std::size_t i = 0; i < visible; ++i) want += score[i] * values[i * hs + c];
            want /= sum;
            ASSERT_NEAR(out[r * dim + h * hs + c], want, bound)
                << what << " (" << kernel_set_name(ks) << ") layer " << l << " head " << h
                << " query " << r << " channel " << c << " of " << end << " positions";
          }
        }
      }
    }
  }
}

/// A config of head size hs with n_heads query heads on n_kv_heads kv heads, 1 layer.
ModelConfig config_of(std::size_t hs, std::size_t seq_len, std::int64_t n_heads = 4,
                      std::int64_t n_kv_heads = 2) {
  return test_config({.dim = n_heads * static_cast<std::int64_t>(hs),
                      .hidden_dim = 32,
                      .n_layers = 1,
                      .n_heads = n_heads,
                      .n_kv_heads = n_kv_heads,
                      .vocab_size = 11,
                      .seq_len = static_cast<std::int64_t>(seq_len)});
}

/// Query heads on kv heads beside the default 4 on 2: one each (MHA: the one-head kernels),
/// and 5 on 1 (MQA: the heads kernels' passes filled and split).
struct HeadLayout {
  std::int64_t n_heads, n_kv_heads;
};
constexpr HeadLayout kOtherLayouts[] = {{2, 2}, {5, 1}};

TEST(CodedAttentionTest, Int8AttentionMatchesDoubleOverDecodedRows) {
  for (const std::size_t hs : {16u, 48u, 64u, 128u, 40u})
    for (const std::size_t end : {1u, 63u, 64u, 130u, 300u}) {
      const ModelConfig cfg = config_of(hs, 320);
      Int8Store<float> s(cfg);
      fill(cfg, s, end, 37, hs + end);
      for (const KernelSet ks : supported_sets())
        for (const std::size_t n : {1u, 3u})
          if (n <= end) expect_attention_matches("int8", cfg, s, end, n, ks);
    }
  for (const HeadLayout hl : kOtherLayouts)
    for (const std::size_t hs : {16u, 48u})
      for (const std::size_t end : {64u, 300u}) {
        const ModelConfig cfg = config_of(hs, 320, hl.n_heads, hl.n_kv_heads);
        Int8Store<float> s(cfg);
        fill(cfg, s, end, 37, hs + end);
        for (const KernelSet ks : supported_sets())
          for (const std::size_t n : {1u, 3u}) expect_attention_matches("int8", cfg, s, end, n, ks);
      }
}

TEST(CodedAttentionTest, LowBitAttentionMatchesDoubleOverDecodedRows) {
  struct Case {
    std::size_t group, residual;
    bool rotate;
  };
  for (const std::size_t hs : {16u, 48u, 64u, 128u, 40u})
    for (const Case cs :
         {Case{64, 128, false}, Case{32, 0, false}, Case{16, 32, true}, Case{300, 0, false}})
      for (const std::size_t end : {1u, 100u, 300u, 301u}) {
        const ModelConfig cfg = config_of(hs, 320);
        Q4Store<float> q4(cfg, 0, cs.group, cs.residual, cs.rotate);
        fill(cfg, q4, end, 37, hs + end);
        Q2Store<float> q2(cfg, 0, cs.group, cs.residual, cs.rotate);
        fill(cfg, q2, end, 37, hs + end + 1);
        for (const KernelSet ks : supported_sets())
          for (const std::size_t n : {1u, 3u}) {
            if (n > end) continue;
            expect_attention_matches("q4", cfg, q4, end, n, ks);
            expect_attention_matches("q2", cfg, q2, end, n, ks);
          }
      }
  for (const HeadLayout hl : kOtherLayouts)
    for (const std::size_t hs : {16u, 48u})
      for (const bool rotate : {false, true}) {
        const std::size_t end = 301;
        const ModelConfig cfg = config_of(hs, 320, hl.n_heads, hl.n_kv_heads);
        Q4Store<float> q4(cfg, 0, 64, 128, rotate);
        fill(cfg, q4, end, 37, hs + end);
        for (const KernelSet ks : supported_sets())
          for (const std::size_t n : {1u, 3u}) expect_attention_matches("q4", cfg, q4, end, n, ks);
      }
}

// The step attend() takes for a decode query over a coded store is the one tested above: its
// output equals attend_kv_head_coded's with the active set, bit for bit.
TEST(CodedAttentionTest, AttendTakesTheCodedPathForFewQueries) {
  const ModelConfig cfg = config_of(48, 320);
  Int8Store<float> s(cfg);
  fill(cfg, s, 200, 50, 5);
  const auto dim = static_cast<std::size_t>(cfg.dim);
  detail::SplitMix64 rng(9);
  std::vector<float> q(dim), a(dim), b(dim);
  for (float& x : q) x = uniform(rng);
  AttentionScratch<float> scratch(cfg, 1, s.block_scratch_size(), 1);
  attend(cfg, s, 0, 199, 1, q.data(), a.data(), scratch);
  const KernelSet ks = active_kernel_set();
  if (!detail::coded_attention_kernels(ks)) GTEST_SKIP() << "no coded kernels in this set";
  for (std::size_t g = 0; g < s.n_kv_heads(); ++g)
    detail::attend_kv_head_coded(cfg, s, 0, g, 199, 1, q.data(), b.data(), scratch, 0, ks);
  EXPECT_EQ(a, b);
}

}  // namespace
}  // namespace kvdecode::testing_util
