// Private: the IDX format read from an open zlib stream into plain bytes, without LibTorch, so
// that the checks on untrusted input can be fuzzed on their own (tests/fuzz). read_idx wraps the
// bytes in a tensor.
#pragma once

#include <zlib.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace flotilla::data::detail {

struct IdxArray {
  std::vector<std::int64_t> dims;
  std::vector<std::uint8_t> data; // row-major, product(dims) bytes
};

// Reads one IDX array from `file` (gzread passes uncompressed files through). `stored_size` is
// the file's size when it is not compressed, so that a truncated one is refused before reading.
// Memory grows with the bytes actually read, never with what the header merely claims.
// DataError names `path` and what was wrong: not IDX (magic), truncated, or corrupt compression.
IdxArray read_idx_array(gzFile file, const std::string& path,
                        std::optional<std::int64_t> stored_size);

} // namespace flotilla::data::detail
