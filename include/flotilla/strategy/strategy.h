// tf.distribute for LibTorch: a Strategy mirrors a model on every replica and keeps the copies
// identical. MultiWorkerMirroredStrategy spans the workers of a cluster (TF_CONFIG);
// MirroredStrategy is the same on one worker. Build the model inside scope() so every replica
// starts from the chief's parameters; each step, GradientReducer averages the gradients before
// the optimizer runs, so every replica takes the same step.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/types.h>

#include <memory>
#include <string>

#include "flotilla/cluster/cluster_spec.h"
#include "flotilla/collective/communicator.h"
#include "flotilla/log.h"
#include "flotilla/strategy/gradient_reducer.h"
#include "flotilla/strategy/input_context.h"

namespace flotilla::strategy {

using collective::ReduceOp;

class Strategy {
 public:
  Strategy(cluster::ClusterSpec cluster, collective::Communicator communicator);
  virtual ~Strategy() = default;

  int num_replicas_in_sync() const { return communicator_.size(); }
  int num_workers() const { return communicator_.size(); }
  int worker_index() const { return communicator_.rank(); }
  bool is_chief() const { return communicator_.rank() == 0; }
  const cluster::ClusterSpec& cluster() const { return cluster_; }
  collective::Communicator& communicator() { return communicator_; }
  const Logger& log() const { return log_; }
  InputContext input_context() const;

  // Builds the model and makes every replica's parameters and buffers the chief's.
  template <class Build> auto scope(Build&& build) {
    auto model = build();
    mirror(module_of(model));
    return model;
  }
  // Overwrites every parameter and buffer with rank 0's (one broadcast per dtype).
  void mirror(torch::nn::Module& module);

  // The reduction of `value` over all replicas, as a new tensor; every replica calls it.
  torch::Tensor reduce(ReduceOp op, const torch::Tensor& value);

  // The gradient engine for `module`'s trainable parameters, with this strategy's bytes_per_pack.
  GradientReducer make_gradient_reducer(const torch::nn::Module& module);

 private:
  static torch::nn::Module& module_of(const std::shared_ptr<torch::nn::Module>& m) { return *m; }
  static torch::nn::Module& module_of(const torch::nn::AnyModule& m) { return *m.ptr(); }
  template <class T> static torch::nn::Module& module_of(const torch::nn::ModuleHolder<T>& m) {
    return *m.ptr();
  }

  cluster::ClusterSpec cluster_;
  collective::Communicator communicator_;
  Logger log_;
};

// One worker, this machine (one CPU replica; several replicas per worker come later).
class MirroredStrategy : public Strategy {
 public:
  explicit MirroredStrategy(const collective::CommunicationOptions& options = {});
};

// The workers of `cluster`, joined through the chief's rendezvous; blocks until all have joined.
class MultiWorkerMirroredStrategy : public Strategy {
 public:
  explicit MultiWorkerMirroredStrategy(const cluster::ClusterSpec& cluster,
                                       const collective::CommunicationOptions& options = {});
};

} // namespace flotilla::strategy
