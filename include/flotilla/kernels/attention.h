// Scaled dot-product attention for ViT: softmax(Q K^T / sqrt(D)) V over [N, H, L, D] queries,
// keys and values, the heads' outputs returned side by side, [N, L, H * D] (what the output
// projection takes). On CUDA ATen's scaled_dot_product_attention (its fused kernels). On the CPU
// two batched matmuls and a softmax in the inputs' type, as PyTorch's nn.MultiheadAttention
// computes them when asked for its weights: under bf16 autocast the matmuls in bfloat16 (float
// sums), the softmax's sums in float. ATen's math attention computes bfloat16 inputs in float32;
// its "safe" softmax checks for rows that are all -inf (a mask's concern; this attention has
// none), which took 3% of ViT-tiny's float32 step, and it multiplies Q and K by the scale's
// square root where this scales inside the first matmul. bench_attention, a block's 64 images,
// forward and backward, one thread: 7.4 ms in bfloat16 against the math path's 12.0 and flash
// attention's 32.2; in float32 13.5 against 15.1 and 12.8 (flash attention is faster there).
// So on the CPU, at each shape, whichever of this and ATen's scaled_dot_product_attention
// measured faster runs (choice.h).
#pragma once

#include <torch/types.h>

namespace flotilla::kernels {

torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v);

} // namespace flotilla::kernels
