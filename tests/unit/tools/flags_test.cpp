// The CLI's table of flags for API names: messages get the flag beside each name the CLI has one
// for, the doctor's settings become the flags that make them, and log lines are rewritten the
// same way once the CLI sets the hook.
#include "tools/flotilla/flags.h"

#include <gtest/gtest.h>

#include <chrono>
#include <limits>
#include <set>

#include "flotilla/error.h"
#include "flotilla/log.h"
#include "flotilla/strategy/strategy.h"
#include "flotilla/train/sidecar_evaluator.h"
#include "support/subprocess.h"

namespace flotilla::tools {
namespace {

using profile::Setting;

TEST(Flags, MessagesGetTheFlagBesideEachApiName) {
  EXPECT_EQ(with_flags("the input ran out; set FitOptions::steps_per_epoch to the steps you want"),
            "the input ran out; set FitOptions::steps_per_epoch (--steps-per-epoch) to the steps "
            "you want");
  // Inside parentheses the flag joins them; a call keeps its arguments.
  EXPECT_EQ(with_flags("no GPU is visible; use the CPU (strategy::parse_devices(\"cpu\"))"),
            "no GPU is visible; use the CPU (strategy::parse_devices(\"cpu\"), --devices)");
  EXPECT_EQ(with_flags("a call with a ) in quotes: strategy::parse_devices(\"(\") here"),
            "a call with a ) in quotes: strategy::parse_devices(\"(\") (--devices) here");
  // A namespace before the name; several names; each at its place.
  EXPECT_EQ(
      with_flags("train::CompileOptions::jit_compile and CompileOptions::steps_per_execution"),
      "train::CompileOptions::jit_compile (--jit-compile) and "
      "CompileOptions::steps_per_execution (--steps-per-execution)");
  EXPECT_EQ(with_flags("FitOptions::epochs: 0"), "FitOptions::epochs (--epochs): 0");
  EXPECT_EQ(with_flags("ends with CommunicationOptions::timeout"),
            "ends with CommunicationOptions::timeout (--timeout)");
  // Only whole names; what is already said stays as it is; words without names unchanged.
  EXPECT_EQ(with_flags("FitOptions::epochs_done and MyFitOptions::epochs"),
            "FitOptions::epochs_done and MyFitOptions::epochs");
  EXPECT_EQ(with_flags("(FitOptions::epochs, --epochs) and FitOptions::epochs (--epochs)"),
            "(FitOptions::epochs, --epochs) and FitOptions::epochs (--epochs)");
  EXPECT_EQ(with_flags("fit() needs compile() first"), "fit() needs compile() first");
  EXPECT_EQ(with_flags(""), "");
}

TEST(Flags, TheOtherModulesNamesHaveTheirFlags) {
  // The names src/train and src/collective use in their messages, as the CLI shows them.
  const std::pair<const char*, const char*> expected[] = {
      {"FitOptions::steps_per_epoch", "--steps-per-epoch"},
      {"FitOptions::epochs", "--epochs"},
      {"CompileOptions::jit_compile", "--jit-compile"},
      {"CompileOptions::gradient_accumulation_steps", "--accumulation-steps"},
      {"CompileOptions::steps_per_execution", "--steps-per-execution"},
      {"CommunicationOptions::implementation", "--implementation"},
      {"CommunicationOptions::timeout", "--timeout"},
      {"CommunicationOptions::bytes_per_pack", "--bytes-per-pack"},
  };
  for (const auto& [api, flag] : expected) {
    EXPECT_EQ(with_flags(std::string("set ") + api), std::string("set ") + api + " (" + flag + ")");
  }
  // No flag sets these: the name stays alone rather than pointing at a wrong flag.
  EXPECT_EQ(flag_for("FitOptions::initial_epoch"), nullptr);
  EXPECT_EQ(flag_for("FitOptions::validation_freq"), nullptr);
  EXPECT_EQ(with_flags("FitOptions::validation_freq is 0"), "FitOptions::validation_freq is 0");
}

TEST(Flags, OneEntryPerApiNameAndEveryFlagSpelledAsAFlagOrCommand) {
  std::set<std::string> seen;
  for (const auto& entry : flag_table()) {
    EXPECT_TRUE(seen.insert(entry.api).second) << "twice: " << entry.api;
    const std::string flag = entry.flag;
    EXPECT_TRUE(flag.rfind("--", 0) == 0 || flag.rfind("flotilla ", 0) == 0) << flag;
    EXPECT_NE(std::string(entry.api).find("::"), std::string::npos) << entry.api;
  }
}

TEST(Flags, LibraryMessagesAsTheCliPrintsThem) {
  // The evaluator's TimeoutError, from the library, then through the table.
  testing::TempDir dir;
  strategy::MirroredStrategy strategy;
  train::Model model(strategy, torch::nn::Sequential(torch::nn::Linear(2, 2)));
  model.compile({});
  train::SidecarEvaluatorOptions options;
  options.checkpoint_dir = dir.path();
  options.timeout = std::chrono::milliseconds(0);
  options.poll_interval = std::chrono::milliseconds(1);
  const auto data = data::Dataset::from_tensor_slices({torch::zeros({4, 2}), torch::zeros({4})});
  try {
    train::SidecarEvaluator(model, data.batch(2), options).start();
    ADD_FAILURE() << "no TimeoutError";
  } catch (const TimeoutError& e) {
    EXPECT_NE(with_flags(e.what()).find("(SidecarEvaluatorOptions::timeout, --timeout)"),
              std::string::npos)
        << with_flags(e.what());
  }
}

TEST(Flags, SettingsBecomeTheFlagsThatMakeThem) {
  EXPECT_EQ(setting_as_flag({"train::set_global_policy", "mixed_bfloat16"}),
            "--precision mixed_bfloat16");
  EXPECT_EQ(setting_as_flag({"CompileOptions::jit_compile", "true"}), "--jit-compile");
  EXPECT_EQ(setting_as_flag({"CompileOptions::jit_compile", "false"}), "without --jit-compile");
  EXPECT_EQ(setting_as_flag({"CommunicationOptions::overlap", "true"}), "without --no-overlap");
  EXPECT_EQ(setting_as_flag({"CommunicationOptions::overlap", "false"}), "--no-overlap");
  EXPECT_EQ(setting_as_flag({"CommunicationOptions::bytes_per_pack", "262144"}),
            "--bytes-per-pack 262144");
  EXPECT_EQ(setting_as_flag({"CommunicationOptions::compression", "bf16"}), "--compression bf16");
  EXPECT_EQ(setting_as_flag({"torch::set_num_threads", "8"}), "--threads 8");
  EXPECT_EQ(setting_as_flag({"RecipeFacts::batch_per_replica", "4096"}),
            "--batch-per-replica 4096");
  EXPECT_EQ(setting_as_flag({"OptimizerOptions::learning_rate", "0.16"}), "--lr 0.16");
  // Updates become epochs of them, when the epoch is known; otherwise API terms.
  EXPECT_EQ(setting_as_flag({"CosineDecayOptions::warmup_steps", "100"}, 100), "--warmup-epochs 1");
  EXPECT_EQ(setting_as_flag({"CosineDecayOptions::warmup_steps", "50"}, 100),
            "--warmup-epochs 0.5");
  EXPECT_EQ(setting_as_flag({"CosineDecayOptions::warmup_steps", "100"}),
            "CosineDecayOptions::warmup_steps = 100");
  // No flag, or a value the flag cannot say: API terms.
  EXPECT_EQ(setting_as_flag({"data::Options::private_threadpool_size", "4"}),
            "data::Options::private_threadpool_size = 4");
  EXPECT_EQ(setting_as_flag({"CompileOptions::jit_compile", "maybe"}),
            "CompileOptions::jit_compile = maybe");
}

TEST(Flags, TheDoctorsFindingsAsTheCliShowsThem) {
  profile::Finding f;
  f.item = "learning rate";
  f.status = profile::Finding::Status::kAct;
  f.settings = {{"CosineDecayOptions::warmup_steps", "30"}};
  f.recommendation = "a linear warmup over the first epoch (train::CosineDecay)";
  EXPECT_EQ(profile::format_recommendation(f, cli_findings_format(30)),
            "--warmup-epochs 1: a linear warmup over the first epoch (train::CosineDecay, "
            "--schedule cosine)");
  EXPECT_EQ(profile::format_recommendation(f),
            "CosineDecayOptions::warmup_steps = 30: a linear warmup over the first epoch "
            "(train::CosineDecay)");
}

TEST(Flags, TheLogRewriteHookShowsTheFlagOnLogLines) {
  set_log_rewrite(with_flags);
  ::testing::internal::CaptureStderr();
  Logger(0, 2).warn("the input ran out; set FitOptions::steps_per_epoch");
  set_log_rewrite({});
  Logger(0, 2).warn("as written: FitOptions::steps_per_epoch");
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(err, "[worker 0/2] warning: the input ran out; set FitOptions::steps_per_epoch "
                 "(--steps-per-epoch)\n"
                 "[worker 0/2] warning: as written: FitOptions::steps_per_epoch\n");
}

// A duration flag (--timeout, --heartbeat-timeout, --grace) is a finite number of seconds up to
// a week; inf or 1e300 used to become an undefined conversion (an expel-everyone timeout).
TEST(Flags, SecondsAreAFiniteDurationOfUpToAWeek) {
  using std::chrono::milliseconds;
  EXPECT_EQ(seconds_flag(1.5, "--timeout"), milliseconds(1500));
  EXPECT_EQ(seconds_flag(0.0001, "--timeout"), milliseconds(1)); // never rounded to nothing
  EXPECT_EQ(seconds_flag(604800, "--timeout"), milliseconds(604800000));
  for (const double bad : {0.0, -1.0, std::numeric_limits<double>::infinity(),
                           std::numeric_limits<double>::quiet_NaN(), 1e300, 604801.0}) {
    try {
      seconds_flag(bad, "--heartbeat-timeout");
      ADD_FAILURE() << "accepted " << bad;
    } catch (const ConfigError& e) {
      EXPECT_EQ(std::string(e.what()).rfind("--heartbeat-timeout takes a number of seconds above "
                                            "0 and at most a week (604800); saw ",
                                            0),
                0u)
          << e.what();
    }
  }
  try {
    seconds_flag(std::numeric_limits<double>::infinity(), "--heartbeat-timeout");
    ADD_FAILURE() << "accepted inf";
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(), "--heartbeat-timeout takes a number of seconds above 0 and at most a "
                           "week (604800); saw inf");
  }
}

// CLI11's PositiveNumber and Range let NaN through, so `flotilla train --lr nan` trained (the
// recipe took NaN as "unset"); every numeric flag now takes finite numbers only.
TEST(Flags, NumericFlagsTakeFiniteNumbersOnly) {
  const auto parse = [](CLI::Validator check, const std::string& value) {
    CLI::App app("test");
    double x = 0;
    app.add_option("--x", x)->check(check);
    try {
      app.parse("--x " + value, false);
    } catch (const CLI::ParseError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_EQ(parse(positive_number(10), "nan"),
            "--x: takes a finite number above 0 and at most 10; saw nan");
  EXPECT_EQ(parse(positive_number(10), "inf"),
            "--x: takes a finite number above 0 and at most 10; saw inf");
  EXPECT_EQ(parse(positive_number(10), "0"),
            "--x: takes a finite number above 0 and at most 10; saw 0");
  EXPECT_EQ(parse(positive_number(10), "1e-3"), "accepted");
  EXPECT_EQ(parse(positive_number(10), "10"), "accepted");
  EXPECT_EQ(parse(positive_number(10), "10.5"),
            "--x: takes a finite number above 0 and at most 10; saw 10.5");
  EXPECT_EQ(parse(non_negative_number(10), "-1"),
            "--x: takes a finite number at least 0 and at most 10; saw -1");
  EXPECT_EQ(parse(non_negative_number(10), "0"), "accepted");
  EXPECT_EQ(parse(number_in(0, 0.999), "NaN"),
            "--x: takes a finite number from 0 to 0.999; saw NaN");
  EXPECT_EQ(parse(number_in(1, 1 << 20), "2000000"),
            "--x: takes a finite number from 1 to 1048576; saw 2000000");
  EXPECT_EQ(parse(number_in(0.1, 3600), "0.1"), "accepted");
}

} // namespace
} // namespace flotilla::tools
