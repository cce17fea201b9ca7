// The layer benchmarks' timing (bench/max_pool_relu.cpp, batch_norm_relu.cpp, dropout.cpp).
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

namespace flotilla::bench {

// The median milliseconds of `repeats` runs of f, after 3 untimed.
inline double median_ms(int repeats, const std::function<void()>& f) {
  for (int i = 0; i < 3; ++i) f();
  std::vector<double> times;
  for (int i = 0; i < repeats; ++i) {
    const auto start = std::chrono::steady_clock::now();
    f();
    times.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
            .count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

} // namespace flotilla::bench
