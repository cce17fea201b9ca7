// `flotilla launch`: real processes, real TF_CONFIG, real training on loopback.
#include <gtest/gtest.h>
#include <sched.h>
#include <signal.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <thread>

#include "flotilla/checkpoint/safetensors.h"
#include "flotilla/cluster/cluster_spec.h"
#include "flotilla/error.h"
#include "support/paths.h"
#include "support/subprocess.h"
#include "support/tensorboard.h"

namespace flotilla {
namespace {

using testing::count_of;
using testing::lines_of;
using testing::run_process;
const std::string kCli = flotilla::testing::flotilla_cli();

TEST(Launch, EachWorkerGetsItsTfConfigAndPrefixedOutput) {
  const auto r = run_process({kCli, "launch", "--workers", "3", "--", "sh", "-c",
                              "echo \"$TF_CONFIG\"; echo \"threads=$OMP_NUM_THREADS\" >&2"},
                             {{"OMP_NUM_THREADS", ""}});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto out = lines_of(r.out);
  ASSERT_EQ(out.size(), 3u) << r.out;
  std::set<int> indices;
  std::set<std::string> addresses;
  for (const auto& line : out) {
    ASSERT_EQ(line.rfind("[worker ", 0), 0u) << line;
    const int index = std::stoi(line.substr(8));
    const auto spec = cluster::parse_tf_config(line.substr(line.find("] ") + 2));
    EXPECT_EQ(spec.task.index, index);
    EXPECT_EQ(spec.world_size, 3);
    for (const auto& a : spec.worker) addresses.insert(a.to_string());
    indices.insert(index);
  }
  EXPECT_EQ(indices, (std::set<int>{0, 1, 2}));
  EXPECT_EQ(addresses.size(), 3u); // one port per worker
  cpu_set_t set;
  ASSERT_EQ(sched_getaffinity(0, sizeof set, &set), 0);
  const int cores = CPU_COUNT(&set); // what this process may use, as the launcher counts
  const std::string threads = "threads=" + std::to_string(std::max(1, cores / 3));
  for (const auto& line : lines_of(r.err)) EXPECT_EQ(line.substr(line.find("] ") + 2), threads);
}

// Workers sharing a host split its GPUs by local rank: the rank launch gives each worker must
// reach cluster::local_rank through the real environment (it once read 0 everywhere).
TEST(Launch, EachWorkerKnowsItsLocalRank) {
  const std::string probe = testing::test_bin_dir() + "/local_rank_probe";
  const auto r = run_process({kCli, "launch", "--workers", "3", "--", probe},
                             {{"LOCAL_RANK", ""}, {"SLURM_LOCALID", ""}});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto out = lines_of(r.out);
  ASSERT_EQ(out.size(), 3u) << r.out;
  std::set<int> ranks;
  for (const auto& line : out) {
    const int index = std::stoi(line.substr(8)); // "[worker i] ..."
    EXPECT_EQ(line.substr(line.find("] ") + 2),
              "local_rank=" + std::to_string(index) + " local_world_size=3");
    ranks.insert(index);
  }
  EXPECT_EQ(ranks, (std::set<int>{0, 1, 2}));
  // Under srun, Slurm's name for it.
  const auto slurm =
      run_process({probe}, {{"LOCAL_RANK", ""}, {"SLURM_LOCALID", "2"}, {"LOCAL_WORLD_SIZE", "4"}});
  ASSERT_EQ(slurm.exit_code, 0) << slurm.err;
  EXPECT_EQ(slurm.out, "local_rank=2 local_world_size=4\n");
}

TEST(Launch, EveryRunGetsItsOwnClusterTokenUnlessTheUserBroughtOne) {
  // sha256sum of the token: equal within a run, different between runs, never printed itself.
  const std::vector<std::string> cmd = {
      kCli, "launch", "--workers", "2",
      "--", "sh",     "-c",        "printf %s \"$FLOTILLA_CLUSTER_TOKEN\" | sha256sum"};
  const auto first =
      run_process(cmd, {{"FLOTILLA_CLUSTER_TOKEN", ""}, {"FLOTILLA_CLUSTER_TOKEN_FILE", ""}});
  const auto second =
      run_process(cmd, {{"FLOTILLA_CLUSTER_TOKEN", ""}, {"FLOTILLA_CLUSTER_TOKEN_FILE", ""}});
  ASSERT_EQ(first.exit_code, 0) << first.err;
  auto digests = [](const std::string& out) {
    std::set<std::string> d;
    for (const auto& line : lines_of(out)) d.insert(line.substr(line.find("] ") + 2, 64));
    return d;
  };
  const auto a = digests(first.out), b = digests(second.out);
  ASSERT_EQ(a.size(), 1u) << first.out; // both workers hold the same token
  ASSERT_EQ(b.size(), 1u) << second.out;
  EXPECT_NE(*a.begin(), *b.begin());
  // sha256 of the empty string: a run without a token would print this.
  EXPECT_NE(*a.begin(), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  const auto own = run_process(
      {kCli, "launch", "--workers", "1", "--", "sh", "-c", "printf %s \"$FLOTILLA_CLUSTER_TOKEN\""},
      {{"FLOTILLA_CLUSTER_TOKEN", "users-own"}});
  EXPECT_EQ(own.out, "[worker 0] users-own\n");
}

TEST(Launch, CarriageReturnsRedrawAndDosNewlinesEndLines) {
  const auto r = run_process(
      {kCli, "launch", "--workers", "1", "--", "sh", "-c", "printf 'a\\r\\nb\\n\\r1/2\\r2/2\\n'"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "[worker 0] a\n[worker 0] b\n[worker 0] 1/2\r[worker 0] 2/2\n");
}

TEST(Launch, TheFirstFailureStopsTheOthersAndBecomesTheExitCode) {
  const auto r =
      run_process({kCli, "launch", "--workers", "3", "--grace", "5", "--", "sh", "-c",
                   "if [ \"$LOCAL_RANK\" = 1 ]; then sleep 0.5; exit 7; fi; exec sleep 600"});
  EXPECT_EQ(r.exit_code, 7) << r.err;
  EXPECT_NE(r.err.find("[launch] worker 1 exited with code 7; stopping the other workers"),
            std::string::npos)
      << r.err;
}

TEST(Launch, AWorkerKilledBySignalGives128PlusSignal) {
  const auto r = run_process({kCli, "launch", "--workers", "2", "--", "sh", "-c",
                              "if [ \"$LOCAL_RANK\" = 0 ]; then kill -9 $$; fi; exec sleep 600"});
  EXPECT_EQ(r.exit_code, 128 + SIGKILL) << r.err;
  EXPECT_NE(r.err.find("[launch] worker 0 was killed by signal Killed"), std::string::npos)
      << r.err;
}

TEST(Launch, SigtermIsForwardedToEveryWorker) {
  testing::Process launch({kCli, "launch", "--workers", "2", "--", "sh", "-c",
                           "trap 'echo got-term; exit 5' TERM; echo ready; sleep 600 & wait"});
  // Both shells have set their trap once they said so (a fixed 2 s wait was too short for one
  // under a loaded `make test`).
  ASSERT_TRUE(launch.wait_for_output("[worker 0] ready")) << launch.output_so_far();
  ASSERT_TRUE(launch.wait_for_output("[worker 1] ready")) << launch.output_so_far();
  launch.signal(SIGTERM);
  const auto r = launch.wait(std::chrono::seconds(60));
  EXPECT_EQ(r.exit_code, 5) << r.out << r.err;
  EXPECT_NE(r.out.find("[worker 0] got-term"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[worker 1] got-term"), std::string::npos) << r.out;
}

TEST(Launch, AForwardedSignalIsNotASuccessEvenIfWorkersExitCleanly) {
  testing::Process launch({kCli, "launch", "--workers", "2", "--", "sh", "-c",
                           "trap 'exit 0' TERM; echo ready; sleep 600 & wait"});
  std::this_thread::sleep_for(std::chrono::seconds(2));
  launch.signal(SIGTERM);
  const auto r = launch.wait(std::chrono::seconds(60));
  EXPECT_EQ(r.exit_code, 128 + SIGTERM) << r.out << r.err;
}

TEST(Launch, WorkersDieWithAKilledLauncher) {
  testing::TempDir dir;
  testing::Process launch({kCli, "launch", "--workers", "2", "--", "sh", "-c",
                           "echo $$ > " + dir.path() + "/pid.$LOCAL_RANK; exec sleep 600"});
  std::vector<pid_t> pids;
  for (int i = 0; i < 200 && pids.size() < 2; ++i) { // up to 10 s for both to start
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    pids.clear();
    for (int r = 0; r < 2; ++r) {
      const std::string text = testing::read_file(dir.path() + "/pid." + std::to_string(r));
      if (!text.empty() && text.back() == '\n') pids.push_back(std::stoi(text));
    }
  }
  ASSERT_EQ(pids.size(), 2u);
  ::kill(launch.pid(), SIGKILL); // no chance to stop anyone
  launch.wait(std::chrono::seconds(10));
  for (pid_t pid : pids) {
    bool gone = false;
    for (int i = 0; i < 200 && !gone; ++i) { // up to 10 s
      gone = ::kill(pid, 0) != 0;
      if (!gone) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    EXPECT_TRUE(gone) << "worker " << pid << " outlived its launcher";
  }
}

TEST(Launch, MaxRestartsRestartsTheWholeClusterOnFreshPortsThenSucceeds) {
  testing::TempDir dir;
  // Worker 1 fails in the first run only; every run prints its TF_CONFIG.
  const auto r = run_process(
      {kCli, "launch", "--workers", "2", "--grace", "5", "--max-restarts", "3", "--", "sh", "-c",
       "echo \"$TF_CONFIG\"; if [ \"$LOCAL_RANK\" = 1 ] && [ ! -e " + dir.path() +
           "/failed ]; then touch " + dir.path() + "/failed; exit 7; fi; exec sleep 0.5"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(count_of(r.err, "restarting the cluster"), 1u) << r.err;
  EXPECT_NE(r.err.find("[launch] worker 1 exited with code 7; stopping the other workers; "
                       "restarting the cluster (restart 1 of 3)\n"),
            std::string::npos)
      << r.err;
  // Both workers of both runs; the second run's ports are not the first's.
  std::map<std::string, int> configs;
  for (const auto& line : lines_of(r.out)) ++configs[line.substr(line.find("] ") + 2)];
  ASSERT_EQ(configs.size(), 4u) << r.out;
  std::set<std::string> clusters;
  for (const auto& [config, n] : configs) {
    clusters.insert(nlohmann::json::parse(config)["cluster"].dump());
  }
  EXPECT_EQ(clusters.size(), 2u) << r.out;
}

// --log-dir, as torchrun's with --tee: each task's output also goes to its own file, appended
// across the cluster's restarts with each start and exit marked; what was there is kept.
TEST(Launch, LogDirKeepsEachTasksOutputInItsOwnFileAcrossRestarts) {
  testing::TempDir dir;
  const std::string logs = dir.path() + "/logs";
  std::filesystem::create_directories(logs);
  { std::ofstream(logs + "/worker-0.log") << "a line from before\n"; }
  const auto r = run_process(
      {kCli, "launch", "--workers", "2", "--grace", "5", "--max-restarts", "1", "--log-dir", logs,
       "--", "sh", "-c",
       "echo out-$LOCAL_RANK; echo err-$LOCAL_RANK >&2; if [ \"$LOCAL_RANK\" = 1 ] && [ ! -e " +
           dir.path() + "/failed ]; then touch " + dir.path() + "/failed; exit 7; fi"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("[worker 1] out-1"), std::string::npos) << r.out; // still on the console
  const std::string zero = testing::read_file(logs + "/worker-0.log");
  const std::string one = testing::read_file(logs + "/worker-1.log");
  EXPECT_EQ(zero.rfind("a line from before\n", 0), 0u) << zero;
  EXPECT_EQ(count_of(zero, "=== flotilla launch: worker 0 started (pid "), 2u) << zero;
  EXPECT_EQ(count_of(one, "=== flotilla launch: worker 1 started (pid "), 2u) << one;
  EXPECT_EQ(count_of(one, ") exited with code 7 at "), 1u) << one;
  EXPECT_EQ(count_of(one, ") exited with code 0 at "), 1u) << one;
  EXPECT_EQ(count_of(one, "out-1\n"), 2u) << one;
  EXPECT_EQ(count_of(one, "err-1\n"), 2u) << one;
  EXPECT_EQ(one.find("out-0"), std::string::npos) << one;
  EXPECT_EQ(zero.find("out-1"), std::string::npos) << zero;

  // A log file name that is a link (another user's trap in a shared directory) is refused.
  std::filesystem::create_symlink(dir.path() + "/elsewhere", logs + "/worker-1.log.tmp");
  std::filesystem::rename(logs + "/worker-1.log.tmp", logs + "/worker-1.log");
  const auto refused =
      run_process({kCli, "launch", "--workers", "2", "--log-dir", logs, "--", "true"});
  EXPECT_EQ(refused.exit_code, 2) << refused.err;
  EXPECT_NE(refused.err.find("--log-dir: cannot open " + logs + "/worker-1.log to append to it"),
            std::string::npos)
      << refused.err;
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/elsewhere"));
}

TEST(Launch, RestartsRunOutAndTheLastFailureIsTheExitCode) {
  const auto r =
      run_process({kCli, "launch", "--workers", "2", "--grace", "5", "--max-restarts", "2", "--",
                   "sh", "-c", "if [ \"$LOCAL_RANK\" = 1 ]; then kill -9 $$; fi; exec sleep 600"});
  EXPECT_EQ(r.exit_code, 128 + SIGKILL) << r.err;
  EXPECT_EQ(count_of(r.err, "[launch] worker 1 was killed by signal Killed; stopping the other "
                            "workers; restarting the cluster (restart "),
            2u)
      << r.err;
  EXPECT_NE(r.err.find("(restart 2 of 2)\n"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("[launch] worker 1 was killed by signal Killed; stopping the other "
                       "workers; no restarts left (--max-restarts 2)\n"),
            std::string::npos)
      << r.err;
}

TEST(Launch, APreemptedClusterRestartsWithoutUsingMaxRestarts) {
  testing::TempDir dir;
  // Every worker exits 75 (as after a preemption backup) in the first run only.
  const auto r = run_process({kCli, "launch", "--workers", "2", "--", "sh", "-c",
                              "if [ ! -e " + dir.path() + "/ran.$LOCAL_RANK ]; then touch " +
                                  dir.path() + "/ran.$LOCAL_RANK; exit 75; fi; echo second run"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(count_of(r.err, "restarting the cluster"), 1u) << r.err;
  EXPECT_NE(r.err.find("exited with code 75 (preempted: every worker saved a backup at the same "
                       "step); restarting the cluster (preemption restart 1; preemptions do not "
                       "count against --max-restarts)\n"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(count_of(r.out, "second run"), 2u) << r.out;
}

TEST(Launch, PreemptionRestartsAreBounded) {
  const auto r = run_process({kCli, "launch", "--workers", "1", "--", "sh", "-c", "exit 75"});
  EXPECT_EQ(r.exit_code, kExitPreempted) << r.err;
  EXPECT_EQ(count_of(r.err, "restarting the cluster (preemption restart "), 100u);
  EXPECT_NE(r.err.find("; not restarting: 100 preemption restarts already."), std::string::npos)
      << r.err.substr(r.err.size() > 2000 ? r.err.size() - 2000 : 0);
}

TEST(Launch, ASignalToLaunchNeverRestartsAndWorkersThatSavedMakeIt75) {
  for (const auto& [worker_exit, launch_exit] : {std::pair{75, kExitPreempted}, {5, 5}}) {
    testing::Process launch(
        {kCli, "launch", "--workers", "2", "--max-restarts", "3", "--", "sh", "-c",
         "trap 'exit " + std::to_string(worker_exit) + "' TERM; echo ready; sleep 600 & wait"});
    // Both shells set their trap before they say ready (a fixed 2 s was too short under load).
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (count_of(launch.output_so_far(), "ready") < 2 &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    launch.signal(SIGTERM);
    const auto r = launch.wait(std::chrono::seconds(60));
    EXPECT_EQ(r.exit_code, launch_exit) << r.out << r.err;
    EXPECT_EQ(r.err.find("restarting"), std::string::npos) << r.err;
    EXPECT_EQ(count_of(r.out, "ready"), 2u) << "one run only: " << r.out;
  }
}

// --elastic: launch hosts the rendezvous; a SIGKILLed worker is restarted alone, the others
// keep training in the same processes and admit it when it is back.
TEST(Launch, UnknownProgramIsABadInput) {
  const auto r = run_process({kCli, "launch", "--workers", "2", "--", "/nonexistent/program"});
  EXPECT_EQ(r.exit_code, kExitBadInput);
  EXPECT_EQ(r.err, "flotilla launch: error: cannot start \"/nonexistent/program\": No such file or "
                   "directory; check the command after --\n");
}

TEST(Launch, TwoWorkersTrainOnLoopback) {
  if (!testing::fashion_mnist_present()) GTEST_SKIP() << "dataset-fashion-mnist absent";
  testing::TempDir dir;
  const std::string metrics = dir.path() + "/metrics.jsonl";
  const std::string checkpoint_dir = dir.path() + "/ckpt";
  const auto r =
      run_process({kCli, "launch", "--workers", "2", "--", "flotilla", "train", "--model", "mlp",
                   "--epochs", "2", "--steps-per-epoch", "60", "--lr", "0.05", "--metrics-json",
                   metrics, "--checkpoint-dir", checkpoint_dir});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("[worker 0] Epoch 1/2\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[worker 0] 60/60 - "), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("[worker 1]"), std::string::npos) << "only the chief prints progress";
  const auto lines = lines_of(testing::read_file(metrics));
  ASSERT_EQ(lines.size(), 3u);
  for (int e = 0; e < 2; ++e) {
    const auto epoch = nlohmann::json::parse(lines[e]);
    EXPECT_EQ(epoch["epoch"], e + 1);
    EXPECT_EQ(epoch["steps"], 60);
    EXPECT_EQ(epoch["workers"], 2);
    EXPECT_EQ(epoch["global_batch"], 64);
    EXPECT_GT(epoch["samples_per_s"].get<double>(), 0);
  }
  const auto test = nlohmann::json::parse(lines[2]);
  EXPECT_EQ(test["test_samples"], 10000);
  EXPECT_GT(test["test_accuracy"].get<double>(), 0.7); // 120 steps of an MLP get ~0.8
  namespace fs = std::filesystem;
  std::vector<std::string> beside;
  for (const auto& e : fs::directory_iterator(dir.path())) beside.push_back(e.path().filename());
  std::sort(beside.begin(), beside.end());
  EXPECT_EQ(beside, (std::vector<std::string>{"ckpt", "metrics.jsonl"}));
  EXPECT_TRUE(fs::exists(fs::path(checkpoint_dir) / "ckpt-2" / "model.safetensors"));
  EXPECT_EQ(testing::read_file(fs::path(checkpoint_dir) / "checkpoint").substr(0, 32),
            "model_checkpoint_path: \"ckpt-2\"\n");
}

TEST(Launch, TheEvaluatorEvaluatesTheChiefsFinalCheckpoint) {
  if (!testing::fashion_mnist_present()) GTEST_SKIP() << "dataset-fashion-mnist absent";
  testing::TempDir dir;
  const std::string metrics = dir.path() + "/metrics.jsonl";
  const auto r = run_process({kCli,
                              "launch",
                              "--workers",
                              "2",
                              "--evaluator",
                              "--",
                              "flotilla",
                              "train",
                              "--model",
                              "mlp",
                              "--epochs",
                              "2",
                              "--steps-per-epoch",
                              "20",
                              "--checkpoint-dir",
                              dir.path() + "/ckpt",
                              "--tensorboard-dir",
                              dir.path() + "/tb",
                              "--metrics-json",
                              metrics});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("[evaluator] Evaluator: ckpt-2 (epoch 2, step 40): loss: "),
            std::string::npos)
      << r.out;
  // The evaluator and the chief measure the same weights on the same test split.
  double chief = -1, evaluator = -2;
  for (const auto& line : lines_of(testing::read_file(metrics))) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("test_accuracy")) chief = j["test_accuracy"];
    if (j.contains("eval_accuracy") && j["epoch"] == 2) evaluator = j["eval_accuracy"];
  }
  EXPECT_EQ(evaluator, chief);
  EXPECT_TRUE(std::filesystem::exists(dir.path() + "/tb/evaluation"));
}

// Modules scripted by the venv's torch (tests/fixtures/torchscript_reference.py) into `dir`.
bool make_torchscript_modules(const std::string& dir) {
  return run_process({testing::test_python(),
                      testing::source_dir() + "/tests/fixtures/torchscript_reference.py", "make",
                      dir})
             .exit_code == 0;
}

// A model from Python, as --model PATH: two workers train it, checkpoints and all, and the
// evaluator evaluates the same weights from the chief's checkpoint.
TEST(Launch, TwoWorkersTrainATorchScriptModuleAndTheEvaluatorEvaluatesIt) {
  if (!testing::fashion_mnist_present()) GTEST_SKIP() << "dataset-fashion-mnist absent";
  testing::TempDir dir;
  ASSERT_TRUE(make_torchscript_modules(dir.path())) << "the test venv's torch cannot script";
  const std::string metrics = dir.path() + "/metrics.jsonl";
  const auto r = run_process({kCli,
                              "launch",
                              "--workers",
                              "2",
                              "--evaluator",
                              "--",
                              "flotilla",
                              "train",
                              "--model",
                              dir.path() + "/bn.pt",
                              "--epochs",
                              "1",
                              "--steps-per-epoch",
                              "40",
                              "--lr",
                              "0.05",
                              "--checkpoint-dir",
                              dir.path() + "/ckpt",
                              "--metrics-json",
                              metrics});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  double chief = -1, evaluator = -2;
  for (const auto& line : lines_of(testing::read_file(metrics))) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("test_accuracy")) chief = j["test_accuracy"];
    if (j.contains("eval_accuracy")) evaluator = j["eval_accuracy"];
  }
  EXPECT_GT(chief, 0.6) << r.out; // 40 steps of batch 64 reach ~0.75
  EXPECT_EQ(evaluator, chief) << r.out;
  EXPECT_TRUE(std::filesystem::exists(dir.path() + "/ckpt/ckpt-1/model.safetensors"));
}

// A module that cannot take the data fails each worker alone, before it joins: every worker
// prints one line and exits 2, none waits for the other (each runs here by itself).
TEST(TrainCommand, ATorchScriptModuleThatRejectsTheDataIsOneLineAndExit2OnEveryWorker) {
  if (!testing::fashion_mnist_present()) GTEST_SKIP() << "dataset-fashion-mnist absent";
  testing::TempDir dir;
  ASSERT_TRUE(make_torchscript_modules(dir.path())) << "the test venv's torch cannot script";
  const std::string model = dir.path() + "/rgb.pt";
  for (int index = 0; index < 2; ++index) {
    const std::string tf_config =
        R"({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": )" +
        std::to_string(index) + "}}";
    const auto r = run_process({kCli, "train", "--model", model}, {{"TF_CONFIG", tf_config}},
                               std::chrono::seconds(60));
    EXPECT_EQ(r.exit_code, kExitBadInput) << r.out << r.err;
    EXPECT_EQ(
        r.err.rfind(
            "flotilla train: error: " + model +
                ": forward failed on a batch of shape [2, 1, 28, 28] Float: RuntimeError: Given "
                "groups=1, weight of size [8, 3, 3, 3], expected input[2, 1, 28, "
                "28] to have 3 channels, but got 1 channels instead\n",
            0),
        0u)
        << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
  const std::string text = dir.path() + "/model.pt";
  std::ofstream(text) << "not a module";
  const auto r = run_process({kCli, "train", "--model", text});
  EXPECT_EQ(r.exit_code, kExitBadInput);
  EXPECT_EQ(r.err.rfind("flotilla train: error: " + text + " is not a TorchScript module (", 0), 0u)
      << r.err;
}

// Fashion-MNIST's first `limit` images of each split as PNG class folders under `dir`.
bool write_image_folders(const std::string& dir, int limit) {
  return run_process({testing::test_python(),
                      testing::source_dir() + "/scripts/fashion_mnist_images.py", "write", dir,
                      "--limit", std::to_string(limit)})
             .exit_code == 0;
}

// Images as files: two workers each decode their own half of the files (FILE sharding), the
// evaluator measures the chief's checkpoint on the same validation subset.
TEST(Launch, TwoWorkersTrainOnAnImageFolderAndTheEvaluatorEvaluatesIt) {
  if (!testing::fashion_mnist_present()) GTEST_SKIP() << "dataset-fashion-mnist absent";
  testing::TempDir dir;
  ASSERT_TRUE(write_image_folders(dir.path() + "/images", 2000)) << "no Pillow in the test venv";
  const std::string metrics = dir.path() + "/metrics.jsonl";
  const auto r = run_process({kCli,
                              "launch",
                              "--workers",
                              "2",
                              "--evaluator",
                              "--",
                              "flotilla",
                              "train",
                              "--model",
                              "mlp",
                              "--dataset",
                              "image-folder",
                              "--data-dir",
                              dir.path() + "/images/train",
                              "--validation-split",
                              "0.25",
                              "--epochs",
                              "2",
                              "--lr",
                              "0.05",
                              "--checkpoint-dir",
                              dir.path() + "/ckpt",
                              "--metrics-json",
                              metrics});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.err.find("input: FILE: worker 0 of 2 reads its 750 of 1500 files"), std::string::npos)
      << r.err;
  double chief = -1, evaluator = -2;
  std::int64_t tested = 0;
  for (const auto& line : lines_of(testing::read_file(metrics))) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("test_accuracy")) {
      chief = j["test_accuracy"];
      tested = j["test_samples"];
    }
    if (j.contains("eval_accuracy") && j["epoch"] == 2) evaluator = j["eval_accuracy"];
  }
  EXPECT_EQ(tested, 500); // the validation subset: int(0.25 x 2000)
  EXPECT_GT(chief, 0.6) << r.out;
  EXPECT_EQ(evaluator, chief) << r.out;
}

// Nothing trains on garbage: a truncated image stops the job with exit 2, naming the file.
TEST(Launch, ACorruptImageStopsTrainingNamingTheFile) {
  if (!testing::fashion_mnist_present()) GTEST_SKIP() << "dataset-fashion-mnist absent";
  testing::TempDir dir;
  ASSERT_TRUE(write_image_folders(dir.path(), 200)) << "no Pillow in the test venv";
  const std::string bad = dir.path() + "/train/3_dress/99999.png";
  const std::string bytes = testing::read_file(dir.path() + "/train/0_tshirt_top/00001.png");
  std::ofstream(bad, std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  const auto r = run_process({kCli, "launch", "--workers", "2", "--", "flotilla", "train",
                              "--model", "mlp", "--dataset", "image-folder", "--data-dir",
                              dir.path(), "--batch-per-replica", "8"});
  EXPECT_EQ(r.exit_code, kExitBadInput) << r.out << r.err;
  EXPECT_NE(r.err.find(bad + ": corrupt or truncated PNG (libpng: "), std::string::npos) << r.err;
}

// The seed's two programs, briefly: 2 workers, a few steps each.
TEST(Examples, TheSeedProgramsRunOnTwoWorkers) {
  if (!testing::fashion_mnist_present()) GTEST_SKIP() << "dataset-fashion-mnist absent";
  const std::string examples = testing::test_bin_dir() + "/../examples/";
  const auto first =
      run_process({kCli, "launch", "--workers", "2", "--", examples + "multi_worker", "1", "5"});
  ASSERT_EQ(first.exit_code, 0) << first.out << first.err;
  EXPECT_NE(first.out.find("[worker 0] final training accuracy "), std::string::npos) << first.out;
  const auto recipe =
      run_process({kCli, "launch", "--workers", "2", "--", examples + "recipe", "1", "3"});
  ASSERT_EQ(recipe.exit_code, 0) << recipe.out << recipe.err;
  // The seed passes warmup_steps without warmup_target: flotilla says that does no warmup.
  const std::string said = recipe.out + recipe.err;
  EXPECT_NE(said.find("warmup_target"), std::string::npos) << said;
  EXPECT_NE(said.find("jit_compile: the compile step"), std::string::npos) << said;
  EXPECT_NE(recipe.out.find("[worker 0] final training accuracy "), std::string::npos)
      << recipe.out;
}

TEST(Launch, ProfilingGathersEveryWorkersTimelineAndWritesTheRecordAndReport) {
  if (!testing::fashion_mnist_present()) GTEST_SKIP() << "dataset-fashion-mnist absent";
  testing::TempDir dir;
  const std::string trace = dir.path() + "/trace.json";
  const std::string run = dir.path() + "/run.json";
  const std::string report = dir.path() + "/report.html";
  const auto r = run_process({kCli, "launch", "--workers", "2", "--", kCli, "train", "--model",
                              "mlp", "--epochs", "2", "--steps-per-epoch", "15", "--trace", trace,
                              "--profile-json", run, "--report", report});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // The per-epoch phase line and the doctor, on the chief only.
  EXPECT_NE(r.out.find("[worker 0]   step "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("input-bound"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("Recipe doctor"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("[worker 1] Recipe doctor"), std::string::npos) << r.out;

  // One trace file for both processes: each worker's steps, phases and bucket all-reduces.
  const auto events = nlohmann::json::parse(testing::read_file(trace)).at("traceEvents");
  std::map<int, int> steps, all_reduces;
  std::map<int, std::string> names;
  for (const auto& e : events) {
    const int pid = e.at("pid").get<int>();
    if (e["ph"] == "M" && e["name"] == "process_name") names[pid] = e["args"]["name"];
    if (e["ph"] != "X") continue;
    if (e["cat"] == "step") ++steps[pid];
    if (e["cat"] == "all-reduce") ++all_reduces[pid];
  }
  ASSERT_EQ(names.size(), 2u);
  EXPECT_NE(names[1].find("worker 1 127.0.0.1:"), std::string::npos) << names[1];
  for (int pid : {0, 1}) {
    EXPECT_EQ(steps[pid], 30) << "worker " << pid;
    EXPECT_GE(all_reduces[pid], 30) << "worker " << pid;
  }

  const auto record = nlohmann::json::parse(testing::read_file(run));
  EXPECT_EQ(record.at("schema"), "flotilla.run/1");
  EXPECT_EQ(record["recipe"]["workers"], 2);
  EXPECT_EQ(record["recipe"]["model"], "mlp");
  EXPECT_EQ(record["recipe"]["global_batch"], 64);
  ASSERT_EQ(record["epochs"].size(), 2u);
  EXPECT_EQ(record["epochs"][1]["workers"].size(), 2u);
  EXPECT_EQ(record["epochs"][1]["workers"][1]["steps"], 15);
  EXPECT_NE(record.at("command").get<std::string>().find("--profile-json"), std::string::npos);

  const std::string html = testing::read_file(report);
  EXPECT_EQ(html.rfind("<!DOCTYPE html>", 0), 0u) << html.substr(0, 40);
  EXPECT_NE(html.find("data-worker=\"1\""), std::string::npos);
}

// The real torchrun from the venv, run as the issue's user ran it. Its agent keeps its own c10d
// store on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True), so the chief's rendezvous failed there:
// "Address already in use", exit 1. The chief now hosts it on a port of its own and publishes
// the address in the agent's store (ClusterSpec::agent_store_key).
TEST(Torchrun, TwoWorkersTrainUnderTheRealTorchrun) {
  const int port = testing::free_ports(1)[0];
  std::vector<std::string> argv = {testing::test_python(), "-m", "torch.distributed.run"};
  for (const std::string& arg : {"--nnodes", "1", "--nproc-per-node", "2", "--master-port"}) {
    argv.push_back(arg);
  }
  argv.push_back(std::to_string(port));
  for (const std::string& arg : {"--no-python", kCli.c_str(), "train", "--model", "mlp"}) {
    argv.push_back(arg);
  }
  for (const std::string& arg : {"--epochs", "1", "--steps-per-epoch", "5", "--batch-per-replica",
                                 "16", "--threads", "1", "--verbose", "0"}) {
    argv.push_back(arg);
  }
  const auto r =
      run_process(argv, {{"TF_CONFIG", ""}, {"FLOTILLA_RENDEZVOUS", ""}, {"OMP_NUM_THREADS", "1"}},
                  std::chrono::seconds(240));
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::string all = r.out + r.err;
  EXPECT_NE(all.find("MultiWorkerMirroredStrategy: 2 worker(s)"), std::string::npos) << all;
  EXPECT_NE(all.find("torchrun environment"), std::string::npos) << all;
  EXPECT_EQ(all.find("Address already in use"), std::string::npos) << all;
}

// --standalone: torchrun's one-node rendezvous on a port of its own choosing.
TEST(Torchrun, StandaloneTrains) {
  std::vector<std::string> argv = {testing::test_python(),
                                   "-m",
                                   "torch.distributed.run",
                                   "--standalone",
                                   "--nproc-per-node",
                                   "2",
                                   "--no-python"};
  for (const std::string& arg :
       {kCli.c_str(), "train", "--model", "mlp", "--epochs", "1", "--steps-per-epoch", "5",
        "--batch-per-replica", "16", "--threads", "1", "--verbose", "0"}) {
    argv.push_back(arg);
  }
  const auto r =
      run_process(argv, {{"TF_CONFIG", ""}, {"FLOTILLA_RENDEZVOUS", ""}, {"OMP_NUM_THREADS", "1"}},
                  std::chrono::seconds(240));
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE((r.out + r.err).find("MultiWorkerMirroredStrategy: 2 worker(s)"), std::string::npos)
      << r.out << r.err;
}

// torchrun's default multi-node form: two agents meet through its c10d rendezvous backend (the
// first hosts the store on the endpoint), one worker each. flotilla reads the RANK, WORLD_SIZE,
// MASTER_ADDR and MASTER_PORT the agents give and meets in the agent's store as on one node.
TEST(Torchrun, TwoNodesMeetThroughItsC10dRendezvous) {
  const int port = testing::free_ports(1)[0];
  std::vector<std::unique_ptr<testing::Process>> nodes;
  for (int n = 0; n < 2; ++n) {
    std::vector<std::string> argv = {testing::test_python(), "-m", "torch.distributed.run"};
    for (const std::string& arg :
         {"--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-id", "t2"}) {
      argv.push_back(arg);
    }
    argv.push_back("--rdzv-endpoint");
    argv.push_back("127.0.0.1:" + std::to_string(port));
    for (const std::string& arg : {"--no-python", kCli.c_str(), "train", "--model", "mlp",
                                   "--epochs", "1", "--steps-per-epoch", "5", "--batch-per-replica",
                                   "16", "--threads", "1", "--verbose", "0"}) {
      argv.push_back(arg);
    }
    nodes.push_back(std::make_unique<testing::Process>(
        argv, std::map<std::string, std::string>{
                  {"TF_CONFIG", ""}, {"FLOTILLA_RENDEZVOUS", ""}, {"OMP_NUM_THREADS", "1"}}));
  }
  std::string all;
  for (auto& node : nodes) {
    const auto r = node->wait(std::chrono::seconds(240));
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    all += r.out + r.err;
  }
  EXPECT_EQ(count_of(all, "MultiWorkerMirroredStrategy: 2 worker(s)"), 1u) << all; // the chief's
  EXPECT_EQ(count_of(all, "Test: loss: "), 1u) << all;
}

// The pids of `parent`'s children, from /proc.
std::vector<int> children_of(int parent) {
  std::vector<int> out;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(entry.path() / "stat");
    std::string line;
    std::getline(stat, line);
    const auto close = line.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(line.substr(close + 2));
    char state = 0;
    int ppid = 0;
    rest >> state >> ppid;
    if (ppid == parent) out.push_back(std::stoi(name));
  }
  return out;
}

// torchrun --max-restarts: a worker SIGKILLed in the second epoch; the agent restarts both
// workers (TORCHELASTIC_RESTART_COUNT 1: a fresh meeting in its store), and with --backup-dir
// they resume from the backup of the first epoch and finish.
TEST(Torchrun, MaxRestartsResumesEveryWorkerFromTheBackup) {
  testing::TempDir dir;
  const int port = testing::free_ports(1)[0];
  std::vector<std::string> argv = {testing::test_python(), "-m", "torch.distributed.run"};
  for (const std::string& arg :
       {"--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "1", "--master-port"}) {
    argv.push_back(arg);
  }
  argv.push_back(std::to_string(port));
  for (const std::string& arg : {"--no-python", kCli.c_str(), "train", "--model", "mlp", "--epochs",
                                 "3", "--steps-per-epoch", "400", "--batch-per-replica", "16",
                                 "--threads", "1", "--verbose", "2"}) {
    argv.push_back(arg);
  }
  argv.push_back("--backup-dir");
  argv.push_back(dir.path() + "/backup");
  testing::Process agent(
      argv, {{"TF_CONFIG", ""}, {"FLOTILLA_RENDEZVOUS", ""}, {"OMP_NUM_THREADS", "1"}});
  ASSERT_TRUE(agent.wait_for_output("Epoch 2/3", std::chrono::seconds(120)))
      << agent.output_so_far() << agent.errors_so_far();
  const auto workers = children_of(agent.pid());
  ASSERT_EQ(workers.size(), 2u);
  ::kill(workers[0], SIGKILL);
  const auto r = agent.wait(std::chrono::seconds(240));
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::string all = r.out + r.err;
  EXPECT_NE(all.find("BackupAndRestore: resuming from " + dir.path() +
                     "/backup/backup-1 at epoch "
                     "2, step 0 (400 updates done)"),
            std::string::npos)
      << all;
  EXPECT_EQ(count_of(all, "Test: loss: "), 1u) << all;
}

} // namespace
} // namespace flotilla
