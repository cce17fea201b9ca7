#include "flotilla/strategy/gradient_reducer.h"

#include "flotilla/error.h"

namespace flotilla::strategy {

GradientReducer::GradientReducer(collective::Communicator communicator,
                                 std::vector<torch::Tensor> parameters, std::int64_t bytes_per_pack)
    : communicator_(std::move(communicator)), parameters_(std::move(parameters)) {
  if (bytes_per_pack <= 0) {
    throw ConfigError("bytes_per_pack must be positive; saw " + std::to_string(bytes_per_pack) +
                      "; the default is 25 MiB (26214400)");
  }
  // Reverse registration order: the last layers' gradients are ready first in backward.
  Bucket current;
  std::int64_t current_bytes = 0;
  auto close = [&] {
    if (current.params.empty()) return;
    const auto& first = parameters_[current.params.front()];
    current.numel = current.offsets.back() + parameters_[current.params.back()].numel();
    // One "has a gradient" flag per parameter rides at the end of the bucket (0/1 and their
    // sums are exact in every float type).
    const auto flags = static_cast<std::int64_t>(current.params.size());
    current.flat = torch::zeros({current.numel + flags}, first.options().requires_grad(false));
    buckets_.push_back(std::move(current));
    current = Bucket{};
    current_bytes = 0;
  };
  for (std::size_t k = parameters_.size(); k-- > 0;) {
    const auto& p = parameters_[k];
    const std::int64_t bytes = p.numel() * static_cast<std::int64_t>(p.element_size());
    const bool same_kind =
        current.params.empty() || (parameters_[current.params.front()].dtype() == p.dtype() &&
                                   parameters_[current.params.front()].device() == p.device());
    if (!same_kind || (!current.params.empty() && current_bytes + bytes > bytes_per_pack)) close();
    const std::int64_t offset =
        current.params.empty()
            ? 0
            : current.offsets.back() + parameters_[current.params.back()].numel();
    current.params.push_back(k);
    current.offsets.push_back(offset);
    current_bytes += bytes;
  }
  close();
}

void GradientReducer::finish() {
  torch::NoGradGuard no_grad;
  const int replicas = communicator_.size();
  if (replicas == 1) return;
  std::vector<collective::Work> works;
  works.reserve(buckets_.size());
  for (auto& bucket : buckets_) {
    const auto n = static_cast<std::int64_t>(bucket.params.size());
    std::vector<float> has_grad(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) {
      const auto& p = parameters_[bucket.params[i]];
      auto slot = bucket.flat.narrow(0, bucket.offsets[i], p.numel());
      has_grad[i] = p.grad().defined() ? 1.0f : 0.0f;
      if (p.grad().defined()) {
        slot.copy_(p.grad().reshape({-1}));
      } else {
        slot.zero_();
      }
    }
    bucket.flat.narrow(0, bucket.numel, n).copy_(torch::from_blob(has_grad.data(), {n}));
    works.push_back(communicator_.all_reduce(bucket.flat, collective::ReduceOp::kSum));
  }
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    works[b].wait();
    auto& bucket = buckets_[b];
    const auto n = static_cast<std::int64_t>(bucket.params.size());
    const torch::Tensor used =
        bucket.flat.narrow(0, bucket.numel, n).to(torch::kCPU, torch::kFloat32).contiguous();
    const float* used_by = used.data_ptr<float>();
    bucket.flat.narrow(0, 0, bucket.numel).div_(replicas);
    for (std::int64_t i = 0; i < n; ++i) {
      auto p = parameters_[bucket.params[i]];
      // Unused on every replica: no gradient, as single-worker training (and DDP) would leave it,
      // so momentum and weight decay do not move it.
      if (used_by[i] == 0.0f) continue;
      auto slot = bucket.flat.narrow(0, bucket.offsets[i], p.numel()).view(p.sizes());
      if (p.grad().defined()) {
        p.mutable_grad().copy_(slot);
      } else {
        p.mutable_grad() = slot.clone();
      }
    }
  }
}

} // namespace flotilla::strategy
