// Private: the node factories behind Dataset's methods, and helpers the stages share.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "data/node.h"
#include "flotilla/error.h"

namespace flotilla::data::detail {

// An element or the error raised in its place, as buffered by the threaded stages.
struct Result {
  std::optional<Element> element;
  std::exception_ptr error;
};

// A stage with one input, whose stats come first.
class UnaryStage : public Stage {
 protected:
  UnaryStage(std::string name, std::unique_ptr<Stage> input)
      : Stage(std::move(name)), input_(std::move(input)) {}
  std::vector<const Stage*> stat_inputs() const override { return {input_.get()}; }
  std::unique_ptr<Stage> input_;
};

class UnaryNode : public Node {
 public:
  explicit UnaryNode(NodePtr input) : Node(input->options()), input_(std::move(input)) {}
  UnaryNode(NodePtr input, const Options& options) : Node(options), input_(std::move(input)) {}
  std::vector<NodePtr> inputs() const override { return {input_}; }

 protected:
  NodePtr input_;
};

// A source of `count` elements handed out in order by position: skip() jumps, resumes are cheap.
class PositionedStage : public Stage {
 public:
  PositionedStage(std::string name, std::int64_t count) : Stage(std::move(name)), count_(count) {}
  std::int64_t skip(std::int64_t n) override {
    const std::int64_t moved = std::min(n, count_ - position_);
    position_ += moved;
    return moved;
  }

 protected:
  virtual Element at(std::size_t k) = 0;
  std::optional<Element> produce() override {
    if (position_ >= count_) return std::nullopt;
    return at(static_cast<std::size_t>(position_++));
  }

 private:
  std::int64_t count_, position_ = 0;
};

// A source that reads a list of files; FILE auto-sharding hands each worker a subset.
class FileSourceNode : public Node {
 public:
  FileSourceNode(std::vector<std::string> files, const Options& options);
  std::int64_t cardinality() const override { return kUnknownCardinality; }
  std::int64_t source_files() const override { return static_cast<std::int64_t>(files_.size()); }
  NodePtr shard_files(std::int64_t n, std::int64_t i) const override;
  virtual NodePtr with_files(std::vector<std::string> files) const = 0;

 protected:
  std::string describe_files() const;
  std::vector<std::string> files_;
};

// "path:size:mtime;" for each file: what a fingerprint says of data read from files.
std::string file_identity(const std::vector<std::string>& files);

class EmptyStage : public Stage {
 public:
  EmptyStage() : Stage("Empty") {}

 protected:
  std::optional<Element> produce() override { return std::nullopt; }
};

// The parallel forms of map and batch (parallel.cpp): calls run on the context's pool.
std::unique_ptr<Stage> make_parallel_map(std::unique_ptr<Stage> input, MapFn fn,
                                         std::int64_t parallel, bool deterministic,
                                         const IteratorContext& ctx);
std::unique_ptr<Stage> make_parallel_batch(std::unique_ptr<Stage> input, std::int64_t size,
                                           bool drop_remainder, std::int64_t parallel,
                                           const IteratorContext& ctx);

// The error a consumer sees when a map function threw on element `index` of the pass.
DataError map_failure(std::int64_t index, std::exception_ptr error);
// Stacks the parts of batch `batch_index`; DataError names a mismatched element.
Element stack_batch(const std::vector<Element>& parts, std::int64_t batch_index);
// Whether `node` is a batch, and its settings (for distribute_dataset's rewrite).
bool is_batch(const Node& node, std::int64_t* size, bool* drop_remainder);

NodePtr make_tensor_slices(Element tensors, const Options& options);
NodePtr make_tensors(Element tensors, const Options& options);
NodePtr make_range(std::int64_t start, std::int64_t stop, std::int64_t step,
                   const Options& options);
NodePtr make_random(std::uint64_t seed, bool rerandomize, const Options& options);
NodePtr make_file_tensor_slices(Element tensors, const std::vector<std::string>& files,
                                const Options& options);

NodePtr make_map(NodePtr input, MapFn fn, std::int64_t num_parallel_calls,
                 std::optional<bool> deterministic);
NodePtr make_filter(NodePtr input, PredicateFn predicate);
NodePtr make_interleave(NodePtr input, InterleaveFn fn, std::int64_t cycle_length,
                        std::int64_t block_length, std::int64_t num_parallel_calls,
                        std::optional<bool> deterministic);
NodePtr make_list_files(const std::string& pattern, bool shuffle, std::optional<std::uint64_t> seed,
                        const Options& options);
NodePtr make_shuffle(NodePtr input, std::int64_t buffer_size, std::optional<std::uint64_t> seed,
                     bool reshuffle_each_iteration);
NodePtr make_batch(NodePtr input, std::int64_t batch_size, bool drop_remainder,
                   std::int64_t num_parallel_calls);
NodePtr make_repeat(NodePtr input, std::int64_t count);
NodePtr make_take(NodePtr input, std::int64_t count);
NodePtr make_skip(NodePtr input, std::int64_t count);
NodePtr make_shard(NodePtr input, std::int64_t num_shards, std::int64_t index);
NodePtr make_enumerate(NodePtr input, std::int64_t start);
NodePtr make_cache(NodePtr input, const std::string& filename);
NodePtr make_prefetch(NodePtr input, std::int64_t buffer_size);
NodePtr make_prefetch_to_device(NodePtr input, torch::Device device, std::int64_t buffer_size);
NodePtr make_zip(std::vector<NodePtr> inputs);
NodePtr make_concatenate(NodePtr first, NodePtr second);
NodePtr make_with_options(NodePtr input, const Options& options);

// A content hash of tensors (for fingerprints of in-memory sources), as 16 hex digits.
std::string hash_tensors(const Element& tensors);
// Approximate bytes an element holds (for the RAM budget).
std::int64_t element_bytes(const Element& e);
// "what the user's function threw", for wrapping into DataError.
std::string describe_exception(std::exception_ptr error);

} // namespace flotilla::data::detail
