#include <gtest/gtest.h>

#include <torch/torch.h>

#include <string>

#include "flotilla/train/mixed_precision.h"
#include "models/attention.h"

namespace flotilla::models {
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

// bfloat16 inputs, under autocast as in training: computed in float32 as the math path does, the
// result rounded once to bfloat16: ATen's math attention within one bfloat16 rounding (2^-8
// relative), and its gradients as close.
TEST(Attention, ComputesBFloat16InFloat32AsTheMathPath) {
  torch::manual_seed(6);
  const std::int64_t n = 2, l = 50, h = 3, d = 64;
  const torch::Tensor qkv = torch::randn({n, l, 3, h, d}).to(torch::kBFloat16);
  const torch::Tensor grad = torch::randn({n, l, h * d}).to(torch::kBFloat16);
  const train::AutocastGuard autocast(train::Policy::kMixedBFloat16, torch::kCPU);
  const Result ours = run(attention, qkv, grad), math = run(math_attention, qkv, grad);
  EXPECT_EQ(ours.out.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(ours.dq.scalar_type(), torch::kBFloat16);
  const auto close = [](const torch::Tensor& a, const torch::Tensor& b) {
    return torch::allclose(a.to(torch::kFloat), b.to(torch::kFloat), 1.0 / 128, 1.0 / 128);
  };
  EXPECT_TRUE(close(ours.out, math.out));
  EXPECT_TRUE(close(ours.dq, math.dq));
  EXPECT_TRUE(close(ours.dk, math.dk));
  EXPECT_TRUE(close(ours.dv, math.dv));
  // Not computed in bfloat16: the float32 inputs' attention rounds to within one rounding.
  const Result exact = run(attention, qkv.to(torch::kFloat), grad.to(torch::kFloat));
  EXPECT_TRUE(torch::allclose(ours.out.to(torch::kFloat), exact.out, 1.0 / 256, 1e-6));
}

} // namespace
} // namespace flotilla::models
