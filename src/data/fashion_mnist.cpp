#include "flotilla/data/fashion_mnist.h"

#include <filesystem>

#include "flotilla/data/idx.h"
#include "flotilla/data/image.h"
#include "flotilla/error.h"

namespace flotilla::data {
namespace {

std::string find_file(const std::string& dir, const std::string& stem) {
  namespace fs = std::filesystem;
  for (const char* suffix : {".gz", ""}) {
    const fs::path candidate = fs::path(dir) / (stem + suffix);
    if (fs::exists(candidate)) return candidate.string();
  }
  throw DataError(
      dir + ": has no " + stem + ".gz (nor " + stem +
      "); point data::fashion_mnist at the Fashion-MNIST IDX files, or on Debian install the "
      "dataset-fashion-mnist package (" +
      kFashionMnistDir + ")");
}

} // namespace

LabeledImages load_fashion_mnist(const std::string& dir, Split split) {
  const std::string prefix = split == Split::kTrain ? "train" : "t10k";
  const std::string images_path = find_file(dir, prefix + "-images-idx3-ubyte");
  const std::string labels_path = find_file(dir, prefix + "-labels-idx1-ubyte");
  torch::Tensor images = read_idx(images_path);
  torch::Tensor labels = read_idx(labels_path);
  if (images.dim() != 3 || images.size(1) != 28 || images.size(2) != 28) {
    throw DataError(images_path + ": holds " + std::to_string(images.dim()) +
                    "-dimensional data; expected N images of 28x28 (an idx3 image file)");
  }
  if (labels.dim() != 1 || labels.size(0) != images.size(0)) {
    throw DataError(labels_path + ": holds " + std::to_string(labels.numel()) + " labels for " +
                    std::to_string(images.size(0)) + " images in " + images_path +
                    "; the two files must come from the same split");
  }
  if (labels.numel() > 0 && labels.max().item<int>() > 9) {
    throw DataError(labels_path + ": has label " + std::to_string(labels.max().item<int>()) +
                    "; Fashion-MNIST labels are 0 to 9");
  }
  return {images.unsqueeze(1), labels.to(torch::kInt64)};
}

torch::Tensor normalize_images(const torch::Tensor& images) {
  return image::normalize(images, kFashionMnistMean, kFashionMnistStd);
}

Dataset fashion_mnist(const std::string& dir, Split split) {
  const std::string prefix = split == Split::kTrain ? "train" : "t10k";
  auto data = load_fashion_mnist(dir, split);
  return Dataset::from_file_tensors({data.images, data.labels},
                                    {find_file(dir, prefix + "-images-idx3-ubyte"),
                                     find_file(dir, prefix + "-labels-idx1-ubyte")});
}

} // namespace flotilla::data
