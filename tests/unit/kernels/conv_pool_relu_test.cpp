#include <gtest/gtest.h>

#include <torch/torch.h>

#include <string>
#include <vector>

#include "flotilla/train/mixed_precision.h"
#include "kernel_choice.h"
#include "flotilla/kernels/conv_pool_relu.h"
#include "flotilla/kernels/compile.h"
#include "models/zoo.h"

namespace flotilla::kernels {
namespace {

namespace nn = torch::nn;

// Each test runs each kernel this CPU has, then leaves the one chosen before.
using Choose = KernelChoice<conv_max_pool2_relu_kernel, use_conv_max_pool2_relu_kernel>;
std::vector<std::string> kernels() {
  return Choose::runnable();
}

struct Result {
  torch::Tensor y, grad_weight, grad_bias;
};

// The layer, or conv2d, relu and max_pool2d from the same weights, forward and backward with
// the same output gradient, under `policy`.
Result run(const torch::Tensor& x, ConvMaxPool2ReLU& layer, bool reference, train::Policy policy,
           const torch::Tensor& grad_seed) {
  const torch::Tensor w = layer->weight.detach().clone().requires_grad_();
  const torch::Tensor b = layer->bias.detach().clone().requires_grad_();
  torch::Tensor y;
  {
    train::AutocastGuard autocast(policy, torch::kCPU);
    if (reference) {
      y = torch::max_pool2d(torch::relu(torch::conv2d(x, w, b, 1, 1)), 2);
    } else {
      ConvMaxPool2ReLU copy(w.size(0));
      copy->weight = w;
      copy->bias = b;
      y = copy->forward(x);
    }
  }
  (y.to(torch::kFloat) * grad_seed).sum().backward();
  return {y.detach(), w.grad(), b.grad()};
}

TEST(ConvMaxPool2ReLU, MatchesConvReLUMaxPoolForwardAndBackward) {
  if (kernels().empty()) GTEST_SKIP() << "this CPU has neither AVX-512 nor AVX2: ATen's ops run";
  for (const std::string& kernel : kernels()) {
    Choose choose(kernel);
    torch::manual_seed(5);
    for (const auto policy : {train::Policy::kFloat32, train::Policy::kMixedBFloat16}) {
      // Even and odd sizes (the last row and column of an odd size are not pooled), 16 and 48
      // channels.
      for (const auto& [shape, channels] : {std::pair{std::vector<std::int64_t>{5, 1, 10, 12}, 16},
                                            std::pair{std::vector<std::int64_t>{3, 1, 9, 7}, 48}}) {
        const std::string what =
            kernel + " " + train::to_string(policy) + " " + c10::str(torch::IntArrayRef(shape));
        ConvMaxPool2ReLU layer(channels);
        const torch::Tensor x = torch::randn(shape);
        const torch::Tensor seed = torch::randn({shape[0], channels, shape[2] / 2, shape[3] / 2});
        const Result fused = run(x, layer, false, policy, seed);
        const Result plain = run(x, layer, true, policy, seed);
        // Channels-last with an NCHW input: the kernel ran, not ATen's ops.
        EXPECT_TRUE(fused.y.is_contiguous(torch::MemoryFormat::ChannelsLast)) << what;
        EXPECT_EQ(fused.y.scalar_type(), plain.y.scalar_type()) << what;
        const bool bf16 = policy == train::Policy::kMixedBFloat16;
        // float32: sums in another order; bfloat16: that, then one rounding to 8 bits.
        EXPECT_LT(relative_difference(fused.y, plain.y), bf16 ? 1e-2 : 1e-6) << what;
        EXPECT_LT(relative_difference(fused.grad_weight, plain.grad_weight), bf16 ? 2e-2 : 1e-5)
            << what;
        EXPECT_LT(relative_difference(fused.grad_bias, plain.grad_bias), bf16 ? 2e-2 : 1e-5)
            << what;
        EXPECT_EQ(fused.grad_weight.scalar_type(), torch::kFloat) << what;
      }
    }
  }
}

// Each lane (output channel) does the same operations in the same order whatever the vector
// width, so the kernels agree to the bit: a CPU with AVX2 alone trains as one with AVX-512.
TEST(ConvMaxPool2ReLU, TheAvx2AndAvx512KernelsAgreeBitForBit) {
  if (kernels().size() < 2) GTEST_SKIP() << "this CPU lacks AVX-512: one kernel to compare";
  torch::manual_seed(9);
  for (const auto policy : {train::Policy::kFloat32, train::Policy::kMixedBFloat16}) {
    ConvMaxPool2ReLU layer(48);
    const torch::Tensor x = torch::randn({4, 1, 12, 10});
    const torch::Tensor seed = torch::randn({4, 48, 6, 5});
    std::vector<Result> results;
    for (const std::string& kernel : kernels()) {
      Choose choose(kernel);
      results.push_back(run(x, layer, false, policy, seed));
    }
    const std::string what = train::to_string(policy);
    EXPECT_TRUE(torch::equal(results[0].y, results[1].y)) << what;
    EXPECT_TRUE(torch::equal(results[0].grad_weight, results[1].grad_weight)) << what;
    EXPECT_TRUE(torch::equal(results[0].grad_bias, results[1].grad_bias)) << what;
  }
}

TEST(ConvMaxPool2ReLU, ANaNPixelMakesTheSameOutputsNaNAsConvReLUMaxPool) {
  if (kernels().empty()) GTEST_SKIP() << "this CPU has neither AVX-512 nor AVX2: ATen's ops run";
  for (const std::string& kernel : kernels()) {
    Choose choose(kernel);
    torch::manual_seed(6);
    ConvMaxPool2ReLU layer(16);
    torch::Tensor x = torch::randn({2, 1, 8, 8});
    x[1][0][3][4] = std::nan("");
    const torch::Tensor seed = torch::randn({2, 16, 4, 4});
    const Result fused = run(x, layer, false, train::Policy::kFloat32, seed);
    const Result plain = run(x, layer, true, train::Policy::kFloat32, seed);
    EXPECT_TRUE(torch::equal(fused.y.isnan(), plain.y.isnan()));
    EXPECT_GT(fused.y.isnan().sum().item<int>(), 0);
    EXPECT_TRUE(torch::allclose(fused.y.nan_to_num(0), plain.y.nan_to_num(0), 0, 1e-5)) << kernel;
  }
}

// ATen's ops where the input needs its gradient, or where "none" is chosen: conv2d then
// MaxPool2ReLU, equal to conv2d, relu, max_pool2d.
TEST(ConvMaxPool2ReLU, AnInputThatNeedsItsGradientOrTheKernelNoneRunsATensOps) {
  torch::manual_seed(8);
  ConvMaxPool2ReLU layer(16);
  const torch::Tensor x = torch::randn({2, 1, 6, 6}).requires_grad_();
  const torch::Tensor y = layer->forward(x);
  const torch::Tensor expected =
      torch::max_pool2d(torch::relu(torch::conv2d(x, layer->weight, layer->bias, 1, 1)), 2);
  EXPECT_TRUE(torch::equal(y, expected));
  y.sum().backward();
  ASSERT_TRUE(x.grad().defined());
  EXPECT_GT(x.grad().abs().sum().item<double>(), 0);

  // A backward after "none" was chosen (since its forward ran the kernel) still has a kernel.
  if (!kernels().empty()) {
    ConvMaxPool2ReLU fused(16);
    const torch::Tensor y_fused = fused->forward(x.detach());
    Choose none_now("none");
    y_fused.sum().backward();
    EXPECT_TRUE(fused->weight.grad().defined());
  }

  Choose none("none");
  EXPECT_STREQ(conv_max_pool2_relu_kernel(), "none");
  EXPECT_TRUE(torch::equal(layer->forward(x.detach()), expected));
  EXPECT_FALSE(use_conv_max_pool2_relu_kernel("avx3"));
  EXPECT_STREQ(conv_max_pool2_relu_kernel(), "none");
}

// The zoo's CNN, compiled, against the same layers as PyTorch's twin writes them, from the same
// weights:
// the same names and, after SGD steps, the same weights within float rounding, float32 and
// under bfloat16 autocast, channels-last as compile() keeps a CNN.
TEST(ConvMaxPool2ReLU, TheZooCnnTrainsAsConvReLUMaxPool) {
  for (const auto policy : {train::Policy::kFloat32, train::Policy::kMixedBFloat16}) {
    torch::manual_seed(7);
    KernelMode fixed(Mode::kFixed);
    nn::Sequential fused = models::make_model("cnn");
    compile(*fused); // its first layers as ConvMaxPool2ReLU, the second "ReLU, max-pool" one
    ASSERT_TRUE(fused->ptr<ConvMaxPool2ReLUImpl>(0));
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
    const auto initial = plain->named_parameters()["0.weight"].clone();
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
    const bool bf16 = policy == train::Policy::kMixedBFloat16;
    for (const auto& p : fused->named_parameters()) {
      EXPECT_LT(relative_difference(p.value(), plain_params[p.key()]), bf16 ? 1e-2 : 1e-5)
          << p.key() << " under " << train::to_string(policy);
    }
    // Control: the steps moved the first layer's weights well beyond that.
    EXPECT_GT(relative_difference(plain_params["0.weight"], initial), 1e-2);
  }
}

} // namespace
} // namespace flotilla::kernels
