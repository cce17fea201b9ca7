// Convolutions under CPU autocast to bfloat16 with float32 arithmetic: the activations bfloat16
// as autocast makes them (the input rounded to bfloat16 and kept so for backward, the output and
// the input's gradient rounded to bfloat16), the weights, the bias and the products float32, the
// weight's gradient float32 — what Winograd's kernels do for 3x3 convolutions (winograd.h), here
// for every other 2-D convolution (1x1, strided, depthwise, any channel count), by ATen's float32
// convolution on the operands widened to float32 and the result rounded back.
//
// On a CPU that multiplies bfloat16 without native instructions (no AVX512-BF16 or AMX), oneDNN
// emulates them (a thread's matmul: 29.7 GFLOP/s against 133.7 in float32 on a 2-core Intel
// Xeon with AVX-512 and no AVX512-BF16). There the measured choice took this path at 25 of
// torchvision MobileNetV2's 30 shapes (1.01-6.14x oneDNN's, forward and backward; oneDNN's kept
// most depthwise ones) and at all 7 of ResNet-18's (1.45-3.05x): the recipe lines of
// bench/peers.sh, docs/benchmarks.md. Where oneDNN multiplies bfloat16 natively its own
// convolution should win (not measured yet); conv2d() (winograd.h) runs whichever measured
// faster at each shape (choice.h).
#pragma once

#include <torch/types.h>

#include <optional>

namespace flotilla::kernels {

// Whether this path can run at::conv2d(x, weight, bias, stride, padding, dilation, groups):
// CPU autocast to bfloat16 on, CPU tensors, a 4-D float32 or bfloat16 input, 4-D float32 weights
// (and bias), two values each for stride, padding and dilation. (It may still lose the
// measurement.)
bool float32_conv2d_applies(const torch::Tensor& x, const torch::Tensor& weight,
                            const std::optional<torch::Tensor>& bias, at::IntArrayRef stride,
                            at::IntArrayRef padding, at::IntArrayRef dilation, std::int64_t groups);

// This path whatever was measured, where float32_conv2d_applies (for tests and benchmarks);
// ConfigError where it does not apply.
torch::Tensor float32_conv2d(const torch::Tensor& x, const torch::Tensor& weight,
                             const std::optional<torch::Tensor>& bias, at::IntArrayRef stride,
                             at::IntArrayRef padding, at::IntArrayRef dilation,
                             std::int64_t groups);

namespace detail {
// at::conv2d(...) by this path where it applies and measured faster (choice.h), else ATen's:
// what conv2d() runs where Winograd's kernels do not apply.
torch::Tensor other_conv2d(const torch::Tensor& x, const torch::Tensor& weight,
                           const std::optional<torch::Tensor>& bias, at::IntArrayRef stride,
                           at::IntArrayRef padding, at::IntArrayRef dilation, std::int64_t groups);
} // namespace detail

} // namespace flotilla::kernels
