// `flotilla doctor` and `flotilla tune --max-batch` as a user runs them: the report on a recorded
// run, on a real training run, the child's failure passed on, and the batch search's JSON.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "flotilla/error.h"
#include "flotilla/profile/run_summary.h"
#include "support/paths.h"
#include "support/subprocess.h"

namespace flotilla {
namespace {

using testing::run_process;
const std::string kCli = flotilla::testing::flotilla_cli();

const char* const kItems[] = {"input pipeline", "mixed precision",    "compiled step", "batch size",
                              "learning rate",  "threads per worker", "communication", "compute"};

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// A recorded run that is 40% input-bound on 2 CPU workers with the rest of the recipe in order.
profile::RunSummary input_bound_run() {
  profile::RunSummary run;
  auto& r = run.recipe;
  r.model = "mlp";
  r.workers = 2;
  r.batch_per_replica = 64;
  r.global_batch = 128;
  r.peak_memory_bytes = 300LL << 20;
  r.base_lr = 0.02;
  r.base_batch = 32;
  r.lr_scaling = "linear";
  r.peak_lr = 0.08;
  r.schedule = "cosine";
  r.total_steps = 30;
  r.threads_per_worker = 1;
  r.cores = 2;
  r.local_workers = 2;
  r.buckets = 1;
  profile::EpochSummary epoch;
  epoch.epoch = 1;
  epoch.steps = 30;
  for (int w = 0; w < 2; ++w) {
    train::PhaseTimes p;
    p.steps = 30;
    p.step_seconds = 3;
    p[train::Phase::kInput] = w == 0 ? 1.2 : 0.3;
    p[train::Phase::kForward] = 0.6;
    p[train::Phase::kBackward] = 1.0;
    p[train::Phase::kAllReduce] = 0.03;
    p.comm_seconds = 0.3;
    epoch.workers.push_back(p);
  }
  run.epochs.push_back(epoch);
  return run;
}

TEST(DoctorCommand, DiagnosesARecordedRun) {
  const testing::TempDir dir;
  const std::string file = dir.path() + "/run.json";
  profile::write_run_summary(file, input_bound_run());
  const auto r = run_process({kCli, "doctor", "--profile", file});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "Recipe doctor (most valuable first):\n  [act] input pipeline: 40% "
                              "of step time waiting for input (highly input-bound; the chief is "
                              "the worst worker)\n        -> "))
      << r.out;
  for (const char* item : kItems) {
    EXPECT_TRUE(contains(r.out, std::string("] ") + item + ": ")) << item << "\n" << r.out;
  }
  EXPECT_TRUE(contains(r.out, "[ok] communication: all-reduce wait 1.0% of step time, 90% hidden"))
      << r.out;
  // The doctor's API names, each with the flag that sets it.
  for (const char* shown : {"cache the decoded data in memory (Dataset::cache(), --cache)",
                            "or fewer for the step (torch::set_num_threads, --threads)",
                            "(profile::search_max_batch, flotilla tune --max-batch)",
                            "(RecipeFacts::batch_per_replica, --batch-per-replica)"}) {
    EXPECT_TRUE(contains(r.out, shown)) << shown << "\n" << r.out;
  }
}

TEST(DoctorCommand, MaxBatchFillsTheLargestBatchThatFits) {
  const testing::TempDir dir;
  const std::string file = dir.path() + "/run.json";
  profile::write_run_summary(file, input_bound_run());
  const auto r =
      run_process({kCli, "doctor", "--profile", file, "--max-batch", "--memory-budget", "600MiB"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // The mlp's step fits in 600 MiB at thousands, far above the run's 64: raise it.
  const std::string marker = "of a 600.0 MiB budget, the largest that fits is ";
  const auto at = r.out.find(marker);
  ASSERT_NE(at, std::string::npos) << r.out;
  const long max_batch = std::stol(r.out.substr(at + marker.size()));
  EXPECT_GE(max_batch, 512);
  EXPECT_EQ(max_batch % 8, 0);
  EXPECT_TRUE(contains(r.out, "[act] batch size: 64 per replica")) << r.out;
  // The setting as its flag, the advice's API names with theirs.
  EXPECT_TRUE(contains(r.out, "-> --batch-per-replica " + std::to_string(max_batch) +
                                  ": with the learning rate scaled linearly "
                                  "(train::linear_scaling (--lr-scaling linear): peak rate x "))
      << r.out;
  EXPECT_TRUE(contains(r.out, "and a warmup (CosineDecayOptions::warmup_steps, --warmup-epochs)"))
      << r.out;
}

TEST(DoctorCommand, BadUseIsOneLineAndExitCode2) {
  const auto none = run_process({kCli, "doctor"});
  EXPECT_EQ(none.exit_code, kExitBadInput);
  EXPECT_TRUE(contains(none.err, "nothing to diagnose")) << none.err;
  const auto no_train =
      run_process({kCli, "doctor", "--", "flotilla", "tf-config", "--index", "0"});
  EXPECT_EQ(no_train.exit_code, kExitBadInput);
  EXPECT_TRUE(contains(no_train.err, "has no `train`")) << no_train.err;
  const auto missing = run_process({kCli, "doctor", "--profile", "/nonexistent/run.json"});
  EXPECT_EQ(missing.exit_code, kExitBadInput);
  EXPECT_TRUE(contains(missing.err, "cannot read the run profile /nonexistent/run.json"))
      << missing.err;
}

TEST(DoctorCommand, AFailingCommandsExitCodeAndErrorPassThrough) {
  const auto r = run_process({kCli, "doctor", "--", "flotilla", "train", "--model", "resnet"});
  EXPECT_EQ(r.exit_code, kExitBadInput);
  EXPECT_TRUE(contains(r.err, "flotilla train: error:")) << r.err;
  EXPECT_FALSE(contains(r.out, "Recipe doctor")) << r.out;
}

bool train_writes_profiles() {
  const auto help = run_process({kCli, "train", "--help"});
  return contains(help.out, "--profile-json");
}

TEST(DoctorCommand, DiagnosesARealTrainingRun) {
  if (!testing::fashion_mnist_present()) GTEST_SKIP() << "Fashion-MNIST is not installed";
  if (!train_writes_profiles()) GTEST_SKIP() << "flotilla train has no --profile-json yet";
  const auto r = run_process({kCli, "doctor", "--", "flotilla", "train", "--model", "mlp",
                              "--epochs", "1", "--steps-per-epoch", "30", "--threads", "1"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto at = r.out.find("Recipe doctor (most valuable first):\n");
  ASSERT_NE(at, std::string::npos) << r.out;
  const std::string report = r.out.substr(at);
  EXPECT_EQ(report.find("Recipe doctor", 1), std::string::npos) << "printed twice:\n" << r.out;
  for (const char* item : kItems) {
    EXPECT_TRUE(contains(report, std::string("] ") + item + ": ")) << item << "\n" << report;
  }
  // The facts of this run, not defaults: one worker, the batch and rate flotilla train used.
  EXPECT_TRUE(contains(report, "[ok] communication: one worker: nothing crosses a network"))
      << report;
  EXPECT_TRUE(contains(report, "batch size: 32 per replica (global 32)")) << report;
  EXPECT_TRUE(contains(report, "learning rate: peak 0.02 = 0.02 x 32 / 32 (linear scaling)"))
      << report;
}

TEST(TuneCommand, MaxBatchWithinABudget) {
  const auto r = run_process({kCli, "tune", "--max-batch", "--model", "mlp", "--precision",
                              "float32", "--memory-budget", "2GiB", "--max", "2048", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j.at("model"), "mlp");
  EXPECT_EQ(j.at("memory_budget_bytes"), 2LL << 30);
  // The mlp's step at 2048 needs far less than 2 GiB beside LibTorch: the cap is reached.
  EXPECT_EQ(j.at("max_batch_per_replica"), 2048);
  EXPECT_TRUE(j.at("capped").get<bool>());
  EXPECT_LE(j.at("peak_bytes").get<std::int64_t>(), 2LL << 30);
  EXPECT_GT(j.at("peak_bytes").get<std::int64_t>(), 20LL << 20);
  EXPECT_EQ(j.at("suggested"), "flotilla train --model mlp --batch-per-replica 2048");
  EXPECT_DOUBLE_EQ(j.at("peak_lr_one_replica").get<double>(), 0.02 * 2048 / 32);
}

TEST(TuneCommand, ABudgetBelowTheProcessItselfFitsNothing) {
  const auto r = run_process(
      {kCli, "tune", "--max-batch", "--model", "mlp", "--memory-budget", "1MiB", "--max", "64"});
  EXPECT_EQ(r.exit_code, kExitBadInput);
  EXPECT_TRUE(contains(r.err, "flotilla tune: error: no batch fits")) << r.err;
  EXPECT_TRUE(contains(r.err, "over the 1.0 MiB budget")) << r.err;
  const auto none = run_process({kCli, "tune", "--model", "mlp"});
  EXPECT_EQ(none.exit_code, kExitBadInput);
  EXPECT_TRUE(contains(none.err, "use --max-batch")) << none.err;
}

} // namespace
} // namespace flotilla
