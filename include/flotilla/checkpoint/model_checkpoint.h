// Saving a mirrored model the multi-worker way (the seeds' rule, as TF does it): every worker
// saves, because saving is a collective step; only the chief writes into model_dir, each other
// worker writes the same files into its own unique temporary directory beside it and removes it
// afterwards. Files are safetensors, written atomically.
#pragma once

#include <torch/nn/module.h>

#include <filesystem>
#include <map>
#include <string>

#include "flotilla/strategy/strategy.h"

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

// Every worker calls it at the same step. Writes `file_name` (parameters and buffers by their
// module path, plus `metadata`) and returns the chief's path. A failure on any worker is
// reported on all of them as CheckpointError, and the previous file of that name is intact.
std::filesystem::path save_model(strategy::Strategy& strategy, const torch::nn::Module& module,
                                 const std::filesystem::path& model_dir,
                                 const std::string& file_name,
                                 const std::map<std::string, std::string>& metadata = {});

// Copies a saved model's tensors into `module`; CheckpointError on a missing name or a shape
// mismatch. Returns the file's metadata.
std::map<std::string, std::string> load_model(torch::nn::Module& module,
                                              const std::filesystem::path& file);

} // namespace flotilla::checkpoint
