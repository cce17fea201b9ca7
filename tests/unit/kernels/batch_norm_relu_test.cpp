#include <gtest/gtest.h>

#include <torch/torch.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "flotilla/error.h"
#include "flotilla/train/mixed_precision.h"
#include "flotilla/kernels/batch_norm_relu.h"
#include "flotilla/kernels/compile.h"
#include "flotilla/kernels/winograd.h"
#include "kernel_choice.h"
#include "kernels/batch_norm_relu_kernel.h"
#include "kernels/cpu.h"
#include "models/zoo.h"

namespace flotilla::kernels {
namespace {

namespace nn = torch::nn;
const auto kChannelsLast = torch::MemoryFormat::ChannelsLast;

// Each test runs each kernel this CPU has, then leaves the one chosen before.
using Choose = KernelChoice<batch_norm_relu_kernel, use_batch_norm_relu_kernel>;
std::vector<std::string> kernels() {
  return Choose::runnable();
}

struct Result {
  torch::Tensor y, gx, gw, gb, gr, running_mean, running_var, batches;
};

// One training step of relu(bn(x) [+ r]) from `bn`'s state: fused, or as the module's forward,
// the add and torch::relu.
Result step(const nn::BatchNorm2d& bn, const torch::Tensor& input, const torch::Tensor& res,
            bool fused, const torch::Tensor& seed, bool training = true,
            std::optional<double> ceiling = std::nullopt) {
  auto copy = std::dynamic_pointer_cast<nn::BatchNorm2dImpl>(bn->clone());
  copy->train(training);
  const torch::Tensor x = input.detach().clone(kChannelsLast).requires_grad_();
  torch::Tensor r;
  if (res.defined()) r = res.detach().clone(kChannelsLast).requires_grad_();
  const auto activation = [&](const torch::Tensor& v) {
    return ceiling ? torch::hardtanh(v, 0, *ceiling) : torch::relu(v);
  };
  const torch::Tensor y = fused ? batch_norm_relu(*copy, x, r, ceiling)
                                : activation(r.defined() ? copy->forward(x) + r : copy->forward(x));
  (y.to(torch::kFloat) * seed).sum().backward();
  return {y.detach(),
          x.grad(),
          copy->weight.grad(),
          copy->bias.grad(),
          r.defined() ? r.grad() : torch::Tensor(),
          copy->running_mean.clone(),
          copy->running_var.clone(),
          copy->num_batches_tracked.clone()};
}

nn::BatchNorm2d layer(std::int64_t c, std::optional<double> momentum = 0.1) {
  nn::BatchNorm2d bn(nn::BatchNorm2dOptions(c).momentum(momentum));
  torch::NoGradGuard no_grad;
  bn->weight.uniform_(0.5, 1.5);
  bn->bias.uniform_(-0.5, 0.5);
  bn->running_mean.uniform_(-1, 1);
  bn->running_var.uniform_(0.5, 2);
  return bn;
}

TEST(BatchNormReLU, MatchesBatchNormAddReLUForwardBackwardAndRunningStatistics) {
  if (kernels().empty()) GTEST_SKIP() << "this CPU has neither AVX-512 nor AVX2: ATen's ops run";
  for (const std::string& kernel : kernels()) {
    Choose choose(kernel);
    torch::manual_seed(11);
    for (const auto type : {torch::kFloat, torch::kBFloat16}) {
      // One block of rows and several (256 rows a block), 16 and 48 channels, a mean far from
      // zero against the spread, with and without a residual; and the widths and sizes of
      // ResNet-18's stages past the first (torchvision's too, at 28x28 images).
      for (const auto& shape :
           {std::vector<std::int64_t>{6, 48, 5, 7}, std::vector<std::int64_t>{4, 16, 15, 20},
            std::vector<std::int64_t>{2, 128, 14, 14}, std::vector<std::int64_t>{3, 256, 7, 7},
            std::vector<std::int64_t>{4, 512, 4, 4}}) {
        for (const bool with_residual : {false, true}) {
          const std::string what = kernel + " " + std::string(c10::toString(type)) + " " +
                                   c10::str(torch::IntArrayRef(shape)) +
                                   (with_residual ? " residual" : "");
          const nn::BatchNorm2d bn = layer(shape[1]);
          const torch::Tensor x = (torch::randn(shape) * 2 + 20).to(type);
          const torch::Tensor r = with_residual ? torch::randn(shape).to(type) : torch::Tensor();
          const torch::Tensor seed = torch::randn(shape);
          const Result fused = step(bn, x, r, true, seed);
          const Result plain = step(bn, x, r, false, seed);
          EXPECT_TRUE(fused.y.is_contiguous(kChannelsLast)) << what;
          EXPECT_EQ(fused.y.scalar_type(), type) << what;
          EXPECT_EQ(fused.gx.scalar_type(), type) << what;
          const bool bf16 = type == torch::kBFloat16;
          // float32: sums in another order; bfloat16: that, then a rounding to 8 bits.
          EXPECT_LT(relative_difference(fused.y, plain.y), bf16 ? 1e-2 : 1e-5) << what;
          EXPECT_LT(relative_difference(fused.gx, plain.gx), bf16 ? 2e-2 : 1e-4) << what;
          EXPECT_LT(relative_difference(fused.gw, plain.gw), bf16 ? 2e-2 : 1e-4) << what;
          EXPECT_LT(relative_difference(fused.gb, plain.gb), bf16 ? 2e-2 : 1e-5) << what;
          if (with_residual) {
            EXPECT_LT(relative_difference(fused.gr, plain.gr), bf16 ? 1e-2 : 1e-6) << what;
          }
          EXPECT_LT(relative_difference(fused.running_mean, plain.running_mean), 1e-5) << what;
          EXPECT_LT(relative_difference(fused.running_var, plain.running_var), bf16 ? 1e-3 : 1e-5)
              << what;
          EXPECT_TRUE(torch::equal(fused.batches, plain.batches)) << what;
        }
      }
    }
  }
}

// Cumulative averages (momentum None), and evaluation with the running statistics.
// ReLU6 (MobileNet's "BatchNorm, ReLU6", hardtanh(0, 6)) in place of the ReLU: the values and
// gradients of BatchNorm then hardtanh, with outputs at the ceiling (whose gradient is zero) and
// below it, with and without a residual.
TEST(BatchNormReLU, WithACeilingItIsBatchNormThenReLU6) {
  if (kernels().empty()) GTEST_SKIP() << "this CPU has neither AVX-512 nor AVX2: ATen's ops run";
  for (const std::string& kernel : kernels()) {
    Choose choose(kernel);
    torch::manual_seed(12);
    for (const auto type : {torch::kFloat, torch::kBFloat16}) {
      for (const bool with_residual : {false, true}) {
        const std::string what = kernel + " " + std::string(c10::toString(type)) +
                                 (with_residual ? " residual" : "");
        nn::BatchNorm2d bn = layer(32);
        {
          torch::NoGradGuard no_grad;
          bn->weight.uniform_(2, 4); // a good share of the outputs past 6
        }
        const std::vector<std::int64_t> shape = {4, 32, 6, 7};
        const torch::Tensor x = torch::randn(shape).to(type);
        const torch::Tensor r = with_residual ? torch::randn(shape).to(type) : torch::Tensor();
        const torch::Tensor seed = torch::randn(shape);
        const Result fused = step(bn, x, r, true, seed, true, 6.0);
        const Result plain = step(bn, x, r, false, seed, true, 6.0);
        const double at_ceiling = (plain.y == 6).to(torch::kDouble).mean().item<double>();
        EXPECT_GT(at_ceiling, 0.01) << what; // 2-4% measured: over a hundred elements
        EXPECT_LT(at_ceiling, 0.5) << what;
        const bool bf16 = type == torch::kBFloat16;
        EXPECT_EQ(fused.y.max().item<double>(), 6.0) << what;
        EXPECT_LT(relative_difference(fused.y, plain.y), bf16 ? 1e-2 : 1e-5) << what;
        EXPECT_LT(relative_difference(fused.gx, plain.gx), bf16 ? 2e-2 : 1e-4) << what;
        EXPECT_LT(relative_difference(fused.gw, plain.gw), bf16 ? 2e-2 : 1e-4) << what;
        EXPECT_LT(relative_difference(fused.gb, plain.gb), bf16 ? 2e-2 : 1e-5) << what;
        if (with_residual) {
          EXPECT_LT(relative_difference(fused.gr, plain.gr), bf16 ? 1e-2 : 1e-6) << what;
        }
      }
    }
  }
}

TEST(BatchNormReLU, CumulativeAveragesAndEvaluationMatchTheModule) {
  if (kernels().empty()) GTEST_SKIP() << "this CPU has neither AVX-512 nor AVX2: ATen's ops run";
  torch::manual_seed(12);
  nn::BatchNorm2d bn = layer(32, std::nullopt);
  bn->num_batches_tracked.fill_(3);
  const torch::Tensor x = torch::randn({3, 32, 6, 6});
  const torch::Tensor seed = torch::randn({3, 32, 6, 6});
  const Result fused = step(bn, x, {}, true, seed);
  const Result plain = step(bn, x, {}, false, seed);
  EXPECT_LT(relative_difference(fused.running_mean, plain.running_mean), 1e-5);
  EXPECT_LT(relative_difference(fused.running_var, plain.running_var), 1e-5);
  EXPECT_EQ(fused.batches.item<std::int64_t>(), 4);

  bn->eval();
  torch::NoGradGuard no_grad;
  const torch::Tensor xc = x.contiguous(kChannelsLast), r = torch::randn_like(xc);
  EXPECT_LT(relative_difference(batch_norm_relu(*bn, xc, r), torch::relu(bn->forward(xc) + r)),
            1e-6);
  EXPECT_TRUE(torch::equal(bn->num_batches_tracked, plain.batches - 1)); // evaluation counts none
}

// Each lane (channel) does the same operations in the same order whatever the vector width.
TEST(BatchNormReLU, TheAvx2AndAvx512KernelsAgreeBitForBit) {
  if (kernels().size() < 2) GTEST_SKIP() << "this CPU lacks AVX-512: one kernel to compare";
  torch::manual_seed(13);
  for (const auto type : {torch::kFloat, torch::kBFloat16}) {
    const nn::BatchNorm2d bn = layer(32);
    const torch::Tensor x = torch::randn({5, 32, 9, 11}).to(type);
    const torch::Tensor r = torch::randn({5, 32, 9, 11}).to(type);
    const torch::Tensor seed = torch::randn({5, 32, 9, 11});
    std::vector<Result> results;
    for (const std::string& kernel : kernels()) {
      Choose choose(kernel);
      results.push_back(step(bn, x, r, true, seed));
    }
    const Result &a = results[0], &b = results[1];
    for (const auto& [p, q] : {std::pair{a.y, b.y},
                               {a.gx, b.gx},
                               {a.gw, b.gw},
                               {a.gb, b.gb},
                               {a.gr, b.gr},
                               {a.running_var, b.running_var}}) {
      EXPECT_TRUE(torch::equal(p, q)) << c10::toString(type);
    }
  }
}

// On a CPU with AVX512_BF16 "avx512" runs the build that rounds with its instruction, so the
// test above compares that one with AVX2. The AVX-512 build without it (what "avx512" runs on
// other AVX-512 CPUs) rounds the same bits from normal values; a denormal result, which the
// software rounding keeps, the instruction takes for zero.
TEST(BatchNormReLU, TheAvx512BuildsRoundAlikeButTheInstructionTakesDenormalsForZero) {
  if (!cpu_runs("avx512bf16")) GTEST_SKIP() << "this CPU lacks AVX512_BF16: one AVX-512 build";
  namespace kernel = batch_norm_relu_kernels;
  torch::manual_seed(16);
  const std::int64_t rows = 37, c = 32;
  auto bf16 = [&](double scale) { return (torch::randn({rows, c}) * scale).to(torch::kBFloat16); };
  const torch::Tensor x = bf16(1), residual = bf16(1), gy = bf16(1);
  const torch::Tensor scale = torch::rand({c}) + 0.5, shift = torch::randn({c}),
                      mean = torch::randn({c}) * 0.1, slope = torch::randn({c}) * 0.1,
                      offset = torch::randn({c}) * 0.1;
  auto f = [](const torch::Tensor& t) { return t.const_data_ptr<float>(); };
  // y without and with the residual, then the input's and the residual's gradients.
  auto run = [&](const kernel::Kernel& k, const torch::Tensor& in, const torch::Tensor& sc,
                 const torch::Tensor& sh) {
    const kernel::Rows rows_of_x{in.const_data_ptr(), rows, c, true};
    std::vector<torch::Tensor> out(4);
    for (auto& t : out) t = torch::empty({rows, c}, torch::kBFloat16);
    const float no_ceiling = std::numeric_limits<float>::infinity();
    k.normalize(rows_of_x, nullptr, f(sc), f(sh), no_ceiling, out[0].mutable_data_ptr());
    k.normalize(rows_of_x, residual.const_data_ptr(), f(sc), f(sh), no_ceiling,
                out[1].mutable_data_ptr());
    k.backward_input(rows_of_x, out[1].const_data_ptr(), gy.const_data_ptr(), f(mean), f(sc),
                     f(slope), f(offset), no_ceiling, out[2].mutable_data_ptr(),
                     out[3].mutable_data_ptr());
    return out;
  };
  const auto plain = run(kernel::kAvx512, x, scale, shift);
  const auto instruction = run(kernel::kAvx512Bf16, x, scale, shift);
  for (std::size_t i = 0; i < plain.size(); ++i) {
    EXPECT_TRUE(torch::equal(plain[i], instruction[i])) << "output " << i;
  }
  EXPECT_GT((plain[0] > 0).sum().item<std::int64_t>(), 0); // the ReLU left values to round

  // 1 x 0 + 1e-39: a positive denormal float, rounded to the bfloat16 denormal 0x000b by the
  // software and to +0 by the instruction (ReLU keeps either).
  const torch::Tensor ones = torch::ones({rows, c}).to(torch::kBFloat16);
  const torch::Tensor zero = torch::zeros({c}), tiny = torch::full({c}, 1e-39f);
  const auto kept = run(kernel::kAvx512, ones, zero, tiny)[0];
  const auto flushed = run(kernel::kAvx512Bf16, ones, zero, tiny)[0];
  EXPECT_TRUE(
      torch::equal(kept.view(torch::kInt16), torch::full({rows, c}, 0x000b, torch::kInt16)));
  EXPECT_TRUE(torch::equal(flushed.view(torch::kInt16), torch::zeros({rows, c}, torch::kInt16)));
}

// ATen's operations where the kernel does not apply: NCHW, channels not a multiple of 16,
// "none" chosen; the same as the module's forward, the add and relu, to the bit.
TEST(BatchNormReLU, WhereTheKernelDoesNotApplyItRunsTheModuleAddAndReLU) {
  torch::manual_seed(14);
  const torch::Tensor seed = torch::randn({2, 16, 4, 4});
  const nn::BatchNorm2d bn = layer(16);
  const torch::Tensor nchw = torch::randn({2, 16, 4, 4});
  auto check = [&](const nn::BatchNorm2d& norm, const torch::Tensor& x, const std::string& what) {
    auto a = std::dynamic_pointer_cast<nn::BatchNorm2dImpl>(norm->clone());
    auto b = std::dynamic_pointer_cast<nn::BatchNorm2dImpl>(norm->clone());
    EXPECT_TRUE(torch::equal(batch_norm_relu(*a, x), torch::relu(b->forward(x)))) << what;
    EXPECT_TRUE(torch::equal(a->running_var, b->running_var)) << what;
  };
  check(bn, nchw, "NCHW");
  const nn::BatchNorm2d eight = layer(8);
  check(eight, torch::randn({2, 8, 4, 4}).contiguous(kChannelsLast), "8 channels");
  {
    Choose none("none");
    EXPECT_STREQ(batch_norm_relu_kernel(), "none");
    check(bn, nchw.contiguous(kChannelsLast), "none");
    EXPECT_FALSE(use_batch_norm_relu_kernel("avx3"));
    EXPECT_STREQ(batch_norm_relu_kernel(), "none");
  }
  // A backward after "none" was chosen (since its forward ran the kernel) still has a kernel.
  if (!kernels().empty()) {
    auto copy = std::dynamic_pointer_cast<nn::BatchNorm2dImpl>(bn->clone());
    const torch::Tensor y = batch_norm_relu(*copy, nchw.contiguous(kChannelsLast).requires_grad_());
    Choose none_now("none");
    (y * seed).sum().backward();
    EXPECT_TRUE(copy->weight.grad().defined());
  }
}

TEST(CpuKernels, AnUnknownOrUnsupportedNameInTheEnvironmentIsAConfigError) {
  ::setenv("FLOTILLA_TEST_CPU_KERNEL", "avx3", 1);
  try {
    cpu_kernel_from_environment("FLOTILLA_TEST_CPU_KERNEL");
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("FLOTILLA_TEST_CPU_KERNEL is 'avx3'"), std::string::npos)
        << e.what();
  }
  ::setenv("FLOTILLA_TEST_CPU_KERNEL", "none", 1);
  EXPECT_EQ(cpu_kernel_from_environment("FLOTILLA_TEST_CPU_KERNEL"), "none");
  ::unsetenv("FLOTILLA_TEST_CPU_KERNEL");
  EXPECT_EQ(cpu_kernel_from_environment("FLOTILLA_TEST_CPU_KERNEL"), best_cpu_kernel());
}

// The largest relative difference over the parameters' gradients of two nets.
double gradient_error(const nn::Sequential& net, const nn::Sequential& truth) {
  auto reference = truth->named_parameters();
  double worst = 0;
  for (const auto& p : net->named_parameters()) {
    worst = std::max(worst, relative_difference(p.value().grad(), reference[p.key()].grad()));
  }
  return worst;
}

// The zoo's ResNet-20 with its "BatchNorm, ReLU" fused by the compile step is as accurate as with ATen's
// operations: one training step's logits and gradients, against the same step in float64,
// differ no more than ATen's do (within 2x; measured: logits 5.3e-7 against ATen's 7.0e-7 and
// gradients 4.2e-6 against 6.7e-6 in float32, 7.0e-3 against 7.9e-3 and 1.02 against 0.85
// under bfloat16 autocast, whose gradients at initialisation are mostly rounding), channels-last
// as compile() keeps it; and the running statistics agree with ATen's. With float sums over all
// the rows (not runs of 16 added in double) the float32 gradients were 3.6e-3 off: after a
// convolution of a BatchNorm's gradient (which sums to zero) the next BatchNorm's sums cancel
// to a thousandth of their terms.
TEST(BatchNormReLU, TheZooResNetStepIsAsAccurateAsWithATensOperations) {
  if (kernels().empty()) GTEST_SKIP() << "this CPU has neither AVX-512 nor AVX2: ATen's ops run";
  // oneDNN's convolutions on every side: the BatchNorms are what is compared (winograd_test.cpp
  // measures the Winograd convolutions).
  KernelChoice<winograd_kernel, use_winograd_kernel> direct("none");
  for (const auto policy : {train::Policy::kFloat32, train::Policy::kMixedBFloat16}) {
    torch::manual_seed(15);
    nn::Sequential fused = models::make_model("resnet20");
    {
      torch::NoGradGuard no_grad; // as compile() keeps a convolutional net
      for (auto& p : fused->parameters()) {
        if (p.dim() == 4) p.set_data(p.contiguous(kChannelsLast));
      }
    }
    auto copy = [&] {
      return nn::Sequential(std::dynamic_pointer_cast<nn::SequentialImpl>(fused->clone()));
    };
    nn::Sequential plain = fused, truth = copy();
    fused = copy();
    compile(*fused); // the blocks' "BatchNorm, ReLU" as BatchNormReLU
    truth->to(torch::kDouble);
    const torch::Tensor x = torch::randn({8, 1, 28, 28}).contiguous(kChannelsLast);
    const torch::Tensor labels = torch::randint(10, {8});
    std::vector<torch::Tensor> logits;
    for (auto* net : {&fused, &plain, &truth}) {
      Choose kernel(net == &fused ? batch_norm_relu_kernel() : "none");
      train::AutocastGuard autocast(net == &truth ? train::Policy::kFloat32 : policy, torch::kCPU);
      logits.push_back(
          (*net)->forward(net == &truth ? x.to(torch::kDouble) : x).to(torch::kDouble));
      torch::nn::functional::cross_entropy(logits.back(), labels).backward();
    }
    const std::string what = train::to_string(policy);
    // The kernel ran (its sums run in another order than ATen's): not equal to the bit.
    EXPECT_FALSE(torch::equal(fused->named_parameters()["3.body.1.weight"].grad(),
                              plain->named_parameters()["3.body.1.weight"].grad()));
    const double fused_error = gradient_error(fused, truth),
                 aten_error = gradient_error(plain, truth);
    if (policy == train::Policy::kFloat32) {
      EXPECT_LT(fused_error, 2 * aten_error) << what << ": ATen's " << aten_error;
    } else { // whose largest differences are near 1 either way: the whole gradient's direction
      const GradientAgreement f = gradient_agreement(*fused, *truth),
                              a = gradient_agreement(*plain, *truth);
      std::printf("bf16 gradients against float64: fused angle %.3g length %.4f, ATen's angle "
                  "%.3g length %.4f\n",
                  f.angle_error, f.length_ratio, a.angle_error, a.length_ratio);
      EXPECT_LT(f.angle_error, 2 * a.angle_error);
      EXPECT_NEAR(f.length_ratio, 1, 0.05);
    }
    EXPECT_LT(relative_difference(logits[0], logits[2]),
              2 * relative_difference(logits[1], logits[2]))
        << what;
    EXPECT_GT(aten_error, 0) << what;
    auto plain_buffers = plain->named_buffers();
    const bool bf16 = policy == train::Policy::kMixedBFloat16;
    for (const auto& b : fused->named_buffers()) {
      if (b.value().is_floating_point()) {
        EXPECT_LT(relative_difference(b.value(), plain_buffers[b.key()]), bf16 ? 1e-2 : 1e-5)
            << what << " " << b.key();
      } else {
        EXPECT_TRUE(torch::equal(b.value(), plain_buffers[b.key()])) << b.key();
      }
    }
  }
}

} // namespace
} // namespace flotilla::kernels
