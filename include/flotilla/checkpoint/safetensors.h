// The safetensors format (read by Python's safetensors, Hugging Face tools and PyTorch):
// an 8-byte little-endian header length, a JSON header mapping each tensor's name to its dtype,
// shape and byte range, an optional "__metadata__" of strings, then the raw little-endian data.
#pragma once

#include <torch/types.h>

#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace flotilla::checkpoint {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

struct SafetensorsFile {
  std::map<std::string, torch::Tensor> tensors; // CPU tensors
  std::map<std::string, std::string> metadata;
};

// Writes atomically (AtomicFile). Tensors are copied to contiguous CPU memory.
void save_safetensors(const std::filesystem::path& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// Validates the header (size, JSON, dtypes, byte ranges) and throws CheckpointError naming the
// file and the problem.
SafetensorsFile load_safetensors(const std::filesystem::path& path);

// The same format in memory (a state sent over the network): the bytes save_safetensors
// writes, and their reader, whose errors name `source`.
std::string encode_safetensors(const NamedTensors& tensors,
                               const std::map<std::string, std::string>& metadata = {});
SafetensorsFile decode_safetensors(const std::string& bytes, const std::string& source);

} // namespace flotilla::checkpoint
