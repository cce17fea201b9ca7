// Learning-rate schedules: every value TensorFlow computed for tests/fixtures/lr_schedules.json
// (fixtures/make_lr_schedule_fixtures.py), Keras's branches spelled out, describe(),
// warnings() and each ConfigError.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "flotilla/error.h"
#include "flotilla/train/schedules.h"
#include "support/paths.h"

namespace flotilla::train {
namespace {

using nlohmann::json;

std::string fixture(const std::string& name) {
  return flotilla::testing::test_bin_dir() + "/fixtures/" + name;
}

json load_fixture() {
  std::ifstream in(fixture("lr_schedules.json"));
  if (!in) throw std::runtime_error("cannot open " + fixture("lr_schedules.json"));
  return json::parse(in);
}

// A schedule from the fixture's class name and Keras keyword arguments (Keras's defaults for
// the ones left out).
std::unique_ptr<LearningRateSchedule> from_keras(const std::string& cls, const json& args) {
  if (cls == "CosineDecay") {
    CosineDecayOptions o;
    o.initial_learning_rate = args.at("initial_learning_rate").get<double>();
    o.decay_steps = args.at("decay_steps").get<std::int64_t>();
    o.alpha = args.value("alpha", 0.0);
    if (args.contains("warmup_target") && !args.at("warmup_target").is_null()) {
      o.warmup_target = args.at("warmup_target").get<double>();
    }
    o.warmup_steps = args.value("warmup_steps", std::int64_t{0});
    return std::make_unique<CosineDecay>(o);
  }
  if (cls == "PiecewiseConstantDecay") {
    return std::make_unique<PiecewiseConstantDecay>(
        args.at("boundaries").get<std::vector<std::int64_t>>(),
        args.at("values").get<std::vector<double>>());
  }
  if (cls == "ExponentialDecay") {
    return std::make_unique<ExponentialDecay>(
        args.at("initial_learning_rate").get<double>(), args.at("decay_steps").get<std::int64_t>(),
        args.at("decay_rate").get<double>(), args.value("staircase", false));
  }
  throw std::runtime_error("fixture names an unknown schedule class " + cls);
}

// TensorFlow computes in float32 and we in double. Relative to the value, float32 rounding
// reaches 1e-3 where the cosine nears 0 (1 + cos(x) cancels) and 2e-6 where decay_rate's
// float32 rounding is raised to a power of 100; relative to the schedule's largest rate the
// difference stays below 2e-7. So: within 1e-6 of the larger of the value and that peak.
TEST(LrScheduleFixture, EveryValueMatchesTensorFlow) {
  const json fx = load_fixture();
  ASSERT_EQ(fx.at("dtype"), "float32");
  std::set<std::string> classes;
  int checked = 0;
  for (const json& entry : fx.at("schedules")) {
    const std::string name = entry.at("name");
    const std::string cls = entry.at("class");
    classes.insert(cls);
    const auto schedule = from_keras(cls, entry.at("args"));
    double peak = 0;
    for (const json& pair : entry.at("values"))
      peak = std::max(peak, std::abs(pair[1].get<double>()));
    for (const json& pair : entry.at("values")) {
      const auto step = pair[0].get<std::int64_t>();
      const double expected = pair[1].get<double>();
      const double got = (*schedule)(step);
      const double tolerance = 1e-6 * std::max(std::abs(expected), peak);
      EXPECT_NEAR(got, expected, tolerance)
          << name << " (" << schedule->describe() << ") at step " << step << "; TensorFlow "
          << fx.at("tensorflow_version").get<std::string>();
      ++checked;
    }
  }
  EXPECT_EQ(classes,
            (std::set<std::string>{"CosineDecay", "PiecewiseConstantDecay", "ExponentialDecay"}));
  EXPECT_GE(checked, 100);
}

// The seed program's call is in the fixture, and TensorFlow's values show that warmup_steps
// without warmup_target change nothing: they equal a plain cosine's.
TEST(LrScheduleFixture, SeedCaseIsAPlainCosineInTensorFlow) {
  const json fx = load_fixture();
  const json* seed = nullptr;
  for (const json& entry : fx.at("schedules")) {
    if (entry.at("name") == "cosine_warmup_steps_without_target") seed = &entry;
  }
  ASSERT_NE(seed, nullptr);
  const json& args = seed->at("args");
  ASSERT_GT(args.at("warmup_steps").get<int>(), 0);
  ASSERT_FALSE(args.contains("warmup_target"));
  const CosineDecay plain(
      {args.at("initial_learning_rate").get<double>(), args.at("decay_steps").get<std::int64_t>()});
  for (const json& pair : seed->at("values")) {
    const double expected = pair[1].get<double>();
    EXPECT_NEAR(plain(pair[0].get<std::int64_t>()), expected, 1e-6 * 0.016) << pair.dump();
  }
  EXPECT_FALSE(from_keras("CosineDecay", args)->warnings().empty());
}

// Keras's branches, spelled out.

TEST(CosineDecay, DecaysToAlphaAndStaysThere) {
  const CosineDecay s({0.1, 100, 0.2});
  EXPECT_DOUBLE_EQ(s(0), 0.1);
  EXPECT_NEAR(s(50), 0.1 * (0.8 * 0.5 + 0.2), 1e-15);
  EXPECT_NEAR(s(100), 0.02, 1e-15);
  EXPECT_NEAR(s(101), 0.02, 1e-15);
  EXPECT_NEAR(s(1000000), 0.02, 1e-15);
}

TEST(CosineDecay, WarmsUpLinearlyToTargetThenDecaysFromIt) {
  CosineDecayOptions o{0.0, 1000};
  o.warmup_target = 0.016;
  o.warmup_steps = 200;
  const CosineDecay s(o);
  EXPECT_DOUBLE_EQ(s(0), 0.0);
  EXPECT_NEAR(s(100), 0.008, 1e-15);
  EXPECT_NEAR(s(199), 0.016 * 199 / 200, 1e-15);
  EXPECT_DOUBLE_EQ(s(200), 0.016); // warmup ends exactly at the peak
  EXPECT_NEAR(s(700), 0.008, 1e-15);
  EXPECT_NEAR(s(1200), 0.0, 1e-15); // clamped at decay_steps + warmup_steps
  EXPECT_NEAR(s(5000), 0.0, 1e-15);
}

TEST(CosineDecay, WarmupStepsWithoutTargetAreIgnored) {
  CosineDecayOptions seed{0.016, 1000};
  seed.warmup_steps = 200;
  const CosineDecay with(seed), without({0.016, 1000});
  for (std::int64_t step : {0, 1, 100, 199, 200, 201, 500, 999, 1000, 1100, 1200, 5000}) {
    EXPECT_EQ(with(step), without(step)) << step;
  }
  EXPECT_DOUBLE_EQ(with(0), 0.016);    // no warmup: the peak from the first step
  EXPECT_NEAR(with(1000), 0.0, 1e-15); // and the decay ends at decay_steps
}

TEST(CosineDecay, TargetWithoutWarmupStepsDecaysFromTarget) {
  CosineDecayOptions o{0.5, 100};
  o.warmup_target = 0.1;
  const CosineDecay s(o);
  EXPECT_DOUBLE_EQ(s(0), 0.1);
  EXPECT_NEAR(s(50), 0.05, 1e-15);
}

TEST(PiecewiseConstantDecay, BoundaryStepKeepsThePreviousValue) {
  const PiecewiseConstantDecay s({100, 200}, {1.0, 0.5, 0.1});
  EXPECT_EQ(s(0), 1.0);
  EXPECT_EQ(s(100), 1.0);
  EXPECT_EQ(s(101), 0.5);
  EXPECT_EQ(s(200), 0.5);
  EXPECT_EQ(s(201), 0.1);
  EXPECT_EQ(s(1000000), 0.1);
  const PiecewiseConstantDecay zero({0}, {0.01, 0.1});
  EXPECT_EQ(zero(0), 0.01);
  EXPECT_EQ(zero(1), 0.1);
}

TEST(ExponentialDecay, StaircaseFloorsTheExponent) {
  const ExponentialDecay smooth(0.4, 3, 0.5), stairs(0.4, 3, 0.5, true);
  EXPECT_DOUBLE_EQ(smooth(0), 0.4);
  EXPECT_DOUBLE_EQ(smooth(3), 0.2);
  EXPECT_NEAR(smooth(1), 0.4 * std::pow(0.5, 1.0 / 3), 1e-15);
  EXPECT_DOUBLE_EQ(stairs(0), 0.4);
  EXPECT_DOUBLE_EQ(stairs(2), 0.4);
  EXPECT_DOUBLE_EQ(stairs(3), 0.2);
  EXPECT_DOUBLE_EQ(stairs(5), 0.2);
  EXPECT_DOUBLE_EQ(stairs(6), 0.1);
}

TEST(ConstantLearningRate, SameAtEveryStep) {
  const ConstantLearningRate s(0.01);
  EXPECT_EQ(s(0), 0.01);
  EXPECT_EQ(s(123456789), 0.01);
  const std::shared_ptr<const LearningRateSchedule> any =
      std::make_shared<ConstantLearningRate>(0.5);
  EXPECT_EQ((*any)(7), 0.5);
}

TEST(LinearScaling, MatchesTheSeedsRule) {
  EXPECT_EQ(linear_scaling(1e-3, 512), 1e-3 * (512.0 / 32)); // Python's 0.016, bit for bit
  EXPECT_DOUBLE_EQ(linear_scaling(1e-3, 512), 0.016);
  EXPECT_DOUBLE_EQ(linear_scaling(0.1, 256, 256), 0.1);
  EXPECT_DOUBLE_EQ(linear_scaling(0.1, 64, 256), 0.025);
  EXPECT_DOUBLE_EQ(linear_scaling(1e-3, 384), 0.012); // 64 per replica x 3 workers x 2 GPUs
}

// describe()

TEST(ScheduleDescribe, OneLineWithEveryArgument) {
  CosineDecayOptions seed{linear_scaling(1e-3, 512), 1000};
  seed.warmup_steps = 200;
  EXPECT_EQ(CosineDecay(seed).describe(),
            "CosineDecay(initial_learning_rate=0.016, decay_steps=1000, alpha=0, "
            "warmup_target=none, warmup_steps=200)");
  CosineDecayOptions warm{0, 1000, 0.1, 0.016, 200};
  EXPECT_EQ(CosineDecay(warm).describe(),
            "CosineDecay(initial_learning_rate=0, decay_steps=1000, alpha=0.1, "
            "warmup_target=0.016, warmup_steps=200)");
  EXPECT_EQ(PiecewiseConstantDecay({100, 200}, {0.1, 0.05, 0.01}).describe(),
            "PiecewiseConstantDecay(boundaries=[100, 200], values=[0.1, 0.05, 0.01])");
  EXPECT_EQ(ExponentialDecay(0.1, 100, 0.96).describe(),
            "ExponentialDecay(initial_learning_rate=0.1, decay_steps=100, decay_rate=0.96, "
            "staircase=false)");
  EXPECT_EQ(ExponentialDecay(1e-4, 5, 0.5, true).describe(),
            "ExponentialDecay(initial_learning_rate=0.0001, decay_steps=5, decay_rate=0.5, "
            "staircase=true)");
  EXPECT_EQ(ConstantLearningRate(0.01).describe(), "ConstantLearningRate(learning_rate=0.01)");
  EXPECT_EQ(ConstantLearningRate(1.0 / 3).describe(),
            "ConstantLearningRate(learning_rate=0.3333333333333333)"); // reads back exactly
}

// warnings()

TEST(ScheduleWarnings, SeedsWarmupStepsWithoutTarget) {
  CosineDecayOptions seed{0.016, 1000};
  seed.warmup_steps = 200;
  const auto w = CosineDecay(seed).warnings();
  ASSERT_EQ(w.size(), 1u);
  const std::string& line = w[0];
  EXPECT_EQ(line.find('\n'), std::string::npos);
  for (const char* part :
       {"warmup_steps=200", "no effect without warmup_target", "no warmup",
        "warmup_target=<the peak> (here 0.016)",
        "initial_learning_rate=<the starting rate> (e.g. 0)", "decay_steps=1000"}) {
    EXPECT_NE(line.find(part), std::string::npos) << "missing \"" << part << "\" in: " << line;
  }
}

TEST(ScheduleWarnings, AbsentForOrdinaryConfigurations) {
  EXPECT_TRUE(CosineDecay({0.1, 1000}).warnings().empty());
  EXPECT_TRUE(CosineDecay({0.1, 1000, 0.1}).warnings().empty());
  EXPECT_TRUE(CosineDecay({0.0, 1000, 0.0, 0.016, 200}).warnings().empty());
  EXPECT_TRUE(CosineDecay({0.016, 1000, 0.0, 0.016, 0}).warnings().empty());
  EXPECT_TRUE(PiecewiseConstantDecay({10}, {0.1, 0.01}).warnings().empty());
  EXPECT_TRUE(PiecewiseConstantDecay({10}, {0.01, 0.1}).warnings().empty());
  EXPECT_TRUE(ExponentialDecay(0.1, 100, 0.96).warnings().empty());
  EXPECT_TRUE(ExponentialDecay(0.1, 100, 1.0).warnings().empty());
  EXPECT_TRUE(ConstantLearningRate(0.1).warnings().empty());
}

TEST(ScheduleWarnings, OtherConfigurationsThatDoNotDoWhatTheySay) {
  const auto target = CosineDecay({0.5, 100, 0.0, 0.1, 0}).warnings();
  ASSERT_EQ(target.size(), 1u);
  EXPECT_NE(target[0].find("initial_learning_rate=0.5 is never used"), std::string::npos)
      << target[0];
  const auto growth = ExponentialDecay(0.001, 1000, 1.5).warnings();
  ASSERT_EQ(growth.size(), 1u);
  EXPECT_NE(growth[0].find("decay_rate=1.5"), std::string::npos) << growth[0];
}

// ConfigError: the argument and the value seen.

std::string config_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "no ConfigError";
}

void expect_error(const std::function<void()>& f, std::initializer_list<const char*> parts) {
  const std::string message = config_error(f);
  for (const char* part : parts) {
    EXPECT_NE(message.find(part), std::string::npos)
        << "missing \"" << part << "\" in: " << message;
  }
}

TEST(ScheduleConfigErrors, LinearScaling) {
  expect_error([] { linear_scaling(0, 512); }, {"base_lr", "saw 0"});
  expect_error([] { linear_scaling(-0.1, 512); }, {"base_lr", "saw -0.1"});
  expect_error([] { linear_scaling(NAN, 512); }, {"base_lr", "nan"});
  expect_error([] { linear_scaling(0.1, 0); }, {"global_batch", "saw 0"});
  expect_error([] { linear_scaling(0.1, -64); }, {"global_batch", "saw -64"});
  expect_error([] { linear_scaling(0.1, 512, 0); }, {"base_batch", "saw 0"});
}

TEST(ScheduleConfigErrors, Constant) {
  expect_error([] { ConstantLearningRate{0}; }, {"learning_rate", "saw 0"});
  expect_error([] { ConstantLearningRate{-0.01}; }, {"learning_rate", "saw -0.01"});
  expect_error([] { ConstantLearningRate{INFINITY}; }, {"learning_rate", "inf"});
}

TEST(ScheduleConfigErrors, CosineDecay) {
  expect_error([] { CosineDecay({0.1, 0}); }, {"CosineDecay", "decay_steps", "saw 0"});
  expect_error([] { CosineDecay({0.1, -5}); }, {"decay_steps", "saw -5"});
  expect_error([] { CosineDecay({-0.1, 100}); }, {"initial_learning_rate", "saw -0.1"});
  expect_error([] { CosineDecay({NAN, 100}); }, {"initial_learning_rate", "nan"});
  expect_error([] { CosineDecay({0.1, 100, -0.1}); }, {"alpha", "[0, 1]", "saw -0.1"});
  expect_error([] { CosineDecay({0.1, 100, 1.5}); }, {"alpha", "saw 1.5"});
  expect_error([] { CosineDecay({0.1, 100, 0, -0.2, 10}); }, {"warmup_target", "saw -0.2"});
  expect_error([] { CosineDecay({0.1, 100, 0, 0.2, -10}); }, {"warmup_steps", "saw -10"});
  expect_error([] { CosineDecay({0.1, 100, 0, std::nullopt, -1}); }, {"warmup_steps", "saw -1"});
  // The edges are legal.
  EXPECT_NO_THROW(CosineDecay({0.0, 1, 1.0, 0.0, 0}));
}

TEST(ScheduleConfigErrors, PiecewiseConstantDecay) {
  expect_error(
      [] {
        PiecewiseConstantDecay({100, 200}, {0.1, 0.01});
      },
      {"PiecewiseConstantDecay", "values", "one longer than boundaries", "saw 2 values"});
  expect_error(
      [] {
        PiecewiseConstantDecay({100}, {0.1, 0.01, 0.001});
      },
      {"values", "saw 3 values [0.1, 0.01, 0.001]"});
  expect_error(
      [] {
        PiecewiseConstantDecay({200, 100}, {0.1, 0.05, 0.01});
      },
      {"boundaries", "strictly increasing", "saw [200, 100]"});
  expect_error(
      [] {
        PiecewiseConstantDecay({100, 100}, {0.1, 0.05, 0.01});
      },
      {"boundaries", "strictly increasing", "saw [100, 100]"});
  expect_error(
      [] {
        PiecewiseConstantDecay({-1, 100}, {0.1, 0.05, 0.01});
      },
      {"boundaries", ">= 0", "saw [-1, 100]"});
  expect_error([] { PiecewiseConstantDecay({}, {0.1}); }, {"boundaries", "ConstantLearningRate"});
  expect_error([] { PiecewiseConstantDecay({10}, {0.1, -0.01}); }, {"values", "saw [0.1, -0.01]"});
}

TEST(ScheduleConfigErrors, ExponentialDecay) {
  expect_error([] { ExponentialDecay(0.1, 0, 0.96); },
               {"ExponentialDecay", "decay_steps", "saw 0"});
  expect_error([] { ExponentialDecay(0.1, 100, 0); }, {"decay_rate", "saw 0"});
  expect_error([] { ExponentialDecay(0.1, 100, -0.5); }, {"decay_rate", "saw -0.5"});
  expect_error([] { ExponentialDecay(-1, 100, 0.5); }, {"initial_learning_rate", "saw -1"});
}

} // namespace
} // namespace flotilla::train
