// Images kept as files: keras.utils.image_dataset_from_directory for C++, and the JPEG/PNG
// decoder behind it (libjpeg-turbo, libpng).
//
// Keras's rules, followed exactly: the classes are the sub-folders of `directory` in sorted order
// (names starting with "." skipped), or the class_names given (a subset, in the order given);
// each class's files are found by walking its folder recursively (symbolic links to folders
// followed only with follow_links), folders in sorted path order and files in sorted name order,
// keeping names that end in .bmp, .gif, .jpeg, .jpg or .png (any case); the list is then
// shuffled with numpy's RandomState(seed).shuffle (the same MT19937 draws, so the same order),
// and validation_split keeps the last int(split x files) for "validation", the rest for
// "training". A test compares the lists with Keras's on the same tree.
//
// Where flotilla differs, on purpose: images are channels first ([C, H, W], LibTorch's layout;
// Keras's is [H, W, C]); labels are int64 class indices (Keras's label_mode "int"; categorical,
// binary and None are not offered); BMP and GIF files are listed as Keras lists them but fail to
// decode with a DataError naming the file (only JPEG and PNG are decoded); a validation split
// that leaves either subset empty is a ConfigError rather than an empty dataset.
#pragma once

#include <torch/types.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "flotilla/data/dataset.h"

namespace flotilla::data {

enum class ColorMode {
  kGrayscale, // 1 channel (colour converted: libjpeg's Y for JPEG, Pillow's luma for PNG)
  kRgb,       // 3 channels (a grey image is repeated)
};

struct ImageFolderOptions {
  std::vector<std::string> class_names; // empty: the sub-folders, sorted
  ColorMode color_mode = ColorMode::kRgb;
  std::int64_t batch_size = 32; // 0: elements, not batches (Keras's batch_size=None)
  std::array<std::int64_t, 2> image_size = {256, 256}; // height, width; bilinear resize
  bool shuffle = true;
  // The file list's shuffle and the dataset's (a buffer of 8 batches, or 1024 elements);
  // required with shuffle and validation_split, so that the subsets do not overlap.
  std::optional<std::uint64_t> seed;
  double validation_split = 0; // in (0, 1) with subset
  std::string subset;          // "training" or "validation" (Keras's "both": call twice)
  bool follow_links = false;
  // kFloat32: Keras's pixels, 0..255 in float. kUInt8: the same rounded to bytes, a quarter of
  // the memory in a cache or shuffle buffer (for a pipeline that normalises its batches itself).
  torch::Dtype dtype = torch::kFloat32;
};

struct ImageFolder {
  // Keras's dataset: [shuffle ->] map(decode and resize, AUTOTUNE) [-> batch] -> prefetch, of
  // (image [C, H, W] or batch [N, C, H, W], label int64 [] or [N]).
  Dataset dataset;
  std::vector<std::string> class_names;
  std::vector<std::string> file_paths; // the subset's files, in the order Keras gives them
  std::vector<std::int64_t> labels;    // their classes
  // The same files as a dataset of (path as a uint8 string tensor, label int64), unshuffled and
  // undecoded, and the decoder for its elements: to shuffle the cheap paths, shard them, and
  // decode after (each worker decodes only its own files under FILE auto-sharding).
  Dataset files;
  MapFn load;
};

// ConfigError for bad options or a directory without images; DataError naming the file for one
// that cannot be read (here) or decoded (at iteration).
ImageFolder image_dataset_from_directory(const std::string& directory,
                                         const ImageFolderOptions& options = {});

// One JPEG or PNG file's pixels: uint8 [C, H, W], C = 1 or 3 as `mode` says. JPEG decodes with
// libjpeg-turbo's accurate integer IDCT (JDCT_ISLOW, as Pillow does; TensorFlow's default is the
// fast one) and fancy upsampling; damaged data (libjpeg's truncation and corrupt-data warnings)
// is an error, never grey filler. PNG decodes with libpng's simplified API: palettes and low bit
// depths expanded, 16-bit samples scaled to 8, alpha dropped (not blended), colour to grey as
// ITU-R 601-2 luma (Pillow's convert("L")); a gAMA chunk other than sRGB's is applied by libpng.
// DataError naming the file, for unreadable, corrupt, truncated, oversized (> 2^28 pixels or a
// file over 256 MiB) and unsupported (GIF, BMP, CMYK JPEG, other) files, and for anything but a
// regular file (a FIFO, a device such as /dev/zero, a directory; links are followed), which is
// never read.
torch::Tensor decode_image(const std::string& path, ColorMode mode);

// Bilinear resize with half-pixel centres and no antialiasing (tf.image.resize's "bilinear", as
// Keras calls it): uint8 or float [C, H, W] in, float32 [C, height, width] out; the image itself
// (as float32) when it already has that size.
torch::Tensor resize_bilinear(const torch::Tensor& image, std::int64_t height, std::int64_t width);

} // namespace flotilla::data
