#include "flotilla/data/distribute.h"

#include "data/stages.h"
#include "flotilla/error.h"
#include "flotilla/log.h"

namespace flotilla::data {
namespace detail {
namespace {

// Which replicas' share of a global batch of `b` elements this worker keeps: [begin, end).
std::pair<std::int64_t, std::int64_t> replica_range(std::int64_t b, std::int64_t replicas,
                                                    std::int64_t first, std::int64_t count) {
  return {first * b / replicas, (first + count) * b / replicas};
}

// Component-wise slice [begin, end) of parts, or an empty batch shaped like them.
Element stack_range(const std::vector<Element>& parts, std::int64_t begin, std::int64_t end,
                    std::int64_t batch_index) {
  if (end > begin) {
    return stack_batch(std::vector<Element>(parts.begin() + begin, parts.begin() + end),
                       batch_index);
  }
  Element empty;
  for (const auto& t : parts.front()) {
    std::vector<std::int64_t> shape{0};
    shape.insert(shape.end(), t.sizes().begin(), t.sizes().end());
    empty.push_back(torch::empty(shape, t.options()));
  }
  return empty;
}

// batch(G) rewritten for one worker: reads each global batch's G elements, stacks only this
// worker's replicas' slice, and records G (or the short last batch's size).
class RebatchShardStage : public UnaryStage {
 public:
  RebatchShardStage(std::unique_ptr<Stage> input, std::int64_t global, bool drop,
                    std::int64_t replicas, std::int64_t first, std::int64_t count,
                    std::shared_ptr<BatchSizes> sizes)
      : UnaryStage("RebatchShard", std::move(input)), global_(global), drop_(drop),
        replicas_(replicas), first_(first), count_(count), sizes_(std::move(sizes)) {
    // Rows of in-memory tensors below (slices, shuffled, repeated): gather this worker's rows
    // of each global batch with one index_select per component, making no tensor for the
    // other workers' elements or for its own. Decided before anything is read or skipped, and
    // shown in the stage's name (iterator stats).
    rows_ = input_->rows();
    if (rows_) name_ = "RebatchShard(gathered)";
  }
  std::int64_t skip(std::int64_t n) override {
    const std::int64_t moved = input_->skip(n * global_);
    index_ += moved / global_;
    return moved / global_ + (!drop_ && moved % global_ != 0 ? 1 : 0);
  }

 protected:
  std::optional<Element> produce() override {
    if (rows_) return produce_gathered();
    std::vector<Element> parts;
    parts.reserve(static_cast<std::size_t>(global_));
    while (static_cast<std::int64_t>(parts.size()) < global_) {
      auto e = input_->next();
      if (!e) break;
      parts.push_back(std::move(*e));
    }
    const auto b = static_cast<std::int64_t>(parts.size());
    if (b == 0 || (drop_ && b < global_)) return std::nullopt;
    const auto [begin, end] = replica_range(b, replicas_, first_, count_);
    Element out = stack_range(parts, begin, end, index_++);
    if (sizes_) sizes_->push(b);
    return out;
  }

 private:
  std::int64_t global_;
  bool drop_;
  std::int64_t replicas_, first_, count_;
  std::shared_ptr<BatchSizes> sizes_;
  std::int64_t index_ = 0;
  const Element* rows_ = nullptr;

  std::optional<Element> produce_gathered() {
    std::vector<std::int64_t> taken;
    taken.reserve(static_cast<std::size_t>(global_));
    while (static_cast<std::int64_t>(taken.size()) < global_) {
      auto r = input_->next_row();
      if (!r) break;
      taken.push_back(*r);
    }
    const auto b = static_cast<std::int64_t>(taken.size());
    if (b == 0 || (drop_ && b < global_)) return std::nullopt;
    const auto [begin, end] = replica_range(b, replicas_, first_, count_);
    const torch::Tensor index =
        torch::from_blob(taken.data() + begin, {end - begin}, torch::kInt64).clone();
    Element out;
    out.reserve(rows_->size());
    for (const auto& t : *rows_) out.push_back(t.index_select(0, index));
    ++index_;
    if (sizes_) sizes_->push(b);
    return out;
  }
};

class RebatchShardNode : public UnaryNode {
 public:
  RebatchShardNode(NodePtr input, std::int64_t global, bool drop, std::int64_t replicas,
                   std::int64_t first, std::int64_t count)
      : UnaryNode(std::move(input)), global_(global), drop_(drop), replicas_(replicas),
        first_(first), count_(count) {}
  std::unique_ptr<Stage> make_iterator(const IteratorContext& ctx) const override {
    return std::make_unique<RebatchShardStage>(input_->make_iterator(ctx), global_, drop_,
                                               replicas_, first_, count_, ctx.batch_sizes);
  }
  std::int64_t cardinality() const override {
    const std::int64_t c = input_->cardinality();
    if (c < 0) return c;
    return drop_ ? c / global_ : (c + global_ - 1) / global_;
  }
  std::string describe() const override {
    return "rebatch_shard(" + std::to_string(global_) + "," + std::to_string(drop_) + "," +
           std::to_string(replicas_) + "," + std::to_string(first_) + "," + std::to_string(count_) +
           ")";
  }

 private:
  std::int64_t global_;
  bool drop_;
  std::int64_t replicas_, first_, count_;
};

// batch(G) rewritten for an elastic group that keeps the per-replica batch: the global batches
// are a stream of per-replica slices of B = G/N rows (N the full cluster's replicas), and each
// step takes the next `replicas` slices (fewer rows only where the pass ends); this worker's
// replicas [first, first + count) keep theirs, which may be empty in a pass's last step. Rows
// come in whole global batches, so drop_remainder drops exactly what the full cluster would.
// A pass resumed mid-stream (BatchSizes::start_rows) begins that many rows in, anywhere.
class RebatchSliceStage : public UnaryStage {
 public:
  RebatchSliceStage(std::unique_ptr<Stage> input, std::int64_t global, bool drop,
                    std::int64_t slice, std::int64_t replicas, std::int64_t first,
                    std::int64_t count, std::shared_ptr<BatchSizes> sizes)
      : UnaryStage("RebatchSlice", std::move(input)), global_(global), drop_(drop), slice_(slice),
        replicas_(replicas), first_(first), count_(count), sizes_(std::move(sizes)) {
    rows_ = input_->rows();
    if (rows_) name_ = "RebatchSlice(gathered)";
    lead_ = sizes_ ? sizes_->start_rows : 0;
  }
  std::int64_t skip(std::int64_t n) override {
    std::int64_t moved = 0;
    for (; moved < n; ++moved) {
      if (!take_step()) break;
    }
    return moved;
  }

 protected:
  std::optional<Element> produce() override {
    const std::int64_t step = take_step();
    if (step == 0) return std::nullopt;
    const std::int64_t begin = std::min(first_ * slice_, step);
    const std::int64_t end = std::min((first_ + count_) * slice_, step);
    Element out;
    if (rows_) {
      const torch::Tensor index =
          torch::from_blob(taken_rows_.data() + begin, {end - begin}, torch::kInt64).clone();
      out.reserve(rows_->size());
      for (const auto& t : *rows_) out.push_back(t.index_select(0, index));
    } else {
      out = stack_range(taken_, begin, end, index_);
    }
    ++index_;
    if (sizes_) sizes_->push(step);
    return out;
  }

 private:
  std::int64_t global_;
  bool drop_;
  std::int64_t slice_, replicas_, first_, count_;
  std::shared_ptr<BatchSizes> sizes_;
  std::int64_t lead_;
  std::int64_t index_ = 0;
  const Element* rows_ = nullptr;
  bool ended_ = false;
  // Rows of whole global batches read and not yet stepped on (indices in row mode).
  std::deque<std::int64_t> pending_rows_;
  std::deque<Element> pending_;
  // The last step's rows, in order.
  std::vector<std::int64_t> taken_rows_;
  std::vector<Element> taken_;

  std::int64_t pending() const {
    return static_cast<std::int64_t>(rows_ ? pending_rows_.size() : pending_.size());
  }
  // Reads one global batch into the pending rows; false at the input's end (a short last batch
  // is kept unless drop_remainder).
  bool read_global_batch() {
    std::int64_t got = 0;
    for (; got < global_; ++got) {
      if (rows_) {
        auto r = input_->next_row();
        if (!r) break;
        pending_rows_.push_back(*r);
      } else {
        auto e = input_->next();
        if (!e) break;
        pending_.push_back(std::move(*e));
      }
    }
    if (got == global_) return true;
    if (drop_) { // the full cluster would not train on these either
      for (std::int64_t i = 0; i < got; ++i) rows_ ? pending_rows_.pop_back() : pending_.pop_back();
    }
    ended_ = true;
    return false;
  }
  // Moves the next step's rows into taken_; returns how many (0 where the pass ends).
  std::int64_t take_step() {
    if (lead_ > 0) { // a resumed pass: whole global batches skipped, then part of one
      const std::int64_t whole = lead_ / global_;
      const std::int64_t moved = input_->skip(whole * global_);
      if (moved < whole * global_) ended_ = true;
      if (!ended_) read_global_batch();
      for (std::int64_t i = 0; i < lead_ % global_ && pending() > 0; ++i) {
        rows_ ? pending_rows_.pop_front() : pending_.pop_front();
      }
      lead_ = 0;
    }
    const std::int64_t want = replicas_ * slice_;
    while (pending() < want && !ended_ && read_global_batch()) {
    }
    const std::int64_t step = std::min(want, pending());
    taken_rows_.clear();
    taken_.clear();
    for (std::int64_t i = 0; i < step; ++i) {
      if (rows_) {
        taken_rows_.push_back(pending_rows_.front());
        pending_rows_.pop_front();
      } else {
        taken_.push_back(std::move(pending_.front()));
        pending_.pop_front();
      }
    }
    return step;
  }
};

class RebatchSliceNode : public UnaryNode {
 public:
  RebatchSliceNode(NodePtr input, std::int64_t global, bool drop, std::int64_t slice,
                   std::int64_t replicas, std::int64_t first, std::int64_t count)
      : UnaryNode(std::move(input)), global_(global), drop_(drop), slice_(slice),
        replicas_(replicas), first_(first), count_(count) {}
  std::unique_ptr<Stage> make_iterator(const IteratorContext& ctx) const override {
    return std::make_unique<RebatchSliceStage>(input_->make_iterator(ctx), global_, drop_, slice_,
                                               replicas_, first_, count_, ctx.batch_sizes);
  }
  // Steps of a whole pass (one resumed mid-stream takes fewer).
  std::int64_t cardinality() const override {
    const std::int64_t c = input_->cardinality();
    if (c < 0) return c;
    const std::int64_t rows = drop_ ? c / global_ * global_ : c;
    const std::int64_t step = replicas_ * slice_;
    return (rows + step - 1) / step;
  }
  std::string describe() const override {
    return "rebatch_slice(" + std::to_string(global_) + "," + std::to_string(drop_) + "," +
           std::to_string(slice_) + "," + std::to_string(replicas_) + "," + std::to_string(first_) +
           "," + std::to_string(count_) + ")";
  }

 private:
  std::int64_t global_;
  bool drop_;
  std::int64_t slice_, replicas_, first_, count_;
};

// The fallback when no batch can be rewritten: the whole pipeline runs, and each global batch
// is split at the end. Components that are not batched (no leading dimension of the batch's
// size) pass whole.
class SplitStage : public UnaryStage {
 public:
  SplitStage(std::unique_ptr<Stage> input, std::int64_t replicas, std::int64_t first,
             std::int64_t count, std::shared_ptr<BatchSizes> sizes)
      : UnaryStage("Split", std::move(input)), replicas_(replicas), first_(first), count_(count),
        sizes_(std::move(sizes)) {}
  std::int64_t skip(std::int64_t n) override { return input_->skip(n); }

 protected:
  std::optional<Element> produce() override {
    auto e = input_->next();
    if (!e) return std::nullopt;
    if (e->empty() || e->front().dim() == 0) {
      throw DataError("distribute_dataset: an element's first component is a scalar, not a "
                      "batch; batch the dataset by the global batch size before distributing it");
    }
    const std::int64_t b = e->front().size(0);
    const auto [begin, end] = replica_range(b, replicas_, first_, count_);
    for (auto& t : *e) {
      if (t.dim() > 0 && t.size(0) == b) t = t.narrow(0, begin, end - begin);
    }
    if (sizes_) sizes_->push(b);
    return e;
  }

 private:
  std::int64_t replicas_, first_, count_;
  std::shared_ptr<BatchSizes> sizes_;
};

class SplitNode : public UnaryNode {
 public:
  SplitNode(NodePtr input, std::int64_t replicas, std::int64_t first, std::int64_t count)
      : UnaryNode(std::move(input)), replicas_(replicas), first_(first), count_(count) {}
  std::unique_ptr<Stage> make_iterator(const IteratorContext& ctx) const override {
    return std::make_unique<SplitStage>(input_->make_iterator(ctx), replicas_, first_, count_,
                                        ctx.batch_sizes);
  }
  std::int64_t cardinality() const override { return input_->cardinality(); }
  std::string describe() const override {
    return "split(" + std::to_string(replicas_) + "," + std::to_string(first_) + "," +
           std::to_string(count_) + ")";
  }

 private:
  std::int64_t replicas_, first_, count_;
};

using MakeFromBatch = std::function<NodePtr(NodePtr input, std::int64_t size, bool drop)>;

// The graph with the batch on the order-preserving path from `node` replaced by make(...), or
// nullptr when there is no such batch (or more than one branch has one).
NodePtr rewrite_batch(const NodePtr& node, const Options& options, const MakeFromBatch& make) {
  std::int64_t size = 0;
  bool drop = false;
  if (is_batch(*node, &size, &drop)) return make(node->inputs().at(0), size, drop);
  if (!node->preserves_order(options)) return nullptr;
  auto inputs = node->inputs();
  int rewritten = 0;
  for (auto& in : inputs) {
    if (auto r = rewrite_batch(in, options, make)) {
      in = r;
      ++rewritten;
    }
  }
  return rewritten == 1 ? node->with_inputs(std::move(inputs)) : nullptr;
}

} // namespace
} // namespace detail

std::optional<ReplicaBatch> DistributedIterator::next() {
  std::optional<Element> e;
  try {
    e = iterator_.next();
  } catch (...) {
    if (sizes_) sizes_->pop(); // the failed batch's size, so the next batch gets its own
    throw;
  }
  if (!e) return std::nullopt;
  // Without recorded sizes, each worker's batch is its whole share of the step (split over its
  // replicas), so the global batch is that times the workers (not the replicas: with several
  // replicas per worker that would count each row once per replica). fit replaces it by the
  // true sum of rows where the workers' batches may differ (uneven input).
  const std::int64_t global =
      sizes_ ? sizes_->pop()
             : (e->empty() || e->front().dim() == 0 ? 0 : e->front().size(0)) * workers_;
  rows_before_last_ = rows_;
  rows_ += global;
  return ReplicaBatch{std::move(*e), global};
}

IteratorState DistributedIterator::save(bool before_last) const {
  IteratorState state = iterator_.save();
  if (rows_mode_) {
    state.in_rows = true;
    state.produced = before_last ? rows_before_last_ : rows_;
  } else if (before_last) {
    state.produced -= 1;
  }
  return state;
}

DistributedIterator DistributedDataset::make_iterator() const {
  auto sizes = records_sizes_ ? std::make_shared<detail::BatchSizes>() : nullptr;
  return DistributedIterator(
      detail::make_iterator(per_worker_.node(), sizes, nullptr, original_.node()), sizes,
      context_.num_input_pipelines, slice_rows_ > 0, 0);
}

DistributedIterator DistributedDataset::make_iterator(const IteratorState& state) const {
  auto sizes = records_sizes_ ? std::make_shared<detail::BatchSizes>() : nullptr;
  IteratorState resume = state;
  std::int64_t start_rows = 0;
  if (slice_rows_ > 0) {
    // Rows into the stream (a position in global batches is that many whole ones); the
    // rebatching stage begins there.
    start_rows = state.in_rows ? state.produced : state.produced * global_rows_;
    sizes->start_rows = start_rows;
    resume.produced = 0;
    resume.in_rows = false;
  } else if (state.in_rows) {
    const std::int64_t global = global_rows_;
    if (global <= 0 || state.produced % global != 0) {
      throw ConfigError("the saved input position is " + std::to_string(state.produced) +
                        " rows into the pass (an elastic fit that kept the per-replica batch), "
                        "not at a global batch boundary of this pipeline (" +
                        std::to_string(global) +
                        " rows); resume with ElasticOptions::batch kPerReplica, "
                        "as it was saved");
    }
    resume.produced = state.produced / global;
    resume.in_rows = false;
  }
  return DistributedIterator(
      detail::make_iterator(per_worker_.node(), sizes, &resume, original_.node()), sizes,
      context_.num_input_pipelines, slice_rows_ > 0, start_rows);
}

DistributedDataset distribute_dataset(const Dataset& dataset,
                                      const cluster::InputContext& context) {
  const std::int64_t workers = context.num_input_pipelines;
  const std::int64_t replicas = context.num_replicas_in_sync;
  const Options& options = dataset.options();
  const std::string where =
      "worker " + std::to_string(context.input_pipeline_id) + " of " + std::to_string(workers);
  const std::int64_t full = context.full_replicas; // > 0: elastic, keeping the per-replica batch
  if (replicas == 1 && full == 0) {
    return DistributedDataset(dataset, dataset, context, false, "one replica: the dataset as it is",
                              0, true);
  }
  // This worker's part of each global batch: equal shares count replicas, shares the weights.
  const cluster::InputContext::Part part = context.part_of(context.input_pipeline_id);
  const std::int64_t parts = part.parts, first = part.first, per_worker = part.count;
  const bool by_share = !context.shares.empty();
  if (by_share && full > 0) {
    throw ConfigError("distribute_dataset: shares by speed divide a constant global batch; an "
                      "elastic group keeping the per-replica batch has none to divide");
  }
  // tf.data's AUTO: FILE when the source reads at least one file per worker, else DATA. Where
  // TF fails on FILE with too few files, fall back to DATA and say why.
  AutoShardPolicy policy = options.distribute.auto_shard_policy;
  const std::int64_t files = dataset.node()->source_files();
  if ((context.uneven_split || full > 0 || by_share) && policy != AutoShardPolicy::kAuto &&
      policy != AutoShardPolicy::kData) {
    throw ConfigError(std::string("distribute_dataset: ") +
                      (by_share ? "shares by speed split" : "an elastic group re-splits") +
                      " every global batch among the workers, which needs auto_shard_policy "
                      "DATA (or AUTO); saw " +
                      std::string(policy == AutoShardPolicy::kFile ? "FILE" : "OFF"));
  }
  if (context.uneven_split || full > 0 || by_share) {
    policy = AutoShardPolicy::kData; // FILE shards cannot move to the survivors mid-epoch
  } else if (policy == AutoShardPolicy::kAuto) {
    policy = files >= workers ? AutoShardPolicy::kFile : AutoShardPolicy::kData;
  } else if (policy == AutoShardPolicy::kFile && files < workers) {
    Logger().warn("auto_shard_policy FILE: the dataset reads " + std::to_string(files) +
                  " file(s), fewer than the " + std::to_string(workers) +
                  " workers, so each worker keeps its part of the data instead (DATA)");
    policy = AutoShardPolicy::kData;
  }
  if (policy == AutoShardPolicy::kFile) {
    // Each worker reads its own files and batches its own replicas' share of the global batch.
    std::int64_t global_size = 0;
    detail::NodePtr sharded = dataset.node()->shard_files(workers, context.input_pipeline_id);
    if (sharded) {
      sharded = detail::rewrite_batch(
          sharded, options, [&](detail::NodePtr input, std::int64_t size, bool drop) {
            global_size = size;
            return detail::make_batch(
                std::move(input), context.get_per_replica_batch_size(size) * per_worker, drop, 1);
          });
    }
    if (sharded) {
      const std::int64_t mine = (files - context.input_pipeline_id + workers - 1) / workers;
      return DistributedDataset(dataset, Dataset(sharded), context, false,
                                "FILE: " + where + " reads its " + std::to_string(mine) + " of " +
                                    std::to_string(files) + " files; batch(" +
                                    std::to_string(global_size) + ") becomes " +
                                    std::to_string(global_size / replicas) + " per replica",
                                global_size / replicas, false);
    }
    Logger().warn("auto_shard_policy FILE: the files cannot be sharded through this pipeline (no "
                  "batch to rebatch, or a stage that cannot be copied); using DATA");
  }

  std::int64_t global = 0;
  detail::NodePtr rewritten;
  if (policy == AutoShardPolicy::kOff) {
    // Every worker reads everything, in per-replica batches (tf.data's OFF).
    rewritten = detail::rewrite_batch(
        dataset.node(), options, [&](detail::NodePtr input, std::int64_t size, bool drop) {
          global = size;
          return detail::make_batch(std::move(input), context.get_per_replica_batch_size(size),
                                    drop, 1);
        });
    if (!rewritten) {
      throw ConfigError("distribute_dataset with auto_shard_policy OFF needs a batch() to "
                        "rebatch per replica; batch the dataset by the global batch size");
    }
    return DistributedDataset(dataset, Dataset(rewritten), context, false,
                              "OFF: every worker reads every element; batch(" +
                                  std::to_string(global) + ") becomes " +
                                  std::to_string(global / replicas) + " per replica",
                              global / replicas, true);
  }
  // DATA: every worker builds every global batch and keeps its slice, which only partitions
  // the data if every worker builds the same batches.
  const std::string why = dataset.node()->graph_not_replayable(options);
  if (!why.empty()) {
    throw ConfigError("distribute_dataset: with DATA sharding every worker must build the same "
                      "global batches, but " +
                      why + " (or shard it yourself with distribute_datasets_from_function)");
  }
  rewritten = detail::rewrite_batch(
      dataset.node(), options,
      [&](detail::NodePtr input, std::int64_t size, bool drop) -> detail::NodePtr {
        global = size;
        if (full > 0) {
          if (size % full != 0) {
            throw ConfigError("distribute_dataset: keeping the per-replica batch in an elastic "
                              "group needs a global batch that the cluster's " +
                              std::to_string(full) + " workers split evenly; saw batch(" +
                              std::to_string(size) + "). Use a multiple of " +
                              std::to_string(full));
          }
          return std::make_shared<detail::RebatchSliceNode>(
              std::move(input), size, drop, size / full, replicas, first, per_worker);
        }
        // ConfigError unless it splits evenly (or may not: elastic, shares).
        if (!context.uneven_split && !by_share) context.get_per_replica_batch_size(size);
        return std::make_shared<detail::RebatchShardNode>(std::move(input), size, drop, parts,
                                                          first, per_worker);
      });
  if (full > 0) {
    if (!rewritten) {
      throw ConfigError("distribute_dataset: keeping the per-replica batch in an elastic group "
                        "needs the pipeline's batch(global batch) to rewrite (none was found, or "
                        "one behind an order-changing stage)");
    }
    const std::int64_t slice = global / full;
    DistributedDataset out(dataset, Dataset(rewritten), context, true,
                           "DATA: batch(" + std::to_string(global) + ") dealt out in slices of " +
                               std::to_string(slice) + " per replica, " + std::to_string(replicas) +
                               " of the cluster's " + std::to_string(full) +
                               " replicas' slices per step; " + where + " takes " +
                               std::to_string(per_worker),
                           slice, true);
    out.slice_rows_ = slice;
    out.global_rows_ = global;
    return out;
  }
  if (rewritten) {
    const auto [begin, end] = detail::replica_range(global, parts, first, per_worker);
    const std::string share =
        by_share ? "rows " + std::to_string(begin) + " to " + std::to_string(end - 1) +
                       " of each global batch (shares " + context.describe_shares() + ")"
        : global % replicas == 0
            ? std::to_string(global / workers) + " of each global batch; " +
                  std::to_string(global / replicas) + " per replica"
            : "rows " + std::to_string(begin) + " to " + std::to_string(end - 1) +
                  " of each global batch (an uneven split: shares differ by at most one row)";
    DistributedDataset out(dataset, Dataset(rewritten), context, true,
                           "DATA: batch(" + std::to_string(global) + ") rewritten so " + where +
                               " stacks only its " + share,
                           global / replicas, true);
    out.global_rows_ = global;
    return out;
  }
  return DistributedDataset(
      dataset,
      Dataset(std::make_shared<detail::SplitNode>(dataset.node(), parts, first, per_worker)),
      context, true,
      "DATA: no batch found to rewrite (or one behind an order-changing stage), so " + where +
          " runs the whole pipeline and keeps its slice of each global batch",
      0, true);
}

DistributedDataset DistributedDataset::redistribute(const cluster::InputContext& context) const {
  if (sharding() == "from a function") {
    throw ConfigError("a dataset each worker builds for itself (distribute_datasets_from_function) "
                      "cannot be split anew among other workers; use distribute_dataset");
  }
  return distribute_dataset(original_, context);
}

DistributedDataset
distribute_datasets_from_function(const std::function<Dataset(const cluster::InputContext&)>& fn,
                                  const cluster::InputContext& context) {
  if (!context.shares.empty()) {
    throw ConfigError("distribute_datasets_from_function: shares by speed split each global batch "
                      "by the workers' weights, which a pipeline each worker builds for itself "
                      "cannot do; use distribute_dataset");
  }
  if (context.uneven_split) {
    throw ConfigError("distribute_datasets_from_function: an elastic group re-splits each global "
                      "batch among the workers it has mid-epoch, which a pipeline each worker "
                      "builds for itself cannot do; use distribute_dataset");
  }
  const Dataset built = fn(context);
  return DistributedDataset(built, built, context, false,
                            "from a function: this worker's pipeline as built, per-replica batches",
                            0, false);
}

} // namespace flotilla::data
