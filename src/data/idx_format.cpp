#include "data/idx_format.h"

#include <algorithm>
#include <cstdio>
#include <new>
#include <sstream>

#include "flotilla/error.h"

namespace flotilla::data::detail {
namespace {

std::string hex(std::uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

// Reads exactly n bytes or says why not (end of data, or zlib's error).
std::size_t read_some(gzFile f, void* out, std::size_t n, const std::string& path) {
  std::size_t total = 0;
  auto* p = static_cast<unsigned char*>(out);
  while (total < n) {
    const unsigned chunk = static_cast<unsigned>(std::min<std::size_t>(n - total, 1u << 30));
    const int got = gzread(f, p + total, chunk);
    if (got < 0) {
      int code = 0;
      const char* message = gzerror(f, &code);
      if (code == Z_BUF_ERROR) break; // the compressed stream stops early: a truncated file
      throw DataError(path + ": cannot decompress (" + std::string(message) +
                      "); the file is corrupt: download or reinstall it");
    }
    if (got == 0) break;
    total += static_cast<std::size_t>(got);
  }
  return total;
}

} // namespace

IdxArray read_idx_array(gzFile file, const std::string& path,
                        std::optional<std::int64_t> stored_size) {
  unsigned char header[4];
  if (read_some(file, header, 4, path) != 4) {
    throw DataError(path + ": truncated: the file ends inside the 4-byte IDX magic number");
  }
  const std::uint32_t magic = (std::uint32_t{header[0]} << 24) | (std::uint32_t{header[1]} << 16) |
                              (std::uint32_t{header[2]} << 8) | header[3];
  const int ndim = header[3];
  if (header[0] != 0 || header[1] != 0 || header[2] != 0x08 || ndim < 1 || ndim > 4) {
    throw DataError(path + ": wrong magic number " + hex(magic) +
                    "; expected an unsigned-byte IDX file (0x00000801 to 0x00000804), such as "
                    "train-images-idx3-ubyte.gz");
  }
  IdxArray out;
  out.dims.resize(ndim);
  auto& dims = out.dims;
  std::int64_t count = 1;
  for (int d = 0; d < ndim; ++d) {
    unsigned char b[4];
    if (read_some(file, b, 4, path) != 4) {
      throw DataError(path + ": truncated: the file ends inside its dimension list (" +
                      std::to_string(ndim) + " dimensions expected)");
    }
    dims[d] =
        (std::int64_t{b[0]} << 24) | (std::int64_t{b[1]} << 16) | (std::int64_t{b[2]} << 8) | b[3];
    constexpr std::int64_t kMaxBytes = std::int64_t{1} << 40; // far beyond any IDX file
    if (dims[d] != 0 && count > kMaxBytes / dims[d]) {
      throw DataError(path + ": header claims more than 1 TiB of data (dimension " +
                      std::to_string(d) + " is " + std::to_string(dims[d]) +
                      "); the file is corrupt");
    }
    count *= dims[d];
  }
  auto truncated = [&](std::int64_t held) {
    std::ostringstream shape;
    for (int d = 0; d < ndim; ++d) shape << (d ? "x" : "") << dims[d];
    return DataError(path + ": truncated: the header promises " + shape.str() + " = " +
                     std::to_string(count) + " bytes of data, the file holds " +
                     std::to_string(held) + "; download or reinstall it");
  };
  const std::int64_t header_bytes = 4 + 4 * ndim;
  if (stored_size && *stored_size < header_bytes + count) {
    throw truncated(*stored_size - header_bytes);
  }
  // A compressed file's size says nothing about its contents, and its header may claim up to
  // 1 TiB: grow the buffer with what arrives (at most doubling) rather than trusting the claim.
  constexpr std::size_t kFirstChunk = std::size_t{1} << 20;
  const auto total = static_cast<std::size_t>(count);
  std::size_t held = 0;
  while (held < total) {
    const std::size_t want =
        stored_size ? total : std::min(total, std::max(kFirstChunk, 2 * held));
    try {
      out.data.resize(want);
    } catch (const std::bad_alloc&) {
      throw DataError(path + ": cannot allocate the " + std::to_string(want) +
                      " bytes its header promises; the file is corrupt or too large for memory");
    }
    const std::size_t got = read_some(file, out.data.data() + held, want - held, path);
    held += got;
    if (held < want) break;
  }
  if (held != total) throw truncated(static_cast<std::int64_t>(held));
  return out;
}

} // namespace flotilla::data::detail
