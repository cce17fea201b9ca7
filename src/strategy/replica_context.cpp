#include "flotilla/strategy/replica_context.h"

#include <condition_variable>
#include <mutex>

#include "flotilla/error.h"

namespace flotilla::strategy {
namespace detail {

// The worker's replicas meeting point: a generation-counted barrier whose last arrival does the
// reduction. One reduction is in flight at a time: a replica cannot call again before it has its
// result, and all call in the same order.
class LocalReplicas {
 public:
  LocalReplicas(collective::Communicator workers, int replicas)
      : workers_(std::move(workers)), inputs_(static_cast<std::size_t>(replicas)),
        results_(static_cast<std::size_t>(replicas)) {}

  int size() const { return static_cast<int>(inputs_.size()); }
  const collective::Communicator& workers() const { return workers_; }

  torch::Tensor all_reduce_sum(int local, const torch::Tensor& value) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (broken_) throw CommError(reason_);
    const auto me = static_cast<std::size_t>(local);
    inputs_[me] = value;
    if (++arrived_ < size()) {
      const std::uint64_t generation = generation_;
      const bool done = woken_.wait_for(lock, workers_.options().timeout, [&] {
        return generation_ != generation || broken_;
      });
      if (!done) {
        fail_locked("a replica of this worker did not reach the same cross-replica reduction "
                    "within CommunicationOptions::timeout (" +
                    std::to_string(workers_.options().timeout.count()) +
                    " ms): the replicas run different code, or one is stuck");
        throw TimeoutError(reason_);
      }
      if (generation_ == generation) throw CommError(reason_);
      return std::move(results_[me]);
    }
    try {
      torch::NoGradGuard no_grad;
      torch::Tensor sum = inputs_[0].detach().clone();
      for (std::size_t r = 1; r < inputs_.size(); ++r) sum.add_(inputs_[r].to(sum.device()));
      if (workers_.size() > 1) {
        collective::Communicator workers = workers_;
        workers.all_reduce(sum, collective::ReduceOp::kSum).wait();
      }
      for (std::size_t r = 0; r < inputs_.size(); ++r) {
        // Each replica its own tensor: autograd may accumulate into a gradient it is given.
        results_[r] = sum.to(inputs_[r].device(), /*non_blocking=*/false, /*copy=*/true);
        inputs_[r] = torch::Tensor();
      }
    } catch (const std::exception& e) {
      fail_locked(std::string("a cross-replica reduction failed: ") + e.what());
      throw;
    }
    arrived_ = 0;
    ++generation_;
    woken_.notify_all();
    return std::move(results_[me]);
  }

  void abort(const std::string& why) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!broken_) fail_locked(why);
  }

 private:
  void fail_locked(const std::string& why) {
    broken_ = true;
    reason_ = why;
    woken_.notify_all();
  }

  collective::Communicator workers_;
  std::mutex mutex_;
  std::condition_variable woken_;
  std::vector<torch::Tensor> inputs_;
  std::vector<torch::Tensor> results_;
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
  bool broken_ = false;
  std::string reason_;
};

} // namespace detail

int ReplicaContext::replica_id_in_sync_group() const {
  return group_ ? group_->workers().rank() * group_->size() + local_ : 0;
}

int ReplicaContext::num_replicas_in_sync() const {
  return group_ ? group_->workers().size() * group_->size() : 1;
}

torch::Tensor ReplicaContext::all_reduce_sum(const torch::Tensor& value) const {
  if (!group_) return value;
  return group_->all_reduce_sum(local_, value);
}

void ReplicaContext::abort(const std::string& why) const {
  if (group_) group_->abort(why);
}

std::vector<ReplicaContext> make_replica_contexts(collective::Communicator workers, int replicas) {
  if (replicas < 1) {
    throw ConfigError("make_replica_contexts needs at least one replica; saw " +
                      std::to_string(replicas));
  }
  auto group = std::make_shared<detail::LocalReplicas>(std::move(workers), replicas);
  std::vector<ReplicaContext> contexts;
  for (int r = 0; r < replicas; ++r) contexts.push_back(ReplicaContext(group, r));
  return contexts;
}

} // namespace flotilla::strategy
