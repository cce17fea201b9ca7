// The single-machine performance recipe's training choices, made in one place for `flotilla
// train`, `flotilla tune` and your own program: mixed precision matched to the device, the
// learning rate scaled linearly with the global batch, and a linear warmup then cosine decay
// over the whole run. Each choice comes with a line saying what was chosen and why.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "flotilla/train/mixed_precision.h"
#include "flotilla/train/optimizers.h"

namespace flotilla::train {

struct RecipeOptions {
  // auto (train::fastest_policy for the device), float32, mixed_float16 or mixed_bfloat16.
  std::string precision = "auto";
  std::string optimizer = "sgd"; // sgd, adam or adamw
  double lr = 0;                 // > 0: this rate as given, no scaling
  double base_lr = 0.02;         // per base_batch examples (SGD with momentum 0.9)
  std::int64_t base_batch = 32;
  std::string lr_scaling = "linear"; // linear: peak = base_lr x global batch / base_batch; none
  std::string schedule = "cosine";   // cosine (warmup, then cosine decay) or constant
  int epochs = 1;
  double warmup_epochs = -1;  // -1: one epoch when training for more than one, else none
  int accumulation_steps = 1; // batches per optimizer update
  double momentum = 0.9;      // SGD
  double weight_decay = -1;   // -1: the optimizer's default (0; AdamW 0.004)
  double global_clipnorm = 0; // > 0: OptimizerOptions::global_clipnorm
};

struct Recipe {
  Policy policy = Policy::kFloat32;
  OptimizerOptions optimizer; // with its learning rate schedule
  double peak_lr = 0;
  std::int64_t warmup_steps = 0;
  std::int64_t total_steps = 0;   // optimizer updates over the whole run
  std::vector<std::string> lines; // what was chosen and why, one line each, for the log
};

// The precision policy `precision` names on `device`, and the line saying why.
std::pair<Policy, std::string> choose_precision(const std::string& precision,
                                                const torch::Device& device);

// The recipe for a run of `steps_per_epoch` batches of `global_batch` examples an epoch.
// ConfigError on a name it does not know or a warmup that leaves nothing to decay over.
Recipe make_recipe(const RecipeOptions& options, std::int64_t global_batch,
                   std::int64_t steps_per_epoch, const torch::Device& device);

} // namespace flotilla::train
