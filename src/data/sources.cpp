// In-memory sources: tensor slices, whole tensors, integer ranges.
#include <c10/util/Exception.h>

#include <sys/stat.h>

#include <cstring>
#include <mutex>
#include <random>
#include <sstream>

#include "data/stages.h"
#include "flotilla/error.h"

namespace flotilla::data::detail {
namespace {

class SlicesStage : public Stage {
 public:
  SlicesStage(Element tensors, std::int64_t size)
      : Stage("TensorSlices"), tensors_(std::move(tensors)), size_(size) {}
  std::int64_t skip(std::int64_t n) override {
    const std::int64_t moved = std::min(n, size_ - position_);
    position_ += moved;
    return moved;
  }
  const Element* rows() override {
    row_mode_ = true;
    return &tensors_;
  }

 protected:
  std::optional<std::int64_t> produce_row() override {
    if (position_ >= size_) return std::nullopt;
    return position_++;
  }
  std::optional<Element> produce() override {
    if (position_ >= size_) return std::nullopt;
    Element out;
    out.reserve(tensors_.size());
    for (const auto& t : tensors_) out.push_back(t[position_]);
    ++position_;
    return out;
  }

 private:
  Element tensors_;
  std::int64_t size_;
  std::int64_t position_ = 0;
};

// Hashes the data once, on first use of the fingerprint.
class InMemoryNode : public Node {
 public:
  InMemoryNode(Element tensors, const Options& options)
      : Node(options), tensors_(std::move(tensors)) {}
  std::string content_hash() const {
    std::call_once(hashed_, [this] { hash_ = hash_tensors(tensors_); });
    return hash_;
  }

 protected:
  Element tensors_;

 private:
  mutable std::once_flag hashed_;
  mutable std::string hash_;
};

class SlicesNode : public InMemoryNode {
 public:
  // `identity`, when given, stands for the data in the fingerprint (files' paths, sizes, times).
  SlicesNode(Element tensors, const Options& options, std::string identity = "")
      : InMemoryNode(std::move(tensors), options), identity_(std::move(identity)) {
    if (tensors_.empty()) {
      throw ConfigError("from_tensor_slices needs at least one tensor; saw none");
    }
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      if (tensors_[i].dim() == 0) {
        throw ConfigError("from_tensor_slices: component " + std::to_string(i) +
                          " is a scalar; slicing needs a first dimension (use from_tensors)");
      }
      if (tensors_[i].size(0) != tensors_[0].size(0)) {
        throw ConfigError("from_tensor_slices: component " + std::to_string(i) + " has " +
                          std::to_string(tensors_[i].size(0)) + " rows, component 0 has " +
                          std::to_string(tensors_[0].size(0)) +
                          "; all need the same first dimension");
      }
    }
  }
  std::unique_ptr<Stage> make_iterator(const IteratorContext&) const override {
    return std::make_unique<SlicesStage>(tensors_, tensors_[0].size(0));
  }
  std::int64_t cardinality() const override { return tensors_[0].size(0); }
  std::string describe() const override {
    return "tensor_slices(" + (identity_.empty() ? content_hash() : identity_) + ")";
  }

 private:
  std::string identity_;
};

class TensorsNode : public InMemoryNode {
 public:
  using InMemoryNode::InMemoryNode;
  std::unique_ptr<Stage> make_iterator(const IteratorContext&) const override {
    // One element: a stack of one, unsqueezed, is the tensors themselves.
    std::vector<torch::Tensor> single;
    for (const auto& t : tensors_) single.push_back(t.unsqueeze(0));
    return std::make_unique<SlicesStage>(single, 1);
  }
  std::int64_t cardinality() const override { return 1; }
  std::string describe() const override { return "tensors(" + content_hash() + ")"; }
};

class RangeStage : public Stage {
 public:
  RangeStage(std::int64_t start, std::int64_t stop, std::int64_t step)
      : Stage("Range"), next_(start), stop_(stop), step_(step) {}
  std::int64_t skip(std::int64_t n) override {
    std::int64_t moved = 0;
    while (moved < n && more()) {
      next_ += step_;
      ++moved;
    }
    return moved;
  }

 protected:
  std::optional<Element> produce() override {
    if (!more()) return std::nullopt;
    Element out{torch::tensor(next_, torch::kInt64)};
    next_ += step_;
    return out;
  }

 private:
  bool more() const { return step_ > 0 ? next_ < stop_ : next_ > stop_; }
  std::int64_t next_, stop_, step_;
};

class RangeNode : public Node {
 public:
  RangeNode(std::int64_t start, std::int64_t stop, std::int64_t step, const Options& options)
      : Node(options), start_(start), stop_(stop), step_(step) {
    if (step == 0) throw ConfigError("range step must not be 0");
  }
  std::unique_ptr<Stage> make_iterator(const IteratorContext&) const override {
    return std::make_unique<RangeStage>(start_, stop_, step_);
  }
  std::int64_t cardinality() const override {
    const std::int64_t span = step_ > 0 ? stop_ - start_ : start_ - stop_;
    const std::int64_t step = step_ > 0 ? step_ : -step_;
    return span <= 0 ? 0 : (span + step - 1) / step;
  }
  std::string describe() const override {
    return "range(" + std::to_string(start_) + "," + std::to_string(stop_) + "," +
           std::to_string(step_) + ")";
  }

 private:
  std::int64_t start_, stop_, step_;
};

class RandomStage : public Stage {
 public:
  explicit RandomStage(std::uint64_t seed) : Stage("Random"), rng_(seed) {}
  std::int64_t skip(std::int64_t n) override {
    rng_.discard(static_cast<unsigned long long>(n));
    return n;
  }

 protected:
  std::optional<Element> produce() override {
    return Element{torch::tensor(static_cast<std::int64_t>(rng_() >> 1), torch::kInt64)};
  }

 private:
  std::mt19937_64 rng_;
};

class RandomNode : public Node {
 public:
  RandomNode(std::uint64_t seed, bool rerandomize, const Options& options)
      : Node(options), seed_(seed), rerandomize_(rerandomize) {}
  std::unique_ptr<Stage> make_iterator(const IteratorContext& ctx) const override {
    return std::make_unique<RandomStage>(
        mix_seed(seed_, rerandomize_ ? static_cast<std::uint64_t>(ctx.iteration) : 0));
  }
  std::int64_t cardinality() const override { return kInfiniteCardinality; }
  std::string describe() const override {
    return "random(" + std::to_string(seed_) + "," + std::to_string(rerandomize_) + ")";
  }
  // Seeds hold no data to divide: every worker's file shard may draw from the same stream.
  NodePtr shard_files(std::int64_t, std::int64_t) const override {
    return std::make_shared<RandomNode>(seed_, rerandomize_, options());
  }

 private:
  std::uint64_t seed_;
  bool rerandomize_;
};

} // namespace

std::string file_identity(const std::vector<std::string>& files) {
  std::string out;
  for (const auto& f : files) {
    struct stat info {};
    if (::stat(f.c_str(), &info) != 0) throw DataError(f + ": cannot stat it; check the path");
    out += f + ":" + std::to_string(info.st_size) + ":" + std::to_string(info.st_mtim.tv_sec) +
           "." + std::to_string(info.st_mtim.tv_nsec) + ";";
  }
  return out;
}

NodePtr make_random(std::uint64_t seed, bool rerandomize, const Options& options) {
  return std::make_shared<RandomNode>(seed, rerandomize, options);
}

NodePtr make_file_tensor_slices(Element tensors, const std::vector<std::string>& files,
                                const Options& options) {
  return std::make_shared<SlicesNode>(std::move(tensors), options, file_identity(files));
}

NodePtr make_tensor_slices(Element tensors, const Options& options) {
  return std::make_shared<SlicesNode>(std::move(tensors), options);
}
NodePtr make_tensors(Element tensors, const Options& options) {
  return std::make_shared<TensorsNode>(std::move(tensors), options);
}
NodePtr make_range(std::int64_t start, std::int64_t stop, std::int64_t step,
                   const Options& options) {
  return std::make_shared<RangeNode>(start, stop, step, options);
}

std::string hash_tensors(const Element& tensors) {
  // 64-bit multiply-xorshift over 8-byte words: fast enough for tens of MB, and any change of
  // content, dtype or shape changes it.
  std::uint64_t h = 0x9E3779B97F4A7C15ull;
  auto mix = [&](std::uint64_t v) {
    h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 31;
  };
  for (const auto& t : tensors) {
    const torch::Tensor c = t.contiguous().cpu();
    mix(static_cast<std::uint64_t>(c.scalar_type()));
    for (auto d : c.sizes()) mix(static_cast<std::uint64_t>(d));
    const auto* bytes = static_cast<const unsigned char*>(c.data_ptr());
    const std::size_t n = static_cast<std::size_t>(c.numel()) * c.element_size();
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      std::uint64_t word;
      std::memcpy(&word, bytes + i, 8);
      mix(word);
    }
    std::uint64_t tail = 0;
    std::memcpy(&tail, bytes + i, n - i);
    mix(tail ^ n);
  }
  std::ostringstream out;
  out << std::hex << h;
  return out.str();
}

std::int64_t element_bytes(const Element& e) {
  std::int64_t bytes = 0;
  for (const auto& t : e) bytes += t.numel() * static_cast<std::int64_t>(t.element_size());
  return bytes;
}

std::string describe_exception(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

} // namespace flotilla::data::detail
