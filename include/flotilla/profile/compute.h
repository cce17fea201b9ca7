// What a model's step asks of the processor and what the processor can give, for the doctor's
// "compute" item: the share of this machine's matrix-product peak a training run reached.
#pragma once

#include <c10/core/ScalarType.h>

#include <functional>

namespace flotilla::profile {

// The floating-point operations of the products `run` computes on the calling thread, counted
// from the operators' input shapes as LibTorch records them (RecordFunction): convolutions
// (aten::convolution), matrix products (mm, addmm, bmm, baddbmm) and fused attention (Q K^T and
// the weights times V); a multiply-add counts 2, and a counted operator inside another (autocast
// calling addmm again, a math attention's bmm) is not counted twice. Normalisations,
// activations and elementwise kernels count nothing. Run a forward pass: backward kernels are
// not counted.
double counted_flops(const std::function<void()>& run);

// The rate of a 1024 x 1024 matrix product in `dtype` with LibTorch's current threads, in
// GFLOP/s: the median of 7 timings after 3 untimed.
double matmul_peak_gflops(c10::ScalarType dtype);

} // namespace flotilla::profile
