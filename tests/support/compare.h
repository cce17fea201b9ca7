// Test support: comparing two sets of parameters, for equivalence tests.
#pragma once

#include <torch/nn/module.h>
#include <torch/types.h>

#include <algorithm>
#include <vector>

namespace flotilla::testing {

// max over tensors of ||a - b||_inf / ||b||_inf
inline double max_relative_difference(const std::vector<torch::Tensor>& a,
                                      const std::vector<torch::Tensor>& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    worst =
        std::max(worst, (a[i] - b[i]).abs().max().item<double>() / b[i].abs().max().item<double>());
  }
  return worst;
}

// Every parameter's values, in order, as one vector: equal vectors mean bit-identical models.
inline std::vector<float> flat_parameters(const torch::nn::Module& m) {
  std::vector<float> out;
  for (const auto& p : m.parameters()) {
    const auto t = p.detach().to(torch::kFloat32).contiguous().view(-1);
    out.insert(out.end(), t.data_ptr<float>(), t.data_ptr<float>() + t.numel());
  }
  return out;
}

} // namespace flotilla::testing
