// Private: fencing in storage, shared by CheckpointManager (checkpoints, backups) and save_model
// (weights files). A save carries the token of the state it writes: the generation of the group
// that decided it and the updates applied. check_token() refuses one older than what is on disk;
// DirectoryFlock holds the directory while the check and the commit run, so two writers cannot
// both pass the check. Where the file system refuses locks on directories, the check runs
// unlocked.
#pragma once

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <filesystem>
#include <string>

namespace flotilla::checkpoint::detail {

class DirectoryFlock {
 public:
  explicit DirectoryFlock(const std::filesystem::path& dir) {
    fd_ = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd_ >= 0) {
      while (::flock(fd_, LOCK_EX) != 0 && errno == EINTR) {
      }
    }
  }
  ~DirectoryFlock() {
    if (fd_ >= 0) ::close(fd_); // releases the lock
  }
  DirectoryFlock(const DirectoryFlock&) = delete;
  DirectoryFlock& operator=(const DirectoryFlock&) = delete;

 private:
  int fd_ = -1;
};

// CheckpointError when the state on disk (`disk_generation`, `disk_update`) was decided by a
// newer generation than the writer's, or holds more updates. The message says "<whose> of
// generation G, update U", names the disk's state as `where` with its tokens, and ends the
// second refusal with `older_tail` (what replacing it would do; may be empty).
void check_token(std::int64_t generation, std::int64_t update, std::int64_t disk_generation,
                 std::int64_t disk_update, const std::string& whose, const std::string& where,
                 const std::string& older_tail);

} // namespace flotilla::checkpoint::detail
