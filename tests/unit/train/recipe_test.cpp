// The library's recipe: linear scaling, warmup then cosine decay over the run, the precision
// choice flotilla train and flotilla tune share, and the errors it gives.
#include <gtest/gtest.h>

#include <limits>

#include <cmath>

#include "flotilla/error.h"
#include "flotilla/train/recipe.h"
#include "flotilla/train/schedules.h"

namespace flotilla::train {
namespace {

TEST(Recipe, ScalesTheRateLinearlyWarmsUpForAnEpochThenDecaysToZeroAtTheRunsEnd) {
  RecipeOptions options;
  options.precision = "float32";
  options.base_lr = 0.02;
  options.base_batch = 32;
  options.epochs = 3;
  const Recipe r = make_recipe(options, /*global_batch=*/128, /*steps_per_epoch=*/50,
                               torch::Device(torch::kCPU));
  EXPECT_EQ(r.policy, Policy::kFloat32);
  EXPECT_DOUBLE_EQ(r.peak_lr, 0.08); // 0.02 x 128 / 32
  EXPECT_EQ(r.total_steps, 150);
  EXPECT_EQ(r.warmup_steps, 50); // one epoch, as more than one is trained
  ASSERT_TRUE(r.optimizer.schedule);
  const auto& schedule = *r.optimizer.schedule;
  EXPECT_DOUBLE_EQ(schedule(0), 0.0);
  EXPECT_NEAR(schedule(25), 0.04, 1e-12);
  EXPECT_NEAR(schedule(50), 0.08, 1e-12);
  EXPECT_NEAR(schedule(100), 0.04, 1e-12); // half-way through the cosine
  EXPECT_NEAR(schedule(150), 0.0, 1e-12);
  EXPECT_EQ(r.optimizer.kind, OptimizerKind::kSGD);
  EXPECT_DOUBLE_EQ(r.optimizer.momentum, 0.9);
  ASSERT_EQ(r.lines.size(), 3u);
  EXPECT_EQ(r.lines[1], "linear LR scaling: 0.02 x 128 / 32 = 0.08");
}

TEST(Recipe, AGivenRateIsNotScaledAndAccumulationCountsUpdatesNotBatches) {
  RecipeOptions options;
  options.precision = "float32";
  options.lr = 0.5;
  options.epochs = 2;
  options.warmup_epochs = 0;
  options.accumulation_steps = 4;
  options.optimizer = "adamw";
  const Recipe r = make_recipe(options, 64, 40, torch::Device(torch::kCPU));
  EXPECT_DOUBLE_EQ(r.peak_lr, 0.5);
  EXPECT_EQ(r.total_steps, 20);
  EXPECT_EQ(r.warmup_steps, 0);
  EXPECT_NEAR((*r.optimizer.schedule)(0), 0.5, 1e-12);
  EXPECT_DOUBLE_EQ(r.optimizer.weight_decay, 0.004); // AdamW's default
}

TEST(Recipe, AutoPrecisionIsTheFastestPolicyForTheDevice) {
  const auto [policy, line] = choose_precision("auto", torch::Device(torch::kCPU));
  EXPECT_EQ(policy, fastest_policy(torch::Device(torch::kCPU)));
  EXPECT_EQ(policy, cpu_has_native_bf16() ? Policy::kMixedBFloat16 : Policy::kFloat32);
  EXPECT_NE(line.find(to_string(policy) == "float32" ? "off, float32" : "mixed_bfloat16"),
            std::string::npos)
      << line;
  EXPECT_EQ(choose_precision("mixed_float16", torch::Device(torch::kCPU)).first,
            Policy::kMixedFloat16);
}

TEST(Recipe, NamesItDoesNotKnowAndAWarmupLeavingNothingToDecayAreRefused) {
  RecipeOptions options;
  options.precision = "float8";
  EXPECT_THROW(make_recipe(options, 32, 10, torch::Device(torch::kCPU)), ConfigError);
  options.precision = "float32";
  options.schedule = "step";
  EXPECT_THROW(make_recipe(options, 32, 10, torch::Device(torch::kCPU)), ConfigError);
  options.schedule = "cosine";
  options.warmup_epochs = 1;
  try {
    make_recipe(options, 32, 10, torch::Device(torch::kCPU));
    FAIL() << "a warmup of the whole single epoch was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("leaves no steps to decay over"), std::string::npos)
        << e.what();
  }
}

// NaN is not "unset": before, an lr of NaN fell through to the scaled rate (every comparison with
// NaN is false), and a weight decay or warmup of NaN to its default, and the run trained.
TEST(Recipe, NanInfAndNegativeNumbersAreRefusedNotTakenAsUnset) {
  const auto error = [](auto set) {
    RecipeOptions options;
    options.precision = "float32";
    options.epochs = 2;
    set(options);
    try {
      make_recipe(options, 32, 10, torch::Device(torch::kCPU));
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_EQ(error([&](RecipeOptions& o) { o.lr = nan; }),
            "make_recipe: RecipeOptions::lr must be a finite rate above 0 (or 0: base_lr, "
            "scaled); saw nan");
  EXPECT_EQ(error([&](RecipeOptions& o) { o.lr = inf; }),
            "make_recipe: RecipeOptions::lr must be a finite rate above 0 (or 0: base_lr, "
            "scaled); saw inf");
  EXPECT_EQ(error([&](RecipeOptions& o) { o.base_lr = nan; }),
            "make_recipe: RecipeOptions::base_lr must be a finite rate above 0; saw nan");
  EXPECT_EQ(error([&](RecipeOptions& o) { o.warmup_epochs = nan; }),
            "make_recipe: RecipeOptions::warmup_epochs must be a finite number of epochs at "
            "least 0 (or -1: the default); saw nan");
  EXPECT_EQ(error([&](RecipeOptions& o) { o.weight_decay = nan; }),
            "make_recipe: RecipeOptions::weight_decay must be a finite number at least 0 (or -1: "
            "the optimizer's default); saw nan");
  EXPECT_EQ(error([&](RecipeOptions& o) { o.weight_decay = -0.5; }),
            "make_recipe: RecipeOptions::weight_decay must be a finite number at least 0 (or -1: "
            "the optimizer's default); saw -0.5");
  EXPECT_EQ(error([&](RecipeOptions& o) { o.momentum = nan; }),
            "make_recipe: RecipeOptions::momentum must be in [0, 1); saw nan");
  EXPECT_EQ(error([&](RecipeOptions& o) { o.global_clipnorm = inf; }),
            "make_recipe: RecipeOptions::global_clipnorm must be a finite number at least 0 (0: "
            "no clipping); saw inf");
  // The defaults and plain values still make a recipe.
  EXPECT_EQ(error([](RecipeOptions& o) {
              o.lr = 0.1;
              o.base_lr = 0;
              o.weight_decay = 0;
            }),
            "accepted");
}

} // namespace
} // namespace flotilla::train
