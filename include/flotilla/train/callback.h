// The callback interface of Model::fit (Keras's keras.callbacks.Callback) and the list fit runs
// them through (Keras's CallbackList). Hooks run on every worker with the same global epoch
// logs, so decisions (early stopping, the best checkpoint) agree; callbacks that write what a
// user sees do so on the chief only. Epoch indices are 0-based in hooks, as in Keras. The
// callbacks themselves are in callbacks.h.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "flotilla/train/model.h"

namespace flotilla::train {

// What fit() tells its callbacks before training (Keras's callback.params).
struct TrainParams {
  int epochs = 0;
  std::int64_t steps = 0; // per epoch; 0 when unknown
  Verbosity verbose = Verbosity::kSilent;
};

// What a callback needs of fit() beyond its hooks, asked once before training: fit arranges each
// itself, at the same point on every worker, rather than each callback finding out what fit does.
struct CallbackNeeds {
  bool finite_check = false;   // Model::last_step_finite() after every step (a host read each)
  bool shows_progress = false; // it prints progress, so fit adds no ProgressBar of its own
  // Preemption handling (preemption.h): the workers vote on requests about this often, and on
  // an agreed request fit calls on_preemption() and throws Preempted. Unset: no vote.
  std::optional<std::chrono::milliseconds> preemption_check;
  // The directories it writes into. An exclusive one is a directory it deletes its files from
  // when the fit ends: fit refuses to start when it overlaps any other callback's directory.
  struct Directory {
    std::string owner; // for messages: "BackupOptions::backup_dir"
    std::filesystem::path path;
    bool exclusive = false;
  };
  std::vector<Directory> directories;
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
  // Every worker has agreed to stop for preemption at this step boundary: save what a restart
  // needs. Returns where it saved (for the Preempted message), "" when it saves nothing.
  virtual std::string on_preemption() { return ""; }
  virtual CallbackNeeds needs() const { return {}; }

  void set_model(Model* model) { model_ = model; }
  void set_params(const TrainParams& params) { params_ = params; }

 protected:
  Model& model() const;
  Model* model_or_null() const { return model_; } // outside fit: null
  const TrainParams& params() const { return params_; }
  bool is_chief() const;

 private:
  Model* model_ = nullptr;
  TrainParams params_;
};

// Verbosity::kAuto resolved as Keras does: a progress bar when `out` is a terminal, else one
// line per epoch; any other value as it is.
Verbosity resolve_verbosity(Verbosity verbose, std::FILE* out = stdout);

// Keras's CallbackList: the user's callbacks, with a ProgressBar in front unless the verbosity
// is silent or one of them shows progress itself; each hook runs on every callback in order.
class CallbackList {
 public:
  // ConfigError for a null callback, or an exclusive directory that overlaps another (the same
  // directory, or one inside the other).
  CallbackList(std::vector<std::shared_ptr<Callback>> callbacks, Verbosity verbose);
  Verbosity verbosity() const { return verbose_; }
  // Everything the callbacks need, together (the shortest preemption interval, every
  // directory).
  CallbackNeeds needs() const;
  void set_model(Model* model, const TrainParams& params);

  void on_train_begin();
  void on_train_end();
  void on_epoch_begin(int epoch);
  void on_epoch_end(int epoch, EpochLogs& logs);
  void on_train_batch_begin(std::int64_t batch);
  void on_train_batch_end(std::int64_t batch, const Logs& logs);
  // Where each callback saved, joined with " and ".
  std::string on_preemption();

 private:
  std::vector<std::shared_ptr<Callback>> callbacks_;
  Verbosity verbose_;
};

enum class MonitorMode { kAuto, kMin, kMax }; // auto: max for accuracies, min otherwise

} // namespace flotilla::train
