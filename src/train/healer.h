// Private: live healing of an elastic fit (strategy.h). A collective that fails as a member's
// departure would is not the end: the healer waits for the group to form without that member,
// then every member reconciles where it stands (elastic_heal.h) and goes on from the most
// advanced position, taking the state it lacks from a live peer. It also admits restarted
// workers at step boundaries, and brings a joining worker the group's training state.
// It holds the last committed state (after each optimizer update), the admission vote in
// flight and the fit's input as redistributed; it drives the compiled step (adopt_group,
// counters) and the fit's progress, never the model.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>

#include "flotilla/collective/communicator.h"
#include "flotilla/data/distribute.h"
#include "flotilla/strategy/strategy.h"
#include "flotilla/train/training_state.h"
#include "train/elastic_heal.h"

namespace flotilla::collective {
class PendingAgreement;
} // namespace flotilla::collective

namespace flotilla::train::detail {

class EpochIterator;
class TrainStep;
struct FitProgress;

class Healer {
 public:
  // The donor's weights, buffers, optimizer state and generator to every member (the model's
  // share_training_state); returns the training state received (the donor's own on the donor).
  using ShareState = std::function<TrainingState(collective::Communicator& comm, int donor,
                                                 const TrainingState& mine)>;

  Healer(strategy::Strategy& strategy, TrainStep& step, FitProgress& progress, bool& stop_training,
         ShareState share);
  ~Healer();

  bool elastic() const { return strategy_.elastic() != nullptr; }

  // The one guard around fit's, evaluate()'s and predict()'s collectives: runs `attempt` and
  // returns true. Elastic, where it fails as a member's departure would (a CommError or a
  // backend's own exception): `before_heal`, then waits for the group to form without that
  // member and heals (every member where the plan puts it, `input` — fit's, or null outside fit —
  // split anew among them), and returns false: the caller goes on from where the group stands.
  // Anything else, or any failure outside elastic mode, is rethrown.
  // A template, so a step's call allocates nothing.
  template <class Attempt, class BeforeHeal = void (*)()>
  bool attempt(
      Attempt&& attempt, EpochIterator* input, BeforeHeal&& before_heal = [] {}) {
    if (!elastic()) {
      attempt();
      return true;
    }
    try {
      attempt();
      return true;
    } catch (const std::exception& e) {
      if (!healable(e)) throw;
      before_heal();
      heal(e, input);
      return false;
    }
  }

  // fit()'s input as given (every redistribution starts from it); end_fit drops what the fit
  // left (a vote in flight is dropped by every member alike).
  void begin_fit(const data::DistributedDataset& train);
  void end_fit();
  // A worker joining a running group: the training state from a live peer's memory, restored
  // into the step (its counters) and the model (weights, optimizer, generator: `share`); the
  // fit resumes from it as from a backup. A member leaving meanwhile: regroup and ask again.
  // CommError when no member holds a training state (nothing to join).
  TrainingState join();
  // After every optimizer update (and at an epoch's start): the state a heal goes back to.
  void commit();
  // A batch was pulled from the input since the last commit (a failed step pulls it again).
  void pulled() { pulled_since_commit_ = true; }
  // At every step boundary: restarted workers wait to be admitted. Every kAdmitEvery updates the
  // members start a vote on whether the rendezvous reported any and read it at the next
  // boundary (it overlapped that step); if so all take them in there.
  void admit_at_step_boundary(EpochIterator& input);
  void drop_admission();

 private:
  // Whether a failure may be a member's departure, to regroup after: a CommError or a backend's
  // own exception. Not flotilla's other errors: configuration, data and checkpoint errors are the
  // same on every worker or this worker's own bad input, a preemption means this worker leaves,
  // and members that cannot agree where to go on would not agree after a regroup.
  static bool healable(const std::exception& e);
  void heal(const std::exception& failure, EpochIterator* input);
  // After regroup() or admit(): the step adopts the group, the members reconcile, and this
  // worker goes where the plan puts it, fit's input (null outside fit) split anew among the
  // members at its position there.
  void on_generation(EpochIterator* input);
  // Every member's position, the plan, and what the plan sends (the donor's training state into
  // `state`, its epoch end's results into the progress).
  HealPlan reconcile(const FitPosition& mine, TrainingState& state);
  FitPosition position() const;
  // This worker's committed state: the step's counters where the last update left them, and the
  // input's exact position there.
  TrainingState committed_with_position(EpochIterator* input) const;
  void go_to(const HealPlan& plan, const FitPosition& mine, TrainingState& state,
             const std::optional<data::IteratorState>& own_position);

  strategy::Strategy& strategy_;
  TrainStep& step_;
  FitProgress& progress_;
  bool& stop_training_;
  ShareState share_;
  const data::DistributedDataset* fit_input_ = nullptr;
  std::unique_ptr<data::DistributedDataset> elastic_input_; // the current redistribution
  TrainingState committed_;
  bool pulled_since_commit_ = false;
  std::unique_ptr<collective::PendingAgreement> admission_; // the vote in flight
};

} // namespace flotilla::train::detail
