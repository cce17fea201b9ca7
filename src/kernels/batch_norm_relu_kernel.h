// The kernels of batch_norm_relu (batch_norm_relu.h) over rows of a channels-last tensor: each
// row is one pixel's C channels (C a multiple of 16), as floats or as bfloat16 bits (`bf16`).
// This header includes no other, for the reason conv_pool_relu_kernel.h gives:
// batch_norm_relu_kernel.inc is compiled once per instruction set into its own namespace, and
// batch_norm_relu.cpp calls the one this CPU runs. Sums run in double, over runs of 16 rows summed
// in float.
#pragma once

namespace flotilla::kernels::batch_norm_relu_kernels {

struct Rows {
  const void* x; // [rows][channels]
  long rows, channels;
  bool bf16;
};

// Adds, per channel, the sum of (x - origin) and of its square into `sum` and `squares`.
using Statistics = void (*)(const Rows& x, const float* origin, double* sum, double* squares);
// y = min(max(x * scale + shift (+ residual), 0), ceiling) per channel, NaN kept (ceiling:
// infinity for ReLU, 6 for ReLU6); with bfloat16 the normalized value is rounded before the
// residual is added and the sum after, as the separate operations round. `residual` (rows like
// x) may be null.
using Normalize = void (*)(const Rows& x, const void* residual, const float* scale,
                           const float* shift, float ceiling, void* y);
// With g = gy where 0 < y < ceiling, else 0: adds, per channel, the sum of g and of
// g * (x - mean).
using BackwardSums = void (*)(const Rows& x, const void* y, const void* gy, const float* mean,
                              float ceiling, double* sum_g, double* sum_gx);
// gx = g * scale + (x - mean) * slope + offset per channel; where `g_residual` is not null, g
// itself is written there too (the residual's gradient).
using BackwardInput = void (*)(const Rows& x, const void* y, const void* gy, const float* mean,
                               const float* scale, const float* slope, const float* offset,
                               float ceiling, void* gx, void* g_residual);

struct Kernel {
  Statistics statistics;
  Normalize normalize;
  BackwardSums backward_sums;
  BackwardInput backward_input;
};
extern const Kernel kAvx512;     // x86-64-v4
extern const Kernel kAvx512Bf16; // x86-64-v4 with AVX512_BF16: rounds to bfloat16 with it
extern const Kernel kAvx2;       // x86-64-v3

} // namespace flotilla::kernels::batch_norm_relu_kernels
