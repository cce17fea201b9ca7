#include "train/train_step.h"

#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>

#include <utility>

#include "flotilla/base/hashes.h"
#include "flotilla/collective/agreement.h"
#include "flotilla/error.h"
#include "flotilla/kernels/compile.h"
#include "flotilla/train/sync_batchnorm.h"
#include "flotilla/train/torchscript.h"
#include "train/captured_step.h"
#include "train/replica_set.h"
#include "train/step_timer.h"

namespace flotilla::train {

std::string why_no_captured_step(strategy::Strategy& strategy, int gradient_accumulation_steps) {
  if (!strategy.devices().front().is_cuda()) {
    return "a CUDA graph needs CUDA replicas; on the CPU jit_compile is the compile step";
  }
  if (!detail::cuda_graphs_built())
    return "this flotilla was built against a LibTorch without CUDA";
  if (strategy.replicas_per_worker() > 1) {
    return "a graph over several GPUs per worker is not captured yet: use one GPU per worker "
           "(one worker per GPU) for a captured step";
  }
  if (gradient_accumulation_steps > 1) return "gradient accumulation steps are not captured";
  if (strategy.num_workers() > 1 &&
      (strategy.communicator().options().implementation == collective::Implementation::kRing ||
       !collective::nccl_available())) {
    return "the workers' all-reduce goes over Gloo, which a CUDA graph cannot capture; use "
           "CommunicationOptions::implementation AUTO or NCCL";
  }
  return "";
}

namespace detail {

namespace {

std::vector<Metric> make_metrics(const CompileOptions& options);

// Each metric for each output ("output_<o>_<name>" when there are several); `outputs_read`
// gets the output each reads.
std::vector<Metric> make_metrics(const CompileOptions& options, int outputs,
                                 std::vector<int>& outputs_read) {
  if (options.output_metrics && static_cast<int>(options.output_metrics->size()) != outputs) {
    throw ConfigError("CompileOptions::output_metrics has " +
                      std::to_string(options.output_metrics->size()) + " lists; the model has " +
                      std::to_string(outputs) + " outputs");
  }
  const std::vector<Metric> metrics = make_metrics(options);
  if (outputs == 1 && !options.output_metrics) {
    outputs_read.assign(metrics.size(), 0);
    return metrics;
  }
  std::vector<Metric> each;
  for (int o = 0; o < outputs; ++o) {
    std::vector<Metric> own = metrics;
    if (options.output_metrics) {
      own.clear();
      for (const auto& name : (*options.output_metrics)[static_cast<std::size_t>(o)]) {
        own.push_back(make_metric(name, options.loss));
      }
    }
    for (const auto& metric : own) {
      each.push_back({"output_" + std::to_string(o) + "_" + metric.name, metric.per_example});
      outputs_read.push_back(o);
    }
  }
  return each;
}

std::vector<Metric> make_metrics(const CompileOptions& options) {
  std::vector<Metric> metrics;
  for (const auto& name : options.metrics) metrics.push_back(make_metric(name, options.loss));
  for (const auto& metric : options.custom_metrics) {
    if (metric.name.empty() || !metric.per_example) {
      throw ConfigError("a custom metric needs a name and a per_example function; saw \"" +
                        metric.name + "\"");
    }
    metrics.push_back(metric);
  }
  for (std::size_t i = 0; i < metrics.size(); ++i) {
    for (std::size_t j = 0; j < i; ++j) {
      if (metrics[i].name == metrics[j].name || metrics[i].name == "loss") {
        throw ConfigError("metric name \"" + metrics[i].name +
                          "\" is used twice; names are the keys of the logs and must be unique");
      }
    }
  }
  return metrics;
}

void check_compile_options(const CompileOptions& options) {
  validate(options.loss);
  validate(options.optimizer);
  if (options.gradient_accumulation_steps < 1) {
    throw ConfigError("CompileOptions::gradient_accumulation_steps must be at least 1; saw " +
                      std::to_string(options.gradient_accumulation_steps));
  }
  if (options.steps_per_execution < 1) {
    throw ConfigError("CompileOptions::steps_per_execution must be at least 1; saw " +
                      std::to_string(options.steps_per_execution));
  }
}

// Each replica's SyncBatchNorm layers meet the others through its own context, over the
// worker's current group; the number of layers bound.
int bind_replica_contexts(strategy::Strategy& strategy, ReplicaSet& replicas,
                          std::vector<strategy::ReplicaContext>& contexts) {
  contexts = strategy::make_replica_contexts(strategy.communicator(), replicas.size());
  int layers = 0;
  for (int r = 0; r < replicas.size(); ++r) {
    const int bound =
        bind_sync_batchnorm(replicas.module(r), contexts[static_cast<std::size_t>(r)]);
    if (r == 0) layers = bound; // the replicas are copies: the same count
  }
  return layers;
}

} // namespace

torch::Tensor on_device(const torch::Tensor& t, const torch::Device& device) {
  if (t.device() == device) return t;
  return t.to(torch::TensorOptions().device(device), /*non_blocking=*/t.is_pinned());
}

void check_element(const data::Element& e, const Signature& signature) {
  const std::size_t needed = static_cast<std::size_t>(signature.inputs + signature.outputs);
  if (e.size() < needed || e.size() > needed + 1) {
    throw DataError(signature.inputs == 1 && signature.outputs == 1
                        ? "a training element needs (features, labels[, weights]); saw " +
                              std::to_string(e.size()) + " component(s)"
                        : "a training element of this model needs " +
                              std::to_string(signature.inputs) + " inputs, " +
                              std::to_string(signature.outputs) +
                              " labels (one per output) and, optionally, sample weights; saw " +
                              std::to_string(e.size()) + " component(s)");
  }
}

void check_outputs(const Tensors& outputs, const Signature& signature) {
  if (static_cast<int>(outputs.size()) != signature.outputs) {
    throw ConfigError("the model's forward returned " + std::to_string(outputs.size()) +
                      " outputs; its Signature says " + std::to_string(signature.outputs));
  }
  for (std::size_t o = 0; o < outputs.size(); ++o) {
    if (!outputs[o].defined()) {
      throw ConfigError("the model's forward returned no tensor for output " + std::to_string(o));
    }
  }
}

std::vector<double> to_host(const torch::Tensor& sums) {
  const torch::Tensor host = sums.to(torch::kCPU, torch::kFloat64).contiguous();
  return std::vector<double>(host.data_ptr<double>(), host.data_ptr<double>() + host.numel());
}

TrainStep::TrainStep(strategy::Strategy& strategy, Model::MultiReplica model, Signature signature,
                     const std::function<Model::MultiReplica()>& clone,
                     const CompileOptions& options, Policy policy, StepTimer& timer)
    : strategy_(strategy), timer_(timer), options_(options), model_forward_(model.second),
      signature_(signature), policy_(policy) {
  check_compile_options(options);
  if (!options.loss.loss_weights.empty() &&
      static_cast<int>(options.loss.loss_weights.size()) != signature.outputs) {
    throw ConfigError("LossOptions::loss_weights has " +
                      std::to_string(options.loss.loss_weights.size()) +
                      " weights; the model has " + std::to_string(signature.outputs) +
                      " outputs (give one each, or none)");
  }
  metrics_ = make_metrics(options, signature.outputs, metric_outputs_);
  if (options.loss_scale) {
    loss_scale_.emplace(*options.loss_scale);
  } else if (policy == Policy::kMixedFloat16) {
    loss_scale_.emplace(LossScaleOptions{});
  }
  channels_last_ = options.channels_last.value_or(has_convolutions(*model.first));
  // On the CPU jit_compile (unset: Keras's "auto") is the compile step: the model rewritten so
  // flotilla's kernels can run its layers, before the replicas are copied from it.
  if (strategy_.devices().front().is_cpu() && options.jit_compile.value_or(true)) {
    auto* script = dynamic_cast<TorchScriptModuleImpl*>(model.first.get());
    const bool bfloat16 = policy == Policy::kMixedBFloat16;
    kernel_rewrites_ = std::make_unique<kernels::CompileReport>(
        script ? script->compile_kernels(bfloat16) : kernels::compile(*model.first, bfloat16));
  }
  replicas_ = std::make_unique<ReplicaSet>(strategy_.devices(), std::move(model), clone,
                                           options.optimizer, channels_last_);
  if (options_.optimizer.custom && !options_.optimizer.schedule) {
    options_.optimizer.learning_rate = replicas_->built_learning_rate();
  }
  sync_batchnorm_layers_ = bind_replica_contexts(strategy_, *replicas_, replica_contexts_);
  std::string why_no_graph = why_no_captured_step(strategy_, options.gradient_accumulation_steps);
  if (why_no_graph.empty() && sync_batchnorm_layers_ > 0) {
    why_no_graph = "SyncBatchNorm reduces its statistics through the host between kernels, which "
                   "a CUDA graph cannot capture";
  }
  if (options.jit_compile.value_or(false) && why_no_graph.empty()) {
    captured_ = std::make_unique<CapturedStep>(replicas_->device(0));
  }
  {
    // Under jit_compile the gradient accumulators (and with them the engine's hooks) belong to
    // the side stream the steps run on, or a capture would meet the default stream.
    std::optional<SideStream::Use> side;
    if (captured_) side.emplace(captured_->stream());
    reducer_ = strategy_.make_gradient_reducer(replicas_->modules());
  }
  log_compile(why_no_graph);
}

TrainStep::~TrainStep() = default; // the gradient engine (its hooks) goes before the replicas

void TrainStep::log_compile(const std::string& why_no_graph) const {
  if (!strategy_.is_chief()) return;
  const auto& log = strategy_.log();
  if (options_.optimizer.schedule) {
    for (const auto& warning : options_.optimizer.schedule->warnings()) log.warn(warning);
  }
  // Asked for by name, the compile step says what it did (by default Model::kernel_rewrites()
  // tells whoever wants to know: the CLI's recipe lines).
  if (kernel_rewrites_ && options_.jit_compile.value_or(false)) {
    log.info("jit_compile: the compile step " + kernel_rewrites_->summary() +
             " (flotilla's kernels run where they measure faster than ATen's)");
  } else if (options_.jit_compile.value_or(false) && !captured_) {
    log.info("jit_compile: no effect (" + why_no_graph + ")");
  }
  if (policy_ == Policy::kMixedFloat16 && !replicas_->device(0).is_cuda()) {
    log.warn("mixed_float16 on the CPU: LibTorch's CPU autocast computes in float16 slowly on "
             "most CPUs; mixed_bfloat16 is the CPU's mixed precision");
  }
}

const torch::Device& TrainStep::device() const {
  return replicas_->device(0);
}

double TrainStep::learning_rate() const {
  const double rate = options_.optimizer.learning_rate_at(schedule_step());
  if (lr_global_rows_ == 0) return rate;
  // Keeping the per-replica batch: a whole step of the members there are (a pass's last step
  // may have fewer rows, and a lower rate).
  const strategy::InputContext context = strategy_.input_context();
  return rate * context.num_replicas_in_sync / context.full_replicas;
}

void TrainStep::set_learning_rate(double learning_rate) {
  if (options_.optimizer.schedule) {
    throw ConfigError("the learning rate follows a schedule (" +
                      options_.optimizer.schedule->describe() +
                      "); a LearningRateScheduler cannot also set it. Use one or the other");
  }
  if (!(learning_rate > 0)) {
    throw ConfigError("learning rate must be positive; saw " + std::to_string(learning_rate));
  }
  options_.optimizer.learning_rate = learning_rate;
}

TrainingState TrainStep::counters() const {
  TrainingState state;
  state.iterations = iterations_;
  state.trained_rows = trained_rows_;
  state.generation_base = generation_base_;
  state.training = training_;
  if (loss_scale_) {
    state.loss_scale = loss_scale_->scale();
    state.loss_scale_good_steps = loss_scale_->good_steps();
  }
  return state;
}

void TrainStep::restore_counters(const TrainingState& state) {
  iterations_ = state.iterations;
  trained_rows_ = state.trained_rows; // -1 from an older checkpoint: counted at the next fit
  generation_base_ = state.generation_base;
  training_ = state.training;
  if (loss_scale_ && state.loss_scale > 0) {
    loss_scale_->restore(state.loss_scale, state.loss_scale_good_steps);
  }
}

void TrainStep::agree_training(collective::Communicator& comm) {
  std::string mine = training_;
  if (mine.empty() && comm.rank() == 0) mine = base::to_hex(base::random_bytes<16>());
  training_ = collective::broadcast_string(comm, mine, 0);
}

void TrainStep::begin_fit(std::int64_t lr_global_rows, std::int64_t global_rows) {
  lr_global_rows_ = lr_global_rows;
  if (trained_rows_ < 0) trained_rows_ = iterations_ * global_rows;
}

void TrainStep::mirror_buffers() {
  if (!buffers_dirty_) return;
  // Shares by speed: each worker's statistics weigh as much as its share of the rows.
  double weight = 0;
  if (!strategy_.shares().empty()) {
    const auto part = strategy_.input_context().part_of(strategy_.worker_index());
    weight = static_cast<double>(part.count) / static_cast<double>(part.parts);
  }
  replicas_->mirror_buffers(strategy_.communicator(), weight);
  buffers_dirty_ = false; // not before: a mirror that failed is still due (elastic redoes it)
}

void TrainStep::adopt_group() {
  strategy_.adopt_generation();
  reducer_ = strategy_.make_gradient_reducer(replicas_->modules());
  // The replicas' contexts held the group they were made on: generation 0's stayed alive (its
  // backend's threads and sockets) for as long as the model.
  bind_replica_contexts(strategy_, *replicas_, replica_contexts_);
}

torch::Tensor TrainStep::zero_sums() const {
  return torch::zeros({static_cast<std::int64_t>(metrics_.size()) + 2},
                      torch::TensorOptions().dtype(torch::kFloat64).device(device()));
}

void TrainStep::set_means(Logs& logs, const double* sums, double count) const {
  logs.set("loss", sums[0] / count);
  for (std::size_t m = 0; m < metrics_.size(); ++m) logs.set(metrics_[m].name, sums[m + 1] / count);
}

Tensors TrainStep::forward(int r, const data::Element& e) const {
  const auto inputs = static_cast<std::ptrdiff_t>(signature_.inputs);
  Tensors outputs;
  {
    AutocastGuard autocast(policy_, e[0].device().type());
    const auto& forward = r < 0 ? model_forward_ : replicas_->forward(r);
    outputs = signature_.inputs == 1 ? forward(Tensors{e[0]})
                                     : forward(Tensors(e.begin(), e.begin() + inputs));
  }
  check_outputs(outputs, signature_);
  return outputs;
}

torch::Tensor TrainStep::per_example(const Tensors& outputs, const data::Element& e) const {
  const auto first_label = e.begin() + signature_.inputs;
  torch::Tensor loss =
      signature_.outputs == 1 && !options_.loss.custom_outputs
          ? per_example_loss(options_.loss, outputs[0], *first_label)
          : per_example_loss(options_.loss, outputs,
                             Tensors(first_label, first_label + signature_.outputs));
  const std::size_t weights = static_cast<std::size_t>(signature_.inputs + signature_.outputs);
  if (e.size() > weights) loss = loss * e[weights].to(loss.dtype());
  return loss;
}

torch::Tensor TrainStep::batch_sums(const torch::Tensor& per_example_loss, const Tensors& outputs,
                                    const data::Element& e) const {
  // On the device, in float64, the example count last: summed over steps there and read by the
  // host only when logs are due (no synchronisation per step on CUDA).
  std::vector<torch::Tensor> sums = {per_example_loss.sum()};
  for (std::size_t m = 0; m < metrics_.size(); ++m) {
    const auto o = static_cast<std::size_t>(metric_outputs_[m]);
    sums.push_back(
        metrics_[m]
            .per_example(outputs[o].detach(), e[static_cast<std::size_t>(signature_.inputs) + o])
            .sum());
  }
  sums.push_back(torch::full({}, static_cast<double>(rows_of(e, signature_)),
                             per_example_loss.options().dtype(torch::kFloat64)));
  return torch::stack(sums).to(torch::kFloat64);
}

std::vector<data::Element> TrainStep::split(const data::ReplicaBatch& batch) const {
  const int num_replicas = replicas_->size();
  check_element(batch.element, signature_);
  // This worker's batch, split as evenly as possible over its replicas.
  std::vector<data::Element> parts(static_cast<std::size_t>(num_replicas));
  for (const auto& component : batch.element) {
    auto pieces = num_replicas == 1 ? std::vector<torch::Tensor>{component}
                                    : torch::tensor_split(component, num_replicas);
    for (int r = 0; r < num_replicas; ++r) {
      // To the replica's device (a no-op when the batch is there already); pinned host memory
      // makes it asynchronous.
      parts[r].push_back(on_device(pieces[r], replicas_->device(r)));
      // Under jit_compile the step runs on a side stream, not the one the input was made for.
      if (captured_) use_on_current_stream(parts[r].back());
    }
  }
  return parts;
}

std::optional<torch::Tensor> TrainStep::replay(const data::Element& part, double loss_factor) {
  // What an eager step does between the copy and the optimizer, for the graph to record.
  auto body = [&](const data::Element& e, const torch::Tensor& factor) {
    reducer_->zero_grad();
    reducer_->prepare(true);
    const Tensors outputs = forward(0, e);
    const torch::Tensor loss = per_example(outputs, e);
    (loss.sum() * factor).backward();
    torch::Tensor sums;
    {
      torch::NoGradGuard no_grad;
      sums = batch_sums(loss.detach(), outputs, e);
    }
    reducer_->finish();
    return sums;
  };
  auto sums = captured_->replay(
      part, loss_factor, body, [&] { reducer_->abort_step(); }, timer_,
      strategy_.is_chief() ? &strategy_.log() : nullptr);
  if (sums) apply_update();
  return sums;
}

void TrainStep::replica_body(int r, const data::Element& e, double loss_factor,
                             std::vector<torch::Tensor>& results) {
  // An empty slice (a short last batch over many replicas, a worker whose input ended) runs
  // no forward — a batch norm could not — but still joins the reduction, with no gradients of
  // its own. With SyncBatchNorm it does run: its layers are collectives every replica joins.
  if (rows_of(e, signature_) == 0 && sync_batchnorm_layers_ == 0) return;
  const Tensors outputs = forward(r, e);
  const torch::Tensor loss = per_example(outputs, e);
  // Replica 0 runs on this thread and times the phases; the others' extra time shows as
  // backward, where this thread waits for them.
  if (r == 0) timer_.mark(Phase::kForward);
  // Summed over this replica's slice and divided by the global batch's share per replica:
  // averaged over replicas by the reducer, that is the global batch's mean loss exactly, short
  // last batches included.
  (loss.sum() * loss_factor).backward();
  if (r == 0) timer_.mark(Phase::kBackward);
  torch::NoGradGuard no_grad;
  results[r] = batch_sums(loss.detach(), outputs, e);
  if (r == 0) timer_.mark(Phase::kMetrics);
}

torch::Tensor TrainStep::run(const data::ReplicaBatch& batch, int& micro) {
  const std::vector<data::Element> parts = split(batch);
  const double share =
      static_cast<double>(batch.global_batch_size) / strategy_.num_replicas_in_sync();
  const double loss_factor = (loss_scale_ ? loss_scale_->scale() : 1.0) / share;
  buffers_dirty_ = true;
  update_rows_ += batch.global_batch_size;
  if (captured_ && rows_of(parts[0], signature_) > 0 && captured_->warmed_up()) {
    if (auto sums = replay(parts[0], loss_factor)) return *sums;
  }
  timer_.mark(Phase::kCopy);
  if (micro == 0) reducer_->zero_grad();
  const bool sync = micro + 1 == options_.gradient_accumulation_steps;
  reducer_->prepare(sync);
  std::vector<torch::Tensor> results(parts.size());
  try {
    replicas_->run([&](int r) {
      try {
        replica_body(r, parts[static_cast<std::size_t>(r)], loss_factor, results);
      } catch (const std::exception& e) {
        // The other replicas may be waiting for this one inside a SyncBatchNorm layer.
        for (const auto& context : replica_contexts_) {
          context.abort("replica " + std::to_string(r) + " of this worker failed: " + e.what());
        }
        throw;
      }
    });
  } catch (...) {
    reducer_->abort_step(); // buckets already on the wire complete before anything else
    throw;
  }
  if (parts.size() > 1) timer_.mark(Phase::kBackward); // waiting for the other replicas
  if (sync) {
    apply_gradients();
    micro = 0;
  } else {
    ++micro;
  }
  // One replica: its sums as they are (no allocation per step); several: added on replica 0's
  // device (an empty slice has none).
  if (results.size() == 1 && results[0].defined()) return results[0];
  torch::Tensor total = zero_sums();
  for (const auto& r : results) {
    if (r.defined()) total.add_(r.to(device(), /*non_blocking=*/true));
  }
  return total;
}

void TrainStep::apply_gradients() {
  reducer_->finish();
  timer_.mark(Phase::kAllReduce);
  apply_update();
}

void TrainStep::apply_update() {
  bool apply = true;
  if (loss_scale_ || check_finite_) {
    // The all-reduced gradients are the same on every worker, so is this decision.
    const double inverse = loss_scale_ ? 1.0 / loss_scale_->scale() : 1.0;
    const torch::Tensor first = replicas_->module(0).parameters().front();
    torch::Tensor found_inf = torch::zeros({1}, first.options().dtype(torch::kFloat32));
    const torch::Tensor inv_scale = torch::full({1}, inverse, found_inf.options());
    for (int r = 0; r < replicas_->size(); ++r) {
      std::vector<torch::Tensor> grads;
      for (const auto& p : replicas_->module(r).parameters()) {
        if (p.grad().defined()) grads.push_back(p.grad());
      }
      if (!grads.empty())
        at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale);
    }
    last_step_finite_ = found_inf.item<float>() == 0;
    if (loss_scale_) apply = loss_scale_->update(last_step_finite_);
  }
  const std::int64_t rows = std::exchange(update_rows_, 0);
  if (apply) { // skipped otherwise: no update, and the schedules' step does not advance
    // Keeping the per-replica batch, the rate scales with the update's rows (the global batch
    // as it is, over the one the rate was set for): Goyal et al.'s linear rule, per update.
    const double scale = lr_global_rows_ > 0
                             ? static_cast<double>(rows) / static_cast<double>(lr_global_rows_)
                             : 1.0;
    if (options_.optimizer.global_clipnorm > 0) {
      replicas_->clip_gradients(options_.optimizer.global_clipnorm);
    }
    replicas_->step(options_.optimizer.learning_rate_at(schedule_step()) * scale);
    ++iterations_;
    trained_rows_ += rows;
  }
  timer_.mark(Phase::kOptimizer);
}

} // namespace detail
} // namespace flotilla::train
