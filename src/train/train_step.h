// Private: the compiled train step — what Model::compile() builds and every step uses: the
// replicas with their optimizers, the gradient engine, jit_compile's CUDA graph where it applies,
// the metrics, the precision and loss scale, and the update counters (Keras's iterations and the
// rows trained). It knows nothing of epochs, callbacks or healing: the fit loop (fit_loop.h) and
// the healer (healer.h) drive it.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "flotilla/data/distribute.h"
#include "flotilla/strategy/replica_context.h"
#include "flotilla/strategy/strategy.h"
#include "flotilla/train/model.h"

namespace flotilla::kernels {
struct CompileReport;
}

namespace flotilla::train::detail {

class CapturedStep;
class ReplicaSet;
class StepTimer;

class TrainStep {
 public:
  // ConfigError for options compile() refuses. `timer` outlives this step (it is the model's).
  TrainStep(strategy::Strategy& strategy, Model::MultiReplica model, Signature signature,
            const std::function<Model::MultiReplica()>& clone, const CompileOptions& options,
            Policy policy, StepTimer& timer);
  ~TrainStep();

  // Runs one batch on every replica and applies the update when due (`micro`: batches
  // accumulated since the last update); returns the batch's sums: per-example loss, each metric
  // and the example count summed (float64, on the device).
  torch::Tensor run(const data::ReplicaBatch& batch, int& micro);
  // Finishes the reduction, then applies the update (an epoch's last, partial accumulation).
  void apply_gradients();
  // Zeros shaped as run()'s sums, on replica 0's device.
  torch::Tensor zero_sums() const;
  // Loss and metric sums (the count last) into logs as means.
  void set_means(Logs& logs, const double* sums, double count) const;
  // Model::mirror_buffers: the buffers averaged over every replica of every worker, when a step
  // ran since the last time.
  void mirror_buffers();
  // Whether a mirror is due must be the same on every worker (it is a collective): after a new
  // generation every member counts as having trained.
  void mark_trained() { buffers_dirty_ = true; }
  // The group changed (regroup or admission): the strategy adopts the new generation, and this
  // step gets a fresh gradient engine (the old one's buffers may still be on the abandoned
  // group's wire) and replica contexts on the new group. The one place a new group reaches the
  // step.
  void adopt_group();

  // The update counters and loss scale (no epoch or position: the fit loop's).
  TrainingState counters() const;
  void restore_counters(const TrainingState& state);
  // Elastic fits, on every starting member (not a joiner: it gets the id with the counters):
  // the training's id (TrainingState::training) is rank 0's, drawn there when no backup gave
  // one. Collective.
  void agree_training(collective::Communicator& comm);
  const std::string& training() const { return training_; }
  std::int64_t generation_base() const { return generation_base_; }
  // A failed step's rows are dropped: it is redone.
  void drop_partial_update() { update_rows_ = 0; }
  // Elastic keeping the per-replica batch: the global batch the learning rate is set for (each
  // update's rate scales by its rows over it); 0: every update has the full global batch.
  // Restored counters that did not count trained rows count them as whole global batches.
  void begin_fit(std::int64_t lr_global_rows, std::int64_t global_rows);

  double learning_rate() const; // the next update's
  void set_learning_rate(double learning_rate);
  std::int64_t iterations() const { return iterations_; }
  bool last_step_finite() const { return last_step_finite_; }
  void set_check_finite(bool on) { check_finite_ = on; }

  strategy::Strategy& strategy() const { return strategy_; }
  const CompileOptions& options() const { return options_; }
  ReplicaSet& replicas() const { return *replicas_; }
  const torch::Device& device() const;
  // The model's own forward (replica 0 as given; the replicas' may view a 4-D input
  // channels-last first): evaluate() and predict() call it.
  const Model::MultiForward& model_forward() const { return model_forward_; }
  const Signature& signature() const { return signature_; }
  const strategy::GradientReducer& reducer() const { return *reducer_; }
  CapturedStep* captured() const { return captured_.get(); }
  const std::vector<Metric>& metrics() const { return metrics_; }
  Policy policy() const { return policy_; }
  bool channels_last() const { return channels_last_; }
  const std::optional<LossScale>& loss_scale() const { return loss_scale_; }
  int sync_batchnorm_layers() const { return sync_batchnorm_layers_; }
  // What the compile step rewrote (CompileOptions::jit_compile on the CPU), or null.
  const kernels::CompileReport* kernel_rewrites() const { return kernel_rewrites_.get(); }
  // The per-example loss of `outputs` against e's labels, weighted by its sample weights when
  // it has them (see Signature).
  torch::Tensor per_example(const Tensors& outputs, const data::Element& e) const;
  // Sums of the per-example loss, the metrics and the count (float64, on the device).
  torch::Tensor batch_sums(const torch::Tensor& per_example_loss, const Tensors& outputs,
                           const data::Element& e) const;
  // The forward's outputs for e's inputs (replica r), checked against the signature.
  Tensors forward(int r, const data::Element& e) const;

 private:
  std::int64_t schedule_step() const {
    return lr_global_rows_ > 0 ? trained_rows_ / lr_global_rows_ : iterations_;
  }
  // The batch split over the replicas, each part on its replica's device.
  std::vector<data::Element> split(const data::ReplicaBatch& batch) const;
  // The step as a CUDA graph replay; nullopt when it ran eagerly instead (run() goes on).
  std::optional<torch::Tensor> replay(const data::Element& part, double loss_factor);
  // Forward and backward on replica r; its sums into results[r].
  void replica_body(int r, const data::Element& e, double loss_factor,
                    std::vector<torch::Tensor>& results);
  // Unscales and checks the reduced gradients, then steps the optimizers (or skips the step).
  void apply_update();
  void log_compile(const std::string& why_no_graph) const;

  strategy::Strategy& strategy_;
  StepTimer& timer_;
  CompileOptions options_;
  Model::MultiForward model_forward_;
  Signature signature_;
  std::unique_ptr<ReplicaSet> replicas_;
  std::unique_ptr<strategy::GradientReducer> reducer_;
  std::unique_ptr<CapturedStep> captured_;
  std::unique_ptr<kernels::CompileReport> kernel_rewrites_;
  std::vector<strategy::ReplicaContext> replica_contexts_; // one per replica (SyncBatchNorm)
  int sync_batchnorm_layers_ = 0;                          // per replica
  bool buffers_dirty_ = false; // a step ran since the buffers were last mirrored
  std::vector<Metric> metrics_;
  std::vector<int> metric_outputs_; // the output each metric reads
  Policy policy_;
  bool channels_last_ = false;
  std::optional<LossScale> loss_scale_;
  std::int64_t iterations_ = 0;
  std::int64_t generation_base_ = 0; // TrainingState::generation_base
  std::string training_;             // TrainingState::training
  std::int64_t trained_rows_ = 0;    // rows of the global batches of those updates (-1: unknown)
  std::int64_t update_rows_ = 0;     // rows of the update being accumulated
  std::int64_t lr_global_rows_ = 0;
  bool check_finite_ = false; // a callback needs last_step_finite()
  bool last_step_finite_ = true;
};

// `t` on `device`: itself when it is there; asynchronous from pinned host memory.
torch::Tensor on_device(const torch::Tensor& t, const torch::Device& device);
// (inputs..., labels...[, weights]) as `signature` lays them out, checked: DataError otherwise.
void check_element(const data::Element& e, const Signature& signature);
// The forward gave as many outputs as `signature` says, each defined: ConfigError otherwise.
void check_outputs(const Tensors& outputs, const Signature& signature);
// An element's rows (its first label's).
inline std::int64_t rows_of(const data::Element& e, const Signature& signature) {
  return e[static_cast<std::size_t>(signature.inputs)].size(0);
}
// A float64 tensor's values on the host.
std::vector<double> to_host(const torch::Tensor& sums);

} // namespace flotilla::train::detail
