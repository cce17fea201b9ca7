#include "flotilla/data/idx.h"

#include <sys/stat.h>
#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <memory>

#include "data/idx_format.h"
#include "flotilla/error.h"

namespace flotilla::data {
namespace {

struct GzCloser {
  void operator()(gzFile_s* f) const { gzclose(f); }
};
using GzFile = std::unique_ptr<gzFile_s, GzCloser>;

} // namespace

Dataset idx_dataset(const std::vector<std::string>& files) {
  Element tensors;
  for (const auto& f : files) tensors.push_back(read_idx(f));
  for (std::size_t i = 1; i < tensors.size(); ++i) {
    if (tensors[i].size(0) != tensors[0].size(0)) {
      throw DataError(files[i] + ": holds " + std::to_string(tensors[i].size(0)) + " items, " +
                      files[0] + " holds " + std::to_string(tensors[0].size(0)) +
                      "; idx_dataset pairs files item by item");
    }
  }
  return Dataset::from_file_tensors(std::move(tensors), files);
}

torch::Tensor read_idx(const std::string& path) {
  GzFile file(gzopen(path.c_str(), "rb"));
  if (!file) {
    throw DataError(path + ": cannot open (" + std::strerror(errno) +
                    "); give the directory that holds the IDX files, or on Debian install "
                    "the dataset-fashion-mnist package");
  }
  // An uncompressed file's size is known: a truncated one is refused before reading.
  struct stat info {};
  std::optional<std::int64_t> stored_size;
  if (gzdirect(file.get()) && ::stat(path.c_str(), &info) == 0) stored_size = info.st_size;
  auto array = detail::read_idx_array(file.get(), path, stored_size);
  if (array.data.empty()) return torch::empty(array.dims, torch::kUInt8);
  // The tensor takes the bytes over: no copy of a 47 MB image file.
  auto bytes = std::make_shared<std::vector<std::uint8_t>>(std::move(array.data));
  return torch::from_blob(
      bytes->data(), array.dims, [bytes](void*) mutable { bytes.reset(); }, torch::kUInt8);
}

} // namespace flotilla::data
