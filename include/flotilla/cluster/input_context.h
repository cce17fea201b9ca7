// What an input pipeline needs to know about distribution (tf.distribute.InputContext): how
// many pipelines there are, which one this is, and how a global batch splits across replicas.
// In cluster, below both the strategy that makes it and the data layer that reads it
// (strategy::InputContext names the same type).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace flotilla::cluster {

struct InputContext {
  int num_input_pipelines = 1; // one per worker
  int input_pipeline_id = 0;   // this worker's index among them
  int num_replicas_in_sync = 1;
  // Elastic mode: the replicas change with the membership while the global batch stays, so a
  // global batch need not divide evenly. distribute_dataset (DATA sharding) then gives replica
  // r of R the rows [r·G/R, (r+1)·G/R) of each global batch of G: shares differ by at most one
  // row, and since each replica's loss is summed and divided by G, the all-reduced gradient is
  // still the mean over the global batch.
  bool uneven_split = false;
  // Elastic mode keeping the per-replica batch instead (strategy::ElasticOptions::batch):
  // the full cluster's replica count N. A global batch of G becomes a stream of per-replica
  // slices of B = G/N rows, and with R replicas each step takes the next R slices, so the step's
  // batch is R·B rows (fewer only at a pass's end) and the learning rate follows it linearly.
  // 0: the global batch stays (uneven_split above).
  int full_replicas = 0;
  // Shares by speed (--shares): worker w's weight, one per worker; empty: equal shares. Worker w
  // keeps the rows [G·S(w)/S, G·S(w+1)/S) of each global batch of G, where S(w) is the weights'
  // sum before w and S their total: whole rows, every one kept by exactly one worker. Each
  // replica's loss is summed and divided by G/R, so the all-reduced gradient is the mean over
  // the global batch whatever the shares (as with uneven_split). DATA sharding only.
  std::vector<std::int64_t> shares;

  // "equal", or the weights as "2,1".
  std::string describe_shares() const;

  // A worker's part of each global batch of G: rows [G·first/parts, G·(first+count)/parts).
  // Equal shares count replicas, shares count weights.
  struct Part {
    std::int64_t first = 0;
    std::int64_t count = 1;
    std::int64_t parts = 1;
    std::int64_t rows(std::int64_t global) const {
      return global * (first + count) / parts - global * first / parts;
    }
  };
  // ConfigError for shares that are not one weight from 1 to 2^20 per worker (check_shares).
  Part part_of(int worker) const;

  // global_batch ÷ num_replicas_in_sync; ConfigError when it does not divide evenly.
  std::int64_t get_per_replica_batch_size(std::int64_t global_batch) const;
};

// The largest share weight (2^20).
inline constexpr std::int64_t kMaxShareWeight = std::int64_t{1} << 20;

// ConfigError unless `shares` is empty (equal) or one whole weight from 1 to 2^20 per worker.
void check_shares(const std::vector<std::int64_t>& shares, int workers);

} // namespace flotilla::cluster
