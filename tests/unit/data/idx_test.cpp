#include <gtest/gtest.h>
#include <zlib.h>

#include <fstream>

#include "flotilla/data/fashion_mnist.h"
#include "flotilla/data/idx.h"
#include "flotilla/error.h"
#include "support/subprocess.h"

namespace flotilla::data {
namespace {

using flotilla::testing::TempDir;

std::string idx_bytes(std::vector<std::uint32_t> dims, const std::vector<std::uint8_t>& data,
                      std::uint8_t type = 0x08) {
  std::string out = {0, 0, static_cast<char>(type), static_cast<char>(dims.size())};
  for (auto d : dims) {
    for (int shift = 24; shift >= 0; shift -= 8) out += static_cast<char>((d >> shift) & 0xff);
  }
  out.append(data.begin(), data.end());
  return out;
}

void write_raw(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

void write_gz(const std::string& path, const std::string& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size()));
  gzclose(f);
}

std::string error_of(const std::string& path) {
  try {
    read_idx(path);
  } catch (const DataError& e) {
    return e.what();
  }
  return "no error";
}

TEST(Idx, ReadsRawAndGzipWithTheirShape) {
  TempDir dir;
  std::vector<std::uint8_t> values(2 * 3 * 4);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<std::uint8_t>(i * 7);
  write_raw(dir.path() + "/a.idx", idx_bytes({2, 3, 4}, values));
  write_gz(dir.path() + "/a.idx.gz", idx_bytes({2, 3, 4}, values));
  for (const char* name : {"/a.idx", "/a.idx.gz"}) {
    const auto t = read_idx(dir.path() + name);
    EXPECT_EQ(t.sizes(), (std::vector<std::int64_t>{2, 3, 4}));
    EXPECT_EQ(t.scalar_type(), torch::kUInt8);
    EXPECT_EQ(t[1][2][3].item<int>(), static_cast<std::uint8_t>(23 * 7));
  }
}

TEST(Idx, WrongMagicNamesFileAndExpectation) {
  TempDir dir;
  const std::string path = dir.path() + "/f.idx";
  write_raw(path, idx_bytes({1}, {0}, 0x0d)); // float IDX: not what we read
  EXPECT_EQ(error_of(path), path + ": wrong magic number 0x00000d01; expected an unsigned-byte IDX "
                                   "file (0x00000801 to 0x00000804), such as "
                                   "train-images-idx3-ubyte.gz");
  write_raw(path, "PK\x03\x04 not idx");
  EXPECT_EQ(error_of(path), path + ": wrong magic number 0x504b0304; expected an unsigned-byte IDX "
                                   "file (0x00000801 to 0x00000804), such as "
                                   "train-images-idx3-ubyte.gz");
}

TEST(Idx, TruncatedRawAndGzipFilesAreCaught) {
  TempDir dir;
  const std::string full = idx_bytes({10, 5}, std::vector<std::uint8_t>(50, 1));
  const std::string raw = dir.path() + "/t.idx";
  write_raw(raw, full.substr(0, full.size() - 8));
  EXPECT_EQ(error_of(raw), raw + ": truncated: the header promises 10x5 = 50 bytes of data, the "
                                 "file holds 42; download or reinstall it");
  // A gzip stream cut in half.
  const std::string gz = dir.path() + "/t.idx.gz";
  std::vector<std::uint8_t> noise(5000);
  for (std::size_t i = 0; i < noise.size(); ++i) noise[i] = static_cast<std::uint8_t>(i * 31 % 251);
  write_gz(gz, idx_bytes({5000}, noise));
  std::ifstream in(gz, std::ios::binary);
  std::string compressed((std::istreambuf_iterator<char>(in)), {});
  write_raw(gz, compressed.substr(0, compressed.size() / 2));
  const std::string message = error_of(gz);
  EXPECT_EQ(
      message.rfind(
          gz + ": truncated: the header promises 5000 = 5000 bytes of data, the file holds ", 0),
      0u)
      << message;
  write_raw(raw, full.substr(0, 6));
  EXPECT_EQ(error_of(raw), raw + ": truncated: the file ends inside its dimension list (2 "
                                 "dimensions expected)");
}

TEST(Idx, AnImpossibleHeaderIsRefusedBeforeAllocating) {
  TempDir dir;
  const std::string raw = dir.path() + "/huge.idx";
  write_raw(raw, idx_bytes({60000, 60000, 60000}, {1, 2, 3}));
  EXPECT_EQ(error_of(raw), raw + ": header claims more than 1 TiB of data (dimension 2 is 60000); "
                                 "the file is corrupt");
  write_raw(raw, idx_bytes({100000, 1000, 1000}, {1, 2, 3})); // 100 GB promised, 3 bytes held
  EXPECT_EQ(error_of(raw), raw + ": truncated: the header promises 100000x1000x1000 = 100000000000 "
                                 "bytes of data, the file holds 3; download or reinstall it");
}

TEST(Idx, FilesPairUpAsADataset) {
  TempDir dir;
  write_gz(dir.path() + "/x.gz", idx_bytes({3, 2}, {1, 2, 3, 4, 5, 6}));
  write_raw(dir.path() + "/y", idx_bytes({3}, {7, 8, 9}));
  write_raw(dir.path() + "/z", idx_bytes({2}, {7, 8}));
  auto it = idx_dataset({dir.path() + "/x.gz", dir.path() + "/y"}).make_iterator();
  it.next();
  const auto second = it.next();
  ASSERT_TRUE(second);
  EXPECT_TRUE(torch::equal((*second)[0], torch::tensor({3, 4}, torch::kUInt8)));
  EXPECT_EQ((*second)[1].item<int>(), 8);
  try {
    idx_dataset({dir.path() + "/x.gz", dir.path() + "/z"});
    FAIL();
  } catch (const DataError& e) {
    EXPECT_EQ(std::string(e.what()), dir.path() + "/z: holds 2 items, " + dir.path() +
                                         "/x.gz holds 3; idx_dataset pairs files item by item");
  }
}

TEST(Idx, MissingFile) {
  EXPECT_EQ(error_of("/nonexistent/x.gz"),
            "/nonexistent/x.gz: cannot open (No such file or directory); give the directory that "
            "holds the IDX files, or on Debian install the dataset-fashion-mnist package");
}

TEST(FashionMnist, MissingDirectorySaysWhatToInstall) {
  try {
    load_fashion_mnist("/nonexistent", Split::kTest);
    FAIL();
  } catch (const DataError& e) {
    EXPECT_EQ(std::string(e.what()),
              "/nonexistent: has no t10k-images-idx3-ubyte.gz (nor t10k-images-idx3-ubyte); "
              "point data::fashion_mnist at the Fashion-MNIST IDX files, or on Debian install the "
              "dataset-fashion-mnist package (/usr/share/datasets/fashion-mnist)");
  }
}

TEST(FashionMnist, RealFilesHaveTheKnownShapeAndLabels) {
  if (!flotilla::testing::fashion_mnist_present()) GTEST_SKIP() << "dataset-fashion-mnist absent";
  const auto train = load_fashion_mnist(kFashionMnistDir, Split::kTrain);
  const auto test = load_fashion_mnist(kFashionMnistDir, Split::kTest);
  EXPECT_EQ(train.images.sizes(), (std::vector<std::int64_t>{60000, 1, 28, 28}));
  EXPECT_EQ(test.images.sizes(), (std::vector<std::int64_t>{10000, 1, 28, 28}));
  EXPECT_EQ(train.labels[0].item<int>(), 9); // the first training image is an ankle boot
  EXPECT_EQ(test.labels[0].item<int>(), 9);
  // Balanced classes: 6,000 of each in training.
  EXPECT_TRUE(torch::bincount(train.labels).eq(6000).all().item<bool>());
  const auto x = normalize_images(train.images.slice(0, 0, 10000));
  EXPECT_NEAR(x.mean().item<double>(), 0.0, 0.02);
  EXPECT_NEAR(x.std().item<double>(), 1.0, 0.02);
}

} // namespace
} // namespace flotilla::data
