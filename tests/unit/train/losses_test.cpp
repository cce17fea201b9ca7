// Losses, metrics, optimizers and the mixed-precision pieces against independent computations.
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <sstream>

#include "flotilla/error.h"
#include "flotilla/train/losses.h"
#include "flotilla/train/mixed_precision.h"
#include "flotilla/train/optimizers.h"

namespace flotilla::train {
namespace {
namespace F = torch::nn::functional;

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Losses, SparseCrossEntropyWithSmoothingEqualsTorchAndTheCategoricalForm) {
  torch::manual_seed(0);
  const auto logits = torch::randn({6, 4}, torch::kFloat64);
  const auto labels = torch::tensor({0, 3, 1, 1, 2, 0});
  LossOptions sparse;
  sparse.label_smoothing = 0.2;
  const auto ours = per_example_loss(sparse, logits, labels);
  const auto torch_ce = F::cross_entropy(
      logits, labels, F::CrossEntropyFuncOptions().reduction(torch::kNone).label_smoothing(0.2));
  EXPECT_TRUE(torch::allclose(ours, torch_ce, 1e-12, 1e-12));
  LossOptions categorical = sparse;
  categorical.kind = LossKind::kCategoricalCrossentropy;
  const auto one_hot = F::one_hot(labels, 4).to(torch::kFloat64);
  EXPECT_TRUE(torch::allclose(per_example_loss(categorical, logits, one_hot), ours, 1e-12, 1e-12));
  // From probabilities: the same values (clipped away from 0).
  LossOptions probs = sparse;
  probs.from_logits = false;
  EXPECT_TRUE(
      torch::allclose(per_example_loss(probs, torch::softmax(logits, 1), labels), ours, 1e-9));
}

TEST(Losses, BinaryCrossEntropyAndMeanSquaredErrorPerExample) {
  const auto logits = torch::tensor({{2.0}, {-1.0}, {0.5}}, torch::kFloat64);
  const auto labels = torch::tensor({1.0, 0.0, 0.0}, torch::kFloat64);
  LossOptions binary;
  binary.kind = LossKind::kBinaryCrossentropy;
  const auto loss = per_example_loss(binary, logits, labels);
  ASSERT_EQ(loss.sizes(), torch::IntArrayRef({3}));
  // -[y log s(x) + (1 - y) log(1 - s(x))]
  EXPECT_NEAR(loss[0].item<double>(), std::log1p(std::exp(-2.0)), 1e-12);
  EXPECT_NEAR(loss[1].item<double>(), std::log1p(std::exp(-1.0)), 1e-12);
  EXPECT_NEAR(loss[2].item<double>(), std::log1p(std::exp(0.5)), 1e-12);
  binary.label_smoothing = 0.1; // targets 0.95 / 0.05
  const double s0 = 1 / (1 + std::exp(-2.0));
  EXPECT_NEAR(per_example_loss(binary, logits, labels)[0].item<double>(),
              -(0.95 * std::log(s0) + 0.05 * std::log(1 - s0)), 1e-12);

  LossOptions mse;
  mse.kind = LossKind::kMeanSquaredError;
  const auto out = torch::tensor({{1.0, 2.0}, {0.0, 0.0}}, torch::kFloat64);
  const auto target = torch::tensor({{0.0, 0.0}, {3.0, 1.0}}, torch::kFloat64);
  const auto per = per_example_loss(mse, out, target);
  EXPECT_DOUBLE_EQ(per[0].item<double>(), 2.5);
  EXPECT_DOUBLE_EQ(per[1].item<double>(), 5.0);
}

TEST(Losses, BadInputSaysWhatWasExpected) {
  LossOptions sparse;
  EXPECT_EQ(error_of([&] {
              per_example_loss(sparse, torch::zeros({4, 3}), torch::zeros({5}));
            }),
            "sparse_categorical_crossentropy expects integer labels of shape [4]; saw [5]");
  EXPECT_EQ(error_of([] { parse_loss("hinge"); }),
            "loss \"hinge\" is not available; use sparse_categorical_crossentropy, "
            "categorical_crossentropy, binary_crossentropy or mean_squared_error");
  sparse.label_smoothing = 1.5;
  EXPECT_EQ(error_of([&] { validate(sparse); }), "label_smoothing must be in [0, 1]; saw 1.500000");
}

TEST(Losses, AUsersOwnLossGivesOneValuePerExampleOrItsScalarMeanSpreadOverThem) {
  const torch::Tensor outputs = torch::randn({4, 3});
  const torch::Tensor labels = torch::tensor({0, 2, 1, 2}, torch::kLong);
  LossOptions options;
  options.custom = [](const torch::Tensor& o, const torch::Tensor& y) {
    return torch::nn::functional::cross_entropy(o, y); // a scalar: the mean
  };
  const torch::Tensor spread = per_example_loss(options, outputs, labels);
  ASSERT_EQ(spread.sizes(), torch::IntArrayRef({4}));
  // Summed over the examples and divided by them, as fit() does: the scalar itself.
  EXPECT_NEAR(spread.sum().item<double>() / 4,
              torch::nn::functional::cross_entropy(outputs, labels).item<double>(), 1e-6);
  options.custom = [](const torch::Tensor& o, const torch::Tensor& y) {
    return (o - o.mean()).pow(2).sum(1); // [N]: one value each
  };
  EXPECT_TRUE(torch::allclose(per_example_loss(options, outputs, labels),
                              (outputs - outputs.mean()).pow(2).sum(1)));
  options.custom = [](const torch::Tensor& o, const torch::Tensor&) { return o; }; // [N, 3]
  try {
    per_example_loss(options, outputs, labels);
    FAIL() << "a [4, 3] loss was taken";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("the custom loss gave a tensor of shape [4, 3] for 4 "
                                         "examples; give one value per example ([4]) or a scalar"),
              std::string::npos)
        << e.what();
  }
}

TEST(Metrics, AccuracyFollowsTheLossAndTopKCountsHits) {
  const auto logits = torch::tensor({{0.1, 0.7, 0.2}, {0.5, 0.3, 0.2}, {0.2, 0.3, 0.5}});
  const auto labels = torch::tensor({1, 2, 0});
  const LossOptions sparse;
  EXPECT_TRUE(torch::equal(make_metric("accuracy", sparse).per_example(logits, labels),
                           torch::tensor({1.f, 0.f, 0.f})));
  // Top 2: example 1's label (2) is its lowest score; example 2's label (0) is its lowest too.
  EXPECT_TRUE(torch::equal(
      make_metric("sparse_top_k_categorical_accuracy@2", sparse).per_example(logits, labels),
      torch::tensor({1.f, 0.f, 0.f})));
  EXPECT_TRUE(torch::equal(
      make_metric("sparse_top_k_categorical_accuracy", sparse).per_example(logits, labels),
      torch::tensor({1.f, 1.f, 1.f}))); // k = 5 > 3 classes
  LossOptions categorical;
  categorical.kind = LossKind::kCategoricalCrossentropy;
  const auto one_hot = F::one_hot(labels, 3);
  EXPECT_TRUE(torch::equal(make_metric("accuracy", categorical).per_example(logits, one_hot),
                           torch::tensor({1.f, 0.f, 0.f})));
  LossOptions binary;
  binary.kind = LossKind::kBinaryCrossentropy;
  // Logits are thresholded at 0.
  EXPECT_TRUE(torch::equal(
      make_metric("accuracy", binary)
          .per_example(torch::tensor({{0.3}, {-0.2}, {-4.0}}), torch::tensor({1.0, 1.0, 0.0})),
      torch::tensor({1.f, 0.f, 1.f})));
  EXPECT_NE(error_of([&] { make_metric("f1", sparse); }).find("metric \"f1\" is not available"),
            std::string::npos);
  EXPECT_EQ(error_of([&] { make_metric("sparse_top_k_categorical_accuracy@0", sparse); }),
            "metric \"sparse_top_k_categorical_accuracy@0\": write k as "
            "sparse_top_k_categorical_accuracy@3 (k >= 1)");
}

// make_optimizer's SGD updates each group's tensors together (multi-tensor kernels on CUDA):
// the same numbers and state as LibTorch's SGD, step after step, with or without momentum,
// Nesterov and weight decay, with a parameter that has no gradient in some steps, and with a
// second parameter group at another learning rate.
// The same three tensors twice, one set for each optimizer under comparison.
struct Twins {
  std::vector<torch::Tensor> ours, theirs;
};
Twins twin_parameters() {
  Twins t;
  for (auto shape : {std::vector<std::int64_t>{4, 3}, {3}, {2, 2, 2}}) {
    t.ours.push_back(torch::randn(shape).requires_grad_());
    t.theirs.push_back(t.ours.back().detach().clone().requires_grad_());
  }
  return t;
}

// `p` as a second parameter group of `optimizer`, with the first group's options but `lr`.
void add_group(torch::optim::Optimizer& optimizer, const torch::Tensor& p, double lr) {
  optimizer.add_param_group(
      torch::optim::OptimizerParamGroup({p}, optimizer.param_groups()[0].options().clone()));
  optimizer.param_groups()[1].options().set_lr(lr);
}

// `steps` steps of `a` on twins.ours and `b` on twins.theirs, the same loss for both; the
// second tensor joins only from the third step, so its state starts later. torch::equal after
// every step.
void expect_equal_steps(torch::optim::Optimizer& a, torch::optim::Optimizer& b, Twins& twins,
                        int steps, const std::string& what) {
  for (int step = 0; step < steps; ++step) {
    a.zero_grad();
    b.zero_grad();
    const auto data = torch::randn({3});
    for (auto* params : {&twins.ours, &twins.theirs}) {
      auto loss = ((*params)[0].sum(0) * data).pow(2).sum() + (*params)[2].sin().sum();
      if (step >= 2) loss = loss + ((*params)[1] * data).sum();
      loss.backward();
    }
    a.step();
    b.step();
    for (std::size_t i = 0; i < twins.ours.size(); ++i) {
      ASSERT_TRUE(torch::equal(twins.ours[i], twins.theirs[i]))
          << what << " step " << step << " tensor " << i;
    }
  }
}

TEST(Optimizers, SgdMatchesLibTorchsBitForBit) {
  for (double momentum : {0.0, 0.9}) {
    for (bool nesterov : {false, true}) {
      if (nesterov && momentum == 0) continue;
      for (double decay : {0.0, 1e-3}) {
        torch::manual_seed(3);
        Twins t = twin_parameters();
        OptimizerOptions o = OptimizerOptions::sgd(0.05, momentum, nesterov);
        o.weight_decay = decay;
        auto a = make_optimizer(o, {t.ours[0], t.ours[1]});
        add_group(*a, t.ours[2], 0.2);
        torch::optim::SGD b(
            {t.theirs[0], t.theirs[1]},
            torch::optim::SGDOptions(0.05).momentum(momentum).nesterov(nesterov).weight_decay(
                decay));
        add_group(b, t.theirs[2], 0.2);
        std::ostringstream what;
        what << "momentum " << momentum << " nesterov " << nesterov << " decay " << decay;
        expect_equal_steps(*a, b, t, 5, what.str());
        if (::testing::Test::HasFatalFailure()) return;
        EXPECT_EQ(a->state().size(), momentum == 0 ? 0u : 3u);
        for (std::size_t i = 0; momentum != 0 && i < t.ours.size(); ++i) {
          const auto& mine = static_cast<torch::optim::SGDParamState&>(
              *a->state().at(t.ours[i].unsafeGetTensorImpl()));
          const auto& ref = static_cast<torch::optim::SGDParamState&>(
              *b.state().at(t.theirs[i].unsafeGetTensorImpl()));
          EXPECT_TRUE(torch::equal(mine.momentum_buffer(), ref.momentum_buffer()));
        }
      }
    }
  }
}

// The foreach Adam and AdamW against LibTorch's own: torch::equal after every step, with and
// without weight decay and AMSGrad, a parameter joining at the third step (its step count, so
// its bias corrections, lag the others'), and two groups of different learning rates.
template <typename Reference, typename Options, typename State>
void expect_adam_matches(bool decoupled) {
  for (double decay : {0.0, 0.05}) {
    for (bool amsgrad : {false, true}) {
      torch::manual_seed(5);
      Twins t = twin_parameters();
      OptimizerOptions o =
          decoupled ? OptimizerOptions::adamw(0.01, decay) : OptimizerOptions::adam(0.01);
      o.weight_decay = decay;
      o.amsgrad = amsgrad;
      auto a = make_optimizer(o, {t.ours[0], t.ours[1]});
      add_group(*a, t.ours[2], 0.03);
      Reference b({t.theirs[0], t.theirs[1]}, Options(0.01)
                                                  .betas({o.beta_1, o.beta_2})
                                                  .eps(o.epsilon)
                                                  .weight_decay(decay)
                                                  .amsgrad(amsgrad));
      add_group(b, t.theirs[2], 0.03);
      std::ostringstream what;
      what << (decoupled ? "AdamW" : "Adam") << " decay " << decay << " amsgrad " << amsgrad;
      expect_equal_steps(*a, b, t, 6, what.str());
      if (::testing::Test::HasFatalFailure()) return;
      for (std::size_t i = 0; i < t.ours.size(); ++i) {
        const auto& mine = static_cast<State&>(*a->state().at(t.ours[i].unsafeGetTensorImpl()));
        const auto& ref = static_cast<State&>(*b.state().at(t.theirs[i].unsafeGetTensorImpl()));
        EXPECT_EQ(mine.step(), ref.step()) << "tensor " << i;
        EXPECT_TRUE(torch::equal(mine.exp_avg(), ref.exp_avg())) << "tensor " << i;
        EXPECT_TRUE(torch::equal(mine.exp_avg_sq(), ref.exp_avg_sq())) << "tensor " << i;
        EXPECT_EQ(mine.max_exp_avg_sq().defined(), amsgrad);
        if (amsgrad) EXPECT_TRUE(torch::equal(mine.max_exp_avg_sq(), ref.max_exp_avg_sq()));
      }
      EXPECT_EQ(static_cast<State&>(*a->state().at(t.ours[1].unsafeGetTensorImpl())).step(), 4);
    }
  }
}

TEST(Optimizers, AdamAndAdamWMatchLibTorchsBitForBit) {
  expect_adam_matches<torch::optim::Adam, torch::optim::AdamOptions, torch::optim::AdamParamState>(
      false);
  expect_adam_matches<torch::optim::AdamW, torch::optim::AdamWOptions,
                      torch::optim::AdamWParamState>(true);
}

TEST(Optimizers, BuildLibTorchsWithKerasDefaultsAndFollowTheSchedule) {
  auto w = torch::zeros({3}, torch::requires_grad());
  auto adam = make_optimizer(OptimizerOptions::adam(), {w});
  const auto* adam_options =
      dynamic_cast<const torch::optim::AdamOptions*>(&adam->param_groups()[0].options());
  ASSERT_NE(adam_options, nullptr);
  EXPECT_DOUBLE_EQ(adam_options->eps(), 1e-7);
  EXPECT_DOUBLE_EQ(adam_options->lr(), 0.001);
  auto adamw = make_optimizer(OptimizerOptions::adamw(0.01), {w});
  EXPECT_NE(dynamic_cast<torch::optim::AdamW*>(adamw.get()), nullptr);
  set_learning_rate(*adamw, 0.5);
  EXPECT_DOUBLE_EQ(adamw->param_groups()[0].options().get_lr(), 0.5);

  struct Halving : LearningRateSchedule {
    double operator()(std::int64_t step) const override { return 1.0 / (1 << step); }
    std::string describe() const override { return "Halving"; }
  };
  OptimizerOptions sgd = OptimizerOptions::sgd(0.1, 0.9, true);
  sgd.schedule = std::make_shared<Halving>();
  EXPECT_DOUBLE_EQ(sgd.learning_rate_at(3), 0.125);
  EXPECT_EQ(sgd.describe(), "SGD(learning_rate=Halving, momentum=0.9, nesterov=true)");
  EXPECT_EQ(error_of([] { validate(OptimizerOptions::sgd(0.1, 0, true)); }),
            "Nesterov momentum needs momentum > 0; saw momentum 0");
  EXPECT_EQ(error_of([] { validate(OptimizerOptions::sgd(-1)); }),
            "learning rate must be positive; saw -1.000000");
  EXPECT_EQ(error_of([] { parse_optimizer("lamb"); }),
            "optimizer \"lamb\" is not available; use sgd, adam or adamw");
}

TEST(MixedPrecision, AutocastComputesInTheDtypeOnlyInsideTheGuard) {
  const auto a = torch::randn({4, 4});
  const auto b = torch::randn({4, 4});
  {
    AutocastGuard guard(Policy::kMixedBFloat16, torch::kCPU);
    EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kBFloat16);
    {
      AutocastGuard inner(Policy::kFloat32, torch::kCPU); // float32 changes nothing
      EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kBFloat16);
    }
  }
  EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kFloat32);
  EXPECT_EQ(parse_policy("mixed_bfloat16"), Policy::kMixedBFloat16);
  EXPECT_EQ(error_of([] { parse_policy("fp16"); }),
            "precision policy \"fp16\" is not available; use float32, mixed_float16 or "
            "mixed_bfloat16");
}

TEST(MixedPrecision, DynamicLossScaleHalvesOnOverflowAndDoublesAfterTheInterval) {
  LossScale scale(LossScaleOptions{true, 32768, 3});
  EXPECT_FALSE(scale.update(false));
  EXPECT_EQ(scale.scale(), 16384);
  EXPECT_TRUE(scale.update(true));
  EXPECT_TRUE(scale.update(true));
  EXPECT_EQ(scale.scale(), 16384);
  EXPECT_TRUE(scale.update(true)); // the third finite step in a row
  EXPECT_EQ(scale.scale(), 32768);
  EXPECT_EQ(scale.good_steps(), 0);
  LossScale tiny(LossScaleOptions{true, 1, 2000});
  tiny.update(false);
  EXPECT_EQ(tiny.scale(), 1); // never below 1
  LossScale fixed(LossScaleOptions{false, 128, 1});
  EXPECT_FALSE(fixed.update(false));
  EXPECT_TRUE(fixed.update(true));
  EXPECT_EQ(fixed.scale(), 128);
}

} // namespace
} // namespace flotilla::train
