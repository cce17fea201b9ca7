#include "checkpoint/safetensors_header.h"

#include <limits>

#include <nlohmann/json.hpp>

#include "flotilla/error.h"

namespace flotilla::checkpoint::detail {
namespace {

using nlohmann::json;

// The integers of a header array, each within int64_t. nlohmann's get<int64_t> would convert a
// float (1e20, found by fuzz_safetensors) or an unsigned above 2^63-1 into an undefined value.
std::vector<std::int64_t> integers(const json& array, const std::string& what) {
  if (!array.is_array()) throw CheckpointError(what + " is " + array.dump() + ", not an array");
  std::vector<std::int64_t> out;
  for (const auto& x : array) {
    const bool fits = x.is_number_unsigned()
                          ? x.get<std::uint64_t>() <= std::numeric_limits<std::int64_t>::max()
                          : x.is_number_integer();
    if (!fits) {
      throw CheckpointError(what + " holds " + x.dump() +
                            ", not an integer in [-2^63, 2^63); the file is corrupt");
    }
    out.push_back(x.get<std::int64_t>());
  }
  return out;
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

} // namespace

std::size_t safetensors_element_size(const std::string& dtype) {
  static const std::map<std::string, std::size_t> kSizes = {
      {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8},
      {"I32", 4}, {"I16", 2}, {"I8", 1},  {"U8", 1},   {"BOOL", 1}};
  const auto found = kSizes.find(dtype);
  return found == kSizes.end() ? 0 : found->second;
}

SafetensorsHeader parse_safetensors_header(std::string_view bytes, const std::string& source) {
  const std::string where = source + ": ";
  const auto file_size = static_cast<std::int64_t>(bytes.size());
  if (file_size < 8) {
    throw CheckpointError(where + "truncated: " + std::to_string(file_size) +
                          " bytes, shorter than the 8-byte header length");
  }
  const auto* length_bytes = reinterpret_cast<const unsigned char*>(bytes.data());
  std::uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | length_bytes[i];
  if (header_size > static_cast<std::uint64_t>(file_size - 8) ||
      header_size > kMaxSafetensorsHeaderBytes) {
    throw CheckpointError(where + "header length " + std::to_string(header_size) +
                          " does not fit in a file of " + std::to_string(file_size) +
                          " bytes; the file is truncated or not safetensors");
  }
  json header;
  try {
    header = json::parse(bytes.substr(8, header_size));
  } catch (const json::exception& e) {
    throw CheckpointError(where + "header is not valid JSON (" + std::string(e.what()) + ")");
  }
  if (!header.is_object()) throw CheckpointError(where + "header is not a JSON object");

  SafetensorsHeader out;
  out.data_start = 8 + static_cast<std::int64_t>(header_size);
  const std::int64_t data_size = file_size - out.data_start;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) continue;
      for (const auto& [key, value] : entry.items()) {
        if (value.is_string()) out.metadata[key] = value.get<std::string>();
      }
      continue;
    }
    SafetensorsEntry e;
    e.name = name;
    try {
      e.dtype = entry.at("dtype").get<std::string>();
      const std::string tensor = where + "tensor \"" + name + "\"";
      e.shape = integers(entry.at("shape"), tensor + "'s shape");
      const auto offsets = integers(entry.at("data_offsets"), tensor + "'s data_offsets");
      const std::size_t element = safetensors_element_size(e.dtype);
      if (element == 0) {
        throw CheckpointError(where + "tensor \"" + name + "\" has unknown dtype \"" + e.dtype +
                              "\"");
      }
      std::int64_t numel = 1;
      for (const auto d : e.shape) {
        if (d < 0 || (d > 0 && numel > data_size / d)) {
          throw CheckpointError(where + "tensor \"" + name + "\" has shape " + shape_text(e.shape) +
                                ", larger than the file's " + std::to_string(data_size) +
                                "-byte data section; the file is corrupt");
        }
        numel *= d;
      }
      const std::int64_t size = numel * static_cast<std::int64_t>(element);
      if (offsets.size() != 2 || offsets[0] < 0 || offsets[1] < offsets[0] ||
          offsets[1] - offsets[0] != size || offsets[1] > data_size) {
        throw CheckpointError(where + "tensor \"" + name + "\" claims bytes [" +
                              std::to_string(offsets.empty() ? -1 : offsets[0]) + ", " +
                              std::to_string(offsets.size() < 2 ? -1 : offsets[1]) + ") for " +
                              std::to_string(size) + " bytes of data in a " +
                              std::to_string(data_size) + "-byte section; the file is corrupt");
      }
      e.begin = offsets[0];
      e.end = offsets[1];
    } catch (const json::exception& x) {
      throw CheckpointError(where + "tensor \"" + name + "\" has a malformed entry (" +
                            std::string(x.what()) + ")");
    }
    out.entries.push_back(std::move(e));
  }
  return out;
}

} // namespace flotilla::checkpoint::detail
