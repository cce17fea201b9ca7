// Recovery with real processes: `flotilla launch --max-restarts` after a SIGKILLed worker,
// preemption (SIGTERM to one worker, or to launch itself), each compared with a run never
// interrupted: the final weights must match and the optimizer must have made exactly as many
// updates, none lost and none done twice. Where and when the signal lands is random; the seed
// is printed (and taken from FLOTILLA_RECOVERY_SEED when set) so a failure can be replayed.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <sstream>
#include <thread>

#include "flotilla/checkpoint/checkpoint_manager.h"
#include "flotilla/error.h"
#include "support/compare.h"
#include "support/paths.h"
#include "support/subprocess.h"

namespace flotilla {
namespace {

namespace fs = std::filesystem;
const std::string kCli = flotilla::testing::flotilla_cli();
constexpr int kEpochs = 2;
constexpr int kStepsPerEpoch = 25;
constexpr std::int64_t kUpdates = kEpochs * kStepsPerEpoch;
constexpr auto kHangGuard = std::chrono::seconds(180);

// The training command every run of a test shares: an MLP on 2 x 25 global batches of 64 from
// Fashion-MNIST, a backup every 5 updates and a full checkpoint at each epoch's end. Equal
// shares: a division measured by speed depends on each run's timing, and every test here
// compares a recovered run with an uninterrupted one.
std::vector<std::string> train_command(const fs::path& dir) {
  return {"flotilla",         "train",
          "--shares",         "equal",
          "--model",          "mlp",
          "--epochs",         std::to_string(kEpochs),
          "--steps-per-epoch", std::to_string(kStepsPerEpoch),
          "--seed",           "7",
          "--lr",             "0.05",
          "--shuffle-buffer", "2000",
          "--verbose",        "2",
          "--timeout",        "60",
          "--backup-dir",     (dir / "backup").string(),
          "--backup-freq",    "5",
          // Votes every step: however fast this machine, a SIGTERM mid-run is acted on before
          // the run ends (with the default, a vote is due about every 0.5 s).
          "--preemption-check-ms", "0",
          "--checkpoint-dir", (dir / "ckpt").string(),
          "--metrics-json",   (dir / "metrics.jsonl").string()};
}

std::vector<std::string> launch_command(const fs::path& dir, std::vector<std::string> options) {
  std::vector<std::string> argv = {kCli, "launch", "--workers", "2", "--grace", "10"};
  argv.insert(argv.end(), options.begin(), options.end());
  argv.push_back("--");
  const auto train = train_command(dir);
  argv.insert(argv.end(), train.begin(), train.end());
  return argv;
}

struct Final {
  std::vector<torch::Tensor> weights;
  std::int64_t manifest_iterations = -1; // the last checkpoint's training state
  std::int64_t metrics_iterations = -1;  // the chief's last epoch line
};

// What a finished run left: the last epoch's checkpoint and the chief's metrics.
Final final_of(const fs::path& dir) {
  Final f;
  const auto data = checkpoint::read_checkpoint(dir / "ckpt" / ("ckpt-" + std::to_string(kEpochs)));
  for (const auto& [name, tensor] : data.model) f.weights.push_back(tensor.clone());
  f.manifest_iterations = data.state.at("iterations").get<std::int64_t>();
  std::ifstream metrics(dir / "metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("iterations")) f.metrics_iterations = j["iterations"].get<std::int64_t>();
  }
  return f;
}

using testing::count_of;

// The uninterrupted run every test compares with (same flags, same seed).
const Final& reference() {
  static const Final result = [] {
    testing::TempDir dir;
    const auto r = testing::run_process(launch_command(dir.path(), {}), {}, kHangGuard);
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    Final f = final_of(dir.path());
    EXPECT_FALSE(fs::exists(fs::path(dir.path()) / "backup")) << "a finished fit removes it";
    return f;
  }();
  return result;
}

void expect_same_training(const Final& got) {
  const Final& want = reference();
  ASSERT_EQ(got.weights.size(), want.weights.size());
  EXPECT_LE(testing::max_relative_difference(got.weights, want.weights), 1e-5);
  EXPECT_EQ(want.manifest_iterations, kUpdates);
  EXPECT_EQ(got.manifest_iterations, want.manifest_iterations); // no update lost or repeated
  EXPECT_EQ(want.metrics_iterations, kUpdates);
  EXPECT_EQ(got.metrics_iterations, want.metrics_iterations);
}

// Random choices, reproducible from the printed seed.
std::mt19937 seeded_rng() {
  const char* given = std::getenv("FLOTILLA_RECOVERY_SEED");
  const auto seed = given ? static_cast<std::uint32_t>(std::stoul(given)) : std::random_device{}();
  std::cout << "FLOTILLA_RECOVERY_SEED=" << seed << "\n";
  ::testing::Test::RecordProperty("recovery_seed", std::to_string(seed));
  return std::mt19937(seed);
}

// The newest backup's number (the pointer file "checkpoint" names backup-<n>), 0 before any.
int latest_backup(const fs::path& dir) {
  const std::string text = testing::read_file((dir / "backup" / "checkpoint").string());
  std::smatch m;
  if (!std::regex_search(text, m, std::regex("\"backup-([0-9]+)\""))) return 0;
  return std::stoi(m[1]);
}

// Launch's children (the workers), indexed by the LOCAL_RANK launch gave each.
std::map<int, pid_t> workers_of(pid_t pid) {
  std::map<int, pid_t> out;
  for (const auto& task : fs::directory_iterator("/proc/" + std::to_string(pid) + "/task")) {
    std::istringstream in(testing::read_file((task.path() / "children").string()));
    for (pid_t child; in >> child;) {
      std::ifstream environ("/proc/" + std::to_string(child) + "/environ");
      for (std::string var; std::getline(environ, var, '\0');) {
        if (var.rfind("LOCAL_RANK=", 0) == 0) out[std::stoi(var.substr(11))] = child;
      }
    }
  }
  return out;
}

// Whether `pid` still runs (a child that exited stays a zombie until the test reaps it).
bool running(pid_t pid) {
  const std::string stat = testing::read_file("/proc/" + std::to_string(pid) + "/stat");
  const auto paren = stat.rfind(')');
  return paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] != 'Z';
}

// Waits (bounded) until backup number `at_least` (2 or more) exists, then a random part of the
// time between the last two backups (5 updates), at most 50 ms: a moment in the middle of the
// first epoch, however fast the machine. (A fixed 0-300 ms once landed after the end of a fast
// run, which then had nothing to resume. Without the cap, a machine loaded by other tests made
// one interval 2 s long, 384 ms a step, then ran the last 30 steps at 8 ms each: the signal
// came after the run ended.) False if the run ended first.
bool wait_mid_run(testing::Process& launch, const fs::path& dir, int at_least, std::mt19937& rng) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  auto wait_for = [&](int number) {
    while (latest_backup(dir) < number) {
      if (std::chrono::steady_clock::now() > deadline || !running(launch.pid())) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return true;
  };
  if (!wait_for(at_least - 1)) return false;
  const auto previous = std::chrono::steady_clock::now();
  if (!wait_for(at_least)) return false;
  const auto interval = std::min<std::chrono::steady_clock::duration>(
      std::chrono::steady_clock::now() - previous, std::chrono::milliseconds(50));
  std::this_thread::sleep_for(std::uniform_real_distribution<double>(0, 1)(rng) * interval);
  return true;
}

class Recovery : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!testing::fashion_mnist_present()) GTEST_SKIP() << "dataset-fashion-mnist absent";
    reference(); // before the test's own run: the two never share the 2 cores
  }
};

TEST_F(Recovery, ASigkilledWorkerRestartsTheClusterAndLosesNoStep) {
  auto rng = seeded_rng();
  const int victim = std::uniform_int_distribution<int>(0, 1)(rng);
  const int after_backup = std::uniform_int_distribution<int>(2, 4)(rng); // updates 10..20
  std::cout << "SIGKILL to worker " << victim << " after backup " << after_backup << "\n";
  testing::TempDir dir;
  testing::Process launch(launch_command(dir.path(), {"--max-restarts", "2"}));
  ASSERT_TRUE(wait_mid_run(launch, dir.path(), after_backup, rng));
  auto workers = workers_of(launch.pid());
  ASSERT_EQ(workers.size(), 2u);
  ASSERT_EQ(::kill(workers[victim], SIGKILL), 0);
  const auto r = launch.wait(kHangGuard);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(count_of(r.err, "restarting the cluster"), 1u) << r.err;
  EXPECT_EQ(count_of(r.err, "[launch] worker " + std::to_string(victim) +
                                " was killed by signal Killed; stopping the other workers; "
                                "restarting the cluster (restart 1 of 2)\n"),
            1u)
      << r.err;
  EXPECT_NE(r.err.find("BackupAndRestore: resuming from "), std::string::npos) << r.err;
  expect_same_training(final_of(dir.path()));
}

TEST_F(Recovery, ASigtermedWorkerMakesEveryWorkerSaveAtOneStepAndResumeThere) {
  auto rng = seeded_rng();
  const int victim = std::uniform_int_distribution<int>(0, 1)(rng);
  const int after_backup = std::uniform_int_distribution<int>(2, 4)(rng);
  std::cout << "SIGTERM to worker " << victim << " after backup " << after_backup << "\n";
  testing::TempDir dir;
  // No failure restarts allowed: only the preemption can start the cluster again.
  testing::Process launch(launch_command(dir.path(), {"--max-restarts", "0"}));
  ASSERT_TRUE(wait_mid_run(launch, dir.path(), after_backup, rng));
  auto workers = workers_of(launch.pid());
  ASSERT_EQ(workers.size(), 2u);
  ASSERT_EQ(::kill(workers[victim], SIGTERM), 0);
  const auto r = launch.wait(kHangGuard);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(count_of(r.err, "restarting the cluster"), 1u) << r.err;
  EXPECT_EQ(count_of(r.err, "exited with code 75 (preempted: every worker saved a backup at "
                            "the same step); restarting the cluster (preemption restart 1; "
                            "preemptions do not count against --max-restarts)\n"),
            1u)
      << r.err;
  // Both workers say where they saved, and it is the same update.
  const std::regex saved(R"(\[worker (\d)\] flotilla train: training preempted .* saved the )"
                         R"(backup at update (\d+) )");
  std::map<int, std::int64_t> saved_at;
  for (std::sregex_iterator it(r.err.begin(), r.err.end(), saved), end; it != end; ++it) {
    saved_at[std::stoi((*it)[1])] = std::stoll((*it)[2]);
  }
  ASSERT_EQ(saved_at.size(), 2u) << r.err;
  EXPECT_EQ(saved_at[0], saved_at[1]);
  EXPECT_GT(saved_at[0], 0);
  EXPECT_LT(saved_at[0], kUpdates);
  // The restarted chief resumes from exactly there.
  EXPECT_NE(r.err.find("(" + std::to_string(saved_at[0]) + " updates done)"), std::string::npos)
      << r.err;
  expect_same_training(final_of(dir.path()));
}

TEST_F(Recovery, ASigtermedLaunchExitsTempfailAndTheNextLaunchResumes) {
  auto rng = seeded_rng();
  const int after_backup = std::uniform_int_distribution<int>(2, 4)(rng);
  std::cout << "SIGTERM to launch after backup " << after_backup << "\n";
  testing::TempDir dir;
  {
    testing::Process launch(launch_command(dir.path(), {"--max-restarts", "2"}));
    ASSERT_TRUE(wait_mid_run(launch, dir.path(), after_backup, rng));
    launch.signal(SIGTERM);
    const auto r = launch.wait(kHangGuard);
    EXPECT_EQ(r.exit_code, kExitPreempted) << r.out << r.err;
    EXPECT_EQ(count_of(r.err, "restarting the cluster"), 0u) << r.err; // never on its own signal
    EXPECT_EQ(count_of(r.err, "flotilla train: training preempted"), 2u) << r.err;
    ASSERT_GE(latest_backup(dir.path()), after_backup);
  }
  const auto again = testing::run_process(launch_command(dir.path(), {}), {}, kHangGuard);
  ASSERT_EQ(again.exit_code, 0) << again.out << again.err;
  EXPECT_NE(again.err.find("BackupAndRestore: resuming from "), std::string::npos) << again.err;
  expect_same_training(final_of(dir.path()));
}

} // namespace
} // namespace flotilla
