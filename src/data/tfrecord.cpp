#include "flotilla/data/tfrecord.h"

#include <cstring>

#include "data/example_codec.h"
#include "data/stages.h"
#include "flotilla/base/atomic_file.h"
#include "flotilla/base/tfrecord_framing.h"
#include "flotilla/error.h"

namespace flotilla::data {
namespace {

std::string type_name(FeatureType t) {
  switch (t) {
  case FeatureType::kInt64:
    return "int64";
  case FeatureType::kFloat:
    return "float";
  case FeatureType::kBytes:
    return "bytes";
  }
  return "?";
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  return c10::str(c10::IntArrayRef(shape));
}

std::int64_t numel_of(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

using Kind = detail::FeatureValues::Kind;

const char* kind_name(Kind k) {
  switch (k) {
  case Kind::kInt64:
    return "int64";
  case Kind::kFloat:
    return "float";
  case Kind::kBytes:
    return "bytes";
  case Kind::kNone:
    return "empty";
  }
  return "?";
}

torch::Tensor feature_tensor(const detail::FeatureValues& f, const FixedLenFeature& spec,
                             const std::string& where) {
  const std::string head = where + ": feature \"" + spec.name + "\" ";
  const std::int64_t want = numel_of(spec.shape);
  auto check_count = [&](std::size_t have, const char* what) {
    if (static_cast<std::int64_t>(have) != want) {
      throw DataError(head + "has " + std::to_string(have) + " " + what +
                      " values; the spec's shape " + shape_text(spec.shape) + " needs " +
                      std::to_string(want));
    }
  };
  if (spec.type == FeatureType::kInt64 && f.kind == Kind::kInt64) {
    check_count(f.ints.size(), "int64");
    torch::Tensor t = torch::empty(spec.shape, torch::kInt64);
    std::memcpy(t.data_ptr(), f.ints.data(), f.ints.size() * sizeof(std::int64_t));
    return t;
  }
  if (spec.type == FeatureType::kFloat && f.kind == Kind::kFloat) {
    check_count(f.floats.size(), "float");
    torch::Tensor t = torch::empty(spec.shape, torch::kFloat32);
    std::memcpy(t.data_ptr(), f.floats.data(), f.floats.size() * sizeof(float));
    return t;
  }
  if (spec.type == FeatureType::kBytes && f.kind == Kind::kBytes) {
    if (f.bytes.size() != 1) {
      throw DataError(head + "has " + std::to_string(f.bytes.size()) +
                      " bytes values; a bytes feature holds exactly one");
    }
    return string_tensor(f.bytes.front());
  }
  throw DataError(head + "holds a " + std::string(kind_name(f.kind)) + " list; the spec expects " +
                  type_name(spec.type));
}

} // namespace

Element parse_example(const std::string& serialized, const FeatureSpec& spec,
                      const std::string& where) {
  std::map<std::string, detail::FeatureValues> features;
  if (!detail::decode_example(serialized, features)) {
    throw DataError(where + ": is not a serialized tf.train.Example (" +
                    std::to_string(serialized.size()) + " bytes)");
  }
  Element out;
  out.reserve(spec.size());
  for (const auto& s : spec) {
    auto it = features.find(s.name);
    if (it != features.end()) {
      out.push_back(feature_tensor(it->second, s, where));
    } else if (s.default_value) {
      out.push_back(s.default_value->clone());
    } else {
      std::string present;
      for (const auto& [name, value] : features) present += (present.empty() ? "" : ", ") + name;
      throw DataError(where + ": feature \"" + s.name +
                      "\" is missing and has no default; the Example has: " +
                      (present.empty() ? "no features" : present) +
                      ". Give the spec a default_value or fix the writer");
    }
  }
  return out;
}

std::string serialize_example(const std::map<std::string, torch::Tensor>& features) {
  std::map<std::string, detail::FeatureValues> values;
  for (const auto& [name, tensor] : features) {
    const torch::Tensor t = tensor.contiguous().cpu().reshape({-1});
    detail::FeatureValues& v = values[name];
    if (t.scalar_type() == torch::kInt64) {
      v.kind = Kind::kInt64;
      v.ints.assign(t.data_ptr<std::int64_t>(), t.data_ptr<std::int64_t>() + t.numel());
    } else if (t.scalar_type() == torch::kFloat32) {
      v.kind = Kind::kFloat;
      v.floats.assign(t.data_ptr<float>(), t.data_ptr<float>() + t.numel());
    } else if (t.scalar_type() == torch::kUInt8) {
      v.kind = Kind::kBytes;
      v.bytes.push_back(to_string(t));
    } else {
      throw DataError("serialize_example: feature \"" + name + "\" has dtype " +
                      std::string(c10::toString(t.scalar_type())) +
                      "; tf.train.Example holds int64, float32 or bytes (uint8)");
    }
  }
  return detail::encode_example(values);
}

torch::Tensor string_tensor(const std::string& s) {
  torch::Tensor t = torch::empty({static_cast<std::int64_t>(s.size())}, torch::kUInt8);
  std::memcpy(t.data_ptr(), s.data(), s.size());
  return t;
}

std::string to_string(const torch::Tensor& bytes) {
  const torch::Tensor t = bytes.contiguous().cpu();
  if (t.scalar_type() != torch::kUInt8) {
    throw DataError("to_string needs a uint8 tensor of bytes; saw " +
                    std::string(c10::toString(t.scalar_type())));
  }
  return std::string(static_cast<const char*>(t.data_ptr()), static_cast<std::size_t>(t.numel()));
}

// --- framing ---

TFRecordReader::TFRecordReader(std::string path)
    : path_(std::move(path)), in_(path_, std::ios::binary) {
  if (!in_) throw DataError(path_ + ": cannot open it; check the path");
}

std::optional<std::string> TFRecordReader::next() {
  auto record = base::read_tfrecord(in_, path_ + ": record " + std::to_string(index_));
  if (record) ++index_;
  return record;
}

TFRecordWriter::TFRecordWriter(const std::string& path)
    : file_(std::make_unique<base::AtomicFile>(path)) {}
TFRecordWriter::~TFRecordWriter() = default;

void TFRecordWriter::write(const std::string& record) {
  if (!file_) throw DataError("TFRecordWriter: write after close()");
  const base::TFRecordFrame frame = base::tfrecord_frame(record);
  file_->write(frame.header, sizeof frame.header);
  file_->write(record);
  file_->write(frame.footer, sizeof frame.footer);
}

void TFRecordWriter::close() {
  if (file_) file_->commit();
  file_.reset();
}

// --- the dataset ---

namespace detail {
namespace {

class TFRecordStage : public Stage {
 public:
  TFRecordStage(std::vector<std::string> files, std::optional<FeatureSpec> spec)
      : Stage(spec ? "TFRecord(parsed)" : "TFRecord"), files_(std::move(files)),
        spec_(std::move(spec)) {}
  std::int64_t skip(std::int64_t n) override {
    std::int64_t moved = 0;
    while (moved < n && read()) ++moved; // framing is checked; parsing is not needed
    return moved;
  }

 protected:
  std::optional<Element> produce() override {
    auto record = read();
    if (!record) return std::nullopt;
    if (!spec_) return Element{string_tensor(*record)};
    return parse_example(*record, *spec_,
                         reader_->path() + ": record " +
                             std::to_string(reader_->records_read() - 1));
  }

 private:
  std::optional<std::string> read() {
    for (;;) {
      if (!reader_) {
        if (next_file_ >= files_.size()) return std::nullopt;
        reader_ = std::make_unique<TFRecordReader>(files_[next_file_++]);
      }
      if (auto r = reader_->next()) return r;
      reader_.reset();
    }
  }

  std::vector<std::string> files_;
  std::optional<FeatureSpec> spec_;
  std::size_t next_file_ = 0;
  std::unique_ptr<TFRecordReader> reader_;
};

class TFRecordNode : public FileSourceNode {
 public:
  TFRecordNode(std::vector<std::string> files, std::optional<FeatureSpec> spec, const Options& o)
      : FileSourceNode(std::move(files), o), spec_(std::move(spec)) {}
  std::unique_ptr<Stage> make_iterator(const IteratorContext&) const override {
    return std::make_unique<TFRecordStage>(files_, spec_);
  }
  std::string describe() const override {
    std::string spec;
    if (spec_) {
      for (const auto& f : *spec_) {
        spec += f.name + ":" + type_name(f.type) + shape_text(f.shape) +
                (f.default_value ? "=d" : "") + ";";
      }
    }
    return "tfrecord(" + describe_files() + "|" + spec + ")";
  }
  NodePtr with_files(std::vector<std::string> files) const override {
    return std::make_shared<TFRecordNode>(std::move(files), spec_, options());
  }

 private:
  std::optional<FeatureSpec> spec_;
};

} // namespace
} // namespace detail

Dataset tfrecord_dataset(const std::vector<std::string>& files) {
  return Dataset(std::make_shared<detail::TFRecordNode>(files, std::nullopt, Options{}));
}

Dataset tfrecord_dataset(const std::vector<std::string>& files, const FeatureSpec& spec) {
  for (const auto& f : spec) {
    if (f.type == FeatureType::kBytes && !f.shape.empty()) {
      throw ConfigError("feature \"" + f.name +
                        "\": a bytes feature holds one value; give it "
                        "shape {} and decode it in a map");
    }
    if (f.default_value && f.type != FeatureType::kBytes &&
        f.default_value->sizes() != c10::IntArrayRef(f.shape)) {
      throw ConfigError("feature \"" + f.name + "\": default_value has shape " +
                        c10::str(f.default_value->sizes()) + ", the spec says " +
                        shape_text(f.shape));
    }
  }
  return Dataset(std::make_shared<detail::TFRecordNode>(files, spec, Options{}));
}

} // namespace flotilla::data
