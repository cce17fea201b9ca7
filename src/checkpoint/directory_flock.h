// Private: an exclusive flock on a checkpoint directory, held while a fenced save compares its
// token with the disk's and commits (two writers cannot both pass the check). Where the file
// system refuses locks on directories, the check runs unlocked.
#pragma once

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>

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

} // namespace flotilla::checkpoint::detail
