#include "flotilla/train/sync_batchnorm.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/init.h>

#include "flotilla/error.h"

namespace flotilla::train {
namespace {

// The gradient of a cross-replica sum is the cross-replica sum of the gradients: every replica's
// loss depends on every replica's contribution.
struct CrossReplicaSumBackward : torch::autograd::Node {
  strategy::ReplicaContext context;
  std::vector<std::int64_t> sizes;
  torch::TensorOptions options;

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    // An output no loss depends on still joins the reduction: the others wait for it.
    const torch::Tensor grad = grads[0].defined() ? grads[0] : torch::zeros(sizes, options);
    return {context.all_reduce_sum(grad)};
  }
  std::string name() const override { return "CrossReplicaSumBackward"; }
};

torch::Tensor cross_replica_sum(const strategy::ReplicaContext& context, const torch::Tensor& x) {
  if (context.alone()) return x;
  torch::Tensor out = context.all_reduce_sum(x.detach());
  if (torch::GradMode::is_enabled() && x.requires_grad()) {
    auto node = std::shared_ptr<CrossReplicaSumBackward>(new CrossReplicaSumBackward(),
                                                         torch::autograd::deleteNode);
    node->context = context;
    node->sizes = x.sizes().vec();
    node->options = x.options();
    node->set_next_edges(torch::autograd::collect_next_edges(x));
    torch::autograd::set_history(out, node);
  }
  return out;
}

bool is_batchnorm(const torch::nn::Module& m) {
  return dynamic_cast<const torch::nn::BatchNorm1dImpl*>(&m) ||
         dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&m) ||
         dynamic_cast<const torch::nn::BatchNorm3dImpl*>(&m);
}

template <class Impl>
std::shared_ptr<SyncBatchNormImpl> sync_copy_of(const torch::nn::Module& m) {
  const auto* bn = dynamic_cast<const Impl*>(&m);
  if (!bn) return nullptr;
  auto sync = std::make_shared<SyncBatchNormImpl>(bn->options);
  torch::NoGradGuard no_grad;
  auto copy = [](torch::Tensor& to, const torch::Tensor& from) {
    if (from.defined()) to.set_data(from.detach().clone());
  };
  copy(sync->weight, bn->weight);
  copy(sync->bias, bn->bias);
  copy(sync->running_mean, bn->running_mean);
  copy(sync->running_var, bn->running_var);
  copy(sync->num_batches_tracked, bn->num_batches_tracked);
  if (bn->weight.defined()) sync->weight.set_requires_grad(bn->weight.requires_grad());
  if (bn->bias.defined()) sync->bias.set_requires_grad(bn->bias.requires_grad());
  sync->train(bn->is_training());
  return sync;
}

std::shared_ptr<SyncBatchNormImpl> sync_copy(const torch::nn::Module& m) {
  if (auto s = sync_copy_of<torch::nn::BatchNorm1dImpl>(m)) return s;
  if (auto s = sync_copy_of<torch::nn::BatchNorm2dImpl>(m)) return s;
  return sync_copy_of<torch::nn::BatchNorm3dImpl>(m);
}

// The converted module: a SyncBatchNorm for a BatchNorm, a new Sequential where a child changed,
// otherwise `m` itself (its children converted in place, where it lets us).
std::shared_ptr<torch::nn::Module> convert(const std::shared_ptr<torch::nn::Module>& m,
                                           const std::string& path);

std::shared_ptr<torch::nn::SequentialImpl>
convert_sequential(const std::shared_ptr<torch::nn::SequentialImpl>& seq, const std::string& path) {
  auto rebuilt = std::make_shared<torch::nn::SequentialImpl>();
  bool changed = false;
  const auto children = seq->named_children();
  std::size_t i = 0;
  for (const auto& any : *seq) {
    const std::string& name = children[i++].key();
    const auto converted = convert(any.ptr(), path.empty() ? name : path + "." + name);
    if (converted == any.ptr()) {
      rebuilt->push_back(name, any);
    } else {
      // Only a BatchNorm is replaced here (a Sequential cannot hold another Sequential; the
      // modules it holds are converted in place).
      rebuilt->push_back(name, std::dynamic_pointer_cast<SyncBatchNormImpl>(converted));
      changed = true;
    }
  }
  if (!changed) return seq;
  // The container's mode, without changing any layer's own (a frozen BatchNorm stays in eval;
  // the modules around it are shared with the original).
  std::vector<std::pair<std::shared_ptr<torch::nn::Module>, bool>> modes;
  for (const auto& m : rebuilt->modules(/*include_self=*/false)) modes.emplace_back(m, m->is_training());
  rebuilt->train(seq->is_training());
  for (const auto& [m, training] : modes) m->train(training);
  return rebuilt;
}

std::shared_ptr<torch::nn::Module> convert(const std::shared_ptr<torch::nn::Module>& m,
                                           const std::string& path) {
  if (is_batchnorm(*m)) return sync_copy(*m);
  if (auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(m)) {
    return convert_sequential(seq, path);
  }
  for (const auto& child : m->named_children()) {
    const std::string where = path.empty() ? child.key() : path + "." + child.key();
    const auto converted = convert(child.value(), where);
    if (converted == child.value()) continue;
    auto* replaceable = dynamic_cast<ReplaceableChildren*>(m.get());
    if (!replaceable) {
      throw ConfigError(
          "convert_sync_batchnorm: the BatchNorm at \"" + where + "\" belongs to " + m->name() +
          ", a module that calls its submodules through members the conversion cannot reach; "
          "build that layer as train::SyncBatchNorm in " +
          m->name() + ", or derive it from train::ReplaceableChildren");
    }
    replaceable->replace_child(child.key(), converted);
  }
  return m;
}

} // namespace

SyncBatchNormImpl::SyncBatchNormImpl(const torch::nn::BatchNormOptions& options_)
    : options(options_) {
  if (options.num_features() < 1) {
    throw ConfigError("SyncBatchNorm needs num_features >= 1; saw " +
                      std::to_string(options.num_features()));
  }
  reset();
}

void SyncBatchNormImpl::reset() {
  const std::int64_t c = options.num_features();
  if (options.affine()) {
    weight = register_parameter("weight", torch::empty({c}));
    bias = register_parameter("bias", torch::empty({c}));
  } else {
    weight = register_parameter("weight", torch::Tensor(), /*requires_grad=*/false);
    bias = register_parameter("bias", torch::Tensor(), /*requires_grad=*/false);
  }
  if (options.track_running_stats()) {
    running_mean = register_buffer("running_mean", torch::zeros({c}));
    running_var = register_buffer("running_var", torch::ones({c}));
    num_batches_tracked = register_buffer("num_batches_tracked", torch::tensor(0, torch::kLong));
  } else {
    running_mean = register_buffer("running_mean", torch::Tensor());
    running_var = register_buffer("running_var", torch::Tensor());
    num_batches_tracked = register_buffer("num_batches_tracked", torch::Tensor());
  }
  reset_parameters();
}

void SyncBatchNormImpl::reset_running_stats() {
  if (!options.track_running_stats()) return;
  running_mean.zero_();
  running_var.fill_(1);
  num_batches_tracked.zero_();
}

void SyncBatchNormImpl::reset_parameters() {
  reset_running_stats();
  if (options.affine()) {
    torch::nn::init::ones_(weight);
    torch::nn::init::zeros_(bias);
  }
}

void SyncBatchNormImpl::pretty_print(std::ostream& stream) const {
  stream << "flotilla::train::SyncBatchNorm(" << options.num_features()
         << ", eps=" << options.eps() << ", momentum=";
  if (options.momentum()) {
    stream << *options.momentum();
  } else {
    stream << "None";
  }
  stream << ", affine=" << options.affine()
         << ", track_running_stats=" << options.track_running_stats() << ")";
}

torch::Tensor SyncBatchNormImpl::forward(const torch::Tensor& input) {
  const std::int64_t c = options.num_features();
  if (input.dim() < 2 || input.size(1) != c) {
    throw ConfigError("SyncBatchNorm(" + std::to_string(c) + ") expects input [N, " +
                      std::to_string(c) + ", ...]; saw " + c10::str(input.sizes()));
  }
  const bool batch_statistics = is_training() || !options.track_running_stats();
  if (!batch_statistics) {
    return torch::batch_norm(input, weight, bias, running_mean, running_var, /*training=*/false,
                             0.0, options.eps(), /*cudnn_enabled=*/true);
  }
  std::vector<std::int64_t> dims = {0};
  for (std::int64_t d = 2; d < input.dim(); ++d) dims.push_back(d);
  // The statistics in float32 whatever the input (autocast's bfloat16), accumulated in float64:
  // E[x²] - E[x]² over a global batch is exact enough there.
  const torch::Tensor x = input.scalar_type() == torch::kDouble ? input : input.to(torch::kFloat);
  const double local_count = c == 0 ? 0.0 : static_cast<double>(input.numel() / c);
  const torch::Tensor local = torch::cat(
      {x.sum(dims, false, torch::kDouble), x.square().sum(dims, false, torch::kDouble),
       torch::full({1}, local_count, x.options().dtype(torch::kDouble))});
  // Evaluation without running statistics normalises each replica's batch alone: evaluate()
  // runs one replica, which must not wait for the others.
  const torch::Tensor global = is_training() ? cross_replica_sum(context_, local) : local;
  const double count = global[2 * c].item<double>();
  if (count <= 1) {
    throw ConfigError("SyncBatchNorm: expected more than 1 value per channel in training; the "
                      "global batch has " +
                      std::to_string(static_cast<std::int64_t>(count)) +
                      " (input on this replica " + c10::str(input.sizes()) + ")");
  }
  const torch::Tensor mean = global.narrow(0, 0, c) / count;
  const torch::Tensor var = (global.narrow(0, c, c) / count - mean.square()).clamp_min(0);
  if (is_training() && options.track_running_stats()) {
    torch::NoGradGuard no_grad;
    num_batches_tracked.add_(1);
    const double factor = options.momentum()
                              ? *options.momentum()
                              : 1.0 / static_cast<double>(num_batches_tracked.item<std::int64_t>());
    running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype()), factor);
    running_var.mul_(1 - factor).add_((var * (count / (count - 1))).to(running_var.dtype()),
                                      factor);
  }
  std::vector<std::int64_t> shape(static_cast<std::size_t>(input.dim()), 1);
  shape[1] = c;
  torch::Tensor scale = (var + options.eps()).rsqrt().to(x.scalar_type());
  torch::Tensor shift = -mean.to(x.scalar_type()) * scale;
  if (weight.defined()) {
    scale = scale * weight.to(x.scalar_type());
    shift = shift * weight.to(x.scalar_type());
  }
  if (bias.defined()) shift = shift + bias.to(x.scalar_type());
  return (x * scale.view(shape) + shift.view(shape)).to(input.scalar_type());
}

torch::nn::Sequential convert_sync_batchnorm(const torch::nn::Sequential& module) {
  return torch::nn::Sequential(convert_sequential(module.ptr(), ""));
}

int bind_sync_batchnorm(torch::nn::Module& module, const strategy::ReplicaContext& context) {
  int bound = 0;
  for (const auto& m : module.modules()) {
    if (auto* sync = dynamic_cast<SyncBatchNormImpl*>(m.get())) {
      sync->set_replica_context(context);
      ++bound;
    }
  }
  return bound;
}

} // namespace flotilla::train
