#include "flotilla/train/model.h"

#include <ATen/autocast_mode.h>
#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>

#include <torch/cuda.h>
#include <torch/version.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <limits>
#include <mutex>
#include <utility>

#include "flotilla/base/thread_pool.h"
#include "flotilla/error.h"
#include "flotilla/train/callbacks.h"
#include "train/step_graph.h"

namespace flotilla::train {

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

  base::ThreadPool pool;
  std::vector<std::exception_ptr> errors;
};

// Times a step's phases: each mark() charges the time since the previous mark to a phase, so the
// phases of a step are consecutive and add up to its wall-clock time. A few clock reads a step;
// spans are kept only while tracing.
struct Model::StepClock {
  using Clock = std::chrono::steady_clock;
  PhaseTimes epoch;           // this epoch's sums
  StepTrace* trace = nullptr; // the step being traced, if any
  Clock::time_point origin;   // the trace's zero
  bool sync_cuda = false;     // tracing on CUDA: wait for the kernels at each mark
  Clock::time_point step_start;
  Clock::time_point last;
  bool active = false; // between start_step() and end_step(): work outside steps is not charged

  void start_step() {
    step_start = last = Clock::now();
    active = true;
  }
  void mark(Phase phase) {
    if (!active) return;
    if (sync_cuda) torch::cuda::synchronize();
    const auto now = Clock::now();
    const double seconds = std::chrono::duration<double>(now - last).count();
    epoch[phase] += seconds;
    if (trace) {
      if (!trace->spans.empty() && trace->spans.back().phase == phase) {
        trace->spans.back().seconds += seconds; // one span per stretch of a phase
      } else {
        trace->spans.push_back(
            {phase, std::chrono::duration<double>(last - origin).count(), seconds});
      }
    }
    last = now;
  }
  // The step's tail since the last mark (its bookkeeping) counts as callbacks' time.
  void end_step() {
    if (!active) return;
    mark(Phase::kCallbacks);
    epoch.step_seconds += std::chrono::duration<double>(last - step_start).count();
    ++epoch.steps;
    trace = nullptr;
    active = false;
  }
};

// jit_compile on CUDA: the step's forward, backward and gradient all-reduce captured once in a
// CUDA graph, after a few eager warm-up steps (the allocator, cuBLAS and NCCL set themselves up
// then), and replayed for every batch of the captured shapes. The optimizer stays eager: LibTorch's
// optimizers read their learning rate and step count on the host, which a graph would freeze.
struct Model::Compiled {
  static constexpr int kWarmupSteps = 3;
  explicit Compiled(const torch::Device& device) : stream(device) {}
  detail::SideStream stream; // the gradient engine is made, and every step runs, on it
  detail::StepGraph graph;
  std::vector<torch::Tensor> inputs; // static copies of the batch's components, read by the graph
  torch::Tensor loss_factor;         // loss scale / replica share: changes without a re-capture
  torch::Tensor sums;                // the captured step's batch sums, rewritten by each replay
  int eager_steps = 0;
  bool told_shapes = false; // said once that a batch of other shapes runs eagerly
};

void Logs::set(const std::string& key, double value) {
  for (auto& [k, v] : items_) {
    if (k == key) {
      v = value;
      return;
    }
  }
  items_.emplace_back(key, value);
}

std::optional<double> Logs::get(const std::string& key) const {
  for (const auto& [k, v] : items_) {
    if (k == key) return v;
  }
  return std::nullopt;
}

double Logs::at(const std::string& key) const {
  if (auto v = get(key)) return *v;
  std::string keys;
  for (const auto& [k, v] : items_) keys += (keys.empty() ? "" : ", ") + k;
  throw ConfigError("no \"" + key + "\" in the logs; they have: " +
                    (keys.empty() ? std::string("nothing yet") : keys) +
                    (key.rfind("val_", 0) == 0 ? " (val_ keys need validation_data)" : ""));
}

std::vector<double> History::operator[](const std::string& key) const {
  std::vector<double> values;
  for (const auto& e : epochs) {
    values.push_back(e.values.get(key).value_or(std::numeric_limits<double>::quiet_NaN()));
  }
  return values;
}

Model::Model(strategy::Strategy& strategy, std::shared_ptr<torch::nn::Module> module,
             Forward forward, std::function<Replica()> clone)
    : strategy_(strategy), module_(std::move(module)), forward_(std::move(forward)),
      clone_(std::move(clone)), clock_(std::make_unique<StepClock>()) {
  if (!module_ || !forward_) throw ConfigError("Model needs a module and its forward function");
}

Model::~Model() = default;

void Model::set_step_tracing(bool on, std::int64_t max_steps) {
  if (on && max_steps < 1) {
    throw ConfigError("step tracing needs max_steps >= 1; saw " + std::to_string(max_steps));
  }
  tracing_ = on;
  max_traced_steps_ = max_steps;
}

std::vector<StepTrace> Model::take_step_traces() {
  return std::exchange(traces_, {});
}

const strategy::GradientReducer& Model::gradient_reducer() const {
  require_compiled("gradient_reducer");
  return *reducer_;
}

const CompileOptions& Model::compile_options() const {
  require_compiled("compile_options");
  return *compiled_;
}

torch::optim::Optimizer& Model::optimizer() {
  require_compiled("optimizer");
  return *optimizers_.front();
}

std::vector<torch::optim::Optimizer*> Model::optimizers() {
  require_compiled("optimizers");
  std::vector<torch::optim::Optimizer*> all;
  for (auto& optimizer : optimizers_) all.push_back(optimizer.get());
  return all;
}

double Model::learning_rate() const {
  require_compiled("learning_rate");
  return compiled_->optimizer.learning_rate_at(iterations_);
}

void Model::set_learning_rate(double learning_rate) {
  require_compiled("set_learning_rate");
  if (compiled_->optimizer.schedule) {
    throw ConfigError("the learning rate follows a schedule (" +
                      compiled_->optimizer.schedule->describe() +
                      "); a LearningRateScheduler cannot also set it. Use one or the other");
  }
  if (!(learning_rate > 0)) {
    throw ConfigError("learning rate must be positive; saw " + std::to_string(learning_rate));
  }
  compiled_->optimizer.learning_rate = learning_rate;
}

void Model::compile(const CompileOptions& options) {
  compiled_.reset(); // until this compile succeeds, the model is not compiled
  validate(options.loss);
  validate(options.optimizer);
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
                          "\" is used twice; names are "
                          "the keys of the logs and must be unique");
      }
    }
  }
  if (options.gradient_accumulation_steps < 1) {
    throw ConfigError("gradient_accumulation_steps must be at least 1; saw " +
                      std::to_string(options.gradient_accumulation_steps));
  }
  if (options.steps_per_execution < 1) {
    throw ConfigError("steps_per_execution must be at least 1; saw " +
                      std::to_string(options.steps_per_execution));
  }
  const Policy policy = global_policy();
  std::optional<LossScale> loss_scale;
  if (options.loss_scale) {
    loss_scale.emplace(*options.loss_scale);
  } else if (policy == Policy::kMixedFloat16) {
    loss_scale.emplace(LossScaleOptions{});
  }
  const int replicas = strategy_.replicas_per_worker();
  if (replicas > 1 && !clone_) {
    throw ConfigError("replicas_per_worker is " + std::to_string(replicas) +
                      ", but this Model cannot copy its module: construct it from a module "
                      "holder (torch::nn::Sequential, a TORCH_MODULE), or pass a clone function");
  }
  reducer_.reset(); // its hooks sit on the replicas being replaced
  threads_.reset();
  graph_.reset();
  replicas_.clear();
  const auto& devices = strategy_.devices();
  // A model built outside scope() is moved here, before the optimizer and the gradient engine
  // take its parameters; but not off a GPU the user chose onto the strategy's CPU.
  for (const auto& p : module_->parameters()) {
    if (p.is_cuda() && devices.front().is_cpu()) {
      throw ConfigError("the model is on " + p.device().str() +
                        ", but the strategy's replicas "
                        "are on the CPU; give the strategy that device (MirroredStrategy("
                        "parse_devices(\"" +
                        p.device().str() +
                        "\")), --devices) or build the "
                        "model in strategy.scope()");
    }
  }
  module_->to(devices.front());
  replicas_.emplace_back(module_, forward_);
  for (int r = 1; r < replicas; ++r) {
    replicas_.push_back(clone_());
    if (!replicas_.back().first) {
      throw ConfigError("the clone function returned no module for replica " + std::to_string(r));
    }
    replicas_.back().first->to(devices[static_cast<std::size_t>(r)]);
  }
  optimizers_.clear();
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  for (const auto& [replica, forward] : replicas_) {
    modules.push_back(replica);
    optimizers_.push_back(make_optimizer(options.optimizer, replica->parameters()));
  }
  const std::string why_no_graph =
      why_no_captured_step(strategy_, options.gradient_accumulation_steps);
  if (options.jit_compile && why_no_graph.empty()) {
    graph_ = std::make_unique<Compiled>(devices.front());
  }
  {
    // Under jit_compile the gradient accumulators (and with them the engine's hooks) belong to
    // the side stream the steps run on, or a capture would meet the default stream.
    std::optional<detail::SideStream::Use> side;
    if (graph_) side.emplace(graph_->stream);
    reducer_ = strategy_.make_gradient_reducer(modules);
  }
  if (replicas > 1) threads_ = std::make_unique<Threads>(replicas);
  devices_ = devices;
  metrics_ = std::move(metrics);
  policy_ = policy;
  loss_scale_ = loss_scale;
  iterations_ = 0;
  resume_.reset();
  compiled_ = options;
  if (strategy_.is_chief()) {
    const auto& log = strategy_.log();
    if (options.optimizer.schedule) {
      for (const auto& warning : options.optimizer.schedule->warnings()) log.warn(warning);
    }
    if (options.jit_compile && !graph_) log.info("jit_compile: no effect (" + why_no_graph + ")");
    if (policy == Policy::kMixedFloat16 && module_->parameters().size() > 0 &&
        !module_->parameters().front().is_cuda()) {
      log.warn("mixed_float16 on the CPU: LibTorch's CPU autocast computes in float16 slowly on "
               "most CPUs; mixed_bfloat16 is the CPU's mixed precision");
    }
  }
}

std::string why_no_captured_step(strategy::Strategy& strategy, int gradient_accumulation_steps) {
  if (!strategy.devices().front().is_cuda()) {
    return "on the CPU the step is compiled C++ already; a CUDA graph needs CUDA replicas";
  }
  if (!detail::cuda_graphs_built()) return "this flotilla was built against a LibTorch without CUDA";
  if (strategy.replicas_per_worker() > 1) {
    return "a graph over several GPUs per worker is not captured yet: use one GPU per worker "
           "(one worker per GPU) for a captured step";
  }
  if (gradient_accumulation_steps > 1) return "gradient accumulation steps are not captured";
  if (strategy.num_workers() > 1 &&
      (strategy.communicator().options().implementation == collective::Implementation::kRing ||
       !collective::nccl_available())) {
    return "the workers' all-reduce goes over Gloo, which a CUDA graph cannot capture; use "
           "implementation AUTO or NCCL";
  }
  return "";
}

void Model::require_compiled(const char* what) const {
  if (!compiled_) {
    throw ConfigError(std::string("Model.") + what + "() before compile(); call compile() first");
  }
}

TrainingState Model::training_state() const {
  TrainingState state;
  state.iterations = iterations_;
  state.epoch = epoch_index_;
  state.step_in_epoch = step_in_epoch_;
  if (pass_) {
    data::IteratorState position = pass_->save();
    // At an epoch's end without steps_per_epoch, the next epoch is the next pass, from its start.
    if (step_in_epoch_ == 0 && !pass_continues_) {
      position.iteration += 1;
      position.produced = 0;
    }
    state.iterator = position;
  }
  if (loss_scale_) {
    state.loss_scale = loss_scale_->scale();
    state.loss_scale_good_steps = loss_scale_->good_steps();
  }
  return state;
}

void Model::restore_training_state(const TrainingState& state) {
  require_compiled("restore_training_state");
  iterations_ = state.iterations;
  if (loss_scale_ && state.loss_scale > 0) {
    loss_scale_->restore(state.loss_scale, state.loss_scale_good_steps);
  }
  resume_ = state;
}

History Model::fit(const data::Dataset& train, const FitOptions& options) {
  return fit(data::distribute_dataset(train, strategy_.input_context()), options);
}

namespace {

// (features, labels[, weights]) of a replica batch, checked.
void check_element(const data::Element& e) {
  if (e.size() < 2) {
    throw DataError("a training element needs (features, labels[, weights]); saw " +
                    std::to_string(e.size()) + " component(s)");
  }
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

} // namespace

// Per-example sums of a batch: loss, then each metric, then the example count (float64, on
// replica 0's device).
struct Model::StepSums {
  torch::Tensor sums;
};

void Model::check_consistency(const data::DistributedDataset& train, const FitOptions& options) {
  const auto& comm = strategy_.communicator().options();
  std::vector<std::pair<std::string, std::string>> fields = {
      {"flotilla version", FLOTILLA_VERSION},
      {"LibTorch version", TORCH_VERSION},
      {"replicas per worker", std::to_string(strategy_.replicas_per_worker())},
      {"precision policy", to_string(policy_)},
      {"loss scaling",
       loss_scale_ ? (loss_scale_->options().dynamic ? "dynamic" : "fixed") : std::string("off")},
      {"optimizer", compiled_->optimizer.describe()},
      {"loss", to_string(compiled_->loss.kind)},
      {"per-replica batch", train.per_replica_batch() > 0
                                ? std::to_string(train.per_replica_batch())
                                : std::string("set by the input pipeline")},
      {"gradient accumulation steps", std::to_string(compiled_->gradient_accumulation_steps)},
      {"bytes_per_pack", std::to_string(comm.bytes_per_pack)},
      {"compression", std::string(collective::to_string(comm.compression))},
      {"overlap", comm.overlap ? "on" : "off"},
      {"bucket plan", reducer_->plan()},
      {"epochs", std::to_string(options.epochs)},
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

void Model::apply_gradients() {
  reducer_->finish();
  clock_->mark(Phase::kAllReduce);
  apply_update();
}

void Model::apply_update() {
  bool apply = true;
  if (loss_scale_ || check_finite_) {
    // The all-reduced gradients are the same on every worker, so is this decision.
    const double inverse = loss_scale_ ? 1.0 / loss_scale_->scale() : 1.0;
    const torch::Tensor first = module_->parameters().front();
    torch::Tensor found_inf = torch::zeros({1}, first.options().dtype(torch::kFloat32));
    const torch::Tensor inv_scale = torch::full({1}, inverse, found_inf.options());
    for (const auto& [replica, forward] : replicas_) {
      std::vector<torch::Tensor> grads;
      for (const auto& p : replica->parameters()) {
        if (p.grad().defined()) grads.push_back(p.grad());
      }
      if (!grads.empty())
        at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale);
    }
    last_step_finite_ = found_inf.item<float>() == 0;
    if (loss_scale_) apply = loss_scale_->update(last_step_finite_);
  }
  if (apply) { // skipped otherwise: no update, and the schedules' step does not advance
    const double lr = compiled_->optimizer.learning_rate_at(iterations_);
    for (auto& optimizer : optimizers_) {
      train::set_learning_rate(*optimizer, lr);
      optimizer->step();
    }
    ++iterations_;
  }
  clock_->mark(Phase::kOptimizer);
}

std::vector<PhaseTimes> Model::gather_phases(const PhaseTimes& mine) {
  std::vector<double> flat(mine.seconds.begin(), mine.seconds.end());
  flat.push_back(mine.step_seconds);
  flat.push_back(mine.comm_seconds);
  flat.push_back(static_cast<double>(mine.steps));
  auto& comm = strategy_.communicator();
  if (comm.size() == 1) return {mine};
  collective::Work work = comm.all_gather(torch::tensor(flat, torch::kFloat64));
  work.wait();
  std::vector<PhaseTimes> all;
  for (const auto& t : work.result()) {
    const torch::Tensor host = t.to(torch::kCPU).contiguous();
    const double* v = host.data_ptr<double>();
    PhaseTimes p;
    std::copy(v, v + kPhaseCount, p.seconds.begin());
    p.step_seconds = v[kPhaseCount];
    p.comm_seconds = v[kPhaseCount + 1];
    p.steps = static_cast<std::int64_t>(v[kPhaseCount + 2]);
    all.push_back(p);
  }
  return all;
}

torch::Tensor Model::batch_sums(const torch::Tensor& per_example_loss, const torch::Tensor& outputs,
                                const torch::Tensor& labels) const {
  // On the device, in float64, the example count last: summed over steps there and read by the
  // host only when logs are due (no synchronisation per step on CUDA).
  std::vector<torch::Tensor> sums = {per_example_loss.sum()};
  for (const auto& metric : metrics_) sums.push_back(metric.per_example(outputs, labels).sum());
  sums.push_back(torch::full({}, static_cast<double>(labels.size(0)),
                             per_example_loss.options().dtype(torch::kFloat64)));
  return torch::stack(sums).to(torch::kFloat64);
}

namespace {
// `t` on `device`: itself when it is there; asynchronous from pinned host memory.
torch::Tensor on_device(const torch::Tensor& t, const torch::Device& device) {
  if (t.device() == device) return t;
  return t.to(torch::TensorOptions().device(device), /*non_blocking=*/t.is_pinned());
}

std::vector<double> to_host(const torch::Tensor& sums) {
  const torch::Tensor host = sums.to(torch::kCPU, torch::kFloat64).contiguous();
  return std::vector<double>(host.data_ptr<double>(), host.data_ptr<double>() + host.numel());
}
} // namespace

std::optional<torch::Tensor> Model::replay_step(const data::Element& batch, double loss_factor) {
  Compiled& g = *graph_;
  if (g.graph.captured()) {
    bool same = batch.size() == g.inputs.size();
    for (std::size_t k = 0; same && k < batch.size(); ++k) {
      same = batch[k].sizes() == g.inputs[k].sizes() &&
             batch[k].scalar_type() == g.inputs[k].scalar_type();
    }
    if (!same) {
      if (!g.told_shapes && strategy_.is_chief()) {
        strategy_.log().info(
            "jit_compile: a batch of shape " + c10::str(batch[0].sizes()) +
            " differs from the captured " + c10::str(g.inputs[0].sizes()) +
            "; such batches run eagerly (batch with drop_remainder for one shape)");
      }
      g.told_shapes = true;
      return std::nullopt;
    }
  } else {
    for (const auto& t : batch) g.inputs.push_back(torch::empty_like(t));
    g.loss_factor = torch::ones({}, torch::TensorOptions().device(devices_[0]));
  }
  for (std::size_t k = 0; k < batch.size(); ++k) g.inputs[k].copy_(batch[k], /*non_blocking=*/true);
  g.loss_factor.fill_(loss_factor);
  clock_->mark(Phase::kCopy);
  if (!g.graph.captured()) {
    // What one eager step does between the copy and the optimizer, recorded instead of run.
    auto body = [&] {
      reducer_->zero_grad();
      reducer_->prepare(true);
      torch::Tensor outputs;
      {
        AutocastGuard autocast(policy_, devices_[0].type());
        // Casts cached across the capture's edge would be stale on replay.
        const bool cache = at::autocast::is_autocast_cache_enabled();
        at::autocast::set_autocast_cache_enabled(false);
        outputs = replicas_[0].second(g.inputs[0]);
        at::autocast::set_autocast_cache_enabled(cache);
      }
      torch::Tensor per_example = per_example_loss(compiled_->loss, outputs, g.inputs[1]);
      if (g.inputs.size() > 2) per_example = per_example * g.inputs[2].to(per_example.dtype());
      (per_example.sum() * g.loss_factor).backward();
      {
        torch::NoGradGuard no_grad;
        g.sums = batch_sums(per_example.detach(), outputs.detach(), g.inputs[1]);
      }
      reducer_->finish();
    };
    try {
      g.graph.capture(body);
    } catch (const std::exception& e) {
      // Fatal: the other workers may have captured their all-reduces, and stepping on eagerly
      // would leave them waiting for collectives this worker never issues.
      reducer_->abort_step();
      throw ConfigError(std::string("jit_compile: capturing the step in a CUDA graph failed (") +
                        e.what() +
                        "); a step that reads values back to the host (a parameter some replica "
                        "leaves unused, a metric or callback that copies to the CPU) cannot be "
                        "captured. Run without jit_compile (drop --jit-compile)");
    }
    if (strategy_.is_chief()) {
      strategy_.log().info("jit_compile: the step's forward, backward and all-reduce are captured "
                           "in a CUDA graph (batch " +
                           c10::str(batch[0].sizes()) + "); the optimizer runs eagerly");
    }
  }
  g.graph.replay();
  clock_->mark(Phase::kBackward);
  apply_update();
  return g.sums;
}

Model::StepSums Model::train_step(const data::ReplicaBatch& batch, int& micro) {
  const int num_replicas = static_cast<int>(replicas_.size());
  check_element(batch.element);
  // This worker's batch, split as evenly as possible over its replicas.
  std::vector<data::Element> parts(static_cast<std::size_t>(num_replicas));
  for (const auto& component : batch.element) {
    auto pieces = num_replicas == 1 ? std::vector<torch::Tensor>{component}
                                    : torch::tensor_split(component, num_replicas);
    for (int r = 0; r < num_replicas; ++r) {
      // To the replica's device (a no-op when the batch is there already); pinned host memory
      // makes it asynchronous.
      parts[r].push_back(on_device(pieces[r], devices_[r]));
      // Under jit_compile the step runs on a side stream, not the one the input was made for.
      if (graph_) detail::use_on_current_stream(parts[r].back());
    }
  }
  const double share =
      static_cast<double>(batch.global_batch_size) / strategy_.num_replicas_in_sync();
  const double scale = loss_scale_ ? loss_scale_->scale() : 1.0;
  if (graph_ && parts[0][1].size(0) > 0) {
    if (graph_->eager_steps >= Compiled::kWarmupSteps) {
      if (auto sums = replay_step(parts[0], scale / share)) return StepSums{*sums};
    } else {
      ++graph_->eager_steps;
    }
  }
  clock_->mark(Phase::kCopy);
  const int accumulation = compiled_->gradient_accumulation_steps;
  if (micro == 0) reducer_->zero_grad();
  const bool sync = micro + 1 == accumulation;
  reducer_->prepare(sync);
  std::vector<StepSums> results(static_cast<std::size_t>(num_replicas));
  auto replica_step = [&](int r) {
    const data::Element& e = parts[r];
    const torch::Tensor& labels = e[1];
    // An empty slice (a short last batch over many replicas) runs no forward — a batch
    // norm could not — but still joins the reduction, with no gradients of its own.
    if (labels.size(0) == 0) return;
    torch::Tensor outputs;
    {
      AutocastGuard autocast(policy_, e[0].device().type());
      outputs = replicas_[r].second(e[0]);
    }
    torch::Tensor per_example = per_example_loss(compiled_->loss, outputs, labels);
    if (e.size() > 2) per_example = per_example * e[2].to(per_example.dtype());
    // Replica 0 runs on this thread and times the phases; the others' extra time shows as
    // backward, where this thread waits for them.
    if (r == 0) clock_->mark(Phase::kForward);
    // Summed over this replica's slice and divided by the global batch's share per
    // replica: averaged over replicas by the reducer, that is the global batch's mean loss
    // exactly, short last batches included.
    (per_example.sum() * (scale / share)).backward();
    if (r == 0) clock_->mark(Phase::kBackward);
    torch::NoGradGuard no_grad;
    results[r].sums = batch_sums(per_example.detach(), outputs.detach(), labels);
    if (r == 0) clock_->mark(Phase::kMetrics);
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
  if (threads_) clock_->mark(Phase::kBackward); // waiting for the other replicas
  if (sync) {
    apply_gradients();
    micro = 0;
  } else {
    ++micro;
  }
  // One replica: its sums as they are (no allocation per step); several: added on replica 0's
  // device (an empty slice has none).
  if (results.size() == 1 && results[0].sums.defined()) return results[0];
  StepSums total{torch::zeros({static_cast<std::int64_t>(metrics_.size()) + 2},
                              torch::TensorOptions().dtype(torch::kFloat64).device(devices_[0]))};
  for (const auto& r : results) {
    if (r.sums.defined()) total.sums.add_(r.sums.to(devices_[0], /*non_blocking=*/true));
  }
  return total;
}

History Model::fit(const data::DistributedDataset& train, const FitOptions& options) {
  require_compiled("fit");
  if (options.epochs < 1) {
    throw ConfigError("epochs must be at least 1; saw " + std::to_string(options.epochs));
  }
  if (options.initial_epoch < 0 || options.initial_epoch >= options.epochs) {
    throw ConfigError("initial_epoch must be in [0, epochs); saw " +
                      std::to_string(options.initial_epoch) + " with epochs " +
                      std::to_string(options.epochs));
  }
  if (options.steps_per_epoch && *options.steps_per_epoch < 1) {
    throw ConfigError("steps_per_epoch must be at least 1; saw " +
                      std::to_string(*options.steps_per_epoch));
  }
  if (options.validation_freq < 1) {
    throw ConfigError("validation_freq must be at least 1; saw " +
                      std::to_string(options.validation_freq));
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
  // Every worker has just left the same collective: the timelines' common zero.
  clock_->origin = std::chrono::steady_clock::now();
  if (agreed && known == data::kInfiniteCardinality && !options.steps_per_epoch) {
    throw ConfigError("the training dataset is endless (repeat() without a count), so an epoch "
                      "would never end; set FitOptions.steps_per_epoch (--steps-per-epoch)");
  }
  std::optional<data::DistributedDataset> validation;
  if (options.validation_data) {
    validation.emplace(
        data::distribute_dataset(*options.validation_data, strategy_.input_context()));
  }

  // Callbacks: the user's, plus a progress bar unless silent or given (Keras's ProgbarLogger).
  std::vector<std::shared_ptr<Callback>> callbacks = options.callbacks;
  Verbosity verbose = options.verbose;
  if (verbose == Verbosity::kAuto) {
    verbose = ::isatty(STDOUT_FILENO) ? Verbosity::kProgressBar : Verbosity::kOneLinePerEpoch;
  }
  const bool has_bar = std::any_of(callbacks.begin(), callbacks.end(), [](const auto& c) {
    return dynamic_cast<const ProgressBar*>(c.get()) != nullptr;
  });
  if (verbose != Verbosity::kSilent && !has_bar) {
    callbacks.insert(callbacks.begin(), std::make_shared<ProgressBar>(verbose));
  }
  check_finite_ = std::any_of(callbacks.begin(), callbacks.end(), [](const auto& c) {
    return dynamic_cast<const TerminateOnNaN*>(c.get()) != nullptr;
  });
  TrainParams params;
  params.epochs = options.epochs;
  params.steps = options.steps_per_epoch.value_or(agreed && known >= 0 ? known : 0);
  params.verbose = verbose;
  for (auto& c : callbacks) {
    if (!c) throw ConfigError("a null callback was passed to fit()");
    c->set_model(this);
    c->set_params(params);
  }
  auto each = [&](const auto& hook) {
    for (auto& c : callbacks) hook(*c);
  };

  History history;
  auto& net = module();
  const int num_replicas = static_cast<int>(replicas_.size());
  stop_training = false;
  pass_continues_ = options.steps_per_epoch.has_value();
  epoch_index_ = options.initial_epoch;
  step_in_epoch_ = 0;
  std::optional<data::DistributedIterator> pass;
  // However fit() ends, the model no longer points at this fit's iterator.
  struct ClearPass {
    const data::DistributedIterator** pass;
    ~ClearPass() { *pass = nullptr; }
  } clear_pass{&pass_};

  each([](Callback& c) { c.on_train_begin(); }); // BackupAndRestore may set resume_ here
  // Tracing (a Profiler turns it on in on_train_begin) lasts this fit, however it ends.
  traces_.clear();
  clock_->sync_cuda = tracing_ && !devices_.empty() && devices_.front().is_cuda();
  struct StopTracing {
    bool* tracing;
    ~StopTracing() { *tracing = false; }
  } stop_tracing{&tracing_};
  // Replicas are clones made at compile(); weights loaded into the model since then (a
  // checkpoint, a backup, a user's edit) reach the other replicas here.
  if (num_replicas > 1) {
    torch::NoGradGuard no_grad;
    const auto params_0 = net.parameters();
    const auto buffers = net.buffers();
    for (int r = 1; r < num_replicas; ++r) {
      const auto theirs = replicas_[r].first->parameters();
      const auto their_buffers = replicas_[r].first->buffers();
      if (theirs.size() != params_0.size() || their_buffers.size() != buffers.size()) {
        throw ConfigError("the model now has " + std::to_string(params_0.size()) +
                          " parameters and " + std::to_string(buffers.size()) +
                          " buffers, its replicas " + std::to_string(theirs.size()) + " and " +
                          std::to_string(their_buffers.size()) +
                          " (changed after compile()); call compile() again");
      }
      for (std::size_t k = 0; k < params_0.size(); ++k) theirs[k].copy_(params_0[k]);
      for (std::size_t k = 0; k < buffers.size(); ++k) their_buffers[k].copy_(buffers[k]);
    }
  }
  int first_epoch = options.initial_epoch; // 0-based
  std::int64_t resume_step = 0;
  if (resume_) {
    first_epoch = std::max(first_epoch, resume_->epoch);
    resume_step = resume_->step_in_epoch;
    if (resume_->iterator) pass.emplace(train.make_iterator(*resume_->iterator));
    resume_.reset();
  }

  const std::int64_t every = compiled_->steps_per_execution;
  bool ran_out = false;
  // A captured step is warmed up, captured and replayed on one side stream.
  std::optional<detail::SideStream::Use> side_stream;
  if (graph_) side_stream.emplace(graph_->stream);
  for (int epoch = first_epoch; epoch < options.epochs && !ran_out && !stop_training; ++epoch) {
    // A new pass per epoch, unless one pass runs across epochs or a resume made this one.
    if (!pass || (!options.steps_per_epoch && epoch != first_epoch)) {
      pass.emplace(train.make_iterator());
    }
    pass_ = &*pass;
    epoch_index_ = epoch;
    step_in_epoch_ = epoch == first_epoch ? resume_step : 0;
    for (auto& [replica, forward] : replicas_) replica->train();
    each([&](Callback& c) { c.on_epoch_begin(epoch); });
    const torch::Tensor epoch_sums =
        torch::zeros({static_cast<std::int64_t>(metrics_.size()) + 2},
                     torch::TensorOptions().dtype(torch::kFloat64).device(devices_[0]));
    clock_->epoch = PhaseTimes{};
    std::int64_t steps = 0;
    std::int64_t skipped = 0;
    int micro = 0; // batches accumulated since the last optimizer step
    const auto comm_before = reducer_->stats();
    const auto start = std::chrono::steady_clock::now();
    while (!options.steps_per_epoch || step_in_epoch_ < *options.steps_per_epoch) {
      StepTrace* trace = nullptr;
      if (tracing_ && static_cast<std::int64_t>(traces_.size()) < max_traced_steps_) {
        trace = &traces_.emplace_back();
        trace->epoch = epoch;
        trace->step = step_in_epoch_;
      }
      clock_->trace = trace;
      clock_->start_step();
      std::optional<data::ReplicaBatch> batch = pass->next();
      bool have = batch.has_value();
      if (!agreed) {
        have =
            strategy_.reduce(strategy::ReduceOp::kMin, torch::tensor({have ? 1 : 0})).item<int>() ==
            1;
      }
      if (!have) {
        clock_->active = false; // no step: the pass's end is not a step's input wait
        if (trace) traces_.pop_back();
        ran_out = options.steps_per_epoch.has_value();
        break;
      }
      clock_->mark(Phase::kInput);
      const bool hooks = step_in_epoch_ % every == 0;
      if (hooks) {
        each([&](Callback& c) { c.on_train_batch_begin(step_in_epoch_); });
        clock_->mark(Phase::kCallbacks);
      }
      const std::int64_t iterations_before = iterations_;
      const StepSums sums = train_step(*batch, micro);
      if (trace && micro == 0) { // this step's all-reduces (none while accumulating)
        for (const auto& [begin, end] : reducer_->last_all_reduces()) {
          trace->all_reduces.emplace_back(
              std::chrono::duration<double>(begin - clock_->origin).count(),
              std::chrono::duration<double>(end - clock_->origin).count());
        }
      }
      if (micro == 0 && iterations_ == iterations_before) ++skipped;
      epoch_sums.add_(sums.sums);
      ++steps;
      ++step_in_epoch_;
      const bool last = options.steps_per_epoch && step_in_epoch_ == *options.steps_per_epoch;
      std::vector<double> totals;
      if (step_in_epoch_ % every == 0 || last) totals = to_host(epoch_sums);
      if (!totals.empty() && totals.back() > 0) {
        Logs running;
        running.set("loss", totals[0] / totals.back());
        for (std::size_t m = 0; m < metrics_.size(); ++m) {
          running.set(metrics_[m].name, totals[m + 1] / totals.back());
        }
        each([&](Callback& c) { c.on_train_batch_end(step_in_epoch_ - 1, running); });
        clock_->end_step();
        if (stop_training) break;
      }
      clock_->end_step();
    }
    // The steps' all-reduce time, without the partial accumulation's below (in no step).
    const double comm_in_steps = reducer_->stats().comm_seconds - comm_before.comm_seconds;
    if (micro > 0) apply_gradients(); // the epoch's last, partial accumulation
    if (steps == 0) {
      // Resumed from a backup taken at the very end of an epoch (the last step of a pass whose
      // length was not known in advance): that epoch is over, the next ones are still to do.
      if (epoch == first_epoch && resume_step > 0 && !ran_out) continue;
      break; // the data ran out at an epoch's start: nothing to report
    }
    const double seconds = seconds_since(start);
    const std::vector<double> totals = to_host(epoch_sums);
    const torch::Tensor global =
        strategy_.reduce(strategy::ReduceOp::kSum, torch::tensor(totals, torch::kFloat64));
    const auto g = global.accessor<double, 1>();
    const double count = g[static_cast<std::int64_t>(totals.size()) - 1];
    EpochLogs logs;
    logs.epoch = epoch + 1;
    logs.steps = steps;
    logs.values.set("loss", g[0] / count);
    for (std::size_t m = 0; m < metrics_.size(); ++m) {
      logs.values.set(metrics_[m].name, g[static_cast<std::int64_t>(m) + 1] / count);
    }
    logs.values.set("learning_rate", compiled_->optimizer.learning_rate_at(iterations_));
    logs.seconds = seconds;
    logs.samples_per_s = count / seconds;
    logs.skipped_steps = skipped;
    logs.phases = clock_->epoch;
    logs.phases.comm_seconds = comm_in_steps;
    logs.worker_phases = gather_phases(logs.phases);
    step_in_epoch_ = 0; // at the boundary: a backup taken now resumes at the next epoch
    epoch_index_ = epoch + 1;
    if (validation && (epoch + 1) % options.validation_freq == 0) {
      const EvalResult val = evaluate_impl(*validation);
      for (const auto& [key, value] : val.values.items()) logs.values.set("val_" + key, value);
      for (auto& [replica, forward] : replicas_) replica->train();
    }
    each([&](Callback& c) { c.on_epoch_end(epoch, logs); });
    // A stop decided by one worker alone (a user's callback) must stop them all.
    stop_training =
        strategy_
            .reduce(strategy::ReduceOp::kMax, torch::tensor({stop_training ? 1 : 0}, torch::kInt32))
            .item<int>() == 1;
    history.epochs.push_back(logs);
  }
  if (ran_out && strategy_.is_chief()) {
    strategy_.log().warn("your input ran out of data; interrupting training. Make sure the dataset "
                         "can give at least steps_per_epoch x epochs batches (use repeat())");
  }
  each([](Callback& c) { c.on_train_end(); });
  return history;
}

EvalResult Model::evaluate(const data::Dataset& data) {
  return evaluate(data::distribute_dataset(data, strategy_.input_context()));
}

EvalResult Model::evaluate(const data::DistributedDataset& data) {
  require_compiled("evaluate");
  return evaluate_impl(data);
}

EvalResult Model::evaluate_impl(const data::DistributedDataset& data) {
  torch::NoGradGuard no_grad;
  auto& net = module();
  net.eval();
  const torch::Device device = devices_.front(); // the model itself is replica 0
  torch::Tensor sums = torch::zeros({static_cast<std::int64_t>(metrics_.size()) + 2},
                                    torch::TensorOptions().dtype(torch::kFloat64).device(device));
  auto pass = data.make_iterator();
  while (auto batch = pass.next()) {
    check_element(batch->element);
    data::Element e;
    for (const auto& t : batch->element) {
      e.push_back(on_device(t, device));
      if (graph_) detail::use_on_current_stream(e.back()); // on the side stream inside fit()
    }
    const torch::Tensor& labels = e[1];
    if (labels.size(0) == 0) continue; // this worker's share of a short last batch
    torch::Tensor outputs;
    {
      AutocastGuard autocast(policy_, device.type());
      outputs = forward_(e[0]);
    }
    torch::Tensor per_example = per_example_loss(compiled_->loss, outputs, labels);
    if (e.size() > 2) per_example = per_example * e[2].to(per_example.dtype());
    sums.add_(batch_sums(per_example, outputs, labels));
  }
  const std::vector<double> totals = to_host(sums);
  const torch::Tensor global =
      strategy_.reduce(strategy::ReduceOp::kSum, torch::tensor(totals, torch::kFloat64));
  const auto g = global.accessor<double, 1>();
  EvalResult result;
  const double count = g[static_cast<std::int64_t>(totals.size()) - 1];
  result.samples = static_cast<std::int64_t>(count);
  const double denominator = count > 0 ? count : 1;
  result.values.set("loss", g[0] / denominator);
  for (std::size_t m = 0; m < metrics_.size(); ++m) {
    result.values.set(metrics_[m].name, g[static_cast<std::int64_t>(m) + 1] / denominator);
  }
  return result;
}

torch::Tensor Model::predict(const torch::Tensor& features) {
  torch::NoGradGuard no_grad;
  module().eval();
  const torch::Device device = devices_.empty() ? features.device() : devices_.front();
  AutocastGuard autocast(policy_, device.type());
  const torch::Tensor outputs = forward_(on_device(features, device));
  // On the caller's device, as given.
  return (policy_ == Policy::kFloat32 ? outputs : outputs.to(torch::kFloat32))
      .to(features.device());
}

} // namespace flotilla::train
