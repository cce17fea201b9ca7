#include "train/epoch_iterator.h"

#include "flotilla/collective/agreement.h"
#include "flotilla/error.h"

namespace flotilla::train::detail {

EpochIterator::EpochIterator(const data::DistributedDataset& data,
                             std::optional<std::int64_t> steps_per_epoch,
                             collective::Communicator& workers)
    : data_(data), steps_per_epoch_(steps_per_epoch), workers_(workers) {
  const std::int64_t known = data.cardinality();
  // Equal on every worker: a known length, or endless (repeat()) everywhere.
  agreed_ =
      collective::same_value(workers, known) && (known >= 0 || known == data::kInfiniteCardinality);
  if (agreed_ && known == data::kInfiniteCardinality && !steps_per_epoch) {
    throw ConfigError("the training dataset is endless (repeat() without a count), so an epoch "
                      "would never end; set FitOptions::steps_per_epoch");
  }
  known_steps_ = steps_per_epoch.value_or(agreed_ && known >= 0 ? known : 0);
}

void EpochIterator::begin_epoch(bool first) {
  if (!pass_ || (!steps_per_epoch_ && !first)) pass_.emplace(data_.make_iterator());
}

std::optional<data::ReplicaBatch> EpochIterator::next() {
  std::optional<data::ReplicaBatch> batch = pass_->next();
  bool have = batch.has_value();
  if (!agreed_) have = collective::all_true(workers_, have);
  if (!have) {
    ran_out_ = steps_per_epoch_.has_value();
    return std::nullopt;
  }
  return batch;
}

std::optional<data::IteratorState> EpochIterator::position(std::int64_t step_in_epoch) const {
  if (!pass_) return std::nullopt;
  data::IteratorState position = pass_->save();
  // At an epoch's end without steps_per_epoch, the next epoch is the next pass, from its start.
  if (step_in_epoch == 0 && !steps_per_epoch_) {
    position.iteration += 1;
    position.produced = 0;
  }
  return position;
}

} // namespace flotilla::train::detail
