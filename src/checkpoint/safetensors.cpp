#include "flotilla/checkpoint/safetensors.h"

#include <cstring>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "checkpoint/safetensors_header.h"
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
  const detail::SafetensorsHeader header = detail::parse_safetensors_header(bytes, source);
  const char* data = bytes.data() + header.data_start;
  SafetensorsFile out;
  out.metadata = header.metadata;
  for (const auto& entry : header.entries) {
    const auto found = std::find_if(dtype_names().begin(), dtype_names().end(),
                                    [&](const auto& p) { return entry.dtype == p.second; });
    const std::size_t size = static_cast<std::size_t>(entry.end - entry.begin);
    torch::Tensor t;
    if (found != dtype_names().end()) t = torch::empty(entry.shape, found->first);
    // The header parser's dtypes and sizes are LibTorch's (Safetensors.RoundTripsEveryDtype...).
    if (!t.defined() || t.nbytes() != size) {
      throw CheckpointError(source + ": tensor \"" + entry.name + "\": flotilla's dtype table " +
                            "disagrees with LibTorch on " + entry.dtype + "; please report it");
    }
    std::memcpy(t.data_ptr(), data + entry.begin, size);
    out.tensors[entry.name] = t;
  }
  return out;
}

} // namespace flotilla::checkpoint
