// Private: where a fit stands — the epoch and step in progress, the input, and how far the
// epoch's end has come. Model reads it for callbacks (current_epoch, training_state); the fit
// loop (fit_loop.h) moves it on; the healer (healer.h) moves it to where a new generation goes on.
#pragma once

#include <torch/types.h>

#include <cstdint>

#include "flotilla/train/training_state.h"
#include "train/elastic_heal.h"

namespace flotilla::train::detail {

class EpochIterator;
class TrainStep;

struct FitProgress {
  int epoch = 0;                        // the epoch in progress (0-based)
  std::int64_t step = 0;                // its steps done
  const EpochIterator* input = nullptr; // during fit: the training input
  // The epoch in progress: this worker's loss and metric sums, how far its end has come and
  // what it agreed so far (kept for a member that missed a collective of it), and whether this
  // worker joined at a step boundary of it (its end is then due even without a step here).
  torch::Tensor epoch_sums;
  EpochStage end_stage = EpochStage::kSteps;
  EpochEndRecord end;
  bool joined_this_epoch = false;

  // Where training stands: `step`'s counters and loss scale (none before compile), the epoch and
  // step, and with `with_position` the input's position (serialising the iterator: not for
  // every step).
  TrainingState state(const TrainStep* step, bool with_position) const;
};

} // namespace flotilla::train::detail
