#include <gtest/gtest.h>

#include <array>

#include <torch/torch.h>

#include <optional>
#include <string>
#include <vector>

#include "flotilla/profile/compute.h"
#include "flotilla/train/mixed_precision.h"
#include "kernel_choice.h"
#include "flotilla/kernels/batch_norm_relu.h"
#include "flotilla/kernels/winograd.h"
#include "flotilla/kernels/compile.h"
#include "models/zoo.h"

namespace flotilla::kernels {
namespace {

namespace nn = torch::nn;
const auto kChannelsLast = torch::MemoryFormat::ChannelsLast;

using Choose = KernelChoice<winograd_kernel, use_winograd_kernel>;
std::vector<std::string> kernels() {
  return Choose::runnable();
}

nn::Conv2d conv3(std::int64_t in, std::int64_t out) {
  nn::Conv2d conv(nn::Conv2dOptions(in, out, 3).padding(1).bias(false));
  torch::NoGradGuard no_grad;
  conv->weight.set_data(conv->weight.contiguous(kChannelsLast));
  return conv;
}

struct Result {
  torch::Tensor y, gx, gw;
};

// One forward and backward of `conv` on x: through conv3x3 (float32), or the module's own in
// float64 (the truth both float32 convolutions are measured against).
Result step(const nn::Conv2d& conv, const torch::Tensor& input, const torch::Tensor& seed,
            bool in_double = false) {
  auto copy = std::dynamic_pointer_cast<nn::Conv2dImpl>(conv->clone());
  if (in_double) copy->to(torch::kDouble);
  const auto type = in_double ? torch::kDouble : torch::kFloat;
  const torch::Tensor x = input.detach().to(type).contiguous(kChannelsLast).requires_grad_();
  const torch::Tensor y = conv2d(*copy, x);
  (y * seed.to(type)).sum().backward();
  return {y.detach(), x.grad(), copy->weight.grad()};
}

// Forward, the input's gradient and the weight's, against the convolution in float64, for
// sizes that are and are not multiples of the 4x4 tiles, 16 to 512 channels in and out: the
// Winograd kernels are within 2e-5 of the largest value (measured: 7.9e-8 to 1.5e-5, against
// oneDNN's direct convolution's 4.3e-8 to 2.2e-6 in float32: the transforms scale values by up
// to 8 and 64 before they cancel, and the weight gradient adds its tiles' products in float).
TEST(Winograd, MatchesTheConvolutionInFloat64ForwardAndBackward) {
  if (kernels().empty()) GTEST_SKIP() << "this CPU has neither AVX-512 nor AVX2: oneDNN runs";
  struct Shape {
    std::int64_t n, in, out, h, w;
  };
  // {6, 16, 16, 28, 28}: 294 tiles, 5 blocks, 2 partial sums; 512 x 256 weights are
  // transformed a panel at a time, the others all first. Sides of 14, 6 and 2 end in tiles 2
  // deep, 11, 7 and 3 in tiles 3 deep, 9, 5 and 1 in tiles 2 deep of which 1 is written.
  for (const Shape s :
       {Shape{3, 16, 32, 9, 7}, Shape{2, 32, 16, 28, 28}, Shape{2, 64, 64, 7, 7},
        Shape{1, 48, 64, 4, 5}, Shape{2, 16, 16, 1, 2}, Shape{1, 256, 128, 5, 3},
        Shape{6, 16, 16, 28, 28}, Shape{2, 512, 256, 4, 4}, Shape{1, 256, 512, 3, 5},
        Shape{2, 32, 48, 14, 14}, Shape{3, 16, 16, 6, 11}}) {
    torch::manual_seed(s.h * 100 + s.in);
    const nn::Conv2d conv = conv3(s.in, s.out);
    const torch::Tensor x = torch::randn({s.n, s.in, s.h, s.w});
    const torch::Tensor seed = torch::randn({s.n, s.out, s.h, s.w});
    const Result truth = step(conv, x, seed, /*in_double=*/true);
    Result direct;
    {
      Choose none("none");
      EXPECT_FALSE(winograd_applies(*conv, x.contiguous(kChannelsLast)));
      direct = step(conv, x, seed);
    }
    for (const auto& name : kernels()) {
      Choose kernel(name);
      const std::string what = name + " " + std::to_string(s.n) + "x" + std::to_string(s.in) +
                               "->" + std::to_string(s.out) + " " + std::to_string(s.h) + "x" +
                               std::to_string(s.w);
      ASSERT_TRUE(winograd_applies(*conv, x.contiguous(kChannelsLast))) << what;
      const Result r = step(conv, x, seed);
      EXPECT_TRUE(r.y.is_contiguous(kChannelsLast)) << what;
      EXPECT_EQ(r.gw.sizes(), conv->weight.sizes()) << what;
      const std::pair<torch::Tensor, torch::Tensor> pairs[] = {
          {r.y, direct.y}, {r.gx, direct.gx}, {r.gw, direct.gw}};
      const torch::Tensor* truths[] = {&truth.y, &truth.gx, &truth.gw};
      const char* names[] = {"y", "gx", "gw"};
      for (int i = 0; i < 3; ++i) {
        const double error = relative_difference(pairs[i].first, *truths[i]);
        // oneDNN's, for scale: 4.3e-8 to 2.2e-6.
        EXPECT_GT(relative_difference(pairs[i].second, *truths[i]), 0) << what << " " << names[i];
        EXPECT_LT(error, 2e-5) << what << " " << names[i];
        EXPECT_GT(error, 0) << what << " " << names[i];
      }
    }
  }
}

// Under bfloat16 autocast the activations are bfloat16 and the weights and arithmetic float32:
// against the convolution in float64 of the same bfloat16 input, the output is its value rounded
// to bfloat16 (within half a unit in the last place: 2^-8 of the largest value), and no farther
// from it than oneDNN's bfloat16 convolution (whose products round the weights to bfloat16 too);
// the gradients likewise, the input's bfloat16 and the weight's float32 (strictly closer).
TEST(Winograd, UnderBfloat16AutocastTheActivationsAreBfloat16AndTheArithmeticFloat) {
  if (kernels().empty()) GTEST_SKIP() << "this CPU has neither AVX-512 nor AVX2: oneDNN runs";
  struct Shape {
    std::int64_t n, in, out, h, w;
  };
  // A small odd one, and ResNet-18's stages past the first (torchvision's too, at 28x28).
  for (const Shape s : {Shape{3, 32, 64, 10, 9}, Shape{2, 128, 128, 14, 14},
                        Shape{2, 256, 256, 7, 7}, Shape{2, 512, 512, 4, 4}}) {
    const std::string what = std::to_string(s.in) + "->" + std::to_string(s.out) + " " +
                             std::to_string(s.h) + "x" + std::to_string(s.w);
    torch::manual_seed(11);
    const nn::Conv2d conv = conv3(s.in, s.out);
    const torch::Tensor x =
        torch::randn({s.n, s.in, s.h, s.w}).to(torch::kBFloat16).contiguous(kChannelsLast);
    const torch::Tensor seed =
        torch::randn({s.n, s.out, s.h, s.w}).to(torch::kBFloat16).contiguous(kChannelsLast);
    const Result truth = step(conv, x, seed, /*in_double=*/true);
    std::vector<Result> results;
    for (const std::string name : {std::string("none"), std::string(winograd_kernel())}) {
      Choose kernel(name);
      // "none": oneDNN's bfloat16 convolution (not the float32 one of convolution.h).
      std::optional<KernelMode> aten;
      if (name == "none") aten.emplace(Mode::kNone);
      auto copy = std::dynamic_pointer_cast<nn::Conv2dImpl>(conv->clone());
      const torch::Tensor input = x.detach().clone().requires_grad_();
      torch::Tensor y;
      {
        train::AutocastGuard autocast(train::Policy::kMixedBFloat16, torch::kCPU);
        EXPECT_EQ(winograd_applies(*copy, input), name != "none") << what;
        y = conv2d(*copy, input);
      }
      (y * seed).sum().backward();
      EXPECT_EQ(y.scalar_type(), torch::kBFloat16) << name << " " << what;
      EXPECT_EQ(input.grad().scalar_type(), torch::kBFloat16) << name << " " << what;
      EXPECT_EQ(copy->weight.grad().scalar_type(), torch::kFloat) << name << " " << what;
      results.push_back({y.detach(), input.grad(), copy->weight.grad()});
    }
    const Result &direct = results[0], &winograd = results[1];
    EXPECT_LT(relative_difference(winograd.y, truth.y), 1.0 / 256) << what;
    // No farther than oneDNN's (at 128 channels and more both are the rounding to bfloat16 of
    // the same value at the worst element: equal).
    EXPECT_LE(relative_difference(winograd.y, truth.y), relative_difference(direct.y, truth.y))
        << what;
    EXPECT_LT(relative_difference(winograd.gx, truth.gx), 1.0 / 256) << what;
    EXPECT_LE(relative_difference(winograd.gx, truth.gx),
              relative_difference(direct.gx, truth.gx))
        << what;
    EXPECT_LT(relative_difference(winograd.gw, truth.gw), 1e-4) << what;
    EXPECT_LT(relative_difference(winograd.gw, truth.gw),
              relative_difference(direct.gw, truth.gw))
        << what;
  }
}

// The AVX2 and AVX-512 kernels add the same products in the same order, and the weight
// gradient's partial sums are added in an order that does not depend on the threads.
TEST(Winograd, TheKernelsAndTheThreadCountsAgreeBitForBit) {
  if (kernels().size() < 2) GTEST_SKIP() << "this CPU lacks AVX-512: one kernel to compare";
  torch::manual_seed(7);
  // 640 tiles: 10 blocks, 3 partial sums; then 512 x 160 weights, transformed a panel at a time.
  for (const auto& [in, out, n, size] :
       {std::array<std::int64_t, 4>{32, 16, 40, 14}, std::array<std::int64_t, 4>{512, 160, 3, 4}}) {
    const nn::Conv2d conv = conv3(in, out);
    const torch::Tensor x = torch::randn({n, in, size, size});
    const torch::Tensor seed = torch::randn({n, out, size, size});
    std::vector<Result> results;
    const int threads = at::get_num_threads();
    for (const int t : {1, 2}) {
      at::set_num_threads(t);
      for (const auto& name : kernels()) {
        Choose kernel(name);
        results.push_back(step(conv, x, seed));
      }
    }
    at::set_num_threads(threads);
    for (std::size_t i = 1; i < results.size(); ++i) {
      EXPECT_TRUE(torch::equal(results[i].y, results[0].y)) << in << " " << i;
      EXPECT_TRUE(torch::equal(results[i].gx, results[0].gx)) << in << " " << i;
      EXPECT_TRUE(torch::equal(results[i].gw, results[0].gw)) << in << " " << i;
    }
  }
}

// Where the kernels do not apply, conv3x3 is the module's forward: oneDNN's result to the bit.
TEST(Winograd, WhereTheKernelsDoNotApplyItRunsTheModule) {
  if (kernels().empty()) GTEST_SKIP() << "this CPU has neither AVX-512 nor AVX2: oneDNN runs";
  torch::manual_seed(5);
  const torch::Tensor x = torch::randn({2, 16, 8, 8}).contiguous(kChannelsLast);
  const auto same = [](nn::Conv2d conv, const torch::Tensor& input) {
    torch::NoGradGuard no_grad;
    EXPECT_FALSE(winograd_applies(*conv, input));
    return torch::equal(conv2d(*conv, input), conv->forward(input));
  };
  EXPECT_TRUE(winograd_applies(*conv3(16, 16), x));
  EXPECT_TRUE(same(conv3(16, 16), x.contiguous())) << "NCHW";
  nn::Conv2d in_double = conv3(16, 16);
  in_double->to(torch::kDouble);
  EXPECT_TRUE(same(in_double, x.to(torch::kDouble))) << "float64";
  EXPECT_TRUE(same(nn::Conv2d(nn::Conv2dOptions(16, 16, 3).padding(1)), x)) << "a bias";
  EXPECT_TRUE(same(nn::Conv2d(nn::Conv2dOptions(16, 16, 3).padding(1).stride(2).bias(false)), x))
      << "stride 2";
  EXPECT_TRUE(same(nn::Conv2d(nn::Conv2dOptions(16, 16, 3).bias(false)), x)) << "no padding";
  EXPECT_TRUE(same(nn::Conv2d(nn::Conv2dOptions(16, 16, 1).bias(false)), x)) << "1x1";
  EXPECT_TRUE(same(conv3(16, 8), x)) << "8 out";
  EXPECT_TRUE(winograd_applies(*conv3(16, 512), x));
  EXPECT_TRUE(same(conv3(16, 1024), x)) << "1024 out";
  {
    // Under bfloat16 autocast what Winograd's kernels do not take may compute in float32
    // (convolution.h); with the kernels off it is the module's.
    train::AutocastGuard autocast(train::Policy::kMixedBFloat16, torch::kCPU);
    EXPECT_TRUE(winograd_applies(*conv3(16, 512), x)) << "under bfloat16 autocast";
    KernelMode none(Mode::kNone);
    EXPECT_TRUE(same(conv3(16, 1024), x)) << "1024 out under bfloat16 autocast, --kernels none";
  }
}

// The FLOP counter (the doctor's, the benchmarks' utilisation) counts a Winograd convolution as
// the convolution it computes, not the fewer products it takes.
TEST(Winograd, CountsAsTheConvolutionItComputes) {
  if (kernels().empty()) GTEST_SKIP() << "this CPU has neither AVX-512 nor AVX2: oneDNN runs";
  nn::Conv2d conv = conv3(32, 16);
  const torch::Tensor x = torch::randn({3, 32, 9, 7}).contiguous(kChannelsLast);
  ASSERT_TRUE(winograd_applies(*conv, x));
  torch::NoGradGuard no_grad;
  EXPECT_EQ(profile::counted_flops([&] { conv2d(*conv, x); }), 2.0 * 3 * 9 * 7 * 16 * 32 * 9);
}

// The zoo's ResNet-20 with its 3x3 convolutions as Winograd's: one training step's logits and
// gradients against the same step in float64, next to the step with oneDNN's direct
// convolutions. Measured: in float32 logits 2.1e-6 against 5.3e-7 and gradients 1.4e-5 against
// 4.2e-6; under bfloat16 autocast, whose gradients at initialisation are mostly rounding, logits
// 9.0e-3 against 7.0e-3 and gradients 0.65 against 1.02.
TEST(Winograd, TheZooResNetStepStaysCloseToFloat64) {
  if (kernels().empty()) GTEST_SKIP() << "this CPU has neither AVX-512 nor AVX2: oneDNN runs";
  for (const auto policy : {train::Policy::kFloat32, train::Policy::kMixedBFloat16}) {
    const std::string what = train::to_string(policy);
    torch::manual_seed(15);
    nn::Sequential winograd = models::make_model("resnet20");
    {
      torch::NoGradGuard no_grad; // as compile() keeps a convolutional net
      for (auto& p : winograd->parameters()) {
        if (p.dim() == 4) p.set_data(p.contiguous(kChannelsLast));
      }
    }
    auto copy = [&] {
      return nn::Sequential(std::dynamic_pointer_cast<nn::SequentialImpl>(winograd->clone()));
    };
    nn::Sequential direct = copy(), truth = copy();
    truth->to(torch::kDouble);
    compile(*winograd); // both with the compile step's layers: the convolutions are compared
    compile(*direct);
    const torch::Tensor x = torch::randn({8, 1, 28, 28}).contiguous(kChannelsLast);
    const torch::Tensor labels = torch::randint(10, {8});
    std::vector<torch::Tensor> logits;
    for (auto* net : {&winograd, &direct, &truth}) {
      Choose kernel(net == &winograd ? winograd_kernel() : "none");
      train::AutocastGuard autocast(net == &truth ? train::Policy::kFloat32 : policy, torch::kCPU);
      logits.push_back(
          (*net)->forward(net == &truth ? x.to(torch::kDouble) : x).to(torch::kDouble));
      torch::nn::functional::cross_entropy(logits.back(), labels).backward();
    }
    auto reference = truth->named_parameters(), plain = direct->named_parameters();
    double error = 0, direct_error = 0;
    for (const auto& p : winograd->named_parameters()) {
      error = std::max(error, relative_difference(p.value().grad(), reference[p.key()].grad()));
      direct_error = std::max(
          direct_error, relative_difference(plain[p.key()].grad(), reference[p.key()].grad()));
    }
    // The kernels ran: not oneDNN's values to the bit.
    EXPECT_FALSE(torch::equal(winograd->named_parameters()["3.body.0.weight"].grad(),
                              plain["3.body.0.weight"].grad()))
        << what;
    if (policy == train::Policy::kFloat32) {
      EXPECT_LT(error, 5e-5) << "oneDNN's " << direct_error;
      EXPECT_LT(relative_difference(logits[0], logits[2]), 1e-5);
    } else {
      const GradientAgreement w = gradient_agreement(*winograd, *truth),
                              d = gradient_agreement(*direct, *truth);
      std::printf("bf16 gradients against float64: Winograd's angle %.3g length %.4f, oneDNN's "
                  "angle %.3g length %.4f\n",
                  w.angle_error, w.length_ratio, d.angle_error, d.length_ratio);
      EXPECT_LT(w.angle_error, 2 * d.angle_error);
      EXPECT_NEAR(w.length_ratio, 1, 0.05);
      EXPECT_LT(relative_difference(logits[0], logits[2]),
                1.5 * relative_difference(logits[1], logits[2]));
    }
    EXPECT_GT(direct_error, 0) << what;
  }
}

} // namespace
} // namespace flotilla::kernels
