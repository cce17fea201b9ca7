// The kernel of kernels::hash_dropout (dropout.h). This header includes no other, for the reason
// conv_pool_relu_kernel.h gives: dropout_kernel.inc is compiled once per instruction set into its
// own namespace, and dropout.cpp calls the one this CPU runs.
#pragma once

namespace flotilla::kernels::dropout_kernels {

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

// GELU (x * Phi(x), Phi the standard normal's distribution function) then dropout:
// y[i] = x[i] * Phi(x[i]) * (kept(first + i) ? scale : 0), Phi from Abramowitz and Stegun's
// 7.1.26 for erfc (absolute error below 1.5e-7, the approximation ATen's vectorized erf uses).
// bf16: x and y bfloat16 bits, computed in float and rounded once.
using GeluApply = Apply;
// Its backward: gx[i] = gy[i] * (kept ? scale : 0) * (Phi(x[i]) + x[i] * phi(x[i])), phi the
// normal density; x, gy and gx of one type.
using GeluBackward = void (*)(const void* x, const void* gy, void* gx, long n, bool bf16,
                              unsigned first, const Mask& mask);

struct Kernel {
  Apply apply;
  GeluApply gelu;
  GeluBackward gelu_backward;
};
extern const Kernel kAvx512; // x86-64-v4
extern const Kernel kAvx2;   // x86-64-v3

} // namespace flotilla::kernels::dropout_kernels
