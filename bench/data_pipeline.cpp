// flotilla's side of `make bench-data`: the Fashion-MNIST input pipeline, timed end to end.
//   element order (the issue's):  map(normalize, flip, crop) -> shuffle(10000) -> batch(256) ->
//   prefetch batch order (the seeds'):     shuffle(10000) -> batch(256) -> map(normalize, flip,
//   crop) -> prefetch
//   folder (images as files):    image_dataset_from_directory(dir, grayscale, SIZE x SIZE,
//                                 batch 256, shuffled) -> map(normalize) -> prefetch
// map and prefetch use AUTOTUNE. Prints one JSON line: elements per second over `epochs` passes,
// after one untimed pass.
// Usage: data_pipeline [element|batch] [epochs] [data_dir]
//        data_pipeline folder epochs class_folder_dir size
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "flotilla/data/dataset.h"
#include "flotilla/data/fashion_mnist.h"
#include "flotilla/data/image.h"
#include "flotilla/data/image_folder.h"

using namespace flotilla::data;

// Elements per second over `epochs` passes after an untimed one, as one JSON line.
int run(const Dataset& ds, const std::string& pipeline, int epochs) {
  double checksum = 0;
  std::int64_t elements = 0;
  double seconds = 0;
  for (int epoch = 0; epoch <= epochs; ++epoch) {
    const auto start = std::chrono::steady_clock::now();
    std::int64_t n = 0;
    auto it = ds.make_iterator();
    while (auto batch = it.next()) {
      n += (*batch)[1].size(0);
      checksum += (*batch)[0][0][0][14][14].item<float>(); // touch the output
    }
    if (epoch == epochs && std::getenv("FLOTILLA_BENCH_STATS")) {
      for (const auto& s : it.stats()) {
        std::fprintf(
            stderr,
            "%-14s elements %8lld  latency %8.1f us  wait %.3f  parallelism %lld  buffer %lld%s\n",
            s.name.c_str(), static_cast<long long>(s.elements), s.mean_latency_us,
            s.consumer_wait_share, static_cast<long long>(s.parallelism),
            static_cast<long long>(s.buffer_size), s.autotuned ? " (autotuned)" : "");
      }
    }
    if (epoch == 0) continue; // warm-up: autotune settles, pages are in memory
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    elements += n;
  }
  std::printf("{\"bench\":\"data\",\"system\":\"flotilla\",\"pipeline\":\"%s\",\"metric\":"
              "\"elements_per_s\","
              "\"value\":%.0f,\"epochs\":%d,\"checksum\":%.3f}\n",
              pipeline.c_str(), static_cast<double>(elements) / seconds, epochs, checksum);
  return 0;
}

int main(int argc, char** argv) {
  const std::string order = argc > 1 ? argv[1] : "element";
  const int epochs = argc > 2 ? std::atoi(argv[2]) : 3;
  const std::string dir = argc > 3 ? argv[3] : kFashionMnistDir;
  const std::uint64_t seed = 7;

  // Normalise, flip and crop a batch [N, 1, 28, 28] (one image is a batch of one).
  auto preprocess = [](const torch::Tensor& images, std::uint64_t s) {
    auto x = image::random_flip_left_right(images, s);
    x = image::random_crop_with_padding(x, 2, s ^ 0x9e3779b9u);
    return normalize_images(x);
  };
  if (order == "folder") {
    ImageFolderOptions o;
    o.color_mode = ColorMode::kGrayscale;
    const std::int64_t size = argc > 4 ? std::atoll(argv[4]) : 28;
    o.image_size = {size, size};
    o.batch_size = 256;
    o.seed = seed;
    const Dataset ds = image_dataset_from_directory(dir, o)
                           .dataset
                           .map([](Element e) { return Element{image::normalize(e[0], kFashionMnistMean, kFashionMnistStd), e[1]}; }, kAutotune)
                           .prefetch(kAutotune);
    return run(ds, order + " " + std::to_string(size), epochs);
  }
  Dataset source = fashion_mnist(dir, Split::kTrain);
  Dataset ds = source;
  if (order == "element") {
    ds = Dataset::zip({source, Dataset::random(seed)})
             .map(
                 [&](Element e) {
                   const auto s = static_cast<std::uint64_t>(e[2].item<std::int64_t>());
                   return Element{preprocess(e[0].unsqueeze(0), s).squeeze(0), e[1]};
                 },
                 kAutotune)
             .shuffle(10000, seed)
             .batch(256)
             .prefetch(kAutotune);
  } else {
    ds = Dataset::zip({source.shuffle(10000, seed).batch(256), Dataset::random(seed)})
             .map(
                 [&](Element e) {
                   const auto s = static_cast<std::uint64_t>(e[2].item<std::int64_t>());
                   return Element{preprocess(e[0], s), e[1]};
                 },
                 kAutotune)
             .prefetch(kAutotune);
  }
  return run(ds, order, epochs);
}
