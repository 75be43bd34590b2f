// Two configurations measured in turns within one benchmark, so that whatever else the machine
// does slows both alike: the median of each one's figure and of the turns' ratio.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

namespace kvdecode::bench {

/// The upper median of v (not empty).
inline double median_of(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

/// Each iteration runs first() then second(), each returning its figure; reports the median of
/// each as counters first_name and second_name, and of ratio(first's, second's) per turn as
/// ratio_name.
template <class First, class Second, class Ratio>
void in_turns(benchmark::State& state, const std::string& first_name, First first,
              const std::string& second_name, Second second, const std::string& ratio_name,
              Ratio ratio) {
  std::vector<double> a, b, r;
  for (auto _ : state) {
    a.push_back(first());
    b.push_back(second());
    r.push_back(ratio(a.back(), b.back()));
  }
  state.counters[first_name] = median_of(a);
  state.counters[second_name] = median_of(b);
  state.counters[ratio_name] = median_of(r);
}

}  // namespace kvdecode::bench
