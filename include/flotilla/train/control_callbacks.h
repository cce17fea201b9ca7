// Keras's callbacks that steer a fit: EarlyStopping, TerminateOnNaN, LearningRateScheduler, and
// LambdaCallback for any hook as a function.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "flotilla/train/callback.h"

namespace flotilla::train {

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

// Stops training at the first step whose all-reduced gradients are not finite (the same step on
// every worker), or at an epoch whose global loss is NaN or infinite.
class TerminateOnNaN : public Callback {
 public:
  void on_train_begin() override { terminated_.clear(); }
  void on_train_batch_end(std::int64_t batch, const Logs& logs) override;
  void on_epoch_end(int epoch, EpochLogs& logs) override;
  CallbackNeeds needs() const override;
  // Why the last fit was stopped ("batch 7: non-finite gradients (invalid loss)"); "" when it
  // was not. The CLI then exits with kExitDiverged.
  const std::string& terminated() const { return terminated_; }

 private:
  std::string terminated_;
};

// Keras's LearningRateScheduler: at each epoch's start, rate = schedule(epoch (0-based), rate).
class LearningRateScheduler : public Callback {
 public:
  explicit LearningRateScheduler(std::function<double(int epoch, double learning_rate)> schedule);
  void on_epoch_begin(int epoch) override;

 private:
  std::function<double(int, double)> schedule_;
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

} // namespace flotilla::train
