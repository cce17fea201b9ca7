// The gradient engine: averages gradients over every replica in sync, each step.
//
// Gradients live in flat buckets of at most bytes_per_pack bytes, filled in reverse registration
// order (roughly the order backward produces them); every parameter's .grad() is a view into its
// bucket, so autograd accumulates straight into the buffer that is all-reduced and nothing is
// copied after. A hook on each parameter's gradient accumulator counts the bucket down; when its
// last gradient is in, the bucket's asynchronous all-reduce starts while backward goes on
// (overlap), and finish() waits for all of them only before the optimizer. Buckets start in
// plan order on every rank, so ranks always issue the same collectives in the same order.
//
// Several replicas per worker (threads, each its own model copy, on one device each) share one
// engine: a bucket is summed locally once every replica has produced it (NCCL across GPUs), crosses
// workers in one all-reduce, and the mean is broadcast back to every replica.
//
// A parameter that got no gradient on a replica contributes zeros, so nobody waits for a
// gradient that never comes (PyTorch DDP's find_unused_parameters, without the graph walk): a
// bucket holding one simply starts after backward. One used by no replica keeps no gradient, as
// it would in single-process training. Accumulation (DDP's no_sync): prepare(false) for all but
// the last of K micro-batches; the mean then covers every micro-batch.
#pragma once

#include <torch/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "flotilla/collective/communicator.h"

namespace torch::autograd {
struct Node;
}

namespace flotilla::strategy {

// A parameter's kind for assign_buckets (bucket_assignment.h): its dtype and device, "Float@cpu".
std::string gradient_kind(const torch::Tensor& parameter);

class GradientReducer {
 public:
  struct Bucket {
    std::vector<std::size_t> params;   // indices into a replica's parameter list
    std::vector<std::int64_t> offsets; // element offset of each parameter's gradient
    std::int64_t numel = 0;            // gradient elements; one used-flag per parameter follows
    torch::ScalarType dtype = torch::kFloat32;
    torch::Device device = torch::kCPU;
  };
  // Totals since construction, for the overlap report.
  struct Stats {
    std::int64_t syncs = 0;              // completed finish() calls
    std::int64_t buckets = 0;            // bucket reductions started
    std::int64_t buckets_in_backward = 0; // of them, started by a hook while backward ran
    double comm_seconds = 0;    // time some cross-worker all-reduce was in flight
    double exposed_seconds = 0; // time finish() waited after backward (the part not hidden)
    std::int64_t wire_bytes = 0; // bytes this worker handed to all-reduces
    // Share of communication time hidden behind backward, 0 to 1.
    double hidden_share() const;
  };

  // `replicas[r]`: replica r's trainable parameters in registration order; every replica is a
  // copy of the same model. `communicator` joins this worker to the others.
  GradientReducer(collective::Communicator communicator,
                  std::vector<std::vector<torch::Tensor>> replicas,
                  const collective::CommunicationOptions& options);
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  // Zeroes every gradient (the buckets) and makes each .grad() a bucket view again; call it
  // instead of the optimizer's zero_grad(), which would detach the views.
  void zero_grad();
  // Before each micro-batch's backward. sync=false: only accumulate (no communication);
  // sync=true: this micro-batch ends the accumulation, its buckets reduce as they fill.
  void prepare(bool sync = true);
  // After every replica's backward of a sync micro-batch: starts what has not started, waits,
  // and leaves every replica's gradients equal to the mean over all replicas and micro-batches.
  // After prepare(false) micro-batches only, it flushes them (a partial accumulation).
  // If it fails (a peer died, a timeout), every started all-reduce is waited for and the engine
  // refuses further steps with a CommError: the ranks are no longer in step.
  void finish();
  // After a step failed between prepare() and finish() (a replica's forward or backward threw):
  // waits for the all-reduces already started and refuses further steps, as finish() does.
  void abort_step();

  int num_replicas() const { return static_cast<int>(replicas_.size()); }
  const std::vector<Bucket>& buckets() const { return buckets_; }
  // "3 buckets: [float x 1290 (2 params)], ..." — identical on every rank, or the ranks would
  // reduce different things (part of the start-up consistency check).
  std::string plan() const;
  Stats stats() const;
  // Each bucket's cross-worker all-reduce in the last finish(): [started, completed], for the
  // timeline. Empty with one worker.
  std::vector<std::pair<std::chrono::steady_clock::time_point,
                        std::chrono::steady_clock::time_point>>
  last_all_reduces() const;

 private:
  struct Hook;
  void on_gradient(int replica, std::size_t param, bool defined); // from autograd's threads
  void check_second_gradient(int replica, std::size_t param);
  void require_usable_locked() const;
  void drain_locked() noexcept;
  void start_ready_locked(bool in_backward);
  void start_locked(std::size_t bucket, bool in_backward);
  std::vector<torch::Tensor> replica_buffers(std::size_t bucket) const; // [replica]

  collective::Communicator communicator_;
  collective::CommunicationOptions options_;
  std::vector<std::vector<torch::Tensor>> replicas_;
  std::vector<Bucket> buckets_;
  std::vector<std::size_t> bucket_of_;                 // parameter -> bucket
  std::vector<std::vector<torch::Tensor>> flat_;       // [replica][bucket]
  std::vector<std::vector<torch::Tensor>> views_;      // [replica][parameter]
  std::vector<torch::Tensor> wire_;                    // [bucket]: half-precision copies
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<std::uintptr_t> hook_keys_;
  std::vector<unsigned> tensor_hooks_;

  mutable std::mutex mutex_; // hooks fire on every replica's thread
  bool armed_ = false;
  bool broken_ = false; // a step failed mid-reduction: the ranks are out of step
  int micro_batches_ = 0; // backward passes since zero_grad()
  std::vector<std::vector<char>> used_;  // [replica][parameter], since zero_grad()
  std::vector<std::vector<char>> fired_; // [replica][parameter], this micro-batch
  std::vector<std::int64_t> pending_;    // [bucket]: gradients still to come this micro-batch
  std::size_t next_bucket_ = 0;          // buckets start in order
  std::vector<collective::Work> works_;
  std::vector<std::chrono::steady_clock::time_point> started_at_;
  Stats stats_;
  std::vector<std::pair<std::chrono::steady_clock::time_point,
                        std::chrono::steady_clock::time_point>>
      last_in_flight_;
};

} // namespace flotilla::strategy
