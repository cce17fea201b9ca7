// The IDX format of MNIST and Fashion-MNIST: a big-endian magic (0x00000800 | dtype << 8 | ndim
// ... here unsigned bytes only, 0x0000080N), N big-endian 32-bit dimensions, then the data.
// gzip'd and raw files are both read.
#pragma once

#include <torch/types.h>

#include <string>
#include <vector>

#include "flotilla/data/dataset.h"

namespace flotilla::data {

// The file's contents as a uint8 tensor of its dimensions. DataError names the file and what
// was wrong: missing, not IDX (magic), truncated, or corrupt compression.
torch::Tensor read_idx(const std::string& path);

// The files read whole and sliced together along their first dimension: element i is
// (file0[i], file1[i], ...), e.g. idx_dataset({images, labels}). DataError if their first
// dimensions differ.
Dataset idx_dataset(const std::vector<std::string>& files);

} // namespace flotilla::data
