// image_dataset_from_directory: Keras's file index (class folders, walk order, numpy's shuffle,
// the validation split), a shardable file source, and decoding into tensors (image_decode.h).
#include "flotilla/data/image_folder.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "data/image_decode.h"
#include "data/stages.h"
#include "flotilla/base/hashes.h"
#include "flotilla/data/tfrecord.h"

namespace flotilla::data {
namespace {

namespace fs = std::filesystem;

// --- Keras's index ---

bool has_image_extension(const std::string& name) {
  std::string lower = name;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  for (const char* ext : {".bmp", ".gif", ".jpeg", ".jpg", ".png"}) {
    const std::size_t n = std::strlen(ext);
    if (lower.size() >= n && lower.compare(lower.size() - n, n, ext) == 0) return true;
  }
  return false;
}

// os.walk(top, followlinks=follow_links), its (root, files) pairs sorted by root, then each
// root's files sorted: Keras's iter_valid_files.
void walk(const std::string& root, bool follow_links, std::vector<std::pair<std::string,
          std::vector<std::string>>>& out) {
  std::vector<std::string> files, dirs;
  std::error_code ec;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    std::error_code kind;
    if (it->is_directory(kind)) { // follows a link, as os.walk's isdir does
      if (!it->is_symlink(kind) || follow_links) dirs.push_back(root + "/" + name);
    } else {
      files.push_back(name);
    }
  }
  out.emplace_back(root, std::move(files));
  for (const auto& d : dirs) walk(d, follow_links, out);
}

struct Index {
  std::vector<std::string> class_names;
  std::vector<std::string> paths;
  std::vector<std::int64_t> labels;
};

Index index_directory(std::string directory, const ImageFolderOptions& o) {
  // os.path.join's paths: "dir/" and "dir" give the same "dir/class/file".
  while (directory.size() > 1 && directory.back() == '/') directory.pop_back();
  std::error_code ec;
  if (!fs::is_directory(directory, ec)) {
    throw ConfigError("image_dataset_from_directory: " + directory +
                      " is not a directory; give the folder that holds one sub-folder per class");
  }
  std::vector<std::string> subdirs;
  for (fs::directory_iterator it(directory, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    std::error_code kind;
    if (it->is_directory(kind) && name[0] != '.') subdirs.push_back(name);
  }
  std::sort(subdirs.begin(), subdirs.end());
  Index index;
  index.class_names = subdirs;
  if (!o.class_names.empty()) {
    for (const auto& c : o.class_names) {
      if (std::find(subdirs.begin(), subdirs.end(), c) == subdirs.end()) {
        std::string found;
        for (const auto& s : subdirs) found += (found.empty() ? "" : ", ") + s;
        throw ConfigError("ImageFolderOptions::class_names has \"" + c + "\", which is not a "
                          "sub-folder of " + directory + " (its sub-folders: " + found + ")");
      }
    }
    index.class_names = o.class_names;
  }
  for (std::size_t c = 0; c < index.class_names.size(); ++c) {
    std::vector<std::pair<std::string, std::vector<std::string>>> roots;
    walk(directory + "/" + index.class_names[c], o.follow_links, roots);
    std::sort(roots.begin(), roots.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    for (auto& [root, files] : roots) {
      std::sort(files.begin(), files.end());
      for (const auto& f : files) {
        if (!has_image_extension(f)) continue;
        index.paths.push_back(root + "/" + f);
        index.labels.push_back(static_cast<std::int64_t>(c));
      }
    }
  }
  return index;
}

// numpy's legacy RandomState(seed).shuffle: MT19937 seeded with init_genrand(seed) (std::mt19937's
// seeding), and for i = n-1 .. 1 a swap with j drawn uniformly from [0, i] by masked rejection
// (random_interval).
template <class T> void numpy_shuffle(std::vector<T>& v, std::uint32_t seed) {
  std::mt19937 rng(seed);
  for (std::size_t i = v.size(); i-- > 1;) {
    std::uint64_t mask = i;
    for (int s = 1; s < 64; s <<= 1) mask |= mask >> s;
    std::uint64_t j;
    do {
      if (i <= 0xffffffffu) {
        j = rng() & mask;
      } else { // numpy's next_uint64 for MT19937: the high word first
        const std::uint64_t high = rng();
        j = (high << 32 | rng()) & mask;
      }
    } while (j > i);
    std::swap(v[i], v[j]);
  }
}

// --- the file source: (path, label) in order; FILE sharding splits paths and labels alike ---

struct FileList {
  std::vector<std::string> files;
  std::vector<std::int64_t> labels;
};

class ImageFilesStage : public detail::PositionedStage {
 public:
  explicit ImageFilesStage(std::shared_ptr<const FileList> list)
      : PositionedStage("ImageFiles", static_cast<std::int64_t>(list->files.size())),
        list_(std::move(list)) {}

 protected:
  Element at(std::size_t k) override {
    return Element{string_tensor(list_->files[k]),
                   torch::scalar_tensor(list_->labels[k], torch::kInt64)};
  }

 private:
  std::shared_ptr<const FileList> list_;
};

// `decoder`: what load() makes of the files (colour mode, size, dtype), part of the identity so
// that a cache of decoded images is rebuilt when it changes.
class ImageFilesNode : public detail::FileSourceNode {
 public:
  ImageFilesNode(std::vector<std::string> files, std::vector<std::int64_t> labels,
                 std::string decoder, const Options& options)
      : FileSourceNode(files, options),
        list_(std::make_shared<FileList>(FileList{std::move(files), std::move(labels)})),
        decoder_(std::move(decoder)) {
    // The identity once (paths, sizes, times, labels): a fingerprint of a million files stays
    // short, and a file deleted mid-run does not fail the next backup.
    std::string text = describe_files() + "|";
    for (auto l : list_->labels) text += std::to_string(l) + ",";
    identity_ = base::sha256_hex(text.data(), text.size());
  }
  std::unique_ptr<detail::Stage> make_iterator(const detail::IteratorContext&) const override {
    return std::make_unique<ImageFilesStage>(list_);
  }
  std::int64_t cardinality() const override {
    return static_cast<std::int64_t>(list_->files.size());
  }
  std::string describe() const override {
    return "image_files(" + std::to_string(list_->files.size()) + " files, " + decoder_ +
           ", sha256 " + identity_ + ")";
  }
  detail::NodePtr shard_files(std::int64_t n, std::int64_t i) const override {
    if (static_cast<std::int64_t>(list_->files.size()) < n) return nullptr;
    std::vector<std::string> files;
    std::vector<std::int64_t> labels;
    for (auto k = static_cast<std::size_t>(i); k < list_->files.size();
         k += static_cast<std::size_t>(n)) {
      files.push_back(list_->files[k]);
      labels.push_back(list_->labels[k]);
    }
    return std::make_shared<ImageFilesNode>(std::move(files), std::move(labels), decoder_,
                                            options());
  }
  detail::NodePtr with_files(std::vector<std::string>) const override {
    return nullptr; // sharded by shard_files, with the labels
  }

 private:
  std::shared_ptr<const FileList> list_;
  std::string decoder_, identity_;
};

} // namespace

torch::Tensor decode_image(const std::string& path, ColorMode mode) {
  auto* pixels = new detail::Pixels(detail::decode_image_bytes(detail::read_image_file(path), path,
                                                               mode == ColorMode::kGrayscale));
  // The tensor owns the decoded planes: no copy.
  return torch::from_blob(
      pixels->chw.data(), {pixels->channels, pixels->height, pixels->width},
      [pixels](void*) { delete pixels; }, torch::kUInt8);
}

namespace {

// TensorFlow's bilinear weights for one axis (half-pixel centres): output i reads inputs lower[i]
// and upper[i], mixed by lerp[i].
struct Axis {
  std::vector<std::int64_t> lower, upper;
  std::vector<float> lerp;
};

Axis axis(std::int64_t in, std::int64_t out) {
  Axis a;
  const float scale = static_cast<float>(in) / static_cast<float>(out);
  for (std::int64_t i = 0; i < out; ++i) {
    const float x = (static_cast<float>(i) + 0.5f) * scale - 0.5f;
    const float floor = std::floor(x);
    a.lower.push_back(std::max<std::int64_t>(static_cast<std::int64_t>(floor), 0));
    a.upper.push_back(std::min<std::int64_t>(static_cast<std::int64_t>(std::ceil(x)), in - 1));
    a.lerp.push_back(x - floor);
  }
  return a;
}

template <class T>
void resize_plane(const T* in, std::int64_t in_w, const Axis& ys, const Axis& xs, float* out) {
  for (std::size_t y = 0; y < ys.lerp.size(); ++y) {
    const T* top = in + ys.lower[y] * in_w;
    const T* bottom = in + ys.upper[y] * in_w;
    const float dy = ys.lerp[y];
    for (std::size_t x = 0; x < xs.lerp.size(); ++x) {
      const float dx = xs.lerp[x];
      const float tl = static_cast<float>(top[xs.lower[x]]), tr = static_cast<float>(top[xs.upper[x]]);
      const float bl = static_cast<float>(bottom[xs.lower[x]]),
                  br = static_cast<float>(bottom[xs.upper[x]]);
      const float t = tl + (tr - tl) * dx;
      const float b = bl + (br - bl) * dx;
      *out++ = t + (b - t) * dy;
    }
  }
}

} // namespace

torch::Tensor resize_bilinear(const torch::Tensor& image, std::int64_t height, std::int64_t width) {
  if (image.dim() != 3) {
    throw ConfigError("resize_bilinear: expected an image [C, H, W]; saw " +
                      std::to_string(image.dim()) + " dimensions");
  }
  if (image.size(1) == height && image.size(2) == width) return image.to(torch::kFloat32);
  // One pass over the pixels on the calling thread (a pipeline's map runs many images at once):
  // no per-image tensor operations.
  const torch::Tensor in = image.is_cpu() && (image.scalar_type() == torch::kUInt8 ||
                                              image.scalar_type() == torch::kFloat32)
                               ? image.contiguous()
                               : image.to(torch::kCPU, torch::kFloat32).contiguous();
  const std::int64_t c = in.size(0), h = in.size(1), w = in.size(2);
  const Axis ys = axis(h, height), xs = axis(w, width);
  torch::Tensor out = torch::empty({c, height, width}, torch::kFloat32);
  for (std::int64_t k = 0; k < c; ++k) {
    float* dst = out.data_ptr<float>() + k * height * width;
    if (in.scalar_type() == torch::kUInt8) {
      resize_plane(in.data_ptr<std::uint8_t>() + k * h * w, w, ys, xs, dst);
    } else {
      resize_plane(in.data_ptr<float>() + k * h * w, w, ys, xs, dst);
    }
  }
  return out;
}

ImageFolder image_dataset_from_directory(const std::string& directory,
                                         const ImageFolderOptions& o) {
  const std::string where = "image_dataset_from_directory(" + directory + "): ";
  if (o.validation_split != 0 && !(o.validation_split > 0 && o.validation_split < 1)) {
    throw ConfigError(where + "ImageFolderOptions::validation_split must be in (0, 1); saw " +
                      std::to_string(o.validation_split));
  }
  if ((o.validation_split != 0) != !o.subset.empty()) {
    throw ConfigError(where + "give ImageFolderOptions::validation_split and ::subset together "
                              "(subset \"" + o.subset + "\", validation_split " +
                      std::to_string(o.validation_split) + ")");
  }
  if (!o.subset.empty() && o.subset != "training" && o.subset != "validation") {
    throw ConfigError(where + "ImageFolderOptions::subset must be \"training\" or \"validation\"; "
                              "saw \"" + o.subset + "\"");
  }
  if (o.validation_split != 0 && o.shuffle && !o.seed) {
    throw ConfigError(where + "a validation split of shuffled files needs ImageFolderOptions::seed, "
                              "the same for both subsets, or they overlap");
  }
  if (o.image_size[0] < 1 || o.image_size[1] < 1) {
    throw ConfigError(where + "ImageFolderOptions::image_size must be positive; saw " +
                      std::to_string(o.image_size[0]) + "x" + std::to_string(o.image_size[1]));
  }
  if (o.dtype != torch::kFloat32 && o.dtype != torch::kUInt8) {
    throw ConfigError(where + "ImageFolderOptions::dtype must be float32 or uint8");
  }
  if (o.batch_size < 0) {
    throw ConfigError(where + "ImageFolderOptions::batch_size must be positive, or 0 for none");
  }
  Index index = index_directory(directory, o);
  if (index.class_names.empty()) {
    throw ConfigError(where + "no sub-folders; put each class's images in a folder of its own");
  }
  if (index.paths.empty()) {
    throw ConfigError(where + "no images (.bmp, .gif, .jpeg, .jpg or .png) in its " +
                      std::to_string(index.class_names.size()) + " class folder(s)");
  }
  if (o.seed && *o.seed > 0xffffffffu) {
    throw ConfigError(where + "ImageFolderOptions::seed must be below 2^32 (numpy's RandomState "
                              "takes no more); saw " + std::to_string(*o.seed));
  }
  // Keras draws a seed when none is given; so do we (the order then differs from run to run).
  const std::uint64_t seed = o.seed ? *o.seed : std::random_device{}() % 1000000;
  if (o.shuffle) {
    numpy_shuffle(index.paths, static_cast<std::uint32_t>(seed));
    numpy_shuffle(index.labels, static_cast<std::uint32_t>(seed));
  }
  if (o.validation_split != 0) {
    const auto n = static_cast<std::int64_t>(index.paths.size());
    const auto validation = static_cast<std::int64_t>(o.validation_split * static_cast<double>(n));
    if (validation < 1 || validation >= n) {
      throw ConfigError(where + "validation_split " + std::to_string(o.validation_split) + " of " +
                        std::to_string(n) + " files leaves an empty subset; change the split");
    }
    const bool training = o.subset == "training";
    const std::size_t from = training ? 0 : static_cast<std::size_t>(n - validation);
    const std::size_t to = training ? static_cast<std::size_t>(n - validation) : index.paths.size();
    index.paths = {index.paths.begin() + from, index.paths.begin() + to};
    index.labels = {index.labels.begin() + from, index.labels.begin() + to};
  }

  const ColorMode mode = o.color_mode;
  const std::int64_t height = o.image_size[0], width = o.image_size[1];
  const torch::Dtype dtype = o.dtype;
  const std::string decoder = std::string(mode == ColorMode::kRgb ? "rgb" : "grayscale") + " " +
                              std::to_string(height) + "x" + std::to_string(width) + " " +
                              c10::toString(dtype);
  const Dataset files(
      std::make_shared<ImageFilesNode>(index.paths, index.labels, decoder, Options{}));
  MapFn load = [mode, height, width, dtype](Element e) {
    const torch::Tensor pixels = decode_image(to_string(e[0]), mode);
    const bool sized = pixels.size(1) == height && pixels.size(2) == width;
    if (sized && dtype == torch::kUInt8) return Element{pixels, e[1]}; // no copy
    const torch::Tensor image = resize_bilinear(pixels, height, width); // float32
    return Element{dtype == torch::kUInt8 ? image.round().clamp(0, 255).to(torch::kUInt8) : image,
                   e[1]};
  };
  Dataset d = files;
  if (o.shuffle) d = d.shuffle(o.batch_size > 0 ? o.batch_size * 8 : 1024, seed);
  d = d.map(load, kAutotune);
  if (o.batch_size > 0) d = d.batch(o.batch_size);
  return ImageFolder{d.prefetch(kAutotune), index.class_names, index.paths, index.labels, files,
                     load};
}

} // namespace flotilla::data
