// Keras's learning-rate schedules (tf.keras.optimizers.schedules), with Keras's semantics to the
// branch: the same warmup, clamping and boundary rules, checked against values TensorFlow
// computed (tests/fixtures/lr_schedules.json). A schedule is evaluated at every optimizer update
// with the count of updates applied so far (Keras's optimizer.iterations, 0 for the first).
// Rates are computed in double; Keras computes in float32, so values agree to float32 rounding.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace flotilla::train {

class LearningRateSchedule {
 public:
  virtual ~LearningRateSchedule() = default;
  // The learning rate for optimizer update `step` (0-based count of updates applied so far:
  // Keras's optimizer.iterations).
  virtual double operator()(std::int64_t step) const = 0;
  // One line for logs, e.g. "CosineDecay(initial_learning_rate=0.016, decay_steps=1000,
  // alpha=0, warmup_target=none, warmup_steps=200)".
  virtual std::string describe() const = 0;
  // Configurations that are legal but probably not what the user meant (compile() logs them
  // once on the chief). Empty for an ordinary configuration.
  virtual std::vector<std::string> warnings() const { return {}; }
};

// The seeds' rule BASE_LR * GLOBAL_BATCH / BASE_BATCH, computed as Python's
// BASE_LR * (GLOBAL_BATCH / BASE_BATCH) (so 1e-3 at 512 over 32 is exactly Python's 0.016).
// ConfigError on a non-positive (or non-finite) input.
double linear_scaling(double base_lr, std::int64_t global_batch, std::int64_t base_batch = 32);

// The same rate at every step. ConfigError unless `lr` is positive and finite.
class ConstantLearningRate : public LearningRateSchedule {
 public:
  explicit ConstantLearningRate(double lr);
  double operator()(std::int64_t step) const override;
  std::string describe() const override; // "ConstantLearningRate(learning_rate=0.01)"
  double learning_rate() const { return lr_; }

 private:
  double lr_;
};

struct CosineDecayOptions {
  double initial_learning_rate;
  std::int64_t decay_steps;
  double alpha = 0;                    // the floor, as a fraction of the rate decayed from
  std::optional<double> warmup_target; // the rate warmup ends at; no warmup when unset
  std::int64_t warmup_steps = 0;       // used only when warmup_target is set (as in Keras)
};

// keras.optimizers.schedules.CosineDecay. With s = step:
//   no warmup_target: s = min(s, decay_steps);
//     rate = initial_learning_rate * ((1 - alpha) * 0.5 * (1 + cos(pi * s / decay_steps)) + alpha)
//     (warmup_steps is ignored entirely: see warnings()).
//   warmup_target:    s = min(s, warmup_steps + decay_steps);
//     s < warmup_steps: rate = initial_learning_rate
//                              + (warmup_target - initial_learning_rate) * s / warmup_steps
//     otherwise: the cosine above, from warmup_target, at s - warmup_steps.
// ConfigError (naming the argument and the value seen) unless decay_steps >= 1, the rates are
// finite and >= 0, alpha is in [0, 1] and warmup_steps >= 0.
class CosineDecay : public LearningRateSchedule {
 public:
  explicit CosineDecay(CosineDecayOptions options);
  double operator()(std::int64_t step) const override;
  std::string describe() const override;
  // warmup_steps without warmup_target (Keras ignores them: no warmup at all), and
  // warmup_target with warmup_steps = 0 (initial_learning_rate is never used).
  std::vector<std::string> warnings() const override;
  const CosineDecayOptions& options() const { return options_; }

 private:
  CosineDecayOptions options_;
};

// keras.optimizers.schedules.PiecewiseConstantDecay: values[0] while step <= boundaries[0],
// values[i] while boundaries[i-1] < step <= boundaries[i], values.back() after the last
// boundary (a boundary step still gets the value before it). ConfigError unless boundaries is
// non-empty, >= 0 and strictly increasing, values.size() == boundaries.size() + 1 and every
// value is finite and >= 0.
class PiecewiseConstantDecay : public LearningRateSchedule {
 public:
  PiecewiseConstantDecay(std::vector<std::int64_t> boundaries, std::vector<double> values);
  double operator()(std::int64_t step) const override;
  std::string describe() const override;
  const std::vector<std::int64_t>& boundaries() const { return boundaries_; }
  const std::vector<double>& values() const { return values_; }

 private:
  std::vector<std::int64_t> boundaries_;
  std::vector<double> values_;
};

// keras.optimizers.schedules.ExponentialDecay:
//   rate = initial_learning_rate * decay_rate ^ (step / decay_steps), the exponent floored
//   (a drop every decay_steps updates) when `staircase`.
// ConfigError unless initial_learning_rate is finite and >= 0, decay_steps >= 1 and decay_rate
// is finite and > 0. warnings() flags decay_rate > 1 (the rate grows without bound).
class ExponentialDecay : public LearningRateSchedule {
 public:
  ExponentialDecay(double initial_learning_rate, std::int64_t decay_steps, double decay_rate,
                   bool staircase = false);
  double operator()(std::int64_t step) const override;
  std::string describe() const override;
  std::vector<std::string> warnings() const override;
  double initial_learning_rate() const { return initial_learning_rate_; }
  std::int64_t decay_steps() const { return decay_steps_; }
  double decay_rate() const { return decay_rate_; }
  bool staircase() const { return staircase_; }

 private:
  double initial_learning_rate_;
  std::int64_t decay_steps_;
  double decay_rate_;
  bool staircase_;
};

} // namespace flotilla::train
