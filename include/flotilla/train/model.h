// Keras's Model for a LibTorch module under a Strategy: compile() picks the optimizer, loss and
// metrics, fit() trains with gradients averaged across every replica each step, evaluate()
// measures on a sharded dataset. Loss and metrics are the global values (summed over all
// workers), never one worker's. Only the chief prints progress.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <string>
#include <vector>

#include "flotilla/data/distribute.h"
#include "flotilla/strategy/strategy.h"

namespace flotilla::train {

// torch::optim::SGD's settings.
struct SGD {
  double learning_rate = 0.01;
  double momentum = 0.0;
  bool nesterov = false;
  double weight_decay = 0.0;
};

enum class Loss {
  kSparseCategoricalCrossentropy, // integer labels, logits in (Keras: from_logits=True)
};

struct CompileOptions {
  SGD optimizer;
  Loss loss = Loss::kSparseCategoricalCrossentropy;
  std::vector<std::string> metrics = {"accuracy"}; // "accuracy" is the one available now
  // Apply the optimizer once every K batches, on their summed gradients, with one all-reduce
  // (Keras's gradient_accumulation_steps, DDP's no_sync). An epoch's last partial group is
  // applied at the epoch's end.
  int gradient_accumulation_steps = 1;
};

// One epoch's results, global across workers.
struct EpochLogs {
  int epoch = 0; // 1-based, as Keras prints it
  std::int64_t steps = 0;
  double loss = 0;
  double accuracy = 0;
  double samples_per_s = 0; // global samples ÷ the chief's wall-clock seconds
  double seconds = 0;
  double input_seconds = 0; // of `seconds`, waiting for the input pipeline (input-bound share)
  // This worker's gradient all-reduces over the epoch: time in flight, time the steps waited
  // for them after backward, and the share hidden behind backward.
  double comm_seconds = 0;
  double comm_exposed_seconds = 0;
  double comm_hidden_share = 0;
};

struct History {
  std::vector<EpochLogs> epochs;
};

struct EvalResult {
  double loss = 0;
  double accuracy = 0;
  std::int64_t samples = 0;
};

enum class Verbosity { kAuto = -1, kSilent = 0, kProgressBar = 1, kOneLinePerEpoch = 2 };

struct FitOptions {
  int epochs = 1;
  // Default: one pass over the dataset. Given: that many steps, continuing the same pass
  // across epochs; training stops early (with a warning) if the data runs out.
  std::optional<std::int64_t> steps_per_epoch;
  Verbosity verbose = Verbosity::kAuto; // auto: a bar on a terminal, else one line
  // Where checkpoints go ("" = none): the chief writes ckpt-<epoch>.safetensors after each
  // epoch; the other workers save into temporary directories beside it (checkpoint/).
  std::string model_dir;
  // Called on every worker after each epoch with the global logs.
  std::function<void(const EpochLogs&)> on_epoch_end;
};

class Model {
 public:
  using Forward = std::function<torch::Tensor(const torch::Tensor&)>;

  // A module and its forward, for a replica (copies of the model on one worker).
  using Replica = std::pair<std::shared_ptr<torch::nn::Module>, Forward>;

  // Any module holder whose forward takes and returns one tensor (torch::nn::Sequential, a
  // TORCH_MODULE of your own, ...). Cloneable modules (all of torch::nn) can also be copied
  // for several replicas per worker.
  template <class Holder>
  Model(strategy::Strategy& strategy, Holder holder)
      : Model(strategy, holder.ptr(), forward_of(holder.ptr()),
              [holder]() -> Replica {
                using Impl = typename Holder::ContainedType;
                auto copy = std::dynamic_pointer_cast<Impl>(holder->clone());
                return {copy, forward_of(copy)};
              }) {}
  // `clone` makes another replica (needed only with replicas_per_worker > 1).
  Model(strategy::Strategy& strategy, std::shared_ptr<torch::nn::Module> module, Forward forward,
        std::function<Replica()> clone = {});
  ~Model();

  void compile(const CompileOptions& options);
  // `train` yields global batches: it is distributed with this model's strategy
  // (data::distribute_dataset). Every pass is a new iteration of it (a new shuffle), except with
  // steps_per_epoch, where one pass continues across epochs as in Keras.
  History fit(const data::Dataset& train, const FitOptions& options = {});
  History fit(const data::DistributedDataset& train, const FitOptions& options = {});
  // Loss and accuracy over every element, each counted once (a short last batch included).
  EvalResult evaluate(const data::Dataset& data);
  EvalResult evaluate(const data::DistributedDataset& data);
  torch::Tensor predict(const torch::Tensor& features);

  torch::nn::Module& module() { return *module_; }
  strategy::Strategy& strategy() { return strategy_; }
  // The gradient engine (after compile): bucket plan and communication statistics.
  const strategy::GradientReducer& gradient_reducer() const;

 private:
  template <class Impl> static Forward forward_of(std::shared_ptr<Impl> module) {
    return [module](const torch::Tensor& x) -> torch::Tensor { return module->forward(x); };
  }
  void require_compiled(const char* what) const;
  void check_consistency(const data::DistributedDataset& train, const FitOptions& options);

  strategy::Strategy& strategy_;
  std::shared_ptr<torch::nn::Module> module_;
  Forward forward_;
  std::function<Replica()> clone_;
  std::optional<CompileOptions> compiled_;
  std::vector<Replica> replicas_; // replica 0 is module_ itself
  std::vector<std::unique_ptr<torch::optim::Optimizer>> optimizers_;
  std::unique_ptr<strategy::GradientReducer> reducer_;
  struct Threads;
  std::unique_ptr<Threads> threads_; // runs replicas 1..K-1
};

} // namespace flotilla::train
