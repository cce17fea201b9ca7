// Datasets over files: list_files (a shardable list of paths) and interleave (several opened
// datasets read in turn, optionally each on its own thread).
#include <glob.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <random>
#include <thread>

#include "data/read_ahead.h"
#include "data/stages.h"
#include "flotilla/data/tfrecord.h"

namespace flotilla::data::detail {
namespace {

// --- list_files ---

class ListFilesStage : public PositionedStage {
 public:
  explicit ListFilesStage(std::vector<std::string> files)
      : PositionedStage("ListFiles", static_cast<std::int64_t>(files.size())),
        files_(std::move(files)) {}

 protected:
  Element at(std::size_t k) override { return Element{string_tensor(files_[k])}; }

 private:
  std::vector<std::string> files_;
};

class ListFilesNode : public FileSourceNode {
 public:
  ListFilesNode(std::vector<std::string> files, std::string pattern, bool shuffle, bool seeded,
                std::uint64_t seed, const Options& options)
      : FileSourceNode(std::move(files), options), pattern_(std::move(pattern)), shuffle_(shuffle),
        seeded_(seeded), seed_(seed) {}
  std::unique_ptr<Stage> make_iterator(const IteratorContext& ctx) const override {
    std::vector<std::string> order = files_;
    if (shuffle_) {
      std::mt19937_64 rng(mix_seed(seed_, static_cast<std::uint64_t>(ctx.iteration)));
      std::shuffle(order.begin(), order.end(), rng);
    }
    return std::make_unique<ListFilesStage>(std::move(order));
  }
  std::int64_t cardinality() const override { return static_cast<std::int64_t>(files_.size()); }
  std::string describe() const override {
    return "list_files(" + pattern_ + "," + std::to_string(shuffle_) + "," +
           (seeded_ ? std::to_string(seed_) : "unseeded") + "|" + describe_files() + ")";
  }
  std::string not_replayable(const Options&) const override {
    return !shuffle_ || seeded_ ? ""
                                : "list_files shuffles without a seed, a new order in every "
                                  "process; give it one";
  }
  NodePtr with_files(std::vector<std::string> files) const override {
    return std::make_shared<ListFilesNode>(std::move(files), pattern_, shuffle_, seeded_, seed_,
                                           options());
  }

 private:
  std::string pattern_;
  bool shuffle_, seeded_;
  std::uint64_t seed_;
};

// --- interleave ---

// One open dataset of the cycle, read ahead on its own thread when parallel.
class Child {
 public:
  Child(std::unique_ptr<Stage> stage, bool parallel, std::int64_t ahead)
      : stage_(std::move(stage)) {
    if (parallel) reader_ = std::make_unique<ReadAhead>(*stage_, [ahead] { return ahead; });
  }
  ~Child() { reader_.reset(); }  // the thread stops before the stage it reads
  // The child's next element, nullopt at its end; rethrows an error in its place.
  std::optional<Element> next() { return reader_ ? reader_->next() : stage_->next(); }
  // Without waiting: whether next() would not block (for deterministic=false).
  bool ready() { return !reader_ || reader_->ready(); }

 private:
  std::unique_ptr<Stage> stage_;
  std::unique_ptr<ReadAhead> reader_;
};

class InterleaveStage : public UnaryStage {
 public:
  InterleaveStage(std::unique_ptr<Stage> input, InterleaveFn fn, std::int64_t cycle,
                  std::int64_t block, bool parallel, bool deterministic, IteratorContext ctx)
      : UnaryStage("Interleave", std::move(input)), fn_(std::move(fn)), cycle_(cycle),
        block_(block), parallel_(parallel), deterministic_(deterministic), ctx_(std::move(ctx)),
        slots_(static_cast<std::size_t>(cycle)) {}

 protected:
  std::optional<Element> produce() override {
    for (;;) {
      fill();
      if (open_ == 0) return std::nullopt;
      if (!deterministic_) pick_ready();
      auto& slot = slots_[current_];
      if (slot.child) {
        if (auto e = slot.child->next()) {
          if (++slot.taken >= block_) advance();
          return e;
        }
        slot.child.reset(); // this one is done: another input element takes its place
        --open_;
      }
      advance();
    }
  }

 private:
  struct Slot {
    std::unique_ptr<Child> child;
    std::int64_t taken = 0;
  };
  void advance() {
    slots_[current_].taken = 0;
    current_ = (current_ + 1) % slots_.size();
  }
  // Opens datasets for empty slots while the input has elements.
  void fill() {
    for (auto& slot : slots_) {
      if (slot.child || input_done_) continue;
      auto e = input_->next();
      if (!e) {
        input_done_ = true;
        break;
      }
      const std::int64_t index = index_++;
      Dataset child(nullptr);
      try {
        child = fn_(*e);
      } catch (...) {
        throw DataError("interleave function failed on element " + std::to_string(index) + ": " +
                        describe_exception(std::current_exception()));
      }
      slot.child =
          std::make_unique<Child>(child.node()->make_iterator(ctx_), parallel_, 2 * block_);
      slot.taken = 0;
      ++open_;
    }
  }
  // deterministic=false: move to the first slot with an element ready, if any.
  void pick_ready() {
    for (std::size_t k = 0; k < slots_.size(); ++k) {
      const std::size_t s = (current_ + k) % slots_.size();
      if (slots_[s].child && slots_[s].child->ready()) {
        if (s != current_) slots_[current_].taken = 0;
        current_ = s;
        return;
      }
    }
  }

  InterleaveFn fn_;
  std::int64_t cycle_, block_;
  bool parallel_, deterministic_;
  IteratorContext ctx_;
  std::vector<Slot> slots_;
  std::size_t current_ = 0;
  std::int64_t open_ = 0;
  std::int64_t index_ = 0;
  bool input_done_ = false;
};

class InterleaveNode : public UnaryNode {
 public:
  InterleaveNode(NodePtr input, InterleaveFn fn, std::int64_t cycle, std::int64_t block,
                 std::int64_t parallel, std::optional<bool> deterministic)
      : UnaryNode(std::move(input)), fn_(std::move(fn)), cycle_(cycle), block_(block),
        parallel_(parallel), deterministic_(deterministic) {}
  std::unique_ptr<Stage> make_iterator(const IteratorContext& ctx) const override {
    return std::make_unique<InterleaveStage>(
        input_->make_iterator(ctx), fn_, cycle_, block_, parallel_ != 1,
        deterministic_.value_or(ctx.options.deterministic), ctx);
  }
  std::int64_t cardinality() const override { return kUnknownCardinality; }
  std::string describe() const override {
    return "interleave(" + std::to_string(cycle_) + "," + std::to_string(block_) + "," +
           std::to_string(parallel_) + ")";
  }
  std::string not_replayable(const Options& options) const override {
    return parallel_ == 1 || deterministic_.value_or(options.deterministic)
               ? ""
               : "a parallel interleave with deterministic=false may reorder elements";
  }
  NodePtr with_inputs(std::vector<NodePtr> inputs) const override {
    return std::make_shared<InterleaveNode>(inputs.at(0), fn_, cycle_, block_, parallel_,
                                            deterministic_);
  }

 private:
  InterleaveFn fn_;
  std::int64_t cycle_, block_, parallel_;
  std::optional<bool> deterministic_;
};

} // namespace

NodePtr make_list_files(const std::string& pattern, bool shuffle, std::optional<std::uint64_t> seed,
                        const Options& options) {
  glob_t found{};
  const int rc = ::glob(pattern.c_str(), 0, nullptr, &found);
  std::vector<std::string> files;
  for (std::size_t i = 0; rc == 0 && i < found.gl_pathc; ++i) files.emplace_back(found.gl_pathv[i]);
  ::globfree(&found);
  if (files.empty()) {
    throw DataError("list_files: pattern \"" + pattern +
                    "\" matched no files; check the directory and the pattern");
  }
  std::sort(files.begin(), files.end());
  return std::make_shared<ListFilesNode>(std::move(files), pattern, shuffle, seed.has_value(),
                                         seed ? *seed : std::random_device{}(), options);
}

NodePtr make_interleave(NodePtr input, InterleaveFn fn, std::int64_t cycle_length,
                        std::int64_t block_length, std::int64_t num_parallel_calls,
                        std::optional<bool> deterministic) {
  if (!fn) throw ConfigError("interleave needs a function; saw an empty one");
  if (cycle_length < 1) {
    throw ConfigError("interleave cycle_length must be at least 1; saw " +
                      std::to_string(cycle_length));
  }
  if (block_length < 1) {
    throw ConfigError("interleave block_length must be at least 1; saw " +
                      std::to_string(block_length));
  }
  if (num_parallel_calls < 1 && num_parallel_calls != kAutotune) {
    throw ConfigError("interleave num_parallel_calls must be at least 1 or kAutotune; saw " +
                      std::to_string(num_parallel_calls));
  }
  return std::make_shared<InterleaveNode>(std::move(input), std::move(fn), cycle_length,
                                          block_length, num_parallel_calls, deterministic);
}

} // namespace flotilla::data::detail
