// The optimizers Keras users pick by name (SGD with momentum/Nesterov, Adam, AdamW), built on
// LibTorch's own, with a learning rate that is a constant or a schedule evaluated at every
// update. Keras's defaults are kept (Adam's epsilon is 1e-7, AdamW's weight decay 0.004).
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "flotilla/train/schedules.h"

namespace flotilla::train {

enum class OptimizerKind { kSGD, kAdam, kAdamW };

struct OptimizerOptions {
  OptimizerKind kind = OptimizerKind::kSGD;
  double learning_rate = 0.01; // used when `schedule` is empty
  // Evaluated at every update with the count of updates applied so far (Keras's iterations).
  std::shared_ptr<const LearningRateSchedule> schedule;
  double momentum = 0.0; // SGD
  bool nesterov = false; // SGD
  // SGD and Adam: L2 added to the gradient (LibTorch's weight_decay); AdamW: decoupled decay.
  double weight_decay = 0.0;
  double beta_1 = 0.9;   // Adam, AdamW
  double beta_2 = 0.999; // Adam, AdamW
  double epsilon = 1e-7; // Adam, AdamW (Keras's default; LibTorch's is 1e-8)
  bool amsgrad = false;  // Adam, AdamW
  // > 0: Keras's global_clipnorm. Before each update the gradients of every parameter are scaled
  // together so that their global L2 norm is at most this (PyTorch's clip_grad_norm_). They are
  // clipped after the all-reduce, so it is the norm of the whole global batch's gradient, the
  // same on every replica and worker, as DDP users clip after backward. 0: no clipping.
  double global_clipnorm = 0;
  // Your own optimizer, in place of `kind` and the fields that configure it: called once per
  // replica with that replica's module, it returns any torch::optim::Optimizer over the module's
  // parameters (all of them or some), with parameter groups if you like (say no weight decay for
  // biases, or a smaller rate for a pretrained part), as a PyTorch user builds one. The first
  // group's learning rate as you built it is the model's learning rate (`learning_rate` is not
  // used; a `schedule` still replaces it), and every other group keeps its rate's ratio to the
  // first group's whenever the rate changes (a schedule, a LearningRateScheduler, an elastic
  // fit's scaling), as PyTorch's LambdaLR scales every group. global_clipnorm clips it as it
  // clips the built-ins. Checkpoints, backups and the elastic state transfer keep its state: SGD,
  // Adam and AdamW by name (as their built-in forms), any other in LibTorch's own archive
  // (torch::optim::Optimizer::save/load, which LibTorch's RMSprop and Adagrad implement and an
  // optimizer of your own must too). LBFGS, which steps with a closure, cannot be used.
  std::function<std::unique_ptr<torch::optim::Optimizer>(torch::nn::Module& replica)> custom;

  static OptimizerOptions sgd(double learning_rate, double momentum = 0, bool nesterov = false);
  static OptimizerOptions adam(double learning_rate = 0.001);
  static OptimizerOptions adamw(double learning_rate = 0.001, double weight_decay = 0.004);

  // The rate for update `step`.
  double learning_rate_at(std::int64_t step) const;
  // "SGD(learning_rate=0.04, momentum=0.9)"-style, for logs.
  std::string describe() const;
};

// "sgd", "adam", "adamw"; ConfigError otherwise.
OptimizerKind parse_optimizer(const std::string& name);

// ConfigError naming the first bad field and its value.
void validate(const OptimizerOptions& options);

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerOptions& options,
                                                        std::vector<torch::Tensor> parameters);

// A replica's optimizer: `options.custom(replica)` when set, checked (ConfigError when it returns
// nothing, is an LBFGS, has no parameter group, updates a tensor that is not one of the replica's
// parameters, or gives its first group a rate that is not positive), else the built-in over the
// replica's parameters.
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerOptions& options,
                                                        torch::nn::Module& replica);

// Sets every parameter group's learning rate.
void set_learning_rate(torch::optim::Optimizer& optimizer, double learning_rate);

// Each group's learning rate over the first group's, as `optimizer` holds them now.
std::vector<double> learning_rate_ratios(const torch::optim::Optimizer& optimizer);
// Sets group g's learning rate to `learning_rate` * ratios[g].
void set_learning_rate(torch::optim::Optimizer& optimizer, double learning_rate,
                       const std::vector<double>& ratios);

} // namespace flotilla::train
