// Keras's checkpointing callbacks: ModelCheckpoint (weights or full checkpoints, per epoch or
// every N updates, the best only) and BackupAndRestore (resume an interrupted fit exactly, and
// save at an agreed step when preempted). Both save collectively: every worker takes part, the
// chief into the real directory, the others into temporary ones removed afterwards. In an
// elastic group (strategy::ElasticOptions) the chief saves alone, so that no save waits for
// a member that joins or leaves mid-fit; a worker joining mid-fit skips the restore (its state
// comes from a live peer).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "flotilla/checkpoint/directory.h"
#include "flotilla/train/callback.h"
#include "flotilla/train/training_state.h"

namespace flotilla::train {

struct ModelCheckpointOptions {
  // A template: {epoch} (1-based) and any logs key, with an optional format such as {epoch:02d}
  // or {val_loss:.4f}. With save_weights_only it names a .safetensors file. Otherwise it names a
  // directory of full checkpoints kept by a checkpoint::CheckpointManager: ckpt-<epoch> (or
  // ckpt-<update> with save_freq) holding weights, optimizer state and a manifest with each
  // file's SHA-256, and TF's "checkpoint" pointer to the newest.
  std::string filepath;
  int max_to_keep = 5; // full checkpoints kept in that directory
  std::string monitor = "val_loss";
  MonitorMode mode = MonitorMode::kAuto;
  bool save_best_only = false;
  bool save_weights_only = false;
  std::int64_t save_freq = 0; // 0: every epoch; N: every N optimizer updates
};

namespace detail {
// Updates since the last save, for a save_freq counted in updates (ModelCheckpoint's and
// BackupAndRestore's). A worker joining an elastic group mid-fit learns the update count only
// at its first step, so its count starts there.
class SaveCadence {
 public:
  void restart(std::int64_t iterations, bool joining) { last_ = joining ? -1 : iterations; }
  // Whether `every` updates have passed since the last save, at `iterations` updates.
  bool due(std::int64_t iterations, std::int64_t every) {
    if (last_ < 0) last_ = iterations - 1;
    return iterations - last_ >= every;
  }
  void saved(std::int64_t iterations) { last_ = iterations; }

 private:
  std::int64_t last_ = -1;
};
} // namespace detail

class ModelCheckpoint : public Callback {
 public:
  explicit ModelCheckpoint(ModelCheckpointOptions options);
  void on_train_begin() override;
  void on_train_batch_end(std::int64_t batch, const Logs& logs) override;
  void on_epoch_end(int epoch, EpochLogs& logs) override;
  CallbackNeeds needs() const override;
  // The chief's paths, oldest first.
  const std::vector<std::filesystem::path>& saved() const { return saved_; }

 private:
  void save(int epoch_1based, const Logs& logs);
  ModelCheckpointOptions options_;
  std::optional<double> best_;
  detail::SaveCadence cadence_;
  std::vector<std::filesystem::path> saved_;
};

struct BackupOptions {
  // A directory of its own (see BackupAndRestore); made when missing.
  std::filesystem::path backup_dir;
  std::int64_t save_freq = 0;    // 0: at every epoch end; N: also every N optimizer updates
  bool delete_checkpoint = true; // delete the backups after a fit that completes
  // TF's PreemptionCheckpointHandler (preemption.h): during fit, SIGTERM to any one worker makes
  // every worker save a backup at the same step and leave fit with Preempted. Elastic: the
  // worker that got it leaves alone at its next step boundary (the chief saves first) and the
  // others go on without it.
  bool handle_preemption = true;
  // How often the workers compare preemption requests: about this often in time, as a whole
  // number of steps the chief derives from its step time and sends with each vote (so every
  // worker uses the same number). A request is acted on within about twice this. 0: every step.
  std::chrono::milliseconds preemption_check_interval{500};
  // Files the program itself writes that may lie in backup_dir (a metrics or CSV log, say): they
  // do not count as what flotilla did not write, and they stay when the backups are deleted.
  std::vector<std::filesystem::path> own_outputs;
};

// Keras's BackupAndRestore: a fit that starts with a backup present continues from it: weights,
// optimizer state, loss scale, epoch, step, input position and RNG state. Every worker reads
// the chief's backup (backup_dir must be on storage they share; on one machine it is).
// With handle_preemption, a preemption request ends fit with Preempted after a backup at the
// agreed step. That step is an optimizer step's boundary (never inside a gradient accumulation
// group) and never an epoch's last step: a request that lands there is carried out after the
// first step of the next epoch (or not at all, if that was the last epoch: the fit has finished
// its work).
// The backup directory is its own, since a completed fit deletes the backups: fit refuses to
// start (ConfigError, on every worker) when it holds anything flotilla did not write, when it
// overlaps another callback's directory (a checkpoint or log directory), or when another job
// holds its lock (checkpoint/directory.h: the lock file names that job's host, process and
// model). A backup of another model (its parameters' names and shapes differ) is refused, not
// resumed, and so is a directory whose backups all fail to verify or to load; a newest backup
// that fails either is passed over for the one before. At the end it deletes only its own files,
// and the directory itself only when it made it.
class BackupAndRestore : public Callback {
 public:
  explicit BackupAndRestore(BackupOptions options);
  void on_train_begin() override;
  void on_train_batch_end(std::int64_t batch, const Logs& logs) override;
  void on_epoch_end(int epoch, EpochLogs& logs) override;
  void on_train_end() override;
  std::string on_preemption() override;
  CallbackNeeds needs() const override;
  // Where the starting fit resumed from (nullopt: it started fresh).
  const std::optional<TrainingState>& restored() const { return restored_; }
  // Model::request_preemption() for the model this callback is fitting (the process-wide
  // request reaches every worker in the process; ranks as threads in one process need this).
  void request_preemption() noexcept;

 private:
  bool backup(); // false: another worker writes it (elastic, not the chief)
  // The chief's claim on the directory at the fit's start: "" when it is this job's, else why
  // not. `elastic_takeover`: a member that became chief mid-fit takes the lock its predecessor
  // held (one frozen but alive still holds it: going on, with a warning).
  std::string claim_directory(bool elastic_takeover = false);
  std::optional<TrainingState> restore();
  // The backup resumed is at or past the fit's epochs: the fit trains nothing.
  bool nothing_left() const { return restored_ && restored_->epoch >= params().epochs; }
  BackupOptions options_;
  checkpoint::DirectoryLock lock_;
  bool claimed_ = false; // this process has claimed the directory for the current fit
  std::optional<TrainingState> restored_;
  detail::SaveCadence cadence_;
  std::int64_t number_ = 0;
  std::atomic<bool> requested_{false}; // asked before its fit began
};

// "{epoch:02d}-{val_loss:.4f}" with epoch and logs; ConfigError on an unknown key or format.
std::string format_filepath(const std::string& pattern, int epoch, const Logs& logs);

} // namespace flotilla::train
