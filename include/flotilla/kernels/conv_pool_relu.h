// A grayscale CNN's first layer as one: a 3×3 convolution of one-channel images (stride 1,
// padding 1, with bias), then ReLU and 2×2 max-pooling (what Keras's Conv2D(3, padding="same",
// activation="relu") + MaxPooling2D compute). Where the CPU has AVX-512 or AVX2, each image goes
// through one kernel each way:
// - forward computes each 2×2 window's four convolution outputs in registers and writes only
//   the pooled output and a byte per output (where its maximum was, or no gradient); the
//   full-size convolution output (the largest tensor of the step) is never written or read;
// - backward computes the weights' and bias's gradients from the pooled gradient and those
//   bytes; the full-size gradient is never written.
// The values are those of conv2d, relu and max_pool2d within float rounding (sums in another
// order: conv_pool_relu_test.cpp). Elsewhere (another device or CPU, other types than float32
// and bfloat16, an input that needs its gradient, channels not a multiple of 16), and where ATen's
// measured faster (choice.h), it runs conv2d then max_pool2_relu. Under CPU autocast (bfloat16)
// it computes in bfloat16 as conv2d does.
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/pimpl.h>

#include <ostream>
#include <string>

namespace flotilla::kernels {

// max_pool2d(relu(conv2d(x, weight, bias, stride 1, padding 1)), 2) for x [N, 1, H, W],
// weight [C, 1, 3, 3] and bias [C]; channels-last where the kernel ran.
torch::Tensor conv_max_pool2_relu(const torch::Tensor& x, const torch::Tensor& weight,
                                  const torch::Tensor& bias);

// The layer: parameters "weight" [C, 1, 3, 3] and "bias" [C].
class ConvMaxPool2ReLUImpl : public torch::nn::Cloneable<ConvMaxPool2ReLUImpl> {
 public:
  // Initialised as torch::nn::Conv2d(1, C, 3) is (the same draws give the same weights).
  explicit ConvMaxPool2ReLUImpl(std::int64_t out_channels);
  // `conv`'s own weight and bias (the same tensors): the compile step's swap for a Conv2d of
  // one input channel, 3x3, padding 1, followed by ReLU and MaxPool2d(2).
  explicit ConvMaxPool2ReLUImpl(const torch::nn::Conv2dImpl& conv);
  void reset() override;
  // [N, 1, H, W] -> [N, C, H/2, W/2].
  torch::Tensor forward(const torch::Tensor& x);
  void pretty_print(std::ostream& stream) const override;

  torch::Tensor weight, bias;

 private:
  std::int64_t out_channels_;
};
TORCH_MODULE(ConvMaxPool2ReLU);

// The instruction set ConvMaxPool2ReLU's kernel runs: "avx512" or "avx2" (with FMA), the best
// this CPU has, or "none" (ATen's ops always). The environment variable FLOTILLA_CONV_POOL_KERNEL
// (avx512, avx2, none) chooses another at the first use, where this CPU runs it.
const char* conv_max_pool2_relu_kernel();
// Runs `name`'s kernel from now on (for tests and benchmarks); false, and nothing changes,
// where this CPU lacks it.
bool use_conv_max_pool2_relu_kernel(const std::string& name);

} // namespace flotilla::kernels
