// Callbacks on two thread-ranks: a backup resumes exactly (the weights equal an uninterrupted
// run's, and no update is lost or done twice), schedules drive the optimizer, decisions agree
// across workers, and only the chief writes files.
#include <gtest/gtest.h>

#include <signal.h>

#include <fstream>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>

#include "flotilla/base/hashes.h"
#include "flotilla/checkpoint/checkpoint_manager.h"
#include "flotilla/checkpoint/safetensors.h"
#include "flotilla/error.h"
#include "flotilla/train/callbacks.h"
#include "flotilla/train/schedules.h"
#include "support/compare.h"
#include "support/ranks.h"
#include "support/subprocess.h"
#include "support/tensorboard.h"

namespace flotilla {
namespace {

using testing::run_ranks;
using testing::thread_cluster;
namespace nn = torch::nn;
namespace fs = std::filesystem;

std::mutex build_mutex; // ranks are threads sharing torch's generator

struct Data {
  Data() {
    torch::manual_seed(11);
    x = torch::randn({96, 8});
    y = (x.narrow(1, 0, 3).argmax(1)); // learnable: the largest of the first 3 features
  }
  torch::Tensor x, y;
  data::Dataset batches() const {
    return data::Dataset::from_tensor_slices({x, y}).shuffle(96, 5).batch(16, true);
  }
};

nn::Sequential make_net() {
  std::lock_guard<std::mutex> lock(build_mutex);
  torch::manual_seed(3);
  return nn::Sequential(nn::Linear(8, 16), nn::ReLU(), nn::Linear(16, 3));
}

train::CompileOptions sgd_with_schedule() {
  train::CompileOptions compile;
  compile.optimizer = train::OptimizerOptions::sgd(0.1, 0.9);
  train::CosineDecayOptions cosine;
  cosine.initial_learning_rate = 0.0;
  cosine.warmup_target = 0.2;
  cosine.warmup_steps = 4;
  cosine.decay_steps = 20;
  compile.optimizer.schedule = std::make_shared<train::CosineDecay>(cosine);
  return compile;
}


struct Crash : std::runtime_error {
  Crash() : std::runtime_error("simulated crash") {}
};

// Counts updates and throws after `crash_after` of them (the same step on every worker).
struct CountingCallback : train::Callback {
  std::int64_t batches = 0;
  std::int64_t crash_after = -1;
  void on_train_batch_end(std::int64_t, const train::Logs&) override {
    ++batches;
    if (batches == crash_after) throw Crash();
  }
};

struct Interruption {
  std::int64_t backup_every;  // BackupOptions::save_freq (0: epoch ends only)
  std::int64_t crash_after;   // updates before the simulated crash
  std::int64_t resumed_at;    // the backup's update count
  int epoch;                  // the backup's epoch (0-based) and step in it
  std::int64_t step_in_epoch;
  int replicas = 1; // per worker
  // Damages the newest backup between the crash and the resume (nullptr: none); the resume
  // must then fall back to the backup before it.
  void (*damage)(const fs::path& newest) = nullptr;
  // Shares by speed (Strategy::set_shares) before the crash and at the resume (empty: equal);
  // the uninterrupted run's are equal. Different shares change the order of the sums only.
  std::vector<std::int64_t> shares_before, shares_after;
};

// 6 global batches of 16 per epoch, 3 epochs: 18 updates in all.
// With replicas per worker, compile() clones the model, and cloning initialises (then
// overwrites) fresh layers from torch's global generator: serialise it with the other rank's
// seeded construction, or the initial weights would depend on thread timing.
void compile_locked(train::Model& model) {
  std::lock_guard<std::mutex> lock(build_mutex);
  model.compile(sgd_with_schedule());
}

// The weights after `epochs` epochs of fit without any callback: what every resume must match.
std::vector<float> uninterrupted_weights(strategy::Strategy& s, const Data& data, int epochs) {
  auto net = make_net();
  train::Model model(s, net);
  compile_locked(model);
  train::FitOptions fit;
  fit.epochs = epochs;
  fit.verbose = train::Verbosity::kSilent;
  model.fit(data.batches(), fit);
  return testing::flat_parameters(*net);
}

void expect_exact_resume(const Interruption& case_) {
  const Data data;
  testing::TempDir dir;
  const fs::path backup = fs::path(dir.path()) / "backup";
  constexpr int kEpochs = 3;
  std::vector<std::vector<float>> uninterrupted(2), resumed(2);
  std::vector<std::int64_t> first_run(2), second_run(2);
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 2), comm, case_.replicas);
    uninterrupted[rank] = uninterrupted_weights(s, data, kEpochs);
    auto counter = std::make_shared<CountingCallback>();
    counter->crash_after = case_.crash_after;
    s.set_shares(case_.shares_before);
    {
      auto net = make_net();
      train::Model model(s, net);
      compile_locked(model);
      train::FitOptions fit;
      fit.epochs = kEpochs;
      fit.verbose = train::Verbosity::kSilent;
      fit.callbacks = {std::make_shared<train::BackupAndRestore>(
                           train::BackupOptions{backup, case_.backup_every}),
                       counter};
      EXPECT_THROW(model.fit(data.batches(), fit), Crash);
      first_run[rank] = counter->batches;
    }
    if (case_.damage) {
      comm.barrier().wait(); // both ranks have crashed
      if (rank == 0) {
        fs::path newest;
        for (const auto& entry : fs::directory_iterator(backup)) {
          if (entry.is_directory() && entry.path().filename().string() > newest.filename().string()) {
            newest = entry.path();
          }
        }
        case_.damage(newest);
      }
      comm.barrier().wait();
    }
    // A new process would start from scratch: new model, new optimizer, a new dataset object.
    s.set_shares(case_.shares_after);
    auto net = make_net();
    train::Model model(s, net);
    compile_locked(model);
    auto restore = std::make_shared<train::BackupAndRestore>(
        train::BackupOptions{backup, case_.backup_every});
    auto counter2 = std::make_shared<CountingCallback>();
    train::FitOptions fit;
    fit.epochs = kEpochs;
    fit.verbose = train::Verbosity::kSilent;
    fit.callbacks = {restore, counter2};
    const auto history = model.fit(data.batches(), fit);
    second_run[rank] = counter2->batches;
    ASSERT_TRUE(restore->restored().has_value());
    EXPECT_EQ(restore->restored()->iterations, case_.resumed_at);
    EXPECT_EQ(restore->restored()->epoch, case_.epoch);
    EXPECT_EQ(restore->restored()->step_in_epoch, case_.step_in_epoch);
    EXPECT_EQ(model.training_state().iterations, 18);
    EXPECT_EQ(history.epochs.front().epoch, case_.epoch + 1);
    resumed[rank] = testing::flat_parameters(*net);
  });
  EXPECT_EQ(first_run[0], case_.crash_after);
  // Every update after the backup is done again, none is lost: 18 in all.
  EXPECT_EQ(second_run[0], 18 - case_.resumed_at);
  EXPECT_EQ(uninterrupted[0], uninterrupted[1]);
  if (case_.shares_before.empty() && case_.shares_after.empty()) {
    EXPECT_EQ(resumed[0], uninterrupted[0]); // bit for bit
    EXPECT_EQ(resumed[1], uninterrupted[1]);
  } else {
    EXPECT_EQ(resumed[0], resumed[1]);
    ASSERT_EQ(resumed[0].size(), uninterrupted[0].size());
    for (std::size_t i = 0; i < resumed[0].size(); ++i) {
      EXPECT_NEAR(resumed[0][i], uninterrupted[0][i], 1e-6) << "parameter element " << i;
    }
  }
  EXPECT_FALSE(fs::exists(backup)) << "a fit that completes deletes its backup";
}

TEST(Callbacks, BackupAndRestoreResumesMidEpochExactly) {
  // Backups at updates 4 and 6 (an epoch's end resets the count), then 10; the crash is at 11.
  expect_exact_resume({/*backup_every=*/4, /*crash_after=*/11, /*resumed_at=*/10, 1, 4});
}

// A checkpoint resumes with any shares: backed up mid-epoch while worker 0 took 3/4 of each
// global batch, resumed with worker 1 taking 3/4. The input goes on at the same global position,
// so every update is the uninterrupted equal-share run's (within 1e-6: the sums' order differs).
TEST(Callbacks, BackupAndRestoreResumesMidEpochWithOtherShares) {
  Interruption c{/*backup_every=*/4, /*crash_after=*/11, /*resumed_at=*/10, 1, 4};
  c.shares_before = {3, 1};
  c.shares_after = {1, 3};
  expect_exact_resume(c);
}

TEST(Callbacks, BackupAndRestoreResumesAtAnEpochBoundaryExactly) {
  expect_exact_resume({/*backup_every=*/0, /*crash_after=*/9, /*resumed_at=*/6, 1, 0});
}

// A crash between an epoch's last step and its end (here: right after the step; in the CLI,
// during the epoch's log reduction) resumes from the backup before that step: a backup taken at
// the last step would resume into an exhausted pass and end the fit with epochs still to go.
TEST(Callbacks, BackupAndRestoreNeverBacksUpAtAnEpochsLastStep) {
  expect_exact_resume({/*backup_every=*/3, /*crash_after=*/6, /*resumed_at=*/3, 0, 3});
}

// A damaged newest backup is caught by its checksums and the previous one is used: backups at
// updates 4, 6 and 10 keep 6 and 10; with 10 damaged, the resume starts at 6 (epoch 1, step 0)
// and is still exact.
TEST(Callbacks, BackupAndRestoreFallsBackWhenTheNewestBackupIsTruncated) {
  Interruption c{/*backup_every=*/4, /*crash_after=*/11, /*resumed_at=*/6, 1, 0};
  c.damage = [](const fs::path& newest) {
    fs::resize_file(newest / "model.safetensors", fs::file_size(newest / "model.safetensors") / 2);
  };
  expect_exact_resume(c);
}

TEST(Callbacks, BackupAndRestoreFallsBackWhenTheNewestBackupHasAChangedByte) {
  Interruption c{/*backup_every=*/4, /*crash_after=*/11, /*resumed_at=*/6, 1, 0};
  c.damage = [](const fs::path& newest) {
    std::fstream f(newest / "optimizer.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-3, std::ios::end);
    const char byte = static_cast<char>(f.get() ^ 0x5a);
    f.seekp(-3, std::ios::end);
    f.put(byte);
  };
  expect_exact_resume(c);
}

// The manifest holds the training state (epoch, step, position): an edit (here: state.epoch 99,
// which would make the resume train nothing, then delete the backups) is caught by its checksum.
TEST(Callbacks, BackupAndRestoreFallsBackWhenTheNewestManifestWasEdited) {
  Interruption c{/*backup_every=*/4, /*crash_after=*/11, /*resumed_at=*/6, 1, 0};
  c.damage = [](const fs::path& newest) {
    auto manifest = nlohmann::json::parse(testing::read_file(newest / "manifest.json"));
    manifest["state"]["epoch"] = 99;
    manifest["epoch"] = 99;
    std::ofstream(newest / "manifest.json") << manifest.dump(2) << "\n";
  };
  expect_exact_resume(c);
}

// A newest backup whose files all match their checksums but that does not load into the model
// (its weights have the wrong shapes) is passed over for the one before, like a damaged one.
TEST(Callbacks, BackupAndRestoreFallsBackWhenTheNewestBackupVerifiesButDoesNotLoad) {
  Interruption c{/*backup_every=*/4, /*crash_after=*/11, /*resumed_at=*/6, 1, 0};
  c.damage = [](const fs::path& newest) {
    auto manifest = nlohmann::json::parse(testing::read_file(newest / "manifest.json"));
    checkpoint::save_safetensors(newest / "model.safetensors",
                                 {{"0.weight", torch::zeros({2, 2})}});
    manifest["files"]["model.safetensors"] = {
        {"sha256", base::sha256_file(newest / "model.safetensors")},
        {"bytes", fs::file_size(newest / "model.safetensors")}};
    const std::string text = manifest.dump(2) + "\n";
    std::ofstream(newest / "manifest.json") << text;
    std::ofstream(newest / "manifest.sha256")
        << base::sha256_hex(text.data(), text.size()) << "  manifest.json\n";
    ASSERT_NO_THROW(checkpoint::read_checkpoint(newest)); // it verifies
  };
  expect_exact_resume(c);
}

// Fits `epochs` epochs of the test's data on two thread-ranks with a BackupAndRestore in
// `backup` (and each rank's `more` callbacks); each rank's ConfigError, "" when fit ended.
std::vector<std::string>
fit_with_backup(const fs::path& backup, int epochs = 1,
                std::function<nn::Sequential()> build = make_net,
                std::function<std::vector<std::shared_ptr<train::Callback>>(int)> more = {}) {
  const Data data;
  std::vector<std::string> errors(2);
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 2), comm);
    auto net = build();
    train::Model model(s, net);
    compile_locked(model);
    train::FitOptions fit;
    fit.epochs = epochs;
    fit.verbose = train::Verbosity::kSilent;
    fit.callbacks = {std::make_shared<train::BackupAndRestore>(train::BackupOptions{backup, 4})};
    if (more) {
      for (auto& c : more(rank)) fit.callbacks.push_back(c);
    }
    try {
      model.fit(data.batches(), fit);
    } catch (const ConfigError& e) {
      errors[rank] = e.what();
    }
  });
  return errors;
}

// The issue's case: `--backup-dir run --checkpoint-dir run/ckpt` (and the same directory for
// both) removed the checkpoints and the user's files with the backups at the end of the fit.
TEST(Callbacks, ABackupDirectoryThatOverlapsTheCheckpointDirectoryIsRefusedNamingBoth) {
  testing::TempDir dir;
  const fs::path run = fs::path(dir.path()) / "run";
  fs::create_directories(run);
  std::ofstream(run / "notes.txt") << "mine";
  for (const fs::path& checkpoints : {run / "ckpt", run, fs::path(dir.path())}) {
    const auto errors = fit_with_backup(run, 1, make_net, [&](int) {
      train::ModelCheckpointOptions options;
      options.filepath = checkpoints.string();
      return std::vector<std::shared_ptr<train::Callback>>{
          std::make_shared<train::ModelCheckpoint>(options)};
    });
    const std::string expected = "BackupOptions::backup_dir " + run.string() +
                                 " and ModelCheckpointOptions::filepath " + checkpoints.string();
    for (const auto& error : errors) {
      EXPECT_EQ(error.rfind(expected, 0), 0u) << error;
      EXPECT_NE(error.find("give it a directory of its own"), std::string::npos) << error;
    }
  }
  EXPECT_EQ(testing::entries(run), std::vector<std::string>{"notes.txt"});
  EXPECT_EQ(testing::read_file(run / "notes.txt"), "mine");
}

TEST(Callbacks, ABackupDirectoryHoldingOtherFilesIsRefusedAndLeftAsItWas) {
  testing::TempDir dir;
  const fs::path run = dir.path();
  std::ofstream(run / "notes.txt") << "mine";
  fs::create_directories(run / "ckpt-3");
  fs::create_directories(run / "backup-7"); // a backup's name, but not a backup's files
  std::ofstream(run / "backup-7" / "data.csv") << "1,2";
  for (const auto& error : fit_with_backup(run)) {
    EXPECT_EQ(error, "BackupOptions::backup_dir " + run.string() +
                         " holds what flotilla did not write (backup-7/, ckpt-3/, notes.txt); "
                         "BackupAndRestore deletes its backups when the fit completes, so it "
                         "needs a directory of its own: give a new or empty one");
  }
  EXPECT_EQ(testing::entries(run), (std::vector<std::string>{"backup-7", "ckpt-3", "notes.txt"}));
  EXPECT_EQ(testing::entries(run / "backup-7"), std::vector<std::string>{"data.csv"});
}

// What the user adds while the fit runs stays; so does a directory the user made.
TEST(Callbacks, AFitThatEndsDeletesOnlyTheBackupsOwnFiles) {
  testing::TempDir dir;
  const fs::path backup = fs::path(dir.path()) / "mine";
  fs::create_directories(backup); // the user's (empty): kept
  const auto errors = fit_with_backup(backup, 3, make_net, [&](int rank) {
    auto drop = std::make_shared<train::LambdaCallback>();
    drop->batch_end = [rank, backup, batches = 0](std::int64_t, const train::Logs&) mutable {
      // After update 4 the first backup is there; the third backup (update 10) deletes it.
      if (rank != 0 || ++batches != 5) return;
      std::ofstream(backup / "added.txt") << "mine";
      std::ofstream(backup / "backup-1" / "keep.txt") << "mine too";
    };
    return std::vector<std::shared_ptr<train::Callback>>{drop};
  });
  EXPECT_EQ(errors, std::vector<std::string>(2));
  EXPECT_EQ(testing::entries(backup), (std::vector<std::string>{"added.txt", "backup-1"}));
  // The backup holding the user's file is left whole.
  EXPECT_EQ(testing::entries(backup / "backup-1"),
            (std::vector<std::string>{"keep.txt", "manifest.json", "manifest.sha256",
                                      "model.safetensors", "optimizer.safetensors"}));
  EXPECT_EQ(testing::read_file(backup / "backup-1" / "keep.txt"), "mine too");

  // An empty directory of the user's stays; one flotilla made goes (expect_exact_resume).
  const fs::path empty = fs::path(dir.path()) / "empty";
  fs::create_directories(empty);
  EXPECT_EQ(fit_with_backup(empty, 2), std::vector<std::string>(2));
  EXPECT_TRUE(fs::is_directory(empty));
  EXPECT_TRUE(testing::entries(empty).empty());
}

// A backup of another model was a hard stop deep in the restore with no way out named.
// The probe's case: a preempted job restarted with fewer epochs than its backup has done. The
// fit trains nothing, says so, and keeps the backups (they were deleted without a word).
TEST(Callbacks, AResumeWithNothingLeftToTrainSaysSoAndKeepsTheBackups) {
  testing::TempDir dir;
  const fs::path backup = fs::path(dir.path()) / "backup";
  const Data data;
  ::testing::internal::CaptureStderr();
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 2), comm);
    for (const int epochs : {3, 2}) {
      auto net = make_net();
      train::Model model(s, net);
      compile_locked(model);
      auto counter = std::make_shared<CountingCallback>();
      counter->crash_after = epochs == 3 ? 14 : -1; // in epoch 3, after epoch 2's backup
      train::FitOptions fit;
      fit.epochs = epochs;
      fit.verbose = train::Verbosity::kSilent;
      auto restore = std::make_shared<train::BackupAndRestore>(train::BackupOptions{backup});
      fit.callbacks = {restore, counter};
      if (epochs == 3) {
        EXPECT_THROW(model.fit(data.batches(), fit), Crash);
        continue;
      }
      const auto history = model.fit(data.batches(), fit);
      EXPECT_TRUE(history.epochs.empty());
      EXPECT_EQ(counter->batches, 0);
      ASSERT_TRUE(restore->restored().has_value());
      EXPECT_EQ(restore->restored()->epoch, 2);
    }
  });
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("BackupAndRestore: the backup in " + backup.string() +
                     " has 2 epoch(s) done (12 updates), and this fit asks for 2: nothing is left "
                     "to train, and the backups are kept"),
            std::string::npos)
      << err;
  const auto kept = testing::entries(backup);
  EXPECT_NE(std::find(kept.begin(), kept.end(), "checkpoint"), kept.end()) << kept.size();
}

TEST(Callbacks, ABackupOfAnotherModelIsRefusedSayingHowToStartAfresh) {
  testing::TempDir dir;
  const fs::path backup = fs::path(dir.path()) / "backup";
  const Data data;
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 2), comm);
    auto net = make_net();
    train::Model model(s, net);
    compile_locked(model);
    auto counter = std::make_shared<CountingCallback>();
    counter->crash_after = 5;
    train::FitOptions fit;
    fit.epochs = 2;
    fit.verbose = train::Verbosity::kSilent;
    fit.callbacks = {std::make_shared<train::BackupAndRestore>(train::BackupOptions{backup, 4}),
                     counter};
    EXPECT_THROW(model.fit(data.batches(), fit), Crash);
  });
  const auto before = testing::entries(backup);
  ASSERT_EQ(before, (std::vector<std::string>{".flotilla.lock", "backup-1", "checkpoint"}));
  const auto wider = [] {
    std::lock_guard<std::mutex> lock(build_mutex);
    return nn::Sequential(nn::Linear(8, 32), nn::ReLU(), nn::Linear(32, 3));
  };
  for (const auto& error : fit_with_backup(backup, 2, wider)) {
    EXPECT_NE(error.find((backup / "backup-1").string() +
                         " is a backup of another model: torch::nn::Sequential with 195 "
                         "parameters, where this fit trains torch::nn::Sequential with 387 "
                         "(their parameters' names and shapes differ). To start afresh, move it "
                         "away (mv " +
                         backup.string() + " " + backup.string() +
                         ".old) or give BackupOptions::backup_dir another directory"),
              std::string::npos)
        << error;
  }
  EXPECT_EQ(testing::entries(backup), before);
}

// Two jobs on one backup directory resumed from and overwrote each other's backups. Another
// process holding the lock (flock(1) here, with the record a job writes) keeps a fit out; once
// it is gone (killed: the kernel drops its lock), its record no longer does.
TEST(Callbacks, ABackupDirectoryAnotherJobHoldsIsRefusedNamingThatJob) {
  testing::TempDir dir;
  const fs::path backup = dir.path();
  const fs::path lock = backup / ".flotilla.lock";
  const std::string record =
      R"({"holder": "flotilla BackupAndRestore", "host": "node-7", "pid": 4242, )"
      R"("started": "2026-12-01T10:00:00Z", "run": {"model": "cnn", "parameter_count": 1200, )"
      R"("seed": 42, "workers": 4}})";
  testing::Process other({"flock", "--exclusive", lock.string(), "sh", "-c",
                          "printf '%s' \"$RECORD\" > \"$LOCK\"; echo locked; exec sleep 120"},
                         {{"RECORD", record}, {"LOCK", lock.string()}});
  ASSERT_TRUE(other.wait_for_output("locked"));
  for (const auto& error : fit_with_backup(backup)) {
    EXPECT_EQ(error, "BackupOptions::backup_dir " + backup.string() +
                         " is in use by another job: the process 4242 on node-7, since "
                         "2026-12-01T10:00:00Z, training cnn (1200 parameters, seed 42, 4 "
                         "workers). Two jobs on one backup directory would resume from and "
                         "overwrite each other's backups: give this job a directory of its own, "
                         "or wait for that one to end");
  }
  EXPECT_EQ(testing::read_file(lock), record); // not taken over
  ::kill(-other.pid(), SIGKILL);               // flock and the command that inherited its lock
  other.wait();
  EXPECT_EQ(fit_with_backup(backup), std::vector<std::string>(2));
  EXPECT_TRUE(testing::entries(backup).empty()); // its lock file went with the backups
}

// Every replica's optimizer state comes back, not only replica 0's.
TEST(Callbacks, BackupAndRestoreResumesTwoReplicasPerWorkerExactly) {
  expect_exact_resume({/*backup_every=*/4, /*crash_after=*/11, /*resumed_at=*/10, 1, 4, 2});
}

// Preemption: one worker is asked to stop (its own request_preemption(), or a real SIGTERM to
// the process); every worker must stop at the same step, the backup must hold that step, and a
// fit started again must end bit-identical to one never interrupted, with no update lost or
// done twice.
struct PreemptionCase {
  bool real_signal;          // rank 0 raises SIGTERM; otherwise rank 1 asks through its callback
  std::int64_t ask_at;       // the update after which the request is made
  std::int64_t stopped_at;   // the update every worker stops at (-1: any, the same on both)
  int epoch;                 // where the backup resumes (0-based epoch, step in it)
  std::int64_t step_in_epoch;
  // 0: a vote every step, so the step it stops at is known; otherwise the chief's timing
  // decides how many steps apart the votes are.
  std::chrono::milliseconds check_interval{0};
};

void expect_preemption(const PreemptionCase& case_) {
  const Data data;
  testing::TempDir dir;
  const fs::path backup = fs::path(dir.path()) / "backup";
  constexpr int kEpochs = 3;
  struct sigaction before {};
  ASSERT_EQ(::sigaction(SIGTERM, nullptr, &before), 0);
  std::vector<std::vector<float>> uninterrupted(2), resumed(2);
  std::vector<std::int64_t> preempted_at(2, -1), restored_at(2, -1), first_run(2), second_run(2);
  std::vector<std::string> messages(2);
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 2), comm);
    uninterrupted[rank] = uninterrupted_weights(s, data, kEpochs);
    {
      auto net = make_net();
      train::Model model(s, net);
      compile_locked(model);
      train::BackupOptions options{backup, 0};
      options.preemption_check_interval = case_.check_interval;
      auto restore = std::make_shared<train::BackupAndRestore>(options);
      // Before BackupAndRestore in the list: the request joins this very step's vote.
      auto trigger = std::make_shared<train::LambdaCallback>();
      std::int64_t batches = 0;
      trigger->batch_end = [&](std::int64_t, const train::Logs&) {
        if (++batches != case_.ask_at) return;
        if (case_.real_signal && rank == 0) ::raise(SIGTERM);
        if (!case_.real_signal && rank == 1) restore->request_preemption();
      };
      train::FitOptions fit;
      fit.epochs = kEpochs;
      fit.verbose = train::Verbosity::kSilent;
      fit.callbacks = {trigger, restore};
      try {
        model.fit(data.batches(), fit);
      } catch (const Preempted& e) {
        preempted_at[rank] = e.iterations();
        messages[rank] = e.what();
      }
      first_run[rank] = batches;
    }
    auto net = make_net();
    train::Model model(s, net);
    compile_locked(model);
    auto restore = std::make_shared<train::BackupAndRestore>(train::BackupOptions{backup, 0});
    auto counter = std::make_shared<CountingCallback>();
    train::FitOptions fit;
    fit.epochs = kEpochs;
    fit.verbose = train::Verbosity::kSilent;
    fit.callbacks = {restore, counter};
    model.fit(data.batches(), fit);
    second_run[rank] = counter->batches;
    ASSERT_TRUE(restore->restored().has_value());
    restored_at[rank] = restore->restored()->iterations;
    if (case_.stopped_at >= 0) {
      EXPECT_EQ(restore->restored()->epoch, case_.epoch);
      EXPECT_EQ(restore->restored()->step_in_epoch, case_.step_in_epoch);
    }
    EXPECT_EQ(model.training_state().iterations, 18);
    resumed[rank] = testing::flat_parameters(*net);
  });
  const std::int64_t stopped_at = case_.stopped_at >= 0 ? case_.stopped_at : preempted_at[0];
  EXPECT_GT(stopped_at, case_.ask_at);
  EXPECT_LT(stopped_at, 18);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(preempted_at[r], stopped_at) << "rank " << r;
    EXPECT_EQ(restored_at[r], stopped_at) << "rank " << r;
    EXPECT_EQ(first_run[r], stopped_at) << "rank " << r;
    EXPECT_EQ(second_run[r], 18 - stopped_at) << "rank " << r;
    EXPECT_NE(messages[r].find("saved the backup at update " + std::to_string(stopped_at)),
              std::string::npos)
        << messages[r];
  }
  EXPECT_EQ(resumed[0], uninterrupted[0]); // bit for bit
  EXPECT_EQ(resumed[1], uninterrupted[1]);
  EXPECT_FALSE(train::preemption_requested());
  // The SIGTERM disposition is the one the test had before the fits.
  struct sigaction after {};
  ASSERT_EQ(::sigaction(SIGTERM, nullptr, &after), 0);
  EXPECT_EQ(after.sa_handler, before.sa_handler);
}

TEST(Callbacks, PreemptionOnOneWorkerStopsEveryWorkerAtTheSameStep) {
  // 6 updates per epoch. Asked after update 8: the vote started then is read after update 9.
  expect_preemption({/*real_signal=*/false, /*ask_at=*/8, /*stopped_at=*/9, 1, 3});
}

TEST(Callbacks, PreemptionAgreedAtAnEpochsLastStepStopsAfterTheNextEpochsFirst) {
  // Agreed after update 6, the last of epoch 1: a backup there would resume into an exhausted
  // pass, so the stop comes after update 7.
  expect_preemption({/*real_signal=*/false, /*ask_at=*/5, /*stopped_at=*/7, 1, 1});
}

TEST(Callbacks, ARealSigtermDuringFitPreemptsInsteadOfKilling) {
  // Rank 0's process-wide flag is in its vote after update 10 whatever rank 1 saw: the MAX of
  // the two is 1 at the same step on both.
  expect_preemption({/*real_signal=*/true, /*ask_at=*/10, /*stopped_at=*/11, 1, 5});
}

TEST(Callbacks, PreemptionVotesSpacedByTheChiefsTimingStillAgreeOnOneStep) {
  // A 1 ms target over sub-millisecond steps: the chief proposes several steps between votes,
  // and where it stops depends on timing, but both ranks stop at the same update.
  expect_preemption({/*real_signal=*/false, /*ask_at=*/2, /*stopped_at=*/-1, 0, 0,
                     std::chrono::milliseconds(1)});
}

// The preemption vote is fit's own collective: workers whose callbacks disagree on it (one
// handles preemption, the other does not) are stopped by the start-up check, on both, naming it,
// before a vote one of them would never join.
TEST(Callbacks, WorkersThatDisagreeOnPreemptionHandlingAreStoppedBeforeTheFirstStep) {
  const Data data;
  testing::TempDir dir;
  std::vector<std::string> errors(2);
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 2), comm);
    auto net = make_net();
    train::Model model(s, net);
    compile_locked(model);
    train::BackupOptions options{fs::path(dir.path()) / "backup", 0};
    options.handle_preemption = rank == 0;
    train::FitOptions fit;
    fit.verbose = train::Verbosity::kSilent;
    fit.callbacks = {std::make_shared<train::BackupAndRestore>(options)};
    try {
      model.fit(data.batches(), fit);
    } catch (const ConfigError& e) {
      errors[rank] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("preemption vote: worker rank 1 has off, the chief (rank 0) has "
                             "every 500 ms"),
              std::string::npos)
        << "rank " << r << ": " << errors[r];
  }
}

TEST(Callbacks, ScheduleDrivesTheLearningRateAndValidationAddsValKeys) {
  const Data data;
  std::vector<train::History> histories(2);
  std::vector<train::EvalResult> evals(2);
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 2), comm);
    auto net = make_net();
    train::Model model(s, net);
    auto compile = sgd_with_schedule();
    compile.metrics = {"accuracy", "sparse_top_k_categorical_accuracy@2"};
    model.compile(compile);
    train::FitOptions fit;
    fit.epochs = 2;
    fit.verbose = train::Verbosity::kSilent;
    fit.validation_data = data::Dataset::from_tensor_slices({data.x, data.y}).batch(10);
    histories[rank] = model.fit(data.batches(), fit);
    evals[rank] = model.evaluate(*fit.validation_data);
  });
  const auto& last = histories[0].epochs.back().values;
  std::vector<std::string> keys;
  for (const auto& [k, v] : last.items()) keys.push_back(k);
  EXPECT_EQ(keys, (std::vector<std::string>{"loss", "accuracy",
                                            "sparse_top_k_categorical_accuracy@2",
                                            "learning_rate", "val_loss", "val_accuracy",
                                            "val_sparse_top_k_categorical_accuracy@2"}));
  // 12 updates done: the next rate is the cosine's at step 12 (8 steps into its decay).
  const double expected = 0.2 * 0.5 * (1 + std::cos(M_PI * 8 / 20));
  EXPECT_NEAR(last.at("learning_rate"), expected, 1e-12);
  EXPECT_DOUBLE_EQ(last.at("val_loss"), evals[0].loss());
  EXPECT_DOUBLE_EQ(last.at("val_accuracy"), evals[0].at("accuracy"));
  EXPECT_EQ(histories[0]["val_loss"], histories[1]["val_loss"]);
}

TEST(Callbacks, EarlyStoppingStopsEveryWorkerAtThePatienceAndRestoresTheBest) {
  const Data data;
  std::vector<std::optional<int>> stopped(2);
  std::vector<std::size_t> epochs_run(2);
  std::vector<bool> restored_best(2);
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 2), comm);
    auto net = make_net();
    train::Model model(s, net);
    model.compile(sgd_with_schedule());
    // Scripted val_loss: best at epoch index 1, then worse twice.
    auto script = std::make_shared<train::LambdaCallback>();
    const std::vector<double> val = {1.0, 0.5, 0.7, 0.8, 0.4, 0.3};
    std::vector<float> best_weights;
    script->epoch_end = [&](int epoch, train::EpochLogs& logs) {
      logs.values.set("val_loss", val[epoch]);
      if (epoch == 1) best_weights = testing::flat_parameters(*net);
    };
    train::EarlyStoppingOptions options;
    options.patience = 2;
    options.restore_best_weights = true;
    auto early = std::make_shared<train::EarlyStopping>(options);
    train::FitOptions fit;
    fit.epochs = 6;
    fit.verbose = train::Verbosity::kSilent;
    fit.callbacks = {script, early};
    epochs_run[rank] = model.fit(data.batches(), fit).epochs.size();
    stopped[rank] = early->stopped_epoch();
    restored_best[rank] = testing::flat_parameters(*net) == best_weights;
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(stopped[r], 3); // epochs 2 and 3 did not improve on epoch 1
    EXPECT_EQ(epochs_run[r], 4u);
    EXPECT_TRUE(restored_best[r]);
  }
}

TEST(Callbacks, CheckpointsCsvAndTensorBoardComeOnlyFromTheChief) {
  const Data data;
  testing::TempDir dir;
  const fs::path root = dir.path();
  std::vector<train::History> histories(2);
  std::vector<std::vector<fs::path>> saved(2);
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 2), comm);
    auto net = make_net();
    train::Model model(s, net);
    model.compile(sgd_with_schedule());
    train::ModelCheckpointOptions best;
    best.filepath = (root / "best-{epoch:02d}-{loss:.3f}.safetensors").string();
    best.monitor = "loss";
    best.save_best_only = true;
    best.save_weights_only = true;
    auto checkpoint = std::make_shared<train::ModelCheckpoint>(best);
    train::ModelCheckpointOptions full;
    full.filepath = (root / "ckpts").string();
    full.max_to_keep = 2;
    train::FitOptions fit;
    fit.epochs = 3;
    fit.verbose = train::Verbosity::kSilent;
    fit.callbacks = {checkpoint, std::make_shared<train::ModelCheckpoint>(full),
                     std::make_shared<train::CSVLogger>(root / "log.csv"),
                     std::make_shared<train::TensorBoard>(train::TensorBoardOptions{root / "tb"})};
    histories[rank] = model.fit(data.batches(), fit);
    saved[rank] = checkpoint->saved();
  });
  const auto loss = histories[0]["loss"];
  // The loss falls every epoch here, so every epoch is a new best.
  ASSERT_EQ(saved[0].size(), 3u);
  char name[64];
  std::snprintf(name, sizeof name, "best-03-%.3f.safetensors", loss[2]);
  EXPECT_EQ(saved[0][2].filename(), name);
  EXPECT_TRUE(fs::exists(saved[0][2]));
  // Full checkpoints: the newest 2, TF's pointer naming ckpt-3, verified on read.
  checkpoint::CheckpointManager manager(root / "ckpts", 2);
  ASSERT_TRUE(manager.latest().has_value());
  EXPECT_EQ(manager.latest()->filename(), "ckpt-3");
  EXPECT_EQ(manager.checkpoints().size(), 2u);
  const auto data3 = checkpoint::read_checkpoint(*manager.latest());
  EXPECT_EQ(data3.epoch, 3);
  EXPECT_EQ(data3.step, 18);
  EXPECT_EQ(data3.state.at("iterations"), 18);
  // CSV: Keras's layout, epochs 0-based, keys sorted.
  std::ifstream csv(root / "log.csv");
  std::string header, row;
  std::getline(csv, header);
  EXPECT_EQ(header, "epoch,accuracy,learning_rate,loss");
  std::getline(csv, row);
  EXPECT_EQ(row.substr(0, 2), "0,");
  // Nothing but the chief's files (no worker's temporary directory left behind).
  std::vector<std::string> expected = {"ckpts", "log.csv", "tb"};
  for (const auto& p : saved[0]) expected.push_back(p.filename());
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(testing::entries(root), expected);
  // TensorBoard's own reader sees the epoch scalars, with the values fit() returned.
  if (!testing::tensorboard_installed()) {
    GTEST_SKIP() << "the test venv's Python cannot import tensorboard; run scripts/bootstrap";
  }
  const auto train = testing::tensorboard_view((root / "tb" / "train").string());
  const auto& epoch_loss = train["scalars"]["epoch_loss"];
  ASSERT_EQ(epoch_loss.size(), 3u) << train.dump();
  for (int e = 0; e < 3; ++e) {
    EXPECT_EQ(epoch_loss[e]["step"], e);
    EXPECT_EQ(epoch_loss[e]["value"].get<double>(), static_cast<double>(static_cast<float>(loss[e])));
  }
  EXPECT_TRUE(train["scalars"].contains("epoch_learning_rate"));
  EXPECT_TRUE(train["scalars"].contains("epoch_samples_per_s"));
}

TEST(Callbacks, TerminateOnNaNStopsEveryWorkerAtTheSameStep) {
  Data data;
  // One poisoned example, in the batch that only worker 1 sees at its second step.
  auto x = data.x.clone();
  std::vector<std::int64_t> steps(2);
  std::vector<bool> finite(2);
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 2), comm);
    auto net = make_net();
    train::Model model(s, net);
    model.compile(sgd_with_schedule());
    // Unshuffled batches of 16: worker 1 takes rows 8..15 of each; step 2's are rows 24..31.
    if (rank == 0) x[27][0] = std::numeric_limits<float>::quiet_NaN();
    const auto ds = data::Dataset::from_tensor_slices({x, data.y}).batch(16, true);
    train::FitOptions fit;
    fit.epochs = 2;
    fit.verbose = train::Verbosity::kSilent;
    fit.callbacks = {std::make_shared<train::TerminateOnNaN>()};
    const auto history = model.fit(ds, fit);
    steps[rank] = history.epochs.back().steps + 100 * static_cast<std::int64_t>(
                                                          history.epochs.size());
    finite[rank] = model.last_step_finite();
  });
  EXPECT_EQ(steps[0], 102); // one epoch, stopped after its second step
  EXPECT_EQ(steps[1], 102);
  EXPECT_FALSE(finite[0]);
}

TEST(Callbacks, FilepathTemplatesFormatLikePython) {
  train::Logs logs;
  logs.set("val_loss", 0.123456);
  EXPECT_EQ(train::format_filepath("m-{epoch:02d}-{val_loss:.4f}", 7, logs), "m-07-0.1235");
  EXPECT_EQ(train::format_filepath("m-{epoch}", 12, logs), "m-12");
  try {
    train::format_filepath("m-{val_acc}", 1, logs);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("names {val_acc}, which is not in the logs"),
              std::string::npos);
  }
}

} // namespace
} // namespace flotilla
