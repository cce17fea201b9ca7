// What flotilla wrote in a directory it saves into, and a lock that keeps a second job out.
// BackupAndRestore deletes its backups when a fit completes, so it must tell its own entries
// from the user's (it deletes only its own); two jobs sharing one backup directory would resume
// from and overwrite each other's backups, so the job using it holds a lock that names it.
#pragma once

#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace flotilla::checkpoint {

// The lock file BackupAndRestore keeps in its directory (directory_lock below).
inline constexpr const char* kLockFile = ".flotilla.lock";

// Whether `name` is one of a checkpoint's own files (the safetensors, the manifest and its
// checksum, or an atomic write's temporary of one of them).
bool is_checkpoint_file(const std::string& name);

// The entries of `directory` that a CheckpointManager with `prefix` did not write, sorted: all
// but its checkpoints "<prefix>-<n>" (directories holding only a checkpoint's files), its
// pointer file, the hidden debris of interrupted saves, and the names in `also_ours`. Empty
// when the directory does not exist.
std::vector<std::string> foreign_entries(const std::filesystem::path& directory,
                                         const std::string& prefix,
                                         const std::vector<std::string>& also_ours = {});

// Deletes one checkpoint directory (or the debris of a save), renaming it to a hidden name first
// so no reader sees it half deleted, then removing its files one by one. One holding anything
// but a checkpoint's files is left whole, and CheckpointError names what is in it.
void remove_checkpoint_directory(const std::filesystem::path& dir);

// Deletes what a CheckpointManager with `prefix` wrote in `directory` (its checkpoints, pointer
// file and debris), and nothing else. Returns what could not be deleted, one reason each.
std::vector<std::string> remove_checkpoints(const std::filesystem::path& directory,
                                            const std::string& prefix);

// An advisory lock on a directory (flock on <directory>/.flotilla.lock) whose file holds a JSON
// record naming the holder. The kernel drops the lock when the holding process ends however it
// ends, so a crashed job leaves no stale lock, only its record.
class DirectoryLock {
 public:
  DirectoryLock() = default;
  ~DirectoryLock(); // releases the lock; the file and its record stay
  DirectoryLock(DirectoryLock&& other) noexcept;
  DirectoryLock& operator=(DirectoryLock&& other) noexcept;
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

  // Takes the lock of `directory` (which must exist) and writes `record` into its file. When
  // another open file description holds it, returns an unheld lock and puts the holder's record
  // into `holder` (an empty object when it wrote none). CheckpointError when the lock file
  // cannot be opened or is not a regular file.
  static DirectoryLock try_acquire(const std::filesystem::path& directory,
                                   const nlohmann::json& record, nlohmann::json& holder);
  // The record in `directory`'s lock file, held or not; nullopt without a readable one.
  static std::optional<nlohmann::json> record(const std::filesystem::path& directory);

  bool held() const { return fd_ >= 0; }
  // Deletes the lock file, then releases the lock (nothing when not held).
  void release_and_remove();

 private:
  int fd_ = -1;
  std::filesystem::path file_;
};

} // namespace flotilla::checkpoint
