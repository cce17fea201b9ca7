// The minimal distributed input pipeline: in-memory examples, shuffled with a seed per epoch,
// sharded by worker and batched by replica. Global batch k is positions [k·G, (k+1)·G) of the
// epoch's order; worker w takes every n-th of them starting at w (tf.data's DATA sharding), so
// workers see disjoint slices whose union is the global batch, and n workers with batch G/n
// step exactly like one worker with batch G.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <functional>

#include "flotilla/strategy/input_context.h"

namespace flotilla::data {

struct Batch {
  torch::Tensor features;
  torch::Tensor labels;
};

struct ShardOptions {
  std::int64_t global_batch = 64; // split evenly across num_replicas_in_sync
  bool shuffle = true;            // a new order each epoch, the same on every worker
  std::uint64_t seed = 0;
  // Drop the last, partial global batch, so every worker runs the same number of steps (required
  // for training, where each step is a collective).
  bool drop_remainder = true;
};

class ShardedDataset {
public:
  // Applied to a batch's features as it is assembled, e.g. normalize_images.
  using Transform = std::function<torch::Tensor(const torch::Tensor&)>;

  ShardedDataset(torch::Tensor features, torch::Tensor labels, strategy::InputContext context,
                 ShardOptions options, Transform transform = nullptr);

  std::int64_t size() const { return labels_.size(0); } // examples in the whole dataset
  std::int64_t global_batch() const { return options_.global_batch; }
  std::int64_t per_replica_batch() const { return per_replica_batch_; }
  std::int64_t steps_per_epoch() const;
  const ShardOptions& options() const { return options_; }

  // Reshuffles for `epoch` (seed + epoch), identically on every worker.
  void set_epoch(std::int64_t epoch);
  // This worker's part of global batch `step` of the current epoch.
  Batch batch(std::int64_t step) const;

private:
  torch::Tensor features_;
  torch::Tensor labels_;
  strategy::InputContext context_;
  ShardOptions options_;
  Transform transform_;
  std::int64_t per_replica_batch_;
  torch::Tensor order_; // int64 positions of this epoch
};

} // namespace flotilla::data
