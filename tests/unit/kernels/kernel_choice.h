// The kernels' tests run each instruction set this CPU has: KernelChoice<name, use> lists them
// and switches to one for a scope (with Mode::kFixed, so flotilla's kernel runs wherever it
// applies, whatever a measurement would say), then back to what was chosen before. KernelMode
// sets the mode alone. relative_difference is how they measure a result against a reference.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "flotilla/kernels/choice.h"

namespace flotilla::kernels {

struct KernelMode {
  explicit KernelMode(Mode m) : before(mode()) { set_mode(m); }
  ~KernelMode() { set_mode(before); }
  Mode before;
};

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
  KernelMode fixed{Mode::kFixed};
};

// The largest difference, relative to the reference's largest magnitude.
inline double relative_difference(const torch::Tensor& a, const torch::Tensor& reference) {
  const torch::Tensor ref = reference.to(torch::kDouble);
  return ((a.to(torch::kDouble) - ref).abs().max() / ref.abs().max()).item<double>();
}

// How a net's whole gradient (every parameter's, as one vector) compares with `truth`'s: the
// angle between them as 1 - cosine, and its length over truth's. A gradient of zeros has no
// direction: its angle error is NaN, which fails every bound (a largest-difference measure, 1 for
// zeros, passed bounds set where bfloat16's differences are near 1 anyway).
struct GradientAgreement {
  double angle_error = 0;
  double length_ratio = 0;
};
inline GradientAgreement gradient_agreement(const torch::nn::Module& net,
                                            const torch::nn::Module& truth) {
  auto reference = truth.named_parameters();
  std::vector<torch::Tensor> a, b;
  for (const auto& p : net.named_parameters()) {
    a.push_back(p.value().grad().to(torch::kDouble).flatten());
    b.push_back(reference[p.key()].grad().to(torch::kDouble).flatten());
  }
  const torch::Tensor g = torch::cat(a), t = torch::cat(b);
  const double cosine = (g.dot(t) / (g.norm() * t.norm())).item<double>();
  return {1 - cosine, (g.norm() / t.norm()).item<double>()};
}

} // namespace flotilla::kernels
