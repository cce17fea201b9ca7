// The flotilla CLI as a user runs it: tf-config output, bad flags and bad configuration.
#include <gtest/gtest.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <thread>
#include <tuple>

#include "flotilla/checkpoint/checkpoint_manager.h"
#include "flotilla/checkpoint/model_checkpoint.h"
#include "flotilla/cluster/cluster_spec.h"
#include "flotilla/error.h"
#include "support/paths.h"
#include "support/subprocess.h"
#include "tools/flotilla/flags.h"

namespace flotilla {
namespace {

using testing::run_process;
const std::string kCli = flotilla::testing::flotilla_cli();

std::size_t line_count(const std::string& s) {
  return std::count(s.begin(), s.end(), '\n');
}

TEST(TfConfigCommand, OutputRoundTripsThroughTheParser) {
  const auto r =
      run_process({kCli, "tf-config", "--workers", "10.0.0.1:2222,10.0.0.2:2222", "--chief",
                   "10.0.0.9:2222", "--evaluator", "10.0.0.8:2222", "--index", "1"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto spec = cluster::parse_tf_config(r.out);
  EXPECT_EQ(spec.chief.at(0).to_string(), "10.0.0.9:2222");
  EXPECT_EQ(spec.worker.at(1).to_string(), "10.0.0.2:2222");
  EXPECT_EQ(spec.evaluator.at(0).to_string(), "10.0.0.8:2222");
  EXPECT_EQ(spec.task.type, cluster::TaskType::kWorker);
  EXPECT_EQ(spec.task.index, 1);
  EXPECT_EQ(spec.rank, 2); // after the chief and worker 0
  EXPECT_EQ(spec.world_size, 3);
  const auto chief = run_process(
      {kCli, "tf-config", "--workers", "a:1", "--chief", "c:2", "--type", "chief", "--index", "0"});
  EXPECT_EQ(cluster::parse_tf_config(chief.out).rank, 0);
}

TEST(TfConfigCommand, BadInputIsOneLineAndExitCode2) {
  const auto r = run_process({kCli, "tf-config", "--workers", "a:1,b", "--index", "0"});
  EXPECT_EQ(r.exit_code, kExitBadInput);
  EXPECT_EQ(r.err, "flotilla tf-config: error: --workers entry 1: \"b\" has no port; write "
                   "\"host:port\", e.g. \"10.0.0.2:2222\"\n");
  const auto range = run_process({kCli, "tf-config", "--workers", "a:1,b:2", "--index", "2"});
  EXPECT_EQ(range.exit_code, kExitBadInput);
  EXPECT_EQ(range.err,
            "flotilla tf-config: error: TF_CONFIG task.index 2 is out of range: cluster.worker "
            "has 2 addresses, so use 0 to 1\n");
}

TEST(TrainCommand, BadFlagsAreOneLineAndExitCode2) {
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"train", "--model", "resnet"},
        std::vector<std::string>{"train", "--epochs", "0"},
        std::vector<std::string>{"train", "--no-such-flag"},
        std::vector<std::string>{"launch", "--workers", "2"},
        std::vector<std::string>{"frobnicate"}}) {
    std::vector<std::string> argv = {kCli};
    argv.insert(argv.end(), args.begin(), args.end());
    const auto r = run_process(argv);
    EXPECT_EQ(r.exit_code, kExitBadInput) << args[0] << " " << r.err;
    EXPECT_EQ(line_count(r.err), 1u) << r.err;
    EXPECT_EQ(r.err.rfind("flotilla", 0), 0u) << r.err;
  }
}

// Every numeric flag has both bounds, named in its one-line error (the hostile probe's values:
// a batch of 10^8 grew to std::bad_alloc, exit 1; --lr 1e300 overflowed naming no flag; --seed
// -1 became 2^64 - 1; a rendezvous with a heartbeat timeout of 1e-9 s expelled every worker).
TEST(TrainCommand, ANumberOutsideAFlagsBoundsIsRefusedNamingTheFlagAndItsBounds) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"train", "--batch-per-replica", "100000000"},
       "--batch-per-replica: takes a finite number above 0 and at most 1048576; saw 100000000"},
      {{"train", "--batch-per-replica", "4294967296"},
       "--batch-per-replica: takes a finite number above 0 and at most 1048576; saw 4294967296"},
      {{"train", "--lr", "1e300"},
       "--lr: takes a finite number above 0 and at most 1000; saw 1e300"},
      {{"train", "--seed", "-1"},
       "--seed: takes a finite number from 0 to 9.00719925474e+15; saw -1"},
      {{"train", "--shares", "2,0"},
       "--shares: \"0\" is not a whole number from 1 to 1048576; write equal, auto, or one "
       "weight per worker in task order, e.g. 2,1"},
      {{"train", "--straggler-floor", "1"},
       "--straggler-floor: takes a finite number from 0 to 0.99; saw 1"},
      {{"rendezvous", "--listen", "127.0.0.1:0", "--workers", "2", "--heartbeat-timeout", "1e-9"},
       "--heartbeat-timeout: takes a finite number from 0.1 to 3600; saw 1e-9"},
  };
  for (const auto& [args, message] : cases) {
    std::vector<std::string> argv = {kCli};
    argv.insert(argv.end(), args.begin(), args.end());
    const auto r = run_process(argv);
    EXPECT_EQ(r.exit_code, kExitBadInput) << args[1] << " " << r.err;
    EXPECT_EQ(line_count(r.err), 1u) << r.err;
    EXPECT_NE(r.err.find(message), std::string::npos) << r.err;
  }
}

// The batch against memory, before anything of its size is allocated: the cnn at 2^20 images a
// replica needs far more than any machine the tests run on has (the probe's 10^8 grew to
// std::bad_alloc; 2^20, the flag's bound, grew until the OOM killer came).
TEST(TrainCommand, ABatchLargerThanMemoryIsRefusedBeforeTraining) {
  const auto r = run_process({kCli, "train", "--model", "cnn", "--batch-per-replica", "1048576",
                              "--precision", "float32", "--threads", "1"});
  EXPECT_EQ(r.exit_code, kExitBadInput) << r.err;
  EXPECT_EQ(line_count(r.err), 1u) << r.err;
  EXPECT_NE(
      r.err.find("--batch-per-replica 1048576: a training step of cnn (float32) needs about "),
      std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find(" for each replica: MemAvailable "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(" / 1 worker(s) on this host (one worker: "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("`flotilla tune --max-batch --model cnn` finds the largest that fits"),
            std::string::npos)
      << r.err;
}

// Untrusted input in an error line is escaped and cut (the probe's: TF_CONFIG errors of 200 KB on
// one line, a NUL that ended the message where it stood, escape sequences sent to the terminal).
TEST(TrainCommand, EchoedInputIsEscapedAndCut) {
  const std::string big(100000, 'x');
  const std::string tf_config =
      R"({"cluster":{"worker":["h:1"]},"task":{"type":"wor\u0000ker\u001b[31m)" + big +
      R"(","index":0}})";
  const std::vector<
      std::tuple<std::vector<std::string>, std::map<std::string, std::string>, std::string>>
      cases = {
          {{"train", "--model", "mlp"},
           {{"TF_CONFIG", tf_config}},
           R"(TF_CONFIG task.type "wor\x00ker\x1b[31mxxx)"},
          {{"train", "--model", "mlp"},
           {{"FLOTILLA_RENDEZVOUS", "\x1b[2J" + big + ":1"}},
           R"(FLOTILLA_RENDEZVOUS: the host in "\x1b[2Jxxx)"},
          {{"train", "--model", "\x1b[2J" + big}, {}, "\\x1b[2Jxxx"},
      };
  for (const auto& [args, env, message] : cases) {
    std::vector<std::string> argv = {kCli};
    argv.insert(argv.end(), args.begin(), args.end());
    const auto r = run_process(argv, env);
    EXPECT_EQ(r.exit_code, kExitBadInput) << r.err.substr(0, 2000);
    EXPECT_EQ(line_count(r.err), 1u) << r.err.substr(0, 2000);
    EXPECT_LT(r.err.size(), 1500u) << r.err.substr(0, 2000);
    EXPECT_NE(r.err.find(message), std::string::npos) << r.err.substr(0, 2000);
    EXPECT_EQ(r.err.find('\x1b'), std::string::npos) << r.err.substr(0, 2000);
    EXPECT_NE(r.err.find("(cut: "), std::string::npos) << r.err.substr(0, 2000);
  }
}

// Connections are descriptors: the CLI raises its soft limit on open files to the hard one at
// start-up (under 1024, waves of stray connections to the Gloo ports aborted the workers).
TEST(TrainCommand, TheSoftLimitOnOpenFilesIsRaisedToTheHardOne) {
  testing::Process train({"prlimit", "--nofile=256:4096", kCli, "train", "--model", "mlp",
                          "--epochs", "1", "--batch-per-replica", "8", "--threads", "1"});
  ASSERT_TRUE(train.wait_for_errors("recipe:")) << train.errors_so_far();
  std::ifstream limits("/proc/" + std::to_string(train.pid()) + "/limits");
  std::string line, found;
  while (std::getline(limits, line)) {
    if (line.rfind("Max open files", 0) == 0) found = line;
  }
  train.signal(SIGKILL);
  std::istringstream fields(found.substr(std::string("Max open files").size()));
  std::string soft, hard;
  fields >> soft >> hard;
  EXPECT_EQ(soft, "4096") << found;
  EXPECT_EQ(hard, "4096") << found;
}

// The probe's case: a run that diverges exited 0 and saved a checkpoint with NaN weights. Now it
// exits 5 (kExitDiverged) saying so, no checkpoint of non-finite weights is written (the newest
// is the last finite one, if any), and the backups stay for a run with a lower rate.
TEST(TrainCommand, ADivergedRunExits5AndLeavesNoNonFiniteCheckpoint) {
  testing::TempDir dir;
  const std::string checkpoints = dir.path() + "/ckpt", backups = dir.path() + "/backup";
  const auto r = run_process({kCli,
                              "train",
                              "--model",
                              "mlp",
                              "--epochs",
                              "3",
                              "--steps-per-epoch",
                              "8",
                              "--batch-per-replica",
                              "32",
                              "--lr",
                              "1000",
                              "--threads",
                              "1",
                              "--checkpoint-dir",
                              checkpoints,
                              "--backup-dir",
                              backups,
                              "--backup-freq",
                              "2"});
  EXPECT_EQ(r.exit_code, kExitDiverged) << r.err;
  EXPECT_NE(r.err.find("the training diverged (batch "), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("Test: loss"), std::string::npos) << r.err;
  for (const std::string& d : {checkpoints, backups}) {
    if (!std::filesystem::exists(d)) continue;
    for (const auto& entry : std::filesystem::directory_iterator(d)) {
      if (!std::filesystem::exists(entry.path() / "manifest.json")) continue;
      const auto data = checkpoint::read_checkpoint(entry.path());
      EXPECT_EQ(checkpoint::first_non_finite(data.model), "") << entry.path();
    }
  }
}

// The cluster token the user set keys the checkpoints' manifests (manifest.hmac); a token
// `flotilla launch` made for one run keys nothing, since the next run's differs.
TEST(TrainCommand, TheUsersClusterTokenKeysTheCheckpointsAndALaunchsOwnTokenDoesNot) {
  for (const bool run_only : {false, true}) {
    testing::TempDir dir;
    std::map<std::string, std::string> env = {{"FLOTILLA_CLUSTER_TOKEN", "the user's secret"}};
    if (run_only) env["FLOTILLA_CLUSTER_TOKEN_RUN_ONLY"] = "1";
    const auto r =
        run_process({kCli, "train", "--model", "mlp", "--epochs", "1", "--steps-per-epoch", "2",
                     "--batch-per-replica", "16", "--threads", "1", "--checkpoint-dir", dir.path()},
                    env);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const std::filesystem::path saved = std::filesystem::path(dir.path()) / "ckpt-1";
    EXPECT_EQ(std::filesystem::exists(saved / "manifest.hmac"), !run_only) << run_only;
    if (!run_only) {
      EXPECT_EQ(checkpoint::read_checkpoint(saved, std::string("the user's secret")).epoch, 1);
      EXPECT_THROW(checkpoint::read_checkpoint(saved, std::string("another")), CheckpointError);
    }
  }
}

TEST(TrainCommand, BadTfConfigIsOneLineAndExitCode2) {
  const auto r = run_process({kCli, "train", "--steps-per-epoch", "1"},
                             {{"TF_CONFIG", R"({"cluster": {"worker": ["a:1"], "ps": ["b:2"]},
                                               "task": {"type": "worker"}})"}});
  EXPECT_EQ(r.exit_code, kExitBadInput);
  EXPECT_EQ(r.err, "flotilla train: error: TF_CONFIG cluster has \"ps\" tasks: parameter-server "
                   "training is not supported; use chief/worker\n");
}

TEST(TrainCommand, TheEvaluatorTaskNeedsTheChiefsCheckpointDir) {
  const auto r = run_process(
      {kCli, "train"}, {{"TF_CONFIG", R"({"cluster": {"worker": ["a:1"], "evaluator": ["e:2"]},
                                               "task": {"type": "evaluator"}})"}});
  EXPECT_EQ(r.exit_code, kExitBadInput);
  EXPECT_NE(r.err.find("it evaluates the chief's checkpoints, so give it --checkpoint-dir"),
            std::string::npos)
      << r.err;
}

// The issue's case, as a user typed it: the backup directory held the checkpoints and a file of
// the user's, and a completed fit deleted all of it. Now refused before training, one line,
// exit 2; a run with directories of their own keeps its checkpoints and drops only the backups.
TEST(TrainCommand, ABackupDirHoldingTheCheckpointDirOrOtherFilesIsRefusedAndKept) {
  testing::TempDir dir;
  const std::string run = dir.path() + "/run";
  std::filesystem::create_directories(run);
  std::ofstream(run + "/notes.txt") << "mine";
  const std::vector<std::string> train = {kCli,       "train", "--model",           "mlp",
                                          "--epochs", "2",     "--steps-per-epoch", "10"};
  auto with = [&](std::vector<std::string> more) {
    std::vector<std::string> argv = train;
    argv.insert(argv.end(), more.begin(), more.end());
    return run_process(argv);
  };
  auto r = with({"--backup-dir", run, "--checkpoint-dir", run + "/ckpt"});
  EXPECT_EQ(r.exit_code, kExitBadInput) << r.err;
  // The recipe's lines, then the error as one line.
  const std::string last = r.err.substr(r.err.rfind('\n', r.err.size() - 2) + 1);
  EXPECT_EQ(last, "flotilla train: error: BackupOptions::backup_dir (--backup-dir) " + run +
                      " and ModelCheckpointOptions::filepath (--checkpoint-dir) " + run +
                      "/ckpt overlap: the second is inside the first; the first holds only the "
                      "files it writes, and deletes them when the fit ends, so give it a "
                      "directory of its own, neither inside the other nor containing it\n");
  r = with({"--backup-dir", run});
  EXPECT_EQ(r.exit_code, kExitBadInput) << r.err;
  EXPECT_NE(r.err.find(run + " holds what flotilla did not write (notes.txt)"), std::string::npos)
      << r.err;
  EXPECT_EQ(testing::entries(run), std::vector<std::string>{"notes.txt"});

  r = with({"--backup-dir", dir.path() + "/backup", "--checkpoint-dir", run + "/ckpt"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(testing::entries(run), (std::vector<std::string>{"ckpt", "notes.txt"}));
  EXPECT_EQ(testing::entries(run + "/ckpt"),
            (std::vector<std::string>{"checkpoint", "ckpt-1", "ckpt-2"}));
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/backup")); // flotilla made it

  // flotilla's own outputs in it are not foreign (the probe's case: --metrics-json there was
  // created, then the directory refused for holding it), and they stay when the backups go.
  const std::string own = dir.path() + "/own";
  std::filesystem::create_directories(own);
  r = with({"--backup-dir", own, "--metrics-json", own + "/metrics.jsonl"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(testing::entries(own), std::vector<std::string>{"metrics.jsonl"});
}

TEST(TrainCommand, MissingDataIsOneLineAndExitCode2) {
  const auto r = run_process({kCli, "train", "--data-dir", "/nonexistent"});
  EXPECT_EQ(r.exit_code, kExitBadInput);
  EXPECT_EQ(
      r.err,
      "flotilla train: error: /nonexistent: has no train-images-idx3-ubyte.gz (nor "
      "train-images-idx3-ubyte); point data::fashion_mnist (--data-dir) at the Fashion-MNIST "
      "IDX files, or on "
      "Debian install the dataset-fashion-mnist package (/usr/share/datasets/fashion-mnist)\n");
}

// --validation holds out the last 10% of the training images (Keras's validation_split) and the
// test split is evaluated once at the end: no image is reported as both.
TEST(TrainCommand, ValidationIsHeldOutOfTheTrainingSetNeverTheTestSplit) {
  if (!testing::fashion_mnist_present()) GTEST_SKIP() << "no Fashion-MNIST";
  const auto r =
      run_process({kCli, "train", "--model", "mlp", "--epochs", "1", "--batch-per-replica", "64",
                   "--threads", "1", "--validation", "--verbose", "2"},
                  {{"TF_CONFIG", ""}});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string all = r.out + r.err;
  EXPECT_NE(all.find("validation: the last 6000 of 60000 training images held out"),
            std::string::npos)
      << all;
  EXPECT_NE(all.find("843/843 - "), std::string::npos) << all; // 54000 / 64 steps: 6000 held out
  EXPECT_NE(all.find(" - val_loss: "), std::string::npos) << all;
  EXPECT_NE(all.find("Test: loss: "), std::string::npos) << all;
  EXPECT_NE(all.find("(10000 samples)"), std::string::npos) << all;

  const auto alone = run_process({kCli, "train", "--validation-split", "0.2"}, {{"TF_CONFIG", ""}});
  EXPECT_EQ(alone.exit_code, kExitBadInput);
  EXPECT_EQ(alone.err, "flotilla train: error: --validation-split on Fashion-MNIST is the fraction "
                       "of its training images held out for --validation (it has its own test "
                       "split); add --validation, or drop --validation-split\n");
  const auto folder = run_process({kCli, "train", "--dataset", "image-folder", "--data-dir",
                                   "/nonexistent", "--validation-split", "0.2", "--validation"},
                                  {{"TF_CONFIG", ""}});
  EXPECT_EQ(folder.exit_code, kExitBadInput);
  EXPECT_NE(folder.err.find("would report the same images twice"), std::string::npos) << folder.err;
}

// Two workers started by hand from one TF_CONFIG, both at 127.0.0.1 (no launcher, no
// LOCAL_WORLD_SIZE): they divide the host's cores and say so. The compile step rewrites the
// zoo's ResNet-20 and, after the first step, the recipe says what ran for each kind of layer;
// without it (--no-jit-compile) the model runs as written.
TEST(TrainCommand, HandStartedWorkersShareTheCoresAndTheRecipeSaysWhichKernelsRan) {
  if (!testing::fashion_mnist_present()) GTEST_SKIP() << "no Fashion-MNIST";
  // 256 training and 64 test images: the final evaluation of all 10000 on one thread a worker
  // was most of this test (97-107 s under make test's load).
  testing::TempDir data;
  ASSERT_TRUE(testing::write_fashion_mnist_subset(data.path(), 256, 64));
  const auto ports = testing::free_ports(2);
  const std::string cluster = R"({"cluster": {"worker": ["127.0.0.1:)" + std::to_string(ports[0]) +
                              R"(", "localhost:)" + std::to_string(ports[1]) + R"("]}, )";
  std::vector<std::unique_ptr<testing::Process>> workers;
  for (int index = 0; index < 2; ++index) {
    workers.push_back(std::make_unique<testing::Process>(
        std::vector<std::string>{kCli, "train", "--model", "resnet20", "--epochs", "1",
                                 "--steps-per-epoch", "2", "--batch-per-replica", "8", "--kernels",
                                 "fixed", "--verbose", "0", "--no-doctor", "--data-dir",
                                 data.path()},
        std::map<std::string, std::string>{
            {"TF_CONFIG",
             cluster + R"("task": {"type": "worker", "index": )" + std::to_string(index) + "}}"},
            {"LOCAL_WORLD_SIZE", ""}}));
  }
  std::string all;
  for (auto& w : workers) {
    const auto r = w->wait(std::chrono::seconds(120));
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    all += r.out + r.err;
  }
  EXPECT_NE(all.find("/ 2 worker(s) on this host, from TF_CONFIG's tasks at this task's address"),
            std::string::npos)
      << all;
  // On a CPU that computes bfloat16 (auto precision picks it) the line goes on with the other
  // convolutions in float32 arithmetic; in float32 it goes on with what was left to ATen.
  EXPECT_NE(all.find("recipe: compile step: rewrote 16 3x3 convolutions, 10 BatchNorm+ReLU"),
            std::string::npos)
      << all;
  EXPECT_NE(all.find("left to ATen: 11 BatchNorm2d (not followed by ReLU)"), std::string::npos)
      << all;
  EXPECT_NE(all.find("recipe: kernels: fixed (--kernels fixed)"), std::string::npos) << all;
  // Two workers divide by speed unless told otherwise (and say how to repeat a run bit for bit).
  EXPECT_NE(all.find("recipe: shares: by speed (the default on more than one worker; --shares "
                     "equal for reruns that repeat bit for bit)"),
            std::string::npos)
      << all;
  EXPECT_NE(all.find("recipe: 3x3 convolutions (Winograd's): flotilla's at 3 of 3 shape(s)"),
            std::string::npos)
      << all;

  const auto plain =
      run_process({kCli, "train", "--model", "resnet20", "--epochs", "1", "--steps-per-epoch", "1",
                   "--batch-per-replica", "8", "--no-jit-compile", "--verbose", "0", "--no-doctor",
                   "--data-dir", data.path()},
                  {{"TF_CONFIG", ""}});
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  const std::string said = plain.out + plain.err;
  EXPECT_NE(said.find("recipe: compiled step: off: the model runs as written"), std::string::npos)
      << said;
  EXPECT_EQ(said.find("recipe: compile step:"), std::string::npos) << said;
  EXPECT_EQ(said.find("recipe: shares:"), std::string::npos) << "one worker: nothing to divide";
  EXPECT_NE(said.find("recipe: kernels: measure (--kernels measure): 0 shape(s)"),
            std::string::npos)
      << said;
}

// Kubeflow Trainer v2's PET_* variables, as its torch runtime sets them on each node, read by
// flotilla train run directly (one worker per node): two "nodes" on loopback train together.
TEST(TrainCommand, TwoNodesTrainFromKubeflowTrainersPetVariables) {
  if (!testing::fashion_mnist_present()) GTEST_SKIP() << "no Fashion-MNIST";
  const int port = testing::free_ports(1)[0];
  std::vector<std::unique_ptr<testing::Process>> nodes;
  for (int rank = 0; rank < 2; ++rank) {
    nodes.push_back(std::make_unique<testing::Process>(
        std::vector<std::string>{kCli, "train", "--model", "mlp", "--epochs", "1",
                                 "--steps-per-epoch", "3", "--batch-per-replica", "16", "--threads",
                                 "1", "--verbose", "0"},
        std::map<std::string, std::string>{{"TF_CONFIG", ""},
                                           {"PET_NNODES", "2"},
                                           {"PET_NPROC_PER_NODE", "1"},
                                           {"PET_NODE_RANK", std::to_string(rank)},
                                           {"PET_MASTER_ADDR", "127.0.0.1"},
                                           {"PET_MASTER_PORT", std::to_string(port)}}));
  }
  std::string all;
  for (auto& node : nodes) {
    const auto r = node->wait(std::chrono::seconds(120));
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    all += r.out + r.err;
  }
  EXPECT_NE(all.find("MultiWorkerMirroredStrategy: 2 worker(s)"), std::string::npos) << all;
  EXPECT_NE(all.find("cluster from Kubeflow Trainer environment (PET_*)"), std::string::npos)
      << all;
}

TEST(TrainCommand, AnEvaluatorWithoutCheckpointsTimesOutNamingTheFlag) {
  if (!testing::fashion_mnist_present()) GTEST_SKIP() << "dataset-fashion-mnist absent";
  testing::TempDir dir;
  const auto r =
      run_process({kCli, "train", "--checkpoint-dir", dir.path(), "--timeout", "0.1"},
                  {{"TF_CONFIG", R"({"cluster": {"worker": ["a:1"], "evaluator": ["e:2"]},
                        "task": {"type": "evaluator"}})"}});
  EXPECT_EQ(r.exit_code, kExitComm) << r.err;
  EXPECT_EQ(line_count(r.err), 1u) << r.err;
  // The library names its option; the CLI's line adds the flag that sets it.
  EXPECT_NE(r.err.find("flotilla train: error: SidecarEvaluator: no new checkpoint in " +
                       dir.path() + " for 0.1 s (SidecarEvaluatorOptions::timeout, --timeout)"),
            std::string::npos)
      << r.err;
}

// tests/multiworker/elastic_worker with `flags`, as slot `slot` of the `world` workers on
// `ports`, meeting at the rendezvous at `listen`.
std::unique_ptr<testing::Process> elastic_worker(const std::vector<int>& ports, int world, int slot,
                                                 const std::string& listen,
                                                 const std::vector<std::string>& flags) {
  cluster::ClusterSpec spec;
  for (int i = 0; i < world; ++i)
    spec.worker.push_back({"127.0.0.1", ports[static_cast<std::size_t>(i)]});
  spec.task = {cluster::TaskType::kWorker, slot};
  std::vector<std::string> argv = {testing::test_bin_dir() + "/elastic_worker"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  return std::make_unique<testing::Process>(
      argv, std::map<std::string, std::string>{{"TF_CONFIG", cluster::to_tf_config(spec)},
                                               {"FLOTILLA_RENDEZVOUS", listen}});
}

// flotilla rendezvous: the arbiter as a process of its own. The chief of an elastic group is
// killed; the service (not the chief) hosted the rendezvous, so the other worker goes on.
TEST(RendezvousCommand, AnElasticGroupOutlivesItsKilledChiefAndTheServiceStopsOnSigterm) {
  const auto ports = testing::free_ports(3);
  const std::string listen = "127.0.0.1:" + std::to_string(ports[2]);
  testing::Process service(
      {kCli, "rendezvous", "--listen", listen, "--workers", "2", "--heartbeat-timeout", "30"});
  std::vector<std::unique_ptr<testing::Process>> workers;
  workers.push_back(elastic_worker(ports, 2, 0, listen,
                                   {"--steps", "5", "--signal-at", "2", "--signal", "KILL"}));
  workers.push_back(elastic_worker(ports, 2, 1, listen, {"--steps", "5"}));
  const auto chief = workers[0]->wait(std::chrono::seconds(60));
  const auto other = workers[1]->wait(std::chrono::seconds(60));
  EXPECT_EQ(chief.exit_code, 128 + SIGKILL) << chief.err;
  EXPECT_EQ(other.exit_code, 0) << other.out << other.err;
  EXPECT_NE(other.out.find("generation 1 [1] (slot 0 lost its connection"), std::string::npos)
      << other.out;
  EXPECT_NE(other.out.find("step 4 gen 1 rank 0/1 sum 2 ok"), std::string::npos) << other.out;
  service.signal(SIGTERM);
  const auto served = service.wait(std::chrono::seconds(30));
  EXPECT_EQ(served.exit_code, 0) << served.err;
  EXPECT_NE(served.out.find("flotilla rendezvous: serving an elastic group of 2 workers at " +
                            listen + "; set FLOTILLA_RENDEZVOUS=" + listen + " on every task"),
            std::string::npos)
      << served.out;
  EXPECT_NE(served.out.find("stopped by SIGTERM"), std::string::npos) << served.out;
  EXPECT_NE(served.err.find("rendezvous: generation 1 has 1 of 2 workers [1]"), std::string::npos)
      << served.err;
}

// The step number of the last "step K gen ..." line a worker printed; -1 before any.
long last_step(const std::string& out) {
  const auto at = out.rfind("\nstep ");
  if (at == std::string::npos) return -1;
  return std::stol(out.substr(at + 6, out.find(' ', at + 6) - at - 6));
}

// The last step a worker printed once it passed `target`, or when 30 s are up: progress, not a
// speed (under make test's load three workers once trained 3 steps of 10 ms in 2 s).
long step_past(testing::Process& worker, long target) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (last_step(worker.output_so_far()) <= target &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return last_step(worker.output_so_far());
}

// The rendezvous is no single point of failure: frozen (SIGSTOP) past the heartbeat timeout, and
// then killed, the group trains on without it; a new rendezvous on the same address takes the
// membership up from the members (generation 0 as it was), and heals the next fault.
TEST(RendezvousCommand, AGroupTrainsOnThroughItsRendezvousFrozenAndKilledAndHealsThroughTheNext) {
  const auto ports = testing::free_ports(4);
  const std::string listen = "127.0.0.1:" + std::to_string(ports[3]);
  const std::vector<std::string> serve = {
      kCli, "rendezvous", "--listen", listen, "--workers", "3", "--heartbeat-timeout", "1"};
  auto service = std::make_unique<testing::Process>(serve);
  std::vector<std::unique_ptr<testing::Process>> workers;
  for (int slot = 0; slot < 3; ++slot) {
    workers.push_back(
        elastic_worker(ports, 3, slot, listen,
                       {"--steps", "100000", "--step-ms", "10", "--heartbeat-timeout-ms", "1000",
                        "--heartbeat-interval-ms", "200"}));
  }
  auto& chief = *workers[0];
  // What a stall leaves to read: the chief's steps, every worker's log and the service's (once,
  // under make test's load, the chief printed step 11 and nothing more through the freeze, the
  // kill and the new rendezvous, which never took the members up; its logs were not kept).
  const auto everything = [&] {
    std::string all = chief.output_so_far();
    for (std::size_t i = 0; i < workers.size(); ++i)
      all += "\n--- worker " + std::to_string(i) + " log:\n" + workers[i]->errors_so_far();
    return all + "\n--- rendezvous log:\n" + service->errors_so_far();
  };
  ASSERT_TRUE(chief.wait_for_output("step 10 gen 0 rank 0/3 sum 6 ok")) << chief.errors_so_far();
  // Frozen for twice the heartbeat timeout: the members wait for its answer and train on; woken,
  // it counts nobody silent for the time it did not run.
  service->signal(SIGSTOP);
  const long frozen_at = last_step(chief.output_so_far());
  std::this_thread::sleep_for(std::chrono::seconds(2));
  const long thawed_at = step_past(chief, frozen_at + 10); // still frozen
  service->signal(SIGCONT);
  EXPECT_GT(thawed_at, frozen_at + 10) << everything();
  ASSERT_TRUE(service->wait_for_errors("(stopped or starved); no worker's silence counts that time",
                                       std::chrono::seconds(10)))
      << service->errors_so_far();
  // Killed: the members train on without it.
  service->signal(SIGKILL);
  const auto first = service->wait(std::chrono::seconds(10));
  const long killed_at = last_step(chief.output_so_far());
  ASSERT_TRUE(chief.wait_for_errors("lost the connection to the rendezvous at " + listen))
      << chief.errors_so_far();
  EXPECT_GT(step_past(chief, killed_at + 10), killed_at + 10) << everything();
  // A new one on the same address: the members join it again and name generation 0.
  service = std::make_unique<testing::Process>(serve);
  ASSERT_TRUE(service->wait_for_errors(
      "rendezvous: generation 0 has 3 of 3 workers [0,1,2]: taken up after the rendezvous "
      "restarted",
      std::chrono::seconds(30)))
      << everything();
  // Each member back in it (store and heartbeat): "answers again after" alone is also what the
  // thaw above printed, and a member killed before it rejoined is released as one that "did not
  // come back" instead (a make test run, once).
  for (auto& w : workers) {
    EXPECT_TRUE(
        w->wait_for_errors("joined it again as a member of generation 0", std::chrono::seconds(30)))
        << w->errors_so_far();
  }
  // The next fault heals through it: slot 2 is killed, the others regroup as generation 1.
  workers[2]->signal(SIGKILL);
  ASSERT_TRUE(workers[1]->wait_for_output("rank 1/2 sum 3 ok", std::chrono::seconds(30)))
      << workers[1]->errors_so_far();
  EXPECT_TRUE(service->wait_for_errors("rendezvous: generation 1 has 2 of 3 workers [0,1]: slot 2 "
                                       "lost its connection to the rendezvous"))
      << service->errors_so_far();
  const std::string out = chief.output_so_far();
  EXPECT_NE(out.find("regrouped after"), std::string::npos) << out;
  EXPECT_NE(out.find("generation 1 [0,1] (slot 2 lost its connection"), std::string::npos) << out;
  EXPECT_EQ(out.find("WRONG"), std::string::npos) << out;
  // Until slot 2's death no member regrouped: the rendezvous's outages cost nothing.
  EXPECT_EQ(out.find("regrouped after"), out.rfind("regrouped after")) << out;
  EXPECT_EQ(first.err.find("rendezvous: generation 1"), std::string::npos) << first.err;
}

// A restarted worker whose slot is still held (its old process stopped, not expelled yet) waits
// for the slot instead of failing as a misconfigured task would: it joins once the rendezvous
// expels the old one, and the others admit it. The heartbeat timeout (3 s) gives the new process
// time to start and ask before the old one is expelled: with 1 s, a make test's load once had it
// ask after, and it joined at once.
TEST(RendezvousCommand, ARestartWhoseSlotIsStillHeldWaitsForItAndIsAdmitted) {
  const auto ports = testing::free_ports(3);
  const std::string listen = "127.0.0.1:" + std::to_string(ports[2]);
  testing::Process service(
      {kCli, "rendezvous", "--listen", listen, "--workers", "2", "--heartbeat-timeout", "3"});
  const auto start = [&](int slot, std::vector<std::string> flags) {
    flags.insert(flags.end(), {"--heartbeat-timeout-ms", "3000", "--heartbeat-interval-ms", "200"});
    return elastic_worker(ports, 2, slot, listen, flags);
  };
  auto chief = start(0, {"--steps", "5", "--until-members", "2"});
  auto stopped = start(1, {"--steps", "5", "--signal-at", "3", "--signal", "STOP"});
  ASSERT_TRUE(stopped->wait_for_output("step 2 gen 0")) << stopped->errors_so_far();
  auto again = start(1, {"--steps", "5"});
  const auto restarted = again->wait(std::chrono::seconds(60));
  const auto first = chief->wait(std::chrono::seconds(60));
  EXPECT_EQ(restarted.exit_code, 0) << restarted.err;
  EXPECT_NE(restarted.err.find("the rendezvous at " + listen +
                               " refused worker 1 at 127.0.0.1:" + std::to_string(ports[1]) +
                               " (rank 1) for now: slot 1 is already taken by the process at"),
            std::string::npos)
      << restarted.err;
  EXPECT_NE(restarted.err.find("trying again until the timeout (60 s)"), std::string::npos)
      << restarted.err;
  EXPECT_NE(restarted.out.find("joined: generation 2 [0,1] (admitted slot 1)"), std::string::npos)
      << restarted.out;
  EXPECT_EQ(first.exit_code, 0) << first.err;
  EXPECT_NE(first.out.find("generation 1 [0] (slot 1 stopped sending heartbeats"),
            std::string::npos)
      << first.out;
  EXPECT_EQ(first.out.find("WRONG"), std::string::npos) << first.out;
}

// Three elastic members of a `flotilla rendezvous` (heartbeat timeout 1 s) train `steps` steps
// with a collective timeout of `timeout_ms`; slot 2 hangs before step 3's all-reduce, slot 0 gets
// `slot0_flags` too. Slots 0 and 1 must go on as generation 1 without slot 2, expelled as hung
// (its own process told so); their results are returned.
std::vector<testing::ProcessResult>
run_with_a_hung_member(int steps, int timeout_ms, const std::vector<std::string>& slot0_flags) {
  const auto ports = testing::free_ports(4);
  const std::string listen = "127.0.0.1:" + std::to_string(ports[3]);
  testing::Process service(
      {kCli, "rendezvous", "--listen", listen, "--workers", "3", "--heartbeat-timeout", "1"});
  std::vector<std::unique_ptr<testing::Process>> workers;
  for (int slot = 0; slot < 3; ++slot) {
    std::vector<std::string> flags = {"--steps",
                                      std::to_string(steps),
                                      "--timeout-ms",
                                      std::to_string(timeout_ms),
                                      "--heartbeat-timeout-ms",
                                      "1000",
                                      "--heartbeat-interval-ms",
                                      "200"};
    if (slot == 2) flags.insert(flags.end(), {"--signal-at", "3", "--signal", "HANG"});
    if (slot == 0) flags.insert(flags.end(), slot0_flags.begin(), slot0_flags.end());
    workers.push_back(elastic_worker(ports, 3, slot, listen, flags));
  }
  std::vector<testing::ProcessResult> results;
  for (int slot = 0; slot < 2; ++slot) {
    results.push_back(workers[static_cast<std::size_t>(slot)]->wait(std::chrono::seconds(90)));
    const auto& r = results.back();
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_NE(r.out.find("generation 1 [0,1] (slot 2 made no progress: it never reached "
                         "all_reduce #"),
              std::string::npos)
        << r.out;
    EXPECT_NE(r.out.find("step " + std::to_string(steps - 1) + " gen 1 rank " +
                         std::to_string(slot) + "/2 sum 3 ok"),
              std::string::npos)
        << r.out;
  }
  // Its heartbeat hears it: the process says so (its hung thread cannot be stopped from here).
  EXPECT_TRUE(workers[2]->wait_for_errors("slot 2 made no progress: it never reached all_reduce "
                                          "#",
                                          std::chrono::seconds(10)))
      << workers[2]->errors_so_far();
  EXPECT_TRUE(workers[2]->wait_for_errors("it was expelled from the training group (start it "
                                          "again to rejoin)",
                                          std::chrono::seconds(10)))
      << workers[2]->errors_so_far();
  return results;
}

// A member whose training thread hangs outside the collectives while its heartbeat runs: the
// others time out in the collective it never reaches, say so to the rendezvous, which expels it,
// and they go on without it instead of exiting.
TEST(RendezvousCommand, AMemberHungOutsideTheCollectivesIsExpelledAndTheOthersGoOn) {
  run_with_a_hung_member(8, 4000, {});
}

// As above, but slot 0 reaches that collective late: slot 1 times out first (2 s after it
// entered), waits its grace (2 s) for the others to say where they are, and reports slot 0 as
// well as slot 2 before slot 0's own timeout fires (slot 0 enters 3 s after slot 1). Slot 0's
// heartbeat says it started the collective: only slot 2 is expelled.
TEST(RendezvousCommand, AMemberThatReachesTheCollectiveLateIsNotTakenForAHungOne) {
  for (const auto& r : run_with_a_hung_member(
           6, 2000, {"--signal-at", "3", "--signal", "NAP", "--nap-ms", "3000"})) {
    EXPECT_EQ(r.out.find("slot 0 made no progress"), std::string::npos) << r.out;
  }
}

// The table's flags are the CLI's: each one a subcommand's --help lists.
TEST(TrainCommand, EveryFlagOfTheApiTableIsAFlagOfTheCli) {
  auto help_of = [](const std::string& sub) {
    const auto r = run_process({kCli, sub, "--help"});
    EXPECT_EQ(r.exit_code, 0) << sub << " " << r.err;
    return r.out;
  };
  std::string every_help;
  for (const char* sub : {"train", "launch", "tune", "doctor", "plan"}) every_help += help_of(sub);
  auto listed = [](const std::string& help, const std::string& flag) {
    for (auto at = help.find(flag); at != std::string::npos; at = help.find(flag, at + 1)) {
      const char next = at + flag.size() < help.size() ? help[at + flag.size()] : ' ';
      if (!std::isalnum(static_cast<unsigned char>(next)) && next != '-') return true;
    }
    return false;
  };
  for (const auto& entry : tools::flag_table()) {
    // "--schedule cosine": the flag; "flotilla tune --max-batch": that subcommand's flags.
    std::istringstream words(entry.flag);
    std::string word, help = every_help;
    words >> word;
    if (word == "flotilla") {
      words >> word;
      help = help_of(word);
      EXPECT_NE(help.find("Usage:"), std::string::npos) << entry.api << ": no command " << word;
      if (!(words >> word)) continue;
    }
    do {
      if (word.rfind("--", 0) == 0) EXPECT_TRUE(listed(help, word)) << entry.api << " -> " << word;
    } while (words >> word);
  }
}

} // namespace
} // namespace flotilla
