#include <gtest/gtest.h>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <cmath>
#include <string>
#include <vector>

#include "flotilla/error.h"
#include "kernel_choice.h"
#include "flotilla/kernels/dropout.h"

namespace flotilla::kernels {
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

// Each element's factor (0, or 1/(1-p)) in the mask the next draw from `seed` makes.
torch::Tensor factors(std::uint64_t seed, at::IntArrayRef sizes, double p) {
  torch::manual_seed(seed);
  return hash_dropout(torch::ones(sizes, torch::kDouble).to(torch::kFloat), p, true)
      .to(torch::kDouble);
}

// GELU then dropout in one: the exact GELU (float64's, erf from the C library) times the mask
// hash_dropout draws from the same seed, within the approximation's 1.5e-7 of erfc (times |x|
// and the scale) and float's rounding; bfloat16 within one rounding of that; backward the
// float64 GELU's gradient through the same mask. Sizes with a tail shorter than a vector.
TEST(GeluDropout, IsTheExactGeluThenTheSameMask) {
  if (kernels().empty()) GTEST_SKIP() << "this CPU has neither AVX-512 nor AVX2: ATen's runs";
  for (const std::string& kernel : kernels()) {
    Choose choose(kernel);
    for (const auto type : {torch::kFloat, torch::kBFloat16}) {
      const std::string what = kernel + " " + c10::toString(type);
      const std::vector<std::int64_t> sizes = {3, 7, 101};
      torch::manual_seed(30);
      const torch::Tensor x = (torch::randn(sizes) * 4).to(type).requires_grad_();
      const torch::Tensor g = torch::randn(sizes).to(type);
      const double p = 0.3, scale = 1 / (1 - p);
      torch::manual_seed(31);
      const torch::Tensor y = gelu_dropout(x, p, true);
      y.backward(g);
      const torch::Tensor factor = factors(31, sizes, p);
      const torch::Tensor x64 = x.detach().to(torch::kDouble).requires_grad_();
      const torch::Tensor expected = torch::gelu(x64) * factor;
      expected.backward(g.to(torch::kDouble));
      const double rounding = type == torch::kFloat ? 2e-7 : 1.0 / 256;
      const torch::Tensor error = (y.detach().to(torch::kDouble) - expected).abs();
      EXPECT_TRUE((error <= scale * 2e-7 * x64.detach().abs() + rounding * expected.abs().detach())
                      .all()
                      .item<bool>())
          << what << ": " << error.max().item<double>();
      // Dropped exactly where the mask drops (in float32 no kept GELU here rounds to 0).
      if (type == torch::kFloat) EXPECT_TRUE(torch::equal(y.detach() == 0, factor == 0)) << what;
      const torch::Tensor grad_error = (x.grad().to(torch::kDouble) - x64.grad()).abs();
      EXPECT_TRUE((grad_error <= scale * 3e-7 * (1 + x64.detach().abs()) * g.to(torch::kDouble).abs() +
                                     rounding * x64.grad().abs())
                      .all()
                      .item<bool>())
          << what << ": " << grad_error.max().item<double>();
    }
  }
}

// The AVX2 and AVX-512 kernels compute each element with the same operations in the same order:
// the same bits, forward and backward.
TEST(GeluDropout, TheKernelsAgreeBitForBit) {
  if (kernels().size() < 2) GTEST_SKIP() << "this CPU runs one kernel";
  std::vector<torch::Tensor> results;
  for (const std::string& kernel : kernels()) {
    Choose choose(kernel);
    for (const auto type : {torch::kFloat, torch::kBFloat16}) {
      torch::manual_seed(32);
      const torch::Tensor x = (torch::randn({5, 1003}) * 3).to(type).requires_grad_();
      const torch::Tensor y = gelu_dropout(x, 0.1, true);
      y.backward(torch::ones_like(y));
      results.push_back(y.detach());
      results.push_back(x.grad());
    }
  }
  for (std::size_t i = 0; i < results.size() / 2; ++i) {
    EXPECT_TRUE(torch::equal(results[i], results[i + results.size() / 2])) << i;
  }
}

// Evaluation and p = 0: the GELU alone, without a draw from the generator; NaN stays NaN;
// without a kernel ("none") ATen's GELU then hash_dropout's (ATen's) dropout, bit for bit.
TEST(GeluDropout, EvaluationNaNAndATensPath) {
  torch::manual_seed(33);
  const torch::Tensor x = torch::randn({4, 333}) * 3;
  for (const bool training : {false, true}) {
    torch::manual_seed(34);
    const torch::Tensor y = gelu_dropout(x, training ? 0.0 : 0.5, training);
    const torch::Tensor next = torch::rand({4});
    torch::manual_seed(34);
    EXPECT_TRUE(torch::equal(next, torch::rand({4}))) << training;
    EXPECT_TRUE(torch::allclose(y, torch::gelu(x), 1e-6, 1e-6)) << training;
  }
  EXPECT_TRUE(gelu_dropout(torch::full({100}, std::nan("")), 0.5, true).isnan().all().item<bool>());
  Choose none("none");
  torch::manual_seed(35);
  const torch::Tensor aten = gelu_dropout(x, 0.5, true);
  torch::manual_seed(35);
  EXPECT_TRUE(torch::equal(aten, torch::dropout(torch::gelu(x), 0.5, true)));
}

} // namespace
} // namespace flotilla::kernels
