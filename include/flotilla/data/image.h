// Image preprocessing for batches of images [N, C, H, W] (or [N, H, W]). The random ones are
// stateless: the same images and seed give the same result, on any thread, in any process —
// seed them per batch from Dataset::random, and a run is reproducible and resumable.
#pragma once

#include <torch/types.h>

#include <cstdint>

namespace flotilla::data::image {

// uint8 pixels to float: (x / 255 - mean) / stddev.
torch::Tensor normalize(const torch::Tensor& images, double mean, double stddev);

// Each image's randomness is drawn from (seed, key): keys[i] (int64 [N]) when given — e.g. the
// images' positions from Dataset::enumerate(), so an image is augmented the same way however a
// batch is split across workers — else its index in the batch.

// Each image flipped left-right with probability 1/2.
torch::Tensor random_flip_left_right(const torch::Tensor& images, std::uint64_t seed,
                                     const torch::Tensor& keys = {});

// Each image padded with `padding` zeros on every side, then cropped back to its size at a
// uniformly random offset (the usual CIFAR/Fashion-MNIST augmentation).
torch::Tensor random_crop_with_padding(const torch::Tensor& images, std::int64_t padding,
                                       std::uint64_t seed, const torch::Tensor& keys = {});

} // namespace flotilla::data::image
