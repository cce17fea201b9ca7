#include <gtest/gtest.h>

#include <torch/torch.h>

#include <string>

#include "flotilla/train/mixed_precision.h"
#include "flotilla/kernels/attention.h"

namespace flotilla::kernels {
namespace {

// ATen's math attention, its output arranged as attention()'s: [N, L, H * D].
torch::Tensor math_attention(const torch::Tensor& q, const torch::Tensor& k,
                             const torch::Tensor& v) {
  const auto out = std::get<0>(at::_scaled_dot_product_attention_math(q, k, v));
  return out.transpose(1, 2).reshape({q.size(0), q.size(2), q.size(1) * q.size(3)});
}

struct Result {
  torch::Tensor out, dq, dk, dv;
};

// Output and input gradients of `f` at views of one QKV projection, as ViT makes them: queries,
// keys and values [N, H, L, D] permuted out of [N, L, 3, H, D].
template <typename F>
Result run(F f, const torch::Tensor& qkv_values, const torch::Tensor& grad) {
  const torch::Tensor qkv = qkv_values.detach().requires_grad_();
  const auto heads = qkv.permute({2, 0, 3, 1, 4});
  const torch::Tensor out = f(heads[0], heads[1], heads[2]);
  out.backward(grad);
  const auto g = qkv.grad().permute({2, 0, 3, 1, 4});
  return {out.detach(), g[0], g[1], g[2]};
}

// float32: ATen's math attention within float rounding (the same products and sums; the scale
// applied once to Q K^T instead of to Q and K by its square root), forward and backward, and
// float64 within 1e-12 (the same computation in either type).
TEST(Attention, EqualsATensMathAttention) {
  torch::manual_seed(5);
  const std::int64_t n = 3, l = 7, h = 2, d = 16;
  for (const auto type : {torch::kFloat, torch::kDouble}) {
    const torch::Tensor qkv = torch::randn({n, l, 3, h, d}, type) * 2;
    const torch::Tensor grad = torch::randn({n, l, h * d}, type);
    const Result ours = run(attention, qkv, grad), math = run(math_attention, qkv, grad);
    const double tolerance = type == torch::kFloat ? 2e-6 : 1e-12;
    const std::string what = c10::toString(type);
    EXPECT_EQ(ours.out.scalar_type(), type);
    EXPECT_EQ(ours.out.sizes(), (std::vector<std::int64_t>{n, l, h * d}));
    EXPECT_TRUE(torch::allclose(ours.out, math.out, tolerance, tolerance)) << what;
    EXPECT_TRUE(torch::allclose(ours.dq, math.dq, tolerance, tolerance)) << what;
    EXPECT_TRUE(torch::allclose(ours.dk, math.dk, tolerance, tolerance)) << what;
    EXPECT_TRUE(torch::allclose(ours.dv, math.dv, tolerance, tolerance)) << what;
  }
}

// bfloat16 inputs, under autocast as in training: bfloat16 out and back, within a few bfloat16
// roundings of the same attention computed in float32 from the same values (its matmuls'
// products rounded to bfloat16: 2^-8 relative each); bfloat16's two roundings of 1.5 are 2^-6.
TEST(Attention, ComputesBFloat16InputsWithinBFloat16RoundingOfFloat32) {
  torch::manual_seed(6);
  const std::int64_t n = 2, l = 50, h = 3, d = 64;
  const torch::Tensor qkv = torch::randn({n, l, 3, h, d}).to(torch::kBFloat16);
  const torch::Tensor grad = torch::randn({n, l, h * d}).to(torch::kBFloat16);
  const train::AutocastGuard autocast(train::Policy::kMixedBFloat16, torch::kCPU);
  const Result ours = run(attention, qkv, grad);
  const Result exact = run(attention, qkv.to(torch::kFloat), grad.to(torch::kFloat));
  EXPECT_EQ(ours.out.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(ours.dq.scalar_type(), torch::kBFloat16);
  const auto error = [](const torch::Tensor& a, const torch::Tensor& b) {
    return ((a.to(torch::kFloat) - b).abs().max() / b.abs().max()).item<double>();
  };
  EXPECT_LT(error(ours.out, exact.out), 1.0 / 64);
  EXPECT_LT(error(ours.dq, exact.dq), 1.0 / 64);
  EXPECT_LT(error(ours.dk, exact.dk), 1.0 / 64);
  EXPECT_LT(error(ours.dv, exact.dv), 1.0 / 64);
}

} // namespace
} // namespace flotilla::kernels
