#include "flotilla/train/recipe.h"

#include <cmath>
#include <cstdio>
#include <memory>
#include <sstream>

#include "flotilla/error.h"
#include "flotilla/train/schedules.h"

namespace flotilla::train {

std::pair<Policy, std::string> choose_precision(const std::string& precision,
                                                const torch::Device& device) {
  Policy policy = Policy::kFloat32;
  std::string line;
  // Mixed precision, matched to the hardware (the seeds: mixed_float16 on GPU, bf16 where it is
  // native: Ampere and newer GPUs, AVX512-BF16/AMX CPUs).
  if (precision == "auto") {
    policy = fastest_policy(device);
    if (device.is_cuda()) {
      line = policy == Policy::kMixedBFloat16
                 ? "mixed precision: mixed_bfloat16 (this GPU computes bfloat16 natively)"
                 : "mixed precision: mixed_float16 with dynamic loss scaling (this GPU "
                   "predates native bfloat16)";
    } else {
      line = policy == Policy::kMixedBFloat16
                 ? "mixed precision: mixed_bfloat16 (this CPU computes bfloat16 natively)"
                 : "mixed precision: off, float32 (this CPU has no AVX512-BF16/AMX, so "
                   "bfloat16 would be slower; --precision mixed_bfloat16 forces it)";
    }
  } else {
    policy = parse_policy(precision);
    line = "mixed precision: " + to_string(policy) + " (--precision)";
  }
  return {policy, line};
}

namespace {

// NaN and inf are not "unset": every comparison with NaN is false, so an lr of NaN fell through
// to the scaled rate and a weight decay or warmup of NaN to its default, and the run trained.
void check_numbers(const RecipeOptions& a) {
  const auto check = [](const char* name, double value, bool ok, const char* rule) {
    if (std::isfinite(value) && ok) return;
    std::ostringstream seen;
    seen << value;
    throw ConfigError(std::string("make_recipe: RecipeOptions::") + name + " must be " + rule +
                      "; saw " + seen.str());
  };
  check("lr", a.lr, a.lr >= 0, "a finite rate above 0 (or 0: base_lr, scaled)");
  check("base_lr", a.base_lr, a.base_lr > 0 || a.lr > 0, "a finite rate above 0");
  check("warmup_epochs", a.warmup_epochs, a.warmup_epochs >= 0 || a.warmup_epochs == -1,
        "a finite number of epochs at least 0 (or -1: the default)");
  check("weight_decay", a.weight_decay, a.weight_decay >= 0 || a.weight_decay == -1,
        "a finite number at least 0 (or -1: the optimizer's default)");
  check("momentum", a.momentum, a.momentum >= 0 && a.momentum < 1, "in [0, 1)");
  check("global_clipnorm", a.global_clipnorm, a.global_clipnorm >= 0,
        "a finite number at least 0 (0: no clipping)");
}

} // namespace

Recipe make_recipe(const RecipeOptions& a, std::int64_t global_batch, std::int64_t steps_per_epoch,
                   const torch::Device& device) {
  if (a.epochs < 1 || a.accumulation_steps < 1) {
    throw ConfigError("make_recipe: epochs (" + std::to_string(a.epochs) +
                      ") and accumulation steps (" + std::to_string(a.accumulation_steps) +
                      ") must both be at least 1");
  }
  check_numbers(a);
  Recipe r;
  char buf[256];
  auto [policy, precision_line] = choose_precision(a.precision, device);
  r.policy = policy;
  r.lines.push_back(precision_line);
  // Linear learning-rate scaling with the global batch.
  double peak = a.lr;
  if (a.lr > 0) {
    std::snprintf(buf, sizeof buf, "learning rate: %g as given (--lr; no scaling)", a.lr);
  } else if (a.lr_scaling == "linear") {
    peak = linear_scaling(a.base_lr, global_batch, a.base_batch);
    std::snprintf(buf, sizeof buf, "linear LR scaling: %g x %lld / %lld = %g", a.base_lr,
                  static_cast<long long>(global_batch), static_cast<long long>(a.base_batch), peak);
  } else {
    peak = a.base_lr;
    std::snprintf(buf, sizeof buf, "learning rate: %g, not scaled (--lr-scaling none)", a.base_lr);
  }
  r.lines.push_back(buf);
  r.peak_lr = peak;
  r.optimizer.kind = parse_optimizer(a.optimizer);
  r.optimizer.learning_rate = peak;
  if (r.optimizer.kind == OptimizerKind::kSGD) {
    r.optimizer.momentum = a.momentum;
  } else if (r.optimizer.kind == OptimizerKind::kAdamW) {
    r.optimizer.weight_decay = 0.004;
  }
  if (a.weight_decay >= 0) r.optimizer.weight_decay = a.weight_decay;
  r.optimizer.global_clipnorm = a.global_clipnorm;
  // Warmup + cosine decay over the whole run, per optimizer update.
  const std::int64_t total = steps_per_epoch * a.epochs / a.accumulation_steps;
  const double warmup_epochs = a.warmup_epochs >= 0 ? a.warmup_epochs : (a.epochs > 1 ? 1 : 0);
  const auto warmup =
      static_cast<std::int64_t>(warmup_epochs * static_cast<double>(total) / a.epochs);
  r.total_steps = total;
  if (a.schedule == "cosine") {
    r.warmup_steps = warmup;
    if (total - warmup < 1) {
      throw ConfigError("--warmup-epochs " + std::to_string(warmup_epochs) +
                        " leaves no steps to decay over in " + std::to_string(a.epochs) +
                        " epoch(s); lower it or train longer");
    }
    CosineDecayOptions cosine;
    if (warmup > 0) {
      // TF warms up only with a warmup_target: from initial_learning_rate (0) to it.
      cosine.initial_learning_rate = 0;
      cosine.warmup_target = peak;
      cosine.warmup_steps = warmup;
    } else {
      cosine.initial_learning_rate = peak;
    }
    cosine.decay_steps = total - warmup;
    r.optimizer.schedule = std::make_shared<CosineDecay>(cosine);
    std::snprintf(buf, sizeof buf,
                  "schedule: %lld warmup step(s) (%g epoch(s)) to %g, then cosine "
                  "decay over %lld step(s)",
                  static_cast<long long>(warmup), warmup_epochs, peak,
                  static_cast<long long>(total - warmup));
  } else if (a.schedule == "constant") {
    std::snprintf(buf, sizeof buf, "schedule: constant %g", peak);
  } else {
    throw ConfigError("--schedule \"" + a.schedule + "\" is not available; use cosine or constant");
  }
  r.lines.push_back(buf);
  if (a.global_clipnorm > 0) {
    std::snprintf(buf, sizeof buf,
                  "gradient clipping: global norm at most %g, after the all-reduce",
                  a.global_clipnorm);
    r.lines.push_back(buf);
  }
  return r;
}

} // namespace flotilla::train
