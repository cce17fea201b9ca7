// Test support: how far apart two sets of parameters are, for equivalence tests.
#pragma once

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

} // namespace flotilla::testing
