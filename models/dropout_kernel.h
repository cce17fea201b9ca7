// The kernel of models::dropout (dropout.h). This header includes no other, for the reason
// conv_pool_relu_kernel.h gives: dropout_kernel.inc is compiled once per instruction set into its
// own namespace, and dropout.cpp calls the one this CPU runs.
#pragma once

namespace flotilla::models::dropout_kernels {

// Which elements are kept: element i (its index in the whole tensor) is dropped where
// hash(i) < `threshold`, hash(i) = mix(mix(i ^ seed_a) + seed_b) with a 32-bit bijective mixer,
// the same on every instruction set, so forward and backward (and any thread count) agree.
struct Mask {
  unsigned seed_a, seed_b, threshold;
  float scale; // 1 / (1 - p)
};

// y[i] = x[i] * (kept(first + i) ? scale : 0) for n elements, floats or bfloat16 bits (`bf16`;
// the product rounded to nearest even). A NaN or infinite x stays NaN where dropped, as ATen's
// product with its mask does.
using Apply = void (*)(const void* x, void* y, long n, bool bf16, unsigned first, const Mask& mask);

struct Kernel {
  Apply apply;
};
extern const Kernel kAvx512; // x86-64-v4
extern const Kernel kAvx2;   // x86-64-v3

} // namespace flotilla::models::dropout_kernels
