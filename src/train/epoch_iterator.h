// Private: fit's passes over the training input (Keras 3's EpochIterator). Every step is a
// collective, so every worker must take the same number of steps: when each knows its pass
// length and they agree, that is enough; otherwise every step first asks all workers whether they
// still have a batch and how many rows (tf.distribute's get-next-as-optional for uneven input:
// every batch of every worker is trained on, and a worker whose input has ended joins the step
// with an empty batch). A new pass starts each epoch,
// unless steps_per_epoch makes one pass run across epochs (Keras's steps_per_epoch with
// repeat()), or a resume continues a saved one.
#pragma once

#include <cstdint>
#include <optional>

#include "flotilla/collective/communicator.h"
#include "flotilla/data/distribute.h"

namespace flotilla::train::detail {

class EpochIterator {
 public:
  // Agrees with the other workers on the pass length: a collective, as the first thing fit does.
  // ConfigError for an endless input without steps_per_epoch.
  // `agree` false: a worker joining a running elastic group, whose peers are mid-fit, trusts
  // its own pass length (DATA sharding: the same on every worker) instead of asking.
  EpochIterator(const data::DistributedDataset& data, std::optional<std::int64_t> steps_per_epoch,
                collective::Communicator& workers, bool agree = true);

  // Steps in every epoch, when known in advance (Keras's params["steps"]); 0 otherwise. An
  // elastic group keeping the per-replica batch takes more while members are missing: there it
  // is the full cluster's, a lower bound, so the epoch's real last step is always at or past it
  // (where fit and BackupAndRestore take no mid-epoch backup: a resume would find the pass over).
  std::int64_t known_steps() const { return known_steps_; }
  // The first epoch continues the pass saved at `position` (a backup's).
  void resume_at(const data::IteratorState& position) {
    pass_.emplace(data_->make_iterator(position));
  }
  // Elastic: the pass continues at `position` on `data` (the input distributed anew for the
  // group's new membership; it must outlive this iterator or the next rebind).
  void rebind(const data::DistributedDataset& data, const data::IteratorState& position) {
    data_ = &data;
    pass_.emplace(data.make_iterator(position));
  }
  // The pass's position exactly as it stands (no epoch-end adjustment), or before the last batch
  // next() returned; nullopt before the pass.
  std::optional<data::IteratorState> raw_position(bool before_last = false) const {
    if (!pass_) return std::nullopt;
    return pass_->save(before_last);
  }
  // Before each epoch: a new pass unless one continues (see above).
  void begin_epoch(bool first);
  // Whether step `step_in_epoch` (0-based) of this epoch is to run: with steps_per_epoch, up to
  // it; otherwise until the pass ends.
  bool wants_step(std::int64_t step_in_epoch) const {
    return !steps_per_epoch_ || step_in_epoch < *steps_per_epoch_;
  }
  // The next batch, or nullopt where the epoch ends for every worker. With uneven input, an
  // empty batch (zero rows) where only this worker's input has ended.
  std::optional<data::ReplicaBatch> next();
  // Whether, at the last step, some worker had no batch yet in this fit and took part with
  // components of no shape (the same on every worker): a model whose every replica must run its
  // forward cannot use that step.
  bool shapeless_empty_batch_anywhere() const { return shapeless_anywhere_; }
  // The input ended before steps_per_epoch x epochs steps (fit stops early, with a warning).
  bool ran_out() const { return ran_out_; }
  // The input's position, for a backup (see Model::training_state); nullopt before the first
  // pass.
  std::optional<data::IteratorState> position(std::int64_t step_in_epoch) const;

 private:
  const data::DistributedDataset* data_;
  std::optional<std::int64_t> steps_per_epoch_;
  collective::Communicator& workers_;
  bool agreed_ = false; // every worker knows the same pass length: no vote per step
  std::int64_t known_steps_ = 0;
  std::optional<data::DistributedIterator> pass_;
  bool ran_out_ = false;
  // Keeps empty_ shaped like `element` (zero rows).
  void remember_layout(const data::Element& element);
  data::Element empty_; // components with zero rows, shaped like the last batch's
  bool shapeless_anywhere_ = false;
};

} // namespace flotilla::train::detail
