#include "flotilla/checkpoint/model_checkpoint.h"

#include <nlohmann/json.hpp>

#include <fstream>
#include <random>
#include <unordered_map>
#include <utility>
#include <vector>

#include "checkpoint/fence.h"
#include "checkpoint/safetensors_header.h"
#include "flotilla/checkpoint/safetensors.h"
#include "flotilla/collective/agreement.h"
#include "flotilla/error.h"

namespace flotilla::checkpoint {
namespace fs = std::filesystem;

WriteLocation::WriteLocation(const fs::path& model_dir, bool is_chief, int rank)
    : temporary_(!is_chief) {
  if (model_dir.empty()) throw ConfigError("model_dir is empty; give a directory to save into");
  fs::path base = model_dir;
  if (!base.has_filename()) base = base.parent_path(); // "dir/" -> "dir"
  if (is_chief) {
    dir_ = base;
  } else {
    std::random_device random;
    dir_ = base;
    dir_ += ".worker" + std::to_string(rank) + "-" + std::to_string(random());
  }
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) {
    throw CheckpointError("cannot create " + dir_.string() + " (" + ec.message() +
                          "); choose a writable model directory");
  }
}

WriteLocation::~WriteLocation() {
  if (temporary_) {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
}

std::string first_non_finite(const NamedTensors& tensors) {
  for (const auto& [name, tensor] : tensors) {
    if (tensor.defined() && tensor.is_floating_point() && !tensor.isfinite().all().item<bool>()) {
      return name;
    }
  }
  return "";
}

NamedTensors model_state(const torch::nn::Module& module) {
  NamedTensors tensors;
  for (const auto& item : module.named_parameters()) {
    tensors.emplace_back(item.key(), item.value().detach());
  }
  for (const auto& item : module.named_buffers()) {
    tensors.emplace_back(item.key(), item.value().detach());
  }
  return tensors;
}

void load_model_state(torch::nn::Module& module, const NamedTensors& state,
                      const std::string& source) {
  const std::string where = source.empty() ? "checkpoint: " : source + ": ";
  std::unordered_map<std::string, const torch::Tensor*> saved;
  for (const auto& [name, tensor] : state) saved.emplace(name, &tensor);
  std::vector<std::pair<torch::Tensor, const torch::Tensor*>> copies;
  auto check = [&](const std::string& name, const torch::Tensor& target) {
    auto it = saved.find(name);
    if (it == saved.end()) {
      throw CheckpointError(where + "has no tensor \"" + name +
                            "\"; it was saved from a different model");
    }
    if (it->second->sizes() != target.sizes()) {
      throw CheckpointError(where + "tensor \"" + name + "\" has shape " +
                            c10::str(it->second->sizes()) + ", the model expects " +
                            c10::str(target.sizes()) + "; it was saved from a different model");
    }
    copies.emplace_back(target, it->second);
  };
  for (const auto& item : module.named_parameters()) check(item.key(), item.value());
  for (const auto& item : module.named_buffers()) check(item.key(), item.value());
  torch::NoGradGuard no_grad;
  for (auto& [target, source_tensor] : copies) target.copy_(*source_tensor);
}

std::map<std::string, std::string> read_safetensors_metadata(const fs::path& path) {
  std::map<std::string, std::string> out;
  std::ifstream in(path, std::ios::binary);
  unsigned char size_bytes[8];
  if (!in.read(reinterpret_cast<char*>(size_bytes), 8)) return out;
  std::uint64_t size = 0;
  for (int i = 7; i >= 0; --i) size = (size << 8) | size_bytes[i]; // little-endian
  if (size > detail::kMaxSafetensorsHeaderBytes) return out;
  std::string header(size, '\0');
  if (!in.read(header.data(), static_cast<std::streamsize>(size))) return out;
  const auto json = nlohmann::json::parse(header, nullptr, /*allow_exceptions=*/false);
  if (!json.is_object() || !json.contains("__metadata__") || !json["__metadata__"].is_object()) {
    return out;
  }
  for (const auto& [key, value] : json["__metadata__"].items()) {
    if (value.is_string()) out.emplace(key, value.get<std::string>());
  }
  return out;
}

namespace {

// The fence of save_model: CheckpointError when `path` holds weights of the same training that
// a newer generation decided or that have more updates.
void check_weights_fence(const fs::path& path, const WeightsFence& fence) {
  const auto theirs = read_safetensors_metadata(path);
  const auto field = [&](const char* key) -> std::optional<std::int64_t> {
    const auto it = theirs.find(key);
    if (it == theirs.end()) return std::nullopt;
    try {
      return std::stoll(it->second);
    } catch (const std::exception&) {
      return std::nullopt;
    }
  };
  const auto training = theirs.find("flotilla.training");
  if (training == theirs.end() || training->second != fence.training) return;
  const auto generation = field("flotilla.generation");
  const auto update = field("flotilla.update");
  if (!generation || !update) return;
  detail::check_token(fence.generation, fence.update, *generation, *update, "these weights are",
                      "the file there, " + path.string(), "");
}

} // namespace

fs::path save_model(collective::Communicator& workers, const torch::nn::Module& module,
                    const fs::path& model_dir, const std::string& file_name,
                    const std::map<std::string, std::string>& metadata,
                    const std::optional<WeightsFence>& fence) {
  const NamedTensors tensors = model_state(module);

  std::exception_ptr failure;
  try {
    WriteLocation location(model_dir, workers.rank() == 0, workers.rank());
    const fs::path path = location.dir() / file_name;
    if (!fence) {
      save_safetensors(path, tensors, metadata);
    } else {
      std::map<std::string, std::string> fenced = metadata;
      fenced["flotilla.training"] = fence->training;
      fenced["flotilla.generation"] = std::to_string(fence->generation);
      fenced["flotilla.update"] = std::to_string(fence->update);
      detail::DirectoryFlock lock(path.parent_path());
      if (!location.is_temporary()) check_weights_fence(path, *fence);
      save_safetensors(path, tensors, fenced);
    }
  } catch (...) {
    failure = std::current_exception();
  }
  // Everyone learns whether everyone succeeded: nobody waits on a worker that gave up.
  const bool ok = collective::all_true(workers, !failure);
  if (failure) std::rethrow_exception(failure);
  if (!ok) {
    throw CheckpointError("saving " + file_name +
                          " failed on another worker; see its output. The previous checkpoint "
                          "in " +
                          model_dir.string() + " is intact");
  }
  fs::path base = model_dir;
  if (!base.has_filename()) base = base.parent_path();
  return base / file_name;
}

std::map<std::string, std::string> load_model(torch::nn::Module& module, const fs::path& file) {
  SafetensorsFile saved = load_safetensors(file);
  NamedTensors state(saved.tensors.begin(), saved.tensors.end());
  load_model_state(module, state, file.string());
  return saved.metadata;
}

} // namespace flotilla::checkpoint
