// Element-wise and structural transformations that run on the consumer's thread: map with one
// call at a time, filter, repeat, take, skip, shard, enumerate, zip, concatenate, batch.
#include "data/stages.h"

#include "flotilla/error.h"

namespace flotilla::data::detail {
namespace {

// --- map (one call at a time) ---

class MapStage : public UnaryStage {
 public:
  MapStage(std::unique_ptr<Stage> input, MapFn fn)
      : UnaryStage("Map", std::move(input)), fn_(std::move(fn)) {}
  std::int64_t skip(std::int64_t n) override {
    const std::int64_t moved = input_->skip(n); // map functions are pure: nothing to run
    index_ += moved;
    return moved;
  }

 protected:
  std::optional<Element> produce() override {
    auto e = input_->next();
    if (!e) return std::nullopt;
    const std::int64_t index = index_++;
    try {
      return fn_(std::move(*e));
    } catch (...) {
      throw map_failure(index, std::current_exception());
    }
  }

 private:
  MapFn fn_;
  std::int64_t index_ = 0;
};

class MapNode : public UnaryNode {
 public:
  MapNode(NodePtr input, MapFn fn, std::int64_t parallel, std::optional<bool> deterministic)
      : UnaryNode(std::move(input)), fn_(std::move(fn)), parallel_(parallel),
        deterministic_(deterministic) {}
  std::unique_ptr<Stage> make_iterator(const IteratorContext& ctx) const override {
    auto in = input_->make_iterator(ctx);
    if (parallel_ == 1) return std::make_unique<MapStage>(std::move(in), fn_);
    return make_parallel_map(std::move(in), fn_, parallel_,
                             deterministic_.value_or(ctx.options.deterministic), ctx);
  }
  std::int64_t cardinality() const override { return input_->cardinality(); }
  std::string describe() const override {
    // A function has no stable identity: the position of this map in the pipeline is what the
    // fingerprint can say. Changing a map function without changing the pipeline's shape does
    // not change the fingerprint (documented on Dataset::cache).
    return "map(parallel=" + std::to_string(parallel_) + ")";
  }
  std::string not_replayable(const Options& options) const override {
    return parallel_ == 1 || deterministic_.value_or(options.deterministic)
               ? ""
               : "a parallel map with deterministic=false may reorder elements";
  }
  bool preserves_order(const Options& options) const override {
    return not_replayable(options).empty();
  }
  NodePtr with_inputs(std::vector<NodePtr> inputs) const override {
    return std::make_shared<MapNode>(inputs.at(0), fn_, parallel_, deterministic_);
  }

 private:
  MapFn fn_;
  std::int64_t parallel_;
  std::optional<bool> deterministic_;
};

// --- filter ---

class FilterStage : public UnaryStage {
 public:
  FilterStage(std::unique_ptr<Stage> input, PredicateFn predicate)
      : UnaryStage("Filter", std::move(input)), predicate_(std::move(predicate)) {}

 protected:
  std::optional<Element> produce() override {
    for (;;) {
      auto e = input_->next();
      if (!e) return std::nullopt;
      const std::int64_t index = index_++;
      bool keep = false;
      try {
        keep = predicate_(*e);
      } catch (...) {
        throw DataError("filter predicate failed on element " + std::to_string(index) + ": " +
                        describe_exception(std::current_exception()));
      }
      if (keep) return e;
    }
  }

 private:
  PredicateFn predicate_;
  std::int64_t index_ = 0;
};

class FilterNode : public UnaryNode {
 public:
  FilterNode(NodePtr input, PredicateFn p)
      : UnaryNode(std::move(input)), predicate_(std::move(p)) {}
  std::unique_ptr<Stage> make_iterator(const IteratorContext& ctx) const override {
    return std::make_unique<FilterStage>(input_->make_iterator(ctx), predicate_);
  }
  std::int64_t cardinality() const override {
    return input_->cardinality() == kInfiniteCardinality ? kInfiniteCardinality
                                                         : kUnknownCardinality;
  }
  std::string describe() const override { return "filter"; }
  NodePtr with_inputs(std::vector<NodePtr> inputs) const override {
    return std::make_shared<FilterNode>(inputs.at(0), predicate_);
  }

 private:
  PredicateFn predicate_;
};

// --- repeat ---

class RepeatStage : public Stage {
 public:
  RepeatStage(NodePtr input, IteratorContext ctx, std::int64_t count)
      : Stage("Repeat"), node_(std::move(input)), ctx_(std::move(ctx)), count_(count),
        pass_length_(node_->cardinality()) {
    start_pass();
  }
  std::int64_t skip(std::int64_t n) override {
    std::int64_t moved = 0;
    while (moved < n && current_) {
      // Whole passes of a known length are stepped over, not run: a pass's order depends only
      // on its number. (Running them made a resume cost time in proportion to the passes
      // before it: an endless stream resumed deep into a long training took seconds.) The
      // last pass of a counted repeat is still run, to end where it ends.
      if (produced_in_pass_ == 0 && pass_length_ > 0) {
        std::int64_t whole = (n - moved) / pass_length_;
        if (count_ >= 0) whole = std::min(whole, count_ - 1 - pass_);
        if (whole > 0) {
          pass_ += whole;
          moved += whole * pass_length_;
          start_pass();
          continue;
        }
      }
      const std::int64_t m = current_->skip(n - moved);
      moved += m;
      produced_in_pass_ += m;
      if (moved < n && !next_pass()) break;
    }
    return moved;
  }
  // Every pass is the same node's iteration, so its rows index the same tensors.
  const Element* rows() override {
    const Element* below = current_ ? current_->rows() : nullptr;
    if (!below) return nullptr;
    rows_ = *below;
    row_mode_ = true;
    return &rows_;
  }

 protected:
  std::optional<Element> produce() override {
    return from_passes([this] { return current_->next(); });
  }
  std::optional<std::int64_t> produce_row() override {
    return from_passes([this] { return current_->next_row(); });
  }
  // The current pass is replaced at pass boundaries, maybe on a prefetch thread, while the
  // consumer asks for stats: both hold the lock for that.
  void stats(std::vector<StageStats>& out) const override {
    {
      std::lock_guard<std::mutex> lock(swap_mutex_);
      if (current_) current_->stats(out);
    }
    StageStats s;
    s.name = name_;
    s.elements = elements_.load();
    out.push_back(s);
  }

 private:
  // The current pass's next item, moving on to new passes as they end.
  template <class Pull> auto from_passes(Pull pull) -> decltype(pull()) {
    while (current_) {
      if (auto item = pull()) {
        ++produced_in_pass_;
        return item;
      }
      if (!next_pass()) break;
    }
    return std::nullopt;
  }
  void start_pass() {
    IteratorContext inner = ctx_;
    // Each repetition is its own pass: a shuffle inside reshuffles, as in tf.data.
    inner.iteration = static_cast<std::int64_t>(
        mix_seed(static_cast<std::uint64_t>(ctx_.iteration), static_cast<std::uint64_t>(pass_)) >>
        1);
    auto next = node_->make_iterator(inner);
    if (row_mode_) {
      const Element* rows = next->rows();
      // The same node gives the same kind of stage every pass; the tensors are the same too.
      if (!rows) throw DataError("repeat: a pass could not continue in row mode (internal)");
      rows_ = *rows;
    }
    {
      std::lock_guard<std::mutex> lock(swap_mutex_);
      std::swap(current_, next);
    }
    produced_in_pass_ = 0;
  } // the finished pass is destroyed here, outside the lock
  bool next_pass() {
    // An empty pass would repeat forever without producing: end instead.
    if (produced_in_pass_ == 0 || (count_ >= 0 && pass_ + 1 >= count_)) {
      std::unique_ptr<Stage> done;
      std::lock_guard<std::mutex> lock(swap_mutex_);
      std::swap(current_, done);
      return false;
    }
    ++pass_;
    start_pass();
    return true;
  }

  NodePtr node_;
  IteratorContext ctx_;
  std::int64_t count_;
  std::int64_t pass_length_; // the input's cardinality: elements of every pass, when known
  std::int64_t pass_ = 0;
  std::int64_t produced_in_pass_ = 0;
  mutable std::mutex swap_mutex_;
  std::unique_ptr<Stage> current_;
  Element rows_; // in row mode: the tensors every pass's rows index
};

class RepeatNode : public UnaryNode {
 public:
  RepeatNode(NodePtr input, std::int64_t count) : UnaryNode(std::move(input)), count_(count) {}
  std::unique_ptr<Stage> make_iterator(const IteratorContext& ctx) const override {
    if (count_ == 0) return std::make_unique<EmptyStage>();
    return std::make_unique<RepeatStage>(input_, ctx, count_);
  }
  std::int64_t cardinality() const override {
    const std::int64_t c = input_->cardinality();
    if (count_ == 0 || c == 0) return 0;
    if (count_ < 0 || c == kInfiniteCardinality) return kInfiniteCardinality;
    return c == kUnknownCardinality ? kUnknownCardinality : c * count_;
  }
  std::string describe() const override { return "repeat(" + std::to_string(count_) + ")"; }
  // The rebatching under it records a size per batch it produces, in order, in every pass.
  bool preserves_order(const Options&) const override { return true; }
  NodePtr with_inputs(std::vector<NodePtr> inputs) const override {
    return std::make_shared<RepeatNode>(inputs.at(0), count_);
  }

 private:
  std::int64_t count_;
};

// --- take / skip ---

class TakeStage : public UnaryStage {
 public:
  TakeStage(std::unique_ptr<Stage> input, std::int64_t count)
      : UnaryStage("Take", std::move(input)), left_(count) {}
  std::int64_t skip(std::int64_t n) override {
    const std::int64_t moved = input_->skip(left_ < 0 ? n : std::min(n, left_));
    if (left_ >= 0) left_ -= moved;
    return moved;
  }

 protected:
  std::optional<Element> produce() override {
    if (left_ == 0) return std::nullopt;
    auto e = input_->next();
    if (e && left_ > 0) --left_;
    return e;
  }

 private:
  std::int64_t left_; // -1: no limit
};

class SkipStage : public UnaryStage {
 public:
  SkipStage(std::unique_ptr<Stage> input, std::int64_t count)
      : UnaryStage("Skip", std::move(input)), pending_(count) {}
  std::int64_t skip(std::int64_t n) override {
    settle();
    return input_->skip(n);
  }

 protected:
  std::optional<Element> produce() override {
    settle();
    return input_->next();
  }

 private:
  void settle() {
    if (pending_ < 0) {
      while (input_->skip(1 << 20) > 0) {
      }
    } else if (pending_ > 0) {
      input_->skip(pending_);
    }
    pending_ = 0;
  }
  std::int64_t pending_;
};

class TakeSkipNode : public UnaryNode {
 public:
  TakeSkipNode(NodePtr input, std::int64_t count, bool take)
      : UnaryNode(std::move(input)), count_(count), take_(take) {}
  std::unique_ptr<Stage> make_iterator(const IteratorContext& ctx) const override {
    auto in = input_->make_iterator(ctx);
    if (take_) return std::make_unique<TakeStage>(std::move(in), count_);
    return std::make_unique<SkipStage>(std::move(in), count_);
  }
  std::int64_t cardinality() const override {
    const std::int64_t c = input_->cardinality();
    if (take_) {
      if (count_ < 0) return c;
      if (c == kInfiniteCardinality) return count_;
      return c == kUnknownCardinality ? kUnknownCardinality : std::min(c, count_);
    }
    if (count_ < 0) return c == kInfiniteCardinality ? kInfiniteCardinality : 0;
    if (c < 0) return c;
    return std::max<std::int64_t>(0, c - count_);
  }
  std::string describe() const override {
    return std::string(take_ ? "take(" : "skip(") + std::to_string(count_) + ")";
  }
  NodePtr with_inputs(std::vector<NodePtr> inputs) const override {
    return std::make_shared<TakeSkipNode>(inputs.at(0), count_, take_);
  }
  // A skip moves its input without producing (no size is recorded); a take stops early.
  bool preserves_order(const Options&) const override { return true; }

 private:
  std::int64_t count_;
  bool take_;
};

// --- shard ---

class ShardStage : public UnaryStage {
 public:
  ShardStage(std::unique_ptr<Stage> input, std::int64_t n, std::int64_t index)
      : UnaryStage("Shard", std::move(input)), n_(n), index_(index) {}
  std::int64_t skip(std::int64_t m) override {
    std::int64_t moved = 0;
    while (moved < m && align()) {
      // Element k of ours is input element index_ + k·n: skip whole strides at once.
      const std::int64_t want = m - moved;
      const std::int64_t got = input_->skip(1 + (want - 1) * n_);
      moved += got > 0 ? 1 + (got - 1) / n_ : 0;
      position_ += got;
      if (got < 1 + (want - 1) * n_) break;
    }
    return moved;
  }

 protected:
  std::optional<Element> produce() override {
    if (!align()) return std::nullopt;
    auto e = input_->next();
    if (e) ++position_;
    return e;
  }

 private:
  // Moves the input to the next position that belongs to this shard.
  bool align() {
    const std::int64_t offset = ((index_ - position_) % n_ + n_) % n_;
    if (offset == 0) return true;
    const std::int64_t got = input_->skip(offset);
    position_ += got;
    return got == offset;
  }
  std::int64_t n_, index_;
  std::int64_t position_ = 0; // input elements consumed
};

class ShardNode : public UnaryNode {
 public:
  ShardNode(NodePtr input, std::int64_t n, std::int64_t index)
      : UnaryNode(std::move(input)), n_(n), index_(index) {
    if (n < 1) throw ConfigError("shard: num_shards must be at least 1; saw " + std::to_string(n));
    if (index < 0 || index >= n) {
      throw ConfigError("shard: index " + std::to_string(index) + " is out of range for " +
                        std::to_string(n) + " shards; use 0 to " + std::to_string(n - 1));
    }
  }
  std::unique_ptr<Stage> make_iterator(const IteratorContext& ctx) const override {
    return std::make_unique<ShardStage>(input_->make_iterator(ctx), n_, index_);
  }
  std::int64_t cardinality() const override {
    const std::int64_t c = input_->cardinality();
    if (c < 0) return c;
    return c <= index_ ? 0 : (c - index_ + n_ - 1) / n_;
  }
  std::string describe() const override {
    return "shard(" + std::to_string(n_) + "," + std::to_string(index_) + ")";
  }
  NodePtr with_inputs(std::vector<NodePtr> inputs) const override {
    return std::make_shared<ShardNode>(inputs.at(0), n_, index_);
  }

 private:
  std::int64_t n_, index_;
};

// --- enumerate ---

class EnumerateStage : public UnaryStage {
 public:
  EnumerateStage(std::unique_ptr<Stage> input, std::int64_t start)
      : UnaryStage("Enumerate", std::move(input)), next_(start) {}
  std::int64_t skip(std::int64_t n) override {
    const std::int64_t moved = input_->skip(n);
    next_ += moved;
    return moved;
  }

 protected:
  std::optional<Element> produce() override {
    auto e = input_->next();
    if (!e) return std::nullopt;
    e->insert(e->begin(), torch::tensor(next_++, torch::kInt64));
    return e;
  }

 private:
  std::int64_t next_;
};

class EnumerateNode : public UnaryNode {
 public:
  EnumerateNode(NodePtr input, std::int64_t start) : UnaryNode(std::move(input)), start_(start) {}
  std::unique_ptr<Stage> make_iterator(const IteratorContext& ctx) const override {
    return std::make_unique<EnumerateStage>(input_->make_iterator(ctx), start_);
  }
  std::int64_t cardinality() const override { return input_->cardinality(); }
  std::string describe() const override { return "enumerate(" + std::to_string(start_) + ")"; }
  bool preserves_order(const Options&) const override { return true; }
  NodePtr with_inputs(std::vector<NodePtr> inputs) const override {
    return std::make_shared<EnumerateNode>(inputs.at(0), start_);
  }

 private:
  std::int64_t start_;
};

// --- zip / concatenate ---

class ZipStage : public Stage {
 public:
  explicit ZipStage(std::vector<std::unique_ptr<Stage>> inputs)
      : Stage("Zip"), inputs_(std::move(inputs)) {}
  std::int64_t skip(std::int64_t n) override {
    std::int64_t moved = n;
    for (auto& in : inputs_) moved = std::min(moved, in->skip(n));
    return moved;
  }

 protected:
  std::optional<Element> produce() override {
    Element out;
    for (auto& in : inputs_) {
      auto e = in->next();
      if (!e) return std::nullopt;
      out.insert(out.end(), e->begin(), e->end());
    }
    return out;
  }
  std::vector<const Stage*> stat_inputs() const override {
    std::vector<const Stage*> out;
    for (const auto& in : inputs_) out.push_back(in.get());
    return out;
  }

 private:
  std::vector<std::unique_ptr<Stage>> inputs_;
};

class ZipNode : public Node {
 public:
  explicit ZipNode(std::vector<NodePtr> inputs)
      : Node(inputs.empty() ? Options{} : inputs.front()->options()), inputs_(std::move(inputs)) {
    if (inputs_.empty()) throw ConfigError("zip needs at least one dataset; saw none");
  }
  std::unique_ptr<Stage> make_iterator(const IteratorContext& ctx) const override {
    std::vector<std::unique_ptr<Stage>> stages;
    for (const auto& in : inputs_) stages.push_back(in->make_iterator(ctx));
    return std::make_unique<ZipStage>(std::move(stages));
  }
  std::int64_t cardinality() const override {
    std::int64_t out = kInfiniteCardinality;
    bool unknown = false;
    for (const auto& in : inputs_) {
      const std::int64_t c = in->cardinality();
      if (c == kUnknownCardinality) unknown = true;
      if (c >= 0) out = out < 0 ? c : std::min(out, c);
    }
    // tf.data: unknown if any input is unknown (a known count could end later than it says).
    return unknown ? kUnknownCardinality : out;
  }
  std::string describe() const override { return "zip(" + std::to_string(inputs_.size()) + ")"; }
  std::vector<NodePtr> inputs() const override { return inputs_; }
  bool preserves_order(const Options&) const override { return true; }
  NodePtr with_inputs(std::vector<NodePtr> inputs) const override {
    return std::make_shared<ZipNode>(std::move(inputs));
  }

 private:
  std::vector<NodePtr> inputs_;
};

class ConcatenateStage : public Stage {
 public:
  ConcatenateStage(std::unique_ptr<Stage> first, std::unique_ptr<Stage> second)
      : Stage("Concatenate"), first_(std::move(first)), second_(std::move(second)) {}
  std::int64_t skip(std::int64_t n) override {
    std::int64_t moved = first_done_ ? 0 : first_->skip(n);
    if (moved < n) {
      first_done_ = true;
      moved += second_->skip(n - moved);
    }
    return moved;
  }

 protected:
  std::optional<Element> produce() override {
    if (!first_done_) {
      if (auto e = first_->next()) return e;
      first_done_ = true;
    }
    return second_->next();
  }
  std::vector<const Stage*> stat_inputs() const override { return {first_.get(), second_.get()}; }

 private:
  std::unique_ptr<Stage> first_, second_;
  bool first_done_ = false;
};

class ConcatenateNode : public Node {
 public:
  ConcatenateNode(NodePtr first, NodePtr second)
      : Node(first->options()), first_(std::move(first)), second_(std::move(second)) {}
  std::unique_ptr<Stage> make_iterator(const IteratorContext& ctx) const override {
    return std::make_unique<ConcatenateStage>(first_->make_iterator(ctx),
                                              second_->make_iterator(ctx));
  }
  std::int64_t cardinality() const override {
    const std::int64_t a = first_->cardinality(), b = second_->cardinality();
    if (a == kInfiniteCardinality || b == kInfiniteCardinality) return kInfiniteCardinality;
    if (a < 0 || b < 0) return kUnknownCardinality;
    return a + b;
  }
  std::string describe() const override { return "concatenate"; }
  NodePtr with_inputs(std::vector<NodePtr> inputs) const override {
    return std::make_shared<ConcatenateNode>(inputs.at(0), inputs.at(1));
  }
  std::vector<NodePtr> inputs() const override { return {first_, second_}; }

 private:
  NodePtr first_, second_;
};

// --- with_options: changes the options the whole pipeline runs with; no stage of its own ---

class OptionsNode : public UnaryNode {
 public:
  OptionsNode(NodePtr input, const Options& options) : UnaryNode(std::move(input), options) {}
  std::unique_ptr<Stage> make_iterator(const IteratorContext& ctx) const override {
    return input_->make_iterator(ctx);
  }
  std::int64_t cardinality() const override { return input_->cardinality(); }
  std::string describe() const override { return "options"; }
  bool preserves_order(const Options&) const override { return true; }
  NodePtr with_inputs(std::vector<NodePtr> inputs) const override {
    return std::make_shared<OptionsNode>(inputs.at(0), options());
  }
};

// --- batch (one at a time) ---

class BatchStage : public UnaryStage {
 public:
  BatchStage(std::unique_ptr<Stage> input, std::int64_t size, bool drop)
      : UnaryStage("Batch", std::move(input)), size_(size), drop_(drop) {}
  std::int64_t skip(std::int64_t n) override {
    const std::int64_t moved = input_->skip(n * size_);
    const std::int64_t batches = moved / size_ + (!drop_ && moved % size_ != 0 ? 1 : 0);
    index_ += batches; // so an error names the right batch after a restore
    return batches;
  }

 protected:
  std::optional<Element> produce() override {
    std::vector<Element> parts;
    parts.reserve(static_cast<std::size_t>(size_));
    while (static_cast<std::int64_t>(parts.size()) < size_) {
      auto e = input_->next();
      if (!e) break;
      parts.push_back(std::move(*e));
    }
    if (parts.empty() || (drop_ && static_cast<std::int64_t>(parts.size()) < size_)) {
      return std::nullopt;
    }
    return stack_batch(parts, index_++);
  }

 private:
  std::int64_t size_;
  bool drop_;
  std::int64_t index_ = 0;
};

class BatchNode : public UnaryNode {
 public:
  BatchNode(NodePtr input, std::int64_t size, bool drop, std::int64_t parallel)
      : UnaryNode(std::move(input)), size_(size), drop_(drop), parallel_(parallel) {
    if (size < 1) {
      throw ConfigError("batch size must be at least 1; saw " + std::to_string(size));
    }
  }
  std::unique_ptr<Stage> make_iterator(const IteratorContext& ctx) const override {
    auto in = input_->make_iterator(ctx);
    if (parallel_ == 1) return std::make_unique<BatchStage>(std::move(in), size_, drop_);
    return make_parallel_batch(std::move(in), size_, drop_, parallel_, ctx);
  }
  std::int64_t cardinality() const override {
    const std::int64_t c = input_->cardinality();
    if (c < 0) return c;
    return drop_ ? c / size_ : (c + size_ - 1) / size_;
  }
  std::string describe() const override {
    return "batch(" + std::to_string(size_) + ",drop_remainder=" + std::to_string(drop_) + ")";
  }
  NodePtr with_inputs(std::vector<NodePtr> inputs) const override {
    return std::make_shared<BatchNode>(inputs.at(0), size_, drop_, parallel_);
  }
  std::int64_t batch_size() const { return size_; }
  bool drop_remainder() const { return drop_; }

 private:
  std::int64_t size_;
  bool drop_;
  std::int64_t parallel_;
};

} // namespace

DataError map_failure(std::int64_t index, std::exception_ptr error) {
  return DataError("map function failed on element " + std::to_string(index) +
                   " of this pass: " + describe_exception(error));
}

Element stack_batch(const std::vector<Element>& parts, std::int64_t batch_index) {
  const std::size_t arity = parts.front().size();
  Element out;
  out.reserve(arity);
  for (std::size_t c = 0; c < arity; ++c) {
    std::vector<torch::Tensor> column;
    column.reserve(parts.size());
    for (std::size_t k = 0; k < parts.size(); ++k) {
      if (parts[k].size() != arity) {
        throw DataError("batch " + std::to_string(batch_index) + ": element " + std::to_string(k) +
                        " has " + std::to_string(parts[k].size()) + " components, the first has " +
                        std::to_string(arity) + "; every element needs the same structure");
      }
      if (parts[k][c].sizes() != parts[0][c].sizes()) {
        throw DataError("batch " + std::to_string(batch_index) + ": component " +
                        std::to_string(c) + " of element " + std::to_string(k) + " has shape " +
                        c10::str(parts[k][c].sizes()) + ", the first element's has " +
                        c10::str(parts[0][c].sizes()) +
                        "; batching needs equal shapes: resize or pad them in a map first");
      }
      column.push_back(parts[k][c]);
    }
    out.push_back(torch::stack(column));
  }
  return out;
}

NodePtr make_map(NodePtr input, MapFn fn, std::int64_t num_parallel_calls,
                 std::optional<bool> deterministic) {
  if (!fn) throw ConfigError("map needs a function; saw an empty one");
  if (num_parallel_calls < 1 && num_parallel_calls != kAutotune) {
    throw ConfigError("map num_parallel_calls must be at least 1 or kAutotune; saw " +
                      std::to_string(num_parallel_calls));
  }
  return std::make_shared<MapNode>(std::move(input), std::move(fn), num_parallel_calls,
                                   deterministic);
}
NodePtr make_filter(NodePtr input, PredicateFn predicate) {
  if (!predicate) throw ConfigError("filter needs a predicate; saw an empty one");
  return std::make_shared<FilterNode>(std::move(input), std::move(predicate));
}
NodePtr make_batch(NodePtr input, std::int64_t batch_size, bool drop_remainder,
                   std::int64_t num_parallel_calls) {
  if (num_parallel_calls < 1 && num_parallel_calls != kAutotune) {
    throw ConfigError("batch num_parallel_calls must be at least 1 or kAutotune; saw " +
                      std::to_string(num_parallel_calls));
  }
  return std::make_shared<BatchNode>(std::move(input), batch_size, drop_remainder,
                                     num_parallel_calls);
}
NodePtr make_repeat(NodePtr input, std::int64_t count) {
  return std::make_shared<RepeatNode>(std::move(input), count < 0 ? -1 : count);
}
NodePtr make_take(NodePtr input, std::int64_t count) {
  return std::make_shared<TakeSkipNode>(std::move(input), count < 0 ? -1 : count, true);
}
NodePtr make_skip(NodePtr input, std::int64_t count) {
  return std::make_shared<TakeSkipNode>(std::move(input), count < 0 ? -1 : count, false);
}
NodePtr make_shard(NodePtr input, std::int64_t num_shards, std::int64_t index) {
  return std::make_shared<ShardNode>(std::move(input), num_shards, index);
}
NodePtr make_enumerate(NodePtr input, std::int64_t start) {
  return std::make_shared<EnumerateNode>(std::move(input), start);
}
NodePtr make_zip(std::vector<NodePtr> inputs) {
  return std::make_shared<ZipNode>(std::move(inputs));
}
NodePtr make_concatenate(NodePtr first, NodePtr second) {
  return std::make_shared<ConcatenateNode>(std::move(first), std::move(second));
}
NodePtr make_with_options(NodePtr input, const Options& options) {
  return std::make_shared<OptionsNode>(std::move(input), options);
}

bool is_batch(const Node& node, std::int64_t* size, bool* drop) {
  const auto* b = dynamic_cast<const BatchNode*>(&node);
  if (!b) return false;
  *size = b->batch_size();
  *drop = b->drop_remainder();
  return true;
}

} // namespace flotilla::data::detail
