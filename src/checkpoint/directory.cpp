#include "flotilla/checkpoint/directory.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <random>

#include "flotilla/checkpoint/checkpoint_manager.h"
#include "flotilla/error.h"

namespace flotilla::checkpoint {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

bool starts_with(const std::string& text, const std::string& head) {
  return text.rfind(head, 0) == 0;
}

// "<prefix>-<digits>"
bool is_checkpoint_name(const std::string& name, const std::string& prefix) {
  const std::string head = prefix + "-";
  return starts_with(name, head) && name.size() > head.size() && name.size() - head.size() <= 18 &&
         std::all_of(name.begin() + static_cast<std::ptrdiff_t>(head.size()), name.end(),
                     [](unsigned char c) { return std::isdigit(c); });
}

// What an interrupted save or deletion leaves: ".<prefix>-<n>.tmp-*", ".<prefix>-<n>.old-*" and
// their ".deleting-*" forms (see checkpoint_manager.cpp).
bool is_debris_name(const std::string& name, const std::string& prefix) {
  return (starts_with(name, "." + prefix + "-") || starts_with(name, ".." + prefix + "-")) &&
         (name.find(".tmp-") != std::string::npos || name.find(".old-") != std::string::npos ||
          name.find(".deleting-") != std::string::npos);
}

// The names in `dir` that are not a checkpoint's files (subdirectories included).
std::vector<std::string> not_checkpoint_files(const fs::path& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    std::error_code type_error;
    if (!is_checkpoint_file(name) || !entry.is_regular_file(type_error)) out.push_back(name);
  }
  if (ec) out.push_back("(cannot list it: " + ec.message() + ")");
  std::sort(out.begin(), out.end());
  return out;
}

std::string random_suffix() {
  static thread_local std::mt19937_64 generator{std::random_device{}()};
  return std::to_string(generator() % 1000000000);
}

std::string joined(const std::vector<std::string>& names, std::size_t at_most = 5) {
  std::string out;
  for (std::size_t i = 0; i < names.size() && i < at_most; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > at_most) out += ", ... (" + std::to_string(names.size()) + " in all)";
  return out;
}

} // namespace

bool is_checkpoint_file(const std::string& name) {
  for (const char* own :
       {kModelFile, kOptimizerFile, kManifestFile, kManifestChecksumFile, kManifestMacFile}) {
    if (name == own || starts_with(name, std::string(own) + ".tmp-")) return true;
  }
  return false;
}

std::vector<std::string> foreign_entries(const fs::path& directory, const std::string& prefix,
                                         const std::vector<std::string>& also_ours) {
  std::vector<std::string> out;
  std::error_code ec;
  if (!fs::is_directory(directory, ec)) return out;
  for (const auto& entry : fs::directory_iterator(directory, ec)) {
    const std::string name = entry.path().filename().string();
    std::error_code type_error;
    const auto status = entry.symlink_status(type_error);
    bool ours = std::find(also_ours.begin(), also_ours.end(), name) != also_ours.end();
    if (name == kPointerFile || starts_with(name, std::string(kPointerFile) + ".tmp-")) {
      ours = fs::is_regular_file(status);
    } else if (is_checkpoint_name(name, prefix) || is_debris_name(name, prefix)) {
      ours = fs::is_directory(status) && not_checkpoint_files(entry.path()).empty();
    }
    if (!ours) out.push_back(fs::is_directory(status) ? name + "/" : name);
  }
  if (ec) out.push_back("(cannot list " + directory.string() + ": " + ec.message() + ")");
  std::sort(out.begin(), out.end());
  return out;
}

void remove_checkpoint_directory(const fs::path& dir) {
  const std::vector<std::string> foreign = not_checkpoint_files(dir);
  if (!foreign.empty()) {
    throw CheckpointError(dir.string() + " holds " + joined(foreign) +
                          ", which flotilla did not write, so it is left as it is: move what "
                          "you need out of it, then delete it by hand");
  }
  fs::path path = dir;
  const std::string name = dir.filename().string();
  if (!starts_with(name, ".")) { // out of readers' sight first
    const fs::path hidden = dir.parent_path() / ("." + name + ".deleting-" + random_suffix());
    if (::rename(dir.c_str(), hidden.c_str()) == 0) path = hidden;
  }
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(path, ec)) {
    std::error_code ignored;
    if (is_checkpoint_file(entry.path().filename().string())) fs::remove(entry.path(), ignored);
  }
  if (!fs::remove(path, ec) || ec) { // not empty: something arrived meanwhile
    throw CheckpointError("cannot delete " + path.string() + " (" +
                          (ec ? ec.message() : std::string("it is gone")) +
                          "); its checkpoint files are deleted, the rest is left as it is");
  }
}

std::vector<std::string> remove_checkpoints(const fs::path& directory, const std::string& prefix) {
  std::vector<std::string> problems;
  std::vector<fs::path> checkpoints;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(directory, ec)) {
    const std::string name = entry.path().filename().string();
    std::error_code type_error;
    const auto status = entry.symlink_status(type_error);
    if ((is_checkpoint_name(name, prefix) || is_debris_name(name, prefix)) &&
        fs::is_directory(status)) {
      checkpoints.push_back(entry.path());
    }
  }
  if (ec) return {"cannot list " + directory.string() + " (" + ec.message() + ")"};
  // The pointer first: a reader never finds it naming a checkpoint already gone.
  const fs::path pointer = directory / kPointerFile;
  if (fs::is_regular_file(fs::symlink_status(pointer, ec))) {
    fs::remove(pointer, ec);
    if (ec) problems.push_back("cannot delete " + pointer.string() + " (" + ec.message() + ")");
  }
  for (const auto& path : checkpoints) {
    try {
      remove_checkpoint_directory(path);
    } catch (const std::exception& e) {
      problems.push_back(e.what());
    }
  }
  return problems;
}

// ---- DirectoryLock ------------------------------------------------------------------------------

DirectoryLock::~DirectoryLock() {
  if (fd_ >= 0) ::close(fd_); // closing the last descriptor releases the flock
}

DirectoryLock::DirectoryLock(DirectoryLock&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), file_(std::move(other.file_)) {}

DirectoryLock& DirectoryLock::operator=(DirectoryLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    file_ = std::move(other.file_);
  }
  return *this;
}

std::optional<json> DirectoryLock::record(const fs::path& directory) {
  const fs::path file = directory / kLockFile;
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) return std::nullopt;
  std::string text;
  char buffer[4096];
  ssize_t n = 0;
  struct stat st {};
  if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) {
    while (text.size() < 65536 && (n = ::read(fd, buffer, sizeof buffer)) > 0) {
      text.append(buffer, static_cast<std::size_t>(n));
    }
  }
  ::close(fd);
  json parsed = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded() || !parsed.is_object()) return std::nullopt;
  return parsed;
}

DirectoryLock DirectoryLock::try_acquire(const fs::path& directory, const json& record,
                                         json& holder) {
  const fs::path file = directory / kLockFile;
  // A holder deletes the file as it releases it: a lock taken on a file since unlinked is no
  // lock, so take it again on the file that is there now.
  for (int attempt = 0; attempt < 8; ++attempt) {
    const int fd = ::open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0) {
      throw CheckpointError("cannot open the lock file " + file.string() + " (" +
                            std::strerror(errno) + "); check that " + directory.string() +
                            " is a writable directory and " + kLockFile + " a plain file in it");
    }
    struct stat opened {};
    if (::fstat(fd, &opened) != 0 || !S_ISREG(opened.st_mode)) {
      ::close(fd);
      throw CheckpointError(file.string() + " is not a plain file; move it away");
    }
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int error = errno;
      ::close(fd);
      if (error != EWOULDBLOCK) {
        throw CheckpointError("cannot lock " + file.string() + " (" + std::strerror(error) + ")");
      }
      holder = DirectoryLock::record(directory).value_or(json::object());
      return {};
    }
    struct stat now {};
    if (::stat(file.c_str(), &now) != 0 || now.st_ino != opened.st_ino ||
        now.st_dev != opened.st_dev) {
      ::close(fd);
      continue;
    }
    const std::string text = record.dump(2) + "\n";
    const bool written =
        ::ftruncate(fd, 0) == 0 &&
        ::pwrite(fd, text.data(), text.size(), 0) == static_cast<ssize_t>(text.size()) &&
        ::fsync(fd) == 0;
    if (!written) {
      const int error = errno;
      ::close(fd);
      throw CheckpointError("cannot write " + file.string() + " (" + std::strerror(error) + ")");
    }
    DirectoryLock lock;
    lock.fd_ = fd;
    lock.file_ = file;
    return lock;
  }
  throw CheckpointError("cannot lock " + file.string() +
                        ": it was deleted and made again 8 times while trying; is another job "
                        "starting on this directory at the same time?");
}

void DirectoryLock::release_and_remove() {
  if (fd_ < 0) return;
  std::error_code ignored;
  fs::remove(file_, ignored);
  ::close(fd_);
  fd_ = -1;
}

} // namespace flotilla::checkpoint
