// Private: tensorflow.Event records (src/train/proto/event.proto) from plain C++ values.
// Compiled apart from LibTorch, whose wheel carries its own, older protobuf headers that must not
// meet the system's; this interface is std types only so that torch code can call it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace flotilla::train::detail {

struct ScalarValue {
  std::string tag;
  float value = 0;
};

// One Event: file_version set (the first record of a file) or scalars (a Summary of
// simple_values), never both.
struct EventRecord {
  double wall_time = 0;
  std::int64_t step = 0;
  std::string file_version;
  std::vector<ScalarValue> scalars;
};

std::string encode_event(const EventRecord& event);

} // namespace flotilla::train::detail
