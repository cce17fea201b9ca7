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
  if (!module_ || !forward_) throw ConfigError("Model needs a module and its forward function");
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

History Model::fit(const data::Dataset& train, const FitOptions& options) {
  return fit(data::distribute_dataset(train, strategy_.input_context()), options);
}

namespace {

struct StepResult {
  double loss_sum = 0; // per-example losses, summed
  double correct = 0;
  double count = 0;
};

// (features, labels[, weights]) of a replica batch, checked.
void check_element(const data::Element& e) {
  if (e.size() < 2) {
    throw DataError("a training element needs (features, labels[, weights]); saw " +
                    std::to_string(e.size()) + " component(s)");
  }
}

} // namespace

History Model::fit(const data::DistributedDataset& train, const FitOptions& options) {
  require_compiled("fit");
  if (options.epochs < 1) {
    throw ConfigError("epochs must be at least 1; saw " + std::to_string(options.epochs));
  }
  if (options.steps_per_epoch && *options.steps_per_epoch < 1) {
    throw ConfigError("steps_per_epoch must be at least 1; saw " +
                      std::to_string(*options.steps_per_epoch));
  }
  // Every step is a collective, so every worker must take the same number. When each knows its
  // pass length and they agree, that is enough; otherwise every step first asks all workers
  // whether they still have a batch (what tf.distribute does for uneven input).
  const std::int64_t known = train.cardinality();
  const torch::Tensor lengths =
      strategy_.reduce(strategy::ReduceOp::kMin, torch::tensor({known, -known}, torch::kInt64));
  const bool agreed =
      known >= 0 && lengths[0].item<std::int64_t>() == -lengths[1].item<std::int64_t>();
  const std::int64_t steps_hint = options.steps_per_epoch.value_or(agreed ? known : 0);
  const double replicas = strategy_.num_replicas_in_sync();

  Verbosity verbose = options.verbose;
  if (verbose == Verbosity::kAuto) {
    verbose = ::isatty(STDOUT_FILENO) ? Verbosity::kProgressBar : Verbosity::kOneLinePerEpoch;
  }
  Progress progress(strategy_.is_chief() && verbose != Verbosity::kSilent,
                    verbose == Verbosity::kProgressBar);

  History history;
  auto& net = module();
  std::optional<data::DistributedIterator> pass;
  bool ran_out = false;
  for (int epoch = 1; epoch <= options.epochs && !ran_out; ++epoch) {
    if (!pass || !options.steps_per_epoch) pass.emplace(train.make_iterator());
    net.train();
    progress.begin_epoch(epoch, options.epochs, steps_hint);
    StepResult totals;
    double input_seconds = 0;
    std::int64_t steps = 0;
    const auto start = std::chrono::steady_clock::now();
    while (!options.steps_per_epoch || steps < *options.steps_per_epoch) {
      const auto before_input = std::chrono::steady_clock::now();
      std::optional<data::ReplicaBatch> batch = pass->next();
      input_seconds +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - before_input).count();
      bool have = batch.has_value();
      if (!agreed) {
        have =
            strategy_.reduce(strategy::ReduceOp::kMin, torch::tensor({have ? 1 : 0})).item<int>() ==
            1;
      }
      if (!have) {
        ran_out = options.steps_per_epoch.has_value();
        break;
      }
      check_element(batch->element);
      const torch::Tensor& features = batch->element[0];
      const torch::Tensor& labels = batch->element[1];
      optimizer_->zero_grad();
      reducer_->prepare();
      torch::Tensor logits, per_example;
      if (labels.size(0) > 0) {
        logits = forward_(features);
        per_example =
            F::cross_entropy(logits, labels, F::CrossEntropyFuncOptions().reduction(torch::kNone));
        if (batch->element.size() > 2) {
          per_example = per_example * batch->element[2].to(per_example.dtype());
        }
        // Summed over this replica's slice and divided by the global batch's share per
        // replica: averaged over replicas by the reducer, that is the global batch's mean loss
        // exactly, short last batches included.
        const torch::Tensor loss =
            per_example.sum() / (static_cast<double>(batch->global_batch_size) / replicas);
        loss.backward();
      }
      // An empty slice (a short last batch over many replicas) runs no forward — a batch norm
      // could not — but still joins the reduction, with no gradients of its own.
      reducer_->finish();
      optimizer_->step();

      ++steps;
      if (labels.size(0) > 0) {
        totals.loss_sum += per_example.detach().sum().item<double>();
        totals.correct += logits.detach().argmax(1).eq(labels).sum().item<double>();
        totals.count += static_cast<double>(labels.size(0));
      }
      if (totals.count > 0) {
        progress.step(steps, totals.loss_sum / totals.count, totals.correct / totals.count);
      }
    }
    if (steps == 0) break; // the data ran out at an epoch's start: nothing to report
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const torch::Tensor global = strategy_.reduce(
        strategy::ReduceOp::kSum,
        torch::tensor({totals.loss_sum, totals.correct, totals.count}, torch::kFloat64));
    const double global_count = global[2].item<double>();
    EpochLogs logs;
    logs.epoch = epoch;
    logs.steps = steps;
    logs.loss = global[0].item<double>() / global_count;
    logs.accuracy = global[1].item<double>() / global_count;
    logs.seconds = seconds;
    logs.samples_per_s = global_count / seconds;
    logs.input_seconds = input_seconds;
    progress.end_epoch(logs);
    if (!options.model_dir.empty()) {
      checkpoint::save_model(strategy_, net, options.model_dir,
                             "ckpt-" + std::to_string(epoch) + ".safetensors",
                             {{"epoch", std::to_string(epoch)}, {"format", "flotilla"}});
    }
    if (options.on_epoch_end) options.on_epoch_end(logs);
    history.epochs.push_back(logs);
  }
  if (ran_out && strategy_.is_chief()) {
    strategy_.log().warn("your input ran out of data; interrupting training. Make sure the dataset "
                         "can give at least steps_per_epoch x epochs batches (use repeat())");
  }
  return history;
}

EvalResult Model::evaluate(const data::Dataset& data) {
  return evaluate(data::distribute_dataset(data, strategy_.input_context()));
}

EvalResult Model::evaluate(const data::DistributedDataset& data) {
  require_compiled("evaluate");
  torch::NoGradGuard no_grad;
  auto& net = module();
  net.eval();
  StepResult totals;
  auto pass = data.make_iterator();
  while (auto batch = pass.next()) {
    check_element(batch->element);
    const torch::Tensor& labels = batch->element[1];
    if (labels.size(0) == 0) continue; // this worker's share of a short last batch
    const torch::Tensor logits = forward_(batch->element[0]);
    totals.loss_sum +=
        F::cross_entropy(logits, labels, F::CrossEntropyFuncOptions().reduction(torch::kSum))
            .item<double>();
    totals.correct += logits.argmax(1).eq(labels).sum().item<double>();
    totals.count += static_cast<double>(labels.size(0));
  }
  const torch::Tensor global = strategy_.reduce(
      strategy::ReduceOp::kSum,
      torch::tensor({totals.loss_sum, totals.correct, totals.count}, torch::kFloat64));
  EvalResult result;
  result.samples = static_cast<std::int64_t>(global[2].item<double>());
  if (result.samples > 0) {
    result.loss = global[0].item<double>() / static_cast<double>(result.samples);
    result.accuracy = global[1].item<double>() / static_cast<double>(result.samples);
  }
  return result;
}

torch::Tensor Model::predict(const torch::Tensor& features) {
  torch::NoGradGuard no_grad;
  module().eval();
  return forward_(features);
}

} // namespace flotilla::train
