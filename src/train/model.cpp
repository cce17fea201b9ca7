#include "flotilla/train/model.h"

#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>

#include <torch/version.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <numeric>
#include <utility>

#include "flotilla/base/system.h"
#include "flotilla/collective/agreement.h"
#include "flotilla/collective/elastic.h"
#include "flotilla/error.h"
#include "flotilla/train/callback.h"
#include "flotilla/train/sync_batchnorm.h"
#include "train/captured_step.h"
#include "train/elastic_heal.h"
#include "train/epoch_iterator.h"
#include "train/preemption.h"
#include "train/replica_set.h"
#include "train/step_timer.h"

namespace flotilla::train {

namespace {
// Elastic: updates between two admission votes (one small all-reduce each, started at a step
// boundary and read at the next, so it overlaps a step). Few enough that a restarted worker
// waits little; rare enough that a fast step does not pay for it each time.
constexpr std::int64_t kAdmitEvery = 8;

// Elastic: a joining worker whose group holds no training state (the others finished or are
// gone). Not a departure to regroup after: the fit ends with it (exit 3).
class NothingToJoin : public CommError {
 public:
  using CommError::CommError;
};

// Elastic: whether a failure may be a member's departure, to regroup after: a CommError or a
// backend's own exception. Not flotilla's other errors: configuration, data and checkpoint
// errors are the same on every worker or this worker's own bad input, a preemption means this
// worker leaves, and members that cannot agree where to go on would not agree after a regroup.
bool healable(const std::exception& e) {
  return dynamic_cast<const CommError*>(&e) || !dynamic_cast<const Error*>(&e);
}
} // namespace

Model::Model(strategy::Strategy& strategy, std::shared_ptr<torch::nn::Module> module,
             Forward forward, std::function<Replica()> clone)
    : strategy_(strategy), module_(std::move(module)), forward_(std::move(forward)),
      clone_(std::move(clone)), timer_(std::make_unique<detail::StepTimer>()),
      end_(std::make_unique<detail::EpochEndRecord>()) {
  if (!module_ || !forward_) throw ConfigError("Model needs a module and its forward function");
}

Model::~Model() = default;

void Model::set_step_tracing(bool on, std::int64_t max_steps) {
  if (on && max_steps < 1) {
    throw ConfigError("step tracing needs max_steps >= 1; saw " + std::to_string(max_steps));
  }
  timer_->set_tracing(on, max_steps);
}

std::vector<StepTrace> Model::take_step_traces() {
  return timer_->take_traces();
}

const strategy::GradientReducer& Model::gradient_reducer() const {
  require_compiled("gradient_reducer");
  return *reducer_;
}

const CompileOptions& Model::compile_options() const {
  require_compiled("compile_options");
  return *options_;
}

std::vector<std::shared_ptr<torch::nn::Module>> Model::local_replicas() const {
  require_compiled("local_replicas");
  return replicas_->modules();
}

torch::optim::Optimizer& Model::optimizer() {
  require_compiled("optimizer");
  return *replicas_->optimizers().front();
}

std::vector<torch::optim::Optimizer*> Model::optimizers() {
  require_compiled("optimizers");
  return replicas_->optimizers();
}

double Model::learning_rate() const {
  require_compiled("learning_rate");
  const double rate = options_->optimizer.learning_rate_at(schedule_step());
  if (lr_global_rows_ == 0) return rate;
  // Keeping the per-replica batch: a whole step of the members there are (a pass's last step
  // may have fewer rows, and a lower rate).
  const strategy::InputContext context = strategy_.input_context();
  return rate * context.num_replicas_in_sync / context.full_replicas;
}

void Model::set_learning_rate(double learning_rate) {
  require_compiled("set_learning_rate");
  if (options_->optimizer.schedule) {
    throw ConfigError("the learning rate follows a schedule (" +
                      options_->optimizer.schedule->describe() +
                      "); a LearningRateScheduler cannot also set it. Use one or the other");
  }
  if (!(learning_rate > 0)) {
    throw ConfigError("learning rate must be positive; saw " + std::to_string(learning_rate));
  }
  options_->optimizer.learning_rate = learning_rate;
}

std::string why_no_captured_step(strategy::Strategy& strategy, int gradient_accumulation_steps) {
  if (!strategy.devices().front().is_cuda()) {
    return "on the CPU the step is compiled C++ already; a CUDA graph needs CUDA replicas";
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

namespace {

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

void check_fit_options(const FitOptions& options) {
  if (options.epochs < 1) {
    throw ConfigError("FitOptions::epochs must be at least 1; saw " +
                      std::to_string(options.epochs));
  }
  if (options.initial_epoch < 0 || options.initial_epoch >= options.epochs) {
    throw ConfigError("FitOptions::initial_epoch must be in [0, epochs); saw " +
                      std::to_string(options.initial_epoch) + " with epochs " +
                      std::to_string(options.epochs));
  }
  if (options.steps_per_epoch && *options.steps_per_epoch < 1) {
    throw ConfigError("FitOptions::steps_per_epoch must be at least 1; saw " +
                      std::to_string(*options.steps_per_epoch));
  }
  if (options.validation_freq < 1) {
    throw ConfigError("FitOptions::validation_freq must be at least 1; saw " +
                      std::to_string(options.validation_freq));
  }
}

// (features, labels[, weights]) of a replica batch, checked.
void check_element(const data::Element& e) {
  if (e.size() < 2) {
    throw DataError("a training element needs (features, labels[, weights]); saw " +
                    std::to_string(e.size()) + " component(s)");
  }
}

// `t` on `device`: itself when it is there; asynchronous from pinned host memory.
torch::Tensor on_device(const torch::Tensor& t, const torch::Device& device) {
  if (t.device() == device) return t;
  return t.to(torch::TensorOptions().device(device), /*non_blocking=*/t.is_pinned());
}

std::vector<double> to_host(const torch::Tensor& sums) {
  const torch::Tensor host = sums.to(torch::kCPU, torch::kFloat64).contiguous();
  return std::vector<double>(host.data_ptr<double>(), host.data_ptr<double>() + host.numel());
}

// Logs from loss and metric sums whose last element is the example count.
void set_means(Logs& logs, const std::vector<Metric>& metrics, const double* sums, double count) {
  logs.set("loss", sums[0] / count);
  for (std::size_t m = 0; m < metrics.size(); ++m) logs.set(metrics[m].name, sums[m + 1] / count);
}

// Each replica's SyncBatchNorm layers meet the others through its own context, over the
// worker's current group; the number of layers bound.
int bind_replica_contexts(strategy::Strategy& strategy, detail::ReplicaSet& replicas,
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

void Model::compile(const CompileOptions& options) {
  options_.reset(); // until this compile succeeds, the model is not compiled
  check_compile_options(options);
  std::vector<Metric> metrics = make_metrics(options);
  const Policy policy = global_policy();
  std::optional<LossScale> loss_scale;
  if (options.loss_scale) {
    loss_scale.emplace(*options.loss_scale);
  } else if (policy == Policy::kMixedFloat16) {
    loss_scale.emplace(LossScaleOptions{});
  }
  reducer_.reset(); // its hooks sit on the replicas being replaced
  captured_.reset();
  replicas_.reset();
  const bool channels_last = options.channels_last.value_or(detail::has_convolutions(*module_));
  replicas_ = std::make_unique<detail::ReplicaSet>(strategy_.devices(), Replica{module_, forward_},
                                                   clone_, options.optimizer, channels_last);
  channels_last_ = channels_last;
  sync_batchnorm_layers_ = bind_replica_contexts(strategy_, *replicas_, replica_contexts_);
  buffers_dirty_ = false; // the replicas are copies of the model
  std::string why_no_graph = why_no_captured_step(strategy_, options.gradient_accumulation_steps);
  if (why_no_graph.empty() && sync_batchnorm_layers_ > 0) {
    why_no_graph = "SyncBatchNorm reduces its statistics through the host between kernels, which "
                   "a CUDA graph cannot capture";
  }
  if (options.jit_compile && why_no_graph.empty()) {
    captured_ = std::make_unique<detail::CapturedStep>(replicas_->device(0));
  }
  {
    // Under jit_compile the gradient accumulators (and with them the engine's hooks) belong to
    // the side stream the steps run on, or a capture would meet the default stream.
    std::optional<detail::SideStream::Use> side;
    if (captured_) side.emplace(captured_->stream());
    reducer_ = strategy_.make_gradient_reducer(replicas_->modules());
  }
  metrics_ = std::move(metrics);
  policy_ = policy;
  loss_scale_ = loss_scale;
  iterations_ = 0;
  trained_rows_ = 0;
  resume_.reset();
  options_ = options;
  if (strategy_.is_chief()) {
    const auto& log = strategy_.log();
    if (options.optimizer.schedule) {
      for (const auto& warning : options.optimizer.schedule->warnings()) log.warn(warning);
    }
    if (options.jit_compile && !captured_) {
      log.info("jit_compile: no effect (" + why_no_graph + ")");
    }
    if (policy == Policy::kMixedFloat16 && !replicas_->device(0).is_cuda()) {
      log.warn("mixed_float16 on the CPU: LibTorch's CPU autocast computes in float16 slowly on "
               "most CPUs; mixed_bfloat16 is the CPU's mixed precision");
    }
  }
}

void Model::require_compiled(const char* what) const {
  if (!options_) {
    throw ConfigError(std::string("Model.") + what + "() before compile(); call compile() first");
  }
}

TrainingState Model::training_state() const {
  TrainingState state;
  state.iterations = iterations_;
  state.trained_rows = trained_rows_;
  state.epoch = epoch_index_;
  state.step_in_epoch = step_in_epoch_;
  if (input_) state.iterator = input_->position(step_in_epoch_);
  if (loss_scale_) {
    state.loss_scale = loss_scale_->scale();
    state.loss_scale_good_steps = loss_scale_->good_steps();
  }
  return state;
}

void Model::restore_training_state(const TrainingState& state) {
  require_compiled("restore_training_state");
  iterations_ = state.iterations;
  trained_rows_ = state.trained_rows; // -1 from an older checkpoint: counted at the next fit
  if (loss_scale_ && state.loss_scale > 0) {
    loss_scale_->restore(state.loss_scale, state.loss_scale_good_steps);
  }
  resume_ = state;
}

History Model::fit(const data::Dataset& train, const FitOptions& options) {
  return fit(data::distribute_dataset(train, strategy_.input_context()), options);
}

History Model::fit(const data::DistributedDataset& train, const FitOptions& options) {
  require_compiled("fit");
  check_fit_options(options);
  CallbackList callbacks(options.callbacks, options.verbose);
  const bool elastic = strategy_.elastic() != nullptr;
  if (elastic) check_elastic(train, options);
  // A worker joining a running elastic group makes none of the start-up agreements: its peers
  // are mid-fit. It gets their state below instead.
  const bool joining = strategy_.joining();
  if (!joining) check_consistency(train, options, callbacks);
  detail::EpochIterator input(train, options.steps_per_epoch, strategy_.communicator(), !joining);
  fit_input_ = &train;
  // Every worker has just left the same collective: the timelines' common zero.
  timer_->set_origin(base::Clock::now());
  std::optional<data::DistributedDataset> validation;
  if (options.validation_data) {
    validation.emplace(
        data::distribute_dataset(*options.validation_data, evaluation_context()));
  }
  const CallbackNeeds needs = callbacks.needs();
  check_finite_ = needs.finite_check;
  callbacks.set_model(this,
                      TrainParams{options.epochs, input.known_steps(), callbacks.verbosity()});

  stop_training = false;
  epoch_index_ = options.initial_epoch;
  step_in_epoch_ = 0;
  // However fit() ends, the model no longer points at this fit's input, and tracing (a Profiler
  // turns it on in on_train_begin) is over.
  struct EndOfFit {
    Model& model;
    ~EndOfFit() {
      model.input_ = nullptr;
      model.fit_input_ = nullptr;
      model.elastic_input_.reset();
      model.admission_.reset(); // a vote left at the fit's end, dropped by every member
      model.timer_->end_fit();
    }
  } end_of_fit{*this};
  input_ = &input;

  callbacks.on_train_begin(); // BackupAndRestore may set resume_ here
  timer_->begin_fit(replicas_->device(0).is_cuda());
  replicas_->copy_first_to_others();
  if (joining) {
    // The group admitted this worker at a step boundary: the state comes from a live peer's
    // memory (weights, optimizer state, generator, updates, epoch, step, input position), and
    // the fit resumes there as from a backup. A member leaving meanwhile: regroup and ask again.
    detail::FitPosition joiner;
    joiner.holds_state = false;
    for (;;) {
      try {
        TrainingState state;
        if (reconcile(joiner, state).nothing_to_join) {
          throw NothingToJoin(
              "no member of the elastic group holds a training state (the others finished "
              "training or are gone, and this worker restarted too late to rejoin them)");
        }
        restore_training_state(state);
        break;
      } catch (const NothingToJoin&) {
        throw;
      } catch (const CommError&) {
        strategy_.elastic()->regroup();
        adopt_group();
      }
    }
    strategy_.finish_joining();
    joined_this_epoch_ = true; // its end is due even if the group was at the last step
    buffers_dirty_ = true;     // as the members count theirs (on_generation)
    replicas_->copy_first_to_others();
  }
  // Elastic keeping the per-replica batch: the learning rate follows each update's rows.
  lr_global_rows_ = train.slice_rows() > 0 ? train.global_rows() : 0;
  // Restored from a checkpoint that did not count them: whole global batches (0 unknown).
  if (trained_rows_ < 0) trained_rows_ = iterations_ * train.global_rows();
  int first_epoch = options.initial_epoch; // 0-based
  std::int64_t resume_step = 0;
  if (resume_) {
    first_epoch = std::max(first_epoch, resume_->epoch);
    resume_step = resume_->step_in_epoch;
    if (resume_->iterator) input.resume_at(*resume_->iterator);
    resume_.reset();
  }
  // Preemption: SIGTERM becomes a request while this fit runs, and the workers vote on requests
  // at step boundaries (fit's own collective, the same on every worker).
  std::optional<detail::SigtermLatch> latch;
  std::optional<detail::PreemptionVote> vote;
  if (needs.preemption_check) {
    latch.emplace();
    vote.emplace(elastic ? nullptr : &strategy_.communicator(), *needs.preemption_check,
                 preemption_requested_);
  }
  // A captured step is warmed up, captured and replayed on one side stream.
  std::optional<detail::SideStream::Use> side_stream;
  if (captured_) side_stream.emplace(captured_->stream());

  History history;
  for (int epoch = first_epoch; epoch < options.epochs && !stop_training; ++epoch) {
    const bool first = epoch == first_epoch;
    std::optional<EpochLogs> logs = run_epoch(epoch, first, first ? resume_step : 0, input,
                                              callbacks, options, vote ? &*vote : nullptr);
    if (!logs) {
      // Resumed from a backup taken at the very end of an epoch (the last step of a pass whose
      // length was not known in advance): that epoch is over, the next ones are still to do.
      if (first && resume_step > 0 && !input.ran_out()) continue;
      break; // the data ran out at an epoch's start: nothing to report
    }
    end_epoch(epoch, *logs, input, options, validation, callbacks);
    history.epochs.push_back(*logs);
    if (input.ran_out()) break;
  }
  if (auto* group = strategy_.elastic()) {
    // Workers restarted once every member has left then find nothing to do, instead of
    // starting the training afresh.
    try {
      group->training_finished();
    } catch (const std::exception& e) {
      strategy_.log().warn(std::string("elastic: could not tell the rendezvous that training "
                                       "finished (") +
                           e.what() + ")");
    }
  }
  if (input.ran_out() && strategy_.is_chief()) {
    strategy_.log().warn("your input ran out of data; interrupting training. Make sure the dataset "
                         "can give at least steps_per_epoch x epochs batches (use repeat())");
  }
  if (vote && vote->finish()) {
    // A request this late finds the work done: nothing is left to resume, so the fit ends as
    // usual (and the process goes on to what follows it).
    if (strategy_.is_chief()) {
      strategy_.log().info("preemption was requested at the last step; training had finished, so "
                           "it ends normally");
    }
    detail::clear_preemption_request();
  }
  preemption_requested_ = false;
  mirror_buffers(); // a fit that stopped inside an epoch
  callbacks.on_train_end();
  return history;
}

std::optional<EpochLogs> Model::run_epoch(int epoch, bool first, std::int64_t first_step,
                                          detail::EpochIterator& input, CallbackList& callbacks,
                                          const FitOptions& options, detail::PreemptionVote* vote) {
  input.begin_epoch(first);
  epoch_index_ = epoch;
  step_in_epoch_ = first_step;
  replicas_->set_training(true);
  callbacks.on_epoch_begin(epoch);
  epoch_sums_ =
      torch::zeros({static_cast<std::int64_t>(metrics_.size()) + 2},
                   torch::TensorOptions().dtype(torch::kFloat64).device(replicas_->device(0)));
  const torch::Tensor& epoch_sums = epoch_sums_;
  end_stage_ = detail::EpochStage::kSteps;
  *end_ = detail::EpochEndRecord{};
  timer_->epoch = PhaseTimes{};
  std::int64_t steps = 0;
  std::int64_t skipped = 0;
  int micro = 0; // batches accumulated since the last optimizer step
  const std::int64_t every = options_->steps_per_execution;
  const int accumulation = options_->gradient_accumulation_steps;
  const auto comm_before = reducer_->stats();
  const auto start = base::Clock::now();
  collective::ElasticGroup* const group = strategy_.elastic();
  if (group) {
    committed_ = committed_state();
    pulled_since_commit_ = false;
  }
  // One step; false where the epoch ends.
  const auto step = [&]() -> bool {
    timer_->start_step(epoch, step_in_epoch_);
    std::optional<data::ReplicaBatch> batch = input.next();
    if (!batch) {
      timer_->cancel_step(); // no step: the pass's end is not a step's input wait
      return false;
    }
    pulled_since_commit_ = true;
    timer_->mark(Phase::kInput);
    if (sync_batchnorm_layers_ > 0 && input.shapeless_empty_batch_anywhere()) {
      // Known to every worker at the same step (the input's vote), so all stop together.
      throw DataError("a worker's input had no batch in this fit while other workers' had, and "
                      "the model's SyncBatchNorm layers need a batch of the right shape on "
                      "every replica at every step; give every worker at least one batch");
    }
    if (step_in_epoch_ % every == 0) {
      callbacks.on_train_batch_begin(step_in_epoch_);
      timer_->mark(Phase::kCallbacks);
    }
    const std::int64_t iterations_before = iterations_;
    epoch_sums.add_(train_step(*batch, micro));
    if (micro == 0) {
      if (iterations_ == iterations_before) ++skipped;
      // This step's all-reduces (none while accumulating), for its trace.
      if (timer_->tracing_step()) timer_->record_all_reduces(reducer_->last_all_reduces());
    }
    ++steps;
    ++step_in_epoch_;
    if (group) {
      committed_ = committed_state();
      pulled_since_commit_ = false;
    }
    // Batch callbacks every steps_per_execution steps and at the end of a fixed-length epoch.
    bool batch_ended = false;
    if (step_in_epoch_ % every == 0 ||
        (options.steps_per_epoch && step_in_epoch_ == *options.steps_per_epoch)) {
      // Every worker calls them at the same steps (their saves are collectives), even one whose
      // own rows so far are none (uneven input): its running means are then zeros.
      const std::vector<double> totals = to_host(epoch_sums);
      Logs running;
      set_means(running, metrics_, totals.data(), std::max(1.0, totals.back()));
      callbacks.on_train_batch_end(step_in_epoch_ - 1, running);
      batch_ended = true;
    }
    // Stop for preemption only where a resume continues exactly: after an optimizer update (not
    // inside an accumulation group), and not at an epoch's last step (a backup there would resume
    // into an exhausted pass, which ends the fit); the epoch's end is a backup of its own.
    const bool epoch_last = input.known_steps() > 0 && step_in_epoch_ >= input.known_steps();
    if (vote && vote->at_step_boundary() && step_in_epoch_ % accumulation == 0 && !epoch_last) {
      preempt(callbacks);
    }
    // Restarted workers wait to be admitted: every kAdmitEvery updates the members start a vote
    // on whether the rendezvous reported any, read it at the next step boundary (it overlapped
    // that step; across an epoch's end, the next epoch's first), and if so all take them in
    // there. Counted in updates, not steps of the epoch, so short epochs admit too. After a new
    // generation none is in flight (a joiner has none either).
    if (group && admission_) {
      const bool admit = admission_->wait().any;
      admission_.reset();
      if (admit && group->admit()) on_generation(&input);
    } else if (group && iterations_ % kAdmitEvery == 0) {
      admission_ = std::make_unique<collective::PendingAgreement>(strategy_.communicator(),
                                                                  group->waiting() > 0);
    }
    timer_->end_step();
    return !(batch_ended && stop_training);
  };
  while (input.wants_step(step_in_epoch_)) {
    if (!group) {
      if (!step()) break;
      continue;
    }
    try {
      if (!step()) break;
    } catch (const std::exception& e) {
      if (!healable(e)) throw;
      timer_->cancel_step();
      admission_.reset(); // on the group that failed: never read
      heal(e, &input);
    }
  }
  // The steps' all-reduce time, without the partial accumulation's below (in no step).
  const double comm_in_steps = reducer_->stats().comm_seconds - comm_before.comm_seconds;
  if (micro > 0) apply_gradients(); // the epoch's last, partial accumulation
  // A worker that joined at the epoch's last step boundary has no step of its own in it, but
  // the others go on to its end, and so must it.
  const bool joined = std::exchange(joined_this_epoch_, false);
  if (steps == 0 && !joined) return std::nullopt;
  EpochLogs logs;
  logs.epoch = epoch + 1;
  logs.steps = steps;
  logs.seconds = base::seconds_since(start);
  logs.skipped_steps = skipped;
  logs.phases = timer_->epoch;
  logs.phases.comm_seconds = comm_in_steps;
  return logs;
}

void Model::end_epoch(int epoch, EpochLogs& logs, detail::EpochIterator& input,
                      const FitOptions& options,
                      const std::optional<data::DistributedDataset>& validation,
                      CallbackList& callbacks) {
  using detail::EpochStage;
  // Runs the collective of the stage `done` unless the group has passed it. Elastic: a failure
  // heals, which may bring this stage's result from a member that completed it; otherwise the
  // collective runs again in the new group.
  const auto stage = [&](EpochStage done, const std::function<void()>& collective) {
    while (end_stage_ < done) {
      try {
        collective();
        end_stage_ = done;
      } catch (const std::exception& e) {
        if (!strategy_.elastic() || !healable(e)) throw;
        heal(e, &input);
      }
    }
  };
  stage(EpochStage::kGathered, [&] { gather_epoch(logs.phases); });
  const double count = end_->sums.back();
  set_means(logs.values, metrics_, end_->sums.data(), count);
  logs.values.set("learning_rate", learning_rate()); // the next update's (Keras's)
  logs.samples_per_s = logs.seconds > 0 ? count / logs.seconds : 0;
  logs.worker_phases = end_->phases;
  step_in_epoch_ = 0; // at the boundary: a backup taken now resumes at the next epoch
  epoch_index_ = epoch + 1;
  stage(EpochStage::kMirrored, [&] { mirror_buffers(); }); // validation and callbacks read them
  stage(EpochStage::kValidated, [&] {
    end_->validation.clear();
    if (!validation || (epoch + 1) % options.validation_freq != 0) return;
    // Elastic: split among the workers there are now (fit split it among those at its start).
    const EvalResult val = evaluate_impl(
        strategy_.elastic() ? validation->redistribute(evaluation_context()) : *validation);
    replicas_->set_training(true);
    end_->validation = val.values.items();
  });
  for (const auto& [key, value] : end_->validation) logs.values.set("val_" + key, value);
  if (end_stage_ < EpochStage::kEnded) {
    callbacks.on_epoch_end(epoch, logs);
    end_stage_ = EpochStage::kEnded;
  }
  // A stop decided by one worker alone (a user's callback) must stop them all.
  stage(EpochStage::kAgreed, [&] {
    stop_training = collective::any_true(strategy_.communicator(), stop_training);
    end_->stop = stop_training; // for a member that missed the vote while this one left fit
  });
}

void Model::preempt(CallbackList& callbacks) {
  // The backup holds them. Elastic: this worker leaves alone, and a mirror is a collective.
  if (!strategy_.elastic()) mirror_buffers();
  const std::string where = callbacks.on_preemption();
  const TrainingState state = training_state();
  preemption_requested_ = false;
  detail::clear_preemption_request(); // acted on; a new fit in this process starts clean
  if (strategy_.elastic()) {
    // Elastic: this worker alone leaves; the others heal and go on without it.
    throw Preempted("training preempted (this worker received SIGTERM or request_preemption()): "
                    "it left the elastic group at update " +
                        std::to_string(state.iterations) + " (epoch " +
                        std::to_string(state.epoch + 1) + ", step " +
                        std::to_string(state.step_in_epoch) + ")" +
                        (where.empty() ? std::string("; the chief keeps the backup")
                                       : "; it saved the backup in " + where) +
                        ". Start it again to rejoin; start the whole job again to resume from "
                        "the backup",
                    state.iterations);
  }
  throw Preempted("training preempted (a worker received SIGTERM or request_preemption()): "
                  "every worker saved the backup at update " +
                      std::to_string(state.iterations) + " (epoch " +
                      std::to_string(state.epoch + 1) + ", step " +
                      std::to_string(state.step_in_epoch) + ")" +
                      (where.empty() ? std::string() : " in " + where) +
                      "; start the same job again to resume from there",
                  state.iterations);
}

void Model::check_elastic(const data::DistributedDataset& train, const FitOptions& options) const {
  const auto refuse = [](const std::string& what) {
    throw ConfigError("elastic mode (CommunicationOptions::elastic) cannot heal a fit with " +
                      what + " yet; leave it out, or train without elastic mode");
  };
  if (captured_) refuse("jit_compile's captured steps");
  if (options_->gradient_accumulation_steps > 1) refuse("gradient_accumulation_steps > 1");
  if (sync_batchnorm_layers_ > 0) refuse("SyncBatchNorm layers");
  if (!train.input_context().uneven_split && train.sharding() != "one replica") {
    throw ConfigError("elastic mode splits every global batch anew among the workers it has: "
                      "distribute the dataset with the strategy's input_context() (DATA "
                      "sharding; saw " +
                      train.sharding() + ")");
  }
  const bool per_replica = strategy_.input_context().full_replicas > 0;
  if (per_replica != (train.slice_rows() > 0)) {
    throw ConfigError(std::string("elastic mode: the training dataset was distributed for ") +
                      (per_replica ? "a constant global batch" : "a constant per-replica batch") +
                      ", but the strategy's CommunicationOptions::elastic_batch keeps the " +
                      (per_replica ? "per-replica batch" : "global batch") +
                      "; distribute it with this strategy's input_context()");
  }
  if (per_replica && options.steps_per_epoch) {
    throw ConfigError("elastic mode keeping the per-replica batch: an epoch is a pass over the "
                      "data, whose steps change with the members, so steps_per_epoch (saw " +
                      std::to_string(*options.steps_per_epoch) +
                      ") cannot be kept; leave it unset, or keep the global batch");
  }
}

TrainingState Model::committed_state() const {
  // Every step: no input position here (saving one walks the pipeline's graph); it is derived
  // when needed (committed_position).
  TrainingState state;
  state.iterations = iterations_;
  state.trained_rows = trained_rows_;
  state.epoch = epoch_index_;
  state.step_in_epoch = step_in_epoch_;
  if (loss_scale_) {
    state.loss_scale = loss_scale_->scale();
    state.loss_scale_good_steps = loss_scale_->good_steps();
  }
  return state;
}

std::optional<data::IteratorState>
Model::committed_position(const detail::EpochIterator& input) const {
  // Each step pulls one global batch (DATA sharding: no per-step vote): one pulled since the
  // commit is the failed step's, to be pulled again.
  return input.raw_position(pulled_since_commit_);
}

detail::FitPosition Model::position() const {
  detail::FitPosition p;
  p.epoch = committed_.epoch;
  p.stage = end_stage_;
  p.step = committed_.step_in_epoch;
  return p;
}

detail::HealPlan Model::reconcile(const detail::FitPosition& mine, TrainingState& state) {
  collective::Communicator& comm = strategy_.communicator();
  torch::Tensor encoded = torch::empty({detail::FitPosition::kFields}, torch::kLong);
  mine.encode(encoded.data_ptr<std::int64_t>());
  std::vector<detail::FitPosition> members;
  if (comm.size() == 1) {
    members.push_back(mine);
  } else {
    collective::Work work = comm.all_gather(encoded);
    work.wait();
    for (const auto& t : work.result()) {
      const torch::Tensor host = t.to(torch::kCPU).contiguous();
      members.push_back(detail::FitPosition::decode(host.data_ptr<std::int64_t>()));
    }
  }
  const detail::HealPlan plan = detail::plan_heal(members);
  if (plan.nothing_to_join) return plan;
  // When every member stands at the same place, nothing is sent: they hold the same weights,
  // optimizer state and input position already (the same all-reduced gradients), and each
  // keeps its own generator, as in a run without the fault.
  if (plan.send_state) state = share_training_state(*this, comm, plan.donor, state);
  if (plan.send_epoch_end) {
    const std::string record =
        collective::broadcast_string(comm, comm.rank() == plan.donor ? end_->encode() : "",
                                     plan.donor);
    // Members in the target's epoch take it (those at the target hold the same already).
    if (mine.holds_state && mine.epoch == plan.target.epoch && comm.rank() != plan.donor) {
      *end_ = detail::EpochEndRecord::decode(
          record, "the epoch's end from rank " + std::to_string(plan.donor));
    }
  }
  return plan;
}

void Model::adopt_group() {
  strategy_.adopt_generation();
  reducer_ = strategy_.make_gradient_reducer(replicas_->modules());
  // The replicas' contexts held the group they were made on: generation 0's stayed alive (its
  // backend's threads and sockets) for as long as the model.
  bind_replica_contexts(strategy_, *replicas_, replica_contexts_);
}

void Model::on_generation(detail::EpochIterator* input) {
  using detail::EpochStage;
  admission_.reset(); // a vote on the group before, never read
  update_rows_ = 0;    // a failed step's rows: it is redone (no accumulation in elastic mode)
  adopt_group();
  const detail::FitPosition mine = position();
  TrainingState state = committed_;
  if (input) state.iterator = committed_position(*input);
  const std::optional<data::IteratorState> own_position = state.iterator;
  const detail::HealPlan plan = reconcile(mine, state);
  const detail::FitPosition& target = plan.target;
  if (input && !state.iterator) {
    throw Error("elastic: the training state from rank " + std::to_string(plan.donor) +
                " has no input position");
  }
  if (plan.send_state) {
    iterations_ = state.iterations;
    trained_rows_ = state.trained_rows;
    if (loss_scale_ && state.loss_scale > 0) {
      loss_scale_->restore(state.loss_scale, state.loss_scale_good_steps);
    }
    replicas_->copy_first_to_others();
  }
  if (target.epoch == mine.epoch) {
    // The same epoch: its steps from the target's step on, or its end from the target's stage.
    if (target.stage == EpochStage::kSteps) step_in_epoch_ = state.step_in_epoch;
    // A member that missed the stop vote while the donor, past it, left the fit: its answer.
    if (target.stage == EpochStage::kAgreed && mine.stage < EpochStage::kAgreed) {
      stop_training = end_->stop;
    }
    end_stage_ = target.stage;
    committed_ = state;
  } else {
    // This worker waited in the stop vote; the others, past it, began the next epoch: the vote
    // said go on. The next epoch begins here as usual (its input position is this worker's own).
    stop_training = false;
    end_stage_ = EpochStage::kAgreed;
    state.iterator = own_position;
  }
  // Whether a mirror is due must be the same on every member (it is a collective): a joiner or
  // a member that took the state has not trained since, so all count as having trained.
  buffers_dirty_ = true;
  // The input split anew among the members, at the position the group goes on from.
  if (input) {
    elastic_input_ = std::make_unique<data::DistributedDataset>(
        fit_input_->redistribute(strategy_.input_context()));
    input->rebind(*elastic_input_, *state.iterator);
    pulled_since_commit_ = false;
  }
  if (strategy_.is_chief()) {
    const auto* group = strategy_.elastic();
    strategy_.log().info("elastic: generation " + std::to_string(group->generation()) + " with " +
                         std::to_string(strategy_.num_workers()) + " workers (" + group->reason() +
                         "); going on from " + target.describe() + " (update " +
                         std::to_string(iterations_) + ")");
  }
}

void Model::heal(const std::exception& failure, detail::EpochIterator* input) {
  const std::string what = failure.what();
  for (;;) {
    try {
      strategy_.elastic()->regroup();
    } catch (const TimeoutError& e) {
      throw CommError(what + " (" + e.what() + ")");
    }
    try {
      on_generation(input);
      return;
    } catch (const GroupChanged&) {
      // Another member left while this one healed: regroup again.
    } catch (const TimeoutError&) {
      throw;
    } catch (const CommError&) {
      // A backend noticed the departure first: the same.
    }
  }
}

void Model::check_consistency(const data::DistributedDataset& train, const FitOptions& options,
                              const CallbackList& callbacks) {
  const auto& comm = strategy_.communicator().options();
  std::vector<std::pair<std::string, std::string>> fields = {
      {"flotilla version", FLOTILLA_VERSION},
      {"LibTorch version", TORCH_VERSION},
      {"replicas per worker", std::to_string(strategy_.replicas_per_worker())},
      {"precision policy", to_string(policy_)},
      {"loss scaling",
       loss_scale_ ? (loss_scale_->options().dynamic ? "dynamic" : "fixed") : std::string("off")},
      {"optimizer", options_->optimizer.describe()},
      {"loss", options_->loss.custom ? std::string("custom") : to_string(options_->loss.kind)},
      {"per-replica batch", train.per_replica_batch() > 0
                                ? std::to_string(train.per_replica_batch())
                                : std::string("set by the input pipeline")},
      {"gradient accumulation steps", std::to_string(options_->gradient_accumulation_steps)},
      {"bytes_per_pack", std::to_string(comm.bytes_per_pack)},
      {"compression", std::string(collective::to_string(comm.compression))},
      {"overlap", comm.overlap ? "on" : "off"},
      {"bucket plan", reducer_->plan()},
      {"epochs", std::to_string(options.epochs)},
  };
  // The preemption vote is a collective of fit's: every worker votes, at the same interval, or
  // none does.
  const auto preemption = callbacks.needs().preemption_check;
  fields.emplace_back("preemption vote",
                      preemption ? "every " + std::to_string(preemption->count()) + " ms"
                                 : std::string("off"));
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
  // Each SyncBatchNorm layer is a collective of the forward and backward passes.
  fields.emplace_back("SyncBatchNorm layers", std::to_string(sync_batchnorm_layers_));
  strategy_.check_consistency(fields);
}

void Model::apply_gradients() {
  reducer_->finish();
  timer_->mark(Phase::kAllReduce);
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
    const double scale =
        lr_global_rows_ > 0 ? static_cast<double>(rows) / static_cast<double>(lr_global_rows_) : 1.0;
    if (options_->optimizer.global_clipnorm > 0) {
      replicas_->clip_gradients(options_->optimizer.global_clipnorm);
    }
    replicas_->step(options_->optimizer.learning_rate_at(schedule_step()) * scale);
    ++iterations_;
    trained_rows_ += rows;
  }
  timer_->mark(Phase::kOptimizer);
}

void Model::gather_epoch(const PhaseTimes& mine) {
  const std::vector<double> sums = to_host(epoch_sums_);
  const auto n = static_cast<std::int64_t>(sums.size());
  std::vector<double> flat(sums);
  flat.resize(sums.size() + detail::kPhaseTimesFields);
  detail::flatten(mine, flat.data() + n);
  auto& comm = strategy_.communicator();
  std::vector<torch::Tensor> all;
  if (comm.size() == 1) {
    all.push_back(torch::tensor(flat, torch::kFloat64));
  } else {
    collective::Work work = comm.all_gather(torch::tensor(flat, torch::kFloat64));
    work.wait();
    all = work.result();
  }
  detail::EpochEndRecord record;
  record.sums.assign(sums.size(), 0.0);
  for (const auto& t : all) {
    const torch::Tensor host = t.to(torch::kCPU).contiguous();
    const double* v = host.data_ptr<double>();
    for (std::int64_t i = 0; i < n; ++i) record.sums[i] += v[i];
    record.phases.push_back(detail::unflatten(v + n));
  }
  *end_ = std::move(record);
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

torch::Tensor Model::train_step(const data::ReplicaBatch& batch, int& micro) {
  const int num_replicas = replicas_->size();
  check_element(batch.element);
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
      if (captured_) detail::use_on_current_stream(parts[r].back());
    }
  }
  const double share =
      static_cast<double>(batch.global_batch_size) / strategy_.num_replicas_in_sync();
  const double scale = loss_scale_ ? loss_scale_->scale() : 1.0;
  buffers_dirty_ = true;
  update_rows_ += batch.global_batch_size;
  if (captured_ && parts[0][1].size(0) > 0 && captured_->warmed_up()) {
    // What an eager step does between the copy and the optimizer, for the graph to record.
    auto body = [&](const data::Element& e, const torch::Tensor& loss_factor) {
      reducer_->zero_grad();
      reducer_->prepare(true);
      torch::Tensor outputs;
      {
        AutocastGuard autocast(policy_, replicas_->device(0).type());
        outputs = replicas_->forward(0)(e[0]);
      }
      torch::Tensor per_example = per_example_loss(options_->loss, outputs, e[1]);
      if (e.size() > 2) per_example = per_example * e[2].to(per_example.dtype());
      (per_example.sum() * loss_factor).backward();
      torch::Tensor sums;
      {
        torch::NoGradGuard no_grad;
        sums = batch_sums(per_example.detach(), outputs.detach(), e[1]);
      }
      reducer_->finish();
      return sums;
    };
    const auto sums = captured_->replay(
        parts[0], scale / share, body, [&] { reducer_->abort_step(); }, *timer_,
        strategy_.is_chief() ? &strategy_.log() : nullptr);
    if (sums) {
      apply_update();
      return *sums;
    }
  }
  timer_->mark(Phase::kCopy);
  const int accumulation = options_->gradient_accumulation_steps;
  if (micro == 0) reducer_->zero_grad();
  const bool sync = micro + 1 == accumulation;
  reducer_->prepare(sync);
  std::vector<torch::Tensor> results(static_cast<std::size_t>(num_replicas));
  auto replica_body = [&](int r) {
    const data::Element& e = parts[r];
    const torch::Tensor& labels = e[1];
    // An empty slice (a short last batch over many replicas, a worker whose input ended) runs
    // no forward — a batch norm could not — but still joins the reduction, with no gradients of
    // its own. With SyncBatchNorm it does run: its layers are collectives every replica joins.
    if (labels.size(0) == 0 && sync_batchnorm_layers_ == 0) return;
    torch::Tensor outputs;
    {
      AutocastGuard autocast(policy_, e[0].device().type());
      outputs = replicas_->forward(r)(e[0]);
    }
    torch::Tensor per_example = per_example_loss(options_->loss, outputs, labels);
    if (e.size() > 2) per_example = per_example * e[2].to(per_example.dtype());
    // Replica 0 runs on this thread and times the phases; the others' extra time shows as
    // backward, where this thread waits for them.
    if (r == 0) timer_->mark(Phase::kForward);
    // Summed over this replica's slice and divided by the global batch's share per
    // replica: averaged over replicas by the reducer, that is the global batch's mean loss
    // exactly, short last batches included.
    (per_example.sum() * (scale / share)).backward();
    if (r == 0) timer_->mark(Phase::kBackward);
    torch::NoGradGuard no_grad;
    results[r] = batch_sums(per_example.detach(), outputs.detach(), labels);
    if (r == 0) timer_->mark(Phase::kMetrics);
  };
  auto replica_step = [&](int r) {
    try {
      replica_body(r);
    } catch (const std::exception& e) {
      // The other replicas may be waiting for this one inside a SyncBatchNorm layer.
      for (const auto& context : replica_contexts_) {
        context.abort("replica " + std::to_string(r) + " of this worker failed: " + e.what());
      }
      throw;
    }
  };
  try {
    replicas_->run(replica_step);
  } catch (...) {
    reducer_->abort_step(); // buckets already on the wire complete before anything else
    throw;
  }
  if (num_replicas > 1) timer_->mark(Phase::kBackward); // waiting for the other replicas
  if (sync) {
    apply_gradients();
    micro = 0;
  } else {
    ++micro;
  }
  // One replica: its sums as they are (no allocation per step); several: added on replica 0's
  // device (an empty slice has none).
  if (results.size() == 1 && results[0].defined()) return results[0];
  torch::Tensor total =
      torch::zeros({static_cast<std::int64_t>(metrics_.size()) + 2},
                   torch::TensorOptions().dtype(torch::kFloat64).device(replicas_->device(0)));
  for (const auto& r : results) {
    if (r.defined()) total.add_(r.to(replicas_->device(0), /*non_blocking=*/true));
  }
  return total;
}

EvalResult Model::evaluate(const data::Dataset& data) {
  return evaluate(data::distribute_dataset(data, evaluation_context()));
}

template <class Result>
Result Model::collective_pass(const data::DistributedDataset& data,
                             const std::function<Result(const data::DistributedDataset&)>& pass) {
  if (!strategy_.elastic() || input_) {
    mirror_buffers();
    return pass(data);
  }
  for (;;) {
    try {
      mirror_buffers();
      return pass(data.redistribute(evaluation_context()));
    } catch (const std::exception& e) {
      if (!healable(e)) throw;
      heal(e, nullptr);
    }
  }
}

EvalResult Model::evaluate(const data::DistributedDataset& data) {
  require_compiled("evaluate");
  return collective_pass<EvalResult>(
      data, [this](const data::DistributedDataset& d) { return evaluate_impl(d); });
}

void Model::mirror_buffers() {
  require_compiled("mirror_buffers");
  if (!buffers_dirty_) return;
  replicas_->mirror_buffers(strategy_.communicator());
  buffers_dirty_ = false; // not before: a mirror that failed is still due (elastic redoes it)
}

namespace {
// Evaluation mode for a while, then the mode the module had (a callback may evaluate mid-epoch).
struct EvalMode {
  explicit EvalMode(torch::nn::Module& m) : module(m), was_training(m.is_training()) { m.eval(); }
  ~EvalMode() { module.train(was_training); }
  torch::nn::Module& module;
  bool was_training;
};
} // namespace

EvalResult Model::evaluate_impl(const data::DistributedDataset& data) {
  torch::NoGradGuard no_grad;
  EvalMode eval_mode(module());
  const torch::Device device = replicas_->device(0); // the model itself is replica 0
  torch::Tensor sums = torch::zeros({static_cast<std::int64_t>(metrics_.size()) + 2},
                                    torch::TensorOptions().dtype(torch::kFloat64).device(device));
  auto pass = data.make_iterator();
  while (auto batch = pass.next()) {
    check_element(batch->element);
    data::Element e;
    for (const auto& t : batch->element) {
      e.push_back(on_device(t, device));
      if (captured_) detail::use_on_current_stream(e.back()); // on the side stream inside fit()
    }
    const torch::Tensor& labels = e[1];
    if (labels.size(0) == 0) continue; // this worker's share of a short last batch
    torch::Tensor outputs;
    {
      AutocastGuard autocast(policy_, device.type());
      outputs = forward_(e[0]);
    }
    torch::Tensor per_example = per_example_loss(options_->loss, outputs, labels);
    if (e.size() > 2) per_example = per_example * e[2].to(per_example.dtype());
    sums.add_(batch_sums(per_example, outputs, labels));
  }
  const torch::Tensor global = strategy_.reduce(strategy::ReduceOp::kSum, sums.to(torch::kCPU));
  const auto g = global.accessor<double, 1>();
  EvalResult result;
  const double count = g[global.size(0) - 1];
  result.samples = static_cast<std::int64_t>(count);
  const double denominator = count > 0 ? count : 1;
  result.values.set("loss", g[0] / denominator);
  for (std::size_t m = 0; m < metrics_.size(); ++m) {
    result.values.set(metrics_[m].name, g[static_cast<std::int64_t>(m) + 1] / denominator);
  }
  return result;
}

torch::Tensor Model::predict(const data::Dataset& data) {
  return predict(data::distribute_dataset(data, evaluation_context()));
}

torch::Tensor Model::predict(const data::DistributedDataset& data) {
  require_compiled("predict");
  return collective_pass<torch::Tensor>(
      data, [this](const data::DistributedDataset& d) { return predict_impl(d); });
}

torch::Tensor Model::predict_impl(const data::DistributedDataset& data) {
  torch::NoGradGuard no_grad;
  EvalMode eval_mode(module());
  const torch::Device device = replicas_->device(0);
  std::vector<torch::Tensor> outputs; // this worker's, float32 on the CPU
  std::vector<std::int64_t> rows;     // per batch
  auto pass = data.make_iterator();
  while (auto batch = pass.next()) {
    if (batch->element.empty()) throw DataError("predict: a batch has no components");
    const torch::Tensor features = on_device(batch->element[0], device);
    rows.push_back(features.dim() > 0 ? features.size(0) : 0);
    if (rows.back() == 0) continue; // this worker's share of a short last batch
    torch::Tensor y;
    {
      AutocastGuard autocast(policy_, device.type());
      y = forward_(features);
    }
    outputs.push_back(y.to(torch::kCPU, torch::kFloat32).contiguous());
  }
  const torch::Tensor mine = outputs.empty() ? torch::empty({0}) : torch::cat(outputs);
  auto& workers = strategy_.communicator();
  if (workers.size() == 1) return mine;
  // Every worker's outputs and rows per batch, then each batch's rows in worker order.
  const auto flat = collective::all_gather_uneven(workers, mine.reshape({-1}));
  const auto counts = collective::all_gather_uneven(workers, torch::tensor(rows, torch::kLong));
  // A row's shape, from a worker that has one (this one may have predicted nothing).
  const auto shapes = collective::all_gather_uneven(
      workers, outputs.empty() ? torch::empty({0}, torch::kLong)
                               : torch::tensor(mine.sizes().slice(1).vec(), torch::kLong));
  // Worker w's rows per batch (host integers), then each batch's rows in worker order.
  std::vector<std::vector<std::int64_t>> rows_of;
  std::vector<std::int64_t> full_shape;
  std::int64_t batches = 0;
  for (std::size_t w = 0; w < counts.size(); ++w) {
    const std::int64_t* r = counts[w].data_ptr<std::int64_t>();
    rows_of.emplace_back(r, r + counts[w].numel());
    batches = std::max(batches, counts[w].numel());
    if (full_shape.empty() && std::accumulate(rows_of[w].begin(), rows_of[w].end(), 0LL) > 0) {
      const std::int64_t* d = shapes[w].data_ptr<std::int64_t>();
      full_shape.assign({-1});
      full_shape.insert(full_shape.end(), d, d + shapes[w].numel());
    }
  }
  if (full_shape.empty()) return mine; // no worker predicted anything
  const std::int64_t row_numel = std::accumulate(full_shape.begin() + 1, full_shape.end(), 1LL,
                                                 std::multiplies<std::int64_t>());
  std::vector<torch::Tensor> ordered;
  std::vector<std::int64_t> cursor(flat.size(), 0);
  for (std::int64_t b = 0; b < batches; ++b) {
    for (std::size_t w = 0; w < flat.size(); ++w) {
      const auto& r = rows_of[w];
      if (b >= static_cast<std::int64_t>(r.size()) || r[b] == 0) continue;
      ordered.push_back(flat[w].narrow(0, cursor[w] * row_numel, r[b] * row_numel));
      cursor[w] += r[b];
    }
  }
  return torch::cat(ordered).view(full_shape);
}

torch::Tensor Model::predict(const torch::Tensor& features) {
  torch::NoGradGuard no_grad;
  EvalMode eval_mode(module());
  const torch::Device device = replicas_ ? replicas_->device(0) : features.device();
  AutocastGuard autocast(policy_, device.type());
  const torch::Tensor outputs = forward_(on_device(features, device));
  // On the caller's device, as given.
  return (policy_ == Policy::kFloat32 ? outputs : outputs.to(torch::kFloat32))
      .to(features.device());
}

} // namespace flotilla::train
