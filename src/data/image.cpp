#include "flotilla/data/image.h"

#include <ATen/CPUGeneratorImpl.h>

#include "flotilla/error.h"

namespace flotilla::data::image {
namespace {

void check_batch(const torch::Tensor& images, const char* what) {
  if (images.dim() < 3) {
    throw DataError(std::string(what) + " needs a batch of images [N, C, H, W] or [N, H, W]; saw " +
                    std::to_string(images.dim()) + " dimensions");
  }
}

// [N, 1, 1, ...] so a per-image value broadcasts over the image's own dimensions.
std::vector<std::int64_t> per_image_shape(const torch::Tensor& images) {
  std::vector<std::int64_t> shape(static_cast<std::size_t>(images.dim()), 1);
  shape[0] = images.size(0);
  return shape;
}

} // namespace

torch::Tensor normalize(const torch::Tensor& images, double mean, double stddev) {
  if (!(stddev > 0))
    throw ConfigError("normalize: stddev must be positive; saw " + std::to_string(stddev));
  return images.to(torch::kFloat32).mul_(1.0 / (255.0 * stddev)).sub_(mean / stddev);
}

torch::Tensor random_flip_left_right(const torch::Tensor& images, std::uint64_t seed) {
  check_batch(images, "random_flip_left_right");
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  const torch::Tensor flip =
      torch::randint(0, 2, {images.size(0)}, generator, torch::kInt64).to(torch::kBool);
  return torch::where(flip.view(per_image_shape(images)), images.flip({-1}), images);
}

torch::Tensor random_crop_with_padding(const torch::Tensor& images, std::int64_t padding,
                                       std::uint64_t seed) {
  check_batch(images, "random_crop_with_padding");
  if (padding < 0)
    throw ConfigError("random_crop_with_padding: padding must be >= 0; saw " +
                      std::to_string(padding));
  if (padding == 0)
    return images;
  const std::int64_t n = images.size(0);
  const std::int64_t h = images.size(-2), w = images.size(-1);
  const torch::Tensor padded =
      torch::constant_pad_nd(images, {padding, padding, padding, padding}, 0);
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  const torch::Tensor offsets =
      torch::randint(0, 2 * padding + 1, {n, 2}, generator, torch::kInt64).contiguous();
  const auto* o = offsets.data_ptr<std::int64_t>();
  torch::Tensor out = torch::empty_like(images);
  for (std::int64_t i = 0; i < n; ++i) {
    out[i].copy_(padded[i].narrow(-2, o[2 * i], h).narrow(-1, o[2 * i + 1], w));
  }
  return out;
}

} // namespace flotilla::data::image
