#include "flotilla/checkpoint/safetensors.h"

#include <cstring>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "flotilla/base/atomic_file.h"
#include "flotilla/error.h"

namespace flotilla::checkpoint {
namespace {

using nlohmann::json;

const std::vector<std::pair<torch::ScalarType, const char*>>& dtype_names() {
  static const std::vector<std::pair<torch::ScalarType, const char*>> kNames = {
      {torch::kFloat64, "F64"},   {torch::kFloat32, "F32"}, {torch::kFloat16, "F16"},
      {torch::kBFloat16, "BF16"}, {torch::kInt64, "I64"},   {torch::kInt32, "I32"},
      {torch::kInt16, "I16"},     {torch::kInt8, "I8"},     {torch::kUInt8, "U8"},
      {torch::kBool, "BOOL"}};
  return kNames;
}

const char* dtype_name(torch::ScalarType type, const std::string& tensor) {
  for (const auto& [t, name] : dtype_names()) {
    if (t == type) return name;
  }
  throw CheckpointError("tensor \"" + tensor + "\" has dtype " + std::string(c10::toString(type)) +
                        ", which safetensors cannot store");
}

} // namespace

namespace {
// The 8-byte length and the header, then the tensors' bytes in order, contiguous on the CPU.
struct Encoded {
  std::string head;
  std::vector<torch::Tensor> data;
  std::int64_t data_bytes = 0;
};

Encoded encode(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<torch::Tensor> data;
  std::int64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    if (name == "__metadata__" || header.contains(name)) {
      throw CheckpointError("tensor name \"" + name +
                            "\" is reserved or repeated; names must be "
                            "unique");
    }
    torch::Tensor cpu = tensor.detach().to(torch::kCPU).contiguous();
    const std::int64_t bytes = cpu.numel() * static_cast<std::int64_t>(cpu.element_size());
    header[name] = {{"dtype", dtype_name(cpu.scalar_type(), name)},
                    {"shape", cpu.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    data.push_back(cpu);
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' '); // keeps the data 8-byte aligned
  Encoded out;
  for (int i = 0; i < 8; ++i) out.head += static_cast<char>(text.size() >> (8 * i));
  out.head += text;
  out.data = std::move(data);
  out.data_bytes = offset;
  return out;
}
} // namespace

std::string encode_safetensors(const NamedTensors& tensors,
                               const std::map<std::string, std::string>& metadata) {
  Encoded encoded = encode(tensors, metadata);
  std::string out = std::move(encoded.head);
  out.reserve(out.size() + static_cast<std::size_t>(encoded.data_bytes));
  for (const auto& t : encoded.data) {
    out.append(static_cast<const char*>(t.data_ptr()),
               static_cast<std::size_t>(t.numel() * t.element_size()));
  }
  return out;
}

void save_safetensors(const std::filesystem::path& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata) {
  const Encoded encoded = encode(tensors, metadata); // streamed: no second copy of the data
  base::AtomicFile file(path);
  file.write(encoded.head);
  for (const auto& t : encoded.data) {
    file.write(t.data_ptr(), static_cast<std::size_t>(t.numel() * t.element_size()));
  }
  file.commit();
}

SafetensorsFile load_safetensors(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw CheckpointError(path.string() + ": cannot open it; check the path");
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw CheckpointError(path.string() + ": cannot read it");
  return decode_safetensors(bytes, path.string());
}

SafetensorsFile decode_safetensors(const std::string& bytes, const std::string& source) {
  const std::string where = source + ": ";
  const auto file_size = static_cast<std::int64_t>(bytes.size());
  if (file_size < 8) {
    throw CheckpointError(where + "truncated: " + std::to_string(file_size) +
                          " bytes, shorter than the 8-byte header length");
  }
  const auto* length_bytes = reinterpret_cast<const unsigned char*>(bytes.data());
  std::uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | length_bytes[i];
  if (header_size > static_cast<std::uint64_t>(file_size - 8) || header_size > (100u << 20)) {
    throw CheckpointError(where + "header length " + std::to_string(header_size) +
                          " does not fit in a file of " + std::to_string(file_size) +
                          " bytes; the file is truncated or not safetensors");
  }
  const std::string text = bytes.substr(8, header_size);
  json header;
  try {
    header = json::parse(text);
  } catch (const json::exception& e) {
    throw CheckpointError(where + "header is not valid JSON (" + std::string(e.what()) + ")");
  }
  if (!header.is_object()) throw CheckpointError(where + "header is not a JSON object");
  const std::int64_t data_start = 8 + static_cast<std::int64_t>(header_size);
  const std::int64_t data_size = file_size - data_start;
  const char* blob = bytes.data() + data_start;

  SafetensorsFile out;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      for (const auto& [key, value] : entry.items()) {
        if (value.is_string()) out.metadata[key] = value.get<std::string>();
      }
      continue;
    }
    try {
      const std::string dtype = entry.at("dtype").get<std::string>();
      auto found = std::find_if(dtype_names().begin(), dtype_names().end(),
                                [&](const auto& p) { return dtype == p.second; });
      if (found == dtype_names().end()) {
        throw CheckpointError(where + "tensor \"" + name + "\" has unknown dtype \"" + dtype +
                              "\"");
      }
      const auto shape = entry.at("shape").get<std::vector<std::int64_t>>();
      const auto offsets = entry.at("data_offsets").get<std::vector<std::int64_t>>();
      // Sizes are checked against the file before anything is allocated.
      std::int64_t numel = 1;
      for (const auto d : shape) {
        if (d < 0 || (d > 0 && numel > data_size / d)) {
          throw CheckpointError(where + "tensor \"" + name + "\" has shape " +
                                c10::str(c10::IntArrayRef(shape)) + ", larger than the file's " +
                                std::to_string(data_size) +
                                "-byte data section; the file is corrupt");
        }
        numel *= d;
      }
      const std::int64_t bytes = numel * static_cast<std::int64_t>(c10::elementSize(found->first));
      if (offsets.size() != 2 || offsets[0] < 0 || offsets[1] < offsets[0] ||
          offsets[1] - offsets[0] != bytes || offsets[1] > data_size) {
        throw CheckpointError(where + "tensor \"" + name + "\" claims bytes [" +
                              std::to_string(offsets.empty() ? -1 : offsets[0]) + ", " +
                              std::to_string(offsets.size() < 2 ? -1 : offsets[1]) + ") for " +
                              std::to_string(bytes) + " bytes of data in a " +
                              std::to_string(data_size) + "-byte section; the file is corrupt");
      }
      torch::Tensor t = torch::empty(shape, found->first);
      std::memcpy(t.data_ptr(), blob + offsets[0], static_cast<std::size_t>(bytes));
      out.tensors[name] = t;
    } catch (const json::exception& e) {
      throw CheckpointError(where + "tensor \"" + name + "\" has a malformed entry (" +
                            std::string(e.what()) + ")");
    }
  }
  return out;
}

} // namespace flotilla::checkpoint
