// Keras's losses and metrics as per-example tensors. fit() sums them over a replica's slice and
// the strategy sums the sums over every replica, so a reported loss or metric is the mean over
// the global batch (or the whole evaluation set), never one worker's value. Every metric here is
// such a global mean of a per-example value; a custom Metric is any function giving one.
#pragma once

#include <torch/types.h>

#include <functional>
#include <string>
#include <vector>

namespace flotilla::train {

using Tensors = std::vector<torch::Tensor>;

enum class LossKind {
  kSparseCategoricalCrossentropy, // integer class labels [N]; outputs [N, classes]
  kCategoricalCrossentropy,       // one-hot (or soft) labels [N, classes]
  kBinaryCrossentropy,            // labels in [0, 1], the outputs' shape ([N] or [N, k])
  kMeanSquaredError,              // any shape; the mean over all but the first axis
};

struct LossOptions {
  LossKind kind = LossKind::kSparseCategoricalCrossentropy;
  // Outputs are logits (Keras's from_logits=True): numerically safer than probabilities.
  bool from_logits = true;
  // Keras's label_smoothing for the cross-entropies: targets become (1 - s) * y + s / classes
  // (binary: + s / 2). Also accepted by the sparse loss, as if its labels were one-hot.
  double label_smoothing = 0;
  // Your own loss, in place of `kind` (and of the two options above): any function of a
  // replica's (outputs, labels) giving either one value per example ([N], as Keras's loss
  // functions do) or a scalar, read as the mean over the N examples it was given (a PyTorch loss
  // with reduction "mean", as DDP users write it). Either way fit() minimises and reports the
  // mean over the whole global batch, on every replica and worker. (Metrics' "accuracy" still
  // follows `kind`: sparse labels unless set otherwise.)
  std::function<torch::Tensor(const torch::Tensor& outputs, const torch::Tensor& labels)> custom;
  // A model of several outputs (Signature): the loss of each output (the built-in, or `custom`)
  // against its labels, weighted by loss_weights[o] (Keras's loss_weights; empty: 1 each), and
  // summed per example.
  std::vector<double> loss_weights;
  // Or one loss of all the outputs and all the labels at once, in place of the above: one value
  // per example, or a scalar read as their mean, as `custom`.
  std::function<torch::Tensor(const Tensors& outputs, const Tensors& labels)> custom_outputs;
};

// "sparse_categorical_crossentropy", "categorical_crossentropy", "binary_crossentropy", "mse"
// (or "mean_squared_error"); ConfigError for anything else.
LossKind parse_loss(const std::string& name);
std::string to_string(LossKind kind);
// ConfigError on a label_smoothing outside [0, 1] or a loss weight that is negative or not
// finite.
void validate(const LossOptions& options);

// One loss value per example: float32 (or float64 when the outputs are), shape [N].
torch::Tensor per_example_loss(const LossOptions& options, const torch::Tensor& outputs,
                               const torch::Tensor& labels);
// The same for a model's outputs against their labels (as many of each): custom_outputs, or the
// weighted sum of each output's loss.
torch::Tensor per_example_loss(const LossOptions& options, const Tensors& outputs,
                               const Tensors& labels);

struct Metric {
  std::string name; // the key in logs ("accuracy"; "val_accuracy" after validation)
  // One value per example, shape [N]; the metric is their global mean.
  std::function<torch::Tensor(const torch::Tensor& outputs, const torch::Tensor& labels)>
      per_example;
};

// A built-in metric by its Keras name: "accuracy"/"acc" (which accuracy follows the loss, as in
// Keras), "sparse_categorical_accuracy", "categorical_accuracy", "binary_accuracy",
// "sparse_top_k_categorical_accuracy" (k = 5; or "sparse_top_k_categorical_accuracy@3"),
// "mean_squared_error"/"mse", "mean_absolute_error"/"mae". ConfigError lists them otherwise.
Metric make_metric(const std::string& name, const LossOptions& loss);

} // namespace flotilla::train
