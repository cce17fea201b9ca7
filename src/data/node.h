// Private: the graph a Dataset describes (Node) and the runtime an iteration builds from it
// (Stage, one per stage). Every stage times its own next() so that stats() and the
// autotuner see where the time goes.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "flotilla/data/dataset.h"
#include "flotilla/error.h"

namespace flotilla::base {
class ThreadPool;
}

namespace flotilla::data::detail {

using base::ThreadPool;
class Tuner;

// The global size of each batch a distributed pass produced, in order: the rebatching stage
// records it, the distributed iterator reads it to weigh a short last batch exactly.
struct BatchSizes {
  std::mutex mutex;
  std::deque<std::int64_t> sizes;
  void push(std::int64_t n) {
    std::lock_guard<std::mutex> lock(mutex);
    sizes.push_back(n);
  }
  std::int64_t pop() {
    std::lock_guard<std::mutex> lock(mutex);
    if (sizes.empty()) {
      throw DataError("distributed pass: a batch arrived without its recorded global size (a "
                      "stage after the batch dropped or added elements); this is a bug to report");
    }
    const std::int64_t n = sizes.front();
    sizes.pop_front();
    return n;
  }
  // An elastic pass keeping the per-replica batch resumes this many rows into the stream of
  // global batches (set before the pass is made; read by its rebatching stage).
  std::int64_t start_rows = 0;
};

struct IteratorContext {
  std::shared_ptr<ThreadPool> pool;
  std::shared_ptr<Tuner> tuner;
  Options options;
  std::int64_t iteration = 0;              // which pass; nested passes (repeat) derive their own
  std::shared_ptr<BatchSizes> batch_sizes; // set for a distributed pass
};

using Clock = std::chrono::steady_clock;

class Stage {
 public:
  explicit Stage(std::string name) : name_(std::move(name)) {}
  virtual ~Stage() = default;
  Stage(const Stage&) = delete;
  Stage& operator=(const Stage&) = delete;

  // The next element or nullopt at the end; timed for stats.
  // Once a stage has ended it stays ended: a consumer that asks again (a batch that returned
  // its short last batch, a cache completing) gets nullopt without the stage running again.
  std::optional<Element> next() {
    return timed([this] { return produce(); });
  }
  // Row mode, for a batch that gathers. A stage all of whose elements are rows of the same
  // in-memory tensors (their slices, shuffled or repeated) can hand out row numbers instead of
  // elements, and the batch takes its rows with one index_select per component: no tensor per
  // element. rows() switches this stage and those below it to row mode, before their first
  // element, and returns the tensors the rows index (valid while the stage lives); nullptr where
  // a stage cannot, and then nothing changed. In row mode, next_row() replaces next() (the same
  // order: the same elements, as rows) and skip() moves past rows.
  virtual const Element* rows() { return nullptr; }
  std::optional<std::int64_t> next_row() {
    return timed([this] { return produce_row(); });
  }
  const std::string& name() const { return name_; }
  // Moves past up to n elements as cheaply as the stage allows (a map need not run its function:
  // map functions are pure); returns how many it moved past.
  virtual std::int64_t skip(std::int64_t n);
  // This stage's figures after its inputs' (source first).
  virtual void stats(std::vector<StageStats>& out) const;

 protected:
  virtual std::optional<Element> produce() = 0;
  virtual std::optional<std::int64_t> produce_row() { return std::nullopt; }
  virtual void fill(StageStats& s) const {} // parallelism, buffer, waits
  // Runs `produce` for next() or next_row(): timed for stats, counted, and ended for good at the
  // first nullopt.
  template <class Produce> auto timed(Produce produce) -> decltype(produce()) {
    if (ended_) return std::nullopt;
    const std::int64_t start = now_ns();
    if (first_ns_ == 0) first_ns_ = start;
    auto out = produce();
    const std::int64_t end = now_ns();
    latency_ns_ += end - start;
    last_ns_ = end;
    if (out) {
      ++elements_;
    } else {
      ended_ = true;
    }
    return out;
  }
  // The inputs whose stats come before this stage's.
  virtual std::vector<const Stage*> stat_inputs() const { return {}; }

  // `ns` as a share of this stage's active time.
  double share(std::int64_t ns) const {
    const std::int64_t active = active_ns();
    return active > 0 ? static_cast<double>(ns) / static_cast<double>(active) : 0;
  }
  // Wall time from this stage's first next() to the end of its latest.
  std::int64_t active_ns() const { return last_ns_.load() - first_ns_.load(); }
  static std::int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
        .count();
  }

  std::string name_;
  std::atomic<std::int64_t> elements_{0};
  std::atomic<std::int64_t> latency_ns_{0};
  std::atomic<std::int64_t> first_ns_{0};
  std::atomic<std::int64_t> last_ns_{0};
  bool ended_ = false;
  bool row_mode_ = false;
};

class Node {
 public:
  explicit Node(Options options) : options_(std::move(options)) {}
  virtual ~Node() = default;

  virtual std::unique_ptr<Stage> make_iterator(const IteratorContext& ctx) const = 0;
  virtual std::int64_t cardinality() const = 0;
  // This node alone, e.g. "batch(256,drop_remainder=1)"; sources include their data's identity.
  virtual std::string describe() const = 0;
  virtual std::vector<std::shared_ptr<const Node>> inputs() const { return {}; }
  // Why a pass through this node could not be replayed exactly (same elements, same order) in
  // another process, or "" when it can.
  virtual std::string not_replayable(const Options& options) const { return ""; }
  // For distribute_dataset's rewrite: whether element k out is made from element k in of each
  // input, in order (so a batch below can be rebatched), and a copy over other inputs.
  virtual bool preserves_order(const Options& options) const { return false; }
  virtual std::shared_ptr<const Node> with_inputs(std::vector<std::shared_ptr<const Node>>) const {
    return nullptr;
  }
  // FILE auto-sharding: how many files the graph's file sources read (the largest source), and
  // the graph with every file source reading only its files i, i + n, ... (nullptr when a node
  // on the way cannot be copied).
  virtual std::int64_t source_files() const;
  virtual std::shared_ptr<const Node> shard_files(std::int64_t n, std::int64_t i) const;

  std::string fingerprint() const;
  // This node's part of the fingerprint: describe(), unless that names something a resumed pass
  // may change without changing the elements (prefetch_to_device's device: each worker's own).
  virtual std::string fingerprint_text() const { return describe(); }
  // The first reason found anywhere in the graph, or "".
  std::string graph_not_replayable(const Options& options) const;
  const Options& options() const { return options_; }
  std::int64_t next_iteration() const { return iterations_.fetch_add(1); }
  void continue_after(std::int64_t iteration) const;

 private:
  Options options_;
  mutable std::atomic<std::int64_t> iterations_{0};
};

using NodePtr = std::shared_ptr<const Node>;

// Mixes a seed with iteration numbers into a new 64-bit seed (splitmix64).
std::uint64_t mix_seed(std::uint64_t seed, std::uint64_t a, std::uint64_t b = 0);

} // namespace flotilla::data::detail
