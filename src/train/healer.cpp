#include "train/healer.h"

#include "flotilla/collective/agreement.h"
#include "flotilla/collective/elastic.h"
#include "flotilla/error.h"
#include "train/epoch_iterator.h"
#include "train/fit_progress.h"
#include "train/replica_set.h"
#include "train/train_step.h"

namespace flotilla::train::detail {

namespace {
// Updates between two admission votes (one small all-reduce each, started at a step boundary and
// read at the next, so it overlaps a step). Few enough that a restarted worker waits little;
// rare enough that a fast step does not pay for it each time.
constexpr std::int64_t kAdmitEvery = 8;

// A joining worker whose group holds no training state (the others finished or are gone). Not a
// departure to regroup after: the fit ends with it (exit 3).
class NothingToJoin : public CommError {
 public:
  using CommError::CommError;
};

} // namespace

Healer::Healer(strategy::Strategy& strategy, TrainStep& step, FitProgress& progress,
               bool& stop_training, ShareState share)
    : strategy_(strategy), step_(step), progress_(progress), stop_training_(stop_training),
      share_(std::move(share)) {}

Healer::~Healer() = default;

bool Healer::healable(const std::exception& e) {
  return dynamic_cast<const CommError*>(&e) || !dynamic_cast<const Error*>(&e);
}

void Healer::begin_fit(const data::DistributedDataset& train) {
  fit_input_ = &train;
}

void Healer::end_fit() {
  fit_input_ = nullptr;
  elastic_input_.reset();
  admission_.reset(); // a vote left at the fit's end, dropped by every member
}

TrainingState Healer::join() {
  FitPosition joiner;
  joiner.holds_state = false;
  TrainingState state;
  for (;;) {
    try {
      if (reconcile(joiner, state).nothing_to_join) {
        throw NothingToJoin(
            "no member of the elastic group holds a training state (the others finished "
            "training or are gone, and this worker restarted too late to rejoin them)");
      }
      break;
    } catch (const NothingToJoin&) {
      throw;
    } catch (const CommError&) {
      // Nothing to reconcile yet: the group forms again and this worker asks again.
      strategy_.elastic()->regroup();
      step_.adopt_group();
    }
  }
  step_.restore_counters(state);
  strategy_.finish_joining();
  progress_.joined_this_epoch = true; // its end is due even if the group was at the last step
  step_.mark_trained();               // as the members count theirs (on_generation)
  step_.replicas().copy_first_to_others();
  return state;
}

void Healer::commit() {
  if (!elastic()) return;
  // Every step: no input position here (saving one walks the pipeline's graph); it is derived
  // when needed (committed_with_position).
  committed_ = progress_.state(&step_, /*with_position=*/false);
  pulled_since_commit_ = false;
  // Before the step's callbacks: a worker stopped long enough to be expelled may have completed
  // it against the old group's abandoned all-reduce. Committed first, so that a worker still a
  // member regroups from the step it made.
  strategy_.elastic()->confirm_membership();
}

void Healer::admit_at_step_boundary(EpochIterator& input) {
  collective::ElasticGroup* const group = strategy_.elastic();
  if (!group) return;
  // Counted in updates, not steps of the epoch, so short epochs admit too; across an epoch's
  // end, the vote is read at the next epoch's first boundary. After a new generation none is in
  // flight (a joiner has none either).
  if (admission_) {
    const bool admit = admission_->wait().any;
    admission_.reset();
    if (admit && group->admit()) on_generation(&input);
  } else if (step_.iterations() % kAdmitEvery == 0) {
    admission_ = std::make_unique<collective::PendingAgreement>(strategy_.communicator(),
                                                                group->waiting() > 0);
  }
}

void Healer::drop_admission() {
  admission_.reset(); // on the group that failed: never read
}

void Healer::heal(const std::exception& failure, EpochIterator* input) {
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

FitPosition Healer::position() const {
  FitPosition p;
  p.epoch = committed_.epoch;
  p.stage = progress_.end_stage;
  p.step = committed_.step_in_epoch;
  return p;
}

TrainingState Healer::committed_with_position(EpochIterator* input) const {
  TrainingState state = committed_;
  // Each step pulls one global batch (DATA sharding: no per-step vote): one pulled since the
  // commit is the failed step's, to be pulled again.
  if (input) state.iterator = input->raw_position(pulled_since_commit_);
  return state;
}

HealPlan Healer::reconcile(const FitPosition& mine, TrainingState& state) {
  collective::Communicator& comm = strategy_.communicator();
  torch::Tensor encoded = torch::empty({FitPosition::kFields}, torch::kLong);
  mine.encode(encoded.data_ptr<std::int64_t>());
  std::vector<FitPosition> members;
  if (comm.size() == 1) {
    members.push_back(mine);
  } else {
    collective::Work work = comm.all_gather(encoded);
    work.wait();
    for (const auto& t : work.result()) {
      const torch::Tensor host = t.to(torch::kCPU).contiguous();
      members.push_back(FitPosition::decode(host.data_ptr<std::int64_t>()));
    }
  }
  const HealPlan plan = plan_heal(members);
  if (plan.nothing_to_join) return plan;
  // When every member stands at the same place, nothing is sent: they hold the same weights,
  // optimizer state and input position already (the same all-reduced gradients), and each
  // keeps its own generator, as in a run without the fault.
  if (plan.send_state) state = share_(comm, plan.donor, state);
  if (plan.send_epoch_end) {
    const std::string record = collective::broadcast_string(
        comm, comm.rank() == plan.donor ? progress_.end.encode() : "", plan.donor);
    // Members in the target's epoch take it (those at the target hold the same already).
    if (mine.holds_state && mine.epoch == plan.target.epoch && comm.rank() != plan.donor) {
      progress_.end =
          EpochEndRecord::decode(record, "the epoch's end from rank " + std::to_string(plan.donor));
    }
  }
  return plan;
}

void Healer::on_generation(EpochIterator* input) {
  admission_.reset();          // a vote on the group before, never read
  step_.drop_partial_update(); // a failed step's rows: it is redone (no accumulation here)
  step_.adopt_group();
  const FitPosition mine = position();
  TrainingState state = committed_with_position(input);
  const std::optional<data::IteratorState> own_position = state.iterator;
  const HealPlan plan = reconcile(mine, state);
  if (input && !state.iterator) {
    throw Error("elastic: the training state from rank " + std::to_string(plan.donor) +
                " has no input position");
  }
  go_to(plan, mine, state, own_position);
  // Whether a mirror is due must be the same on every member (it is a collective): a joiner or
  // a member that took the state has not trained since, so all count as having trained.
  step_.mark_trained();
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
                         "); going on from " + plan.target.describe() + " (update " +
                         std::to_string(step_.iterations()) + ")");
  }
}

void Healer::go_to(const HealPlan& plan, const FitPosition& mine, TrainingState& state,
                   const std::optional<data::IteratorState>& own_position) {
  if (plan.send_state) {
    step_.restore_counters(state);
    step_.replicas().copy_first_to_others();
  }
  const Destination d = destination(plan, mine, progress_.end.stop);
  if (d.take_step) progress_.step = state.step_in_epoch;
  if (d.stop) stop_training_ = *d.stop;
  progress_.end_stage = d.stage;
  if (d.same_epoch) {
    committed_ = state;
  } else {
    state.iterator = own_position; // the next epoch begins here as usual
  }
}

} // namespace flotilla::train::detail
