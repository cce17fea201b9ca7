// Private: Keras's fit loop over a compiled step — epochs, their steps and batch callbacks, each
// epoch's end (the global logs, mirrored buffers, validation, callbacks, the agreed stop),
// preemption, resuming from a backup or joining a running elastic group. One per fit() call;
// it takes what it uses (the strategy, the step, the healer, the progress), never the model.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>

#include "flotilla/data/distribute.h"
#include "flotilla/strategy/strategy.h"
#include "flotilla/train/callback.h"
#include "flotilla/train/model.h"
#include "train/share_balancer.h"

namespace flotilla::train::detail {

class EpochIterator;
class Healer;
class PreemptionVote;
class StepTimer;
class TrainStep;
struct FitProgress;

class FitLoop {
 public:
  FitLoop(strategy::Strategy& strategy, TrainStep& step, Healer& healer, FitProgress& progress,
          StepTimer& timer, CallbackList& callbacks, const FitOptions& options, bool& stop_training,
          std::atomic<bool>& preemption_requested);

  // Trains on `train` (distributed with the strategy). `bind` hands the callbacks the model and
  // the run's parameters before they begin; `resume` (set by restore_training_state, or by a
  // callback in on_train_begin) is where the first epoch starts, and is used up.
  History run(const data::DistributedDataset& train,
              const std::function<void(const TrainParams&)>& bind,
              std::optional<TrainingState>& resume);

 private:
  struct Epoch; // one epoch's counters (fit_loop.cpp)

  // ConfigError for what fit refuses: bad options; elastic mode with what it cannot heal yet.
  void check_options(const data::DistributedDataset& train) const;
  void check_elastic(const data::DistributedDataset& train) const;
  // Every worker's settings agree (the strategy's start-up check).
  void check_consistency(const data::DistributedDataset& train) const;
  History epochs(EpochIterator& input, int first_epoch, std::int64_t first_step,
                 const std::optional<data::DistributedDataset>& validation, PreemptionVote* vote);
  // An epoch's steps; nullopt when no step ran (the data ended first). The logs hold this
  // worker's figures (steps, seconds, phases) and the progress its loss and metric sums.
  std::optional<EpochLogs> run_epoch(int epoch, bool first, std::int64_t first_step,
                                     EpochIterator& input, PreemptionVote* vote);
  // One step; false where the epoch ends.
  bool step(EpochIterator& input, Epoch& e, PreemptionVote* vote);
  // After an epoch's steps, one collective after the other: the global logs, the mirrored
  // buffers, validation, then the callbacks' epoch end and the agreed stop. Elastic: a failure
  // heals and goes on from where the group stands.
  void end_epoch(int epoch, EpochLogs& logs, EpochIterator& input,
                 const std::optional<data::DistributedDataset>& validation);
  // Every worker's loss and metric sums (added up) and phase sums (in rank order), into the
  // progress's epoch-end record: one collective.
  void gather_epoch(const PhaseTimes& mine);
  // Every worker agreed to stop for preemption: the callbacks save, then Preempted.
  [[noreturn]] void preempt();
  // After the epochs: the rendezvous told, the warnings, a late preemption request, the buffers.
  void finish(const EpochIterator& input, PreemptionVote* vote);

  strategy::Strategy& strategy_;
  TrainStep& step_;
  Healer& healer_;
  std::unique_ptr<ShareBalancer> balancer_; // FitOptions::balance_/advise_shares_every
  FitProgress& progress_;
  StepTimer& timer_;
  CallbackList& callbacks_;
  const FitOptions& options_;
  bool& stop_training_;
  std::atomic<bool>& preemption_requested_;
};

// The input context of validation, evaluate() and predict(): the strategy's, but every global
// batch split among the workers there are (an elastic fit keeping the per-replica batch deals
// out only its training batches).
strategy::InputContext evaluation_context(const strategy::Strategy& strategy);

} // namespace flotilla::train::detail
