// TF's ReplicaContext: what a replica's own code sees of the others while a step runs. Code
// inside a replica's forward or backward (SyncBatchNorm's statistics) reduces a value over every
// replica of every worker with all_reduce_sum(); the worker's replicas (threads) meet first, and
// the last to arrive sums their values and crosses workers in one all-reduce.
//
// Like any collective, every replica must call it the same number of times, in the same order,
// with the same shape and dtype. Model::compile() hands each replica its context.
#pragma once

#include <torch/types.h>

#include <memory>
#include <string>
#include <vector>

#include "flotilla/collective/communicator.h"

namespace flotilla::strategy {

namespace detail {
class LocalReplicas;
}

class ReplicaContext {
 public:
  // A replica alone: all_reduce_sum() returns its input, with no copy.
  ReplicaContext() = default;

  int replica_id_in_sync_group() const; // worker index × replicas per worker + local index
  int num_replicas_in_sync() const;
  // The sum of `value` over every replica of every worker, on value's device (a new tensor;
  // `value` itself for a replica alone).
  // Blocks until every replica has called it; CommError when another replica of this worker
  // failed (abort()) or a worker did, TimeoutError after CommunicationOptions::timeout.
  torch::Tensor all_reduce_sum(const torch::Tensor& value) const;
  // A replica failed mid-step: wakes this worker's replicas waiting in all_reduce_sum() with a
  // CommError saying `why`, and refuses further calls (the replicas are out of step).
  void abort(const std::string& why) const;

 private:
  friend std::vector<ReplicaContext> make_replica_contexts(collective::Communicator, int);
  ReplicaContext(std::shared_ptr<detail::LocalReplicas> group, int local)
      : group_(std::move(group)), local_(local) {}
  std::shared_ptr<detail::LocalReplicas> group_;
  int local_ = 0;
};

// One context per replica of this worker (`replicas` of them, sharing `workers` to reach the
// other workers): a new group, so a failure in an earlier one does not linger.
std::vector<ReplicaContext> make_replica_contexts(collective::Communicator workers, int replicas);

} // namespace flotilla::strategy
