// AllStores: the one list of the store kinds the library ships, for the code that must name
// every kind (the cache file's tag → name table, tests that cover each kind).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "kvdecode/store/contiguous_store.hpp"
#include "kvdecode/store/int8_store.hpp"
#include "kvdecode/store/kv_store.hpp"
#include "kvdecode/store/paged_store.hpp"
#include "kvdecode/store/q4_store.hpp"
#include "kvdecode/store/window_store.hpp"

namespace kvdecode {

/// A list of store templates, each `S<T>` a KvStore of scalar T.
template <template <class> class... Stores>
struct StoreList {
  static constexpr std::size_t kSize = sizeof...(Stores);
};

/// Every store kind, in the order of their cache-file tags. A new store adds itself here once.
using AllStores = StoreList<ContiguousStore, PagedStore, Int8Store, WindowStore, Q4Store, Q2Store>;

namespace detail {
/// Whether no two stores of the list share a cache-file tag (tags are fixed forever, so a new
/// store must take a new one).
template <template <class> class... Stores>
constexpr bool distinct_file_tags(StoreList<Stores...>) {
  const std::array<std::uint32_t, sizeof...(Stores)> tags = {Stores<float>::kFileTag...};
  for (std::size_t i = 0; i < tags.size(); ++i)
    for (std::size_t j = i + 1; j < tags.size(); ++j)
      if (tags[i] == tags[j]) return false;
  return true;
}

template <template <class> class... Stores>
constexpr bool all_kv_stores(StoreList<Stores...>) {
  return (... && (KvStore<Stores<float>> && KvStore<Stores<double>>));
}
}  // namespace detail

static_assert(detail::distinct_file_tags(AllStores{}), "two stores share a cache-file tag");
static_assert(detail::all_kv_stores(AllStores{}));

}  // namespace kvdecode
