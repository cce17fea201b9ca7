#include "train/epoch_iterator.h"

#include "flotilla/collective/agreement.h"
#include "flotilla/error.h"

namespace flotilla::train::detail {

EpochIterator::EpochIterator(const data::DistributedDataset& data,
                             std::optional<std::int64_t> steps_per_epoch,
                             collective::Communicator& workers, bool agree)
    : data_(&data), steps_per_epoch_(steps_per_epoch), workers_(workers) {
  const std::int64_t known = data.full_cluster_steps();
  // Equal on every worker: a known length, or endless (repeat()) everywhere.
  agreed_ = (!agree || collective::same_value(workers, known)) &&
            (known >= 0 || known == data::kInfiniteCardinality);
  if (agreed_ && known == data::kInfiniteCardinality && !steps_per_epoch) {
    throw ConfigError("the training dataset is endless (repeat() without a count), so an epoch "
                      "would never end; set FitOptions::steps_per_epoch");
  }
  known_steps_ = steps_per_epoch.value_or(agreed_ && known >= 0 ? known : 0);
}

void EpochIterator::begin_epoch(bool first) {
  if (!pass_ || (!steps_per_epoch_ && !first)) pass_.emplace(data_->make_iterator());
}

std::optional<data::ReplicaBatch> EpochIterator::next() {
  std::optional<data::ReplicaBatch> batch = pass_->next();
  if (agreed_) {
    if (!batch) ran_out_ = steps_per_epoch_.has_value();
    return batch;
  }
  // Uneven input (tf.distribute's get-next-as-optional): the step runs while any worker has a
  // batch; one that has none takes part with an empty batch, and the step's global batch is the
  // rows every worker really has, so an empty batch weighs nothing in the means.
  const std::int64_t rows = batch ? batch->element.at(0).size(0) : 0;
  // Without a batch of its own yet, a worker's empty batch has no shape to copy.
  const bool shapeless = !batch && empty_.empty();
  torch::Tensor votes = torch::tensor(
      {std::int64_t{batch ? 1 : 0}, rows, std::int64_t{shapeless ? 1 : 0}}, torch::kLong);
  workers_.all_reduce(votes, collective::ReduceOp::kSum).wait();
  const std::int64_t* summed = votes.data_ptr<std::int64_t>();
  if (summed[0] == 0) { // no worker has a batch
    ran_out_ = steps_per_epoch_.has_value();
    return std::nullopt;
  }
  shapeless_anywhere_ = summed[2] > 0;
  if (batch) {
    remember_layout(batch->element);
  } else {
    batch.emplace();
    // No shape to copy yet: components of zero rows (a model without SyncBatchNorm runs no
    // forward on them).
    batch->element =
        shapeless ? data::Element{torch::empty({0}), torch::empty({0}, torch::kLong)} : empty_;
  }
  batch->global_batch_size = summed[1];
  return batch;
}

void EpochIterator::remember_layout(const data::Element& element) {
  // Rebuilt only when the layout changes (a batch's rows aside), not for every batch.
  bool same = empty_.size() == element.size();
  for (std::size_t i = 0; same && i < element.size(); ++i) {
    const torch::Tensor& e = empty_[i];
    const torch::Tensor& c = element[i];
    same = e.dim() == c.dim() && e.scalar_type() == c.scalar_type() && e.device() == c.device() &&
           (c.dim() == 0 || e.sizes().slice(1) == c.sizes().slice(1));
  }
  if (same) return;
  empty_.clear();
  for (const auto& component : element) {
    auto shape = component.sizes().vec();
    if (!shape.empty()) shape[0] = 0;
    empty_.push_back(torch::empty(shape, component.options())); // not a view: no storage kept
  }
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
