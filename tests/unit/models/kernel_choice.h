// The fused layers' tests run each kernel this CPU has: KernelChoice<name, use> lists them and
// switches to one for a scope, then back to the one chosen before. relative_difference is how
// they measure a result against a reference.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

namespace flotilla::models {

template <const char* (*Name)(), bool (*Use)(const std::string&)> struct KernelChoice {
  // The kernels this CPU runs ("avx512", "avx2"), leaving the one chosen as it was.
  static std::vector<std::string> runnable() {
    const std::string before = Name();
    std::vector<std::string> names;
    for (const char* name : {"avx512", "avx2"}) {
      if (Use(name)) names.push_back(name);
    }
    Use(before);
    return names;
  }
  explicit KernelChoice(const std::string& name) : before(Name()) {
    EXPECT_TRUE(Use(name)) << name;
  }
  ~KernelChoice() { Use(before); }
  std::string before;
};

// The largest difference, relative to the reference's largest magnitude.
inline double relative_difference(const torch::Tensor& a, const torch::Tensor& reference) {
  const torch::Tensor ref = reference.to(torch::kDouble);
  return ((a.to(torch::kDouble) - ref).abs().max() / ref.abs().max()).item<double>();
}

} // namespace flotilla::models
