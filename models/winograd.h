// A ResNet's 3x3 convolutions (stride 1, padding 1, no bias) in fewer multiplications:
// Winograd's F(4x4, 3x3) (Lavin and Gray, 2016) computes each 4x4 block of outputs from the 6x6
// block of inputs around it in 36 products a channel pair instead of the direct convolution's
// 144, at the price of transforms that cost a few additions an input and output value. Where a
// side is not a multiple of 4 the last row or column of tiles is as deep as what is left: F(3, 3)
// (5 positions) or F(2, 3) (4) along that side, so no products are spent on outputs past the
// edge (a 14x14 image takes 22 x 22 positions where 4x4 tiles alone take 24 x 24). On a CPU
// with AVX-512 or AVX2, for channels-last input whose channel counts (in and out) are multiples
// of 16, forward, the input's gradient (the same computation with the weights flipped and
// transposed) and the weight's gradient run flotilla's kernels (winograd_kernel.h):
// - float32 activations, 16 to 512 channels: float32 throughout. The values are the
//   convolution's within float rounding, a little more of it than the direct sum's: up to
//   1.5e-5 of the output's largest value against 2.2e-6 (winograd_test.cpp).
// - under CPU autocast to bfloat16, 16 to 512 channels: the activations (input, output and their
//   gradients) are bfloat16 as autocast makes them, the weights and the arithmetic float32 (the
//   direct convolution rounds the weights to bfloat16 too), the weight gradient float32.
// Anything else (another device, type or layout, other options or channel counts) runs the
// module's forward: oneDNN's direct convolution.
#pragma once

#include <torch/nn/modules/conv.h>

#include <string>

namespace flotilla::models {

// conv->forward(x), through the Winograd kernels where they apply (above).
torch::Tensor conv3x3(torch::nn::Conv2dImpl& conv, const torch::Tensor& x);

// Whether conv3x3(conv, x) runs the Winograd kernels.
bool runs_winograd(const torch::nn::Conv2dImpl& conv, const torch::Tensor& x);

// The kernel conv3x3 runs: "avx512" or "avx2" (the best this CPU has), or "none" (oneDNN's
// direct convolution). The environment variable FLOTILLA_WINOGRAD_KERNEL (avx512, avx2, none)
// chooses another at the first use, where this CPU runs it.
const char* winograd_kernel();
// Runs `name`'s kernel from now on (for tests and benchmarks); false, and nothing changes,
// where this CPU lacks it.
bool use_winograd_kernel(const std::string& name);

} // namespace flotilla::models
