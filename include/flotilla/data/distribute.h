// Distributed datasets (tf.distribute's experimental_distribute_dataset and
// distribute_datasets_from_function). The user batches by the GLOBAL batch; each worker gets its
// part of every global batch and each replica its per-replica slice:
//
//   auto train = data::distribute_dataset(
//       ds.shuffle(10000, seed).batch(global_batch, true).map(preprocess, kAutotune)
//         .prefetch(kAutotune),
//       strategy.input_context());
//
// With the DATA policy the batch in the pipeline is rewritten to take only this worker's slice,
// so the stages after it (preprocessing) run on per-replica batches, not on everything. Every
// worker sees every global batch, so all run the same number of steps; a short last global
// batch is split as evenly as possible (a slice may be empty) and ReplicaBatch carries its
// global size, so a loss summed and divided by it is exactly the one-worker mean.
//
// (Free functions rather than Strategy members: the strategy layer sits below the data layer.)
#pragma once

#include <functional>

#include "flotilla/cluster/input_context.h"
#include "flotilla/data/dataset.h"

namespace flotilla::data {

struct ReplicaBatch {
  Element element;                    // this replica's slice of the global batch
  std::int64_t global_batch_size = 0; // elements in the whole global batch (all replicas)
};

class DistributedIterator {
 public:
  std::optional<ReplicaBatch> next();
  std::vector<StageStats> stats() const { return iterator_.stats(); }
  // The pass's position; `before_last`: as it stood before the last batch next() returned (one
  // must have been).
  IteratorState save(bool before_last = false) const;

 private:
  friend class DistributedDataset;
  DistributedIterator(Iterator iterator, std::shared_ptr<detail::BatchSizes> sizes,
                      std::int64_t workers, bool rows_mode, std::int64_t start)
      : iterator_(std::move(iterator)), sizes_(std::move(sizes)), workers_(workers),
        rows_mode_(rows_mode), rows_(start), rows_before_last_(start) {}
  Iterator iterator_;
  std::shared_ptr<detail::BatchSizes> sizes_; // null: sizes are this worker's batch × workers
  std::int64_t workers_;
  bool rows_mode_; // positions in rows (an elastic pass keeping the per-replica batch)
  std::int64_t rows_, rows_before_last_; // rows mode: delivered; before the last batch
};

class DistributedDataset {
 public:
  DistributedIterator make_iterator() const;
  // Resumes a pass saved by DistributedIterator::save() on this worker or any other.
  DistributedIterator make_iterator(const IteratorState& state) const;
  // Steps per pass on this worker (kUnknownCardinality when the source cannot say).
  std::int64_t cardinality() const { return per_worker_.cardinality(); }
  // Steps per pass with every worker of the cluster: cardinality(), except in an elastic group
  // keeping the per-replica batch, whose passes take more steps while members are missing (and
  // a pass resumed after a regroup, a number no membership's cardinality gives): there, the
  // user's global batches, the fewest steps any membership takes, the same on every worker.
  std::int64_t full_cluster_steps() const {
    return slice_rows_ > 0 ? original_.cardinality() : cardinality();
  }
  const cluster::InputContext& input_context() const { return context_; }
  // What was done, for logs: "<sharding>: rewrite or split, per-replica batch".
  const std::string& plan() const { return plan_; }
  // The sharding used: "DATA", "FILE", "OFF", "one replica" or "from a function" (the plan's
  // head; the same on every worker, unlike the rest of the plan).
  std::string sharding() const { return plan_.substr(0, plan_.find(':')); }
  // The per-replica batch the rewrite set (0 when the pipeline did not say).
  std::int64_t per_replica_batch() const { return per_replica_batch_; }
  // Whether every worker necessarily takes as many steps per pass as the others (every worker
  // sees every global batch: DATA, OFF, one replica); FILE shards may legitimately differ.
  bool same_steps_on_every_worker() const { return same_steps_; }
  // The pipeline this worker runs.
  const Dataset& per_worker() const { return per_worker_; }
  // The same dataset distributed anew for another membership (an elastic group after a worker
  // left or joined): distribute_dataset(the user's dataset, context). A pass saved from any
  // distribution of it resumes on this one (make_iterator(state)).
  DistributedDataset redistribute(const cluster::InputContext& context) const;
  // Elastic, keeping the per-replica batch (InputContext::full_replicas): the slice of every
  // replica (B = G / the full cluster's replicas), 0 otherwise. Each step's batch is then as many
  // rows as its ReplicaBatch::global_batch_size says.
  std::int64_t slice_rows() const { return slice_rows_; }
  // The user's global batch G where DATA sharding rewrote it (0 where nothing was rewritten).
  std::int64_t global_rows() const { return global_rows_; }

 private:
  friend DistributedDataset distribute_dataset(const Dataset&, const cluster::InputContext&);
  friend DistributedDataset
  distribute_datasets_from_function(const std::function<Dataset(const cluster::InputContext&)>&,
                                    const cluster::InputContext&);
  DistributedDataset(Dataset original, Dataset per_worker, cluster::InputContext context,
                     bool records_sizes, std::string plan, std::int64_t per_replica_batch,
                     bool same_steps)
      : original_(std::move(original)), per_worker_(std::move(per_worker)), context_(context),
        records_sizes_(records_sizes), plan_(std::move(plan)),
        per_replica_batch_(per_replica_batch), same_steps_(same_steps) {}
  // The user's dataset: passes are numbered on it (so redistributing it, as every fit() does,
  // still reshuffles), and iterator states carry its fingerprint (so any worker can resume
  // from the chief's saved state).
  Dataset original_;
  Dataset per_worker_;
  cluster::InputContext context_;
  bool records_sizes_;
  std::string plan_;
  std::int64_t per_replica_batch_;
  bool same_steps_;
  std::int64_t slice_rows_ = 0, global_rows_ = 0;
};

// `dataset` yields global batches (its batch size must split evenly across the replicas).
DistributedDataset distribute_dataset(const Dataset& dataset, const cluster::InputContext& context);

// `fn` builds this worker's pipeline itself, batched by the per-replica batch
// (context.get_per_replica_batch_size(global)) and sharded as it likes; nothing is rewritten.
DistributedDataset
distribute_datasets_from_function(const std::function<Dataset(const cluster::InputContext&)>& fn,
                                  const cluster::InputContext& context);

} // namespace flotilla::data
