#include "flotilla/data/dataset.h"

#include <sched.h>

#include <cerrno>
#include <cstring>
#include <unistd.h>

#include "data/stages.h"
#include "flotilla/base/system.h"
#include "flotilla/base/thread_pool.h"
#include "data/tuner.h"
#include "flotilla/error.h"

namespace flotilla::data {
namespace detail {

std::uint64_t mix_seed(std::uint64_t seed, std::uint64_t a, std::uint64_t b) {
  auto splitmix = [](std::uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
  };
  return splitmix(splitmix(splitmix(seed) ^ a) ^ b);
}

std::int64_t Stage::skip(std::int64_t n) {
  std::int64_t moved = 0;
  while (moved < n && (row_mode_ ? next_row().has_value() : next().has_value())) ++moved;
  return moved;
}

void Stage::stats(std::vector<StageStats>& out) const {
  for (const Stage* in : stat_inputs()) in->stats(out);
  StageStats s;
  s.name = name_;
  s.elements = elements_.load();
  s.mean_latency_us = s.elements > 0 ? static_cast<double>(latency_ns_.load()) / 1000.0 /
                                           static_cast<double>(s.elements)
                                     : 0;
  fill(s);
  out.push_back(s);
}

std::string Node::fingerprint() const {
  std::string out = fingerprint_text();
  const auto ins = inputs();
  if (!ins.empty()) {
    out += "<-[";
    for (std::size_t i = 0; i < ins.size(); ++i) out += (i ? "," : "") + ins[i]->fingerprint();
    out += "]";
  }
  return out;
}

std::string Node::graph_not_replayable(const Options& options) const {
  std::string why = not_replayable(options);
  if (!why.empty()) return why;
  for (const auto& in : inputs()) {
    why = in->graph_not_replayable(options);
    if (!why.empty()) return why;
  }
  return "";
}

std::int64_t Node::source_files() const {
  std::int64_t n = 0;
  for (const auto& in : inputs()) n = std::max(n, in->source_files());
  return n;
}

NodePtr Node::shard_files(std::int64_t n, std::int64_t i) const {
  auto ins = inputs();
  if (ins.empty()) return nullptr; // a source that reads no files cannot be sharded by file
  for (auto& in : ins) {
    // Every input must shard: zipping worker w's records with everyone's in-memory labels, or
    // concatenating everyone's in-memory part, would be wrong. Then DATA is used instead.
    auto sharded = in->shard_files(n, i);
    if (!sharded) return nullptr;
    in = sharded;
  }
  return with_inputs(std::move(ins));
}

FileSourceNode::FileSourceNode(std::vector<std::string> files, const Options& options)
    : Node(options), files_(std::move(files)) {
  if (files_.empty()) throw DataError("a file dataset needs at least one file; the list is empty");
  for (const auto& f : files_) {
    if (::access(f.c_str(), R_OK) != 0) {
      throw DataError(f + ": cannot read it (" + std::strerror(errno) + "); check the path");
    }
  }
}

NodePtr FileSourceNode::shard_files(std::int64_t n, std::int64_t i) const {
  if (static_cast<std::int64_t>(files_.size()) < n) return nullptr; // some worker would get none
  std::vector<std::string> mine;
  for (std::size_t k = static_cast<std::size_t>(i); k < files_.size();
       k += static_cast<std::size_t>(n)) {
    mine.push_back(files_[k]);
  }
  return with_files(std::move(mine));
}

std::string FileSourceNode::describe_files() const {
  return file_identity(files_);
}

void Node::continue_after(std::int64_t iteration) const {
  std::int64_t current = iterations_.load();
  while (current <= iteration && !iterations_.compare_exchange_weak(current, iteration + 1)) {
  }
}

// The runtime of one pass: the pool and tuner its stages share, and the stage tree.
class IteratorImpl {
 public:
  IteratorImpl(NodePtr node, NodePtr identity, std::int64_t iteration,
               std::shared_ptr<BatchSizes> batch_sizes)
      : node_(std::move(node)), identity_(std::move(identity)), iteration_(iteration) {
    IteratorContext ctx;
    ctx.batch_sizes = std::move(batch_sizes);
    ctx.options = node_->options();
    ctx.iteration = iteration;
    const int threads = ctx.options.private_threadpool_size > 0
                            ? ctx.options.private_threadpool_size
                            : base::available_cores();
    std::int64_t budget = ctx.options.autotune.ram_budget;
    if (budget <= 0) {
      budget = static_cast<std::int64_t>(::sysconf(_SC_PHYS_PAGES)) * ::sysconf(_SC_PAGESIZE) / 4;
    }
    ctx.pool = std::make_shared<ThreadPool>(threads);
    ctx.tuner = std::make_shared<Tuner>(ctx.options.autotune.enabled, budget);
    ctx_ = ctx;
    root_ = node_->make_iterator(ctx_);
  }
  ~IteratorImpl() { root_.reset(); } // stages stop before the pool they use

  std::optional<Element> next() {
    ctx_.tuner->maybe_tune();
    auto e = root_->next();
    if (e) ++produced_;
    return e;
  }
  std::int64_t skip(std::int64_t n) {
    const std::int64_t moved = root_->skip(n);
    produced_ += moved;
    return moved;
  }
  std::vector<StageStats> stats() const {
    std::vector<StageStats> out;
    root_->stats(out);
    return out;
  }
  IteratorState save() const {
    const std::string why = node_->graph_not_replayable(ctx_.options);
    if (!why.empty()) {
      throw ConfigError("this iterator cannot be saved to resume exactly: " + why);
    }
    return IteratorState{iteration_, produced_, identity_->fingerprint()};
  }

 private:
  NodePtr node_;
  NodePtr identity_; // what save() fingerprints: the user's dataset
  std::int64_t iteration_;
  std::int64_t produced_ = 0;
  IteratorContext ctx_;
  std::unique_ptr<Stage> root_;
};

} // namespace detail

// --- Iterator ---

Iterator::Iterator(std::unique_ptr<detail::IteratorImpl> impl) : impl_(std::move(impl)) {}
Iterator::Iterator(Iterator&&) noexcept = default;
Iterator& Iterator::operator=(Iterator&&) noexcept = default;
Iterator::~Iterator() = default;
std::optional<Element> Iterator::next() {
  return impl_->next();
}
std::vector<StageStats> Iterator::stats() const {
  return impl_->stats();
}
IteratorState Iterator::save() const {
  return impl_->save();
}

// --- Dataset ---

Dataset::Dataset(std::shared_ptr<const detail::Node> node) : node_(std::move(node)) {}

Dataset Dataset::from_tensor_slices(Element tensors) {
  return Dataset(detail::make_tensor_slices(std::move(tensors), Options{}));
}
Dataset Dataset::from_tensors(Element tensors) {
  return Dataset(detail::make_tensors(std::move(tensors), Options{}));
}
Dataset Dataset::range(std::int64_t start, std::int64_t stop, std::int64_t step) {
  return Dataset(detail::make_range(start, stop, step, Options{}));
}

Dataset Dataset::random(std::uint64_t seed, bool rerandomize_each_iteration) {
  return Dataset(detail::make_random(seed, rerandomize_each_iteration, Options{}));
}
Dataset Dataset::from_file_tensors(Element tensors, const std::vector<std::string>& files) {
  return Dataset(detail::make_file_tensor_slices(std::move(tensors), files, Options{}));
}

Dataset Dataset::map(MapFn fn, std::int64_t num_parallel_calls,
                     std::optional<bool> deterministic) const {
  return Dataset(detail::make_map(node_, std::move(fn), num_parallel_calls, deterministic));
}
Dataset Dataset::list_files(const std::string& pattern, bool shuffle,
                            std::optional<std::uint64_t> seed) {
  return Dataset(detail::make_list_files(pattern, shuffle, seed, Options{}));
}
Dataset Dataset::interleave(InterleaveFn fn, std::int64_t cycle_length, std::int64_t block_length,
                            std::int64_t num_parallel_calls,
                            std::optional<bool> deterministic) const {
  return Dataset(detail::make_interleave(node_, std::move(fn), cycle_length, block_length,
                                         num_parallel_calls, deterministic));
}
Dataset Dataset::filter(PredicateFn predicate) const {
  return Dataset(detail::make_filter(node_, std::move(predicate)));
}
Dataset Dataset::shuffle(std::int64_t buffer_size, std::optional<std::uint64_t> seed,
                         bool reshuffle_each_iteration) const {
  return Dataset(detail::make_shuffle(node_, buffer_size, seed, reshuffle_each_iteration));
}
Dataset Dataset::batch(std::int64_t batch_size, bool drop_remainder,
                       std::int64_t num_parallel_calls) const {
  return Dataset(detail::make_batch(node_, batch_size, drop_remainder, num_parallel_calls));
}
Dataset Dataset::repeat(std::int64_t count) const {
  return Dataset(detail::make_repeat(node_, count));
}
Dataset Dataset::take(std::int64_t count) const {
  return Dataset(detail::make_take(node_, count));
}
Dataset Dataset::skip(std::int64_t count) const {
  return Dataset(detail::make_skip(node_, count));
}
Dataset Dataset::shard(std::int64_t num_shards, std::int64_t index) const {
  return Dataset(detail::make_shard(node_, num_shards, index));
}
Dataset Dataset::enumerate(std::int64_t start) const {
  return Dataset(detail::make_enumerate(node_, start));
}
Dataset Dataset::cache(const std::string& filename) const {
  return Dataset(detail::make_cache(node_, filename));
}
Dataset Dataset::prefetch(std::int64_t buffer_size) const {
  return Dataset(detail::make_prefetch(node_, buffer_size));
}
Dataset Dataset::prefetch_to_device(torch::Device device, std::int64_t buffer_size) const {
  return Dataset(detail::make_prefetch_to_device(node_, device, buffer_size));
}
Dataset Dataset::zip(const std::vector<Dataset>& datasets) {
  std::vector<std::shared_ptr<const detail::Node>> nodes;
  for (const auto& d : datasets) nodes.push_back(d.node_);
  return Dataset(detail::make_zip(std::move(nodes)));
}
Dataset Dataset::concatenate(const Dataset& other) const {
  return Dataset(detail::make_concatenate(node_, other.node_));
}
Dataset Dataset::with_options(const Options& options) const {
  return Dataset(detail::make_with_options(node_, options));
}

Iterator Dataset::make_iterator() const {
  return detail::make_iterator(node_, nullptr, nullptr);
}

Iterator Dataset::make_iterator(const IteratorState& state) const {
  return detail::make_iterator(node_, nullptr, &state);
}

namespace detail {

Iterator make_iterator(const NodePtr& node, std::shared_ptr<BatchSizes> batch_sizes,
                       const IteratorState* resume, const NodePtr& identity_or_null) {
  const NodePtr& identity = identity_or_null ? identity_or_null : node;
  if (!resume) {
    return Iterator(std::make_unique<IteratorImpl>(node, identity, identity->next_iteration(),
                                                   std::move(batch_sizes)));
  }
  const std::string why = node->graph_not_replayable(node->options());
  if (!why.empty()) throw ConfigError("cannot resume this pipeline exactly: " + why);
  if (resume->fingerprint != identity->fingerprint()) {
    throw ConfigError(
        "the saved iterator state belongs to a different pipeline (its fingerprint differs); "
        "build the same dataset, with the same data, as when the state was saved");
  }
  auto impl =
      std::make_unique<IteratorImpl>(node, identity, resume->iteration, std::move(batch_sizes));
  identity->continue_after(resume->iteration);
  const std::int64_t moved = impl->skip(resume->produced);
  if (moved < resume->produced) {
    throw DataError("the pipeline ends after " + std::to_string(moved) +
                    " elements, before the saved position " + std::to_string(resume->produced) +
                    "; the data changed since the state was saved");
  }
  return Iterator(std::move(impl));
}

} // namespace detail

std::int64_t Dataset::cardinality() const {
  return node_->cardinality();
}
const Options& Dataset::options() const {
  return node_->options();
}
std::string Dataset::fingerprint() const {
  return node_->fingerprint();
}

Element stack(const std::vector<Element>& elements) {
  if (elements.empty()) throw DataError("stack needs at least one element; saw none");
  return detail::stack_batch(elements, 0);
}

} // namespace flotilla::data
