// Private: JPEG and PNG files to 8-bit pixels, for image_dataset_from_directory. No LibTorch, so
// it can be fuzzed on its own: an image folder may hold anything its writers put there.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace flotilla::data::detail {

struct Pixels {
  std::int64_t channels = 0, height = 0, width = 0;
  std::vector<std::uint8_t> chw; // channels x height x width, row-major
};

// The whole file at `path`, which must be a regular file (a link to one is followed) of at most
// 256 MiB; DataError otherwise (a FIFO, a device, a directory: what it is).
std::string read_image_file(const std::string& path);

// `bytes` (a JPEG or PNG; its kind from its first bytes, not the file name) as 1 channel (`grey`)
// or 3. The size a header claims is refused above 2^28 pixels before anything is allocated.
// DataError naming `path` for anything else, a damaged image included.
Pixels decode_image_bytes(const std::string& bytes, const std::string& path, bool grey);

} // namespace flotilla::data::detail
