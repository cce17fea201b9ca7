// Private: the safetensors header as the file claims it, checked against the file before anything
// is allocated from it. Text and sizes only, no LibTorch, so it can be fuzzed on its own;
// safetensors.cpp turns each entry into a tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace flotilla::checkpoint::detail {

struct SafetensorsEntry {
  std::string name;
  std::string dtype; // as safetensors spells it: "F32", "BF16", ...
  std::vector<std::int64_t> shape;
  std::int64_t begin = 0; // the tensor's bytes: [begin, end) of the data section
  std::int64_t end = 0;
};

struct SafetensorsHeader {
  std::map<std::string, std::string> metadata; // "__metadata__": its string values
  std::vector<SafetensorsEntry> entries;       // in the header's key order (sorted by name)
  std::int64_t data_start = 0;                 // offset of the data section in the file
};

// Bytes per element of a safetensors dtype flotilla reads; 0 for any other name.
// The format's bound on a header (the Rust reader's): 100 MiB.
inline constexpr std::uint64_t kMaxSafetensorsHeaderBytes = std::uint64_t{100} << 20;

std::size_t safetensors_element_size(const std::string& dtype);

// The header of `bytes` (a whole file); every entry's dtype is known, its shape non-negative and
// its byte range inside the data section and exactly as long as its shape needs. CheckpointError
// naming `source` otherwise.
SafetensorsHeader parse_safetensors_header(std::string_view bytes, const std::string& source);

} // namespace flotilla::checkpoint::detail
