#include "flotilla/checkpoint/checkpoint_manager.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <torch/version.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <sstream>
#include <type_traits>

#include "checkpoint/fence.h"
#include "checkpoint/manifest.h"
#include "flotilla/base/atomic_file.h"
#include "flotilla/base/hashes.h"
#include "flotilla/base/system.h"
#include "flotilla/checkpoint/directory.h"
#include "flotilla/collective/agreement.h"
#include "flotilla/error.h"

namespace flotilla::checkpoint {
namespace fs = std::filesystem;
using nlohmann::json;
using nlohmann::ordered_json;

using detail::restore_advice;

namespace {

// ---- names and small helpers ------------------------------------------------------------------

bool plain_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

void validate_prefix(const std::string& prefix) {
  const bool ok = !prefix.empty() && prefix.front() != '.' &&
                  std::all_of(prefix.begin(), prefix.end(), [](unsigned char c) {
                    return std::isalnum(c) || c == '.' || c == '_' || c == '-';
                  });
  if (!ok) {
    throw ConfigError("checkpoint prefix \"" + prefix +
                      "\" is not a plain file name; use letters, digits, '.', '_' and '-', not "
                      "starting with '.' (e.g. \"ckpt\")");
  }
}

std::string random_suffix() {
  static thread_local std::mt19937_64 generator{std::random_device{}()};
  std::ostringstream out;
  out << std::hex << generator();
  return out.str();
}

// Makes a directory's entries (a rename into it, a new file) durable.
void sync_directory(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    throw CheckpointError("cannot open " + dir.string() + " to flush it to disk (" +
                          std::strerror(errno) + ")");
  }
  const int rc = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  // Some file systems cannot sync a directory (EINVAL); their renames are as durable as it gets.
  if (rc != 0 && error != EINVAL) {
    throw CheckpointError("cannot flush " + dir.string() + " to disk (" + std::strerror(error) +
                          ")");
  }
}

void rename_or_throw(const fs::path& from, const fs::path& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) {
    throw CheckpointError("cannot rename " + from.string() + " to " + to.string() + " (" +
                          std::strerror(errno) + ")");
  }
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw CheckpointError(path.string() + ": cannot open it (" + std::strerror(errno) + ")");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw CheckpointError(path.string() + ": cannot read it");
  return text.str();
}

fs::path resolve(const fs::path& directory, const std::string& entry) {
  const fs::path path(entry);
  return path.is_absolute() ? path : directory / path;
}

// ---- writing one checkpoint directory ---------------------------------------------------------

// A checkpoint written whole under a hidden name beside its final one; removed unless renamed.
// While it is written it holds a lock on its directory, so that another writer's sweep of what
// interrupted saves left (sweep_debris) passes it over: in an elastic group a replaced chief may
// still be writing beside its successor, and must fail on the fence, not on a vanished file.
class StagedCheckpoint {
 public:
  StagedCheckpoint(const fs::path& parent, const std::string& name)
      : path_(parent / ("." + name + ".tmp-" + random_suffix())) {
    std::error_code ec;
    if (!fs::create_directory(path_, ec) || ec) {
      throw CheckpointError("cannot create " + path_.string() + " (" +
                            (ec ? ec.message() : std::string("it exists")) + "); check that " +
                            parent.string() + " is writable");
    }
    fd_ = ::open(path_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd_ >= 0 && ::flock(fd_, LOCK_EX | LOCK_NB) != 0) { // no locks here: sweeps unguarded
      ::close(fd_);
      fd_ = -1;
    }
  }
  ~StagedCheckpoint() {
    if (!path_.empty()) {
      std::error_code ignored;
      fs::remove_all(path_, ignored);
    }
    if (fd_ >= 0) ::close(fd_);
  }
  StagedCheckpoint(const StagedCheckpoint&) = delete;
  StagedCheckpoint& operator=(const StagedCheckpoint&) = delete;

  const fs::path& path() const { return path_; }
  void renamed() {
    path_.clear();
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  fs::path path_;
  int fd_ = -1;
};

// Whether a live writer holds the staging directory `dir` (StagedCheckpoint's lock).
bool being_written(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool held = ::flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK;
  ::close(fd);
  return held;
}

ordered_json file_entry(const fs::path& path) {
  return ordered_json{{"sha256", base::sha256_file(path)},
                      {"bytes", static_cast<std::uint64_t>(fs::file_size(path))}};
}

void write_files(const fs::path& dir, const CheckpointData& data, std::int64_t number,
                 int cluster_size, const std::optional<std::string>& key) {
  // Hugging Face tools look for this metadata key in PyTorch weights.
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  save_safetensors(dir / kModelFile, data.model, metadata);
  save_safetensors(dir / kOptimizerFile, data.optimizer, metadata);
  ordered_json files = ordered_json::object();
  files[kModelFile] = file_entry(dir / kModelFile);
  files[kOptimizerFile] = file_entry(dir / kOptimizerFile);
  ordered_json manifest = {
      {"format", kCheckpointFormat},
      {"format_version", kCheckpointFormatVersion},
      {"number", number},
      {"epoch", data.epoch},
      {"step", data.step},
      {"policy", data.policy},
      {"cluster_size", cluster_size},
      {"flotilla_version", FLOTILLA_VERSION},
      {"libtorch_version", TORCH_VERSION},
      {"created", base::utc_now()},
      {"files", files},
      {"state", ordered_json::parse(data.state.dump())},
  };
  if (data.generation >= 0) manifest["generation"] = data.generation;
  const std::string manifest_text = manifest.dump(2) + "\n";
  base::write_file_atomic(dir / kManifestFile, manifest_text);
  // The manifest holds the training state (epoch, position, ...): it is checked like the rest.
  base::write_file_atomic(dir / kManifestChecksumFile,
                          base::sha256_hex(manifest_text.data(), manifest_text.size()) + "  " +
                              kManifestFile + "\n");
  if (key) {
    base::write_file_atomic(dir / kManifestMacFile,
                            base::hmac_sha256_hex(*key, manifest_text) + "\n");
  }
  sync_directory(dir);
}

// The pointer's list as it stands in `dir`: entries whose directories still exist, oldest
// first. A pointer that cannot be parsed is replaced (its checkpoints are then no longer
// managed, never deleted); `warning` says so.
std::vector<std::string> kept_checkpoints(const fs::path& dir, std::string& warning) {
  std::vector<std::string> kept;
  try {
    const auto pointer = read_pointer(dir);
    if (!pointer) return kept;
    for (const auto& entry : pointer->all_model_checkpoint_paths) {
      if (std::find(kept.begin(), kept.end(), entry) == kept.end() &&
          fs::is_directory(resolve(dir, entry))) {
        kept.push_back(entry);
      }
    }
  } catch (const CheckpointError& e) {
    warning = std::string(e.what()) + "; it is replaced, and the checkpoints it listed are no "
                                      "longer deleted by max_to_keep";
  }
  return kept;
}

struct Commit {
  std::vector<std::string> to_delete;
  std::string warning;
};

// Fencing: CheckpointError when the newest checkpoint the pointer of `dir` names, of the same
// training, was decided by a newer generation than `data`'s, or holds more updates. A newest
// checkpoint that cannot be read fences nothing (restore_latest passes it over too).
void check_fence(const fs::path& dir, const CheckpointData& data, const std::string& name) {
  if (data.generation < 0) return;
  detail::Manifest newest;
  fs::path newest_path;
  try {
    const auto pointer = read_pointer(dir);
    if (!pointer) return;
    newest_path = resolve(dir, pointer->model_checkpoint_path);
    if (newest_path.filename() == name) return; // a re-save of this number: replaced as before
    newest =
        detail::parse_manifest(read_text(newest_path / kManifestFile), newest_path / kManifestFile,
                               {kCheckpointFormat, kCheckpointFormatVersion, {}});
  } catch (const std::exception&) {
    return;
  }
  // A writer with a training id is fenced by checkpoints of that training only: one of another
  // training (a job started afresh in the same directory, or written before ids) is replaced,
  // as Keras's callbacks replace files, whatever its tokens, which another rendezvous counted.
  const std::string training = data.state.value("training", std::string());
  if (!training.empty() &&
      (!newest.state.is_object() || newest.state.value("training", std::string()) != training)) {
    return;
  }
  detail::check_token(data.generation, data.step, newest.generation, newest.step,
                      "this writer's state is",
                      "the newest checkpoint there, " + newest_path.string(),
                      "; a resume from it would repeat the updates in between");
}

// Moves a staged checkpoint to `dir`/`name`, then points the pointer file at it. On failure,
// everything is as it was before. Returns the checkpoints now beyond max_to_keep.
Commit commit(StagedCheckpoint& staged, const fs::path& dir, const std::string& name,
              int max_to_keep) {
  Commit result;
  std::vector<std::string> kept = kept_checkpoints(dir, result.warning);
  const fs::path final_path = dir / name;
  fs::path aside;
  if (fs::exists(fs::symlink_status(final_path))) { // a re-save of this number
    aside = dir / ("." + name + ".old-" + random_suffix());
    rename_or_throw(final_path, aside);
  }
  auto restore = [&] {
    if (!aside.empty()) {
      std::error_code ignored;
      fs::rename(aside, final_path, ignored);
    }
  };
  try {
    rename_or_throw(staged.path(), final_path);
  } catch (...) {
    restore();
    throw;
  }
  staged.renamed();
  try {
    sync_directory(dir);
    kept.erase(std::remove(kept.begin(), kept.end(), name), kept.end());
    kept.push_back(name);
    const std::size_t keep = static_cast<std::size_t>(max_to_keep);
    if (kept.size() > keep) {
      result.to_delete.assign(kept.begin(), kept.end() - static_cast<std::ptrdiff_t>(keep));
      kept.erase(kept.begin(), kept.end() - static_cast<std::ptrdiff_t>(keep));
    }
    base::write_file_atomic(dir / kPointerFile, format_pointer({name, kept}));
  } catch (...) {
    std::error_code ignored;
    fs::remove_all(final_path, ignored);
    restore();
    throw;
  }
  if (!aside.empty()) result.to_delete.insert(result.to_delete.begin(), aside.filename().string());
  return result;
}

// Deletes what the pointer no longer names; a failure only warns (the save itself succeeded).
void delete_old(const fs::path& dir, const std::vector<std::string>& names, const Logger& log) {
  for (const auto& name : names) {
    if (!plain_name(name)) continue; // only what this manager wrote, inside its directory
    try {
      const fs::path path = dir / name;
      if (fs::is_directory(fs::symlink_status(path))) remove_checkpoint_directory(path);
    } catch (const std::exception& e) {
      log.warn(e.what());
    }
  }
}

// Hidden directories that a save or deletion interrupted between its steps (a crash, a kill)
// left behind: ".<prefix>-<n>.tmp-*", ".<prefix>-<n>.old-*" and their ".deleting-*" forms. Only
// their checkpoint files are deleted: anything else in them is the user's.
void sweep_debris(const fs::path& dir, const std::string& prefix, const Logger& log) {
  std::vector<fs::path> debris;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const bool ours =
        (name.rfind("." + prefix + "-", 0) == 0 || name.rfind(".." + prefix + "-", 0) == 0) &&
        (name.find(".tmp-") != std::string::npos || name.find(".old-") != std::string::npos ||
         name.find(".deleting-") != std::string::npos);
    std::error_code type_error;
    if (ours && entry.is_directory(type_error) && !being_written(entry.path())) {
      debris.push_back(entry.path());
    }
  }
  for (const auto& path : debris) {
    try {
      remove_checkpoint_directory(path);
    } catch (const std::exception& e) {
      log.warn(std::string(e.what()) + " (left by an interrupted save)");
    }
  }
}

// ---- reading -----------------------------------------------------------------------------------

NamedTensors load_tensors(const fs::path& path) {
  SafetensorsFile file = load_safetensors(path);
  return NamedTensors(std::make_move_iterator(file.tensors.begin()),
                      std::make_move_iterator(file.tensors.end()));
}

} // namespace

// ---- the pointer, public ------------------------------------------------------------------------

std::optional<CheckpointPointer> read_pointer(const fs::path& directory) {
  const fs::path file = directory / kPointerFile;
  std::error_code ec;
  const auto status = fs::status(file, ec);
  if (!fs::exists(status)) return std::nullopt;
  if (!fs::is_regular_file(status)) {
    throw CheckpointError(file.string() + ": is not a file; the checkpoint pointer must be one. "
                                          "Move it away");
  }
  return parse_pointer(read_text(file), file.string());
}

// ---- CheckpointManager --------------------------------------------------------------------------

CheckpointManager::CheckpointManager(fs::path directory, int max_to_keep, std::string prefix)
    : directory_(std::move(directory)), max_to_keep_(max_to_keep), prefix_(std::move(prefix)) {
  if (directory_.empty()) {
    throw ConfigError("checkpoint directory is empty; give a directory to save into");
  }
  if (!directory_.has_filename()) directory_ = directory_.parent_path(); // "dir/" -> "dir"
  if (max_to_keep_ < 1) {
    throw ConfigError("max_to_keep is " + std::to_string(max_to_keep_) +
                      "; keep at least 1 checkpoint");
  }
  validate_prefix(prefix_);
}

fs::path CheckpointManager::save(collective::Communicator& workers, const Logger& log,
                                 const CheckpointData& data, std::int64_t number) {
  const std::string name = prefix_ + "-" + std::to_string(number);
  const std::string intact =
      "The previous checkpoints in " + directory_.string() + " and its pointer file are intact";
  const bool chief = workers.rank() == 0;

  // Phase 1, every worker: write the whole checkpoint under a hidden name. The chief stops
  // there; the others, in their own temporary directory, finish as the chief will.
  std::optional<WriteLocation> location;
  std::optional<StagedCheckpoint> staged;
  std::exception_ptr failure;
  try {
    try {
      if (number < 0) {
        throw CheckpointError("checkpoint number " + std::to_string(number) +
                              " is negative; number checkpoints from 0 (epochs, steps)");
      }
      location.emplace(directory_, chief, workers.rank());
      const fs::path final_path = location->dir() / name;
      const auto final_status = fs::symlink_status(final_path);
      if (fs::exists(final_status) && !fs::is_directory(final_status)) {
        throw CheckpointError(final_path.string() +
                              " exists and is not a checkpoint directory; move it away or "
                              "choose another prefix");
      }
      const auto pointer_status = fs::symlink_status(location->dir() / kPointerFile);
      if (fs::exists(pointer_status) && !fs::is_regular_file(pointer_status)) {
        throw CheckpointError((location->dir() / kPointerFile).string() +
                              " is in the way: the checkpoint pointer file must be a file; "
                              "move it away");
      }
      if (const std::string bad = first_non_finite(data.model); !bad.empty()) {
        throw CheckpointError("the model's " + bad +
                              " holds non-finite values (NaN or infinity): the training diverged, "
                              "and a checkpoint of it would be the newest one to resume from");
      }
      if (chief) check_fence(directory_, data, name); // before writing; again under the lock
      staged.emplace(location->dir(), name);
      write_files(staged->path(), data, number, workers.size(), workers.options().checkpoint_key);
      if (!chief) {
        const Commit done = commit(*staged, location->dir(), name, max_to_keep_);
        delete_old(location->dir(), done.to_delete, log);
      }
    } catch (const std::exception& e) {
      throw CheckpointError("cannot save checkpoint " + name + " in " +
                            (location ? location->dir() : directory_).string() + ": " + e.what() +
                            ". " + intact);
    }
  } catch (...) {
    failure = std::current_exception();
  }

  // Everyone learns whether everyone succeeded, and whether all saved the same number.
  const collective::Agreement agreed = collective::agree(workers, !failure, number);
  if (failure) std::rethrow_exception(failure); // destructors remove what this worker wrote
  if (!agreed.all) {
    throw CheckpointError("saving checkpoint " + name +
                          " failed on another worker; see its output. " + intact);
  }
  if (!agreed.same()) {
    throw CheckpointError("workers saved different checkpoint numbers (" +
                          std::to_string(agreed.min) + " to " + std::to_string(agreed.max) +
                          "); every worker must call save() at the same step with the same "
                          "number. " +
                          intact);
  }

  // Phase 2, the chief: move it into place, then the pointer, then delete beyond max_to_keep.
  if (chief) {
    try {
      std::optional<detail::DirectoryFlock> fence_lock;
      if (data.generation >= 0) fence_lock.emplace(directory_);
      check_fence(directory_, data, name);
      const Commit done = commit(*staged, directory_, name, max_to_keep_);
      if (!done.warning.empty()) log.warn(done.warning);
      delete_old(directory_, done.to_delete, log);
      sweep_debris(directory_, prefix_, log);
    } catch (const std::exception& e) {
      failure = std::make_exception_ptr(CheckpointError("cannot save checkpoint " + name + " in " +
                                                        directory_.string() + ": " + e.what() +
                                                        ". " + intact));
    }
  }
  const bool committed = collective::all_true(workers, !failure);
  if (failure) std::rethrow_exception(failure);
  if (!committed) {
    throw CheckpointError("saving checkpoint " + name + " failed on the chief; see its output. " +
                          intact);
  }
  return directory_ / name;
}

std::optional<fs::path> CheckpointManager::latest() const {
  const auto pointer = read_pointer(directory_);
  if (!pointer) return std::nullopt;
  return resolve(directory_, pointer->model_checkpoint_path);
}

std::vector<fs::path> CheckpointManager::checkpoints() const {
  std::vector<fs::path> out;
  const auto pointer = read_pointer(directory_);
  if (!pointer) return out;
  for (const auto& entry : pointer->all_model_checkpoint_paths) {
    out.push_back(resolve(directory_, entry));
  }
  return out;
}

// ---- reading ------------------------------------------------------------------------------------

namespace {
// Whether the manifest has a checksum file (version 1 checkpoints have none); CheckpointError
// when it does and the manifest does not match it.
bool check_manifest_checksum(const fs::path& checkpoint_dir, const std::string& manifest_text) {
  const fs::path file = checkpoint_dir / kManifestChecksumFile;
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(file, ec))) return false;
  const std::string line = read_text(file);
  const std::string expected = line.substr(0, line.find_first_of(" \n"));
  const std::string actual = base::sha256_hex(manifest_text.data(), manifest_text.size());
  if (expected != actual) {
    throw CheckpointError((checkpoint_dir / kManifestFile).string() + ": SHA-256 is " + actual +
                          ", " + kManifestChecksumFile + " says " +
                          (expected.empty() ? std::string("nothing") : expected.substr(0, 64)) +
                          "; the manifest (the training state: epoch, step, position) changed "
                          "after it was written. " +
                          restore_advice(checkpoint_dir));
  }
  return true;
}
// With the cluster token: the manifest's HMAC under it, which only a holder of the token writes.
void check_manifest_mac(const fs::path& checkpoint_dir, const std::string& manifest_text,
                        const std::string& key) {
  const fs::path file = checkpoint_dir / kManifestMacFile;
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(file, ec))) {
    throw CheckpointError(file.string() +
                          ": missing, and this job has a cluster token: the "
                          "checkpoint was saved without one (or its key was removed), so nothing "
                          "shows that its training state came from a holder of the token. " +
                          restore_advice(checkpoint_dir));
  }
  const std::string line = read_text(file);
  const std::string expected = line.substr(0, line.find_first_of(" \n"));
  if (expected != base::hmac_sha256_hex(key, manifest_text)) {
    throw CheckpointError((checkpoint_dir / kManifestFile).string() +
                          ": its HMAC under this "
                          "job's cluster token is not the one " +
                          kManifestMacFile +
                          " holds: the manifest (the training state) was changed by someone "
                          "without the token, or saved under another token. " +
                          restore_advice(checkpoint_dir));
  }
}
} // namespace

CheckpointData read_checkpoint(const fs::path& checkpoint_dir,
                               const std::optional<std::string>& key) {
  const fs::path manifest_path = checkpoint_dir / kManifestFile;
  if (!fs::is_directory(checkpoint_dir)) {
    throw CheckpointError(checkpoint_dir.string() +
                          ": no such checkpoint directory; check the path");
  }
  if (!fs::exists(manifest_path)) {
    throw CheckpointError(manifest_path.string() +
                          ": missing, so this is not a complete flotilla checkpoint (a save "
                          "that does not finish never gets a checkpoint's name). " +
                          restore_advice(checkpoint_dir));
  }
  const std::string manifest_text = read_text(manifest_path);
  const bool has_checksum = check_manifest_checksum(checkpoint_dir, manifest_text);
  if (key) check_manifest_mac(checkpoint_dir, manifest_text, *key);
  const detail::Manifest manifest = detail::parse_manifest(
      manifest_text, manifest_path,
      {kCheckpointFormat, kCheckpointFormatVersion, {kModelFile, kOptimizerFile}});
  if (!has_checksum && manifest.format_version >= 2) {
    throw CheckpointError((checkpoint_dir / kManifestChecksumFile).string() +
                          ": missing, though the manifest is of format version " +
                          std::to_string(manifest.format_version) +
                          ", which has one; the checkpoint is incomplete. " +
                          restore_advice(checkpoint_dir));
  }
  CheckpointData data;
  data.epoch = manifest.epoch;
  data.step = manifest.step;
  data.policy = manifest.policy;
  data.generation = manifest.generation;
  data.state = manifest.state;
  for (const auto& entry : manifest.files) {
    const fs::path path = checkpoint_dir / entry.name;
    std::error_code ec;
    const auto bytes = fs::file_size(path, ec);
    if (ec) {
      throw CheckpointError(path.string() + ": missing (" + ec.message() +
                            "), though the manifest lists it; the checkpoint is incomplete. " +
                            restore_advice(checkpoint_dir));
    }
    if (bytes != entry.bytes) {
      throw CheckpointError(path.string() + ": " + std::to_string(bytes) +
                            " bytes, the manifest says " + std::to_string(entry.bytes) +
                            "; the file is truncated or damaged. " +
                            restore_advice(checkpoint_dir));
    }
    const std::string actual_hash = base::sha256_file(path);
    if (actual_hash != entry.sha256) {
      throw CheckpointError(path.string() + ": SHA-256 is " + actual_hash + ", the manifest says " +
                            entry.sha256 + "; the file changed after it was written (damaged). " +
                            restore_advice(checkpoint_dir));
    }
  }
  data.model = load_tensors(checkpoint_dir / kModelFile);
  data.optimizer = load_tensors(checkpoint_dir / kOptimizerFile);
  return data;
}

std::optional<CheckpointData> restore_latest(const fs::path& directory,
                                             std::vector<std::string>* skipped,
                                             fs::path* restored_from,
                                             const AcceptCheckpoint& accept,
                                             const std::optional<std::string>& key) {
  if (!fs::is_directory(directory)) return std::nullopt;
  std::vector<fs::path> candidates;
  auto add = [&](const fs::path& path) {
    if (std::find(candidates.begin(), candidates.end(), path) == candidates.end()) {
      candidates.push_back(path);
    }
  };
  try {
    if (const auto pointer = read_pointer(directory)) {
      add(resolve(directory, pointer->model_checkpoint_path));
      const auto& all = pointer->all_model_checkpoint_paths;
      for (auto it = all.rbegin(); it != all.rend(); ++it) add(resolve(directory, *it));
    }
  } catch (const CheckpointError& e) {
    if (skipped) skipped->push_back(e.what());
  }
  // Last resort: checkpoint directories the pointer does not name, highest number first.
  std::vector<std::pair<std::int64_t, fs::path>> others;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(directory, ec)) {
    const std::string name = entry.path().filename().string();
    const std::size_t dash = name.rfind('-');
    if (name.empty() || name.front() == '.' || dash == std::string::npos ||
        dash + 1 == name.size() || name.size() - dash > 19 ||
        !std::all_of(name.begin() + static_cast<std::ptrdiff_t>(dash) + 1, name.end(),
                     [](unsigned char c) { return std::isdigit(c); }) ||
        !fs::exists(entry.path() / kManifestFile)) {
      continue;
    }
    others.emplace_back(std::stoll(name.substr(dash + 1)), entry.path());
  }
  std::sort(others.begin(), others.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  for (const auto& other : others) add(other.second);

  for (const auto& candidate : candidates) {
    try {
      CheckpointData data = read_checkpoint(candidate, key);
      if (accept) accept(data, candidate);
      if (restored_from) *restored_from = candidate;
      return data;
    } catch (const ConfigError&) {
      throw;
    } catch (const std::exception& e) {
      if (skipped) skipped->push_back(candidate.string() + ": " + e.what());
    }
  }
  return std::nullopt;
}

void detail::check_token(std::int64_t generation, std::int64_t update, std::int64_t disk_generation,
                         std::int64_t disk_update, const std::string& whose,
                         const std::string& where, const std::string& older_tail) {
  const std::string ours =
      "generation " + std::to_string(generation) + ", update " + std::to_string(update);
  const std::string theirs = where + " (generation " + std::to_string(disk_generation) +
                             ", update " + std::to_string(disk_update) + ")";
  if (disk_generation > generation) {
    throw CheckpointError("refused (fencing): " + whose + " of " + ours + ", and " + theirs +
                          ", was decided by a newer generation of the group: this process was "
                          "replaced (stopped or cut off, then expelled) and must not overwrite "
                          "its successor's work");
  }
  if (disk_update > update) {
    throw CheckpointError("refused (fencing): " + whose + " of " + ours + ", older than " + theirs +
                          older_tail);
  }
}

} // namespace flotilla::checkpoint
