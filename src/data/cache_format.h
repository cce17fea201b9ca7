// Private: the file behind Dataset::cache(filename), read back. Layout: "FLOTILLA-CACHE-1\n", the
// input's fingerprint (u64 length + bytes), the elements (u32 arity; per tensor: i8 dtype code,
// u8 ndim, i64 dims, u64 bytes, data), the marker u32 0xFFFFFFFF, a u64 count and "END\n".
// Host byte order; written to a temporary name and renamed when complete (buffers.cpp).
// The reader is torch-free, so it can be fuzzed on its own: the file may be damaged, or written
// by someone else into a shared directory, so every length it claims is checked against the
// bytes left before anything is allocated from it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <istream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace flotilla::data::detail {

inline constexpr char kCacheMagic[] = "FLOTILLA-CACHE-1\n";
inline constexpr char kCacheEnd[] = "END\n";
inline constexpr std::uint32_t kCacheCountMarker = 0xFFFFFFFFu;

// Bytes per element of the dtype with this code; 0 if no cached tensor may have it.
using CacheElementSize = std::size_t (*)(std::int8_t code);

struct CacheTensorHeader {
  std::int8_t dtype = 0;
  std::vector<std::int64_t> dims;
  std::uint64_t bytes = 0; // = product(dims) * element size, and no more than the bytes left
};

class CacheReader {
 public:
  // `in` holds `size` bytes from its current position; `path` names the file in errors.
  CacheReader(std::unique_ptr<std::istream> in, std::uint64_t size, std::string path,
              CacheElementSize element_size);
  static CacheReader open(const std::string& path, CacheElementSize element_size);

  std::string fingerprint();                 // the magic and the fingerprint: call first
  std::optional<std::uint32_t> next_arity(); // an element's tensor count; nullopt at the marker
  CacheTensorHeader tensor_header();
  void read_into(void* out, std::size_t n); // a tensor's data, after its header

 private:
  template <class T> T read() {
    T v{};
    read_into(&v, sizeof v);
    return v;
  }
  [[noreturn]] void ends_early() const;

  std::unique_ptr<std::istream> in_;
  std::uint64_t left_; // bytes after the read position, counted as the reads go
  std::string path_;
  CacheElementSize element_size_;
};

// The fingerprint at the head of a complete cache file, or "" if absent or incomplete.
std::string cached_fingerprint(const std::string& path);

} // namespace flotilla::data::detail
