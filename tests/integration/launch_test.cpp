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

using testing::run_process;
const std::string kCli = flotilla::testing::flotilla_cli();

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

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
  std::this_thread::sleep_for(std::chrono::seconds(2)); // let both shells set their trap
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

std::size_t count_of(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
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
    std::this_thread::sleep_for(std::chrono::seconds(2)); // let both shells set their trap
    launch.signal(SIGTERM);
    const auto r = launch.wait(std::chrono::seconds(60));
    EXPECT_EQ(r.exit_code, launch_exit) << r.out << r.err;
    EXPECT_EQ(r.err.find("restarting"), std::string::npos) << r.err;
    EXPECT_EQ(count_of(r.out, "ready"), 2u) << "one run only: " << r.out;
  }
}

// --elastic: launch hosts the rendezvous; a SIGKILLed worker is restarted alone, the others
// keep training in the same processes and admit it when it is back.
TEST(Launch, ElasticRestartsOnlyTheDeadWorkerAndTheOthersKeepTheirProcesses) {
  testing::TempDir dir;
  const std::string once = dir.path() + "/signalled";
  const auto r = run_process({kCli,
                              "launch",
                              "--elastic",
                              "--workers",
                              "3",
                              "--max-restarts",
                              "1",
                              "--",
                              testing::test_bin_dir() + "/elastic_worker",
                              "--steps",
                              "8",
                              "--until-members",
                              "3",
                              "--signal-slot",
                              "1",
                              "--signal-at",
                              "2",
                              "--signal",
                              "KILL",
                              "--signal-once",
                              once},
                             {}, std::chrono::seconds(120));
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.err.find("[launch] worker 1 was killed by signal Killed; restarting it alone "
                       "(restart 1 of 1); the others go on and admit it when it is back"),
            std::string::npos)
      << r.err;
  // One process per survivor from start to end; two for the restarted worker.
  std::map<int, std::set<std::string>> pids;
  std::map<int, std::string> last;
  for (const auto& line : lines_of(r.out)) {
    if (line.rfind("[worker ", 0) != 0) continue;
    const int w = std::stoi(line.substr(8));
    const std::string text = line.substr(line.find("] ") + 2);
    if (text.rfind("pid ", 0) == 0) pids[w].insert(text.substr(4, text.find(' ', 4) - 4));
    if (text.rfind("done at step", 0) == 0) last[w] = text;
  }
  EXPECT_EQ(pids[0].size(), 1u) << r.out;
  EXPECT_EQ(pids[2].size(), 1u) << r.out;
  EXPECT_EQ(pids[1].size(), 2u) << r.out;
  ASSERT_EQ(last.size(), 3u) << r.out;
  EXPECT_EQ(last[0], last[1]) << "all end together, the restarted worker too";
  EXPECT_EQ(last[0], last[2]);
  EXPECT_NE(last[0].find("with [0,1,2]"), std::string::npos) << last[0];
  EXPECT_NE(r.out.find("regrouped after"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("WRONG"), std::string::npos) << r.out;
}

// Model::fit in an elastic group of 3 (tests/multiworker/elastic_trainer.cpp) under launch
// --elastic, against the same fit by one worker on the same global batches (--reference).
struct ElasticFit {
  testing::TempDir dir;
  const std::string trainer = testing::test_bin_dir() + "/elastic_trainer";
  const std::string reference = dir.path() + "/reference";
  const std::string elastic = dir.path() + "/elastic";
  int epochs = 4;

  ElasticFit() {
    std::filesystem::create_directories(reference);
    std::filesystem::create_directories(elastic);
  }
  // launch's command line: worker 2 signals itself once before global step 7; `extra` goes to
  // launch (before the command).
  std::vector<std::string> launch(const std::string& signal, const std::string& sleep_ms,
                                  std::vector<std::string> extra = {"--max-restarts", "1"},
                                  const std::vector<std::string>& trainer_extra = {}) const {
    std::vector<std::string> argv = {kCli, "launch", "--elastic", "--workers", "3"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    for (const std::string& arg :
         {std::string("--heartbeat-timeout"), std::string("2"), std::string("--"), trainer,
          std::string("--out"), elastic, std::string("--sleep-ms"), sleep_ms,
          std::string("--signal-slot"), std::string("2"), std::string("--signal-at"),
          std::string("7"), std::string("--signal"), signal, std::string("--signal-once"),
          dir.path() + "/signalled"}) {
      argv.push_back(arg);
    }
    argv.insert(argv.end(), trainer_extra.begin(), trainer_extra.end());
    argv.insert(argv.end(), {"--epochs", std::to_string(epochs)});
    return argv;
  }
  // The weights of every worker equal the one-worker run's within 1e-6 (float32), so do the
  // val_loss of every epoch each finished (within 1e-5), and the ledgers of `processes`
  // processes hold each (epoch, sample) exactly once.
  void expect_one_workers_result(int processes, bool check_ledgers = true) const {
    const auto alone =
        run_process({trainer, "--reference", "--out", reference, "--epochs", std::to_string(epochs)});
    ASSERT_EQ(alone.exit_code, 0) << alone.err;
    expect_every_slot_has_the_references_weights();
    // Validation after each epoch a process finished, on the workers there were then.
    std::map<int, double> expected_val;
    {
      std::ifstream in(reference + "/val-0.txt");
      int epoch = 0;
      double loss = 0;
      while (in >> epoch >> loss) expected_val[epoch] = loss;
    }
    ASSERT_EQ(expected_val.size(), static_cast<std::size_t>(epochs));
    for (int slot = 0; slot < 3; ++slot) {
      std::ifstream in(elastic + "/val-" + std::to_string(slot) + ".txt");
      int epoch = 0, epochs = 0;
      double loss = 0;
      while (in >> epoch >> loss) {
        ++epochs;
        EXPECT_NEAR(loss, expected_val.at(epoch), 1e-5) << "slot " << slot << " epoch " << epoch;
      }
      EXPECT_GT(epochs, 0) << "slot " << slot;
    }
    if (check_ledgers) expect_every_sample_once(processes);
  }
  // Every slot's final weights equal the reference run's (<reference>/weights-0) within 1e-6.
  void expect_every_slot_has_the_references_weights() const {
    const auto expected = checkpoint::load_safetensors(reference + "/weights-0.safetensors");
    for (int slot = 0; slot < 3; ++slot) {
      const auto got = checkpoint::load_safetensors(elastic + "/weights-" + std::to_string(slot) +
                                                    ".safetensors");
      ASSERT_EQ(got.tensors.size(), expected.tensors.size());
      for (const auto& [name, t] : expected.tensors) {
        const double diff = (got.tensors.at(name) - t).abs().max().item<double>();
        EXPECT_LT(diff, 1e-6) << "slot " << slot << " " << name;
      }
    }
  }
  // The ledgers of `processes` processes hold each (epoch, sample) exactly once.
  void expect_every_sample_once(int processes) const {
    std::map<std::pair<int, int>, int> trained; // (epoch, sample) -> times
    int ledgers = 0;
    for (const auto& entry : std::filesystem::directory_iterator(elastic)) {
      if (entry.path().filename().string().rfind("ledger-", 0) != 0) continue;
      ++ledgers;
      std::ifstream in(entry.path());
      for (std::string line; std::getline(in, line);) {
        std::istringstream fields(line);
        int epoch = 0, id = 0;
        fields >> epoch;
        while (fields >> id) ++trained[{epoch, id}];
      }
    }
    EXPECT_EQ(ledgers, processes);
    EXPECT_EQ(trained.size(), static_cast<std::size_t>(epochs) * 240u)
        << "a sample was never trained on";
    for (const auto& [key, times] : trained) {
      EXPECT_EQ(times, 1) << "epoch " << key.first << " sample " << key.second;
    }
  }
};

// Worker 2 of 3 is SIGKILLed at global step 7; the two others regroup and go on with the same
// global batch (12 rows each instead of 8), launch restarts the dead one, which is admitted at a
// step boundary and gets the state from a live peer's memory. The final weights equal the
// one-worker run's, and the ledgers of all four processes hold every sample once per epoch.
TEST(Launch, AnElasticFitHealsAKilledWorkerAndEndsAsOneWorkerWould) {
  const ElasticFit fit;
  const auto r = run_process(fit.launch("KILL", "100"), {}, std::chrono::seconds(180));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::cout << r.err;
  EXPECT_NE(r.err.find("[launch] worker 2 was killed by signal Killed; restarting it alone"),
            std::string::npos);
  EXPECT_NE(r.err.find("elastic: generation 1 with 2 workers (slot 2 lost its connection to the "
                       "rendezvous (the process exited or was killed)); going on from epoch 1, "
                       "7 steps done (update 7)"),
            std::string::npos);
  EXPECT_NE(r.err.find("with 3 workers (admitted slot 2); going on from epoch"),
            std::string::npos);
  fit.expect_one_workers_result(4);
}

// The option that keeps the per-replica batch instead (CommunicationOptions::elastic_batch
// kPerReplica): worker 2 of 3 is SIGKILLed at global step 7; the two others go on with their 8
// rows each (16 per update instead of 24) at 16/24 of the learning rate, the updates of the
// epoch growing to cover its rows, until the restart is admitted. Each process records its rows
// per update; the sums are the schedule a plain LibTorch loop follows over the same rows in the
// same order (the rate: a warmup and cosine schedule at the global batches' worth of rows
// trained, x rows / 24): every worker's weights equal its result, and the ledgers hold each
// sample once per epoch.
TEST(Launch, AnElasticFitKeepingThePerReplicaBatchScalesTheLearningRate) {
  const ElasticFit fit;
  const auto r = run_process(fit.launch("KILL", "100", {"--max-restarts", "1"}, {"--per-replica"}),
                             {}, std::chrono::seconds(180));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::cout << r.err;
  EXPECT_NE(r.err.find("elastic: generation 1 with 2 workers (slot 2 lost its connection to the "
                       "rendezvous (the process exited or was killed)); going on from epoch 1, "
                       "7 steps done (update 7)"),
            std::string::npos);
  EXPECT_NE(r.err.find("with 3 workers (admitted slot 2); going on from epoch"),
            std::string::npos);
  std::map<std::int64_t, std::int64_t> rows; // update -> rows over every process
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(fit.elastic)) {
    if (entry.path().filename().string().rfind("rows-", 0) != 0) continue;
    ++files;
    std::ifstream in(entry.path());
    for (std::int64_t update = 0, mine = 0; in >> update >> mine;) rows[update] += mine;
  }
  EXPECT_EQ(files, 4);
  ASSERT_FALSE(rows.empty());
  EXPECT_EQ(rows.begin()->first, 1);
  EXPECT_EQ(rows.rbegin()->first, static_cast<std::int64_t>(rows.size())) << "an update missing";
  std::map<std::int64_t, int> sizes; // rows of an update -> updates
  std::int64_t total = 0;
  {
    std::ofstream schedule(fit.dir.path() + "/schedule.txt");
    for (const auto& [update, n] : rows) {
      schedule << n << '\n';
      ++sizes[n];
      total += n;
    }
  }
  EXPECT_EQ(total, 4 * 240);
  EXPECT_GT(sizes[16], 0) << "the two survivors kept 8 rows each";
  EXPECT_GT(static_cast<int>(rows.size()), 40) << "fewer rows per update, so more updates";
  for (const auto& [n, count] : sizes) {
    EXPECT_TRUE(n == 24 || n == 16 || n == 8) << n << " rows in " << count << " updates";
  }
  const auto alone = run_process({fit.trainer, "--reference-rows", fit.dir.path() + "/schedule.txt",
                                  "--out", fit.reference, "--epochs", "4"});
  ASSERT_EQ(alone.exit_code, 0) << alone.err;
  fit.expect_every_slot_has_the_references_weights();
  fit.expect_every_sample_once(4);
}

// Faults at an epoch's end, where the members wait in one of its collectives: worker 2 dies
// inside epoch 2's validation (the others wait in its reduce), worker 1 in epoch 3's callbacks
// (the others wait in the stop vote), and the chief after epoch 4's last step (the others wait in
// the gather of the epoch's logs). Each time the others regroup, go on from that collective in
// the same processes, and admit the restarted worker in a later epoch; the result is still the
// one-worker run's, each epoch's validation included. The new chief prints the progress.
TEST(Launch, AnElasticFitHealsFaultsAtAnEpochsEnd) {
  ElasticFit fit;
  fit.epochs = 7;
  const auto r = run_process(fit.launch("KILL", "100", {"--max-restarts", "3"},
                                        {"--signal-at", "-1", "--fault", "2:validation:2",
                                         "--fault", "1:callbacks:3", "--fault", "0:gather:4"}),
                             {}, std::chrono::seconds(180));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::cout << r.err;
  for (const std::string line :
       {"(slot 2 lost its connection to the rendezvous (the process exited or was killed)); "
        "going on from epoch 2's end, buffers mirrored (update 20)",
        "(slot 1 lost its connection to the rendezvous (the process exited or was killed)); "
        "going on from epoch 3's end, callbacks done (update 30)",
        "(slot 0 lost its connection to the rendezvous (the process exited or was killed)); "
        "going on from epoch 4, 10 steps done (update 40)"}) {
    EXPECT_NE(r.err.find(line), std::string::npos) << line;
  }
  // A survivor (slot 1 or 2, whichever is lowest then) took over the chief's duties, the
  // progress lines among them.
  EXPECT_TRUE(r.out.find("[worker 1] Epoch 5/7") != std::string::npos ||
              r.out.find("[worker 2] Epoch 5/7") != std::string::npos)
      << r.out;
  fit.expect_one_workers_result(6);
}

// After the fit, evaluate() and predict() are healed too: worker 2 dies inside the final
// evaluation, worker 1 inside the prediction after it; each time the others regroup and run it
// again on the data split among them, and get the one-worker run's result. (Launch restarts
// both, which find the group done with training: reported, not a failure of the job.)
TEST(Launch, AnElasticEvaluateAndPredictAfterFitHealKilledWorkers) {
  ElasticFit fit;
  fit.epochs = 2;
  const auto r = run_process(fit.launch("KILL", "0", {"--max-restarts", "2"},
                                        {"--signal-at", "-1", "--evaluate", "--fault",
                                         "2:validation:3", "--fault", "1:validation:4"}),
                             {}, std::chrono::seconds(180));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::cout << r.err;
  EXPECT_NE(r.err.find("(slot 2 lost its connection to the rendezvous (the process exited or was "
                       "killed)); going on from epoch 2's end, stop agreed (update 20)"),
            std::string::npos);
  const auto alone = run_process({fit.trainer, "--reference", "--evaluate", "--out", fit.reference,
                                  "--epochs", std::to_string(fit.epochs)});
  ASSERT_EQ(alone.exit_code, 0) << alone.err;
  double expected = 0, got = 0;
  std::int64_t expected_rows = 0, rows = 0;
  std::ifstream(fit.reference + "/eval-0.txt") >> expected >> expected_rows;
  EXPECT_EQ(expected_rows, 96);
  for (int slot = 0; slot < 2; ++slot) {
    std::ifstream(fit.elastic + "/eval-" + std::to_string(slot) + ".txt") >> got >> rows;
    EXPECT_EQ(rows, 96) << "slot " << slot;
    EXPECT_NEAR(got, expected, 1e-6) << "slot " << slot;
  }
  EXPECT_FALSE(std::filesystem::exists(fit.elastic + "/eval-2.txt"));
  EXPECT_NE(r.err.find("(slot 1 lost its connection to the rendezvous (the process exited or was "
                       "killed)); going on from epoch 2's end, stop agreed (update 20)"),
            std::string::npos);
  const auto expected_outputs =
      checkpoint::load_safetensors(fit.reference + "/predict-0.safetensors").tensors.at("outputs");
  ASSERT_EQ(expected_outputs.size(0), 96);
  const auto outputs =
      checkpoint::load_safetensors(fit.elastic + "/predict-0.safetensors").tensors.at("outputs");
  EXPECT_TRUE(torch::allclose(outputs, expected_outputs, 0, 1e-6));
  EXPECT_FALSE(std::filesystem::exists(fit.elastic + "/predict-1.safetensors"));
}

// BatchNorm in an elastic group, with a backup every 4 updates that the chief writes alone: no
// save starts a collective (a lone mirror on the chief met the others' gradient all-reduce), also
// across the heal of worker 2's death at step 7 and its rejoining. Every member ends with the
// same parameters and running statistics, bit for bit (each epoch's end mirrors them), and every
// sample is trained on once per epoch.
TEST(Launch, AnElasticFitWithBatchNormSavesWithoutACollective) {
  const ElasticFit fit;
  const auto r = run_process(fit.launch("KILL", "100", {"--max-restarts", "1"},
                                        {"--batchnorm", "--backup-dir", fit.dir.path() + "/b"}),
                             {}, std::chrono::seconds(180));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::cout << r.err;
  const auto first = checkpoint::load_safetensors(fit.elastic + "/weights-0.safetensors");
  EXPECT_EQ(first.tensors.count("1.running_var"), 1u);
  for (int slot = 1; slot < 3; ++slot) {
    const auto got = checkpoint::load_safetensors(fit.elastic + "/weights-" +
                                                  std::to_string(slot) + ".safetensors");
    ASSERT_EQ(got.tensors.size(), first.tensors.size());
    for (const auto& [name, t] : first.tensors) {
      EXPECT_TRUE(torch::equal(got.tensors.at(name), t)) << "slot " << slot << " " << name;
    }
  }
  fit.expect_every_sample_once(4);
}

// A frozen worker (SIGSTOP at global step 7) is expelled after the heartbeat timeout and the
// others redo the step without it; woken (SIGCONT), it learns it was expelled and exits 3, launch
// restarts it and it rejoins. The result is again the one-worker run's.
TEST(Launch, AnElasticFitExpelsAFrozenWorkerAndItsRestartRejoins) {
  const ElasticFit fit;
  testing::Process launch(fit.launch("STOP", "200"));
  const std::string announced = "[worker 2] slot 2 pid ";
  ASSERT_TRUE(launch.wait_for_output(announced)) << launch.output_so_far();
  const std::string out = launch.output_so_far();
  const pid_t frozen = std::stoi(out.substr(out.find(announced) + announced.size()));
  ASSERT_TRUE(launch.wait_for_errors(
      "elastic: generation 1 with 2 workers (slot 2 stopped sending heartbeats"))
      << launch.errors_so_far();
  ::kill(frozen, SIGCONT);
  const auto r = launch.wait(std::chrono::seconds(180));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::cout << r.err;
  EXPECT_NE(r.err.find("it was expelled from the training group (start it again to rejoin)"),
            std::string::npos);
  EXPECT_NE(r.err.find("[launch] worker 2 exited with code 3; restarting it alone"),
            std::string::npos);
  EXPECT_NE(r.err.find("with 3 workers (admitted slot 2); going on from epoch"),
            std::string::npos);
  fit.expect_one_workers_result(4);
}

// --min-workers: worker 1 of 3 is killed and no restart is left; with fewer than 3 workers the
// others are stopped (SIGTERM), and launch exits with the lost worker's code.
TEST(Launch, ElasticBelowMinWorkersStopsTheRest) {
  const auto r =
      run_process({kCli, "launch", "--elastic", "--workers", "3", "--min-workers", "3",
                   "--max-restarts", "0", "--", testing::test_bin_dir() + "/elastic_worker",
                   "--steps", "400", "--signal-slot", "1", "--signal-at", "2", "--signal", "KILL"},
                  {}, std::chrono::seconds(120));
  EXPECT_EQ(r.exit_code, 128 + SIGKILL) << r.out << r.err;
  EXPECT_NE(r.err.find("[launch] worker 1 was killed by signal Killed; not restarting it "
                       "(--max-restarts 0); 2 workers left, fewer than --min-workers 3: stopping "
                       "them (SIGTERM)"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.out.find("done at step"), std::string::npos) << "a worker ran to the end: " << r.out;
}

// Below --min-workers with a backup: worker 2 of 3 is killed and no restart is left; the two
// others are stopped (SIGTERM), the chief saves the committed state, and all leave with 75, as
// launch does. The same job started again resumes from that backup with all three, and ends as
// one worker would have; the ledgers of all six processes hold every sample once per epoch.
TEST(Launch, ElasticBelowMinWorkersSavesExits75AndTheJobResumes) {
  const ElasticFit fit;
  const std::string backup = fit.dir.path() + "/backup";
  const auto command = fit.launch("KILL", "100", {"--min-workers", "3", "--max-restarts", "0"},
                                  {"--backup-dir", backup});
  const auto stopped = run_process(command, {}, std::chrono::seconds(120));
  ASSERT_EQ(stopped.exit_code, kExitPreempted) << stopped.out << stopped.err;
  EXPECT_NE(stopped.err.find("fewer than --min-workers 3: stopping them (SIGTERM)"),
            std::string::npos)
      << stopped.err;
  EXPECT_NE(stopped.err.find("it left the elastic group at update"), std::string::npos)
      << stopped.err;
  EXPECT_NE(stopped.err.find("it saved the backup in " + backup), std::string::npos) << stopped.err;
  ASSERT_TRUE(std::filesystem::exists(backup + "/checkpoint"));
  const auto resumed = run_process(command, {}, std::chrono::seconds(120));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.out << resumed.err;
  std::cout << stopped.err << resumed.err;
  EXPECT_NE(resumed.err.find("BackupAndRestore: resuming from " + backup), std::string::npos)
      << resumed.err;
  fit.expect_one_workers_result(6);
}

// The whole group lost at once: every worker SIGKILLs itself before its step 7 (the chief backed
// up at update 4). Launch restarts each alone; with no member left to hand a state over, the
// rendezvous waits until every slot has joined again and forms a generation that starts the
// training afresh: the workers make fit's start-up agreements and resume from the backup on disk,
// as a restarted job would (they restarted exit 3, "nothing to join", before). The result is
// the one-worker run's; the updates after the backup were trained twice (as with any restart
// from disk), so the ledgers are not checked for repeats.
TEST(Launch, AnElasticGroupLostWholeStartsAfreshFromItsBackup) {
  const ElasticFit fit;
  const std::string backup = fit.dir.path() + "/backup";
  const auto r =
      run_process(fit.launch("KILL", "100", {"--max-restarts", "3"},
                             {"--signal-at", "-1", "--all-die-at", "7", "--backup-dir", backup}),
                  {}, std::chrono::seconds(180));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::cout << r.err;
  // Once: the members leaving after the training finished are not a lost group.
  const auto lost = r.err.find("every member left before the training finished");
  EXPECT_NE(lost, std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("every member left before the training finished", lost + 1),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("of 3 workers [0,1,2]: all 3 workers joined again after the group was "
                       "lost: the training starts afresh"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("BackupAndRestore: resuming from " + backup), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("no member of the elastic group holds a training state"), std::string::npos)
      << r.err;
  fit.expect_one_workers_result(6, /*check_ledgers=*/false);
}

// The CLI: flotilla train --elastic --elastic-batch per-replica under launch --elastic, worker 1
// SIGKILLed from outside once training has started; the run ends with the chief's test result
// and exit 0. (The default, --elastic-batch global, is what make bench-chaos runs.)
TEST(Launch, ElasticTrainGoesOnWhenAWorkerIsKilledMidFit) {
  if (!testing::fashion_mnist_present()) GTEST_SKIP() << "dataset-fashion-mnist absent";
  testing::Process launch({kCli,        "launch",
                           "--elastic", "--workers",
                           "3",         "--max-restarts",
                           "1",         "--heartbeat-timeout",
                           "3",         "--",
                           "flotilla",  "train",
                           "--elastic", "--elastic-batch",
                           "per-replica", "--heartbeat-timeout",
                           "3",         "--model",
                           "mlp",       "--epochs",
                           "2",         "--batch-per-replica",
                           "128"});
  ASSERT_TRUE(launch.wait_for_output("Epoch 1/2")) << launch.output_so_far();
  // Worker 1: the launcher's child whose LOCAL_RANK is 1.
  pid_t victim = -1;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    std::ifstream stat(entry.path() / "stat");
    std::string pid, name, state;
    int ppid = 0;
    if (!(stat >> pid >> name >> state >> ppid) || ppid != launch.pid()) continue;
    std::ifstream environ(entry.path() / "environ");
    const std::string vars((std::istreambuf_iterator<char>(environ)), {});
    if (vars.find(std::string("LOCAL_RANK=1") + '\0') != std::string::npos) victim = std::stoi(pid);
  }
  ASSERT_GT(victim, 0);
  ::kill(victim, SIGKILL);
  const auto r = launch.wait(std::chrono::seconds(240));
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.err.find("[launch] worker 1 was killed by signal Killed; restarting it alone"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("elastic: generation 1 with 2 workers (slot 1 lost its connection"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.out.find("[worker 0] Test: loss: "), std::string::npos) << r.out;
}

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
  EXPECT_NE(said.find("jit_compile: no effect"), std::string::npos) << said;
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

} // namespace
} // namespace flotilla
