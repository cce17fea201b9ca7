#include "flotilla/train/model.h"

#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>
#include <unistd.h>

#include <chrono>

#include "flotilla/checkpoint/model_checkpoint.h"
#include "flotilla/error.h"
#include "flotilla/train/progress.h"

namespace flotilla::train {
namespace F = torch::nn::functional;

Model::Model(strategy::Strategy& strategy, std::shared_ptr<torch::nn::Module> module,
             Forward forward)
    : strategy_(strategy), module_(std::move(module)), forward_(std::move(forward)) {
  if (!module_ || !forward_)
    throw ConfigError("Model needs a module and its forward function");
}

void Model::compile(const CompileOptions& options) {
  for (const auto& metric : options.metrics) {
    if (metric != "accuracy") {
      throw ConfigError("metric \"" + metric + "\" is not available; use \"accuracy\"");
    }
  }
  const auto& sgd = options.optimizer;
  if (!(sgd.learning_rate > 0)) {
    throw ConfigError("learning rate must be positive; saw " + std::to_string(sgd.learning_rate));
  }
  if (sgd.momentum < 0 || sgd.momentum >= 1) {
    throw ConfigError("momentum must be in [0, 1); saw " + std::to_string(sgd.momentum));
  }
  if (sgd.nesterov && sgd.momentum == 0) {
    throw ConfigError("Nesterov momentum needs momentum > 0; saw momentum 0");
  }
  optimizer_ = std::make_unique<torch::optim::SGD>(module().parameters(),
                                                   torch::optim::SGDOptions(sgd.learning_rate)
                                                       .momentum(sgd.momentum)
                                                       .nesterov(sgd.nesterov)
                                                       .weight_decay(sgd.weight_decay));
  reducer_ = std::make_unique<strategy::GradientReducer>(strategy_.make_gradient_reducer(module()));
  compiled_ = options;
}

void Model::require_compiled(const char* what) const {
  if (!compiled_) {
    throw ConfigError(std::string("Model.") + what + "() before compile(); call compile() first");
  }
}

History Model::fit(data::ShardedDataset& train, const FitOptions& options) {
  require_compiled("fit");
  if (options.epochs < 1) {
    throw ConfigError("epochs must be at least 1; saw " + std::to_string(options.epochs));
  }
  if (!train.options().drop_remainder) {
    throw ConfigError(
        "fit() needs a training dataset with drop_remainder: each step is a collective, so every "
        "worker must run the same number of full steps; set ShardOptions.drop_remainder = true");
  }
  const std::int64_t available = train.steps_per_epoch();
  const std::int64_t steps = options.steps_per_epoch.value_or(available);
  if (steps < 1 || steps > available) {
    throw ConfigError("steps_per_epoch " + std::to_string(steps) +
                      " is out of range: the dataset "
                      "gives " +
                      std::to_string(available) + " steps per epoch at global batch " +
                      std::to_string(train.global_batch()));
  }
  Verbosity verbose = options.verbose;
  if (verbose == Verbosity::kAuto) {
    verbose = ::isatty(STDOUT_FILENO) ? Verbosity::kProgressBar : Verbosity::kOneLinePerEpoch;
  }
  Progress progress(strategy_.is_chief() && verbose != Verbosity::kSilent,
                    verbose == Verbosity::kProgressBar);

  History history;
  auto& net = module();
  for (int epoch = 1; epoch <= options.epochs; ++epoch) {
    train.set_epoch(epoch - 1);
    net.train();
    progress.begin_epoch(epoch, options.epochs, steps);
    double loss_sum = 0;
    double correct = 0;
    double count = 0;
    const auto start = std::chrono::steady_clock::now();
    for (std::int64_t step = 0; step < steps; ++step) {
      const data::Batch batch = train.batch(step);
      optimizer_->zero_grad();
      reducer_->prepare();
      const torch::Tensor logits = forward_(batch.features);
      const torch::Tensor loss = F::cross_entropy(logits, batch.labels);
      loss.backward();
      reducer_->finish();
      optimizer_->step();

      const auto n = static_cast<double>(batch.labels.size(0));
      loss_sum += loss.item<double>() * n;
      correct += logits.detach().argmax(1).eq(batch.labels).sum().item<double>();
      count += n;
      progress.step(step + 1, loss_sum / count, correct / count);
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const torch::Tensor totals = strategy_.reduce(
        strategy::ReduceOp::kSum, torch::tensor({loss_sum, correct, count}, torch::kFloat64));
    const double global_count = totals[2].item<double>();
    EpochLogs logs;
    logs.epoch = epoch;
    logs.steps = steps;
    logs.loss = totals[0].item<double>() / global_count;
    logs.accuracy = totals[1].item<double>() / global_count;
    logs.seconds = seconds;
    logs.samples_per_s = global_count / seconds;
    progress.end_epoch(logs);
    if (!options.model_dir.empty()) {
      checkpoint::save_model(strategy_, net, options.model_dir,
                             "ckpt-" + std::to_string(epoch) + ".safetensors",
                             {{"epoch", std::to_string(epoch)}, {"format", "flotilla"}});
    }
    if (options.on_epoch_end)
      options.on_epoch_end(logs);
    history.epochs.push_back(logs);
  }
  return history;
}

EvalResult Model::evaluate(data::ShardedDataset& data) {
  require_compiled("evaluate");
  torch::NoGradGuard no_grad;
  auto& net = module();
  net.eval();
  double loss_sum = 0;
  double correct = 0;
  double count = 0;
  for (std::int64_t step = 0; step < data.steps_per_epoch(); ++step) {
    const data::Batch batch = data.batch(step);
    if (batch.labels.size(0) == 0)
      continue; // this worker's share of a short last batch
    const torch::Tensor logits = forward_(batch.features);
    loss_sum +=
        F::cross_entropy(logits, batch.labels, F::CrossEntropyFuncOptions().reduction(torch::kSum))
            .item<double>();
    correct += logits.argmax(1).eq(batch.labels).sum().item<double>();
    count += static_cast<double>(batch.labels.size(0));
  }
  const torch::Tensor totals = strategy_.reduce(
      strategy::ReduceOp::kSum, torch::tensor({loss_sum, correct, count}, torch::kFloat64));
  EvalResult result;
  result.samples = static_cast<std::int64_t>(totals[2].item<double>());
  if (result.samples > 0) {
    result.loss = totals[0].item<double>() / static_cast<double>(result.samples);
    result.accuracy = totals[1].item<double>() / static_cast<double>(result.samples);
  }
  return result;
}

torch::Tensor Model::predict(const torch::Tensor& features) {
  torch::NoGradGuard no_grad;
  module().eval();
  return forward_(features);
}

} // namespace flotilla::train
