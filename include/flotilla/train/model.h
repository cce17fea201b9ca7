// Keras's Model for a LibTorch module under a Strategy: compile() picks the optimizer, loss and
// metrics, fit() trains with gradients averaged across every replica each step, evaluate()
// measures on a sharded dataset. Loss and metrics are the global values (summed over all
// workers), never one worker's. Only the chief prints progress.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "flotilla/data/distribute.h"
#include "flotilla/strategy/replica_context.h"
#include "flotilla/strategy/strategy.h"
#include "flotilla/train/logs.h"
#include "flotilla/train/losses.h"
#include "flotilla/train/mixed_precision.h"
#include "flotilla/train/optimizers.h"
#include "flotilla/train/step_phases.h"
#include "flotilla/train/training_state.h"

namespace flotilla::kernels {
struct CompileReport;
} // namespace flotilla::kernels

namespace flotilla::train {

class Callback;
class CallbackList;
namespace detail {
class Healer;
class StepTimer;
class TrainStep;
struct FitProgress;
} // namespace detail

// Keras's compile() arguments.
struct CompileOptions {
  OptimizerOptions optimizer; // SGD(0.01) unless set; a schedule drives its learning rate
  LossOptions loss;           // sparse categorical cross-entropy from logits
  std::vector<std::string> metrics = {"accuracy"}; // Keras names (see make_metric)
  std::vector<Metric> custom_metrics;              // your own per-example means
  // A model of several outputs (Signature): the metrics of each output, by Keras name, reported
  // as "output_<o>_<name>" (Keras's per-output lists). Unset: `metrics` and `custom_metrics`
  // for every output.
  std::optional<std::vector<std::vector<std::string>>> output_metrics;
  // Keras runs this many steps per call of its compiled function; here the steps are C++
  // already, so it sets how often batch-level callbacks (and the progress bar) run.
  int steps_per_execution = 1;
  // Keras's jit_compile. Unset is Keras's "auto": on the CPU, the compile step
  // (flotilla/kernels/compile.h) rewrites the model so flotilla's kernels can run its layers,
  // each where it measures faster than ATen's (flotilla/kernels/choice.h), before the replicas
  // are copied from it; on CUDA nothing. true: that on the CPU; on CUDA (one GPU per worker, no
  // gradient accumulation), after 3 eager warm-up steps, the step's forward, backward and
  // gradient all-reduce are captured once in a CUDA graph and replayed for every batch of the
  // same shapes (others run eagerly); the optimizer and the loss scale's check stay eager;
  // compile() says in one line why where it cannot. false: neither, the model runs as written.
  std::optional<bool> jit_compile;
  // Apply the optimizer once every K batches, on their summed gradients, with one all-reduce
  // (Keras's gradient_accumulation_steps, DDP's no_sync). An epoch's last partial group is
  // applied at the epoch's end.
  int gradient_accumulation_steps = 1;
  // Dynamic loss scaling (Keras's LossScaleOptimizer). Default: on under mixed_float16, off
  // otherwise; set it to force either.
  std::optional<LossScaleOptions> loss_scale;
  // Keep the replicas' 4-D parameters and buffers, and so the activations of their 2-D
  // convolutions, channels-last (NHWC in memory; shapes stay NCHW): oneDNN's and cuDNN's faster
  // kernels. Unset: on for a model with 2-D convolutions, off otherwise. Checkpoints are written
  // in NCHW order either way. See Model::channels_last().
  std::optional<bool> channels_last;
};

// Why CompileOptions::jit_compile cannot capture the step in a CUDA graph under `strategy` with
// `gradient_accumulation_steps` (what compile() says when it has no effect); "" when it can.
std::string why_no_captured_step(strategy::Strategy& strategy, int gradient_accumulation_steps);

// Why shares by speed (FitOptions::balance_shares_every) cannot divide `train`'s global batches
// under `strategy`: an elastic group keeping the per-replica batch, an input not sharded by DATA,
// or CUDA replicas; "" when they can. fit() refuses them there with this reason, and the advice
// (FitOptions::advise_shares_every) stays silent.
std::string why_no_shares_by_speed(const strategy::Strategy& strategy,
                                   const data::DistributedDataset& train);

// Where a model of several inputs or outputs finds them in a training element (Keras's
// Model(inputs=[...], outputs=[...]) over a dataset of ((x1, x2), (y1, y2)); here an element is
// flat): its first `inputs` components are the forward's inputs, the next `outputs` are the
// labels, one per output in the forward's order, and one more, if there is one, the sample
// weights. The default is (features, labels[, weights]).
struct Signature {
  int inputs = 1;
  int outputs = 1;
};

enum class Verbosity { kAuto = -1, kSilent = 0, kProgressBar = 1, kOneLinePerEpoch = 2 };

struct FitOptions {
  int epochs = 1;
  int initial_epoch = 0; // epochs already done (Keras): training runs epochs initial+1..epochs
  // Default: one pass over the dataset. Given: that many steps, continuing the same pass
  // across epochs; training stops early (with a warning) if the data runs out.
  std::optional<std::int64_t> steps_per_epoch;
  // Evaluated after every validation_freq-th epoch; adds val_loss and val_<metric> to the logs.
  std::optional<data::Dataset> validation_data;
  int validation_freq = 1;
  std::vector<std::shared_ptr<Callback>> callbacks;
  Verbosity verbose = Verbosity::kAuto; // auto: a bar on a terminal, else one line per epoch
  // Shares by speed, measured (--shares auto): every that many steps the workers compare their
  // compute time per row (forward and backward, not the waits for each other) and the global
  // batch is divided
  // anew in proportion to speed (Strategy::set_shares), damped so that noise does not move it;
  // the input goes on from the same position, so every sample is still trained on once per
  // epoch. 0: off (the strategy's shares stay). In an elastic group the shares go back to equal
  // at each new generation and are measured again. The log says each new division and how much
  // faster a step's compute is than with equal shares, as measured.
  std::int64_t balance_shares_every = 0;
  // Without balance_shares_every: the same measurement every that many steps, changing nothing;
  // where dividing by speed would make a step's compute 10% faster or more, the chief says so
  // once (what --shares auto would gain, `flotilla train`'s default with equal shares). 0: off.
  std::int64_t advise_shares_every = 0;
  // With balance_shares_every: a worker whose smoothed speed stays below this fraction of the
  // median worker's at two reports in a row is a straggler. In an elastic group it leaves (it
  // throws Straggler, saying why) and the others go on without it, as when a hung member is
  // expelled; its restart rejoins and is measured again. Outside elastic mode the chief warns
  // once and the worker keeps its small share. 0: never.
  double straggler_floor = 0.1;
};

class Model {
 public:
  using Forward = std::function<torch::Tensor(const torch::Tensor&)>;

  // A module and its forward, for a replica (copies of the model on one worker).
  using Replica = std::pair<std::shared_ptr<torch::nn::Module>, Forward>;

  // A forward of several inputs and outputs (see Signature), and a module with it.
  using MultiForward = std::function<Tensors(const Tensors&)>;
  using MultiReplica = std::pair<std::shared_ptr<torch::nn::Module>, MultiForward>;

  // Any module holder whose forward takes and returns one tensor (torch::nn::Sequential, a
  // TORCH_MODULE of your own, ...). Cloneable modules (all of torch::nn) can also be copied
  // for several replicas per worker.
  template <class Holder>
  Model(strategy::Strategy& strategy, Holder holder)
      : Model(strategy, holder.ptr(), forward_of(holder.ptr()), [holder]() -> Replica {
          using Impl = typename Holder::ContainedType;
          auto copy = std::dynamic_pointer_cast<Impl>(holder->clone());
          return {copy, forward_of(copy)};
        }) {}
  // `clone` makes another replica (needed only with replicas_per_worker > 1).
  Model(strategy::Strategy& strategy, std::shared_ptr<torch::nn::Module> module, Forward forward,
        std::function<Replica()> clone = {});
  // A model of `signature.inputs` inputs and `signature.outputs` outputs: `forward` gets the
  // inputs in the element's order and returns the outputs (TorchScript: torchscript_forward()).
  // Every built-in loss applies to each output against its labels, and the losses are summed
  // (weighted by LossOptions::loss_weights); each metric is reported for each output, as
  // "output_<o>_<metric>". ConfigError when a count is below 1.
  Model(strategy::Strategy& strategy, std::shared_ptr<torch::nn::Module> module,
        MultiForward forward, Signature signature, std::function<MultiReplica()> clone = {});
  ~Model();

  // Reads the global mixed-precision policy (set_global_policy) as Keras does.
  void compile(const CompileOptions& options);
  // `train` yields global batches: it is distributed with this model's strategy
  // (data::distribute_dataset). Every pass is a new iteration of it (a new shuffle), except with
  // steps_per_epoch, where one pass continues across epochs as in Keras.
  History fit(const data::Dataset& train, const FitOptions& options = {});
  History fit(const data::DistributedDataset& train, const FitOptions& options = {});
  // Loss and metrics over every element, each counted once (a short last batch included),
  // global across workers. Elastic, outside fit: a member's failure heals, and the evaluation
  // runs again on the data split among the workers there are.
  EvalResult evaluate(const data::Dataset& data);
  EvalResult evaluate(const data::DistributedDataset& data);
  // The model's outputs for `features` (this worker alone; no collective).
  torch::Tensor predict(const torch::Tensor& features);
  // Keras's predict over a dataset of (features[, ...]) batches, across workers like evaluate():
  // each worker runs its share of every batch, and every worker returns the outputs of every
  // element, in the dataset's order (with FILE sharding or per-worker pipelines: batch by batch,
  // each batch's outputs in worker order). A collective; elastic, outside fit, healed as
  // evaluate() is.
  torch::Tensor predict(const data::Dataset& data);
  torch::Tensor predict(const data::DistributedDataset& data);
  // predict() for a model of several inputs or outputs (the single-tensor forms refuse one):
  // every output, in the forward's order. A dataset's elements hold the inputs first.
  Tensors predict_outputs(const Tensors& inputs);
  Tensors predict_outputs(const data::Dataset& data);
  Tensors predict_outputs(const data::DistributedDataset& data);
  const Signature& signature() const { return signature_; }
  // The buffers (BatchNorm's running statistics) as TF keeps them: each replica updates its own
  // from its own batches, and where they are read they are the mean over every replica of every
  // worker (TF's ON_READ variables with MEAN aggregation). fit() does this at every epoch's end,
  // before a checkpoint or backup is written and before it returns; evaluate() and predict()
  // before they run. A callback of your own that reads buffers mid-epoch calls it first, on every
  // worker (a collective). No-op when nothing trained since the last time; integer buffers
  // (num_batches_tracked) take the largest value.
  void mirror_buffers();

  torch::nn::Module& module() { return *module_; }
  const torch::nn::Module& module() const { return *module_; }
  // This worker's replicas of the module (after compile), the model itself first (TF's
  // experimental_local_results of a mirrored model).
  std::vector<std::shared_ptr<torch::nn::Module>> local_replicas() const;
  strategy::Strategy& strategy() { return strategy_; }
  const CompileOptions& compile_options() const;
  Policy policy() const; // float32 before compile()
  // Whether compile() keeps the replicas channels-last (CompileOptions::channels_last).
  bool channels_last() const;
  // What compile()'s compile step rewrote (CompileOptions::jit_compile on the CPU), or null
  // where it did not run.
  const kernels::CompileReport* kernel_rewrites() const;
  // The gradient engine (after compile): bucket plan and communication statistics.
  const strategy::GradientReducer& gradient_reducer() const;
  // Replica 0's optimizer (every replica's holds the same state).
  torch::optim::Optimizer& optimizer();
  // Every replica's, replica 0's first (restoring a checkpoint loads them all).
  std::vector<torch::optim::Optimizer*> optimizers();
  // The learning rate of the next update (an elastic fit keeping the per-replica batch scales it
  // by the members there are over the full cluster's workers).
  double learning_rate() const;
  // Replaces a constant learning rate (LearningRateScheduler); ConfigError under a schedule.
  void set_learning_rate(double learning_rate);
  // Keras's model.stop_training: a callback sets it to end fit() after the current step (batch
  // callbacks) or epoch. Batch-level stops must come from values that are the same on every
  // worker (as TerminateOnNaN's do); fit() agrees on epoch-level stops itself.
  bool stop_training = false;
  // Whether the last step's all-reduced gradients were finite (the same on every worker).
  bool last_step_finite() const;
  // Optimizer updates applied so far (Keras's iterations), and the epoch in progress (0-based):
  // cheap, for per-batch callbacks.
  std::int64_t iterations() const;
  int current_epoch() const;
  // The timeline: while on, fit() keeps every step's phase spans (and each gradient bucket's
  // all-reduce) for take_step_traces(), up to `max_steps` steps. It lasts one fit (set it before
  // fit() or in a callback's on_train_begin; fit() turns it off when it ends). Off by default; the
  // per-epoch phase sums in EpochLogs are always kept (a few clock reads a step). On CUDA, tracing
  // synchronises the device at each phase boundary, so the spans are the kernels' real times.
  void set_step_tracing(bool on, std::int64_t max_steps = 10000);
  std::vector<StepTrace> take_step_traces();
  // Asks this model's running (or next) fit to stop for preemption, as SIGTERM does for every fit
  // of the process (preemption.h); only a fit with a callback that handles preemption
  // (BackupAndRestore) acts on it.
  void request_preemption() noexcept { preemption_requested_ = true; }
  // Where training stands; inside fit() it includes the input's position (serialising the
  // iterator: not for every step).
  TrainingState training_state() const;
  // In an elastic fit, the generation that decides this worker's updates, counted over the
  // training's runs (the fencing token its saves and log lines carry); -1 outside elastic fits.
  std::int64_t generation() const;
  // In an elastic fit, the training's id (TrainingState::training: drawn at its start, kept by a
  // resume and given to a joiner), which fences its saves; empty before one.
  std::string training_id() const;
  // Makes the next (or the starting) fit() continue from `state`: optimizer step count, loss
  // scale, epoch, step and input position. Weights and optimizer state are restored separately.
  void restore_training_state(const TrainingState& state);

  // Keras's model.save for what C++ can save (the architecture is your code, or a TorchScript
  // file): the weights and buffers, the optimizer's state, its update count and loss scale, as a
  // verified checkpoint (safetensors + a manifest of SHA-256s) in `directory`, made if absent,
  // as "<directory>/model-<updates>" with TF's "checkpoint" pointer. Saving again replaces the
  // previous save atomically; nothing else in `directory` is touched. Collective: every worker
  // calls it (elastic: the chief writes alone). After compile(). Returns the chief's path.
  std::filesystem::path save(const std::filesystem::path& directory);
  // Loads what save() wrote into this compiled model of the same architecture: weights into
  // every replica, the optimizer's state, its update count (the schedule goes on from there)
  // and loss scale. The next fit starts at its initial_epoch as you give it, with a fresh pass
  // of its input. CheckpointError when nothing there verifies, or when it is another model's.
  void load(const std::filesystem::path& directory);

 private:
  template <class Impl> static Forward forward_of(std::shared_ptr<Impl> module) {
    return [module](const torch::Tensor& x) -> torch::Tensor { return module->forward(x); };
  }
  void require_compiled(const char* what) const;
  void require_single(const char* what) const; // one input and one output
  // evaluate() and predict(): the buffers mirrored, then `pass` over `data`. Elastic, outside
  // fit: a member's failure heals, and the pass runs again on the data split among the workers
  // there are (inside fit, fit heals).
  template <class Result>
  Result collective_pass(const data::DistributedDataset& data,
                         const std::function<Result(const data::DistributedDataset&)>& pass);

  strategy::Strategy& strategy_;
  std::shared_ptr<torch::nn::Module> module_;
  MultiForward forward_;
  Signature signature_;
  std::function<MultiReplica()> clone_;
  std::unique_ptr<detail::StepTimer> timer_;      // the steps' phases (and the timeline)
  std::unique_ptr<detail::FitProgress> progress_; // where the running (or last) fit stands
  // What compile() built: the train step and, over it, the healer (elastic groups).
  std::unique_ptr<detail::TrainStep> step_;
  std::unique_ptr<detail::Healer> healer_;
  std::optional<TrainingState> resume_; // for the next fit (restore_training_state)
  std::atomic<bool> preemption_requested_{false};
};

} // namespace flotilla::train
