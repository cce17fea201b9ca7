#include <gtest/gtest.h>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <cmath>
#include <string>
#include <vector>

#include "flotilla/error.h"
#include "kernel_choice.h"
#include "models/dropout.h"

namespace flotilla::models {
namespace {

// Each test runs each kernel this CPU has, then leaves the one chosen before.
using Choose = KernelChoice<dropout_kernel, use_dropout_kernel>;
std::vector<std::string> kernels() {
  return Choose::runnable();
}

// Drops a share p of the elements (within 5 standard deviations of a binomial count), scales the
// rest by 1/(1-p) exactly in float32 (and as bfloat16 rounds that product), and drops neighbours
// independently (both of a pair dropped at p^2).
TEST(Dropout, DropsTheShareAskedForAndScalesTheRest) {
  if (kernels().empty()) GTEST_SKIP() << "this CPU has neither AVX-512 nor AVX2: ATen's runs";
  for (const std::string& kernel : kernels()) {
    Choose choose(kernel);
    for (const double p : {0.1, 0.5}) {
      for (const auto type : {torch::kFloat, torch::kBFloat16}) {
        const std::string what = kernel + " p=" + std::to_string(p) + " " + c10::toString(type);
        torch::manual_seed(21);
        const std::int64_t n = 1 << 20;
        const torch::Tensor x = (torch::rand({n}) + 0.5).to(type); // no zeros
        const torch::Tensor y = hash_dropout(x, p, true);
        const torch::Tensor dropped = y == 0;
        const double rate = dropped.to(torch::kDouble).mean().item<double>();
        EXPECT_NEAR(rate, p, 5 * std::sqrt(p * (1 - p) / n)) << what;
        const auto scale = static_cast<float>(1.0 / (1.0 - p));
        const torch::Tensor expected = (x.to(torch::kFloat) * scale).to(type);
        EXPECT_TRUE(torch::equal(y.masked_select(~dropped), expected.masked_select(~dropped)))
            << what;
        const torch::Tensor pairs = dropped.slice(0, 0, n - 1) & dropped.slice(0, 1, n);
        EXPECT_NEAR(pairs.to(torch::kDouble).mean().item<double>(), p * p,
                    5 * std::sqrt(p * p * (1 - p * p) / n))
            << what;
      }
    }
  }
}

// Backward zeroes the same elements and scales the rest, without a stored mask.
TEST(Dropout, BackwardUsesTheForwardsMask) {
  if (kernels().empty()) GTEST_SKIP() << "this CPU has neither AVX-512 nor AVX2: ATen's runs";
  for (const std::string& kernel : kernels()) {
    Choose choose(kernel);
    torch::manual_seed(22);
    const torch::Tensor x = (torch::rand({8, 50, 77}) + 0.5).requires_grad_();
    const torch::Tensor y = hash_dropout(x, 0.3, true);
    const torch::Tensor g = torch::randn_like(x);
    y.backward(g);
    const auto scale = static_cast<float>(1.0 / 0.7);
    EXPECT_TRUE(torch::equal(x.grad(), torch::where(y != 0, g * scale, torch::zeros_like(g))))
        << kernel;
  }
}

// torch::manual_seed repeats it; another seed, or the next call, draws another mask; the thread
// count and the kernel's width do not change it.
TEST(Dropout, TheMaskFollowsTorchsGeneratorNotTheThreadsOrTheKernel) {
  if (kernels().empty()) GTEST_SKIP() << "this CPU has neither AVX-512 nor AVX2: ATen's runs";
  const torch::Tensor x = torch::rand({300001}) + 0.5;
  auto run = [&](std::uint64_t seed, int threads) {
    const int before = at::get_num_threads();
    at::set_num_threads(threads);
    torch::manual_seed(seed);
    const torch::Tensor first = hash_dropout(x, 0.2, true), second = hash_dropout(x, 0.2, true);
    at::set_num_threads(before);
    return std::pair{first, second};
  };
  const auto [a, a_next] = run(5, 1);
  EXPECT_TRUE(torch::equal(a, run(5, 1).first));
  EXPECT_TRUE(torch::equal(a, run(5, 2).first));
  EXPECT_FALSE(torch::equal(a, a_next));
  EXPECT_FALSE(torch::equal(a, run(6, 1).first));
  for (const std::string& kernel : kernels()) {
    Choose choose(kernel);
    EXPECT_TRUE(torch::equal(a, run(5, 2).first)) << kernel;
  }
}

// As torch::dropout: the input itself in evaluation and at p = 0, zeros at p = 1, NaN kept.
TEST(Dropout, EvaluationZeroOneAndNaNAsTorchDropout) {
  const torch::Tensor x = torch::randn({4, 33});
  EXPECT_TRUE(hash_dropout(x, 0.5, false).is_same(x));
  EXPECT_TRUE(hash_dropout(x, 0.0, true).is_same(x));
  EXPECT_EQ(hash_dropout(x, 1.0, true).abs().sum().item<double>(), 0.0);
  torch::Tensor nan = torch::full({1000}, std::nan(""));
  EXPECT_TRUE(hash_dropout(nan, 0.5, true).isnan().all().item<bool>());
  Dropout module(0.25);
  module->eval();
  EXPECT_TRUE(module->forward(x).is_same(x));
  EXPECT_THROW(Dropout(1.5), ConfigError);
  EXPECT_THROW(Dropout(-0.1), ConfigError);
  Choose none("none");
  torch::manual_seed(3);
  const torch::Tensor aten = hash_dropout(x, 0.5, true);
  torch::manual_seed(3);
  EXPECT_TRUE(torch::equal(aten, torch::dropout(x, 0.5, true)));
}

} // namespace
} // namespace flotilla::models
