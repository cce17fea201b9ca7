// PyTorch's SyncBatchNorm (Keras's BatchNormalization(synchronized=True)): in training, the batch
// statistics are those of the whole global batch, over every replica of every worker, in the
// forward pass and in the backward pass, so N workers x B/N train exactly as one worker x B. In
// evaluation it is a plain BatchNorm over its running statistics (no communication), and the
// running statistics stay the same on every replica because every replica updates them with the
// same global values.
//
//   auto net = strategy.scope([] { return train::convert_sync_batchnorm(make_resnet()); });
//
// Each training forward costs one small blocking all-reduce per layer (2C + 1 values), and each
// backward one more (2C): latency, not bandwidth, but 2 per layer per step (bench/batchnorm.sh). An empty slice (a short last batch over many
// replicas, a worker whose input ran out) still takes part, with zero elements.
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/options/batchnorm.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <ostream>
#include <string>

#include "flotilla/strategy/replica_context.h"

namespace flotilla::train {

class SyncBatchNormImpl : public torch::nn::Cloneable<SyncBatchNormImpl> {
 public:
  // Inputs [N, C, ...] of any rank >= 2 (BatchNorm1d/2d/3d), C = options.num_features().
  explicit SyncBatchNormImpl(const torch::nn::BatchNormOptions& options);
  explicit SyncBatchNormImpl(std::int64_t num_features)
      : SyncBatchNormImpl(torch::nn::BatchNormOptions(num_features)) {}

  void reset() override;
  void reset_running_stats();
  void reset_parameters();
  torch::Tensor forward(const torch::Tensor& input);
  void pretty_print(std::ostream& stream) const override;

  // The replica this copy runs on (Model::compile() binds every replica's layers). Unbound, the
  // statistics are this replica's batch alone, as a plain BatchNorm's.
  void set_replica_context(strategy::ReplicaContext context) { context_ = std::move(context); }

  torch::nn::BatchNormOptions options;
  // BatchNorm's names, so checkpoints of either load into the other.
  torch::Tensor weight, bias, running_mean, running_var, num_batches_tracked;

 private:
  strategy::ReplicaContext context_;
};
TORCH_MODULE(SyncBatchNorm);

// A module of your own whose children convert_sync_batchnorm may replace: LibTorch modules call
// their submodules through member holders, which replacing a registered child does not update,
// so such a module says how (set the member, then Module::replace_module).
class ReplaceableChildren {
 public:
  virtual ~ReplaceableChildren() = default;
  virtual void replace_child(const std::string& name,
                             const std::shared_ptr<torch::nn::Module>& module) = 0;
};

// PyTorch's convert_sync_batchnorm: every BatchNorm1d/2d/3d in `module` (inside Sequentials, at
// any depth, and in modules that are ReplaceableChildren) becomes a SyncBatchNorm with the same
// options, weights and running statistics. Returns the converted module (a new Sequential where
// one changed; the modules around the BatchNorms are shared, not copied). ConfigError naming the
// layer for a BatchNorm held by another module, which the conversion cannot reach.
torch::nn::Sequential convert_sync_batchnorm(const torch::nn::Sequential& module);

// Binds every SyncBatchNorm in `module` to `context`; returns how many there are.
int bind_sync_batchnorm(torch::nn::Module& module, const strategy::ReplicaContext& context);

} // namespace flotilla::train
