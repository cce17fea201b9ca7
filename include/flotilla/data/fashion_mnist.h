// Fashion-MNIST (60,000 training and 10,000 test images of 28×28 clothing items, 10 classes)
// from its IDX files; Debian's dataset-fashion-mnist installs them in kFashionMnistDir.
#pragma once

#include <torch/types.h>

#include <string>

#include "flotilla/data/dataset.h"

namespace flotilla::data {

inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

enum class Split { kTrain, kTest };

struct LabeledImages {
  torch::Tensor images; // uint8 [N, 1, 28, 28]
  torch::Tensor labels; // int64 [N], 0..9
};

// Reads {train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz] from `dir`.
LabeledImages load_fashion_mnist(const std::string& dir, Split split);

// The split as a Dataset of (image uint8 [1, 28, 28], label int64 scalar), in file order.
Dataset fashion_mnist(const std::string& dir, Split split);

// uint8 pixels to float, standardised with Fashion-MNIST's training mean and deviation.
torch::Tensor normalize_images(const torch::Tensor& images);
inline constexpr double kFashionMnistMean = 0.2860;
inline constexpr double kFashionMnistStd = 0.3530;

} // namespace flotilla::data
