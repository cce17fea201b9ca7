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
#include <utility>
#include <vector>

#include "flotilla/cluster/cluster_spec.h"
#include "flotilla/collective/communicator.h"
#include "flotilla/log.h"
#include "flotilla/strategy/gradient_reducer.h"
#include "flotilla/strategy/input_context.h"

namespace flotilla::strategy {

using collective::ReduceOp;

class Strategy {
 public:
  // `replicas_per_worker` model copies train on each worker (threads, each on its slice of the
  // worker's batch; MirroredStrategy's devices on CPU).
  Strategy(cluster::ClusterSpec cluster, collective::Communicator communicator,
           int replicas_per_worker = 1);
  virtual ~Strategy() = default;

  int num_replicas_in_sync() const { return communicator_.size() * replicas_per_worker_; }
  int replicas_per_worker() const { return replicas_per_worker_; }
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

  // The gradient engine for the trainable parameters of `replicas` (one module per replica on
  // this worker, copies of one model), with this strategy's CommunicationOptions.
  std::unique_ptr<GradientReducer>
  make_gradient_reducer(const std::vector<std::shared_ptr<torch::nn::Module>>& replicas);

  // The start-up consistency check: every worker passes the same named fields (parameter
  // shapes, bucket plan, batch, versions...); if any worker's value differs from the chief's,
  // every worker throws the same ConfigError listing each difference with the worker and both
  // values, instead of hanging in a mismatched collective or silently diverging.
  void check_consistency(const std::vector<std::pair<std::string, std::string>>& fields);

 private:
  static torch::nn::Module& module_of(const std::shared_ptr<torch::nn::Module>& m) { return *m; }
  static torch::nn::Module& module_of(const torch::nn::AnyModule& m) { return *m.ptr(); }
  template <class T> static torch::nn::Module& module_of(const torch::nn::ModuleHolder<T>& m) {
    return *m.ptr();
  }

  cluster::ClusterSpec cluster_;
  collective::Communicator communicator_;
  int replicas_per_worker_;
  Logger log_;
};

// One worker, this machine, `replicas` CPU replicas (threads) reduced locally.
class MirroredStrategy : public Strategy {
 public:
  explicit MirroredStrategy(const collective::CommunicationOptions& options = {},
                            int replicas = 1);
};

// The workers of `cluster`, joined through the chief's rendezvous; blocks until all have joined.
class MultiWorkerMirroredStrategy : public Strategy {
 public:
  explicit MultiWorkerMirroredStrategy(const cluster::ClusterSpec& cluster,
                                       const collective::CommunicationOptions& options = {},
                                       int replicas_per_worker = 1);
};

} // namespace flotilla::strategy
