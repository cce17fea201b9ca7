// Keras's callbacks for Model::fit. Hooks run on every worker with the same global epoch logs,
// so decisions (early stopping, best checkpoint) agree; only the chief writes what a user sees
// (progress, CSV, TensorBoard, the checkpoint directory), while saves that are collective steps
// (ModelCheckpoint, BackupAndRestore) run on every worker, the others writing into temporary
// directories that are removed afterwards. Epoch indices are 0-based in hooks and CSV files, and
// 1-based in file name templates and progress, as in Keras.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "flotilla/collective/communicator.h"
#include "flotilla/train/model.h"

namespace flotilla::train {

// What fit() tells its callbacks before training (Keras's callback.params).
struct TrainParams {
  int epochs = 0;
  std::int64_t steps = 0; // per epoch; 0 when unknown
  Verbosity verbose = Verbosity::kSilent;
};

class Callback {
 public:
  virtual ~Callback() = default;
  virtual void on_train_begin() {}
  virtual void on_train_end() {}
  virtual void on_epoch_begin(int epoch) {}
  // Callbacks may add to logs.values (later callbacks and the History see it).
  virtual void on_epoch_end(int epoch, EpochLogs& logs) {}
  // Every steps_per_execution steps; `logs` are this worker's running means over the epoch.
  virtual void on_train_batch_begin(std::int64_t batch) {}
  virtual void on_train_batch_end(std::int64_t batch, const Logs& logs) {}

  void set_model(Model* model) { model_ = model; }
  void set_params(const TrainParams& params) { params_ = params; }

 protected:
  Model& model() const;
  const TrainParams& params() const { return params_; }
  bool is_chief() const;

 private:
  Model* model_ = nullptr;
  TrainParams params_;
};

// Keras's ProgbarLogger: a bar with ETA and running loss/metrics on a terminal (verbose 1), one
// line per epoch otherwise; chief only. fit() adds one unless verbose is silent or one is given.
class ProgressBar : public Callback {
 public:
  explicit ProgressBar(Verbosity verbose = Verbosity::kAuto, std::FILE* out = stdout);
  ~ProgressBar() override;
  void on_train_begin() override;
  void on_epoch_begin(int epoch) override;
  void on_train_batch_end(std::int64_t batch, const Logs& logs) override;
  void on_epoch_end(int epoch, EpochLogs& logs) override;

 private:
  struct Impl;
  Verbosity verbose_;
  std::FILE* out_;
  std::unique_ptr<Impl> impl_;
};

// Any hook as a function (Keras's LambdaCallback).
struct LambdaCallback : Callback {
  std::function<void(int, EpochLogs&)> epoch_end;
  std::function<void(std::int64_t, const Logs&)> batch_end;
  std::function<void()> train_end;
  void on_epoch_end(int epoch, EpochLogs& logs) override {
    if (epoch_end) epoch_end(epoch, logs);
  }
  void on_train_batch_end(std::int64_t batch, const Logs& logs) override {
    if (batch_end) batch_end(batch, logs);
  }
  void on_train_end() override {
    if (train_end) train_end();
  }
};

enum class MonitorMode { kAuto, kMin, kMax }; // auto: max for accuracies, min otherwise

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

class ModelCheckpoint : public Callback {
 public:
  explicit ModelCheckpoint(ModelCheckpointOptions options);
  void on_train_begin() override;
  void on_train_batch_end(std::int64_t batch, const Logs& logs) override;
  void on_epoch_end(int epoch, EpochLogs& logs) override;
  // The chief's paths, oldest first.
  const std::vector<std::filesystem::path>& saved() const { return saved_; }

 private:
  void save(int epoch_1based, const Logs& logs);
  ModelCheckpointOptions options_;
  std::optional<double> best_;
  std::int64_t last_saved_iteration_ = 0;
  std::vector<std::filesystem::path> saved_;
};

struct BackupOptions {
  std::filesystem::path backup_dir;
  std::int64_t save_freq = 0;  // 0: at every epoch end; N: also every N optimizer updates
  bool delete_checkpoint = true; // remove the backup after a fit that completes
  // TF's PreemptionCheckpointHandler: during fit, SIGTERM to any one worker makes every worker
  // save a backup at the same step and leave fit with Preempted (see request_preemption).
  bool handle_preemption = true;
  // How often the workers compare preemption requests: about this often in time, as a whole
  // number of steps the chief derives from its step time and sends with each vote (so every
  // worker uses the same number). A request is acted on within about twice this. 0: every step.
  std::chrono::milliseconds preemption_check_interval{500};
};

// Asks the running fit of every BackupAndRestore in this process to stop for preemption: the
// SIGTERM handler calls it (async-signal-safe: it sets one lock-free atomic). Each worker
// contributes its request to a tiny MAX all-reduce at step boundaries (every step, or about
// every BackupOptions::preemption_check_interval), started at one boundary and read at the next
// so it never waits on the step's critical path; because every worker issues it in the same
// order, all see the request at the same step, save a backup there and throw Preempted
// (message: the update it saved at; a fit started again resumes there).
// The SIGTERM handler is installed from on_train_begin to on_train_end (or until Preempted is
// thrown, or the callback is destroyed), and the previous handler is put back after.
void request_preemption() noexcept;
// Whether a request is pending (set by request_preemption, cleared when a fit acts on it).
bool preemption_requested() noexcept;

// Keras's BackupAndRestore: a fit that starts with a backup present continues from it: weights,
// optimizer state, loss scale, epoch, step, input position and RNG state. Every worker reads
// the chief's backup (backup_dir must be on storage they share; on one machine it is).
// With handle_preemption, a preemption request (above) ends fit with Preempted after a backup
// at the agreed step. That step is an optimizer step's boundary (never inside a gradient
// accumulation group) and never an epoch's last step: a request that lands there is carried
// out after the first step of the next epoch (or not at all, if that was the last epoch: the
// fit has finished its work).
class BackupAndRestore : public Callback {
 public:
  explicit BackupAndRestore(BackupOptions options);
  ~BackupAndRestore() override;
  void on_train_begin() override;
  void on_train_batch_end(std::int64_t batch, const Logs& logs) override;
  void on_epoch_end(int epoch, EpochLogs& logs) override;
  void on_train_end() override;
  // Where the starting fit resumed from (nullopt: it started fresh).
  const std::optional<TrainingState>& restored() const { return restored_; }
  // request_preemption() for this worker only (the process-wide request reaches every worker
  // in the process; ranks as threads in one process need this one).
  void request_preemption() noexcept { requested_ = true; }

 private:
  void backup();
  void start_vote(std::int64_t steps_timed); // steps since the last vote began (0: none)
  bool finish_vote();
  void release_signal_handler();
  BackupOptions options_;
  std::optional<TrainingState> restored_;
  std::int64_t last_backup_iteration_ = -1;
  std::int64_t number_ = 0;
  std::atomic<bool> requested_{false};
  bool handler_installed_ = false;
  bool agreed_ = false; // every worker has seen a request: stop at the next allowed boundary
  std::int64_t vote_every_ = 1; // steps between votes, as the last vote decided
  std::int64_t since_vote_ = 0;
  std::chrono::steady_clock::time_point vote_started_;
  torch::Tensor vote_tensor_;
  std::optional<collective::Work> vote_;
};

struct TensorBoardOptions {
  std::filesystem::path log_dir;
  std::int64_t update_freq = 0; // 0: per epoch; N: also batch_* scalars every N updates
};

// Keras's TensorBoard: event files under log_dir/train and log_dir/validation with
// epoch_<key> scalars (loss, metrics, learning_rate, samples_per_s) at each epoch; chief only.
class TensorBoard : public Callback {
 public:
  explicit TensorBoard(TensorBoardOptions options);
  ~TensorBoard() override;
  void on_train_begin() override;
  void on_train_batch_end(std::int64_t batch, const Logs& logs) override;
  void on_epoch_end(int epoch, EpochLogs& logs) override;
  void on_train_end() override;

 private:
  struct Writers;
  TensorBoardOptions options_;
  std::unique_ptr<Writers> writers_;
};

struct EarlyStoppingOptions {
  std::string monitor = "val_loss";
  double min_delta = 0;
  int patience = 0;
  MonitorMode mode = MonitorMode::kAuto;
  std::optional<double> baseline;
  bool restore_best_weights = false;
  int start_from_epoch = 0;
};

class EarlyStopping : public Callback {
 public:
  explicit EarlyStopping(EarlyStoppingOptions options);
  void on_train_begin() override;
  void on_epoch_end(int epoch, EpochLogs& logs) override;
  void on_train_end() override;
  // 0-based epoch at which training was stopped (nullopt: it was not).
  std::optional<int> stopped_epoch() const { return stopped_epoch_; }

 private:
  EarlyStoppingOptions options_;
  std::optional<double> best_;
  int wait_ = 0;
  std::optional<int> stopped_epoch_;
  int best_epoch_ = 0;
  std::vector<torch::Tensor> best_weights_;
};

// Keras's CSVLogger: "epoch" (0-based) then the logs' keys, sorted; chief only.
class CSVLogger : public Callback {
 public:
  explicit CSVLogger(std::filesystem::path filename, char separator = ',', bool append = false);
  void on_train_begin() override;
  void on_epoch_end(int epoch, EpochLogs& logs) override;

 private:
  std::filesystem::path filename_;
  char separator_;
  bool append_;
  std::vector<std::string> keys_;
};

// Stops training at the first step whose all-reduced gradients are not finite (the same step on
// every worker), or at an epoch whose global loss is NaN or infinite.
class TerminateOnNaN : public Callback {
 public:
  void on_train_batch_end(std::int64_t batch, const Logs& logs) override;
  void on_epoch_end(int epoch, EpochLogs& logs) override;
};

// Keras's LearningRateScheduler: at each epoch's start, rate = schedule(epoch (0-based), rate).
class LearningRateScheduler : public Callback {
 public:
  explicit LearningRateScheduler(std::function<double(int epoch, double learning_rate)> schedule);
  void on_epoch_begin(int epoch) override;

 private:
  std::function<double(int, double)> schedule_;
};

// "{epoch:02d}-{val_loss:.4f}" with epoch and logs; ConfigError on an unknown key or format.
std::string format_filepath(const std::string& pattern, int epoch, const Logs& logs);

} // namespace flotilla::train
