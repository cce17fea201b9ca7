#include "train/fit_loop.h"

#include <torch/version.h>

#include <algorithm>
#include <cstdio>
#include <utility>

#include "flotilla/collective/agreement.h"
#include "flotilla/collective/elastic.h"
#include "flotilla/error.h"
#include "train/captured_step.h"
#include "train/epoch_iterator.h"
#include "train/evaluation.h"
#include "train/fit_progress.h"
#include "train/healer.h"
#include "train/preemption.h"
#include "train/replica_set.h"
#include "train/step_timer.h"
#include "train/train_step.h"

namespace flotilla::train::detail {

TrainingState FitProgress::state(const TrainStep* step, bool with_position) const {
  TrainingState s = step ? step->counters() : TrainingState{};
  s.epoch = epoch;
  s.step_in_epoch = this->step;
  if (with_position && input) s.iterator = input->position(this->step);
  return s;
}

strategy::InputContext evaluation_context(const strategy::Strategy& strategy) {
  strategy::InputContext context = strategy.input_context();
  context.full_replicas = 0;
  return context;
}

struct FitLoop::Epoch {
  int index = 0;
  std::int64_t steps = 0;
  std::int64_t skipped = 0; // steps whose update was skipped (non-finite gradients)
  int micro = 0;            // batches accumulated since the last optimizer step
};

FitLoop::FitLoop(strategy::Strategy& strategy, TrainStep& step, Healer& healer,
                 FitProgress& progress, StepTimer& timer, CallbackList& callbacks,
                 const FitOptions& options, bool& stop_training,
                 std::atomic<bool>& preemption_requested)
    : strategy_(strategy), step_(step), healer_(healer), progress_(progress), timer_(timer),
      callbacks_(callbacks), options_(options), stop_training_(stop_training),
      preemption_requested_(preemption_requested) {}

History FitLoop::run(const data::DistributedDataset& train,
                     const std::function<void(const TrainParams&)>& bind,
                     std::optional<TrainingState>& resume) {
  check_options(train);
  // A worker joining a running elastic group makes none of the start-up agreements: its peers
  // are mid-fit. It gets their state below instead.
  const bool joining = strategy_.joining();
  if (!joining) check_consistency(train);
  EpochIterator input(train, options_.steps_per_epoch, strategy_.communicator(), !joining);
  // Every worker has just left the same collective: the timelines' common zero.
  timer_.set_origin(base::Clock::now());
  std::optional<data::DistributedDataset> validation;
  if (options_.validation_data) {
    validation.emplace(
        data::distribute_dataset(*options_.validation_data, evaluation_context(strategy_)));
  }
  const CallbackNeeds needs = callbacks_.needs();
  step_.set_check_finite(needs.finite_check);
  bind(TrainParams{options_.epochs, input.known_steps(), callbacks_.verbosity()});
  stop_training_ = false;
  progress_.epoch = options_.initial_epoch;
  progress_.step = 0;
  // However fit() ends, nothing points at this fit's input, and tracing (a Profiler turns it on
  // in on_train_begin) is over.
  struct EndOfFit {
    FitLoop& loop;
    ~EndOfFit() {
      loop.progress_.input = nullptr;
      loop.healer_.end_fit();
      if (loop.balancer_) loop.balancer_->end_fit();
      loop.timer_.end_fit();
    }
  } end_of_fit{*this};
  progress_.input = &input;
  healer_.begin_fit(train);
  if (options_.balance_shares_every > 0 || options_.advise_shares_every > 0) {
    const bool apply = options_.balance_shares_every > 0;
    balancer_ = std::make_unique<ShareBalancer>(
        strategy_, timer_, apply ? options_.balance_shares_every : options_.advise_shares_every,
        options_.straggler_floor, apply);
    balancer_->begin_fit(train);
  }
  callbacks_.on_train_begin(); // BackupAndRestore may set `resume` here
  // The fencing tokens' training: the backup's, or a fresh one for a training started afresh.
  if (healer_.elastic() && !joining) step_.agree_training(strategy_.communicator());
  timer_.begin_fit(step_.device().is_cuda());
  step_.replicas().copy_first_to_others();
  if (joining) resume = healer_.join();
  // Elastic keeping the per-replica batch: the learning rate follows each update's rows.
  step_.begin_fit(train.slice_rows() > 0 ? train.global_rows() : 0, train.global_rows());
  int first_epoch = options_.initial_epoch; // 0-based
  std::int64_t resume_step = 0;
  if (resume) {
    first_epoch = std::max(first_epoch, resume->epoch);
    resume_step = resume->step_in_epoch;
    if (resume->iterator) input.resume_at(*resume->iterator);
    resume.reset();
  }
  // Preemption: SIGTERM becomes a request while this fit runs, and the workers vote on requests
  // at step boundaries (fit's own collective, the same on every worker).
  std::optional<SigtermLatch> latch;
  std::optional<PreemptionVote> vote;
  if (needs.preemption_check) {
    latch.emplace();
    vote.emplace(healer_.elastic() ? nullptr : &strategy_.communicator(), *needs.preemption_check,
                 preemption_requested_);
  }
  // A captured step is warmed up, captured and replayed on one side stream.
  std::optional<SideStream::Use> side_stream;
  if (step_.captured()) side_stream.emplace(step_.captured()->stream());
  History history = epochs(input, first_epoch, resume_step, validation, vote ? &*vote : nullptr);
  finish(input, vote ? &*vote : nullptr);
  return history;
}

History FitLoop::epochs(EpochIterator& input, int first_epoch, std::int64_t first_step,
                        const std::optional<data::DistributedDataset>& validation,
                        PreemptionVote* vote) {
  History history;
  for (int epoch = first_epoch; epoch < options_.epochs && !stop_training_; ++epoch) {
    const bool first = epoch == first_epoch;
    std::optional<EpochLogs> logs = run_epoch(epoch, first, first ? first_step : 0, input, vote);
    if (!logs) {
      // Resumed from a backup taken at the very end of an epoch (the last step of a pass whose
      // length was not known in advance): that epoch is over, the next ones are still to do.
      if (first && first_step > 0 && !input.ran_out()) continue;
      break; // the data ran out at an epoch's start: nothing to report
    }
    end_epoch(epoch, *logs, input, validation);
    history.epochs.push_back(*logs);
    if (input.ran_out()) break;
  }
  return history;
}

void FitLoop::finish(const EpochIterator& input, PreemptionVote* vote) {
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
    clear_preemption_request();
  }
  preemption_requested_ = false;
  step_.mirror_buffers(); // a fit that stopped inside an epoch
  callbacks_.on_train_end();
}

std::optional<EpochLogs> FitLoop::run_epoch(int epoch, bool first, std::int64_t first_step,
                                            EpochIterator& input, PreemptionVote* vote) {
  input.begin_epoch(first);
  progress_.epoch = epoch;
  progress_.step = first_step;
  step_.replicas().set_training(true);
  callbacks_.on_epoch_begin(epoch);
  progress_.epoch_sums = step_.zero_sums();
  progress_.end_stage = EpochStage::kSteps;
  progress_.end = EpochEndRecord{};
  timer_.epoch = PhaseTimes{};
  Epoch e;
  e.index = epoch;
  const auto comm_before = step_.reducer().stats();
  const auto start = base::Clock::now();
  healer_.commit();
  const auto before_heal = [&] {
    timer_.cancel_step();
    healer_.drop_admission();
  };
  while (input.wants_step(progress_.step)) {
    bool go_on = true;
    if (healer_.attempt([&] { go_on = step(input, e, vote); }, &input, before_heal) && !go_on) {
      break;
    }
  }
  // The steps' all-reduce time, without the partial accumulation's below (in no step).
  const double comm_in_steps = step_.reducer().stats().comm_seconds - comm_before.comm_seconds;
  if (e.micro > 0) step_.apply_gradients(); // the epoch's last, partial accumulation
  // A worker that joined at the epoch's last step boundary has no step of its own in it, but
  // the others go on to its end, and so must it.
  const bool joined = std::exchange(progress_.joined_this_epoch, false);
  if (e.steps == 0 && !joined) return std::nullopt;
  EpochLogs logs;
  logs.epoch = epoch + 1;
  logs.steps = e.steps;
  logs.seconds = base::seconds_since(start);
  logs.skipped_steps = e.skipped;
  logs.phases = timer_.epoch;
  logs.phases.comm_seconds = comm_in_steps;
  return logs;
}

bool FitLoop::step(EpochIterator& input, Epoch& e, PreemptionVote* vote) {
  timer_.start_step(e.index, progress_.step);
  std::optional<data::ReplicaBatch> batch = input.next();
  if (!batch) {
    timer_.cancel_step(); // no step: the pass's end is not a step's input wait
    return false;
  }
  healer_.pulled();
  timer_.mark(Phase::kInput);
  if (step_.sync_batchnorm_layers() > 0 && input.shapeless_empty_batch_anywhere()) {
    // Known to every worker at the same step (the input's vote), so all stop together.
    throw DataError("a worker's input had no batch in this fit while other workers' had, and "
                    "the model's SyncBatchNorm layers need a batch of the right shape on "
                    "every replica at every step; give every worker at least one batch");
  }
  const std::int64_t every = step_.options().steps_per_execution;
  if (progress_.step % every == 0) {
    callbacks_.on_train_batch_begin(progress_.step);
    timer_.mark(Phase::kCallbacks);
  }
  const std::int64_t iterations_before = step_.iterations();
  progress_.epoch_sums.add_(step_.run(*batch, e.micro));
  if (e.micro == 0) {
    if (step_.iterations() == iterations_before) ++e.skipped;
    // This step's all-reduces (none while accumulating), for its trace.
    if (timer_.tracing_step()) timer_.record_all_reduces(step_.reducer().last_all_reduces());
  }
  ++e.steps;
  ++progress_.step;
  healer_.commit();
  // Batch callbacks every steps_per_execution steps and at the end of a fixed-length epoch.
  bool batch_ended = false;
  if (progress_.step % every == 0 ||
      (options_.steps_per_epoch && progress_.step == *options_.steps_per_epoch)) {
    // Every worker calls them at the same steps (their saves are collectives), even one whose
    // own rows so far are none (uneven input): its running means are then zeros.
    const std::vector<double> totals = to_host(progress_.epoch_sums);
    Logs running;
    step_.set_means(running, totals.data(), std::max(1.0, totals.back()));
    callbacks_.on_train_batch_end(progress_.step - 1, running);
    batch_ended = true;
  }
  // After the step's callbacks, so that a straggler leaving here has seen its last step out.
  if (balancer_) {
    const torch::Tensor& first = batch->element.front();
    balancer_->after_step(input, progress_.step, first.dim() > 0 ? first.size(0) : 0,
                          batch->global_batch_size);
  }
  // Stop for preemption only where a resume continues exactly: after an optimizer update (not
  // inside an accumulation group), and not at an epoch's last step (a backup there would resume
  // into an exhausted pass, which ends the fit); the epoch's end is a backup of its own.
  const bool epoch_last = input.known_steps() > 0 && progress_.step >= input.known_steps();
  if (vote && vote->at_step_boundary() &&
      progress_.step % step_.options().gradient_accumulation_steps == 0 && !epoch_last) {
    preempt();
  }
  healer_.admit_at_step_boundary(input);
  timer_.end_step();
  return !(batch_ended && stop_training_);
}

void FitLoop::end_epoch(int epoch, EpochLogs& logs, EpochIterator& input,
                        const std::optional<data::DistributedDataset>& validation) {
  // Runs the collective of the stage `done` unless the group has passed it. Elastic: a failure
  // heals, which may bring this stage's result from a member that completed it; otherwise the
  // collective runs again in the new group.
  const auto stage = [&](EpochStage done, const std::function<void()>& collective) {
    while (progress_.end_stage < done) {
      if (healer_.attempt(collective, &input)) progress_.end_stage = done;
    }
  };
  EpochEndRecord& end = progress_.end;
  stage(EpochStage::kGathered, [&] { gather_epoch(logs.phases); });
  const double count = end.sums.back();
  step_.set_means(logs.values, end.sums.data(), count);
  logs.values.set("learning_rate", step_.learning_rate()); // the next update's (Keras's)
  logs.samples_per_s = logs.seconds > 0 ? count / logs.seconds : 0;
  logs.worker_phases = end.phases;
  progress_.step = 0; // at the boundary: a backup taken now resumes at the next epoch
  progress_.epoch = epoch + 1;
  stage(EpochStage::kMirrored,
        [&] { step_.mirror_buffers(); }); // validation and callbacks read them
  stage(EpochStage::kValidated, [&] {
    progress_.end.validation.clear();
    if (!validation || (epoch + 1) % options_.validation_freq != 0) return;
    // Elastic: split among the workers there are now (fit split it among those at its start).
    const EvalResult val = evaluate_pass(
        step_,
        healer_.elastic() ? validation->redistribute(evaluation_context(strategy_)) : *validation);
    step_.replicas().set_training(true);
    progress_.end.validation = val.values.items();
  });
  for (const auto& [key, value] : progress_.end.validation) logs.values.set("val_" + key, value);
  if (progress_.end_stage < EpochStage::kEnded) {
    callbacks_.on_epoch_end(epoch, logs);
    progress_.end_stage = EpochStage::kEnded;
  }
  // A stop decided by one worker alone (a user's callback) must stop them all.
  stage(EpochStage::kAgreed, [&] {
    stop_training_ = collective::any_true(strategy_.communicator(), stop_training_);
    progress_.end.stop = stop_training_; // for a member that missed the vote while this one left
  });
}

void FitLoop::gather_epoch(const PhaseTimes& mine) {
  const std::vector<double> sums = to_host(progress_.epoch_sums);
  const auto n = static_cast<std::int64_t>(sums.size());
  std::vector<double> flat(sums);
  flat.resize(sums.size() + kPhaseTimesFields);
  flatten(mine, flat.data() + n);
  auto& comm = strategy_.communicator();
  std::vector<torch::Tensor> all;
  if (comm.size() == 1) {
    all.push_back(torch::tensor(flat, torch::kFloat64));
  } else {
    collective::Work work = comm.all_gather(torch::tensor(flat, torch::kFloat64));
    work.wait();
    all = work.result();
  }
  EpochEndRecord record;
  record.sums.assign(sums.size(), 0.0);
  for (const auto& t : all) {
    const torch::Tensor host = t.to(torch::kCPU).contiguous();
    const double* v = host.data_ptr<double>();
    for (std::int64_t i = 0; i < n; ++i) record.sums[i] += v[i];
    record.phases.push_back(unflatten(v + n));
  }
  progress_.end = std::move(record);
}

void FitLoop::preempt() {
  // The backup holds them. Elastic: this worker leaves alone, and a mirror is a collective.
  if (!healer_.elastic()) step_.mirror_buffers();
  const std::string where = callbacks_.on_preemption();
  const TrainingState state = progress_.state(&step_, /*with_position=*/true);
  preemption_requested_ = false;
  clear_preemption_request(); // acted on; a new fit in this process starts clean
  const std::string at = " at update " + std::to_string(state.iterations) + " (epoch " +
                         std::to_string(state.epoch + 1) + ", step " +
                         std::to_string(state.step_in_epoch) + ")";
  if (healer_.elastic()) {
    // Elastic: this worker alone leaves; the others heal and go on without it.
    throw Preempted("training preempted (this worker received SIGTERM or request_preemption()): "
                    "it left the elastic group" +
                        at +
                        (where.empty() ? std::string("; the chief keeps the backup")
                                       : "; it saved the backup in " + where) +
                        ". Start it again to rejoin; start the whole job again to resume from "
                        "the backup",
                    state.iterations);
  }
  throw Preempted("training preempted (a worker received SIGTERM or request_preemption()): "
                  "every worker saved the backup" +
                      at + (where.empty() ? std::string() : " in " + where) +
                      "; start the same job again to resume from there",
                  state.iterations);
}

void FitLoop::check_options(const data::DistributedDataset& train) const {
  const auto at_least = [](const char* what, std::int64_t value, std::int64_t least) {
    if (value < least) {
      throw ConfigError(std::string("FitOptions::") + what + " must be at least " +
                        std::to_string(least) + "; saw " + std::to_string(value));
    }
  };
  at_least("epochs", options_.epochs, 1);
  if (options_.initial_epoch < 0 || options_.initial_epoch >= options_.epochs) {
    throw ConfigError("FitOptions::initial_epoch must be in [0, epochs); saw " +
                      std::to_string(options_.initial_epoch) + " with epochs " +
                      std::to_string(options_.epochs));
  }
  if (options_.steps_per_epoch) at_least("steps_per_epoch", *options_.steps_per_epoch, 1);
  at_least("validation_freq", options_.validation_freq, 1);
  if (healer_.elastic()) check_elastic(train);
}

void FitLoop::check_elastic(const data::DistributedDataset& train) const {
  const auto refuse = [](const std::string& what) {
    throw ConfigError("elastic mode (ElasticOptions::enabled) cannot heal a fit with " + what +
                      " yet; leave it out, or train without elastic mode");
  };
  if (step_.captured()) refuse("jit_compile's captured steps");
  if (step_.options().gradient_accumulation_steps > 1) refuse("gradient_accumulation_steps > 1");
  if (step_.sync_batchnorm_layers() > 0) refuse("SyncBatchNorm layers");
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
                      ", but the strategy's ElasticOptions::batch keeps the " +
                      (per_replica ? "per-replica batch" : "global batch") +
                      "; distribute it with this strategy's input_context()");
  }
  if (per_replica && options_.steps_per_epoch) {
    throw ConfigError("elastic mode keeping the per-replica batch: an epoch is a pass over the "
                      "data, whose steps change with the members, so steps_per_epoch (saw " +
                      std::to_string(*options_.steps_per_epoch) +
                      ") cannot be kept; leave it unset, or keep the global batch");
  }
}

namespace {
// One field per parameter: name, shape, dtype and (when not contiguous) strides.
void add_parameters(torch::nn::Module& module,
                    std::vector<std::pair<std::string, std::string>>& fields) {
  std::int64_t index = 0;
  for (const auto& item : module.named_parameters()) {
    const auto& p = item.value();
    std::string shape;
    for (std::int64_t d = 0; d < p.dim(); ++d) shape += (d ? "x" : "") + std::to_string(p.size(d));
    fields.emplace_back("parameter " + std::to_string(index++),
                        item.key() + " [" + shape + "] " + c10::toString(p.scalar_type()) +
                            (p.is_contiguous() ? "" : c10::str(" strides ", p.strides())));
  }
  fields.emplace_back("parameter count", std::to_string(index));
}
} // namespace

void FitLoop::check_consistency(const data::DistributedDataset& train) const {
  const auto& comm = strategy_.communicator().options();
  const CompileOptions& compiled = step_.options();
  const auto& loss_scale = step_.loss_scale();
  std::vector<std::pair<std::string, std::string>> fields = {
      {"flotilla version", FLOTILLA_VERSION},
      {"LibTorch version", TORCH_VERSION},
      {"replicas per worker", std::to_string(strategy_.replicas_per_worker())},
      {"precision policy", to_string(step_.policy())},
      {"loss scaling",
       loss_scale ? (loss_scale->options().dynamic ? "dynamic" : "fixed") : std::string("off")},
      {"optimizer", compiled.optimizer.describe()},
      {"loss", compiled.loss.custom ? std::string("custom") : to_string(compiled.loss.kind)},
      {"per-replica batch", train.per_replica_batch() > 0
                                ? std::to_string(train.per_replica_batch())
                                : std::string("set by the input pipeline")},
      {"gradient accumulation steps", std::to_string(compiled.gradient_accumulation_steps)},
      {"bytes_per_pack", std::to_string(comm.bytes_per_pack)},
      {"compression", std::string(collective::to_string(comm.compression))},
      {"overlap", comm.overlap ? "on" : "off"},
      {"bucket plan", step_.reducer().plan()},
      {"epochs", std::to_string(options_.epochs)},
  };
  // The preemption vote is a collective of fit's: every worker votes, at the same interval, or
  // none does.
  const auto preemption = callbacks_.needs().preemption_check;
  fields.emplace_back("preemption vote",
                      preemption ? "every " + std::to_string(preemption->count()) + " ms"
                                 : std::string("off"));
  fields.emplace_back("input sharding", train.sharding());
  fields.emplace_back("shares", train.input_context().describe_shares());
  // The share balancer's reports are collectives every that many steps, on every worker or none.
  std::string balancing = "off";
  if (options_.balance_shares_every > 0) {
    char floor[32];
    std::snprintf(floor, sizeof floor, "%g", options_.straggler_floor);
    balancing = "measured every " + std::to_string(options_.balance_shares_every) +
                " steps, straggler floor " + floor;
  } else if (options_.advise_shares_every > 0) {
    balancing = "advised every " + std::to_string(options_.advise_shares_every) + " steps";
  }
  fields.emplace_back("shares by speed", balancing);
  if (options_.steps_per_epoch) {
    fields.emplace_back("steps per epoch", std::to_string(*options_.steps_per_epoch));
  } else if (train.same_steps_on_every_worker()) {
    const std::int64_t steps = train.cardinality();
    fields.emplace_back("steps per epoch after sharding",
                        steps >= 0 ? std::to_string(steps) : std::string("unknown"));
  }
  add_parameters(step_.replicas().module(0), fields);
  // Each SyncBatchNorm layer is a collective of the forward and backward passes.
  fields.emplace_back("SyncBatchNorm layers", std::to_string(step_.sync_batchnorm_layers()));
  strategy_.check_consistency(fields);
}

} // namespace flotilla::train::detail
