#include "flotilla/strategy/strategy.h"

#include <torch/cuda.h>

#include <cctype>
#include <map>
#include <set>

#include "flotilla/cluster/resolvers.h"
#include "flotilla/collective/agreement.h"
#include "flotilla/collective/elastic.h"
#include "flotilla/error.h"

namespace flotilla::strategy {

namespace {

int cuda_devices() {
  return torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
}

std::string visible_text() {
  const int n = cuda_devices();
  return n == 0 ? std::string("no CUDA device is visible")
                : std::to_string(n) +
                      " CUDA device(s) are visible (cuda:0 to cuda:" + std::to_string(n - 1) +
                      "; CUDA_VISIBLE_DEVICES selects them)";
}

std::vector<torch::Device> cpu_replicas(int replicas) {
  if (replicas < 1) {
    throw ConfigError("replicas_per_worker must be at least 1; saw " + std::to_string(replicas));
  }
  return std::vector<torch::Device>(static_cast<std::size_t>(replicas), torch::Device(torch::kCPU));
}

} // namespace

std::vector<torch::Device> visible_devices() {
  std::vector<torch::Device> devices;
  for (int i = 0; i < cuda_devices(); ++i) {
    devices.emplace_back(torch::kCUDA, static_cast<c10::DeviceIndex>(i));
  }
  if (devices.empty()) devices.emplace_back(torch::kCPU);
  return devices;
}

std::vector<torch::Device> default_devices(int replicas) {
  if (replicas < 0) {
    throw ConfigError("replicas_per_worker must be at least 1 (or 0: one per visible GPU); saw " +
                      std::to_string(replicas));
  }
  const int gpus = cuda_devices();
  if (gpus == 0) return cpu_replicas(std::max(replicas, 1));
  if (replicas > gpus) {
    throw ConfigError(std::to_string(replicas) + " replicas per worker asked for, but " +
                      visible_text() + "; ask for at most " + std::to_string(gpus) +
                      ", or list CPU devices for CPU replicas (strategy::parse_devices(\"cpu,cpu,"
                      "...\"))");
  }
  auto devices = visible_devices();
  if (replicas > 0) devices.resize(static_cast<std::size_t>(replicas), devices.front());
  return devices;
}

std::vector<torch::Device> local_share_of_devices(int local_rank, int local_workers) {
  if (local_workers < 1 || local_rank < 0 || local_rank >= local_workers) {
    throw ConfigError("local rank " + std::to_string(local_rank) + " of " +
                      std::to_string(local_workers) +
                      " workers on this host is out of range; check LOCAL_RANK/LOCAL_WORLD_SIZE");
  }
  const int gpus = cuda_devices();
  if (gpus == 0) return {torch::Device(torch::kCPU)};
  if (gpus < local_workers) {
    return {torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(local_rank % gpus))};
  }
  const int each = gpus / local_workers;
  std::vector<torch::Device> devices;
  for (int i = 0; i < each; ++i) {
    devices.emplace_back(torch::kCUDA, static_cast<c10::DeviceIndex>(local_rank * each + i));
  }
  return devices;
}

std::vector<torch::Device> parse_devices(const std::string& text) {
  if (text.empty() || text == "auto") return default_devices(0);
  if (text == "cuda" || text == "gpu") {
    if (cuda_devices() == 0) {
      throw ConfigError("devices \"" + text + "\" asked for every GPU, but " + visible_text() +
                        "; use the CPU (strategy::parse_devices(\"cpu\"))");
    }
    return visible_devices();
  }
  std::vector<torch::Device> devices;
  std::size_t at = 0;
  while (at <= text.size()) {
    const auto comma = text.find(',', at);
    std::string part = text.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    while (!part.empty() && part.front() == ' ') part.erase(0, 1);
    while (!part.empty() && part.back() == ' ') part.pop_back();
    // TF's spelling ("/gpu:1", "/device:GPU:0") as well as LibTorch's ("cuda:1").
    if (!part.empty() && part.front() == '/') part.erase(0, 1);
    for (auto& c : part) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (part.rfind("device:", 0) == 0) part.erase(0, 7);
    if (part.rfind("gpu", 0) == 0) part.replace(0, 3, "cuda");
    try {
      devices.emplace_back(part);
    } catch (const std::exception&) {
      throw ConfigError("device \"" + part + "\" in \"" + text +
                        "\" is not a device; use cpu, cuda or cuda:N, comma-separated");
    }
    if (!devices.back().is_cpu() && !devices.back().is_cuda()) {
      throw ConfigError("device \"" + part + "\" in \"" + text +
                        "\" is neither a CPU nor a CUDA device; flotilla trains on cpu and cuda:N");
    }
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  // "cuda" without an index inside a list means cuda:0, as LibTorch's current device would.
  for (auto& d : devices) {
    if (d.is_cuda() && !d.has_index()) d = torch::Device(torch::kCUDA, 0);
    if (d.is_cpu()) d = torch::Device(torch::kCPU);
  }
  check_devices(devices);
  return devices;
}

void check_devices(const std::vector<torch::Device>& devices) {
  if (devices.empty()) {
    throw ConfigError("a strategy needs at least one replica device; saw an empty list");
  }
  const bool cuda = devices.front().is_cuda();
  for (const auto& d : devices) {
    if (d.is_cuda() != cuda) {
      throw ConfigError("replica devices mix the CPU and CUDA (" + d.str() + " with " +
                        devices.front().str() +
                        "); every replica must be a copy on the same kind of device");
    }
  }
  std::set<int> seen;
  for (const auto& d : devices) {
    if (!d.is_cuda()) continue;
    const int index = d.has_index() ? d.index() : 0;
    if (index >= cuda_devices()) {
      throw ConfigError(
          "device " + d.str() + " was asked for, but " + visible_text() +
          (cuda_devices() == 0 ? "; use the CPU (strategy::parse_devices(\"cpu\"))" : ""));
    }
    if (!seen.insert(index).second) {
      throw ConfigError("device " + d.str() +
                        " is listed twice; one replica per GPU (for more replicas, add GPUs or "
                        "workers)");
    }
  }
}

Strategy::Strategy(cluster::ClusterSpec cluster, collective::Communicator communicator,
                   std::vector<torch::Device> devices)
    : cluster_(std::move(cluster)), communicator_(std::move(communicator)),
      devices_(std::move(devices)), log_(communicator_.rank(), communicator_.size()) {
  check_devices(devices_);
  // "cuda" alone is the first GPU, as parse_devices says: batches are compared by device.
  for (auto& d : devices_) {
    if (d.is_cuda() && !d.has_index()) d = torch::Device(torch::kCUDA, 0);
  }
}

Strategy::Strategy(cluster::ClusterSpec cluster, collective::Communicator communicator,
                   int replicas_per_worker)
    : Strategy(std::move(cluster), std::move(communicator), cpu_replicas(replicas_per_worker)) {}

Strategy::Strategy(cluster::ClusterSpec cluster, std::shared_ptr<collective::ElasticGroup> group,
                   std::vector<torch::Device> devices, ElasticOptions::Batch batch)
    : Strategy(std::move(cluster), group->communicator(), std::move(devices)) {
  elastic_batch_ = batch;
  if (devices_.size() != 1) {
    throw ConfigError("an elastic group runs one replica per worker for now; saw " +
                      std::to_string(devices_.size()) + " (start one worker per device instead)");
  }
  // Generation 0 is the whole cluster starting together; a generation formed after the whole
  // group was lost starts afresh too.
  joining_ = !group->starts_afresh();
  elastic_ = std::move(group);
  log_ = Logger(communicator_.rank(), communicator_.size(), elastic_->generation());
}

collective::Communicator* Strategy::saving_group() {
  if (saves_collectively()) return &communicator_;
  if (!is_chief()) return nullptr;
  if (!saving_alone_) {
    saving_alone_ = std::make_shared<collective::Communicator>(
        // With the group's options: its checkpoint key keys what the chief saves alone.
        collective::Communicator::local_group(1, communicator_.options()).front());
  }
  return saving_alone_.get();
}

void Strategy::adopt_generation() {
  communicator_ = elastic_->communicator();
  shares_.clear(); // the members changed: equal shares until their speeds are measured again
  log_ = Logger(communicator_.rank(), communicator_.size(), elastic_->generation());
}

void Strategy::set_shares(std::vector<std::int64_t> shares) {
  if (!shares.empty() && elastic_ && elastic_batch_ == ElasticOptions::Batch::kPerReplica) {
    throw ConfigError("shares by speed divide a constant global batch; an elastic group keeping "
                      "the per-replica batch (--elastic-batch per-replica) has none to divide; "
                      "leave the shares equal, or keep the global batch");
  }
  cluster::check_shares(shares, num_workers());
  shares_ = std::move(shares);
}

InputContext Strategy::input_context() const {
  InputContext context{num_workers(), worker_index(), num_replicas_in_sync()};
  context.uneven_split = elastic_ != nullptr; // the global batch stays when the members change
  context.shares = shares_;
  if (elastic_ && elastic_batch_ == ElasticOptions::Batch::kPerReplica) {
    context.full_replicas = cluster_.world_size; // one replica per worker in elastic mode
  }
  return context;
}

void Strategy::mirror(torch::nn::Module& module) {
  if (communicator_.size() == 1 || joining_) return;
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
  std::vector<std::vector<std::pair<std::string, std::string>>> all;
  for (const auto& text : collective::all_gather_strings(communicator_, encode(fields))) {
    all.push_back(decode(text));
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
    : MirroredStrategy(default_devices(replicas), options) {}

MirroredStrategy::MirroredStrategy(std::vector<torch::Device> devices,
                                   const collective::CommunicationOptions& options)
    : Strategy(cluster::single_worker(), collective::Communicator::local_group(1, options).front(),
               std::move(devices)) {}

MultiWorkerMirroredStrategy::MultiWorkerMirroredStrategy(
    const cluster::ClusterSpec& cluster, const collective::CommunicationOptions& options,
    int replicas_per_worker, const ElasticOptions& elastic)
    : MultiWorkerMirroredStrategy(cluster, options, default_devices(replicas_per_worker), elastic) {
}

namespace {
// Checks the devices before joining: a bad list fails this worker alone, at once.
collective::Communicator connect_with(const cluster::ClusterSpec& cluster,
                                      const collective::CommunicationOptions& options,
                                      const std::vector<torch::Device>& devices) {
  check_devices(devices);
  return collective::Communicator::connect(cluster, options);
}

std::shared_ptr<collective::ElasticGroup> join_with(const cluster::ClusterSpec& cluster,
                                                    const collective::CommunicationOptions& options,
                                                    const std::vector<torch::Device>& devices) {
  check_devices(devices);
  return collective::ElasticGroup::join(cluster, options);
}
} // namespace

MultiWorkerMirroredStrategy::MultiWorkerMirroredStrategy(
    const cluster::ClusterSpec& cluster, const collective::CommunicationOptions& options,
    std::vector<torch::Device> devices, const ElasticOptions& elastic)
    : Strategy(elastic.enabled
                   ? Strategy(cluster, join_with(cluster, options, devices), devices, elastic.batch)
                   : Strategy(cluster, connect_with(cluster, options, devices), devices)) {}

} // namespace flotilla::strategy
