// tf.data for C++. A Dataset is an immutable description of an input pipeline — sources, then
// transformations such as shuffle, batch, map, prefetch, cache — and iterating it creates the
// runtime: threads for parallel map and prefetch, buffers, an autotuner that sizes them while
// the pipeline runs. Names and semantics follow tf.data, so
//
//   ds = Dataset::from_tensor_slices({x, y}).shuffle(10000, 42).batch(256, true)
//            .map(preprocess, kAutotune).prefetch(kAutotune);
//   for (const Element& batch : ds.make_iterator()) { ... }
//
// reads as it would in Python. An Element is a small tuple of tensors (features, label[, weight]),
// cheap to move. Errors are DataError naming the file, record or line, or the element index where
// a user function threw.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace flotilla::data {

using Element = std::vector<torch::Tensor>;

// tf.data.AUTOTUNE: let the runtime choose (parallelism, buffer size) while it runs.
inline constexpr std::int64_t kAutotune = -1;
inline constexpr std::int64_t kInfiniteCardinality = -1;
inline constexpr std::int64_t kUnknownCardinality = -2;

// tf.data.experimental.AutoShardPolicy.
enum class AutoShardPolicy {
  kAuto, // FILE when the source reads at least as many files as there are workers, else DATA
  kFile, // each worker reads its own files (falls back to DATA, with a warning, if too few)
  kData, // each worker reads everything and keeps its part
  kOff,  // every worker sees every element
};

struct Options {
  // Produce elements in a fixed order (parallel map and interleave wait for the next element in
  // order). false lets a finished element overtake a slow one.
  bool deterministic = true;
  struct {
    bool enabled = true;
    // Bytes the autotuner may spend on buffers (prefetch, parallel map); 0: a quarter of RAM.
    std::int64_t ram_budget = 0;
  } autotune;
  // Threads running map functions and batch assembly; 0: this process's cores.
  int private_threadpool_size = 0;
  struct {
    AutoShardPolicy auto_shard_policy = AutoShardPolicy::kAuto;
  } distribute;
};

// One stage's runtime figures, for Iterator::stats(): what the autotuner saw and chose.
struct StageStats {
  std::string name;               // e.g. "ParallelMap", "Prefetch"
  std::int64_t elements = 0;      // produced so far
  double mean_latency_us = 0;     // mean time a consumer's next() spent in this stage
  double consumer_wait_share = 0; // share of the consumer's time spent waiting here
  std::int64_t parallelism = 0;   // current parallel calls (0: not a parallel stage)
  std::int64_t buffer_size = 0;   // current buffer (0: none)
  bool autotuned = false;
};

// Where an iterator stands, to resume on exactly the next element (see Iterator::save).
struct IteratorState {
  std::int64_t iteration =
      0;                     // which pass over the dataset (reshuffles and augmentations key on it)
  std::int64_t produced = 0; // elements returned so far in that pass
  std::string fingerprint;   // of the pipeline that produced it, checked on restore
  // `produced` counts rows of the global batches' stream, not elements: the position of an
  // elastic pass keeping the per-replica batch (distribute.h), whose steps take a varying
  // number of rows. A distributed pass converts between the two at global batch boundaries.
  bool in_rows = false;
};

class Iterator;
namespace detail {
class Node;
class IteratorImpl;
struct BatchSizes;
// Makes a pass over `node`, optionally recording batch sizes (distribute.cpp) or resuming at
// `resume`. Passes are numbered, and states fingerprinted, by `identity` (the user's dataset,
// which a distributed pipeline was rewritten from; `node` itself when null).
Iterator make_iterator(const std::shared_ptr<const Node>& node,
                       std::shared_ptr<BatchSizes> batch_sizes, const IteratorState* resume,
                       const std::shared_ptr<const Node>& identity = nullptr);
} // namespace detail

class Dataset;
using MapFn = std::function<Element(Element)>;
using PredicateFn = std::function<bool(const Element&)>;
using InterleaveFn = std::function<Dataset(const Element&)>;

class Iterator {
 public:
  Iterator(Iterator&&) noexcept;
  Iterator& operator=(Iterator&&) noexcept;
  ~Iterator(); // stops and joins every thread of the pipeline; never blocks on a full buffer

  // The next element, or nullopt at the end. Rethrows a failure of any stage.
  std::optional<Element> next();
  // Per-stage figures, from the source to this iterator.
  std::vector<StageStats> stats() const;
  // Where this iterator stands. Only a deterministic pipeline can be resumed exactly: seeded
  // shuffles, deterministic parallel stages, no unseeded randomness; otherwise ConfigError.
  IteratorState save() const;

  // Range-for support.
  class Sentinel {};
  class Cursor {
   public:
    explicit Cursor(Iterator* it) : it_(it) { ++*this; }
    const Element& operator*() const { return *current_; }
    Element& operator*() { return *current_; }
    Cursor& operator++() {
      current_ = it_->next();
      return *this;
    }
    bool operator!=(Sentinel) const { return current_.has_value(); }

   private:
    Iterator* it_;
    std::optional<Element> current_;
  };
  Cursor begin() { return Cursor(this); }
  Sentinel end() { return {}; }

 private:
  friend class Dataset;
  friend Iterator detail::make_iterator(const std::shared_ptr<const detail::Node>& node,
                                        std::shared_ptr<detail::BatchSizes> batch_sizes,
                                        const IteratorState* resume,
                                        const std::shared_ptr<const detail::Node>& identity);
  explicit Iterator(std::unique_ptr<detail::IteratorImpl> impl);
  std::unique_ptr<detail::IteratorImpl> impl_;
};

class Dataset {
 public:
  // --- sources ---
  // Element i is (t[i] for t in tensors); every tensor needs the same first dimension.
  static Dataset from_tensor_slices(Element tensors);
  // One element: the tensors themselves.
  static Dataset from_tensors(Element tensors);
  // int64 scalars start, start + step, ... before stop.
  static Dataset range(std::int64_t start, std::int64_t stop, std::int64_t step = 1);
  static Dataset range(std::int64_t stop) { return range(0, stop); }
  // tf.data.Dataset.random: an endless stream of int64 scalars from `seed`, a new stream on each
  // pass when rerandomize_each_iteration. Zip it with batches to seed their augmentation:
  // stateless, reproducible, and resumable.
  static Dataset random(std::uint64_t seed, bool rerandomize_each_iteration = true);
  // Slices of tensors read from files: like from_tensor_slices, but its fingerprint is the files'
  // paths, sizes and modification times rather than a hash of the data.
  static Dataset from_file_tensors(Element tensors, const std::vector<std::string>& files);
  // tf.data.Dataset.list_files: the paths matching a glob pattern, as uint8 string tensors (see
  // to_string in tfrecord.h), shuffled unless shuffle is false (seed it to resume exactly).
  // DataError if nothing matches. FILE auto-sharding splits this list across workers.
  static Dataset list_files(const std::string& pattern, bool shuffle = true,
                            std::optional<std::uint64_t> seed = std::nullopt);

  // --- transformations ---
  // num_parallel_calls: 1 runs fn on the consumer's side of the pipeline; N > 1 or kAutotune
  // run it on the private thread pool. deterministic: nullopt follows Options::deterministic.
  Dataset map(MapFn fn, std::int64_t num_parallel_calls = 1,
              std::optional<bool> deterministic = std::nullopt) const;
  Dataset filter(PredicateFn predicate) const;
  // Opens fn(element) for up to cycle_length input elements at once and takes block_length
  // elements from each in turn (e.g. records from several files). With num_parallel_calls > 1
  // each open dataset is read ahead on its own thread; the order stays the same unless
  // deterministic is false.
  Dataset interleave(InterleaveFn fn, std::int64_t cycle_length, std::int64_t block_length = 1,
                     std::int64_t num_parallel_calls = 1,
                     std::optional<bool> deterministic = std::nullopt) const;
  // TF's buffered shuffle. Without a seed, a random one is drawn (and the pipeline cannot be
  // resumed exactly). reshuffle_each_iteration: a new order on each pass (each epoch).
  Dataset shuffle(std::int64_t buffer_size, std::optional<std::uint64_t> seed = std::nullopt,
                  bool reshuffle_each_iteration = true) const;
  // Stacks batch_size consecutive elements along a new first dimension.
  Dataset batch(std::int64_t batch_size, bool drop_remainder = false,
                std::int64_t num_parallel_calls = 1) const;
  Dataset repeat(std::int64_t count = -1) const; // -1: forever
  Dataset take(std::int64_t count) const;        // -1: all
  Dataset skip(std::int64_t count) const;        // -1: all
  Dataset shard(std::int64_t num_shards, std::int64_t index) const;
  // (int64 index, element...) — an element's position, e.g. to seed its augmentation.
  Dataset enumerate(std::int64_t start = 0) const;
  // In memory (filename empty) or in a file reused by later runs: written whole on the first
  // complete pass (never read half-written), rebuilt when the pipeline before it changes.
  Dataset cache(const std::string& filename = "") const;
  Dataset prefetch(std::int64_t buffer_size) const;
  // tf.data.experimental.prefetch_to_device: a prefetch of buffer_size elements whose thread
  // also moves every tensor to `device`. For a CUDA device it copies from pinned memory on a
  // copy stream of its own and waits for the copy before buffering the element, so the copy of
  // the next batch overlaps the step on this one, and a tensor handed out is complete: use it
  // without synchronizing. (Read on a stream other than the device's default one, a tensor needs
  // record_stream for that stream, as any CUDA tensor used off the stream it was made for.)
  // Tensors already on `device` pass untouched. A CPU device moves tensors to the CPU; otherwise
  // it is prefetch(buffer_size). Make it the LAST stage: a stage after it would work on device
  // tensors, on its own, without the overlap. ConfigError for buffer_size < 1 or a CUDA device
  // this process does not see.
  Dataset prefetch_to_device(torch::Device device, std::int64_t buffer_size = 1) const;
  // Concatenation of `datasets`' components, element by element, to the shortest.
  static Dataset zip(const std::vector<Dataset>& datasets);
  Dataset concatenate(const Dataset& other) const;
  Dataset with_options(const Options& options) const;

  // --- iteration ---
  // A fresh pass: iteration numbers count up from 0 across calls on this Dataset (and copies).
  Iterator make_iterator() const;
  // Resumes where save() was taken: same iteration, next element.
  Iterator make_iterator(const IteratorState& state) const;

  std::int64_t cardinality() const; // elements, or kInfiniteCardinality / kUnknownCardinality
  const Options& options() const;
  // A stable description of the pipeline (sources' identities included): equal strings mean
  // equal pipelines. Cache files and iterator states are keyed on it.
  std::string fingerprint() const;

  const std::shared_ptr<const detail::Node>& node() const { return node_; }
  explicit Dataset(std::shared_ptr<const detail::Node> node);

 private:
  std::shared_ptr<const detail::Node> node_;
};

// Stacks elements component-wise along a new first dimension (what batch() does).
Element stack(const std::vector<Element>& elements);

} // namespace flotilla::data
