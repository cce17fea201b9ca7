// Stages that hold elements: shuffle (a seeded buffer), prefetch (a producer thread ahead of the
// consumer), cache (a first pass kept in memory or in a file for the passes after it).
#include <sys/stat.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdio>
#include <deque>
#include <random>
#include <thread>

#include "data/cache_format.h"
#include "data/read_ahead.h"
#include "data/stages.h"
#include "data/tuner.h"
#include "flotilla/base/atomic_file.h"
#include "flotilla/log.h"

namespace flotilla::data::detail {
namespace {

// --- shuffle ---

class ShuffleStage : public UnaryStage {
 public:
  ShuffleStage(std::unique_ptr<Stage> input, std::int64_t buffer_size, std::uint64_t seed)
      : UnaryStage("Shuffle", std::move(input)), buffer_size_(buffer_size), rng_(seed) {}

 protected:
  std::optional<Element> produce() override {
    return draw(buffer_, [this] { return input_->next(); });
  }
  // The same algorithm over row numbers: the same draws, so the same order as elements.
  std::optional<std::int64_t> produce_row() override {
    return draw(row_buffer_, [this] { return input_->next_row(); });
  }
  void fill(StageStats& s) const override { s.buffer_size = buffer_size_; }

 public:
  const Element* rows() override {
    const Element* below = input_->rows();
    if (below) row_mode_ = true;
    return below;
  }

 private:
  // As tf.data: a uniformly chosen buffered item leaves; the next input takes its place.
  template <class T, class Pull> std::optional<T> draw(std::vector<T>& buffer, Pull pull) {
    while (!input_done_ && static_cast<std::int64_t>(buffer.size()) < buffer_size_) {
      auto item = pull();
      if (!item) {
        input_done_ = true;
        break;
      }
      buffer.push_back(std::move(*item));
    }
    if (buffer.empty()) return std::nullopt;
    const std::size_t pick = static_cast<std::size_t>(rng_() % buffer.size());
    T out = std::move(buffer[pick]);
    if (auto item = input_done_ ? std::optional<T>() : pull()) {
      buffer[pick] = std::move(*item);
    } else {
      input_done_ = true;
      buffer[pick] = std::move(buffer.back());
      buffer.pop_back();
    }
    return out;
  }

  std::int64_t buffer_size_;
  std::mt19937_64 rng_;
  std::vector<Element> buffer_;          // element path
  std::vector<std::int64_t> row_buffer_; // row mode
  bool input_done_ = false;
};

class ShuffleNode : public UnaryNode {
 public:
  ShuffleNode(NodePtr input, std::int64_t buffer_size, std::optional<std::uint64_t> seed,
              bool reshuffle)
      : UnaryNode(std::move(input)), buffer_size_(buffer_size), seeded_(seed.has_value()),
        seed_(seed ? *seed : std::random_device{}()), reshuffle_(reshuffle) {
    if (buffer_size < 1) {
      throw ConfigError("shuffle buffer_size must be at least 1; saw " +
                        std::to_string(buffer_size) + " (1 keeps the order)");
    }
  }
  std::unique_ptr<Stage> make_iterator(const IteratorContext& ctx) const override {
    const std::uint64_t seed =
        mix_seed(seed_, reshuffle_ ? static_cast<std::uint64_t>(ctx.iteration) : 0);
    return std::make_unique<ShuffleStage>(input_->make_iterator(ctx), buffer_size_, seed);
  }
  std::int64_t cardinality() const override { return input_->cardinality(); }
  std::string describe() const override {
    return "shuffle(" + std::to_string(buffer_size_) + "," +
           (seeded_ ? std::to_string(seed_) : "unseeded") + "," + std::to_string(reshuffle_) + ")";
  }
  NodePtr with_inputs(std::vector<NodePtr> inputs) const override {
    return std::make_shared<ShuffleNode>(
        inputs.at(0), buffer_size_, seeded_ ? std::optional<std::uint64_t>(seed_) : std::nullopt,
        reshuffle_);
  }
  std::string not_replayable(const Options&) const override {
    return seeded_ ? ""
                   : "a shuffle without a seed draws a new order in every process; give it one";
  }

 private:
  std::int64_t buffer_size_;
  bool seeded_;
  std::uint64_t seed_;
  bool reshuffle_;
};

// --- prefetch ---

class PrefetchStage : public UnaryStage {
 public:
  PrefetchStage(std::unique_ptr<Stage> input, std::int64_t buffer_size, const IteratorContext& ctx)
      : UnaryStage("Prefetch", std::move(input)), autotuned_(buffer_size == kAutotune),
        tuner_(ctx.tuner), knob_(autotuned_ ? 2 : buffer_size, autotuned_ ? 64 : buffer_size, 0),
        reader_(
            *input_, [this] { return knob_.value(); }, &knob_.counters(),
            [this](const Element& e) { knob_.observe_element_bytes(element_bytes(e)); }) {
    if (autotuned_) tuner_->add(&knob_);
  }
  ~PrefetchStage() override {
    if (autotuned_) tuner_->remove(&knob_);
  } // reader_ stops its thread before input_ goes
  std::int64_t skip(std::int64_t n) override {
    if (reader_.started()) return Stage::skip(n);
    return input_->skip(n);
  }

 protected:
  std::optional<Element> produce() override { return reader_.next(); }
  void fill(StageStats& s) const override {
    s.buffer_size = knob_.value();
    s.autotuned = autotuned_;
    s.consumer_wait_share = share(knob_.counters().consumer_wait_total_ns.load());
  }

 private:
  const bool autotuned_;
  std::shared_ptr<Tuner> tuner_;
  Knob knob_;
  ReadAhead reader_;
};

class PrefetchNode : public UnaryNode {
 public:
  PrefetchNode(NodePtr input, std::int64_t size) : UnaryNode(std::move(input)), size_(size) {
    if (size < 0 && size != kAutotune) {
      throw ConfigError("prefetch buffer_size must be at least 0 or kAutotune; saw " +
                        std::to_string(size));
    }
  }
  std::unique_ptr<Stage> make_iterator(const IteratorContext& ctx) const override {
    auto in = input_->make_iterator(ctx);
    if (size_ == 0) return in; // tf.data: prefetch(0) does nothing
    return std::make_unique<PrefetchStage>(std::move(in), size_, ctx);
  }
  std::int64_t cardinality() const override { return input_->cardinality(); }
  std::string describe() const override { return "prefetch"; }
  bool preserves_order(const Options&) const override { return true; }
  NodePtr with_inputs(std::vector<NodePtr> inputs) const override {
    return std::make_shared<PrefetchNode>(inputs.at(0), size_);
  }

 private:
  std::int64_t size_;
};

// --- cache in memory ---

struct MemoryCache {
  std::mutex mutex;
  std::vector<Element> elements;
  bool complete = false;
  bool filling = false;
};

class MemoryReplayStage : public PositionedStage {
 public:
  explicit MemoryReplayStage(std::shared_ptr<MemoryCache> cache)
      : PositionedStage("Cache(read)", static_cast<std::int64_t>(cache->elements.size())),
        cache_(std::move(cache)) {}

 protected:
  Element at(std::size_t k) override { return cache_->elements[k]; }

 private:
  std::shared_ptr<MemoryCache> cache_; // complete, so read without the lock
};

class MemoryFillStage : public UnaryStage {
 public:
  MemoryFillStage(std::unique_ptr<Stage> input, std::shared_ptr<MemoryCache> cache)
      : UnaryStage("Cache(fill)", std::move(input)), cache_(std::move(cache)) {}
  ~MemoryFillStage() override {
    // A pass that stopped early leaves no partial cache behind (as tf.data): the next pass
    // fills it again.
    std::lock_guard<std::mutex> lock(cache_->mutex);
    cache_->filling = false;
  }

 protected:
  std::optional<Element> produce() override {
    auto e = input_->next();
    if (e) {
      pending_.push_back(*e);
    } else {
      std::lock_guard<std::mutex> lock(cache_->mutex);
      cache_->elements = std::move(pending_);
      cache_->complete = true;
    }
    return e;
  }

 private:
  std::shared_ptr<MemoryCache> cache_;
  std::vector<Element> pending_;
};

// --- cache in a file (its layout and reader: cache_format.h) ---

std::size_t element_size(std::int8_t code) {
  const auto dtype = static_cast<torch::ScalarType>(code);
  if (code < 0 || code >= static_cast<int>(torch::ScalarType::NumOptions) ||
      dtype == torch::ScalarType::Undefined || c10::isQIntType(dtype)) {
    return 0;
  }
  try {
    return c10::elementSize(dtype);
  } catch (const c10::Error&) {
    return 0; // a code LibTorch knows but cannot size: no cached tensor has it
  }
}

class FileReplayStage : public Stage {
 public:
  explicit FileReplayStage(const std::string& path)
      : Stage("Cache(file read)"), in_(CacheReader::open(path, element_size)),
        fingerprint_(in_.fingerprint()) {}
  // The fingerprint of the file actually opened (another process may have replaced it since
  // it was checked).
  const std::string& fingerprint() const { return fingerprint_; }

 protected:
  std::optional<Element> produce() override {
    const auto arity = in_.next_arity();
    if (!arity) return std::nullopt; // the count marker
    Element out;
    for (std::uint32_t i = 0; i < *arity; ++i) {
      const CacheTensorHeader h = in_.tensor_header();
      torch::Tensor t = torch::empty(h.dims, static_cast<torch::ScalarType>(h.dtype));
      in_.read_into(t.data_ptr(), static_cast<std::size_t>(h.bytes));
      out.push_back(std::move(t));
    }
    return out;
  }

 private:
  CacheReader in_;
  std::string fingerprint_;
};

class FileFillStage : public UnaryStage {
 public:
  FileFillStage(std::unique_ptr<Stage> input, const std::string& path, std::string fingerprint)
      : UnaryStage("Cache(file write)", std::move(input)),
        file_(std::make_unique<base::AtomicFile>(path)) {
    file_->write(kCacheMagic, sizeof(kCacheMagic) - 1);
    put<std::uint64_t>(fingerprint.size());
    file_->write(fingerprint);
  }

 protected:
  std::optional<Element> produce() override {
    auto e = input_->next();
    if (!file_) return e;
    if (!e) {
      put<std::uint32_t>(kCacheCountMarker);
      put<std::uint64_t>(static_cast<std::uint64_t>(count_));
      file_->write(kCacheEnd, sizeof(kCacheEnd) - 1);
      file_->commit(); // only now does the cache file appear, whole
      file_.reset();
      return e;
    }
    put<std::uint32_t>(static_cast<std::uint32_t>(e->size()));
    for (const auto& t : *e) {
      const torch::Tensor c = t.contiguous().cpu();
      put<std::int8_t>(static_cast<std::int8_t>(c.scalar_type()));
      put<std::uint8_t>(static_cast<std::uint8_t>(c.dim()));
      for (auto d : c.sizes()) put<std::int64_t>(d);
      const auto bytes = static_cast<std::uint64_t>(c.numel()) * c.element_size();
      put<std::uint64_t>(bytes);
      file_->write(c.data_ptr(), bytes);
    }
    ++count_;
    return e;
  }

 private:
  template <class T> void put(T v) { file_->write(&v, sizeof v); }
  std::unique_ptr<base::AtomicFile> file_; // removed unless the pass completes
  std::int64_t count_ = 0;
};

class CacheNode : public UnaryNode {
 public:
  CacheNode(NodePtr input, std::string filename)
      : UnaryNode(std::move(input)), filename_(std::move(filename)),
        memory_(std::make_shared<MemoryCache>()) {}

  std::unique_ptr<Stage> make_iterator(const IteratorContext& ctx) const override {
    if (!filename_.empty()) return make_file_iterator(ctx);
    std::lock_guard<std::mutex> lock(memory_->mutex);
    if (memory_->complete) return std::make_unique<MemoryReplayStage>(memory_);
    if (memory_->filling) return input_->make_iterator(ctx); // another pass is filling it
    memory_->filling = true;
    return std::make_unique<MemoryFillStage>(input_->make_iterator(ctx), memory_);
  }
  std::int64_t cardinality() const override { return input_->cardinality(); }
  std::string describe() const override { return "cache(" + filename_ + ")"; }
  NodePtr with_inputs(std::vector<NodePtr> inputs) const override {
    return std::make_shared<CacheNode>(inputs.at(0), filename_);
  }

 private:
  std::unique_ptr<Stage> make_file_iterator(const IteratorContext& ctx) const {
    const std::string path = filename_ + ".flotilla-cache";
    const std::string fingerprint = input_->fingerprint();
    const std::string found = cached_fingerprint(path);
    if (!found.empty() && found == fingerprint) {
      try {
        auto replay = std::make_unique<FileReplayStage>(path);
        if (replay->fingerprint() == fingerprint) return replay;
      } catch (const DataError&) {
        // replaced or truncated between the check and the open: rebuild below
      }
    }
    if (!found.empty()) {
      Logger().warn("cache file " + path +
                    " was made by a different pipeline or from different data; rebuilding it");
    }
    return std::make_unique<FileFillStage>(input_->make_iterator(ctx), path, fingerprint);
  }

  std::string filename_;
  std::shared_ptr<MemoryCache> memory_;
};

} // namespace

NodePtr make_shuffle(NodePtr input, std::int64_t buffer_size, std::optional<std::uint64_t> seed,
                     bool reshuffle_each_iteration) {
  return std::make_shared<ShuffleNode>(std::move(input), buffer_size, seed,
                                       reshuffle_each_iteration);
}
NodePtr make_prefetch(NodePtr input, std::int64_t buffer_size) {
  return std::make_shared<PrefetchNode>(std::move(input), buffer_size);
}
NodePtr make_cache(NodePtr input, const std::string& filename) {
  return std::make_shared<CacheNode>(std::move(input), filename);
}

} // namespace flotilla::data::detail
