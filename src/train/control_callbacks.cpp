#include "flotilla/train/control_callbacks.h"

#include <cmath>

#include "flotilla/error.h"
#include "train/monitor.h"

namespace flotilla::train {

// ---------------------------------------------------------------------------------------------
// EarlyStopping

EarlyStopping::EarlyStopping(EarlyStoppingOptions options) : options_(std::move(options)) {
  if (options_.patience < 0) {
    throw ConfigError("EarlyStopping patience must be at least 0; saw " +
                      std::to_string(options_.patience));
  }
  options_.min_delta = std::fabs(options_.min_delta);
}

void EarlyStopping::on_train_begin() {
  best_ = options_.baseline;
  wait_ = 0;
  stopped_epoch_.reset();
  best_epoch_ = 0;
  best_weights_.clear();
}

void EarlyStopping::on_epoch_end(int epoch, EpochLogs& logs) {
  const auto value = logs.values.get(options_.monitor);
  if (!value || epoch < options_.start_from_epoch) {
    if (!value && is_chief()) {
      model().strategy().log().warn("EarlyStopping: monitor \"" + options_.monitor +
                                    "\" is not in the logs; it cannot stop training");
    }
    return;
  }
  const bool maximize = maximizes(options_.mode, options_.monitor);
  ++wait_;
  if (improved(*value, best_, maximize, options_.min_delta)) {
    best_ = *value;
    best_epoch_ = epoch;
    wait_ = 0;
    if (options_.restore_best_weights) {
      torch::NoGradGuard no_grad;
      best_weights_.clear();
      for (const auto& p : model().module().parameters()) best_weights_.push_back(p.clone());
      for (const auto& b : model().module().buffers()) best_weights_.push_back(b.clone());
    }
    return;
  }
  if (wait_ >= options_.patience && epoch > 0) {
    stopped_epoch_ = epoch;
    model().stop_training = true;
  }
}

void EarlyStopping::on_train_end() {
  if (!stopped_epoch_) return;
  if (is_chief()) {
    model().strategy().log().info("Epoch " + std::to_string(*stopped_epoch_ + 1) +
                                  ": early stopping (best " + options_.monitor + " at epoch " +
                                  std::to_string(best_epoch_ + 1) + ")");
  }
  if (options_.restore_best_weights && !best_weights_.empty()) {
    torch::NoGradGuard no_grad;
    std::size_t k = 0;
    for (auto& p : model().module().parameters()) p.copy_(best_weights_[k++]);
    for (auto& b : model().module().buffers()) b.copy_(best_weights_[k++]);
  }
}

// ---------------------------------------------------------------------------------------------
// TerminateOnNaN and LearningRateScheduler

void TerminateOnNaN::on_train_batch_end(std::int64_t batch, const Logs& logs) {
  if (model().last_step_finite()) return;
  terminated_ = "batch " + std::to_string(batch) + ": non-finite gradients (invalid loss)";
  if (is_chief()) {
    model().strategy().log().warn("Batch " + std::to_string(batch) +
                                  ": non-finite gradients (invalid loss), terminating training");
  }
  model().stop_training = true;
}

CallbackNeeds TerminateOnNaN::needs() const {
  CallbackNeeds needs;
  needs.finite_check = true;
  return needs;
}

void TerminateOnNaN::on_epoch_end(int epoch, EpochLogs& logs) {
  if (std::isfinite(logs.values.at("loss"))) return;
  if (terminated_.empty()) terminated_ = "epoch " + std::to_string(epoch + 1) + ": invalid loss";
  if (is_chief()) {
    model().strategy().log().warn("Epoch " + std::to_string(epoch + 1) +
                                  ": invalid loss, terminating training");
  }
  model().stop_training = true;
}

LearningRateScheduler::LearningRateScheduler(std::function<double(int, double)> schedule)
    : schedule_(std::move(schedule)) {
  if (!schedule_) throw ConfigError("LearningRateScheduler needs a schedule function");
}

void LearningRateScheduler::on_epoch_begin(int epoch) {
  model().set_learning_rate(schedule_(epoch, model().learning_rate()));
}

} // namespace flotilla::train
