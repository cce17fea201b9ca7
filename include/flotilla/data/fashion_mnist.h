// Fashion-MNIST (60,000 training and 10,000 test images of 28×28 clothing items, 10 classes)
// from its IDX files; Debian's dataset-fashion-mnist installs them in kFashionMnistDir.
#pragma once

#include <torch/types.h>

#include <string>

namespace flotilla::data {

inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

enum class Split { kTrain, kTest };

struct LabeledImages {
  torch::Tensor images; // uint8 [N, 1, 28, 28]
  torch::Tensor labels; // int64 [N], 0..9
};

// Reads {train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz] from `dir`.
LabeledImages load_fashion_mnist(const std::string& dir, Split split);

// uint8 pixels to float, standardised with Fashion-MNIST's training mean and deviation.
torch::Tensor normalize_images(const torch::Tensor& images);

} // namespace flotilla::data
