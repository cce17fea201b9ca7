#include "flotilla/train/optimizers.h"

#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_foreach_addcdiv.h>
#include <ATen/ops/_foreach_addcmul.h>
#include <ATen/ops/_foreach_div.h>
#include <ATen/ops/_foreach_maximum.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_foreach_sqrt.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <sstream>
#include <unordered_set>

#include "flotilla/error.h"

namespace flotilla::train {

namespace {
// The closure's loss, evaluated with gradients on, as LibTorch's optimizers do first.
torch::Tensor closure_loss(const torch::optim::Optimizer::LossClosure& closure) {
  if (!closure) return {};
  torch::AutoGradMode enable_grad(true);
  return closure();
}

// LibTorch's SGD, each group's update done for all its tensors at once (PyTorch's foreach
// path, its default on CUDA): a few multi-tensor kernels instead of three or four per parameter,
// which on a GPU is most of a small model's optimizer step. The same operations in the same
// order on each element, so the same numbers (Optimizers.SgdMatchesLibTorchsBitForBit compares with
// torch::equal),
// and the same state (SGDParamState momentum buffers), so checkpoints, backups and the elastic
// state transfer see LibTorch's SGD.
class ForeachSGD : public torch::optim::SGD {
 public:
  using torch::optim::SGD::SGD;

  torch::Tensor step(LossClosure closure = nullptr) override {
    torch::NoGradGuard no_grad;
    const torch::Tensor loss = closure_loss(closure);
    for (auto& group : param_groups_) {
      const auto& o = static_cast<const torch::optim::SGDOptions&>(group.options());
      std::vector<torch::Tensor> params, grads, bufs, buf_grads;
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        params.push_back(p);
        grads.push_back(p.grad());
      }
      if (params.empty()) continue;
      std::vector<torch::Tensor> updates =
          o.weight_decay() != 0 ? at::_foreach_add(grads, params, o.weight_decay()) : grads;
      if (o.momentum() != 0) {
        // A parameter's first step starts its buffer at the update; later ones decay it.
        std::vector<torch::Tensor> momentum(params.size());
        for (std::size_t i = 0; i < params.size(); ++i) {
          auto found = state_.find(params[i].unsafeGetTensorImpl());
          if (found == state_.end()) {
            momentum[i] = updates[i].clone().detach();
            auto state = std::make_unique<torch::optim::SGDParamState>();
            state->momentum_buffer(momentum[i]);
            state_[params[i].unsafeGetTensorImpl()] = std::move(state);
          } else {
            momentum[i] =
                static_cast<torch::optim::SGDParamState&>(*found->second).momentum_buffer();
            bufs.push_back(momentum[i]);
            buf_grads.push_back(updates[i]);
          }
        }
        if (!bufs.empty()) {
          at::_foreach_mul_(bufs, o.momentum());
          at::_foreach_add_(bufs, buf_grads, 1 - o.dampening());
        }
        updates = o.nesterov() ? at::_foreach_add(updates, momentum, o.momentum()) : momentum;
      }
      at::_foreach_add_(params, updates, -1 * o.lr());
    }
    return loss;
  }
};

// LibTorch's Adam (kDecoupled false) or AdamW (true), each group's update done for all its
// tensors at once, as ForeachSGD does for SGD: the same operations in the same order on each
// element, the same state (AdamParamState / AdamWParamState: step, exp_avg, exp_avg_sq,
// max_exp_avg_sq), so the same numbers (Optimizers.AdamAndAdamWMatchLibTorchsBitForBit) and
// checkpoints. Steps may differ between parameters (one that joined late), so the bias
// corrections are one scalar per tensor.
template <typename Base, typename Options, typename State, bool kDecoupled>
class ForeachAdam : public Base {
 public:
  using Base::Base;

  torch::Tensor step(torch::optim::Optimizer::LossClosure closure = nullptr) override {
    torch::NoGradGuard no_grad;
    const torch::Tensor loss = closure_loss(closure);
    for (auto& group : this->param_groups_) {
      const auto& o = static_cast<const Options&>(group.options());
      const auto [beta1, beta2] = o.betas();
      std::vector<torch::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs;
      std::vector<at::Scalar> bias2_roots, neg_step_sizes;
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        State& state = state_of(p, o.amsgrad());
        state.step(state.step() + 1);
        params.push_back(p);
        grads.push_back(p.grad());
        exp_avgs.push_back(state.exp_avg());
        exp_avg_sqs.push_back(state.exp_avg_sq());
        if (o.amsgrad()) max_exp_avg_sqs.push_back(state.max_exp_avg_sq());
        const double step = static_cast<double>(state.step());
        bias2_roots.emplace_back(std::sqrt(1 - std::pow(beta2, step)));
        neg_step_sizes.emplace_back(-(o.lr() / (1 - std::pow(beta1, step))));
      }
      if (params.empty()) continue;
      if (o.weight_decay() != 0) {
        if (kDecoupled) {
          at::_foreach_mul_(params, 1 - o.lr() * o.weight_decay());
        } else {
          grads = at::_foreach_add(grads, params, o.weight_decay());
        }
      }
      at::_foreach_mul_(exp_avgs, beta1);
      at::_foreach_add_(exp_avgs, grads, 1 - beta1);
      at::_foreach_mul_(exp_avg_sqs, beta2);
      at::_foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2);
      if (o.amsgrad()) at::_foreach_maximum_(max_exp_avg_sqs, exp_avg_sqs);
      std::vector<torch::Tensor> denoms =
          at::_foreach_sqrt(o.amsgrad() ? max_exp_avg_sqs : exp_avg_sqs);
      at::_foreach_div_(denoms, bias2_roots);
      at::_foreach_add_(denoms, o.eps());
      at::_foreach_addcdiv_(params, exp_avgs, denoms, neg_step_sizes);
    }
    return loss;
  }

 private:
  // A parameter's state, made at its first step as LibTorch makes it.
  State& state_of(const torch::Tensor& p, bool amsgrad) {
    auto& slot = this->state_[p.unsafeGetTensorImpl()];
    if (!slot) {
      auto state = std::make_unique<State>();
      state->step(0);
      state->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
      state->exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
      if (amsgrad) state->max_exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
      slot = std::move(state);
    }
    return static_cast<State&>(*slot);
  }
};
using ForeachAdamOptimizer = ForeachAdam<torch::optim::Adam, torch::optim::AdamOptions,
                                         torch::optim::AdamParamState, /*kDecoupled=*/false>;
using ForeachAdamWOptimizer = ForeachAdam<torch::optim::AdamW, torch::optim::AdamWOptions,
                                          torch::optim::AdamWParamState, /*kDecoupled=*/true>;

// Adam or AdamW (their options have the same fields) at learning rate `lr`.
template <typename Optimizer, typename Options>
std::unique_ptr<torch::optim::Optimizer> adam_like(std::vector<torch::Tensor> parameters,
                                                   const OptimizerOptions& o, double lr) {
  return std::make_unique<Optimizer>(std::move(parameters), Options(lr)
                                                                .betas({o.beta_1, o.beta_2})
                                                                .eps(o.epsilon)
                                                                .weight_decay(o.weight_decay)
                                                                .amsgrad(o.amsgrad));
}
} // namespace

OptimizerOptions OptimizerOptions::sgd(double learning_rate, double momentum, bool nesterov) {
  OptimizerOptions o;
  o.learning_rate = learning_rate;
  o.momentum = momentum;
  o.nesterov = nesterov;
  return o;
}

OptimizerOptions OptimizerOptions::adam(double learning_rate) {
  OptimizerOptions o;
  o.kind = OptimizerKind::kAdam;
  o.learning_rate = learning_rate;
  return o;
}

OptimizerOptions OptimizerOptions::adamw(double learning_rate, double weight_decay) {
  OptimizerOptions o = adam(learning_rate);
  o.kind = OptimizerKind::kAdamW;
  o.weight_decay = weight_decay;
  return o;
}

double OptimizerOptions::learning_rate_at(std::int64_t step) const {
  return schedule ? (*schedule)(step) : learning_rate;
}

std::string OptimizerOptions::describe() const {
  std::ostringstream out;
  const char* names[] = {"SGD", "Adam", "AdamW"};
  out << (custom ? "your optimizer" : names[static_cast<int>(kind)]) << "(learning_rate=";
  if (schedule) {
    out << schedule->describe();
  } else if (custom) {
    out << "its first group's";
  } else {
    out << learning_rate;
  }
  if (!custom) { // your optimizer's options are its own
    if (kind == OptimizerKind::kSGD) {
      if (momentum != 0) out << ", momentum=" << momentum;
      if (nesterov) out << ", nesterov=true";
    } else {
      out << ", beta_1=" << beta_1 << ", beta_2=" << beta_2 << ", epsilon=" << epsilon;
      if (amsgrad) out << ", amsgrad=true";
    }
    if (weight_decay != 0) out << ", weight_decay=" << weight_decay;
  }
  if (global_clipnorm > 0) out << ", global_clipnorm=" << global_clipnorm;
  out << ")";
  return out.str();
}

OptimizerKind parse_optimizer(const std::string& name) {
  if (name == "sgd") return OptimizerKind::kSGD;
  if (name == "adam") return OptimizerKind::kAdam;
  if (name == "adamw") return OptimizerKind::kAdamW;
  throw ConfigError("optimizer \"" + name + "\" is not available; use sgd, adam or adamw");
}

void validate(const OptimizerOptions& o) {
  auto bad = [](const std::string& what, double value, const std::string& rule) {
    throw ConfigError(what + " must be " + rule + "; saw " + std::to_string(value));
  };
  if (!(o.global_clipnorm >= 0) || std::isinf(o.global_clipnorm)) {
    bad("global_clipnorm", o.global_clipnorm, "a finite number at least 0 (0: no clipping)");
  }
  if (o.custom) return; // your optimizer's own options are its own
  if (!o.schedule && !(o.learning_rate > 0)) bad("learning rate", o.learning_rate, "positive");
  if (!(o.weight_decay >= 0)) bad("weight_decay", o.weight_decay, "at least 0");
  if (o.kind == OptimizerKind::kSGD) {
    if (!(o.momentum >= 0 && o.momentum < 1)) bad("momentum", o.momentum, "in [0, 1)");
    if (o.nesterov && o.momentum == 0) {
      throw ConfigError("Nesterov momentum needs momentum > 0; saw momentum 0");
    }
    return;
  }
  if (!(o.beta_1 >= 0 && o.beta_1 < 1)) bad("beta_1", o.beta_1, "in [0, 1)");
  if (!(o.beta_2 >= 0 && o.beta_2 < 1)) bad("beta_2", o.beta_2, "in [0, 1)");
  if (!(o.epsilon > 0)) bad("epsilon", o.epsilon, "positive");
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerOptions& o,
                                                        std::vector<torch::Tensor> parameters) {
  validate(o);
  const double lr = o.learning_rate_at(0);
  switch (o.kind) {
  case OptimizerKind::kSGD:
    return std::make_unique<ForeachSGD>(std::move(parameters), torch::optim::SGDOptions(lr)
                                                                   .momentum(o.momentum)
                                                                   .nesterov(o.nesterov)
                                                                   .weight_decay(o.weight_decay));
  case OptimizerKind::kAdam:
    return adam_like<ForeachAdamOptimizer, torch::optim::AdamOptions>(std::move(parameters), o, lr);
  case OptimizerKind::kAdamW:
    return adam_like<ForeachAdamWOptimizer, torch::optim::AdamWOptions>(std::move(parameters), o,
                                                                        lr);
  }
  throw ConfigError("unknown optimizer");
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerOptions& options,
                                                        torch::nn::Module& replica) {
  if (!options.custom) return make_optimizer(options, replica.parameters());
  validate(options);
  auto optimizer = options.custom(replica);
  const std::string what = "OptimizerOptions::custom ";
  if (!optimizer) throw ConfigError(what + "returned no optimizer");
  if (dynamic_cast<const torch::optim::LBFGS*>(optimizer.get())) {
    throw ConfigError(what + "returned an LBFGS, which steps with a closure that evaluates the "
                             "loss again; fit() takes one step per batch: use SGD, Adam, AdamW, "
                             "RMSprop, Adagrad or an optimizer of your own");
  }
  const auto& groups = optimizer->param_groups();
  if (groups.empty()) throw ConfigError(what + "returned an optimizer with no parameter group");
  std::unordered_set<const void*> own;
  for (const auto& p : replica.parameters()) own.insert(p.unsafeGetTensorImpl());
  for (std::size_t g = 0; g < groups.size(); ++g) {
    for (std::size_t i = 0; i < groups[g].params().size(); ++i) {
      if (!own.count(groups[g].params()[i].unsafeGetTensorImpl())) {
        throw ConfigError(what + "returned an optimizer whose group " + std::to_string(g) +
                          " holds a tensor (number " + std::to_string(i) +
                          ") that is not a parameter of the replica it was given; its "
                          "gradient would not be all-reduced. Build it from that module's "
                          "parameters (replica.parameters() or named_parameters())");
      }
    }
  }
  const double first = groups.front().options().get_lr();
  if (!(first > 0)) {
    throw ConfigError(what + "returned an optimizer whose first group's learning rate is " +
                      std::to_string(first) +
                      "; it must be positive (the other groups' rates "
                      "are kept as ratios to it)");
  }
  return optimizer;
}

void set_learning_rate(torch::optim::Optimizer& optimizer, double learning_rate) {
  for (auto& group : optimizer.param_groups()) group.options().set_lr(learning_rate);
}

std::vector<double> learning_rate_ratios(const torch::optim::Optimizer& optimizer) {
  std::vector<double> ratios;
  const auto& groups = optimizer.param_groups();
  for (const auto& group : groups) {
    ratios.push_back(group.options().get_lr() / groups.front().options().get_lr());
  }
  return ratios;
}

void set_learning_rate(torch::optim::Optimizer& optimizer, double learning_rate,
                       const std::vector<double>& ratios) {
  auto& groups = optimizer.param_groups();
  for (std::size_t g = 0; g < groups.size(); ++g) {
    groups[g].options().set_lr(g == 0 ? learning_rate : learning_rate * ratios.at(g));
  }
}

} // namespace flotilla::train
