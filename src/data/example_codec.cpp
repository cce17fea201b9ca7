#include "data/example_codec.h"

#include "src/data/proto/example.pb.h"

namespace flotilla::data::detail {

bool decode_example(const std::string& serialized, std::map<std::string, FeatureValues>& out) {
  proto::Example example;
  if (!example.ParseFromString(serialized)) return false;
  out.clear();
  for (const auto& [name, f] : example.features().feature()) {
    FeatureValues& v = out[name];
    switch (f.kind_case()) {
    case proto::Feature::kBytesList:
      v.kind = FeatureValues::Kind::kBytes;
      v.bytes.assign(f.bytes_list().value().begin(), f.bytes_list().value().end());
      break;
    case proto::Feature::kFloatList:
      v.kind = FeatureValues::Kind::kFloat;
      v.floats.assign(f.float_list().value().begin(), f.float_list().value().end());
      break;
    case proto::Feature::kInt64List:
      v.kind = FeatureValues::Kind::kInt64;
      v.ints.assign(f.int64_list().value().begin(), f.int64_list().value().end());
      break;
    default:
      break;
    }
  }
  return true;
}

std::string encode_example(const std::map<std::string, FeatureValues>& features) {
  proto::Example example;
  auto* map = example.mutable_features()->mutable_feature();
  for (const auto& [name, v] : features) {
    proto::Feature& f = (*map)[name];
    switch (v.kind) {
    case FeatureValues::Kind::kBytes:
      for (const auto& b : v.bytes) f.mutable_bytes_list()->add_value(b);
      break;
    case FeatureValues::Kind::kFloat:
      f.mutable_float_list()->mutable_value()->Add(v.floats.begin(), v.floats.end());
      break;
    case FeatureValues::Kind::kInt64:
      f.mutable_int64_list()->mutable_value()->Add(v.ints.begin(), v.ints.end());
      break;
    case FeatureValues::Kind::kNone:
      break;
    }
  }
  return example.SerializeAsString();
}

} // namespace flotilla::data::detail
