// Whole-or-nothing file writes: bytes go to a temporary file beside the target, which is
// fsync'd and renamed over it only by commit(). A crash or exception before commit() leaves the
// previous file untouched and no partial file under the target's name.
#pragma once

#include <cstddef>
#include <filesystem>
#include <string>

namespace flotilla::base {

class AtomicFile {
 public:
  explicit AtomicFile(std::filesystem::path target);
  ~AtomicFile(); // removes the temporary file unless committed
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, std::size_t size);
  void write(const std::string& text) { write(text.data(), text.size()); }
  // Flushes to disk, renames over the target, and syncs the directory.
  void commit();

 private:
  std::filesystem::path target_;
  std::filesystem::path temp_;
  int fd_ = -1;
};

// Convenience: the whole file at once.
void write_file_atomic(const std::filesystem::path& target, const std::string& contents);

} // namespace flotilla::base
