#include "flotilla/train/schedules.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <type_traits>
#include <utility>

#include "flotilla/error.h"

namespace flotilla::train {

namespace {

constexpr double kPi = 3.14159265358979323846;

// The shortest decimal that reads back as the same double: 0.016, not 0.016000 or
// 0.016000000000000001.
std::string number(double v) {
  char buf[32];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

[[noreturn]] void bad(const std::string& schedule, const std::string& argument,
                      const std::string& rule, const std::string& seen) {
  throw ConfigError(schedule + ": " + argument + " must be " + rule + "; saw " + seen);
}

void require_rate(const std::string& schedule, const std::string& argument, double v) {
  if (!(std::isfinite(v) && v >= 0)) bad(schedule, argument, "a finite rate >= 0", number(v));
}

void require_decay_steps(const std::string& schedule, std::int64_t v) {
  if (v < 1) bad(schedule, "decay_steps", "at least 1", std::to_string(v));
}

// Keras's cosine: from `from` at s = 0 to alpha * from at s = decay_steps (s already clamped).
double cosine(double from, double s, double decay_steps, double alpha) {
  const double cosine_decayed = 0.5 * (1.0 + std::cos(kPi * (s / decay_steps)));
  return from * ((1 - alpha) * cosine_decayed + alpha);
}

template <typename T> std::string list(const std::vector<T>& xs) {
  std::string out = "[";
  for (std::size_t i = 0; i < xs.size(); ++i) {
    if (i) out += ", ";
    if constexpr (std::is_floating_point_v<T>) {
      out += number(xs[i]);
    } else {
      out += std::to_string(xs[i]);
    }
  }
  return out + "]";
}

} // namespace

double linear_scaling(double base_lr, std::int64_t global_batch, std::int64_t base_batch) {
  if (!(std::isfinite(base_lr) && base_lr > 0)) {
    throw ConfigError("linear_scaling: base_lr must be positive; saw " + number(base_lr));
  }
  if (global_batch < 1) {
    throw ConfigError("linear_scaling: global_batch must be at least 1; saw " +
                      std::to_string(global_batch));
  }
  if (base_batch < 1) {
    throw ConfigError("linear_scaling: base_batch must be at least 1; saw " +
                      std::to_string(base_batch));
  }
  // As the seeds write it: BASE_LR * (GLOBAL_BATCH_SIZE / 32), the same double as Python's.
  return base_lr * (static_cast<double>(global_batch) / static_cast<double>(base_batch));
}

// ConstantLearningRate

ConstantLearningRate::ConstantLearningRate(double lr) : lr_(lr) {
  if (!(std::isfinite(lr) && lr > 0)) {
    bad("ConstantLearningRate", "learning_rate", "positive and finite", number(lr));
  }
}

double ConstantLearningRate::operator()(std::int64_t) const {
  return lr_;
}

std::string ConstantLearningRate::describe() const {
  return "ConstantLearningRate(learning_rate=" + number(lr_) + ")";
}

// CosineDecay

CosineDecay::CosineDecay(CosineDecayOptions options) : options_(std::move(options)) {
  const char* name = "CosineDecay";
  const CosineDecayOptions& o = options_;
  require_rate(name, "initial_learning_rate", o.initial_learning_rate);
  require_decay_steps(name, o.decay_steps);
  if (!(o.alpha >= 0 && o.alpha <= 1)) bad(name, "alpha", "in [0, 1]", number(o.alpha));
  if (o.warmup_target) require_rate(name, "warmup_target", *o.warmup_target);
  if (o.warmup_steps < 0) bad(name, "warmup_steps", "at least 0", std::to_string(o.warmup_steps));
}

double CosineDecay::operator()(std::int64_t step) const {
  const CosineDecayOptions& o = options_;
  const double decay_steps = static_cast<double>(o.decay_steps);
  double s = static_cast<double>(step);
  if (!o.warmup_target) {
    // Keras ignores warmup_steps here: no warmup, and the clamp is decay_steps alone.
    s = std::min(s, decay_steps);
    return cosine(o.initial_learning_rate, s, decay_steps, o.alpha);
  }
  const double target = *o.warmup_target;
  const double warmup_steps = static_cast<double>(o.warmup_steps);
  s = std::min(s, decay_steps + warmup_steps);
  if (s < warmup_steps) {
    return (target - o.initial_learning_rate) * (s / warmup_steps) + o.initial_learning_rate;
  }
  return cosine(target, s - warmup_steps, decay_steps, o.alpha);
}

std::string CosineDecay::describe() const {
  const CosineDecayOptions& o = options_;
  return "CosineDecay(initial_learning_rate=" + number(o.initial_learning_rate) +
         ", decay_steps=" + std::to_string(o.decay_steps) + ", alpha=" + number(o.alpha) +
         ", warmup_target=" + (o.warmup_target ? number(*o.warmup_target) : "none") +
         ", warmup_steps=" + std::to_string(o.warmup_steps) + ")";
}

std::vector<std::string> CosineDecay::warnings() const {
  const CosineDecayOptions& o = options_;
  std::vector<std::string> out;
  if (!o.warmup_target && o.warmup_steps > 0) {
    const std::string lr = number(o.initial_learning_rate);
    out.push_back(
        "CosineDecay: warmup_steps=" + std::to_string(o.warmup_steps) +
        " has no effect without warmup_target (as in Keras): there is no warmup; the rate "
        "starts at initial_learning_rate=" +
        lr + " at step 0 and reaches its floor " + number(o.alpha * o.initial_learning_rate) +
        " at step decay_steps=" + std::to_string(o.decay_steps) +
        ", not decay_steps + warmup_steps. For a linear warmup "
        "to a peak rate, pass warmup_target=<the peak> (here " +
        lr + ") and initial_learning_rate=<the starting rate> (e.g. 0).");
  }
  if (o.warmup_target && o.warmup_steps == 0 && *o.warmup_target != o.initial_learning_rate) {
    out.push_back("CosineDecay: warmup_target=" + number(*o.warmup_target) +
                  " with warmup_steps=0: there is no warmup and the decay starts from "
                  "warmup_target, so initial_learning_rate=" +
                  number(o.initial_learning_rate) +
                  " is never used. Set warmup_steps to the length of the warmup.");
  }
  return out;
}

// PiecewiseConstantDecay

PiecewiseConstantDecay::PiecewiseConstantDecay(std::vector<std::int64_t> boundaries,
                                               std::vector<double> values)
    : boundaries_(std::move(boundaries)), values_(std::move(values)) {
  const char* name = "PiecewiseConstantDecay";
  if (boundaries_.empty()) {
    bad(name, "boundaries", "non-empty (for one rate throughout use ConstantLearningRate)", "[]");
  }
  if (values_.size() != boundaries_.size() + 1) {
    bad(name, "values",
        "one longer than boundaries (" + std::to_string(boundaries_.size()) + " boundaries, so " +
            std::to_string(boundaries_.size() + 1) + " values)",
        std::to_string(values_.size()) + " values " + list(values_));
  }
  for (std::size_t i = 0; i < boundaries_.size(); ++i) {
    if (boundaries_[i] < 0) {
      bad(name, "boundaries", "steps >= 0", list(boundaries_));
    }
    if (i > 0 && boundaries_[i] <= boundaries_[i - 1]) {
      bad(name, "boundaries", "strictly increasing", list(boundaries_));
    }
  }
  for (double v : values_) {
    if (!(std::isfinite(v) && v >= 0)) bad(name, "values", "finite rates >= 0", list(values_));
  }
}

double PiecewiseConstantDecay::operator()(std::int64_t step) const {
  // The first boundary >= step: its index is the interval's (boundaries are inclusive above).
  const auto it = std::lower_bound(boundaries_.begin(), boundaries_.end(), step);
  return values_[static_cast<std::size_t>(it - boundaries_.begin())];
}

std::string PiecewiseConstantDecay::describe() const {
  return "PiecewiseConstantDecay(boundaries=" + list(boundaries_) + ", values=" + list(values_) +
         ")";
}

// ExponentialDecay

ExponentialDecay::ExponentialDecay(double initial_learning_rate, std::int64_t decay_steps,
                                   double decay_rate, bool staircase)
    : initial_learning_rate_(initial_learning_rate), decay_steps_(decay_steps),
      decay_rate_(decay_rate), staircase_(staircase) {
  const char* name = "ExponentialDecay";
  require_rate(name, "initial_learning_rate", initial_learning_rate);
  require_decay_steps(name, decay_steps);
  if (!(std::isfinite(decay_rate) && decay_rate > 0)) {
    bad(name, "decay_rate", "positive and finite", number(decay_rate));
  }
}

double ExponentialDecay::operator()(std::int64_t step) const {
  double p = static_cast<double>(step) / static_cast<double>(decay_steps_);
  if (staircase_) p = std::floor(p);
  return initial_learning_rate_ * std::pow(decay_rate_, p);
}

std::string ExponentialDecay::describe() const {
  return "ExponentialDecay(initial_learning_rate=" + number(initial_learning_rate_) +
         ", decay_steps=" + std::to_string(decay_steps_) + ", decay_rate=" + number(decay_rate_) +
         ", staircase=" + (staircase_ ? "true" : "false") + ")";
}

std::vector<std::string> ExponentialDecay::warnings() const {
  if (decay_rate_ <= 1) return {};
  return {"ExponentialDecay: decay_rate=" + number(decay_rate_) +
          " is above 1, so the rate grows (x" + number(decay_rate_) + " every " +
          std::to_string(decay_steps_) +
          " steps) instead of decaying; a decay needs a "
          "decay_rate in (0, 1)."};
}

} // namespace flotilla::train
