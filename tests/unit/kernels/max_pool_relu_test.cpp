#include <gtest/gtest.h>

#include <torch/torch.h>

#include "flotilla/error.h"
#include "flotilla/kernels/max_pool_relu.h"

namespace flotilla::kernels {
namespace {

// Equal element for element, NaN where the other is NaN.
void expect_same(const torch::Tensor& a, const torch::Tensor& b, const std::string& what) {
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  EXPECT_TRUE(torch::equal(a.isnan(), b.isnan())) << what;
  EXPECT_TRUE(torch::equal(a.nan_to_num(0), b.nan_to_num(0))) << what;
}

// Inputs with ties, zeros, negative windows and a NaN: values on a grid of halves.
torch::Tensor tricky_input(torch::IntArrayRef shape, torch::Dtype dtype,
                           torch::MemoryFormat format) {
  torch::Tensor x = (torch::randn(shape) * 2).round() / 2;
  x.view(-1)[5] = std::nan("");
  return x.to(dtype).contiguous(format);
}

TEST(MaxPool2ReLU, EqualsReLUThenMaxPoolForwardAndBackward) {
  torch::manual_seed(3);
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    for (const auto format : {torch::MemoryFormat::Contiguous, torch::MemoryFormat::ChannelsLast}) {
      for (const std::vector<std::int64_t> shape : {std::vector<std::int64_t>{3, 5, 8, 6},
                                                    std::vector<std::int64_t>{2, 4, 7, 9}}) {
        const std::string what = std::string(c10::toString(dtype)) +
                                 (format == torch::MemoryFormat::ChannelsLast ? " NHWC " : " NCHW ") +
                                 c10::str(torch::IntArrayRef(shape));
        const torch::Tensor x = tricky_input(shape, dtype, format);
        const torch::Tensor fused_in = x.clone().requires_grad_();
        const torch::Tensor plain_in = x.clone().requires_grad_();
        const torch::Tensor fused = max_pool2_relu(fused_in);
        const torch::Tensor plain = torch::max_pool2d(torch::relu(plain_in), 2);
        expect_same(fused, plain, what + " forward");
        EXPECT_EQ(fused.suggest_memory_format(), plain.suggest_memory_format()) << what;
        const torch::Tensor grad = torch::randn(plain.sizes()).to(dtype);
        fused.backward(grad);
        plain.backward(grad);
        expect_same(fused_in.grad(), plain_in.grad(), what + " gradient");
        // Without a gradient to keep: the same values.
        torch::NoGradGuard no_grad;
        expect_same(max_pool2_relu(x), plain.detach(), what + " no_grad");
      }
    }
  }
}

TEST(MaxPool2ReLU, RefusesImagesSmallerThanAWindow) {
  try {
    max_pool2_relu(torch::zeros({2, 3, 1, 8}));
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("[2, 3, 1, 8]"), std::string::npos) << e.what();
  }
}

} // namespace
} // namespace flotilla::kernels
