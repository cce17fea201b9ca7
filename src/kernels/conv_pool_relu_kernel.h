// The fused kernels of ConvMaxPool2ReLU (conv_pool_relu.h), one image at a time. This header
// includes no other (no inline function of a library can be compiled here for a wider
// instruction set than the rest of the program uses): conv_pool_relu_kernel.inc is compiled once
// per instruction set (x86-64-v4: AVX-512; x86-64-v3: AVX2 and FMA) into its own namespace, and
// conv_pool_relu.cpp calls the one this CPU runs.
#pragma once

namespace flotilla::kernels::conv_pool_relu {

// One image: `padded` is its (H+2)×(W+2) pixels with a zero border, as floats; `weights` is
// [9][C] (tap kh*3+kw, then output channel), `bias` [C], C a multiple of 16.
struct Image {
  const float* padded;
  long h, w, channels;
};

// Writes the pooled [H/2][W/2][C] output (floats, or bfloat16 bits when `bf16`: each convolution
// output rounded to bfloat16 before the pooling compares them) and a code per output: the window
// position of its maximum (0..3, row order), or 4 where ReLU passed no gradient.
using Forward = void (*)(const Image& image, const float* weights, const float* bias, void* y,
                         unsigned char* code, bool bf16);
// Adds the image's gradients of the weights ([9][C]) and bias ([C]) for `gy` ([H/2][W/2][C]
// floats, or bfloat16 bits when `bf16`) into `grad_weights` and `grad_bias`.
using Backward = void (*)(const Image& image, const void* gy, bool bf16, const unsigned char* code,
                          float* grad_weights, float* grad_bias);

// One instruction set's pair, defined by conv_pool_relu_kernel.inc.
struct Kernel {
  Forward forward;
  Backward backward;
};
extern const Kernel kAvx512; // x86-64-v4
extern const Kernel kAvx2;   // x86-64-v3

} // namespace flotilla::kernels::conv_pool_relu
