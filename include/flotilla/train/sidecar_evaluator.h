// TensorFlow's SidecarEvaluator (tf.keras.utils.SidecarEvaluator): a process beside the training
// cluster that trains nothing and joins no collective. It watches the chief's checkpoint
// directory (ModelCheckpoint's, or any checkpoint::CheckpointManager's), loads each new
// checkpoint into a model of its own, evaluates it on its data, and reports the result: to a
// hook, to TensorBoard scalars in a log directory of its own, and in start()'s return value.
// Like TF's, it evaluates the newest checkpoint each time it looks: a checkpoint replaced by a
// newer one before it was looked at is skipped, never evaluated late.
//
// A checkpoint is evaluated the way the chief evaluated it: under the mixed-precision policy its
// manifest records (checkpoint::CheckpointData::policy), not whatever policy the evaluator's
// model was compiled under, so its numbers equal the chief's Model::evaluate on the same weights.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "flotilla/data/dataset.h"
#include "flotilla/train/mixed_precision.h"
#include "flotilla/train/model.h"

namespace flotilla::train {

// One evaluated checkpoint.
struct SidecarResult {
  std::filesystem::path checkpoint; // "<checkpoint_dir>/ckpt-7"
  std::int64_t epoch = 0;           // epochs completed when it was saved
  std::int64_t step = 0;            // optimizer updates applied when it was saved
  Policy policy = Policy::kFloat32; // the policy it was evaluated under
  EvalResult result;                // loss and each metric, as Model::evaluate reports them
};

struct SidecarEvaluatorOptions {
  // The directory the chief saves its checkpoints into (ModelCheckpointOptions::filepath); the
  // pointer file there names the newest. Required.
  std::filesystem::path checkpoint_dir;
  // TensorBoard event files for the results: "epoch_<key>" scalars (epoch_loss,
  // epoch_accuracy, ...) at the checkpoint's epoch. Empty: none written.
  std::filesystem::path log_dir;
  // How often to look for a new checkpoint while none is there.
  std::chrono::milliseconds poll_interval = std::chrono::milliseconds(500);
  // How long to wait for a new checkpoint (from start(), then from the last one evaluated)
  // before giving up with a TimeoutError: the chief has stopped, or saves elsewhere. The same
  // default as CommunicationOptions::timeout.
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
  // Stop after evaluating a checkpoint of this epoch or later (the training's last epoch,
  // FitOptions::epochs). Unset: this does not end the evaluation.
  std::optional<std::int64_t> last_epoch;
  // Stop after this many evaluations (at least 1). Unset: this does not end the evaluation.
  // With neither set, start() evaluates until `timeout` passes without a new checkpoint.
  std::optional<int> max_evaluations;
  // Evaluate each checkpoint under the policy its manifest records (recompiling the model when
  // it differs from the model's own). false: always the model's compiled policy.
  bool use_checkpoint_policy = true;
  // Called with each result as soon as it is known (print it, log it, append it to a file). An
  // exception from it ends start().
  std::function<void(const SidecarResult&)> on_result;
};

class SidecarEvaluator {
 public:
  // `model` must be compiled (its loss and metrics are what gets measured); its strategy is
  // this process's own (a MirroredStrategy), not the training cluster's. `data` yields batches
  // as Model::evaluate takes them. ConfigError for an empty checkpoint_dir, a poll_interval
  // that is not positive or max_evaluations < 1.
  SidecarEvaluator(Model& model, data::Dataset data, SidecarEvaluatorOptions options);

  // Evaluates each new checkpoint until last_epoch or max_evaluations says to stop, and returns
  // every result in order. TimeoutError when `timeout` passes without a new checkpoint (saying
  // why the last one that could not be read was refused, if any). While the model is recompiled
  // under a checkpoint's policy, the global policy is set to it, then put back.
  std::vector<SidecarResult> start();

 private:
  void use_policy(Policy policy);

  Model& model_;
  data::Dataset data_;
  SidecarEvaluatorOptions options_;
};

} // namespace flotilla::train
