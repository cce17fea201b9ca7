#include <gtest/gtest.h>

#include <torch/torch.h>

#include "flotilla/error.h"
#include "flotilla/train/mixed_precision.h"
#include "models/max_pool_relu.h"
#include "models/zoo.h"

namespace flotilla::models {
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

// The zoo's CNN (fused) against the same layers as PyTorch's twin writes them (ReLU, then
// max-pool), from the same weights: the same names, and after SGD steps the same weights,
// float32 and under bfloat16 autocast, channels-last as compile() keeps a CNN.
TEST(MaxPool2ReLU, TheZooCnnTrainsBitForBitAsReLUThenMaxPool) {
  namespace nn = torch::nn;
  for (const auto policy : {train::Policy::kFloat32, train::Policy::kMixedBFloat16}) {
    torch::manual_seed(7);
    nn::Sequential fused = make_model("cnn");
    nn::Sequential plain(nn::Conv2d(nn::Conv2dOptions(1, 32, 3).padding(1)), nn::ReLU(),
                         nn::MaxPool2d(2), nn::Conv2d(nn::Conv2dOptions(32, 64, 3).padding(1)),
                         nn::ReLU(), nn::MaxPool2d(2), nn::Flatten(), nn::Linear(3136, 128),
                         nn::ReLU(), nn::Linear(128, 10));
    {
      torch::NoGradGuard no_grad;
      auto from = fused->named_parameters();
      for (auto& p : plain->named_parameters()) {
        ASSERT_TRUE(from.contains(p.key())) << p.key();
        p.value().copy_(from[p.key()]);
      }
      ASSERT_EQ(from.size(), plain->named_parameters().size());
    }
    for (auto* net : {&fused, &plain}) {
      torch::NoGradGuard no_grad;
      for (auto& p : (*net)->parameters()) {
        if (p.dim() == 4) p.set_data(p.contiguous(torch::MemoryFormat::ChannelsLast));
      }
    }
    torch::optim::SGD fused_sgd(fused->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD plain_sgd(plain->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int step = 0; step < 4; ++step) {
      const torch::Tensor x =
          torch::randn({16, 1, 28, 28}).contiguous(torch::MemoryFormat::ChannelsLast);
      const torch::Tensor y = torch::randint(0, 10, {16});
      for (auto [net, sgd] : {std::pair{fused, &fused_sgd}, std::pair{plain, &plain_sgd}}) {
        sgd->zero_grad();
        torch::Tensor loss;
        {
          train::AutocastGuard autocast(policy, torch::kCPU);
          loss = torch::nn::functional::cross_entropy(net->forward(x), y);
        }
        loss.backward();
        sgd->step();
      }
    }
    const auto plain_params = plain->named_parameters();
    for (const auto& p : fused->named_parameters()) {
      EXPECT_TRUE(torch::equal(p.value(), plain_params[p.key()]))
          << p.key() << " under " << train::to_string(policy);
    }
  }
}

} // namespace
} // namespace flotilla::models
