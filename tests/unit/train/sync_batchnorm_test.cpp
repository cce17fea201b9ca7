// SyncBatchNorm alone (one replica) must be BatchNorm: the same outputs, gradients and running
// statistics. The cross-replica cases are in tests/multiworker/batchnorm_test.cpp.
#include <gtest/gtest.h>

#include <torch/nn.h>

#include "flotilla/error.h"
#include "flotilla/train/sync_batchnorm.h"

namespace flotilla::train {
namespace {

double max_difference(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

TEST(SyncBatchNorm, AloneItIsBatchNormInTrainingAndEvaluation) {
  torch::manual_seed(7);
  torch::nn::BatchNorm2d plain(torch::nn::BatchNormOptions(5).momentum(0.2));
  {
    torch::NoGradGuard no_grad;
    plain->weight.uniform_(0.5, 1.5);
    plain->bias.uniform_(-0.5, 0.5);
  }
  torch::nn::Sequential net(plain);
  auto sync = convert_sync_batchnorm(net);
  for (int step = 0; step < 3; ++step) {
    const auto x = (torch::randn({6, 5, 4, 3}) * 3 + 2).requires_grad_();
    const auto x2 = x.detach().clone().requires_grad_();
    const auto g = torch::randn({6, 5, 4, 3});
    const auto y = net->forward(x);
    const auto y2 = sync->forward(x2);
    EXPECT_LT(max_difference(y, y2), 1e-5) << step;
    (y * g).sum().backward();
    (y2 * g).sum().backward();
    EXPECT_LT(max_difference(x.grad(), x2.grad()), 1e-5) << step;
  }
  const auto& p = net->named_parameters();
  const auto& q = sync->named_parameters();
  for (const auto& name : {"0.weight", "0.bias"}) {
    EXPECT_LT(max_difference(p[name].grad(), q[name].grad()), 1e-4) << name;
  }
  const auto& b = net->named_buffers();
  const auto& c = sync->named_buffers();
  EXPECT_LT(max_difference(b["0.running_mean"], c["0.running_mean"]), 1e-6);
  EXPECT_LT(max_difference(b["0.running_var"], c["0.running_var"]), 1e-5);
  EXPECT_EQ(c["0.num_batches_tracked"].item<std::int64_t>(), 3);
  net->eval();
  sync->eval();
  const auto x = torch::randn({2, 5, 4, 3});
  // The running statistics above differ in the last bits (E[x²] - E[x]² against Welford).
  EXPECT_LT(max_difference(net->forward(x), sync->forward(x)), 1e-5);
  {
    torch::NoGradGuard no_grad;
    c["0.running_mean"].copy_(b["0.running_mean"]);
    c["0.running_var"].copy_(b["0.running_var"]);
  }
  EXPECT_TRUE(torch::equal(net->forward(x), sync->forward(x))); // then the same kernel
}

TEST(SyncBatchNorm, ABatchNormInsideAModuleOfYourOwnIsNamedNotSilentlyMissed) {
  struct BlockImpl : torch::nn::Cloneable<BlockImpl> {
    BlockImpl() { reset(); }
    void reset() override { bn = register_module("bn", torch::nn::BatchNorm2d(3)); }
    torch::Tensor forward(const torch::Tensor& x) { return bn->forward(x); }
    torch::nn::BatchNorm2d bn{nullptr};
  };
  torch::nn::Sequential net(torch::nn::Conv2d(1, 3, 3), std::make_shared<BlockImpl>());
  try {
    convert_sync_batchnorm(net);
    FAIL() << "converted a BatchNorm it cannot reach";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("the BatchNorm at \"1.bn\" belongs to"), std::string::npos)
        << e.what();
  }
}

TEST(SyncBatchNorm, WrongInputAndATooSmallBatchAreClearErrors) {
  SyncBatchNorm bn(4);
  EXPECT_THROW(bn->forward(torch::randn({2, 3, 5})), ConfigError);
  try {
    bn->forward(torch::randn({1, 4}));
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("more than 1 value per channel"), std::string::npos);
  }
}

} // namespace
} // namespace flotilla::train
