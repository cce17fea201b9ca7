// 3x3 convolutions (stride 1, padding 1, no bias) in fewer multiplications: Winograd's
// F(4x4, 3x3) (Lavin and Gray, 2016) computes each 4x4 block of outputs from the 6x6 block of
// inputs around it in 36 products a channel pair instead of the direct convolution's 144, at the
// price of transforms that cost a few additions an input and output value. Where a side is not a
// multiple of 4 the last row or column of tiles is as deep as what is left: F(3, 3) (5
// positions) or F(2, 3) (4) along that side, so no products are spent on outputs past the edge
// (a 14x14 image takes 22 x 22 positions where 4x4 tiles alone take 24 x 24). On a CPU with
// AVX-512 or AVX2, for channels-last input whose channel counts (in and out) are multiples of 16,
// forward, the input's gradient (the same computation with the weights flipped and transposed)
// and the weight's gradient run flotilla's kernels:
// - float32 activations, 16 to 512 channels: float32 throughout. The values are the
//   convolution's within float rounding, a little more of it than the direct sum's: up to
//   1.5e-5 of the output's largest value against 2.2e-6 (winograd_test.cpp).
// - under CPU autocast to bfloat16, 16 to 512 channels: the activations (input, output and their
//   gradients) are bfloat16 as autocast makes them, the weights and the arithmetic float32 (the
//   direct convolution rounds the weights to bfloat16 too), the weight gradient float32.
// The products are float32 at the FMA rate: where oneDNN multiplies bfloat16 faster (AMX tiles,
// AVX512-BF16) its direct convolution can win, so conv2d() runs whichever measured faster at
// each shape (choice.h).
#pragma once

#include <torch/nn/modules/conv.h>
#include <torch/types.h>

#include <optional>
#include <string>

namespace flotilla::kernels {

// at::conv2d(x, weight, bias, stride, padding, dilation, groups): by Winograd's kernels where
// they apply (winograd_applies) and flotilla's kernel is chosen (choice.h), else ATen's. Where
// they do not apply, under bfloat16 autocast, by float32 arithmetic on the bfloat16 activations
// (convolution.h) where that measured faster, else ATen's.
torch::Tensor conv2d(const torch::Tensor& x, const torch::Tensor& weight,
                     const std::optional<torch::Tensor>& bias, at::IntArrayRef stride,
                     at::IntArrayRef padding, at::IntArrayRef dilation, std::int64_t groups);
// conv.forward(x) likewise (other padding modes than zeros, and padding given by name, run the
// module's forward).
torch::Tensor conv2d(torch::nn::Conv2dImpl& conv, const torch::Tensor& x);

// Whether Winograd's kernels can run it: a CPU kernel (below), the options above, float32
// weights, float32 input or CPU autocast to bfloat16, channels-last input, channel counts.
bool winograd_applies(const torch::Tensor& x, const torch::Tensor& weight,
                      const std::optional<torch::Tensor>& bias, at::IntArrayRef stride,
                      at::IntArrayRef padding, at::IntArrayRef dilation, std::int64_t groups);
bool winograd_applies(const torch::nn::Conv2dImpl& conv, const torch::Tensor& x);

// Winograd's kernels whatever was measured, where winograd_applies (for tests and benchmarks);
// ConfigError where they do not apply.
torch::Tensor winograd_conv3x3(const torch::Tensor& x, const torch::Tensor& weight);

// The instruction set Winograd's kernels run: "avx512" or "avx2" (the best this CPU has), or
// "none" (never flotilla's). The environment variable FLOTILLA_WINOGRAD_KERNEL (avx512, avx2,
// none) chooses another at the first use, where this CPU runs it.
const char* winograd_kernel();
// Runs `name`'s kernel from now on (for tests and benchmarks); false, and nothing changes,
// where this CPU lacks it.
bool use_winograd_kernel(const std::string& name);

} // namespace flotilla::kernels
