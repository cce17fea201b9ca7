// Dropout (training: each element zeroed with probability p, the rest scaled by 1/(1-p);
// evaluation: the input itself), as torch::nn::Dropout computes it, with its own random numbers:
// on a CPU with AVX-512 or AVX2, for contiguous float32 or bfloat16 tensors, element i is
// dropped where a 32-bit hash of i and a seed drawn from LibTorch's default CPU generator falls
// below p * 2^32. One pass each way, and nothing stored for backward (it hashes the same
// indices again), where ATen draws a Bernoulli mask one element at a time, multiplies by it and
// keeps it. torch::manual_seed makes it repeat; the masks differ from ATen's (other random
// numbers, the same distribution: dropout_test.cpp). Elsewhere (another device or type, p = 1,
// 2^32 elements or more), and where ATen's measured faster (choice.h), it runs torch::dropout.
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <ostream>
#include <string>

namespace flotilla::kernels {

torch::Tensor hash_dropout(const torch::Tensor& x, double p, bool training);

// hash_dropout(torch::gelu(x), p, training) (the exact GELU, x * Phi(x)) in one pass each way,
// with the same masks, for contiguous float32 or bfloat16 CPU tensors where a kernel runs:
// ViT's MLP. Phi from the approximation ATen's vectorized erf uses (absolute error below
// 1.5e-7); a bfloat16 result rounded once, where ATen rounds the GELU and then the product.
// One pass each way where GELU then dropout make two each way: forward reads the input and
// writes the result; backward reads the saved input and the gradient and writes the input's
// gradient. Elsewhere the two operations, as written above.
torch::Tensor gelu_dropout(const torch::Tensor& x, double p, bool training);

class DropoutImpl : public torch::nn::Cloneable<DropoutImpl> {
 public:
  // ConfigError unless 0 <= p <= 1.
  explicit DropoutImpl(double p);
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) { return hash_dropout(x, p, is_training()); }
  void pretty_print(std::ostream& stream) const override;

  double p;
};
TORCH_MODULE(Dropout);

// GELU (exact) then Dropout(p) as one layer (gelu_dropout): the compile step's swap for a
// Sequential's GELU followed by a Dropout.
class GeluDropoutImpl : public torch::nn::Cloneable<GeluDropoutImpl> {
 public:
  // ConfigError unless 0 <= p <= 1.
  explicit GeluDropoutImpl(double p);
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) { return gelu_dropout(x, p, is_training()); }
  void pretty_print(std::ostream& stream) const override;

  double p;
};
TORCH_MODULE(GeluDropout);

// The instruction set dropout's kernel runs: "avx512" or "avx2" (the best this CPU has), or "none" (ATen's
// torch::dropout). The environment variable FLOTILLA_DROPOUT_KERNEL (avx512, avx2, none)
// chooses another at the first use, where this CPU runs it.
const char* dropout_kernel();
// Runs `name`'s kernel from now on (for tests and benchmarks); false, and nothing changes,
// where this CPU lacks it.
bool use_dropout_kernel(const std::string& name);

} // namespace flotilla::kernels
