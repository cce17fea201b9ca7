// A grayscale CNN's first layer as one: a 3×3 convolution of one-channel images (stride 1,
// padding 1, with bias), then ReLU and 2×2 max-pooling (what the zoo's CNN and Keras's
// Conv2D(3, padding="same", activation="relu") + MaxPooling2D compute). Where the CPU has
// AVX-512 or AVX2, each image goes through one kernel each way:
// - forward computes each 2×2 window's four convolution outputs in registers and writes only
//   the pooled output and a byte per output (where its maximum was, or no gradient); the
//   full-size convolution output (the largest tensor of the step) is never written or read;
// - backward computes the weights' and bias's gradients from the pooled gradient and those
//   bytes; the full-size gradient is never written.
// The values are those of conv2d, relu and max_pool2d within float rounding (sums in another
// order: conv_pool_relu_test.cpp). Elsewhere (another device or CPU, other types than float32
// and bfloat16, an input that needs its gradient, channels not a multiple of 16) it runs conv2d
// then MaxPool2ReLU. Under CPU autocast (bfloat16) it computes in bfloat16 as conv2d does.
// Parameters "weight" [C, 1, 3, 3] and "bias" [C], initialised as torch::nn::Conv2d's.
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <string>

namespace flotilla::models {

class ConvMaxPool2ReLUImpl : public torch::nn::Cloneable<ConvMaxPool2ReLUImpl> {
 public:
  explicit ConvMaxPool2ReLUImpl(std::int64_t out_channels);
  void reset() override;
  // [N, 1, H, W] -> [N, C, H/2, W/2], channels-last where the kernel ran.
  torch::Tensor forward(const torch::Tensor& x);

  torch::Tensor weight, bias;

 private:
  std::int64_t out_channels_;
};
TORCH_MODULE(ConvMaxPool2ReLU);

// The kernel ConvMaxPool2ReLU runs: "avx512" or "avx2" (with FMA), the best this CPU has, or
// "none" (ATen's ops). The environment variable FLOTILLA_CONV_POOL_KERNEL (avx512, avx2, none)
// chooses another at the first use, where this CPU runs it.
const char* conv_max_pool2_relu_kernel();
// Runs `name`'s kernel from now on (as FLOTILLA_CONV_POOL_KERNEL does; for tests and
// benchmarks); false, and nothing changes, where this CPU lacks it.
bool use_conv_max_pool2_relu_kernel(const std::string& name);

} // namespace flotilla::models
