// tf.distribute for LibTorch: a Strategy mirrors a model on every replica and keeps the copies
// identical. MultiWorkerMirroredStrategy spans the workers of a cluster (TF_CONFIG);
// MirroredStrategy is the same on one worker. Build the model inside scope() so every replica
// starts from the chief's parameters; each step, GradientReducer averages the gradients before
// the optimizer runs, so every replica takes the same step.
//
// Devices: each worker runs one replica per device. By default that is every visible CUDA device
// (CUDA_VISIBLE_DEVICES selects them), or one CPU replica where there is none, as Keras's
// MirroredStrategy() takes every GPU; an explicit list picks devices, and several CPU "devices"
// are replicas on threads.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/types.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "flotilla/cluster/cluster_spec.h"
#include "flotilla/cluster/input_context.h"
#include "flotilla/collective/communicator.h"
#include "flotilla/log.h"
#include "flotilla/strategy/gradient_reducer.h"

namespace flotilla::collective {
class ElasticGroup;
} // namespace flotilla::collective

namespace flotilla::strategy {

using cluster::InputContext;
using collective::ReduceOp;

// The CUDA devices this process sees (CUDA_VISIBLE_DEVICES renumbers them from cuda:0), or
// {cpu} where there is none.
std::vector<torch::Device> visible_devices();
// `replicas` replicas: 0 means every visible device; K > 0 the first K visible CUDA devices, or K
// CPU replicas (threads) where no CUDA device is visible. ConfigError for more GPUs than there are.
std::vector<torch::Device> default_devices(int replicas = 0);
// Worker `local_rank` of `local_workers` on this host: its share of the visible GPUs (an even
// split, so workers never share one while there are enough; with fewer GPUs than workers,
// GPU local_rank % GPUs), or one CPU replica where there is none.
std::vector<torch::Device> local_share_of_devices(int local_rank, int local_workers);
// "auto" (default_devices()), "cpu", "cuda" (every visible GPU), or a comma-separated list such as
// "cuda:0,cuda:1" or "cpu,cpu". ConfigError naming the bad part and what is visible.
std::vector<torch::Device> parse_devices(const std::string& text);
// Checks a replica device list: not empty, all CPU or all CUDA, every CUDA device visible and
// listed once. ConfigError otherwise.
void check_devices(const std::vector<torch::Device>& devices);

// Elastic mode (collective/elastic.h): a worker that fails is dropped and the others go on in a
// new group, Model::fit healing where it stands; a restarted worker rejoins from a live peer's
// memory. It needs a rendezvous outside the workers (FLOTILLA_RENDEZVOUS, `flotilla rendezvous`
// or `flotilla launch --elastic`) and runs one replica per worker.
struct ElasticOptions {
  bool enabled = false;
  // What stays when the members change: kGlobal (the default) keeps the global batch and the
  // learning rate, each member's batch growing as the group shrinks; kPerReplica keeps each
  // member's batch (the global batch over the full cluster's workers) and scales the learning
  // rate linearly with the step's rows (Goyal et al.'s rule, applied per step).
  enum class Batch { kGlobal, kPerReplica };
  Batch batch = Batch::kGlobal;
};

class Strategy {
 public:
  // One replica per entry of `devices` on each worker (replicas on one worker run on threads,
  // each on its slice of the worker's batch).
  Strategy(cluster::ClusterSpec cluster, collective::Communicator communicator,
           std::vector<torch::Device> devices);
  // `replicas_per_worker` CPU replicas, whatever GPUs there are.
  Strategy(cluster::ClusterSpec cluster, collective::Communicator communicator,
           int replicas_per_worker = 1);
  // An elastic group's strategy (MultiWorkerMirroredStrategy with ElasticOptions::enabled
  // builds it): one replica, on `devices`' only entry; `batch` says what stays when the members
  // change.
  Strategy(cluster::ClusterSpec cluster, std::shared_ptr<collective::ElasticGroup> group,
           std::vector<torch::Device> devices, ElasticOptions::Batch batch);
  virtual ~Strategy() = default;

  int num_replicas_in_sync() const { return communicator_.size() * replicas_per_worker(); }
  int replicas_per_worker() const { return static_cast<int>(devices_.size()); }
  // Replica r's device on this worker; the model built in scope() lives on devices().front().
  const std::vector<torch::Device>& devices() const { return devices_; }
  int num_workers() const { return communicator_.size(); }
  int worker_index() const { return communicator_.rank(); }
  bool is_chief() const { return communicator_.rank() == 0; }
  const cluster::ClusterSpec& cluster() const { return cluster_; }
  collective::Communicator& communicator() { return communicator_; }
  const Logger& log() const { return log_; }
  InputContext input_context() const;
  // Shares by speed: worker w takes shares[w] / sum of each global batch (InputContext::shares)
  // in the datasets distributed with input_context() from now on; empty: equal shares.
  // ConfigError for a count other than num_workers(), a weight outside 1 to 2^20, or an elastic
  // group keeping the per-replica batch. An elastic group goes back to equal shares at every
  // new generation (its members changed); FitOptions::balance_shares_every measures them again.
  void set_shares(std::vector<std::int64_t> shares);
  const std::vector<std::int64_t>& shares() const { return shares_; }

  // Builds the model, puts it on the first replica device and makes its parameters and buffers
  // the chief's. (Model::compile() makes the other replicas' copies on their devices.)
  template <class Build> auto scope(Build&& build) {
    auto model = build();
    module_of(model).to(devices_.front());
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

  // Elastic mode (ElasticOptions::enabled): this worker's membership, generation by generation;
  // null otherwise.
  collective::ElasticGroup* elastic() const { return elastic_.get(); }
  // A worker that joined a group already training (restarted after a failure): it gets the
  // weights and the rest of the training state from a live peer when fit starts, so scope()
  // does not mirror and fit makes none of its start-up agreements.
  bool joining() const { return joining_; }
  void finish_joining() { joining_ = false; }
  // After the membership changed (ElasticGroup::regroup or admit): the current generation's
  // group becomes this strategy's communicator; ranks, sizes and the chief follow it.
  void adopt_generation();

  // Whether checkpoints are saved by every worker together (a collective save, with a fixed
  // membership) rather than by the chief alone (elastic: a collective is one a worker joining
  // or leaving mid-fit could not take part in).
  bool saves_collectively() const { return !elastic_; }
  // The group a checkpoint save goes through: this strategy's communicator when saves are
  // collective; otherwise a group of one for the chief (made on first use, owned here) and
  // nullptr for the other members, which do not save.
  collective::Communicator* saving_group();

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
  std::vector<torch::Device> devices_;
  Logger log_;
  std::shared_ptr<collective::ElasticGroup> elastic_;
  ElasticOptions::Batch elastic_batch_ = ElasticOptions::Batch::kGlobal;
  std::vector<std::int64_t> shares_; // set_shares; empty: equal
  bool joining_ = false;
  std::shared_ptr<collective::Communicator> saving_alone_; // saving_group()'s group of one
};

// One worker, this machine: a replica on each of `devices`, reduced locally.
class MirroredStrategy : public Strategy {
 public:
  // `replicas` as default_devices(): 0, every visible GPU (or the CPU).
  explicit MirroredStrategy(const collective::CommunicationOptions& options = {}, int replicas = 0);
  explicit MirroredStrategy(std::vector<torch::Device> devices,
                            const collective::CommunicationOptions& options = {});
};

// The workers of `cluster`, joined through the chief's rendezvous; blocks until all have joined.
// Each worker runs a replica on each of its devices. With `elastic.enabled` the workers join an
// elastic group instead (ElasticOptions above), one replica each.
class MultiWorkerMirroredStrategy : public Strategy {
 public:
  explicit MultiWorkerMirroredStrategy(const cluster::ClusterSpec& cluster,
                                       const collective::CommunicationOptions& options = {},
                                       int replicas_per_worker = 0,
                                       const ElasticOptions& elastic = {});
  MultiWorkerMirroredStrategy(const cluster::ClusterSpec& cluster,
                              const collective::CommunicationOptions& options,
                              std::vector<torch::Device> devices,
                              const ElasticOptions& elastic = {});
};

} // namespace flotilla::strategy
