// Training checkpoints as directories that ordinary tools read, kept the way
// tf.train.CheckpointManager keeps them:
//
//   <dir>/checkpoint              TensorFlow's CheckpointState text ("model_checkpoint_path:
//                                 \"ckpt-7\"", then "all_model_checkpoint_paths:" lines, oldest
//                                 first), so tf.train.latest_checkpoint(<dir>) names the newest
//   <dir>/ckpt-7/model.safetensors      parameters and buffers by module path
//   <dir>/ckpt-7/optimizer.safetensors  optimizer state as named tensors (optimizer_state)
//   <dir>/ckpt-7/manifest.json          format, version, epoch, step, policy, cluster size,
//                                       versions, time, each file's SHA-256 and size, and the
//                                       caller's own JSON state (loss scale, iterator, RNG...)
//   <dir>/ckpt-7/manifest.sha256        the manifest's own SHA-256, as `sha256sum -c` reads it
//   <dir>/ckpt-7/manifest.hmac          where the group has a checkpoint key (the cluster token
//                                       the user set): the manifest's HMAC-SHA256 under it
//                                       (hex), so that whoever can write the directory but
//                                       lacks the token cannot edit the training state and
//                                       recompute the checksum
//
// A checkpoint directory is written whole under a hidden temporary name, flushed, and renamed
// into place; only then does the pointer file move to it, and only then are checkpoints beyond
// max_to_keep deleted. A crash at any moment leaves the pointer at a complete checkpoint.
// Saving is collective (TF's multi-worker rule): every worker writes the same files, the chief
// into <dir>, the others into a temporary directory beside it that is removed afterwards.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "flotilla/checkpoint/model_checkpoint.h"
#include "flotilla/checkpoint/optimizer_state.h"
#include "flotilla/checkpoint/pointer.h"
#include "flotilla/checkpoint/safetensors.h"
#include "flotilla/collective/communicator.h"
#include "flotilla/log.h"

namespace flotilla::checkpoint {

inline constexpr const char* kCheckpointFormat = "flotilla-checkpoint";
// Version 2 added manifest.sha256; version 1 checkpoints (without it) are still read.
inline constexpr int kCheckpointFormatVersion = 2;
inline constexpr const char* kModelFile = "model.safetensors";
inline constexpr const char* kOptimizerFile = "optimizer.safetensors";
inline constexpr const char* kManifestFile = "manifest.json";
inline constexpr const char* kManifestChecksumFile = "manifest.sha256";
inline constexpr const char* kManifestMacFile = "manifest.hmac";
inline constexpr const char* kPointerFile = "checkpoint"; // TensorFlow's name

struct CheckpointData {
  NamedTensors model;     // parameters and buffers (model_state)
  NamedTensors optimizer; // optimizer_state
  std::int64_t epoch = 0; // epochs completed
  std::int64_t step = 0;  // optimizer updates applied (the global step)
  std::string policy = "float32";
  nlohmann::json state = nlohmann::json::object(); // anything else to resume exactly
  // A fencing token (the manifest's "generation"): the elastic generation that decided this
  // state, counted over the training's runs (BackupAndRestore). -1: none, and save() fences
  // nothing. With one, save() refuses to move the pointer past a newer token or update on disk.
  std::int64_t generation = -1;
};

class CheckpointManager {
 public:
  // Keeps the newest `max_to_keep` (at least 1) checkpoints named "<prefix>-<number>" in
  // `directory`. ConfigError for an empty directory, max_to_keep < 1, or a prefix that is not a
  // plain file name ([A-Za-z0-9._-], not starting with '.').
  explicit CheckpointManager(std::filesystem::path directory, int max_to_keep = 5,
                             std::string prefix = "ckpt");

  // Collective: every worker calls it at the same step with the same data and number (workers
  // that pass different numbers all get a CheckpointError). Returns the chief's checkpoint
  // directory, "<directory>/<prefix>-<number>". Saving a number that exists replaces it. When
  // it fails on any worker it throws CheckpointError on every worker, and the previous
  // checkpoints and pointer are as they were.
  // Fencing, when data.generation >= 0: the chief refuses (CheckpointError, nothing changed) to
  // commit a checkpoint whose generation is older than that of the newest checkpoint the
  // pointer names, or whose update count (data.step) is lower: a writer the group replaced (a
  // chief stopped and woken after its successor saved) cannot put an older state over a newer
  // one. With a training id (state["training"]), only a newest checkpoint of the same training
  // fences: another training's is replaced. The check and the pointer's move hold an exclusive
  // flock on the directory.
  // `workers` are the training group (rank 0 is the chief); with a checkpoint key in their
  // options (CommunicationOptions::checkpoint_key, the cluster token the user set) the manifest
  // is also keyed with it (manifest.hmac). `log` tells of old checkpoints
  // that could not be removed.
  std::filesystem::path save(collective::Communicator& workers, const Logger& log,
                             const CheckpointData& data, std::int64_t number);

  // The newest checkpoint the pointer file names; nullopt when there is no pointer file.
  // CheckpointError when it exists but cannot be read or parsed.
  std::optional<std::filesystem::path> latest() const;
  // Every checkpoint the pointer file lists, oldest first (empty without a pointer file).
  std::vector<std::filesystem::path> checkpoints() const;

  const std::filesystem::path& directory() const { return directory_; }
  int max_to_keep() const { return max_to_keep_; }
  const std::string& prefix() const { return prefix_; }

 private:
  std::filesystem::path directory_;
  int max_to_keep_;
  std::string prefix_;
};

// Reads and verifies one checkpoint directory: the manifest matches its checksum, parses and has
// this format and a version this build reads; every file it lists exists with the recorded size
// and SHA-256; then the tensors load. With a `key` (the cluster token), the manifest must also
// carry its HMAC under that key: one without (saved with no token, or its manifest.hmac
// removed) or with another is refused. Any mismatch is a CheckpointError naming the file, what
// was expected and found, and what to do.
CheckpointData read_checkpoint(const std::filesystem::path& checkpoint_dir,
                               const std::optional<std::string>& key = std::nullopt);

// The newest checkpoint in `directory` that verifies (read_checkpoint) and that `accept` takes:
// those the pointer file names, newest first, then, as a last resort, any other checkpoint
// directory there by number. `accept` loads it (into a model, say) and throws to pass it over;
// a ConfigError from it is not a damaged checkpoint and ends the search (it propagates). Each
// one passed over goes into `skipped` as "<path>: <reason>" (for a warning); the one restored
// goes into `restored_from`. nullopt when none exists or none verifies and loads.
using AcceptCheckpoint =
    std::function<void(const CheckpointData& data, const std::filesystem::path& path)>;
// `key`: as read_checkpoint's.
std::optional<CheckpointData> restore_latest(const std::filesystem::path& directory,
                                             std::vector<std::string>* skipped = nullptr,
                                             std::filesystem::path* restored_from = nullptr,
                                             const AcceptCheckpoint& accept = {},
                                             const std::optional<std::string>& key = std::nullopt);

// nullopt when `directory` has no pointer file (flotilla/checkpoint/pointer.h); CheckpointError
// when it cannot be parsed.
std::optional<CheckpointPointer> read_pointer(const std::filesystem::path& directory);

} // namespace flotilla::checkpoint
