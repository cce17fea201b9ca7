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

Strategy::Strategy(cluster::ClusterSpec cluster, collective::Communicator communicator,
                   int replicas_per_worker)
    : cluster_(std::move(cluster)), communicator_(std::move(communicator)),
      replicas_per_worker_(replicas_per_worker), log_(communicator_.rank(), communicator_.size()) {
  if (replicas_per_worker < 1) {
    throw ConfigError("replicas_per_worker must be at least 1; saw " +
                      std::to_string(replicas_per_worker));
  }
}

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

std::unique_ptr<GradientReducer>
Strategy::make_gradient_reducer(const std::vector<std::shared_ptr<torch::nn::Module>>& replicas) {
  std::vector<std::vector<torch::Tensor>> trainable;
  for (const auto& module : replicas) {
    auto& mine = trainable.emplace_back();
    for (const auto& p : module->parameters()) {
      if (p.requires_grad()) mine.push_back(p);
    }
  }
  return std::make_unique<GradientReducer>(communicator_, std::move(trainable),
                                           communicator_.options());
}

namespace {

std::string encode(const std::vector<std::pair<std::string, std::string>>& fields) {
  std::string out;
  for (const auto& [name, value] : fields) out += name + '\x1f' + value + '\x1e';
  return out;
}

std::vector<std::pair<std::string, std::string>> decode(const std::string& text) {
  std::vector<std::pair<std::string, std::string>> out;
  std::size_t at = 0;
  while (at < text.size()) {
    const auto unit = text.find('\x1f', at);
    const auto record = text.find('\x1e', unit);
    if (unit == std::string::npos || record == std::string::npos) break;
    out.emplace_back(text.substr(at, unit - at), text.substr(unit + 1, record - unit - 1));
    at = record + 1;
  }
  return out;
}

} // namespace

void Strategy::check_consistency(const std::vector<std::pair<std::string, std::string>>& fields) {
  if (communicator_.size() == 1) return;
  const std::string mine = encode(fields);
  // Lengths first, then every worker's fields padded to the longest.
  auto length = torch::tensor({static_cast<std::int64_t>(mine.size())}, torch::kInt64);
  auto lengths = communicator_.all_gather(length);
  lengths.wait();
  std::int64_t longest = 0;
  for (const auto& l : lengths.result()) longest = std::max(longest, l.item<std::int64_t>());
  auto padded = torch::zeros({longest}, torch::kUInt8);
  std::copy(mine.begin(), mine.end(), padded.data_ptr<std::uint8_t>());
  auto texts = communicator_.all_gather(padded);
  texts.wait();
  std::vector<std::vector<std::pair<std::string, std::string>>> all;
  for (std::size_t r = 0; r < texts.result().size(); ++r) {
    const auto* begin = texts.result()[r].data_ptr<std::uint8_t>();
    all.push_back(decode(std::string(begin, begin + lengths.result()[r].item<std::int64_t>())));
  }
  std::string diff;
  int differences = 0;
  const auto& chief = all.front();
  const std::map<std::string, std::string> chiefs(chief.begin(), chief.end());
  for (std::size_t r = 1; r < all.size(); ++r) {
    std::map<std::string, std::string> theirs(all[r].begin(), all[r].end());
    // Every field either side has, in the chief's order first.
    std::vector<std::string> names;
    for (const auto& [name, value] : chief) names.push_back(name);
    for (const auto& [name, value] : all[r]) {
      if (!chiefs.count(name)) names.push_back(name);
    }
    for (const auto& name : names) {
      const auto mine = chiefs.find(name);
      const auto it = theirs.find(name);
      const std::string value = mine == chiefs.end() ? "(nothing)" : mine->second;
      const std::string seen = it == theirs.end() ? "(nothing)" : it->second;
      if (seen == value) continue;
      if (++differences <= 8) {
        diff += "\n  " + name + ": worker rank " + std::to_string(r) + " has " + seen +
                ", the chief (rank 0) has " + value;
      }
    }
  }
  if (differences == 0) return;
  if (differences > 8) diff += "\n  ... and " + std::to_string(differences - 8) + " more";
  throw ConfigError("the workers disagree on the training setup, so none of them starts (" +
                    std::to_string(differences) + " difference(s)):" + diff +
                    "\nstart every worker with the same model, flags and flotilla/LibTorch build");
}

MirroredStrategy::MirroredStrategy(const collective::CommunicationOptions& options, int replicas)
    : Strategy(cluster::single_worker(), collective::Communicator::local_group(1, options).front(),
               replicas) {}

MultiWorkerMirroredStrategy::MultiWorkerMirroredStrategy(
    const cluster::ClusterSpec& cluster, const collective::CommunicationOptions& options,
    int replicas_per_worker)
    : Strategy(cluster, collective::Communicator::connect(cluster, options), replicas_per_worker) {}

} // namespace flotilla::strategy
