#include "flotilla/train/model.h"

#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>
#include <torch/version.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "data/thread_pool.h"
#include "flotilla/checkpoint/model_checkpoint.h"
#include "flotilla/error.h"
#include "flotilla/train/progress.h"

namespace flotilla::train {
namespace F = torch::nn::functional;

// Runs replicas 1..K-1 of a worker on pool threads that live as long as the model (replica 0
// runs on the caller's thread), so a step costs K-1 hand-offs, not K-1 thread starts.
struct Model::Threads {
  explicit Threads(int replicas) : pool(replicas - 1), errors(static_cast<std::size_t>(replicas)) {}
  // fn(r) for every replica at once; rethrows the first replica's failure.
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

  data::detail::ThreadPool pool;
  std::vector<std::exception_ptr> errors;
};

Model::Model(strategy::Strategy& strategy, std::shared_ptr<torch::nn::Module> module,
             Forward forward, std::function<Replica()> clone)
    : strategy_(strategy), module_(std::move(module)), forward_(std::move(forward)),
      clone_(std::move(clone)) {
  if (!module_ || !forward_) throw ConfigError("Model needs a module and its forward function");
}

Model::~Model() = default;

const strategy::GradientReducer& Model::gradient_reducer() const {
  require_compiled("gradient_reducer");
  return *reducer_;
}

void Model::compile(const CompileOptions& options) {
  compiled_.reset(); // until this compile succeeds, the model is not compiled
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
  if (options.gradient_accumulation_steps < 1) {
    throw ConfigError("gradient_accumulation_steps must be at least 1; saw " +
                      std::to_string(options.gradient_accumulation_steps));
  }
  const int replicas = strategy_.replicas_per_worker();
  if (replicas > 1 && !clone_) {
    throw ConfigError("replicas_per_worker is " + std::to_string(replicas) +
                      ", but this Model cannot copy its module: construct it from a module "
                      "holder (torch::nn::Sequential, a TORCH_MODULE), or pass a clone function");
  }
  reducer_.reset(); // its hooks sit on the replicas being replaced
  threads_.reset();
  replicas_.clear();
  replicas_.emplace_back(module_, forward_);
  for (int r = 1; r < replicas; ++r) {
    replicas_.push_back(clone_());
    if (!replicas_.back().first) {
      throw ConfigError("the clone function returned no module for replica " + std::to_string(r));
    }
  }
  optimizers_.clear();
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  for (const auto& [replica, forward] : replicas_) {
    modules.push_back(replica);
    optimizers_.push_back(std::make_unique<torch::optim::SGD>(
        replica->parameters(), torch::optim::SGDOptions(sgd.learning_rate)
                                   .momentum(sgd.momentum)
                                   .nesterov(sgd.nesterov)
                                   .weight_decay(sgd.weight_decay)));
  }
  reducer_ = strategy_.make_gradient_reducer(modules);
  if (replicas > 1) threads_ = std::make_unique<Threads>(replicas);
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

void Model::check_consistency(const data::DistributedDataset& train, const FitOptions& options) {
  const auto& comm = strategy_.communicator().options();
  std::vector<std::pair<std::string, std::string>> fields = {
      {"flotilla version", FLOTILLA_VERSION},
      {"LibTorch version", TORCH_VERSION},
      {"replicas per worker", std::to_string(strategy_.replicas_per_worker())},
      {"precision policy", "float32"},
      {"per-replica batch", train.per_replica_batch() > 0
                                ? std::to_string(train.per_replica_batch())
                                : std::string("set by the input pipeline")},
      {"gradient accumulation steps", std::to_string(compiled_->gradient_accumulation_steps)},
      {"bytes_per_pack", std::to_string(comm.bytes_per_pack)},
      {"compression", std::string(collective::to_string(comm.compression))},
      {"overlap", comm.overlap ? "on" : "off"},
      {"bucket plan", reducer_->plan()},
  };
  fields.emplace_back("input sharding", train.sharding());
  if (options.steps_per_epoch) {
    fields.emplace_back("steps per epoch", std::to_string(*options.steps_per_epoch));
  } else if (train.same_steps_on_every_worker()) {
    const std::int64_t steps = train.cardinality();
    fields.emplace_back("steps per epoch after sharding",
                        steps >= 0 ? std::to_string(steps) : std::string("unknown"));
  }
  std::int64_t index = 0;
  for (const auto& item : module().named_parameters()) {
    const auto& p = item.value();
    std::string shape;
    for (std::int64_t d = 0; d < p.dim(); ++d) shape += (d ? "x" : "") + std::to_string(p.size(d));
    fields.emplace_back("parameter " + std::to_string(index++),
                        item.key() + " [" + shape + "] " + c10::toString(p.scalar_type()) +
                            (p.is_contiguous() ? "" : c10::str(" strides ", p.strides())));
  }
  fields.emplace_back("parameter count", std::to_string(index));
  strategy_.check_consistency(fields);
}

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
  check_consistency(train, options);
  const std::int64_t known = train.cardinality();
  const torch::Tensor lengths =
      strategy_.reduce(strategy::ReduceOp::kMin, torch::tensor({known, -known}, torch::kInt64));
  // Equal on every worker: a known length, or endless (repeat()) everywhere.
  const bool agreed = (known >= 0 || known == data::kInfiniteCardinality) &&
                      lengths[0].item<std::int64_t>() == -lengths[1].item<std::int64_t>();
  if (agreed && known == data::kInfiniteCardinality && !options.steps_per_epoch) {
    throw ConfigError("the training dataset is endless (repeat() without a count), so an epoch "
                      "would never end; set FitOptions.steps_per_epoch (--steps-per-epoch)");
  }
  const std::int64_t steps_hint =
      options.steps_per_epoch.value_or(agreed && known >= 0 ? known : 0);
  const double replicas = strategy_.num_replicas_in_sync();

  Verbosity verbose = options.verbose;
  if (verbose == Verbosity::kAuto) {
    verbose = ::isatty(STDOUT_FILENO) ? Verbosity::kProgressBar : Verbosity::kOneLinePerEpoch;
  }
  Progress progress(strategy_.is_chief() && verbose != Verbosity::kSilent,
                    verbose == Verbosity::kProgressBar);

  History history;
  auto& net = module();
  const int num_replicas = static_cast<int>(replicas_.size());
  // Replicas are clones made at compile(); weights loaded into the model since then (a
  // checkpoint, a user's edit) reach the other replicas here.
  if (num_replicas > 1) {
    torch::NoGradGuard no_grad;
    const auto params = net.parameters();
    const auto buffers = net.buffers();
    for (int r = 1; r < num_replicas; ++r) {
      const auto theirs = replicas_[r].first->parameters();
      const auto their_buffers = replicas_[r].first->buffers();
      if (theirs.size() != params.size() || their_buffers.size() != buffers.size()) {
        throw ConfigError("the model now has " + std::to_string(params.size()) +
                          " parameters and " + std::to_string(buffers.size()) +
                          " buffers, its replicas " + std::to_string(theirs.size()) + " and " +
                          std::to_string(their_buffers.size()) +
                          " (changed after compile()); call compile() again");
      }
      for (std::size_t k = 0; k < params.size(); ++k) theirs[k].copy_(params[k]);
      for (std::size_t k = 0; k < buffers.size(); ++k) their_buffers[k].copy_(buffers[k]);
    }
  }
  const int accumulation = compiled_->gradient_accumulation_steps;
  std::optional<data::DistributedIterator> pass;
  bool ran_out = false;
  for (int epoch = 1; epoch <= options.epochs && !ran_out; ++epoch) {
    if (!pass || !options.steps_per_epoch) pass.emplace(train.make_iterator());
    for (auto& [replica, forward] : replicas_) replica->train();
    progress.begin_epoch(epoch, options.epochs, steps_hint);
    StepResult totals;
    double input_seconds = 0;
    std::int64_t steps = 0;
    int micro = 0; // batches accumulated since the last optimizer step
    const auto comm_before = reducer_->stats();
    auto apply = [&] {
      reducer_->finish();
      for (auto& optimizer : optimizers_) optimizer->step();
      micro = 0;
    };
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
      // This worker's batch, split as evenly as possible over its replicas.
      std::vector<data::Element> parts(static_cast<std::size_t>(num_replicas));
      for (const auto& component : batch->element) {
        auto pieces = num_replicas == 1 ? std::vector<torch::Tensor>{component}
                                        : torch::tensor_split(component, num_replicas);
        for (int r = 0; r < num_replicas; ++r) parts[r].push_back(pieces[r]);
      }
      if (micro == 0) reducer_->zero_grad();
      const bool sync = micro + 1 == accumulation;
      reducer_->prepare(sync);
      std::vector<StepResult> results(static_cast<std::size_t>(num_replicas));
      const double share = static_cast<double>(batch->global_batch_size) / replicas;
      auto replica_step = [&](int r) {
        const data::Element& e = parts[r];
        const torch::Tensor& labels = e[1];
        // An empty slice (a short last batch over many replicas) runs no forward — a batch
        // norm could not — but still joins the reduction, with no gradients of its own.
        if (labels.size(0) == 0) return;
        const torch::Tensor logits = replicas_[r].second(e[0]);
        torch::Tensor per_example =
            F::cross_entropy(logits, labels, F::CrossEntropyFuncOptions().reduction(torch::kNone));
        if (e.size() > 2) per_example = per_example * e[2].to(per_example.dtype());
        // Summed over this replica's slice and divided by the global batch's share per
        // replica: averaged over replicas by the reducer, that is the global batch's mean loss
        // exactly, short last batches included.
        (per_example.sum() / share).backward();
        results[r].loss_sum = per_example.detach().sum().item<double>();
        results[r].correct = logits.detach().argmax(1).eq(labels).sum().item<double>();
        results[r].count = static_cast<double>(labels.size(0));
      };
      try {
        if (threads_) {
          threads_->run(replica_step);
        } else {
          replica_step(0);
        }
      } catch (...) {
        reducer_->abort_step(); // buckets already on the wire complete before anything else
        throw;
      }
      if (sync) {
        apply();
      } else {
        ++micro;
      }

      ++steps;
      for (const auto& r : results) {
        totals.loss_sum += r.loss_sum;
        totals.correct += r.correct;
        totals.count += r.count;
      }
      if (totals.count > 0) {
        progress.step(steps, totals.loss_sum / totals.count, totals.correct / totals.count);
      }
    }
    if (micro > 0) apply(); // the epoch's last, partial accumulation
    if (steps == 0) break;  // the data ran out at an epoch's start: nothing to report
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
    const auto comm_after = reducer_->stats();
    logs.comm_seconds = comm_after.comm_seconds - comm_before.comm_seconds;
    logs.comm_exposed_seconds = comm_after.exposed_seconds - comm_before.exposed_seconds;
    strategy::GradientReducer::Stats epoch_comm;
    epoch_comm.comm_seconds = logs.comm_seconds;
    epoch_comm.exposed_seconds = logs.comm_exposed_seconds;
    logs.comm_hidden_share = epoch_comm.hidden_share();
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
