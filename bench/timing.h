// The layer benchmarks' set-up and timing (bench/max_pool_relu.cpp, batch_norm_relu.cpp,
// dropout.cpp, attention.cpp).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <vector>

#include "flotilla/base/system.h"

namespace flotilla::bench {

// A layer benchmark's arguments, [REPEATS=15] [IMAGES=default_images], each at least 1. Runs on
// one thread; with keep_freed, malloc keeps what a run frees, as `flotilla train` does (no page
// faults for each run's tensors).
struct LayerBench {
  int repeats;
  std::int64_t images;
};
inline LayerBench layer_bench(int argc, char** argv, std::int64_t default_images, bool keep_freed) {
  at::set_num_threads(1);
  if (keep_freed) base::keep_freed_memory();
  return {argc > 1 ? std::max(1, std::atoi(argv[1])) : 15,
          argc > 2 ? std::max<std::int64_t>(1, std::atoi(argv[2])) : default_images};
}

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
