// The preprocessing ops run once per image or batch on the input pipeline's threads, thousands
// of times a second: each is one pass over the pixels in plain loops (uint8 and float32), with
// per-image randomness from a counter-based hash of (seed, image index) — no generator objects,
// no chains of small tensor ops.
#include "flotilla/data/image.h"

#include "flotilla/error.h"

namespace flotilla::data::image {
namespace {

void check_batch(const torch::Tensor& images, const char* what) {
  if (images.dim() < 3) {
    throw DataError(std::string(what) + " needs a batch of images [N, C, H, W] or [N, H, W]; saw " +
                    std::to_string(images.dim()) + " dimensions");
  }
  if (images.scalar_type() != torch::kUInt8 && images.scalar_type() != torch::kFloat32) {
    throw DataError(std::string(what) + " handles uint8 and float32 images; saw " +
                    std::string(c10::toString(images.scalar_type())));
  }
}

// splitmix64 of (seed, i): independent, reproducible draws per image.
std::uint64_t draw(std::uint64_t seed, std::uint64_t i) {
  std::uint64_t x = seed + 0x9E3779B97F4A7C15ull * (i + 1);
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Calls fn(image index, planes per image, H, W, input, output) for each image; in and out are
// contiguous [N, planes, H, W] views of T.
template <class T, class Fn>
void for_each_image(const torch::Tensor& in, torch::Tensor& out, Fn&& fn) {
  const std::int64_t n = in.size(0), h = in.size(-2), w = in.size(-1);
  const std::int64_t planes = in.numel() / std::max<std::int64_t>(1, n * h * w);
  const T* src = in.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  for (std::int64_t i = 0; i < n; ++i) {
    fn(i, planes, h, w, src + i * planes * h * w, dst + i * planes * h * w);
  }
}

// Per-image keys: the given int64 [N] tensor, or 0..N-1.
std::vector<std::uint64_t> image_keys(const torch::Tensor& images, const torch::Tensor& keys,
                                      const char* what) {
  const std::int64_t n = images.size(0);
  std::vector<std::uint64_t> out(static_cast<std::size_t>(n));
  if (!keys.defined()) {
    for (std::int64_t i = 0; i < n; ++i)
      out[static_cast<std::size_t>(i)] = static_cast<std::uint64_t>(i);
    return out;
  }
  if (keys.dim() != 1 || keys.size(0) != n) {
    throw DataError(std::string(what) + ": keys must be one int64 per image ([" +
                    std::to_string(n) + "]); saw shape " + c10::str(keys.sizes()));
  }
  const torch::Tensor k = keys.to(torch::kCPU, torch::kInt64).contiguous();
  for (std::int64_t i = 0; i < n; ++i) {
    out[static_cast<std::size_t>(i)] = static_cast<std::uint64_t>(k.data_ptr<std::int64_t>()[i]);
  }
  return out;
}

template <class T>
void flip(const torch::Tensor& in, torch::Tensor& out, std::uint64_t seed,
          const std::vector<std::uint64_t>& keys) {
  for_each_image<T>(in, out,
                    [&](std::int64_t i, std::int64_t planes, std::int64_t h, std::int64_t w,
                        const T* src, T* dst) {
                      const bool mirror = draw(seed, keys[static_cast<std::size_t>(i)]) & 1;
                      for (std::int64_t r = 0; r < planes * h; ++r) {
                        const T* row = src + r * w;
                        T* to = dst + r * w;
                        if (mirror) {
                          for (std::int64_t x = 0; x < w; ++x) to[x] = row[w - 1 - x];
                        } else {
                          std::copy(row, row + w, to);
                        }
                      }
                    });
}

template <class T>
void crop(const torch::Tensor& in, torch::Tensor& out, std::int64_t padding, std::uint64_t seed,
          const std::vector<std::uint64_t>& keys) {
  const std::uint64_t span = static_cast<std::uint64_t>(2 * padding + 1);
  for_each_image<T>(in, out,
                    [&](std::int64_t i, std::int64_t planes, std::int64_t h, std::int64_t w,
                        const T* src, T* dst) {
                      const std::uint64_t r = draw(seed, keys[static_cast<std::size_t>(i)]);
                      // Offsets in the padded image, as a shift of the original: -padding..padding.
                      const std::int64_t dy = static_cast<std::int64_t>((r >> 8) % span) - padding;
                      const std::int64_t dx = static_cast<std::int64_t>((r >> 32) % span) - padding;
                      for (std::int64_t p = 0; p < planes; ++p) {
                        for (std::int64_t y = 0; y < h; ++y) {
                          T* to = dst + (p * h + y) * w;
                          const std::int64_t sy = y + dy;
                          if (sy < 0 || sy >= h) {
                            std::fill(to, to + w, T(0));
                            continue;
                          }
                          const T* row = src + (p * h + sy) * w;
                          for (std::int64_t x = 0; x < w; ++x) {
                            const std::int64_t sx = x + dx;
                            to[x] = sx >= 0 && sx < w ? row[sx] : T(0);
                          }
                        }
                      }
                    });
}

} // namespace

torch::Tensor normalize(const torch::Tensor& images, double mean, double stddev) {
  if (!(stddev > 0)) {
    throw ConfigError("normalize: stddev must be positive; saw " + std::to_string(stddev));
  }
  const float scale = static_cast<float>(1.0 / (255.0 * stddev));
  const float shift = static_cast<float>(mean / stddev);
  if (images.scalar_type() != torch::kUInt8 || images.device().type() != torch::kCPU) {
    return images.to(torch::kFloat32).mul(scale).sub(shift); // never in place: it may be a view
  }
  const torch::Tensor in = images.contiguous();
  torch::Tensor out = torch::empty(in.sizes(), torch::kFloat32);
  const std::uint8_t* src = in.data_ptr<std::uint8_t>();
  float* dst = out.data_ptr<float>();
  const std::int64_t n = in.numel();
  for (std::int64_t k = 0; k < n; ++k) dst[k] = static_cast<float>(src[k]) * scale - shift;
  return out;
}

torch::Tensor random_flip_left_right(const torch::Tensor& images, std::uint64_t seed,
                                     const torch::Tensor& keys) {
  check_batch(images, "random_flip_left_right");
  const auto k = image_keys(images, keys, "random_flip_left_right");
  const torch::Tensor in = images.contiguous().cpu();
  torch::Tensor out = torch::empty_like(in);
  if (in.scalar_type() == torch::kUInt8) {
    flip<std::uint8_t>(in, out, seed, k);
  } else {
    flip<float>(in, out, seed, k);
  }
  return out;
}

torch::Tensor random_crop_with_padding(const torch::Tensor& images, std::int64_t padding,
                                       std::uint64_t seed, const torch::Tensor& keys) {
  check_batch(images, "random_crop_with_padding");
  const auto k = image_keys(images, keys, "random_crop_with_padding");
  if (padding < 0) {
    throw ConfigError("random_crop_with_padding: padding must be >= 0; saw " +
                      std::to_string(padding));
  }
  if (padding == 0) return images;
  const torch::Tensor in = images.contiguous().cpu();
  torch::Tensor out = torch::empty_like(in);
  if (in.scalar_type() == torch::kUInt8) {
    crop<std::uint8_t>(in, out, padding, seed, k);
  } else {
    crop<float>(in, out, padding, seed, k);
  }
  return out;
}

} // namespace flotilla::data::image
