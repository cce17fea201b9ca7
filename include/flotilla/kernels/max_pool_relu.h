// 2×2 max-pooling (stride 2, no padding, floor) and ReLU as one layer: what a convolutional net's
// "ReLU, max_pool2d(2)" computes. The two commute (ReLU is monotone: the largest of four ReLUs is
// the ReLU of the largest), so this pools first and applies ReLU to a quarter of the elements,
// and on the CPU does both in one pass each way: forward reads the input once and writes the
// output and a one-byte code per output (where its maximum was, or no gradient); backward writes
// every input gradient once (PyTorch's pooling backward zero-fills the whole input gradient and
// then scatters, and ReLU's forward and backward each pass over the full-size tensor).
// Outputs and gradients are equal to torch::relu then torch::max_pool2d(2)
// (max_pool_relu_test.cpp: torch::equal, float32 and bfloat16, NCHW and channels-last, odd sizes,
// ties, NaN). Elsewhere than the CPU, and in other types than float32 and bfloat16, it runs
// max_pool2d then relu (still a quarter of the ReLU); so does every shape where that measured
// faster (choice.h).
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

namespace flotilla::kernels {

// `x` is [N, C, H, W] with H and W at least 2; the result is [N, C, H/2, W/2] in x's memory
// format (NCHW or channels-last).
torch::Tensor max_pool2_relu(const torch::Tensor& x);

class MaxPool2ReLUImpl : public torch::nn::Cloneable<MaxPool2ReLUImpl> {
 public:
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) { return max_pool2_relu(x); }
};
TORCH_MODULE(MaxPool2ReLU);

} // namespace flotilla::kernels
