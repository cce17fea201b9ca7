// Private: where the members of a new elastic generation go on. A collective can complete on some
// members and fail on others (a ring all-reduce hands its result to some before the dead peer's
// absence stops the rest), so after a change of membership the members may stand one collective
// apart. Each says where it stands in fit's sequence of collectives (FitPosition); all go on
// from the most advanced position, because what the members ahead did past it cannot be undone
// (an optimizer update can, but the callbacks at an epoch's end have written their logs and
// files). The members behind take that collective's result from the most advanced member (the
// donor) instead of computing it: the training state after a step, or the epoch end's results.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "flotilla/train/step_phases.h"

namespace flotilla::train::detail {

// The collectives of an epoch's end, in order; a position's stage is the last one completed.
enum class EpochStage : std::int64_t {
  kSteps = 0,     // in the epoch's steps (each a collective of its own)
  kGathered = 1,  // every worker's sums and phase times gathered (the epoch's logs)
  kMirrored = 2,  // the buffers (BatchNorm's statistics) mirrored
  kValidated = 3, // validation done (or not due this epoch)
  kEnded = 4,     // the callbacks' epoch end ran; the stop vote is next
  kAgreed = 5,    // the stop vote agreed: the next epoch (or the fit's end) follows
};

struct FitPosition {
  bool holds_state = true; // false: a worker joining mid-fit, which holds nothing yet
  std::int64_t epoch = 0;  // the epoch in progress, 0-based
  EpochStage stage = EpochStage::kSteps;
  std::int64_t step = 0; // steps of the epoch committed

  static constexpr int kFields = 4;
  void encode(std::int64_t* out) const;
  static FitPosition decode(const std::int64_t* in);
  std::string describe() const; // "epoch 2, step 7" / "epoch 2's end, validated"
};
// Fit order: epoch, then stage, then step.
bool operator<(const FitPosition& a, const FitPosition& b);
bool operator==(const FitPosition& a, const FitPosition& b);

struct HealPlan {
  bool nothing_to_join = false; // no member holds a state (the rest of the plan is empty)
  FitPosition target;           // where every member goes on
  int donor = 0;                // the lowest-ranked member at the target
  // The donor's training state (weights, buffers, optimizer state, generator, position) goes
  // to every other member: someone joins, is a step behind, or lacks the mirrored buffers.
  bool send_state = false;
  // The donor's EpochEndRecord goes to every other member: someone is behind within the end
  // of the target's epoch.
  bool send_epoch_end = false;
};

// The plan every member computes alike from everyone's positions, in rank order. Error (not a
// CommError: regrouping again would not help) when they stand further apart than one collective
// can explain, or a worker would join anywhere but at a step boundary.
HealPlan plan_heal(const std::vector<FitPosition>& members);

// Where one member goes under `plan` from `mine` — the healer applies it to the fit's progress.
struct Destination {
  // The target is in the steps of this member's epoch: the steps go on from the state's step.
  bool take_step = false;
  EpochStage stage = EpochStage::kSteps; // the epoch end's stage to go on from
  // Set: stop_training takes this value. A member that missed the stop vote while the donor,
  // past it, left the fit takes the vote's answer (from the donor's record); a member that
  // waited in the vote while the others began the next epoch learns the vote said go on.
  std::optional<bool> stop;
  // The state (the donor's, or this member's own) becomes the committed state (same epoch);
  // otherwise the next epoch begins here as usual, its input at this member's own position.
  bool same_epoch = true;
};
// `recorded_stop`: the stop vote's answer in the epoch-end record this member holds.
Destination destination(const HealPlan& plan, const FitPosition& mine, bool recorded_stop);

// PhaseTimes as kPhaseTimesFields doubles (the epoch's gather sends them), and back.
inline constexpr int kPhaseTimesFields = kPhaseCount + 3;
void flatten(const PhaseTimes& times, double* out);
PhaseTimes unflatten(const double* in);

// What an epoch's end has agreed so far, for a member that missed it.
struct EpochEndRecord {
  std::vector<double> sums; // the loss, each metric and the example count, over every worker
  std::vector<PhaseTimes> phases;                        // every worker's, in rank order
  std::vector<std::pair<std::string, double>> validation; // "loss" and each metric
  bool stop = false; // the stop vote's answer (stage kAgreed: the donor left the fit)

  std::string encode() const;
  // CommError naming `source` when the text is not a record.
  static EpochEndRecord decode(const std::string& text, const std::string& source);
};

} // namespace flotilla::train::detail
