#include "flotilla/train/sync_batchnorm.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/init.h>

#include "flotilla/error.h"
#include "flotilla/train/torchscript.h"
#include "train/sync_batchnorm_core.h"

namespace flotilla::train {
namespace {

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

namespace {

// SyncBatchNorm's backward with the global batch's statistics: LibTorch's fused BatchNorm
// backward (in evaluation form, with the global mean and variance) gives the local Σdy,
// Σdy·(x-μ)·invstd and dy·invstd·γ in one pass; the first two are summed over every replica,
// and the input gradient gets the global means' correction, an affine function of x per
// channel. The weight and bias gradients stay local: the gradient engine averages them.
struct SyncBatchNormBackward : torch::autograd::Node {
  strategy::ReplicaContext context;
  torch::Tensor input, weight, mean, var, invstd; // weight: ones where the layer has none
  double count = 0, eps = 0;
  bool has_weight = false, has_bias = false;

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    const std::int64_t c = mean.size(0);
    torch::Tensor grad_input, grad_weight, grad_bias;
    torch::Tensor local; // Σdy, Σdy·(x-μ) (float64)
    if (input.numel() == 0) {
      // No rows on this replica (the fused kernel cannot take an empty batch): it still joins.
      grad_input = torch::zeros_like(input);
      grad_weight = torch::zeros_like(weight);
      grad_bias = torch::zeros_like(weight);
      local = torch::zeros({2 * c}, weight.options().dtype(torch::kDouble));
    } else {
      const torch::Tensor dy = grads[0].defined() ? grads[0] : torch::zeros_like(input);
      std::tie(grad_input, grad_weight, grad_bias) = at::native_batch_norm_backward(
          dy, input, weight, mean, var, {}, {}, /*train=*/false, eps, {true, true, true});
      local = torch::cat({grad_bias.to(torch::kDouble), (grad_weight / invstd).to(torch::kDouble)});
    }
    const torch::Tensor global = context.all_reduce_sum(local);
    // float32 for float32 and half-precision inputs, float64 for float64 ones.
    const torch::Dtype compute =
        input.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
    const torch::Tensor mean_dy = (global.narrow(0, 0, c) / count).to(compute);
    const torch::Tensor mean_dy_xmu = (global.narrow(0, c, c) / count).to(compute);
    if (input.numel() > 0) {
      // grad_input = γ·invstd·(dy - mean(dy) - (x-μ)·invstd²·mean(dy·(x-μ))) = the local term
      // + a·x + b per channel.
      const torch::Tensor k = weight * invstd;
      const torch::Tensor a = -k * invstd.square() * mean_dy_xmu;
      const torch::Tensor b = -k * mean_dy - a * mean;
      std::vector<std::int64_t> shape(static_cast<std::size_t>(input.dim()), 1);
      shape[1] = c;
      grad_input = (grad_input.to(compute) + input.to(compute) * a.view(shape) + b.view(shape))
                       .to(input.scalar_type());
    }
    return {grad_input, has_weight ? grad_weight : torch::Tensor(),
            has_bias ? grad_bias : torch::Tensor()};
  }
  std::string name() const override { return "SyncBatchNormBackward"; }
  void release_variables() override {
    input.reset();
    weight.reset();
  }
};

} // namespace

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
  const bool update = is_training() && options.track_running_stats();
  // Evaluation without running statistics normalises each replica's batch alone: evaluate()
  // runs one replica, which must not wait for the others.
  return detail::global_batch_norm(
      input, weight, bias, update ? running_mean : torch::Tensor(),
      update ? running_var : torch::Tensor(),
      [&] {
        torch::NoGradGuard no_grad;
        num_batches_tracked.add_(1);
        return options.momentum()
                   ? *options.momentum()
                   : 1.0 / static_cast<double>(num_batches_tracked.item<std::int64_t>());
      },
      options.eps(), is_training() ? context_ : strategy::ReplicaContext());
}

namespace detail {

torch::Tensor global_batch_norm(const torch::Tensor& input, const torch::Tensor& weight,
                                const torch::Tensor& bias, const torch::Tensor& running_mean,
                                const torch::Tensor& running_var,
                                const std::function<double()>& momentum, double eps,
                                const strategy::ReplicaContext& context) {
  const std::int64_t c = input.size(1);
  std::vector<std::int64_t> dims = {0};
  for (std::int64_t d = 2; d < input.dim(); ++d) dims.push_back(d);
  const torch::TensorOptions stats =
      (weight.defined() ? weight.options() : input.options().dtype(torch::kFloat))
          .requires_grad(false);
  torch::Tensor global;
  {
    torch::NoGradGuard no_grad;
    // This replica's mean and variance (one fused pass, in float32 whatever autocast gave, or
    // float64), as
    // sums n·mean and n·(var + mean²) in float64, with n; summed over every replica.
    const double n = static_cast<double>(input.numel() / c);
    torch::Tensor local = torch::zeros({2 * c + 1}, stats.dtype(torch::kDouble));
    if (n > 0) {
      const torch::Tensor x =
          input.scalar_type() == torch::kDouble ? input : input.to(torch::kFloat);
      const auto [var_l, mean_l] = torch::var_mean(x, dims, /*correction=*/0, /*keepdim=*/false);
      const torch::Tensor m = mean_l.to(torch::kDouble);
      local.narrow(0, 0, c).copy_(m * n);
      local.narrow(0, c, c).copy_((var_l.to(torch::kDouble) + m.square()) * n);
      local[2 * c] = n;
    }
    global = context.all_reduce_sum(local);
  }
  const double count = global[2 * c].item<double>();
  if (count <= 1) {
    throw ConfigError("SyncBatchNorm: expected more than 1 value per channel in training; the "
                      "global batch has " +
                      std::to_string(static_cast<std::int64_t>(count)) +
                      " (input on this replica " + c10::str(input.sizes()) + ")");
  }
  const torch::Tensor mean64 = global.narrow(0, 0, c) / count;
  const torch::Tensor var64 = (global.narrow(0, c, c) / count - mean64.square()).clamp_min(0);
  const torch::Tensor mean = mean64.to(stats.dtype());
  const torch::Tensor var = var64.to(stats.dtype());
  if (running_mean.defined() && running_var.defined()) {
    const double factor = momentum();
    torch::NoGradGuard no_grad;
    running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype()), factor);
    running_var.mul_(1 - factor).add_((var64 * (count / (count - 1))).to(running_var.dtype()),
                                      factor);
  }
  const torch::Tensor gamma = weight.defined() ? weight : torch::ones({c}, stats);
  torch::Tensor output;
  {
    torch::NoGradGuard no_grad;
    output = input.numel() == 0
                 ? torch::empty_like(input)
                 : torch::batch_norm(input, gamma, bias, mean, var, /*training=*/false, 0.0, eps,
                                     /*cudnn_enabled=*/true);
  }
  const bool needs_grad = torch::GradMode::is_enabled() &&
                          (input.requires_grad() || (weight.defined() && weight.requires_grad()) ||
                           (bias.defined() && bias.requires_grad()));
  if (needs_grad) {
    auto node = std::shared_ptr<SyncBatchNormBackward>(new SyncBatchNormBackward(),
                                                       torch::autograd::deleteNode);
    node->context = context;
    node->input = input.detach();
    node->weight = gamma.detach();
    node->mean = mean;
    node->var = var;
    node->invstd = (var + eps).rsqrt();
    node->count = count;
    node->eps = eps;
    node->has_weight = weight.defined();
    node->has_bias = bias.defined();
    node->set_next_edges(torch::autograd::collect_next_edges(input, weight, bias));
    torch::autograd::set_history(output, node);
  }
  return output;
}

} // namespace detail

torch::nn::Sequential convert_sync_batchnorm(const torch::nn::Sequential& module) {
  return torch::nn::Sequential(convert_sequential(module.ptr(), ""));
}

int bind_sync_batchnorm(torch::nn::Module& module, const strategy::ReplicaContext& context) {
  int bound = 0;
  for (const auto& m : module.modules()) {
    if (auto* sync = dynamic_cast<SyncBatchNormImpl*>(m.get())) {
      sync->set_replica_context(context);
      ++bound;
    } else if (auto* script = dynamic_cast<TorchScriptModuleImpl*>(m.get())) {
      script->set_replica_context(context);
      bound += script->sync_batchnorm_layers();
    }
  }
  return bound;
}

} // namespace flotilla::train
