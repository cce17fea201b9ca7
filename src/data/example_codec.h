// Private: tf.train.Example to and from plain C++ values. Compiled apart from LibTorch, whose
// wheel carries its own, older protobuf headers that must not meet the system's.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace flotilla::data::detail {

struct FeatureValues {
  enum class Kind { kNone, kBytes, kFloat, kInt64 } kind = Kind::kNone;
  std::vector<std::string> bytes;
  std::vector<float> floats;
  std::vector<std::int64_t> ints;
};

// False if `serialized` is not a tf.train.Example.
bool decode_example(const std::string& serialized, std::map<std::string, FeatureValues>& out);
std::string encode_example(const std::map<std::string, FeatureValues>& features);

} // namespace flotilla::data::detail
