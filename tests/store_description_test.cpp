// The store description: what every store says about itself (options, bytes, how far it can
// roll back exactly, how much one append may bring, its coded blocks) checked against what the
// store then does.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvdecode/kvdecode.hpp"
#include "test_util.hpp"

namespace kvdecode {
namespace {

using testing_util::small_config;

/// The K and V rows [kv_dim] written for cache index p of layer l: a fixed function of (p, l),
/// so two stores fed the same indices hold the same rows.
std::vector<float> row(const ModelConfig& cfg, std::size_t p, std::size_t l, bool value) {
  detail::SplitMix64 rng(1 + 1000 * p + 10 * l + (value ? 1 : 0));
  std::vector<float> r(static_cast<std::size_t>(cfg.kv_dim()));
  for (float& x : r) x = static_cast<float>(rng.next() % 2001) / 1000.0f - 1.0f;
  return r;
}

/// Appends cache indices [size, size + n) to s in appends of at most `chunk` positions.
template <class S>
void append(const ModelConfig& cfg, S& s, std::size_t n, std::size_t chunk) {
  for (std::size_t done = 0; done < n;) {
    const std::size_t m = std::min({chunk, n - done, s.max_append()});
    ASSERT_GT(m, 0u) << "the store refuses more positions";
    const std::vector<std::int32_t> tokens(m, 3);
    const std::size_t first = s.size();
    s.begin_append(tokens);
    for (std::size_t l = 0; l < s.n_layers(); ++l)
      for (std::size_t i = 0; i < m; ++i)
        s.write(l, i, row(cfg, first + i, l, false).data(), row(cfg, first + i, l, true).data());
    s.commit_append();
    done += m;
  }
}

/// Every (layer, kv head, cache index) row a query at index `end` could see: what for_each_block
/// hands for [0, end), less what the store masks from that query.
template <class S>
std::map<std::tuple<std::size_t, std::size_t, std::size_t>, std::vector<float>> visible(
    const S& s, std::size_t end) {
  std::map<std::tuple<std::size_t, std::size_t, std::size_t>, std::vector<float>> out;
  std::vector<float> scratch(s.block_scratch_size());
  const std::size_t hs = s.head_size();
  for (std::size_t l = 0; l < s.n_layers(); ++l)
    for (std::size_t h = 0; h < s.n_kv_heads(); ++h)
      s.for_each_block(l, h, end, std::span<float>(scratch), [&](const KvBlock<float>& b) {
        for (std::size_t r = 0; r < b.n; ++r) {
          const std::size_t index = b.first + r;
          if constexpr (MaskingKvStore<S>) {
            if (s.masks(end, index)) continue;
          }
          std::vector<float> kv(b.keys + r * b.stride, b.keys + r * b.stride + hs);
          kv.insert(kv.end(), b.values + r * b.stride, b.values + r * b.stride + hs);
          out[{l, h, index}] = std::move(kv);
        }
      });
  return out;
}

/// A store with n positions appended, then k more; rolled back by every r ≤
/// max_exact_rollback(), it must show a later query exactly what a store that never had those
/// r positions shows, and stay so after both take the same further positions.
template <class S, class Make>
void expect_exact_rollback(const char* what, const ModelConfig& cfg, Make make, std::size_t n,
                           std::size_t k, std::size_t chunk) {
  S probe = make();
  append(cfg, probe, n, chunk);
  append(cfg, probe, k, chunk);
  const std::size_t most = probe.max_exact_rollback();
  EXPECT_LE(most, probe.size()) << what;
  for (std::size_t r = 0; r <= std::min(most, k + n); ++r) {
    S rolled = make();
    append(cfg, rolled, n, chunk);
    append(cfg, rolled, k, chunk);
    ASSERT_EQ(rolled.max_exact_rollback(), most) << what;
    rolled.truncate(n + k - r);
    S fresh = make();
    append(cfg, fresh, n + k - r, chunk);
    const std::size_t end = n + k - r;
    EXPECT_EQ(visible(rolled, end), visible(fresh, end)) << what << " rolled back " << r;
    EXPECT_EQ(std::vector<std::int32_t>(rolled.tokens().begin(), rolled.tokens().end()),
              std::vector<std::int32_t>(fresh.tokens().begin(), fresh.tokens().end()));
    append(cfg, rolled, 3, 1);
    append(cfg, fresh, 3, 1);
    EXPECT_EQ(visible(rolled, end + 3), visible(fresh, end + 3))
        << what << " rolled back " << r << ", then 3 more";
  }
}

// Cache files record a store by its tag, fixed forever (docs/FORMATS.md): AllStores holds every
// kind with the tag and name the format gave it, and the cache file names each.
TEST(StoreDescriptionTest, AllStoresKeepTheirFileTags) {
  const std::map<std::uint32_t, std::string> fixed = {
      {1, "contiguous"}, {2, "paged"}, {4, "window"}, {6, "q4"}, {7, "q2"}, {8, "int8"}};
  std::map<std::uint32_t, std::string> listed;
  for (const auto& k : detail::cache_file::kStoreKinds) listed.emplace(k.tag, std::string(k.name));
  EXPECT_EQ(listed, fixed);
  EXPECT_EQ(AllStores::kSize, fixed.size());
  for (const auto& [tag, name] : fixed) EXPECT_EQ(detail::cache_file::kind_name(tag), name);
  EXPECT_EQ(detail::cache_file::kind_name(3), "unknown");  // int8 with f32 scales
  EXPECT_EQ(detail::cache_file::kind_name(5), "unknown");  // the 4-bit layout before its residual
  EXPECT_EQ(detail::cache_file::kind_name(9), "unknown");
}

TEST(StoreDescriptionTest, RollingBackMaxExactRollbackEqualsNeverAppending) {
  const ModelConfig cfg = small_config(4, 2, 64);
  for (const std::size_t chunk : {1u, 4u}) {
    for (const std::size_t k : {1u, 5u, 11u}) {
      expect_exact_rollback<ContiguousStore<float>>(
          "contiguous", cfg, [&] { return ContiguousStore<float>(cfg); }, 9, k, chunk);
      expect_exact_rollback<Int8Store<float>>(
          "int8", cfg, [&] { return Int8Store<float>(cfg); }, 9, k, chunk);
      expect_exact_rollback<Q4Store<float>>(
          "q4", cfg, [&] { return Q4Store<float>(cfg, 0, 8, 8); }, 9, k, chunk);
      expect_exact_rollback<Q2Store<float>>(
          "q2", cfg, [&] { return Q2Store<float>(cfg, 0, 4, 0, false); }, 9, k, chunk);
      for (const auto policy : {WindowPolicy::kTrainedWindow, WindowPolicy::kStreaming}) {
        const WindowOptions o{.window = 6, .sinks = 2, .policy = policy, .max_chunk = chunk};
        expect_exact_rollback<WindowStore<float>>(
            "window", cfg, [&] { return WindowStore<float>(cfg, o); }, 9, k, chunk);
      }
    }
  }
}

TEST(StoreDescriptionTest, PagedRollbackIsExactAndLeavesAForkUnchanged) {
  const ModelConfig cfg = small_config(4, 2, 64);
  BlockPool<float> pool(cfg, 40, 4);
  for (const std::size_t k : {1u, 5u, 11u}) {
    PagedStore<float> a(pool);
    append(cfg, a, 9 + k, 3);
    const PagedStore<float> fork = a.fork();
    const auto fork_before = visible(fork, fork.size());
    ASSERT_EQ(a.max_exact_rollback(), a.size());
    for (std::size_t r = 0; r <= k; ++r) {
      PagedStore<float> rolled = fork.fork();
      rolled.truncate(9 + k - r);
      PagedStore<float> fresh(pool);
      append(cfg, fresh, 9 + k - r, 3);
      EXPECT_EQ(visible(rolled, 9 + k - r), visible(fresh, 9 + k - r)) << "rolled back " << r;
      append(cfg, rolled, 3, 1);
      append(cfg, fresh, 3, 1);
      EXPECT_EQ(visible(rolled, 12 + k - r), visible(fresh, 12 + k - r));
    }
    EXPECT_EQ(visible(fork, fork.size()), fork_before) << "a rollback changed another sequence";
  }
}

/// max_append() is what begin_append accepts: that many positions are taken, one more is not.
template <class S>
void expect_max_append_is_exact(const char* what, S& s) {
  const std::size_t m = s.max_append();
  if (m < s.capacity() - s.size()) {
    const std::vector<std::int32_t> more(m + 1, 3);
    EXPECT_THROW(s.begin_append(more), Error) << what;
    EXPECT_EQ(s.pending(), 0u) << what;
  }
  const std::vector<std::int32_t> ok(m, 3);
  s.begin_append(ok);
  EXPECT_EQ(s.pending(), m) << what;
  s.cancel_append();
}

TEST(StoreDescriptionTest, MaxAppendIsExactlyWhatBeginAppendAccepts) {
  const ModelConfig cfg = small_config(4, 2, 64);
  ContiguousStore<float> c(cfg, 20);
  Int8Store<float> i8(cfg, 20);
  Q4Store<float> q4(cfg, 20, 8);
  for (const std::size_t n : {0u, 7u, 20u}) {
    c.reset(), i8.reset(), q4.reset();
    append(cfg, c, n, 5), append(cfg, i8, n, 5), append(cfg, q4, n, 5);
    EXPECT_EQ(c.max_append(), 20 - n);
    EXPECT_EQ(i8.max_append(), 20 - n);
    EXPECT_EQ(q4.max_append(), 20 - n);
    expect_max_append_is_exact("contiguous", c);
    expect_max_append_is_exact("int8", i8);
    expect_max_append_is_exact("q4", q4);
  }
  // A paged sequence is bounded by its pool too: 5 blocks of 4, one of them held by a fork's
  // shared partial block, which the next append must copy.
  BlockPool<float> pool(cfg, 5, 4, {.capacity = 64});
  PagedStore<float> a(pool);
  append(cfg, a, 6, 6);  // blocks 0 and 1, the second half full
  EXPECT_EQ(a.max_append(), 2 + 3 * 4u);
  expect_max_append_is_exact("paged", a);
  const PagedStore<float> b = a.fork();  // shares the partial block: the next append copies it
  EXPECT_EQ(a.max_append(), 2 + 2 * 4u);
  expect_max_append_is_exact("paged after a fork", a);
}

TEST(StoreDescriptionTest, OptionsRebuildTheSameStore) {
  const ModelConfig cfg = small_config(4, 2, 64);
  const ContiguousStore<float> c(cfg, 17);
  EXPECT_EQ(ContiguousStore<float>(cfg, c.options()).memory_bytes(), c.memory_bytes());
  EXPECT_EQ(ContiguousStore<float>::memory_bytes_for(cfg, c.options()), c.memory_bytes());
  const Q4Store<float> q4(cfg, 40, 16);
  EXPECT_EQ(q4.options().group, 16u);
  EXPECT_EQ(q4.options().residual, 128u);
  EXPECT_FALSE(q4.options().rotate);
  const Q2Store<float> q2(cfg, 40, 8, 16, false);
  EXPECT_EQ(Q2Store<float>(cfg, q2.options()).memory_bytes(), q2.memory_bytes());
  EXPECT_EQ(Q2Store<float>::memory_bytes_for(cfg, q2.options()), q2.memory_bytes());
  EXPECT_EQ(Q4Store<float>(cfg, q4.options()).memory_bytes(), q4.memory_bytes());
  const WindowStore<float> w(
      cfg, {.window = 5, .sinks = 1, .policy = WindowPolicy::kStreaming, .max_chunk = 2});
  EXPECT_EQ(WindowStore<float>::memory_bytes_for(cfg, w.options()), w.memory_bytes());
  EXPECT_EQ(w.options().policy, WindowPolicy::kStreaming);
}

/// An f16 bit pattern's value: (-1)^s 2^(e-15) (1 + m/1024), or 2^-14 m/1024 when e = 0.
double f16(std::uint16_t h) {
  const int e = (h >> 10) & 0x1F, m = h & 0x3FF;
  const double v = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return (h & 0x8000) != 0 ? -v : v;
}

/// Decodes what for_each_coded_block hands for [0, end) with the formulas of the formats
/// (written here) and compares it, bit for bit, with what for_each_block hands.
template <class S>
void expect_coded_blocks_decode_to_blocks(const char* what, const S& s, std::size_t end) {
  const std::size_t hs = s.head_size();
  std::vector<float> scratch(s.block_scratch_size());
  for (std::size_t l = 0; l < s.n_layers(); ++l)
    for (std::size_t h = 0; h < s.n_kv_heads(); ++h) {
      std::vector<float> want(2 * end * hs), got(2 * end * hs, -999.0f);  // [end][K | V]
      s.for_each_block(l, h, end, std::span<float>(scratch), [&](const KvBlock<float>& b) {
        for (std::size_t r = 0; r < b.n; ++r)
          for (std::size_t c = 0; c < hs; ++c) {
            want[(b.first + r) * 2 * hs + c] = b.keys[r * b.stride + c];
            want[(b.first + r) * 2 * hs + hs + c] = b.values[r * b.stride + c];
          }
      });
      std::size_t next = 0;
      const auto put = [&](std::size_t index, std::size_t c, float k, float v) {
        got[index * 2 * hs + c] = k;
        got[index * 2 * hs + hs + c] = v;
      };
      s.for_each_coded_block(l, h, end, [&](const auto& b) {
        using B = std::remove_cvref_t<decltype(b)>;
        EXPECT_EQ(b.first, next) << what << ": blocks out of order";
        next = b.first + b.n;
        for (std::size_t r = 0; r < b.n; ++r)
          for (std::size_t c = 0; c < hs; ++c) {
            if constexpr (std::is_same_v<B, Int8KvBlock>) {
              put(b.first + r, c,
                  static_cast<float>(f16(b.key_min[r]) + b.keys[r * hs + c] * f16(b.key_step[r])),
                  static_cast<float>(f16(b.value_min[r]) +
                                     b.values[r * hs + c] * f16(b.value_step[r])));
            } else if constexpr (std::is_same_v<B, LowBitKvBlock>) {
              // The row in rotated coordinates, then D H / √b applied with the matrix written out.
              const std::size_t per_byte = 8 / b.bits;
              const auto code = [&](const std::uint8_t* codes, std::size_t i) {
                const std::uint8_t byte = codes[r * hs / per_byte + i / per_byte];
                return static_cast<double>((byte >> (b.bits * (i % per_byte))) &
                                           ((1u << b.bits) - 1));
              };
              std::vector<double> kr(hs), vr(hs);
              for (std::size_t i = 0; i < hs; ++i) {
                kr[i] = f16(b.key_min[i]) + code(b.keys, i) * f16(b.key_step[i]);
                vr[i] = f16(b.value_min[r]) + code(b.values, i) * f16(b.value_step[r]);
              }
              double kc = kr[c], vc = vr[c];
              if (b.signs != nullptr) {
                std::size_t blk = 1;  // the largest power of two dividing hs
                while (hs % (2 * blk) == 0) blk *= 2;
                const std::size_t c0 = c / blk * blk;
                kc = vc = 0;
                for (std::size_t j = c0; j < c0 + blk; ++j) {
                  const double hcj =
                      std::popcount((c - c0) & (j - c0)) % 2 == 0 ? 1.0 : -1.0;  // H[c][j]
                  kc += hcj * kr[j];
                  vc += hcj * vr[j];
                }
                kc *= b.signs[c] / std::sqrt(static_cast<double>(blk));
                vc *= b.signs[c] / std::sqrt(static_cast<double>(blk));
              }
              put(b.first + r, c, static_cast<float>(kc), static_cast<float>(vc));
            } else {
              put(b.first + r, c, b.keys[r * b.stride + c], b.values[r * b.stride + c]);
            }
          }
      });
      EXPECT_EQ(next, end) << what;
      // The formulas of the formats, up to the rounding of a fused multiply-add (the kernels
      // may use one): a few units in the last place.
      ASSERT_EQ(got.size(), want.size());
      for (std::size_t i = 0; i < got.size(); ++i)
        ASSERT_NEAR(got[i], want[i], 1e-6 * (1 + std::abs(want[i])))
            << what << " layer " << l << " kv head " << h << " element " << i;
    }
}

TEST(StoreDescriptionTest, CodedBlocksDecodeToWhatForEachBlockHands) {
  const ModelConfig cfg = small_config(4, 2, 200);
  Int8Store<float> i8(cfg);
  append(cfg, i8, 150, 64);
  expect_coded_blocks_decode_to_blocks("int8", i8, 150);
  expect_coded_blocks_decode_to_blocks("int8", i8, 64);
  Q4Store<float> q4(cfg, 0, 16, 32, /*rotate=*/true);
  append(cfg, q4, 150, 64);  // 7 quantized groups and 38 exact rows, rotated
  expect_coded_blocks_decode_to_blocks("q4", q4, 150);
  expect_coded_blocks_decode_to_blocks("q4", q4, 40);
  Q2Store<float> q2(cfg, 0, 16, 0, false);
  append(cfg, q2, 150, 64);  // 9 quantized groups and 6 exact rows
  expect_coded_blocks_decode_to_blocks("q2", q2, 150);
  expect_coded_blocks_decode_to_blocks("q2", q2, 40);
}

}  // namespace
}  // namespace kvdecode
