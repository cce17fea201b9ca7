// Elastic fits under `flotilla launch --elastic`: real processes on loopback that are killed,
// stopped and restarted mid-fit; the survivors heal and every run ends as one worker would.
#include <gtest/gtest.h>
#include <sched.h>
#include <signal.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "flotilla/checkpoint/checkpoint_manager.h"
#include "flotilla/checkpoint/model_checkpoint.h"
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

TEST(ElasticFit, ElasticRestartsOnlyTheDeadWorkerAndTheOthersKeepTheirProcesses) {
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
  // The group's log lines name the generation that decided them, the later ones too.
  const std::regex tagged(R"(\[worker \d/\d g([1-9]\d*)\] generation \1: rank \d of \d)");
  const std::string both = r.out + r.err;
  EXPECT_TRUE(std::regex_search(both, tagged)) << both;
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
    const auto alone = run_process(
        {trainer, "--reference", "--out", reference, "--epochs", std::to_string(epochs)});
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
TEST(ElasticFit, AnElasticFitHealsAKilledWorkerAndEndsAsOneWorkerWould) {
  const ElasticFit fit;
  // 200 ms a step: the restarted process has the other 33 steps (6.6 s) to start, join and be
  // admitted at a vote. With 100 ms, under make test's load, it once came to the rendezvous as
  // the others finished, and exited 3 with nobody left to admit it.
  const auto r = run_process(fit.launch("KILL", "200"), {}, std::chrono::seconds(180));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::cout << r.err;
  EXPECT_NE(r.err.find("[launch] worker 2 was killed by signal Killed; restarting it alone"),
            std::string::npos);
  EXPECT_NE(r.err.find("elastic: generation 1 with 2 workers (slot 2 lost its connection to the "
                       "rendezvous (the process exited or was killed)); going on from epoch 1, "
                       "7 steps done (update 7)"),
            std::string::npos);
  EXPECT_NE(r.err.find("with 3 workers (admitted slot 2); going on from epoch"), std::string::npos);
  fit.expect_one_workers_result(4);
}

// The option that keeps the per-replica batch instead (strategy::ElasticOptions::batch
// kPerReplica): worker 2 of 3 is SIGKILLed at global step 7; the two others go on with their 8
// rows each (16 per update instead of 24) at 16/24 of the learning rate, the updates of the
// epoch growing to cover its rows, until the restart is admitted. Each process records its rows
// per update; the sums are the schedule a plain LibTorch loop follows over the same rows in the
// same order (the rate: a warmup and cosine schedule at the global batches' worth of rows
// trained, x rows / 24): every worker's weights equal its result, and the ledgers hold each
// sample once per epoch.
TEST(ElasticFit, AnElasticFitKeepingThePerReplicaBatchScalesTheLearningRate) {
  const ElasticFit fit;
  const auto r = run_process(fit.launch("KILL", "100", {"--max-restarts", "1"}, {"--per-replica"}),
                             {}, std::chrono::seconds(180));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::cout << r.err;
  EXPECT_NE(r.err.find("elastic: generation 1 with 2 workers (slot 2 lost its connection to the "
                       "rendezvous (the process exited or was killed)); going on from epoch 1, "
                       "7 steps done (update 7)"),
            std::string::npos);
  EXPECT_NE(r.err.find("with 3 workers (admitted slot 2); going on from epoch"), std::string::npos);
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
TEST(ElasticFit, AnElasticFitHealsFaultsAtAnEpochsEnd) {
  ElasticFit fit;
  fit.epochs = 7;
  const auto r = run_process(
      fit.launch("KILL", "100", {"--max-restarts", "3"},
                 {"--signal-at", "-1", "--fault", "2:validation:2", "--fault", "1:callbacks:3",
                  "--fault", "0:gather:4", "--csv", fit.dir.path() + "/log.csv"}),
      {}, std::chrono::seconds(180));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::cout << r.err;
  // CSVLogger's file holds every epoch's row once, under one header, though three chiefs wrote
  // it (slot 0, its successor slot 1, then slot 0 again, rejoined). Before, the rejoined chief
  // truncated it, and the rows of epochs 0 to 3 were lost.
  const std::string csv = testing::read_file(fit.dir.path() + "/log.csv");
  std::cout << csv;
  std::vector<std::string> firsts;
  std::istringstream lines(csv);
  for (std::string line; std::getline(lines, line);) firsts.push_back(line.substr(0, 2));
  EXPECT_EQ(firsts, (std::vector<std::string>{"ep", "0,", "1,", "2,", "3,", "4,", "5,", "6,"}))
      << csv;
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
TEST(ElasticFit, AnElasticEvaluateAndPredictAfterFitHealKilledWorkers) {
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
TEST(ElasticFit, AnElasticFitWithBatchNormSavesWithoutACollective) {
  const ElasticFit fit;
  const std::string weights = fit.dir.path() + "/w/weights.safetensors";
  std::filesystem::create_directories(fit.dir.path() + "/w");
  const auto r =
      run_process(fit.launch("KILL", "100", {"--max-restarts", "1"},
                             {"--batchnorm", "--backup-dir", fit.dir.path() + "/b", "--weights",
                              weights, "--csv", fit.dir.path() + "/w/log.csv"}),
                  {}, std::chrono::seconds(180));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::cout << r.err;
  // ModelCheckpoint's weights carry their fencing token: the training's id (drawn at the start,
  // kept by the survivors and given to the rejoined worker), a generation after the kill's, and
  // the last update. (The backups that also name the id are gone: a finished fit removes them.)
  const auto fence = checkpoint::read_safetensors_metadata(weights);
  EXPECT_EQ(fence.count("flotilla.training") ? fence.at("flotilla.training").size() : 0, 32u);
  EXPECT_GE(std::stoi(fence.count("flotilla.generation") ? fence.at("flotilla.generation") : "0"),
            1);
  // CSVLogger's rows name their generation too.
  const std::string csv = testing::read_file(fit.dir.path() + "/w/log.csv");
  std::cout << csv;
  EXPECT_EQ(csv.rfind("epoch,generation,", 0), 0u) << csv;
  EXPECT_NE(csv.find("\n3,2,"), std::string::npos) << "the last epoch's, after the rejoin";
  EXPECT_EQ(fence.count("flotilla.update") ? fence.at("flotilla.update") : "", "40");
  const auto first = checkpoint::load_safetensors(fit.elastic + "/weights-0.safetensors");
  EXPECT_EQ(first.tensors.count("1.running_var"), 1u);
  for (int slot = 1; slot < 3; ++slot) {
    const auto got = checkpoint::load_safetensors(fit.elastic + "/weights-" + std::to_string(slot) +
                                                  ".safetensors");
    ASSERT_EQ(got.tensors.size(), first.tensors.size());
    for (const auto& [name, t] : first.tensors) {
      EXPECT_TRUE(torch::equal(got.tensors.at(name), t)) << "slot " << slot << " " << name;
    }
  }
  fit.expect_every_sample_once(4);
}

// The chief's "shares: now" lines as (workers, generation, rows of each worker).
struct SharesLine {
  int workers = 0, generation = 0;
  std::vector<int> rows;
};
std::vector<SharesLine> shares_lines(const std::string& log) {
  std::vector<SharesLine> lines;
  const std::regex line(R"(\[worker \d/(\d) g(\d+)\] shares: now ([\d,]+) of 24 rows)");
  for (auto it = std::sregex_iterator(log.begin(), log.end(), line); it != std::sregex_iterator();
       ++it) {
    SharesLine l;
    l.workers = std::stoi((*it)[1]);
    l.generation = std::stoi((*it)[2]);
    std::stringstream rows((*it)[3].str());
    for (std::string r; std::getline(rows, r, ',');) l.rows.push_back(std::stoi(r));
    lines.push_back(l);
  }
  return lines;
}

// Shares by speed in an elastic group (--shares-every 3): slot 1's forward sleeps 0.9 ms a row,
// the others' 0.3 ms. Generation 0 gives slot 1 fewer rows of each global batch of 24; worker 2
// is SIGKILLed at global step 9, and the two left go back to equal shares and measure again, so
// slot 1's share shrinks again among two; the restart rejoins. The shares change the division,
// never the update: the result is the one-worker run's, and every sample is trained on once.
// Step 9, not the other tests' 7: admissions are voted on at every 8th update, and a restart
// ready by update 8 cut generation 1 to two steps, before its first report (once in about 20
// runs); from 9 the next vote is at update 16, after generation 1's report at its 6th step.
TEST(ElasticFit, SharesBySpeedAreMeasuredAnewAfterAHealAndKeepTheResult) {
  const ElasticFit fit;
  const auto r = run_process(fit.launch("KILL", "200", {"--max-restarts", "1"},
                                        {"--signal-at", "9", "--shares-every", "3", "--row-us",
                                         "300", "--slow", "1:900"}),
                             {}, std::chrono::seconds(180));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::cout << r.err;
  bool among_three = false, among_two = false;
  for (const SharesLine& l : shares_lines(r.err)) {
    ASSERT_EQ(static_cast<int>(l.rows.size()), l.workers) << r.err;
    EXPECT_EQ(std::accumulate(l.rows.begin(), l.rows.end(), 0), 24) << r.err;
    // Slot 1 is rank 1 in every generation (slots in rank order, slot 0 never left).
    if (l.generation == 0 && l.workers == 3) among_three = among_three || l.rows[1] < 8;
    if (l.generation == 1 && l.workers == 2) among_two = among_two || l.rows[1] < 12;
  }
  EXPECT_TRUE(among_three) << "slot 1's share shrank in generation 0\n" << r.err;
  EXPECT_TRUE(among_two) << "and again among the two after the heal\n" << r.err;
  fit.expect_one_workers_result(4);
}

// A straggler: slot 1's first process sleeps 3 ms a row in its forward, the others 0.05 ms, so
// it stays below a tenth of the median's speed at two reports in a row. It leaves the group
// saying why (exit 3, as an expelled worker), the others go on without it, and launch restarts
// it; at full speed the restart rejoins. The result is the one-worker run's. 3 epochs of 200 ms
// steps: the restart has the 20 steps (4 s) after the straggler left to start and be admitted
// (with 100 ms steps one came too late under make test's load in the kill test).
TEST(ElasticFit, AStragglerBelowTheFloorLeavesAndTheOthersGoOn) {
  ElasticFit fit;
  fit.epochs = 3;
  const auto r = run_process(fit.launch("KILL", "200", {"--max-restarts", "1"},
                                        {"--signal-at", "-1", "--shares-every", "3", "--row-us",
                                         "50", "--slow", "1:3000"}),
                             {}, std::chrono::seconds(180));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::cout << r.err;
  EXPECT_NE(r.err.find("worker 1 (rank 1 of this group) is a straggler: it computes"),
            std::string::npos);
  EXPECT_NE(r.err.find("it leaves the group, which goes on without it. Find what slows this host"),
            std::string::npos)
      << "the straggler's own error";
  EXPECT_NE(r.err.find("[launch] worker 1 exited with code 3; restarting it alone"),
            std::string::npos);
  EXPECT_NE(r.err.find("elastic: generation 1 with 2 workers (slot 1 "), std::string::npos);
  EXPECT_NE(r.err.find("with 3 workers (admitted slot 1); going on from epoch"), std::string::npos);
  fit.expect_one_workers_result(4);
}

// Under `launch`, slot `slot`'s process (its pid in `pid`), stopped by its own signal, once the
// others have formed generation 1 without it.
void wait_until_expelled(testing::Process& launch, int slot, pid_t& pid) {
  const std::string announced =
      "[worker " + std::to_string(slot) + "] slot " + std::to_string(slot) + " pid ";
  ASSERT_TRUE(launch.wait_for_output(announced)) << launch.output_so_far();
  const std::string out = launch.output_so_far();
  pid = std::stoi(out.substr(out.find(announced) + announced.size()));
  ASSERT_TRUE(launch.wait_for_errors("elastic: generation 1 with 2 workers (slot " +
                                     std::to_string(slot) + " stopped sending heartbeats"))
      << launch.errors_so_far();
}

// A frozen worker (SIGSTOP at global step 7) is expelled after the heartbeat timeout and the
// others redo the step without it; woken (SIGCONT), it learns it was expelled and exits 3, launch
// restarts it and it rejoins. The result is again the one-worker run's.
TEST(ElasticFit, AnElasticFitExpelsAFrozenWorkerAndItsRestartRejoins) {
  const ElasticFit fit;
  testing::Process launch(fit.launch("STOP", "200"));
  pid_t frozen = 0;
  ASSERT_NO_FATAL_FAILURE(wait_until_expelled(launch, 2, frozen));
  ::kill(frozen, SIGCONT);
  const auto r = launch.wait(std::chrono::seconds(180));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::cout << r.err;
  EXPECT_NE(r.err.find("it was expelled from the training group (start it again to rejoin)"),
            std::string::npos);
  EXPECT_NE(r.err.find("[launch] worker 2 exited with code 3; restarting it alone"),
            std::string::npos);
  EXPECT_NE(r.err.find("with 3 workers (admitted slot 2); going on from epoch"), std::string::npos);
  fit.expect_one_workers_result(4);
}

// Fencing in storage: the chief (slot 0) stops itself (SIGSTOP) in its callbacks at epoch 2's
// end, before its BackupAndRestore there. The others expel it and go on in generation 1, where
// slot 1 is the chief and backs up every 4 updates. Woken once such a backup exists, the old
// chief goes on to its own epoch-end backup, alone (a backup in an elastic fit is no
// collective) and with generation 0's state and fewer updates: the directory refuses it (before
// fencing it became the newest backup, and a resume from it would have repeated the updates in
// between). It exits, launch restarts it, it rejoins, and the result is the one-worker run's.
TEST(ElasticFit, AFrozenChiefsStaleBackupIsRefusedOnceItsSuccessorSaved) {
  ElasticFit fit;
  fit.epochs = 6;
  const std::string backup = fit.dir.path() + "/backup";
  testing::Process launch(
      fit.launch("KILL", "200", {"--max-restarts", "1"},
                 {"--signal-at", "-1", "--fault", "0:callbacks-stop:2", "--backup-dir", backup}));
  pid_t frozen = 0;
  ASSERT_NO_FATAL_FAILURE(wait_until_expelled(launch, 0, frozen));
  // The newest backup is generation 1's (the successor's) before the old chief wakes.
  const auto newest_generation = [&]() -> std::int64_t {
    try {
      const auto path = checkpoint::CheckpointManager(backup, 2, "backup").latest();
      return path ? checkpoint::read_checkpoint(*path).generation : -1;
    } catch (const std::exception&) {
      return -1; // being written
    }
  };
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (newest_generation() < 1 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_GE(newest_generation(), 1) << launch.errors_so_far();
  ::kill(frozen, SIGCONT);
  const auto r = launch.wait(std::chrono::seconds(180));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::cout << r.err;
  EXPECT_NE(r.err.find("refused (fencing): this writer's state is of generation 0, update 20, and "
                       "the newest checkpoint there, " +
                       backup + "/backup-"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("was decided by a newer generation of the group: this process was "
                       "replaced"),
            std::string::npos);
  EXPECT_NE(r.err.find("[launch] worker 0 exited with code 4; restarting it alone"),
            std::string::npos);
  fit.expect_one_workers_result(4);
}

// --min-workers: worker 1 of 3 is killed and no restart is left; with fewer than 3 workers the
// others are stopped (SIGTERM), and launch exits with the lost worker's code.
TEST(ElasticFit, ElasticBelowMinWorkersStopsTheRest) {
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
TEST(ElasticFit, ElasticBelowMinWorkersSavesExits75AndTheJobResumes) {
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
TEST(ElasticFit, AnElasticGroupLostWholeStartsAfreshFromItsBackup) {
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
TEST(ElasticFit, ElasticTrainGoesOnWhenAWorkerIsKilledMidFit) {
  if (!testing::fashion_mnist_present()) GTEST_SKIP() << "dataset-fashion-mnist absent";
  testing::Process launch({kCli,          "launch",
                           "--elastic",   "--workers",
                           "3",           "--max-restarts",
                           "1",           "--heartbeat-timeout",
                           "3",           "--",
                           "flotilla",    "train",
                           "--elastic",   "--elastic-batch",
                           "per-replica", "--heartbeat-timeout",
                           "3",           "--model",
                           "mlp",         "--epochs",
                           "2",           "--batch-per-replica",
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

TEST(ElasticFit, AWorkerFailingAfterAnotherFinishedTheTrainingIsNotRestarted) {
  // Worker 0 finishes (exit 0); worker 1 then fails as a member stopped until the others were
  // done would (told it was expelled: exit 3). Its restart would find no member left to admit
  // it, fail again and use up every restart.
  const auto r = run_process({kCli, "launch", "--elastic", "--workers", "2", "--max-restarts", "3",
                              "--", "sh", "-c",
                              "if [ \"$LOCAL_RANK\" = 1 ]; then sleep 1; echo woke; exit 3; fi; "
                              "echo done"},
                             {}, std::chrono::seconds(60));
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(count_of(r.out, "woke"), 1u) << r.out << r.err;
  EXPECT_NE(r.err.find("[launch] worker 1 exited with code 3; not restarting it: the group has "
                       "finished its training (a worker exited 0)"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("restarting it alone"), std::string::npos) << r.err;
}

} // namespace
} // namespace flotilla
