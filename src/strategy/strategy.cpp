#include "flotilla/strategy/strategy.h"

#include <map>

#include "flotilla/cluster/resolvers.h"
#include "flotilla/error.h"

namespace flotilla::strategy {

std::int64_t InputContext::get_per_replica_batch_size(std::int64_t global_batch) const {
  if (global_batch < 1) {
    throw ConfigError("global batch must be at least 1; saw " + std::to_string(global_batch));
  }
  if (global_batch < num_replicas_in_sync || global_batch % num_replicas_in_sync != 0) {
    throw ConfigError("global batch " + std::to_string(global_batch) +
                      " does not split evenly across " + std::to_string(num_replicas_in_sync) +
                      " replicas; use a multiple of " + std::to_string(num_replicas_in_sync));
  }
  return global_batch / num_replicas_in_sync;
}

Strategy::Strategy(cluster::ClusterSpec cluster, collective::Communicator communicator)
    : cluster_(std::move(cluster)), communicator_(std::move(communicator)),
      log_(communicator_.rank(), communicator_.size()) {}

InputContext Strategy::input_context() const {
  return InputContext{num_workers(), worker_index(), num_replicas_in_sync()};
}

void Strategy::mirror(torch::nn::Module& module) {
  if (communicator_.size() == 1) return;
  torch::NoGradGuard no_grad;
  // One flat broadcast per (dtype, device) instead of one per tensor.
  std::map<std::pair<int, std::string>, std::vector<torch::Tensor>> groups;
  for (const auto& t : module.parameters()) {
    groups[{static_cast<int>(t.scalar_type()), t.device().str()}].push_back(t);
  }
  for (const auto& t : module.buffers()) {
    groups[{static_cast<int>(t.scalar_type()), t.device().str()}].push_back(t);
  }
  for (auto& [key, tensors] : groups) {
    std::vector<torch::Tensor> flat_parts;
    for (const auto& t : tensors) flat_parts.push_back(t.reshape({-1}));
    torch::Tensor flat = torch::cat(flat_parts);
    communicator_.broadcast(flat, 0).wait();
    std::int64_t offset = 0;
    for (auto& t : tensors) {
      t.copy_(flat.narrow(0, offset, t.numel()).view_as(t));
      offset += t.numel();
    }
  }
}

torch::Tensor Strategy::reduce(ReduceOp op, const torch::Tensor& value) {
  torch::Tensor out = value.detach().clone();
  communicator_.all_reduce(out, op).wait();
  return out;
}

GradientReducer Strategy::make_gradient_reducer(const torch::nn::Module& module) {
  std::vector<torch::Tensor> trainable;
  for (const auto& p : module.parameters()) {
    if (p.requires_grad()) trainable.push_back(p);
  }
  return GradientReducer(communicator_, std::move(trainable),
                         communicator_.options().bytes_per_pack);
}

MirroredStrategy::MirroredStrategy(const collective::CommunicationOptions& options)
    : Strategy(cluster::single_worker(),
               collective::Communicator::local_group(1, options).front()) {}

MultiWorkerMirroredStrategy::MultiWorkerMirroredStrategy(
    const cluster::ClusterSpec& cluster, const collective::CommunicationOptions& options)
    : Strategy(cluster, collective::Communicator::connect(cluster, options)) {}

} // namespace flotilla::strategy
