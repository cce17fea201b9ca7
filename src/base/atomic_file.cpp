#include "flotilla/base/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

#include "flotilla/error.h"

namespace flotilla::base {
namespace {

std::string reason() {
  return std::strerror(errno);
}

} // namespace

AtomicFile::AtomicFile(std::filesystem::path target) : target_(std::move(target)) {
  std::random_device random;
  temp_ = target_;
  temp_ += ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(random());
  fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    throw CheckpointError("cannot create " + temp_.string() + " (" + reason() +
                          "); check that the directory exists and is writable");
  }
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(temp_.c_str());
  }
}

void AtomicFile::write(const void* data, std::size_t size) {
  const auto* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd_, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      throw CheckpointError("cannot write " + temp_.string() + " (" + reason() +
                            "); free disk space or choose another directory; " + target_.string() +
                            " was left as it was");
    }
    p += n;
    size -= static_cast<std::size_t>(n);
  }
}

void AtomicFile::commit() {
  if (::fsync(fd_) != 0) {
    throw CheckpointError("cannot flush " + temp_.string() + " to disk (" + reason() + ")");
  }
  ::close(fd_);
  fd_ = -1;
  if (::rename(temp_.c_str(), target_.c_str()) != 0) {
    const std::string why = reason();
    ::unlink(temp_.c_str());
    throw CheckpointError("cannot rename " + temp_.string() + " to " + target_.string() + " (" +
                          why + ")");
  }
  // The rename is durable only once the directory entry is.
  const auto dir = target_.has_parent_path() ? target_.parent_path() : std::filesystem::path(".");
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    ::fsync(dir_fd);
    ::close(dir_fd);
  }
}

void write_file_atomic(const std::filesystem::path& target, const std::string& contents) {
  AtomicFile file(target);
  file.write(contents);
  file.commit();
}

} // namespace flotilla::base
