#include "train/replica_set.h"

#include <torch/nn/utils/clip_grad.h>

#include <condition_variable>
#include <map>
#include <mutex>

#include "flotilla/base/thread_pool.h"
#include "flotilla/error.h"

namespace flotilla::train::detail {

struct ReplicaSet::Threads {
  explicit Threads(int replicas) : pool(replicas - 1), errors(static_cast<std::size_t>(replicas)) {}
  void run(const std::function<void(int)>& fn) {
    std::fill(errors.begin(), errors.end(), nullptr);
    std::mutex mutex;
    std::condition_variable done;
    int remaining = pool.size();
    for (int r = 1; r <= pool.size(); ++r) {
      pool.submit([&, r] {
        try {
          fn(r);
        } catch (...) {
          errors[static_cast<std::size_t>(r)] = std::current_exception();
        }
        std::lock_guard<std::mutex> lock(mutex);
        if (--remaining == 0) done.notify_one();
      });
    }
    try {
      fn(0);
    } catch (...) {
      errors[0] = std::current_exception();
    }
    std::unique_lock<std::mutex> lock(mutex);
    done.wait(lock, [&] { return remaining == 0; });
    for (auto& e : errors) {
      if (e) std::rethrow_exception(e);
    }
  }

  base::ThreadPool pool;
  std::vector<std::exception_ptr> errors;
};

namespace {

// NHWC strides for an NCHW shape, even where a dimension of 1 makes the contiguous strides
// channels-last too: kernels choose their layout by the strides' form (suggest_memory_format),
// so a one-channel image or a 1 -> C convolution's weight with NCHW strides would run NCHW.
std::vector<std::int64_t> nhwc_strides(torch::IntArrayRef s) {
  return {s[1] * s[2] * s[3], 1, s[3] * s[1], s[1]};
}

void set_memory_format(torch::nn::Module& module, bool channels_last) {
  torch::NoGradGuard no_grad;
  const auto format =
      channels_last ? torch::MemoryFormat::ChannelsLast : torch::MemoryFormat::Contiguous;
  auto convert = [&](torch::Tensor t) {
    if (t.dim() != 4 || t.suggest_memory_format() == format) return;
    // set_data keeps the tensor's identity: the optimizer and autograd see the same parameter.
    t.set_data(torch::empty_strided(t.sizes(),
                                    channels_last ? nhwc_strides(t.sizes())
                                                  : t.contiguous().strides().vec(),
                                    t.options())
                   .copy_(t));
  };
  for (const auto& p : module.parameters()) convert(p);
  for (const auto& b : module.buffers()) convert(b);
}

// A 4-D input channels-last: a view where its memory is in that order already (any one-channel
// image), else a copy.
torch::Tensor channels_last(const torch::Tensor& x) {
  if (x.dim() != 4 || x.suggest_memory_format() == torch::MemoryFormat::ChannelsLast) return x;
  if (x.is_contiguous(torch::MemoryFormat::ChannelsLast)) {
    return x.as_strided(x.sizes(), nhwc_strides(x.sizes()), x.storage_offset());
  }
  return x.contiguous(torch::MemoryFormat::ChannelsLast);
}

// The forward, taking its 4-D inputs channels-last.
Model::MultiForward channels_last_input(Model::MultiForward forward) {
  return [forward = std::move(forward)](const Tensors& inputs) {
    if (inputs.size() == 1) return forward(Tensors{channels_last(inputs[0])});
    Tensors converted;
    for (const auto& x : inputs) converted.push_back(channels_last(x));
    return forward(converted);
  };
}

} // namespace

bool has_convolutions(const torch::nn::Module& module) {
  for (const auto& p : module.parameters()) {
    if (p.dim() == 4) return true;
  }
  return false;
}

ReplicaSet::ReplicaSet(const std::vector<torch::Device>& devices, Model::MultiReplica first,
                       const std::function<Model::MultiReplica()>& clone,
                       const OptimizerOptions& optimizer, bool channels_last)
    : devices_(devices) {
  const int replicas = static_cast<int>(devices.size());
  if (replicas > 1 && !clone) {
    throw ConfigError("replicas_per_worker is " + std::to_string(replicas) +
                      ", but this Model cannot copy its module: construct it from a module "
                      "holder (torch::nn::Sequential, a TORCH_MODULE), or pass a clone function");
  }
  // A model built outside scope() is moved here, before the optimizer and the gradient engine
  // take its parameters; but not off a GPU the user chose onto the strategy's CPU.
  for (const auto& p : first.first->parameters()) {
    if (p.is_cuda() && devices.front().is_cpu()) {
      throw ConfigError("the model is on " + p.device().str() +
                        ", but the strategy's replicas are on the CPU; give the strategy that "
                        "device (MirroredStrategy(parse_devices(\"" +
                        p.device().str() + "\"))) or build the model in strategy.scope()");
    }
  }
  first.first->to(devices.front());
  replicas_.push_back(std::move(first));
  for (int r = 1; r < replicas; ++r) {
    replicas_.push_back(clone());
    if (!replicas_.back().first) {
      throw ConfigError("the clone function returned no module for replica " + std::to_string(r));
    }
    replicas_.back().first->to(devices[static_cast<std::size_t>(r)]);
  }
  for (auto& [module, forward] : replicas_) {
    set_memory_format(*module, channels_last);
    if (channels_last) forward = channels_last_input(std::move(forward));
    optimizers_.push_back(make_optimizer(optimizer, *module));
    if (optimizers_.back()->param_groups().size() != optimizers_.front()->param_groups().size()) {
      throw ConfigError("OptimizerOptions::custom gave replica " +
                        std::to_string(optimizers_.size() - 1) + " an optimizer of " +
                        std::to_string(optimizers_.back()->param_groups().size()) +
                        " parameter groups, replica 0 one of " +
                        std::to_string(optimizers_.front()->param_groups().size()) +
                        "; every replica's must be built alike");
    }
  }
  learning_rate_ratios_ = learning_rate_ratios(*optimizers_.front());
  if (replicas > 1) threads_ = std::make_unique<Threads>(replicas);
}

ReplicaSet::~ReplicaSet() = default;

std::vector<std::shared_ptr<torch::nn::Module>> ReplicaSet::modules() const {
  std::vector<std::shared_ptr<torch::nn::Module>> all;
  for (const auto& [module, forward] : replicas_) all.push_back(module);
  return all;
}

std::vector<torch::optim::Optimizer*> ReplicaSet::optimizers() const {
  std::vector<torch::optim::Optimizer*> all;
  for (const auto& optimizer : optimizers_) all.push_back(optimizer.get());
  return all;
}

void ReplicaSet::run(const std::function<void(int)>& fn) {
  if (threads_) {
    threads_->run(fn);
  } else {
    fn(0);
  }
}

void ReplicaSet::copy_first_to_others() {
  if (replicas_.size() < 2) return;
  torch::NoGradGuard no_grad;
  const auto params = module(0).parameters();
  const auto buffers = module(0).buffers();
  for (int r = 1; r < size(); ++r) {
    const auto theirs = module(r).parameters();
    const auto their_buffers = module(r).buffers();
    if (theirs.size() != params.size() || their_buffers.size() != buffers.size()) {
      throw ConfigError("the model now has " + std::to_string(params.size()) + " parameters and " +
                        std::to_string(buffers.size()) + " buffers, its replicas " +
                        std::to_string(theirs.size()) + " and " +
                        std::to_string(their_buffers.size()) +
                        " (changed after compile()); call compile() again");
    }
    for (std::size_t k = 0; k < params.size(); ++k) theirs[k].copy_(params[k]);
    for (std::size_t k = 0; k < buffers.size(); ++k) their_buffers[k].copy_(buffers[k]);
  }
}

void ReplicaSet::mirror_buffers(collective::Communicator& workers, double weight) {
  if (size() == 1 && workers.size() == 1) return;
  torch::NoGradGuard no_grad;
  std::vector<std::vector<torch::Tensor>> buffers;
  for (int r = 0; r < size(); ++r) buffers.push_back(module(r).buffers());
  // One flat tensor per dtype, on replica 0's device.
  std::map<torch::ScalarType, std::vector<std::size_t>> groups;
  for (std::size_t k = 0; k < buffers[0].size(); ++k) {
    if (buffers[0][k].defined()) groups[buffers[0][k].scalar_type()].push_back(k);
  }
  const double replicas = static_cast<double>(size()) * workers.size();
  for (const auto& [dtype, indices] : groups) {
    const bool floating = c10::isFloatingType(dtype);
    auto flat_of = [&](int r) {
      std::vector<torch::Tensor> parts;
      for (const std::size_t k : indices) parts.push_back(buffers[r][k].reshape({-1}));
      return torch::cat(parts).to(device(0));
    };
    torch::Tensor flat = flat_of(0);
    for (int r = 1; r < size(); ++r) {
      if (floating) {
        flat.add_(flat_of(r));
      } else {
        flat = torch::maximum(flat, flat_of(r));
      }
    }
    if (floating && weight > 0) flat.mul_(weight / size()); // the weighted mean's terms
    if (workers.size() > 1) {
      workers.all_reduce(flat, floating ? collective::ReduceOp::kSum : collective::ReduceOp::kMax)
          .wait();
    }
    if (floating && weight <= 0) flat.div_(replicas);
    for (int r = 0; r < size(); ++r) {
      std::int64_t offset = 0;
      for (const std::size_t k : indices) {
        torch::Tensor& b = buffers[r][k];
        b.copy_(flat.narrow(0, offset, b.numel()).view_as(b));
        offset += b.numel();
      }
    }
  }
}

void ReplicaSet::set_training(bool training) {
  for (auto& [module, forward] : replicas_) module->train(training);
}

void ReplicaSet::step(double learning_rate) {
  for (auto& optimizer : optimizers_) {
    set_learning_rate(*optimizer, learning_rate, learning_rate_ratios_);
    optimizer->step();
  }
}

void ReplicaSet::clip_gradients(double max_norm) {
  for (auto& [module, forward] : replicas_) {
    torch::nn::utils::clip_grad_norm_(module->parameters(), max_norm);
  }
}

} // namespace flotilla::train::detail
