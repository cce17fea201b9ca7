// Convolutions under bfloat16 autocast with float32 arithmetic (flotilla/kernels/convolution.h):
// the values against float64 at the shapes MobileNetV2 and torchvision's ResNet-18 run that
// Winograd's kernels do not take, the types autocast gives, and the measured choice with each
// candidate forced.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "flotilla/error.h"
#include "flotilla/kernels/choice.h"
#include "flotilla/kernels/convolution.h"
#include "flotilla/kernels/winograd.h"
#include "flotilla/train/mixed_precision.h"
#include "kernel_choice.h"

namespace flotilla::kernels {
namespace {

const auto kChannelsLast = torch::MemoryFormat::ChannelsLast;

struct Shape {
  std::int64_t n, in, out, size, kernel, stride, padding, groups;
  bool bias;
  std::string what() const {
    return std::to_string(in) + "->" + std::to_string(out) + " " + std::to_string(kernel) + "x" +
           std::to_string(kernel) + " s" + std::to_string(stride) + " g" + std::to_string(groups) +
           " at " + std::to_string(size) + (bias ? " with a bias" : "");
  }
};

struct Result {
  torch::Tensor y, gx, gw, gb;
};

// One forward and backward of conv2d() with x, w and b: in float64 (the truth), or under bfloat16
// autocast in `mode` (kFixed: the float32 arithmetic; kNone: oneDNN's bfloat16 convolution).
Result step(const Shape& s, const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
            const torch::Tensor& seed, std::optional<Mode> mode) {
  const auto type = mode ? torch::kBFloat16 : torch::kDouble;
  const torch::Tensor input = x.detach().to(type).contiguous(kChannelsLast).requires_grad_();
  const torch::Tensor weight =
      w.detach().to(mode ? torch::kFloat : torch::kDouble).requires_grad_();
  const torch::Tensor bias =
      s.bias ? b.detach().to(weight.scalar_type()).requires_grad_() : torch::Tensor();
  const std::optional<torch::Tensor> b_opt =
      s.bias ? std::optional<torch::Tensor>(bias) : std::nullopt;
  torch::Tensor y;
  if (mode) {
    KernelMode m(*mode);
    train::AutocastGuard autocast(train::Policy::kMixedBFloat16, torch::kCPU);
    y = kernels::conv2d(input, weight, b_opt, {s.stride, s.stride}, {s.padding, s.padding}, {1, 1},
                        s.groups);
  } else {
    y = at::conv2d(input, weight, b_opt, {s.stride, s.stride}, {s.padding, s.padding}, {1, 1},
                   s.groups);
  }
  (y * seed.to(y.scalar_type())).sum().backward();
  return {y.detach(), input.grad(), weight.grad(), s.bias ? bias.grad() : torch::Tensor()};
}

// Against the convolution in float64 of the same bfloat16 input and float32 weights, the output
// and the input's gradient are its values rounded to bfloat16 (within half a unit in the last
// place: 2^-8 of the largest value) and no farther than oneDNN's bfloat16 convolution's (whose
// products round the weights to bfloat16 too); the weight's and bias's gradients are float32,
// within 1e-5 and strictly closer than oneDNN's. The shapes: MobileNetV2's 1x1 expansions and
// projections, its depthwise 3x3s at strides 1 and 2, a first layer of one channel, ResNet-18's
// stride-2 3x3 and 1x1 shortcut at 128 -> 256 channels, and one with a bias.
TEST(Float32Conv, UnderBfloat16AutocastTheActivationsAreBfloat16AndTheArithmeticFloat) {
  for (const Shape s :
       {Shape{4, 32, 16, 14, 1, 1, 0, 1, false}, Shape{4, 96, 96, 14, 3, 2, 1, 96, false},
        Shape{4, 144, 144, 7, 3, 1, 1, 144, false}, Shape{4, 144, 24, 7, 1, 1, 0, 1, false},
        Shape{4, 1, 32, 28, 3, 1, 1, 1, false}, Shape{2, 128, 256, 14, 3, 2, 1, 1, false},
        Shape{2, 128, 256, 14, 1, 2, 0, 1, false}, Shape{3, 24, 40, 9, 3, 1, 0, 1, true}}) {
    torch::manual_seed(21);
    const std::int64_t out_size = (s.size + 2 * s.padding - s.kernel) / s.stride + 1;
    const torch::Tensor x = torch::randn({s.n, s.in, s.size, s.size}).to(torch::kBFloat16);
    const torch::Tensor w =
        torch::randn({s.out, s.in / s.groups, s.kernel, s.kernel}).contiguous(kChannelsLast);
    const torch::Tensor b = torch::randn({s.out});
    const torch::Tensor seed = torch::randn({s.n, s.out, out_size, out_size})
                                   .to(torch::kBFloat16)
                                   .contiguous(kChannelsLast);
    const Result truth = step(s, x, w, b, seed, std::nullopt);
    const Result ours = step(s, x, w, b, seed, Mode::kFixed);
    const Result direct = step(s, x, w, b, seed, Mode::kNone);
    const std::string what = s.what();
    EXPECT_EQ(ours.y.scalar_type(), torch::kBFloat16) << what;
    EXPECT_EQ(ours.gx.scalar_type(), torch::kBFloat16) << what;
    EXPECT_EQ(ours.gw.scalar_type(), torch::kFloat) << what;
    EXPECT_EQ(ours.y.is_contiguous(kChannelsLast), direct.y.is_contiguous(kChannelsLast))
        << what << ": the layout ATen's gives";
    EXPECT_FALSE(torch::equal(ours.y, direct.y)) << what << ": the two paths can be told apart";
    EXPECT_LT(relative_difference(ours.y, truth.y), 1.0 / 256) << what;
    EXPECT_LE(relative_difference(ours.y, truth.y), relative_difference(direct.y, truth.y)) << what;
    EXPECT_LT(relative_difference(ours.gx, truth.gx), 1.0 / 256) << what;
    EXPECT_LE(relative_difference(ours.gx, truth.gx), relative_difference(direct.gx, truth.gx))
        << what;
    EXPECT_LT(relative_difference(ours.gw, truth.gw), 1e-5) << what;
    EXPECT_LT(relative_difference(ours.gw, truth.gw), relative_difference(direct.gw, truth.gw))
        << what;
    EXPECT_GT(ours.gw.abs().max().item<double>(), 0) << what;
    if (s.bias) {
      EXPECT_EQ(ours.gb.scalar_type(), torch::kFloat) << what;
      EXPECT_LT(relative_difference(ours.gb, truth.gb), 1e-5) << what;
    }
  }
}

// Only under bfloat16 autocast: in float32 conv2d() is ATen's to the bit, and float32_conv2d
// refuses, naming what it was given.
TEST(Float32Conv, InFloat32ItIsATensConvolution) {
  torch::manual_seed(4);
  const torch::Tensor x = torch::randn({2, 16, 8, 8}).contiguous(kChannelsLast);
  const torch::Tensor w = torch::randn({32, 16, 1, 1});
  KernelMode fixed(Mode::kFixed);
  EXPECT_FALSE(float32_conv2d_applies(x, w, std::nullopt, {1, 1}, {0, 0}, {1, 1}, 1));
  EXPECT_TRUE(torch::equal(kernels::conv2d(x, w, std::nullopt, {1, 1}, {0, 0}, {1, 1}, 1),
                           at::conv2d(x, w)));
  try {
    float32_conv2d(x, w, std::nullopt, {1, 1}, {0, 0}, {1, 1}, 1);
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("[2, 16, 8, 8] Float"), std::string::npos) << e.what();
  }
  train::AutocastGuard autocast(train::Policy::kMixedBFloat16, torch::kCPU);
  EXPECT_TRUE(float32_conv2d_applies(x, w, std::nullopt, {1, 1}, {0, 0}, {1, 1}, 1));
  EXPECT_FALSE(
      float32_conv2d_applies(x, w.to(torch::kDouble), std::nullopt, {1, 1}, {0, 0}, {1, 1}, 1))
      << "float64 weights";
}

// The measured choice, each candidate forced: kFixed runs the float32 arithmetic, kNone oneDNN's
// bfloat16 convolution, and kMeasure times both, forward and backward, records the decision
// under "conv_float32" and runs the faster.
TEST(Float32Conv, TheMeasuredChoiceRunsTheCandidateItRecords) {
  torch::manual_seed(8);
  const torch::Tensor x = torch::randn({4, 32, 14, 14}).contiguous(kChannelsLast);
  const torch::Tensor w = torch::randn({64, 32, 1, 1}).contiguous(kChannelsLast);
  const auto run = [&](Mode m) {
    KernelMode mode(m);
    train::AutocastGuard autocast(train::Policy::kMixedBFloat16, torch::kCPU);
    const torch::Tensor input = x.clone().requires_grad_();
    const torch::Tensor y = kernels::conv2d(input, w, std::nullopt, {1, 1}, {0, 0}, {1, 1}, 1);
    y.sum().backward();
    return std::make_pair(y.detach(), input.grad());
  };
  const auto forced = [&] {
    train::AutocastGuard autocast(train::Policy::kMixedBFloat16, torch::kCPU);
    torch::NoGradGuard no_grad;
    return float32_conv2d(x, w, std::nullopt, {1, 1}, {0, 0}, {1, 1}, 1);
  }();
  const auto aten = [&] {
    train::AutocastGuard autocast(train::Policy::kMixedBFloat16, torch::kCPU);
    torch::NoGradGuard no_grad;
    return at::conv2d(x, w);
  }();
  ASSERT_FALSE(torch::equal(forced, aten));
  set_cache_directory(std::filesystem::path()); // in memory: this test's own decisions
  reset_decisions();
  EXPECT_TRUE(torch::equal(run(Mode::kFixed).first, forced));
  EXPECT_TRUE(torch::equal(run(Mode::kNone).first, aten));
  reset_decisions();
  const torch::Tensor measured = run(Mode::kMeasure).first;
  const std::vector<Decision> d = decisions();
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].op, "conv_float32");
  EXPECT_GT(d[0].flotilla_ms, 0);
  EXPECT_GT(d[0].aten_ms, 0);
  EXPECT_NE(d[0].key.find("4x32x14x14 nhwc w64x32x1x1 s1,1 p0,0 d1,1 g1 from f32 train"),
            std::string::npos)
      << d[0].key;
  EXPECT_TRUE(torch::equal(measured, d[0].flotilla ? forced : aten));
  bool named = false;
  for (const std::string& line : summary_lines()) {
    named |= line.rfind("other convolutions (bfloat16 in float32 arithmetic): ", 0) == 0;
  }
  EXPECT_TRUE(named);
  reset_decisions();
  set_cache_directory(std::nullopt);
}

} // namespace
} // namespace flotilla::kernels
