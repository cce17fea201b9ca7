// What training and evaluation report: Keras's logs (metric name -> value), one epoch's results,
// the History fit() returns, and evaluate()'s result. Callbacks read them; fit() fills them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "flotilla/train/step_phases.h"

namespace flotilla::train {

// Keras's logs: metric name -> value, in the order Keras shows them (loss, metrics, val_...).
class Logs {
 public:
  void set(const std::string& key, double value);
  std::optional<double> get(const std::string& key) const;
  // ConfigError naming the keys there are.
  double at(const std::string& key) const;
  bool empty() const { return items_.empty(); }
  const std::vector<std::pair<std::string, double>>& items() const { return items_; }

 private:
  std::vector<std::pair<std::string, double>> items_;
};

// One epoch's results, global across workers.
struct EpochLogs {
  int epoch = 0; // 1-based, as Keras prints it (callbacks' 0-based index is epoch - 1)
  std::int64_t steps = 0;
  // loss, metrics, learning_rate, then val_loss and val_<metric> after a validation.
  Logs values;
  double samples_per_s = 0; // global samples ÷ the chief's wall-clock seconds
  double seconds = 0;
  // Where this worker's step time went, phase by phase (input wait, forward, backward, exposed
  // all-reduce, ...; see step_phases.h), and every worker's, in rank order: one small all-gather
  // per epoch, so the chief can show them all.
  PhaseTimes phases;
  std::vector<PhaseTimes> worker_phases;
  std::int64_t skipped_steps = 0; // non-finite gradients (loss scaling), the same on every worker
};

struct History {
  std::vector<EpochLogs> epochs;
  // Keras's history.history[key]: the value of `key` after each epoch (NaN where absent).
  std::vector<double> operator[](const std::string& key) const;
};

struct EvalResult {
  Logs values; // "loss" and each metric
  std::int64_t samples = 0;
  double loss() const { return values.at("loss"); }
  double at(const std::string& key) const { return values.at(key); }
};

} // namespace flotilla::train
