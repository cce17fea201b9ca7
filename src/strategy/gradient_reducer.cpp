#include "flotilla/strategy/gradient_reducer.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>

#include "flotilla/error.h"
#include "flotilla/strategy/bucket_assignment.h"

namespace flotilla::strategy {

using Clock = std::chrono::steady_clock;

double GradientReducer::Stats::hidden_share() const {
  if (comm_seconds <= 0) return 0;
  return std::clamp(1.0 - exposed_seconds / comm_seconds, 0.0, 1.0);
}

// Runs after autograd has accumulated a parameter's gradient into its .grad().
struct GradientReducer::Hook : torch::autograd::FunctionPostHook {
  Hook(GradientReducer* owner, int replica, std::size_t param)
      : owner(owner), replica(replica), param(param) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& inputs) override {
    // An undefined incoming gradient (autograd's "zero") means the parameter was not used.
    owner->on_gradient(replica, param, !inputs.empty() && inputs[0].defined());
    return outputs;
  }
  GradientReducer* owner;
  int replica;
  std::size_t param;
};

std::string gradient_kind(const torch::Tensor& parameter) {
  return c10::str(parameter.scalar_type(), "@", parameter.device());
}

GradientReducer::GradientReducer(collective::Communicator communicator,
                                 std::vector<std::vector<torch::Tensor>> replicas,
                                 const collective::CommunicationOptions& options)
    : communicator_(std::move(communicator)), options_(options), replicas_(std::move(replicas)) {
  if (options_.bytes_per_pack <= 0) {
    throw ConfigError("bytes_per_pack must be positive; saw " +
                      std::to_string(options_.bytes_per_pack) +
                      "; the default is 25 MiB (26214400)");
  }
  if (replicas_.empty()) {
    throw ConfigError("the gradient engine needs at least one replica; saw an empty list");
  }
  const auto& params = replicas_.front();
  auto describe = [](const torch::Tensor& t) {
    return c10::str(t.sizes(), " ", t.scalar_type(), " strides ", t.strides(), " on ", t.device());
  };
  for (std::size_t r = 1; r < replicas_.size(); ++r) {
    if (replicas_[r].size() != params.size()) {
      throw ConfigError("replica " + std::to_string(r) + " has " +
                        std::to_string(replicas_[r].size()) + " trainable parameters, replica 0 " +
                        std::to_string(params.size()) +
                        "; every replica must be a clone of the same model");
    }
    for (std::size_t k = 0; k < params.size(); ++k) {
      const auto& mine = replicas_[r][k];
      // Buffers are summed element by element, so layouts must match too. Replicas may sit on
      // different devices of one kind (one GPU each); one model's parameters on one device.
      if (mine.sizes() != params[k].sizes() || mine.scalar_type() != params[k].scalar_type() ||
          mine.strides() != params[k].strides() ||
          mine.device().type() != params[k].device().type() ||
          mine.device() != replicas_[r].front().device()) {
        throw ConfigError("parameter " + std::to_string(k) + " of replica " + std::to_string(r) +
                          " is " + describe(mine) + ", but replica 0's is " + describe(params[k]) +
                          "; every replica must be a clone of the same model, each on one device "
                          "of the same kind");
      }
    }
  }

  // The plan, from replica 0, in reverse registration order: the last layers' gradients are
  // ready first in backward. A bucket holds one dtype on one device.
  std::vector<GradientSlot> slots;
  for (std::size_t k = params.size(); k-- > 0;) {
    const auto& p = params[k];
    slots.push_back({p.numel() * static_cast<std::int64_t>(p.element_size()), gradient_kind(p)});
  }
  bucket_of_.resize(params.size());
  std::vector<std::size_t> slot_of(params.size()); // parameter -> index within its bucket
  for (const auto& members : assign_buckets(slots, options_.bytes_per_pack)) {
    Bucket bucket;
    const std::size_t first = params.size() - 1 - members.front();
    bucket.dtype = params[first].scalar_type();
    bucket.device = params[first].device();
    for (const std::size_t slot : members) {
      const std::size_t k = params.size() - 1 - slot;
      bucket_of_[k] = buckets_.size();
      slot_of[k] = bucket.params.size();
      bucket.params.push_back(k);
      bucket.offsets.push_back(bucket.numel);
      bucket.numel += params[k].numel();
    }
    buckets_.push_back(std::move(bucket));
  }

  // Per replica: the flat buffers (gradients, then one "has a gradient" flag per parameter:
  // 0/1 and their sums are exact in every float type) and the views the gradients live in.
  const int world = communicator_.size();
  flat_.resize(replicas_.size());
  views_.resize(replicas_.size());
  for (std::size_t r = 0; r < replicas_.size(); ++r) {
    for (const auto& bucket : buckets_) {
      const auto flags = static_cast<std::int64_t>(bucket.params.size());
      // On this replica's device: the local reduction moves buckets between devices, not
      // gradients.
      flat_[r].push_back(torch::zeros({bucket.numel + flags},
                                      torch::TensorOptions()
                                          .dtype(bucket.dtype)
                                          .device(replicas_[r][bucket.params.front()].device())));
    }
    views_[r].resize(params.size());
    for (std::size_t k = 0; k < params.size(); ++k) {
      const auto& bucket = buckets_[bucket_of_[k]];
      const auto slot =
          flat_[r][bucket_of_[k]].narrow(0, bucket.offsets[slot_of[k]], params[k].numel());
      // The gradient takes its parameter's layout (a channels-last convolution weight gets a
      // channels-last gradient), so autograd and the optimizer never convert between layouts.
      const auto& p = replicas_[r][k];
      views_[r][k] = p.is_non_overlapping_and_dense()
                         ? slot.as_strided(p.sizes(), p.strides(), slot.storage_offset())
                         : slot.view(p.sizes());
    }
  }
  if (world > 1 && options_.compression != collective::Compression::kNone) {
    const auto wire_type =
        options_.compression == collective::Compression::kFp16 ? torch::kFloat16 : torch::kBFloat16;
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      wire_.push_back(torch::empty_like(flat_[0][b], flat_[0][b].options().dtype(wire_type)));
    }
  }
  used_.assign(replicas_.size(), std::vector<char>(params.size(), 0));
  fired_ = used_;
  pending_.assign(buckets_.size(), 0);
  works_.resize(buckets_.size());
  started_at_.resize(buckets_.size());

  for (std::size_t r = 0; r < replicas_.size(); ++r) {
    for (std::size_t k = 0; k < params.size(); ++k) {
      if (!replicas_[r][k].requires_grad()) {
        throw ConfigError("parameter " + std::to_string(k) + " of replica " + std::to_string(r) +
                          " does not require a gradient; pass only trainable parameters");
      }
      auto accumulator = torch::autograd::impl::grad_accumulator(replicas_[r][k]);
      hook_keys_.push_back(
          accumulator->add_post_hook(std::make_unique<Hook>(this, static_cast<int>(r), k)));
      accumulators_.push_back(std::move(accumulator));
      // Before accumulation: a second gradient in one step must be refused before it is added
      // into a bucket that may be on the wire (the post-hook would be too late).
      tensor_hooks_.push_back(replicas_[r][k].register_hook(
          [this, r, k](const torch::Tensor&) { check_second_gradient(static_cast<int>(r), k); }));
    }
  }
  zero_grad();
}

GradientReducer::~GradientReducer() {
  for (std::size_t i = 0; i < accumulators_.size(); ++i) {
    accumulators_[i]->del_post_hook(hook_keys_[i]);
  }
  std::size_t i = 0;
  for (auto& replica : replicas_) {
    for (auto& p : replica) p.remove_hook(tensor_hooks_[i++]);
  }
}

void GradientReducer::check_second_gradient(int replica, std::size_t param) {
  std::lock_guard<std::mutex> lock(mutex_);
  // A second backward through the same parameters in one step: its gradient would land in a
  // bucket that may already be on the wire. DDP refuses this too.
  if (armed_ && fired_[replica][param] && bucket_of_[param] < next_bucket_) {
    throw ConfigError("parameter " + std::to_string(param) + " of replica " +
                      std::to_string(replica) +
                      " got a second gradient in one step, after its bucket's all-reduce "
                      "started; run one backward per step (retain_graph twice is not "
                      "supported), or accumulate with gradient_accumulation_steps");
  }
}

void GradientReducer::require_usable_locked() const {
  if (broken_) {
    throw CommError("an earlier step failed in the middle of the gradient reduction, so the "
                    "workers are no longer issuing the same collectives; restart the workers "
                    "(saved checkpoints are intact)");
  }
}

void GradientReducer::drain_locked() noexcept {
  // Every started all-reduce must complete (or fail) before its buffer is reused, and the group
  // is out of step: no later step may reduce.
  broken_ = true;
  for (auto& work : works_) {
    try {
      work.wait();
    } catch (...) {
    }
  }
  works_.assign(buckets_.size(), collective::Work());
  armed_ = false;
}

void GradientReducer::abort_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (armed_ || next_bucket_ > 0) drain_locked();
}

void GradientReducer::zero_grad() {
  std::lock_guard<std::mutex> lock(mutex_);
  require_usable_locked();
  for (auto& replica : flat_) {
    for (auto& flat : replica) flat.zero_();
  }
  for (std::size_t r = 0; r < replicas_.size(); ++r) {
    for (std::size_t k = 0; k < views_[r].size(); ++k) {
      replicas_[r][k].mutable_grad() = views_[r][k];
    }
    std::fill(used_[r].begin(), used_[r].end(), 0);
  }
  micro_batches_ = 0;
  armed_ = false;
}

void GradientReducer::prepare(bool sync) {
  std::lock_guard<std::mutex> lock(mutex_);
  require_usable_locked();
  // set_data() or to() on a parameter replaces its gradient accumulator, and with it the hooks:
  // its gradients would never be counted or reduced.
  std::size_t i = 0;
  for (std::size_t r = 0; r < replicas_.size(); ++r) {
    for (std::size_t k = 0; k < replicas_[r].size(); ++k, ++i) {
      if (torch::autograd::impl::try_get_grad_accumulator(replicas_[r][k]) != accumulators_[i]) {
        throw ConfigError("parameter " + std::to_string(k) + " of replica " + std::to_string(r) +
                          " was replaced (set_data or to() after compile), so the gradient "
                          "engine no longer sees its gradients; move or convert the model "
                          "before compile(), or compile again");
      }
    }
  }
  ++micro_batches_;
  armed_ = sync;
  for (auto& replica : fired_) std::fill(replica.begin(), replica.end(), 0);
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    pending_[b] = static_cast<std::int64_t>(buckets_[b].params.size() * replicas_.size());
  }
  next_bucket_ = 0;
  std::fill(works_.begin(), works_.end(), collective::Work());
}

void GradientReducer::on_gradient(int replica, std::size_t param, bool defined) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (defined) used_[replica][param] = 1;
  if (!armed_ || fired_[replica][param]) return;
  fired_[replica][param] = 1;
  if (--pending_[bucket_of_[param]] == 0 && options_.overlap) start_ready_locked(true);
}

void GradientReducer::start_ready_locked(bool in_backward) {
  while (next_bucket_ < buckets_.size() && pending_[next_bucket_] == 0) {
    start_locked(next_bucket_, in_backward);
    ++next_bucket_;
  }
}

void GradientReducer::start_locked(std::size_t b, bool in_backward) {
  torch::NoGradGuard no_grad;
  const Bucket& bucket = buckets_[b];
  const auto n = static_cast<std::int64_t>(bucket.params.size());
  for (std::size_t r = 0; r < replicas_.size(); ++r) {
    for (std::int64_t i = 0; i < n; ++i) {
      const std::size_t k = bucket.params[i];
      // A gradient autograd put elsewhere (the optimizer's zero_grad() set it to none, or a
      // create_graph backward replaced it) is taken into the bucket.
      auto& param = replicas_[r][k];
      if (param.grad().defined() && !param.grad().is_same(views_[r][k])) {
        views_[r][k].copy_(param.grad());
        param.mutable_grad() = views_[r][k];
      }
      // fill_, not a copy from host memory: on CUDA it queues, it does not synchronise.
      flat_[r][b].narrow(0, bucket.numel + i, 1).fill_(used_[r][k] ? 1 : 0);
    }
  }
  // Local reduction first: replica 0's buffer carries the worker's sum (NCCL across GPUs).
  torch::Tensor& sum = flat_[0][b];
  if (replicas_.size() > 1) collective::reduce_to_first(replica_buffers(b));
  const int world = communicator_.size();
  const double divisor = static_cast<double>(world) * static_cast<double>(replicas_.size()) *
                         static_cast<double>(std::max(1, micro_batches_));
  // Divided before the sum, as DDP does: half-precision wire values stay in range.
  if (divisor != 1) sum.narrow(0, 0, bucket.numel).div_(divisor);
  ++stats_.buckets;
  if (in_backward) ++stats_.buckets_in_backward;
  if (world == 1) return;
  started_at_[b] = Clock::now();
  if (!wire_.empty()) {
    wire_[b].copy_(sum);
    stats_.wire_bytes += wire_[b].numel() * static_cast<std::int64_t>(wire_[b].element_size());
    works_[b] = communicator_.all_reduce(wire_[b], collective::ReduceOp::kSum);
  } else {
    stats_.wire_bytes += sum.numel() * static_cast<std::int64_t>(sum.element_size());
    works_[b] = communicator_.all_reduce(sum, collective::ReduceOp::kSum);
  }
}

void GradientReducer::finish() {
  torch::NoGradGuard no_grad;
  std::lock_guard<std::mutex> lock(mutex_);
  require_usable_locked();
  if (micro_batches_ == 0) {
    throw ConfigError("GradientReducer::finish() with no micro-batch since zero_grad(); call "
                      "zero_grad(), then prepare() before each backward");
  }
  const auto backward_end = Clock::now();
  std::vector<std::pair<Clock::time_point, Clock::time_point>> in_flight;
  try {
    // Whatever did not start in backward (overlap off, or a bucket with a parameter some
    // replica did not use) starts now, still in plan order.
    while (next_bucket_ < buckets_.size()) {
      start_locked(next_bucket_, false);
      ++next_bucket_;
    }
    armed_ = false;
    std::vector<torch::Tensor> flags;
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      torch::Tensor& mean = flat_[0][b];
      if (communicator_.size() > 1) {
        works_[b].wait();
        in_flight.emplace_back(started_at_[b], works_[b].completed_at().value_or(Clock::now()));
        if (!wire_.empty()) mean.copy_(wire_[b]);
      }
      if (replicas_.size() > 1) collective::broadcast_from_first(replica_buffers(b));
      flags.push_back(
          mean.narrow(0, buckets_[b].numel, static_cast<std::int64_t>(buckets_[b].params.size())));
    }
    // Where every replica of this worker used every parameter, each has a gradient somewhere,
    // so none is dropped and the flags need not be read: no host synchronisation per step on
    // CUDA (nor in a captured graph). Otherwise one copy to the host for all the flags.
    bool all_used_here = true;
    for (const auto& replica : used_) {
      all_used_here = all_used_here && std::all_of(replica.begin(), replica.end(),
                                                   [](char used) { return used != 0; });
    }
    if (!all_used_here) {
      const torch::Tensor used = torch::cat(flags).to(torch::kCPU, torch::kFloat32).contiguous();
      const float* used_by = used.data_ptr<float>();
      for (const auto& bucket : buckets_) {
        for (std::size_t k : bucket.params) {
          // Used by no replica: no gradient, as single-process training (and DDP) would leave
          // it, so momentum and weight decay do not move it. zero_grad() restores the view.
          if (*used_by++ == 0.0f) {
            for (auto& replica : replicas_) replica[k].mutable_grad().reset();
          }
        }
      }
    }
  } catch (...) {
    drain_locked();
    throw;
  }
  works_.assign(buckets_.size(), collective::Work());
  ++stats_.syncs;
  if (!in_flight.empty()) {
    std::sort(in_flight.begin(), in_flight.end());
    auto [begin, end] = in_flight.front();
    double busy = 0;
    for (const auto& [s, e] : in_flight) {
      if (s > end) {
        busy += std::chrono::duration<double>(end - begin).count();
        begin = s;
      }
      end = std::max(end, e);
    }
    busy += std::chrono::duration<double>(end - begin).count();
    stats_.comm_seconds += busy;
    stats_.exposed_seconds += std::chrono::duration<double>(Clock::now() - backward_end).count();
  }
  last_in_flight_ = std::move(in_flight);
}

std::vector<torch::Tensor> GradientReducer::replica_buffers(std::size_t bucket) const {
  std::vector<torch::Tensor> buffers;
  for (const auto& replica : flat_) buffers.push_back(replica[bucket]);
  return buffers;
}

std::string GradientReducer::plan() const {
  std::string out = std::to_string(buckets_.size()) + " bucket(s):";
  for (const auto& bucket : buckets_) {
    out += " [" + std::string(c10::toString(bucket.dtype)) + " x " + std::to_string(bucket.numel) +
           ", params";
    for (auto k : bucket.params) out += " " + std::to_string(k);
    out += "]";
  }
  return out;
}

std::vector<std::pair<std::chrono::steady_clock::time_point, std::chrono::steady_clock::time_point>>
GradientReducer::last_all_reduces() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return last_in_flight_;
}

GradientReducer::Stats GradientReducer::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

} // namespace flotilla::strategy
