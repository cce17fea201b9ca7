// Saving a mirrored model the multi-worker way (the seeds' rule, as TF does it): every worker
// saves, because saving is a collective step; only the chief writes into model_dir, each other
// worker writes the same files into its own unique temporary directory beside it and removes it
// afterwards. Files are safetensors, written atomically.
#pragma once

#include <torch/nn/module.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>

#include "flotilla/checkpoint/safetensors.h"
#include "flotilla/collective/communicator.h"

namespace flotilla::checkpoint {

// Where this worker writes: model_dir on the chief; "<model_dir>.worker<rank>-<random>" on the
// others, created now and removed with everything in it when this object goes.
class WriteLocation {
 public:
  WriteLocation(const std::filesystem::path& model_dir, bool is_chief, int rank);
  ~WriteLocation();
  WriteLocation(const WriteLocation&) = delete;
  WriteLocation& operator=(const WriteLocation&) = delete;

  const std::filesystem::path& dir() const { return dir_; }
  bool is_temporary() const { return temporary_; }

 private:
  std::filesystem::path dir_;
  bool temporary_;
};

// A module's parameters and buffers by module path ("0.weight", "encoder.bn.running_mean"), the
// names PyTorch's state_dict() gives the same module. The tensors are detached views of the
// module's own (no copy): clone them to keep a snapshot while training goes on.
NamedTensors model_state(const torch::nn::Module& module);
// The name of the first floating-point tensor holding a NaN or an infinity; "" when none does.
// A diverged model's state: no checkpoint of it becomes the newest (CheckpointManager::save
// refuses it, the callbacks skip it).
std::string first_non_finite(const NamedTensors& tensors);

// Copies `state` into the module's parameters and buffers (each keeps its device and dtype).
// Everything is checked before anything is copied: a name the module has and `state` lacks, or
// a shape that differs, is a CheckpointError naming the tensor (prefixed by `source`, e.g. the
// file, when given) and the module is left as it was. Extra names in `state` are ignored.
void load_model_state(torch::nn::Module& module, const NamedTensors& state,
                      const std::string& source = "");

// A weights file's fencing token (elastic fits): the training, the generation that decided the
// weights (counted over the training's runs) and the updates applied. save_model() records it
// in the file's metadata ("flotilla.training", "flotilla.generation", "flotilla.update").
struct WeightsFence {
  std::string training;
  std::int64_t generation = 0;
  std::int64_t update = 0;
};

// Every worker of `workers` calls it at the same step. Writes `file_name` (parameters and buffers
// by their module path, plus `metadata`) and returns the chief's path. A failure on any worker is
// reported on all of them as CheckpointError, and the previous file of that name is intact.
// With a fence, the chief refuses (CheckpointError, the file unchanged) to replace a file of
// the same training whose generation is newer or whose update count is higher: a chief the
// group replaced, woken, cannot put older weights over its successor's. The check and the write
// hold an exclusive flock on the directory. A file of another training, or none, is replaced.
std::filesystem::path save_model(collective::Communicator& workers, const torch::nn::Module& module,
                                 const std::filesystem::path& model_dir,
                                 const std::string& file_name,
                                 const std::map<std::string, std::string>& metadata = {},
                                 const std::optional<WeightsFence>& fence = std::nullopt);

// A safetensors file's metadata ("__metadata__"), read from its header alone; empty when the
// file is missing or its header unreadable.
std::map<std::string, std::string> read_safetensors_metadata(const std::filesystem::path& path);

// Copies a saved model's tensors into `module`; CheckpointError on a missing name or a shape
// mismatch. Returns the file's metadata.
std::map<std::string, std::string> load_model(torch::nn::Module& module,
                                              const std::filesystem::path& file);

} // namespace flotilla::checkpoint
