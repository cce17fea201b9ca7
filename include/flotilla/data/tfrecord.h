// TFRecord files and tf.train.Example, the format TensorFlow pipelines store data in. Every
// record's framing (length, masked CRC-32C of the length, data, masked CRC-32C of the data) is
// verified as it is read; a parsed Example becomes tensors following a fixed-length feature
// spec, with defaults for absent features, as tf.io.parse_single_example does.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "flotilla/data/dataset.h"

namespace flotilla::base {
class AtomicFile;
}

namespace flotilla::data {

enum class FeatureType { kInt64, kFloat, kBytes };

// tf.io.FixedLenFeature. int64 and float features become tensors of `shape` (int64, float32);
// a bytes feature holds one value and becomes a uint8 tensor of its bytes.
struct FixedLenFeature {
  std::string name;
  FeatureType type = FeatureType::kFloat;
  std::vector<std::int64_t> shape = {};
  std::optional<torch::Tensor> default_value; // used when the Example lacks the feature
};
using FeatureSpec = std::vector<FixedLenFeature>;

// The spec's features of one serialized Example, in spec order. DataError names the feature and
// what was expected; `where` (e.g. "file.tfrecord: record 12") starts the message.
Element parse_example(const std::string& serialized, const FeatureSpec& spec,
                      const std::string& where = "Example");

// A serialized Example of int64, float32 or uint8 (bytes) tensors, flattened.
std::string serialize_example(const std::map<std::string, torch::Tensor>& features);

class TFRecordReader {
 public:
  explicit TFRecordReader(std::string path);
  // The next record, or nullopt at the end. DataError on a short file or a CRC mismatch.
  std::optional<std::string> next();
  std::int64_t records_read() const { return index_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::ifstream in_;
  std::int64_t index_ = 0;
};

// Writes atomically: the file appears, whole, on close().
class TFRecordWriter {
 public:
  explicit TFRecordWriter(const std::string& path);
  ~TFRecordWriter();
  void write(const std::string& record);
  void close();

 private:
  std::unique_ptr<base::AtomicFile> file_;
};

// tf.data.TFRecordDataset: the records of `files`, in order, as uint8 tensors...
Dataset tfrecord_dataset(const std::vector<std::string>& files);
// ...or parsed with `spec` as they are read (errors then name the file and record).
Dataset tfrecord_dataset(const std::vector<std::string>& files, const FeatureSpec& spec);

// Strings as uint8 tensors (file names in list_files, bytes features) and back.
torch::Tensor string_tensor(const std::string& s);
std::string to_string(const torch::Tensor& bytes);

} // namespace flotilla::data
