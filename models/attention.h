// Scaled dot-product attention for ViT: softmax(Q K^T / sqrt(D)) V over [N, H, L, D] queries,
// keys and values, the heads' outputs returned side by side, [N, L, H * D] (what the output
// projection takes). On CUDA ATen's scaled_dot_product_attention (its fused kernels). On the CPU
// the computation of ATen's math attention (in float32 for bfloat16 or float16 inputs, as it
// does, the result in the inputs' type), with two passes fewer: the scale applied inside the
// first batched matmul instead of multiplying Q and K by its square root, and a plain softmax
// instead of the math path's "safe" one, whose checks for rows that are all -inf (a mask's
// concern; this attention has no mask) took 3% of ViT-tiny's float32 step. Autocast does not
// change its types. ATen's flash attention for the CPU is slower at ViT-tiny's 50 tokens:
// 29.4 ms forward and backward for a block's 64 images in bfloat16 against the math path's 12.7.
#pragma once

#include <torch/types.h>

namespace flotilla::models {

torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v);

} // namespace flotilla::models
