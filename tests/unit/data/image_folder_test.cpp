// image_dataset_from_directory on real files: Fashion-MNIST written as PNG and JPEG class folders
// by scripts/fashion_mnist_images.py (Pillow), decoded by flotilla and by Pillow; Keras's own
// index and tf.image.resize's values (fixtures/image_folder_index.json, written by Keras and TF).
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "flotilla/checkpoint/safetensors.h"
#include "flotilla/data/distribute.h"
#include "flotilla/data/fashion_mnist.h"
#include "flotilla/data/image_folder.h"
#include "flotilla/data/tfrecord.h"
#include "flotilla/error.h"
#include "support/paths.h"
#include "support/subprocess.h"
#include "support/tensorboard.h"

namespace flotilla::data {
namespace {

namespace fs = std::filesystem;
constexpr int kPerSplit = 60; // images written per split

nlohmann::json fixture() {
  std::ifstream in(testing::test_bin_dir() + "/fixtures/image_folder_index.json");
  return nlohmann::json::parse(in);
}

std::string script() { return testing::source_dir() + "/scripts/fashion_mnist_images.py"; }

bool pillow_installed() {
  return testing::run_process({testing::test_python(), "-c", "import PIL, numpy"}).exit_code == 0;
}

// Pillow's pixels for `paths`, uint8 [N, C, H, W].
torch::Tensor pillow_decode(const std::vector<std::string>& paths, const std::string& mode,
                            const std::string& dir) {
  const std::string list = dir + "/list.txt", out = dir + "/pillow.safetensors";
  std::ofstream f(list);
  for (const auto& p : paths) f << p << "\n";
  f.close();
  const auto r = testing::run_process(
      {testing::test_python(), script(), "decode", list, out, "--mode", mode});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  return checkpoint::load_safetensors(out).tensors.at("pixels");
}

// Fashion-MNIST's first kPerSplit images of each split, as files, written once for the suite.
class ImageFolderFiles : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir();
    if (!testing::fashion_mnist_present() || !pillow_installed()) return;
    for (const auto& [name, extra] : std::vector<std::pair<std::string, std::string>>{
             {"png", "--format=png"}, {"jpeg", "--format=jpeg"}, {"rgb", "--rgb"},
             {"rgba", "--colour"}}) {
      const auto r = testing::run_process({testing::test_python(), script(), "write",
                                           dir_->path() + "/" + name, extra, "--limit",
                                           std::to_string(kPerSplit)});
      ASSERT_EQ(r.exit_code, 0) << r.err;
    }
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override {
    if (!testing::fashion_mnist_present()) GTEST_SKIP() << "dataset-fashion-mnist absent";
    if (!pillow_installed()) GTEST_SKIP() << "the test venv lacks Pillow; run scripts/bootstrap --test";
  }
  static std::string dir(const std::string& name) { return dir_->path() + "/" + name; }

  static ImageFolderOptions gray28() {
    ImageFolderOptions o;
    o.color_mode = ColorMode::kGrayscale;
    o.image_size = {28, 28};
    o.batch_size = 0;
    o.shuffle = false;
    return o;
  }
  static testing::TempDir* dir_;
};
testing::TempDir* ImageFolderFiles::dir_ = nullptr;

// The IDX position a file was written from (its name).
std::int64_t position_of(const std::string& path) {
  return std::stoll(fs::path(path).stem().string());
}

TEST_F(ImageFolderFiles, PngDecodesToTheIdxPixelsAndToPillowsExactly) {
  const ImageFolder folder = image_dataset_from_directory(dir("png/train"), gray28());
  ASSERT_EQ(folder.file_paths.size(), static_cast<std::size_t>(kPerSplit));
  ASSERT_EQ(folder.class_names.size(), 10u);
  EXPECT_EQ(folder.class_names.front(), "0_tshirt_top");
  const auto idx = load_fashion_mnist(kFashionMnistDir, Split::kTrain);
  const torch::Tensor pillow = pillow_decode(folder.file_paths, "L", dir_->path());
  auto it = folder.dataset.make_iterator();
  for (std::size_t k = 0; k < folder.file_paths.size(); ++k) {
    const auto e = it.next();
    ASSERT_TRUE(e);
    const std::int64_t i = position_of(folder.file_paths[k]);
    EXPECT_EQ((*e)[1].item<std::int64_t>(), idx.labels[i].item<std::int64_t>()) << k;
    EXPECT_EQ((*e)[0].scalar_type(), torch::kFloat32); // Keras's pixels: 0..255 in float
    ASSERT_EQ((*e)[0].sizes(), (std::vector<std::int64_t>{1, 28, 28}));
    EXPECT_TRUE(torch::equal((*e)[0], idx.images[i].to(torch::kFloat32))) << folder.file_paths[k];
    EXPECT_TRUE(torch::equal(decode_image(folder.file_paths[k], ColorMode::kGrayscale), pillow[k]))
        << folder.file_paths[k];
  }
  EXPECT_FALSE(it.next());
}

TEST_F(ImageFolderFiles, JpegDecodesWithinOneGreyLevelOfPillow) {
  const ImageFolder folder = image_dataset_from_directory(dir("jpeg/test"), gray28());
  const torch::Tensor pillow = pillow_decode(folder.file_paths, "L", dir_->path());
  std::int64_t worst = 0, differing = 0;
  for (std::size_t k = 0; k < folder.file_paths.size(); ++k) {
    const torch::Tensor ours = decode_image(folder.file_paths[k], ColorMode::kGrayscale);
    const torch::Tensor diff = (ours.to(torch::kInt32) - pillow[k].to(torch::kInt32)).abs();
    worst = std::max(worst, diff.max().item<std::int64_t>());
    differing += diff.gt(0).sum().item<std::int64_t>();
  }
  // Both are libjpeg-turbo's accurate integer IDCT (JDCT_ISLOW); Pillow's wheel bundles its own
  // libjpeg-turbo, Debian's is ours.
  EXPECT_LE(worst, 1) << differing << " pixels differ";
  // Control: JPEG at quality 90 is lossy, so the files are not the IDX pixels.
  const auto idx = load_fashion_mnist(kFashionMnistDir, Split::kTest);
  const std::int64_t i = position_of(folder.file_paths[0]);
  EXPECT_FALSE(torch::equal(decode_image(folder.file_paths[0], ColorMode::kGrayscale), idx.images[i]));
}

TEST_F(ImageFolderFiles, ColorModesConvertAsPillowDoes) {
  // Grey files read as RGB repeat the grey; RGB files (of grey) read as grey give it back.
  const ImageFolder gray = image_dataset_from_directory(dir("png/test"), gray28());
  const torch::Tensor pillow_rgb = pillow_decode(gray.file_paths, "RGB", dir_->path());
  for (std::size_t k = 0; k < 5; ++k) {
    const torch::Tensor rgb = decode_image(gray.file_paths[k], ColorMode::kRgb);
    ASSERT_EQ(rgb.sizes(), (std::vector<std::int64_t>{3, 28, 28}));
    EXPECT_TRUE(torch::equal(rgb, pillow_rgb[k]));
  }
  ImageFolderOptions o = gray28();
  const ImageFolder rgb_files = image_dataset_from_directory(dir("rgb/test"), o);
  for (std::size_t k = 0; k < 5; ++k) {
    EXPECT_TRUE(torch::equal(decode_image(rgb_files.file_paths[k], ColorMode::kGrayscale),
                             decode_image(gray.file_paths[k], ColorMode::kGrayscale)));
  }
}

TEST_F(ImageFolderFiles, ColourAndAlphaDecodeAsPillowConverts) {
  // RGBA PNGs (alpha = the grey, so most pixels are partly transparent): RGB drops the alpha,
  // grey is ITU-R 601-2 luma of the colour, both exactly as Pillow's convert does.
  const ImageFolder folder = image_dataset_from_directory(dir("rgba/test"), gray28());
  const torch::Tensor rgb = pillow_decode(folder.file_paths, "RGB", dir_->path());
  const torch::Tensor grey = pillow_decode(folder.file_paths, "L", dir_->path());
  for (std::size_t k = 0; k < folder.file_paths.size(); ++k) {
    EXPECT_TRUE(torch::equal(decode_image(folder.file_paths[k], ColorMode::kRgb), rgb[k])) << k;
    EXPECT_TRUE(torch::equal(decode_image(folder.file_paths[k], ColorMode::kGrayscale), grey[k]))
        << k;
  }
  // Decoding twice gives the same pixels (nothing read from uninitialised memory).
  EXPECT_TRUE(torch::equal(decode_image(folder.file_paths[0], ColorMode::kRgb),
                           decode_image(folder.file_paths[0], ColorMode::kRgb)));
}

TEST_F(ImageFolderFiles, TheDecodersOptionsArePartOfTheFingerprint) {
  // A cache of decoded images is keyed on the fingerprint: another size or colour mode must not
  // replay the old one.
  ImageFolderOptions o = gray28();
  const std::string a = image_dataset_from_directory(dir("png/train"), o).dataset.fingerprint();
  o.image_size = {32, 32};
  const std::string b = image_dataset_from_directory(dir("png/train"), o).dataset.fingerprint();
  o.color_mode = ColorMode::kRgb;
  const std::string c = image_dataset_from_directory(dir("png/train"), o).dataset.fingerprint();
  EXPECT_NE(a, b);
  EXPECT_NE(b, c);
  EXPECT_EQ(a, image_dataset_from_directory(dir("png/train"), gray28()).dataset.fingerprint());
  EXPECT_LT(a.size(), 1000u) << "the files' identity is hashed, not spelled out";
}

TEST_F(ImageFolderFiles, ResizeAndBatchAsKerasDoes) {
  ImageFolderOptions o = gray28();
  o.image_size = {32, 20};
  o.batch_size = 8;
  o.dtype = torch::kFloat32;
  const ImageFolder folder = image_dataset_from_directory(dir("png/train"), o);
  auto it = folder.dataset.make_iterator();
  const auto batch = it.next();
  ASSERT_TRUE(batch);
  ASSERT_EQ((*batch)[0].sizes(), (std::vector<std::int64_t>{8, 1, 32, 20}));
  ASSERT_EQ((*batch)[1].sizes(), (std::vector<std::int64_t>{8}));
  const torch::Tensor first = decode_image(folder.file_paths[0], ColorMode::kGrayscale);
  EXPECT_TRUE(torch::equal((*batch)[0][0], resize_bilinear(first, 32, 20)));
  o.dtype = torch::kUInt8;
  const auto bytes = image_dataset_from_directory(dir("png/train"), o).dataset.make_iterator().next();
  EXPECT_EQ((*bytes)[0].scalar_type(), torch::kUInt8);
  EXPECT_TRUE(torch::equal((*bytes)[0][0], (*batch)[0][0].round().to(torch::kUInt8)));
}

TEST_F(ImageFolderFiles, FileShardingGivesEachWorkerItsOwnFiles) {
  ImageFolderOptions o = gray28();
  o.shuffle = true;
  o.seed = 3;
  const ImageFolder folder = image_dataset_from_directory(dir("png/train"), o);
  const Dataset pipeline = folder.files.map(folder.load, kAutotune).batch(4, true);
  for (int worker = 0; worker < 2; ++worker) {
    const DistributedDataset mine = distribute_dataset(pipeline, {2, worker, 2});
    EXPECT_EQ(mine.sharding(), "FILE") << mine.plan();
    auto it = mine.per_worker().make_iterator();
    std::size_t k = static_cast<std::size_t>(worker);
    while (auto e = it.next()) {
      for (std::int64_t row = 0; row < (*e)[0].size(0); ++row, k += 2) {
        EXPECT_TRUE(torch::equal((*e)[0][row],
                                 decode_image(folder.file_paths[k], ColorMode::kGrayscale)
                                     .to(torch::kFloat32)))
            << "worker " << worker << " row " << row;
        EXPECT_EQ((*e)[1][row].item<std::int64_t>(), folder.labels[k]);
      }
    }
    EXPECT_EQ(k, folder.file_paths.size() + static_cast<std::size_t>(worker)) << worker;
  }
}

TEST_F(ImageFolderFiles, BrokenImagesAreDataErrorsNamingTheFile) {
  const ImageFolder folder = image_dataset_from_directory(dir("png/train"), gray28());
  const std::string png = folder.file_paths[0];
  const std::string jpeg = image_dataset_from_directory(dir("jpeg/train"), gray28()).file_paths[0];
  testing::TempDir broken;
  auto truncated = [&](const std::string& from, const std::string& name) {
    const std::string bytes = testing::read_file(from);
    const std::string to = broken.path() + "/" + name;
    std::ofstream(to, std::ios::binary) << bytes.substr(0, bytes.size() / 2);
    return to;
  };
  auto expect_data_error = [](const std::string& path, const std::string& words) {
    try {
      decode_image(path, ColorMode::kGrayscale);
      ADD_FAILURE() << path << " decoded";
    } catch (const DataError& e) {
      const std::string what = e.what();
      EXPECT_EQ(what.rfind(path + ": ", 0), 0u) << what;
      EXPECT_NE(what.find(words), std::string::npos) << what;
    }
  };
  expect_data_error(truncated(png, "half.png"), "corrupt or truncated PNG");
  expect_data_error(truncated(jpeg, "half.jpg"), "corrupt, truncated or unsupported JPEG");
  std::ofstream(broken.path() + "/anim.gif") << "GIF89a\x01\x00\x01\x00";
  expect_data_error(broken.path() + "/anim.gif", "a GIF image; flotilla decodes JPEG and PNG only");
  std::ofstream(broken.path() + "/text.png") << "hello";
  expect_data_error(broken.path() + "/text.png", "not a JPEG or PNG image");
  // Nothing but a regular file is read: a FIFO with no writer would block, a link to /dev/zero
  // never end, a huge file fill the memory (this one is sparse: it costs no disk).
  const std::string fifo = broken.path() + "/fifo.png";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_data_error(fifo, "a FIFO, not an image file");
  fs::create_symlink("/dev/zero", broken.path() + "/zero.png");
  expect_data_error(broken.path() + "/zero.png", "a device, not an image file");
  fs::create_directory(broken.path() + "/dir.png");
  expect_data_error(broken.path() + "/dir.png", "a directory, not an image file");
  const std::string huge = broken.path() + "/huge.png";
  std::ofstream(huge) << "\x89PNG\r\n\x1A\n";
  fs::resize_file(huge, std::uintmax_t{300} << 20);
  expect_data_error(huge, "314572800 bytes, over the 256 MiB an image file may have");
  // A header may claim any size. A progressive JPEG claiming 65500x65500 is refused from its
  // header: libjpeg would allocate (and zero) its whole-image coefficient arrays, 25 GB, in
  // jpeg_start_decompress, where the size used to be checked only after.
  const std::string small = broken.path() + "/small.jpg";
  const auto made = testing::run_process(
      {testing::test_python(), "-c",
       "import sys; from PIL import Image; Image.new('RGB', (16, 16), (90, 30, 200)).save("
       "sys.argv[1], 'JPEG', progressive=True, subsampling=0)",
       small});
  ASSERT_EQ(made.exit_code, 0) << made.err;
  std::string giant = testing::read_file(small);
  const auto sof = giant.find("\xFF\xC2"); // SOF2: length, precision, height, width
  ASSERT_NE(sof, std::string::npos);
  for (const std::size_t at : {sof + 5, sof + 7}) giant.replace(at, 2, "\xFF\xDC"); // 65500
  std::ofstream(broken.path() + "/giant.jpg", std::ios::binary) << giant;
  expect_data_error(broken.path() + "/giant.jpg",
                    "the image claims 65500x65500 pixels, more than flotilla decodes (2^28)");
  EXPECT_EQ(decode_image(small, ColorMode::kRgb).sizes(), (std::vector<std::int64_t>{3, 16, 16}));
  fs::create_symlink(png, broken.path() + "/link.png"); // a link to an image is one
  EXPECT_TRUE(torch::equal(decode_image(broken.path() + "/link.png", ColorMode::kGrayscale),
                           decode_image(png, ColorMode::kGrayscale)));
  // In a pipeline, the error reaches the consumer, naming the file.
  fs::create_directories(broken.path() + "/tree/cls");
  fs::copy_file(broken.path() + "/half.png", broken.path() + "/tree/cls/a.png");
  const ImageFolder bad = image_dataset_from_directory(broken.path() + "/tree", gray28());
  auto it = bad.dataset.make_iterator();
  EXPECT_THROW(it.next(), DataError);
}

// Keras's index on the fixture's tree: the same files, order, labels and classes.
TEST(ImageFolderIndex, ListsSplitsAndShufflesAsKeras) {
  const nlohmann::json f = fixture();
  testing::TempDir root;
  for (const std::string rel : f["tree"]) {
    const fs::path path = fs::path(root.path()) / rel;
    fs::create_directories(path.parent_path());
    std::ofstream(path).close();
  }
  for (const auto& c : f["cases"]) {
    ImageFolderOptions o;
    o.shuffle = c["shuffle"];
    if (c.contains("seed")) o.seed = c["seed"].get<std::uint64_t>();
    if (c.contains("validation_split")) {
      o.validation_split = c["validation_split"];
      o.subset = c["subset"];
    }
    if (c.contains("given_class_names")) {
      o.class_names = c["given_class_names"].get<std::vector<std::string>>();
    }
    const ImageFolder folder = image_dataset_from_directory(root.path(), o);
    std::vector<std::string> relative;
    for (const auto& p : folder.file_paths) relative.push_back(fs::relative(p, root.path()));
    EXPECT_EQ(relative, c["paths"].get<std::vector<std::string>>()) << c.dump();
    EXPECT_EQ(folder.labels, c["labels"].get<std::vector<std::int64_t>>()) << c.dump();
    EXPECT_EQ(folder.class_names, c["class_names"].get<std::vector<std::string>>()) << c.dump();
  }
  // "dir/" lists the same paths as "dir", as os.path.join makes them.
  ImageFolderOptions unshuffled;
  unshuffled.shuffle = false;
  EXPECT_EQ(image_dataset_from_directory(root.path() + "/", unshuffled).file_paths,
            image_dataset_from_directory(root.path(), unshuffled).file_paths);
}

TEST(ImageFolderIndex, BadOptionsAreConfigErrors) {
  testing::TempDir root;
  fs::create_directories(root.path() + "/a");
  std::ofstream(root.path() + "/a/x.png").close();
  std::ofstream(root.path() + "/a/y.png").close();
  auto refused = [&](ImageFolderOptions o, const std::string& words) {
    try {
      image_dataset_from_directory(root.path(), o);
      ADD_FAILURE() << words;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  ImageFolderOptions o;
  o.validation_split = 0.5;
  refused(o, "give ImageFolderOptions::validation_split and ::subset together");
  o.subset = "training";
  refused(o, "needs ImageFolderOptions::seed");
  o.seed = 1;
  o.validation_split = 0.2; // int(0.2 x 2) = 0 files for validation
  refused(o, "leaves an empty subset");
  ImageFolderOptions names;
  names.class_names = {"b"};
  refused(names, "class_names has \"b\", which is not a sub-folder");
  EXPECT_THROW(image_dataset_from_directory(root.path() + "/nope"), ConfigError);
  testing::TempDir empty;
  fs::create_directories(empty.path() + "/a");
  EXPECT_THROW(image_dataset_from_directory(empty.path()), ConfigError);
}

TEST(ImageFolderIndex, BilinearResizeMatchesTensorFlow) {
  for (const auto& c : fixture()["resize"]) {
    const auto hwc = c["image_hwc"].get<std::vector<std::vector<std::vector<int>>>>();
    const auto h = static_cast<std::int64_t>(hwc.size()), w = static_cast<std::int64_t>(hwc[0].size()),
               ch = static_cast<std::int64_t>(hwc[0][0].size());
    torch::Tensor image = torch::empty({ch, h, w}, torch::kUInt8);
    for (std::int64_t y = 0; y < h; ++y)
      for (std::int64_t x = 0; x < w; ++x)
        for (std::int64_t k = 0; k < ch; ++k) image[k][y][x] = hwc[y][x][k];
    const std::int64_t oh = c["size"][0], ow = c["size"][1];
    const torch::Tensor ours = resize_bilinear(image, oh, ow);
    const auto expected = c["resized_hwc"].get<std::vector<std::vector<std::vector<double>>>>();
    double worst = 0;
    for (std::int64_t y = 0; y < oh; ++y)
      for (std::int64_t x = 0; x < ow; ++x)
        for (std::int64_t k = 0; k < ch; ++k)
          worst = std::max(worst, std::abs(ours[k][y][x].item<double>() - expected[y][x][k]));
    EXPECT_LT(worst, 1e-4) << oh << "x" << ow;
  }
}

} // namespace
} // namespace flotilla::data
