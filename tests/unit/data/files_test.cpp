// File sources: TFRecord (fixtures written by real TensorFlow), list_files, interleave, CSV, and
// FILE auto-sharding.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "flotilla/data/csv.h"
#include "flotilla/data/distribute.h"
#include "flotilla/data/tfrecord.h"
#include "flotilla/error.h"
#include "support/paths.h"
#include "support/subprocess.h"

namespace flotilla::data {
namespace {

using flotilla::testing::TempDir;

std::string fixture(const std::string& name) {
  return flotilla::testing::test_bin_dir() + "/fixtures/" + name;
}

const FeatureSpec kSpec = {
    {"label", FeatureType::kInt64, {}, std::nullopt},
    {"features", FeatureType::kFloat, {3}, std::nullopt},
    {"name", FeatureType::kBytes, {}, std::nullopt},
};

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const DataError& e) {
    return e.what();
  }
  return "no error";
}

std::vector<Element> all(const Dataset& ds) {
  std::vector<Element> out;
  for (Element& e : ds.make_iterator()) out.push_back(e);
  return out;
}

TEST(TFRecord, ReadsExamplesWrittenByTensorFlow) {
  const auto examples = all(tfrecord_dataset({fixture("examples.tfrecord")}, kSpec));
  ASSERT_EQ(examples.size(), 5u);
  for (std::int64_t i = 0; i < 5; ++i) {
    const auto& e = examples[i];
    EXPECT_EQ(e[0].item<std::int64_t>(), i);
    EXPECT_EQ(e[0].dim(), 0);
    EXPECT_TRUE(torch::equal(e[1], torch::tensor({i * 0.5f, i + 1.0f, -static_cast<float>(i)})));
    EXPECT_EQ(to_string(e[2]), "item-" + std::to_string(i));
  }
  // Raw records, and our own framing and Example encoding read back the same.
  TempDir dir;
  const std::string ours = dir.path() + "/ours.tfrecord";
  TFRecordWriter writer(ours);
  for (const Element& raw : all(tfrecord_dataset({fixture("examples.tfrecord")}))) {
    const auto parsed = parse_example(to_string(raw[0]), kSpec);
    writer.write(
        serialize_example({{"label", parsed[0]}, {"features", parsed[1]}, {"name", parsed[2]}}));
  }
  writer.close();
  const auto again = all(tfrecord_dataset({ours}, kSpec));
  ASSERT_EQ(again.size(), 5u);
  EXPECT_TRUE(torch::equal(again[3][1], examples[3][1]));
  EXPECT_EQ(to_string(again[4][2]), "item-4");
}

TEST(TFRecord, AMissingFeatureWithoutDefaultNamesTheFileAndRecord) {
  const std::string path = fixture("examples_missing.tfrecord");
  EXPECT_EQ(error_of([&] { all(tfrecord_dataset({path}, kSpec)); }),
            path + ": record 1: feature \"label\" is missing and has no default; the Example has: "
                   "features, name. Give the spec a default_value or fix the writer");
  FeatureSpec with_default = kSpec;
  with_default[0].default_value = torch::tensor(-1, torch::kInt64);
  const auto examples = all(tfrecord_dataset({path}, with_default));
  ASSERT_EQ(examples.size(), 3u);
  EXPECT_EQ(examples[1][0].item<std::int64_t>(), -1);
  EXPECT_EQ(examples[2][0].item<std::int64_t>(), 2);
}

TEST(TFRecord, TypeAndShapeMismatchesAreNamed) {
  FeatureSpec wrong_type = kSpec;
  wrong_type[1].type = FeatureType::kInt64;
  const std::string path = fixture("examples.tfrecord");
  EXPECT_EQ(error_of([&] { all(tfrecord_dataset({path}, wrong_type)); }),
            path + ": record 0: feature \"features\" holds a float list; the spec expects int64");
  FeatureSpec wrong_shape = kSpec;
  wrong_shape[1].shape = {4};
  EXPECT_EQ(error_of([&] { all(tfrecord_dataset({path}, wrong_shape)); }),
            path + ": record 0: feature \"features\" has 3 float values; the spec's shape [4] "
                   "needs 4");
}

TEST(TFRecord, EveryRecordsCrcIsChecked) {
  TempDir dir;
  const std::string path = dir.path() + "/bad.tfrecord";
  std::filesystem::copy_file(fixture("examples.tfrecord"), path);
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(12 + 20); // inside the first record's data
    f.put('\x7f');
  }
  const std::string message = error_of([&] { all(tfrecord_dataset({path})); });
  EXPECT_EQ(message.rfind(path + ": record 0: data CRC mismatch (stored 0x", 0), 0u) << message;
  EXPECT_NE(message.find("); the file is corrupt"), std::string::npos) << message;
  std::filesystem::copy_file(fixture("examples.tfrecord"), path,
                             std::filesystem::copy_options::overwrite_existing);
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 3);
  EXPECT_EQ(error_of([&] { all(tfrecord_dataset({path})); }),
            path + ": record 4: truncated: the record claims 68 bytes and its CRC, the file ends "
                   "first");
  EXPECT_EQ(error_of([] { tfrecord_dataset({"/nonexistent.tfrecord"}); }),
            "/nonexistent.tfrecord: cannot read it (No such file or directory); check the path");
}

TEST(ListFiles, MatchesSortsShufflesWithASeedAndRefusesAnEmptyGlob) {
  TempDir dir;
  for (int i = 0; i < 6; ++i)
    std::ofstream(dir.path() + "/part-" + std::to_string(i) + ".txt") << i;
  std::vector<std::string> in_order;
  for (const Element& e : Dataset::list_files(dir.path() + "/part-*.txt", false).make_iterator()) {
    in_order.push_back(to_string(e[0]));
  }
  ASSERT_EQ(in_order.size(), 6u);
  EXPECT_TRUE(std::is_sorted(in_order.begin(), in_order.end()));
  auto shuffled = Dataset::list_files(dir.path() + "/part-*.txt", true, 3);
  std::vector<std::string> a, b;
  for (const Element& e : shuffled.make_iterator()) a.push_back(to_string(e[0]));
  for (const Element& e :
       Dataset::list_files(dir.path() + "/part-*.txt", true, 3).make_iterator()) {
    b.push_back(to_string(e[0]));
  }
  EXPECT_EQ(a, b);
  EXPECT_EQ(std::set<std::string>(a.begin(), a.end()).size(), 6u);
  EXPECT_EQ(error_of([&] { Dataset::list_files(dir.path() + "/*.csv"); }),
            "list_files: pattern \"" + dir.path() +
                "/*.csv\" matched no files; check the directory and the pattern");
}

// Four files of 10 records each: (file index, record index) as int64 label = 100·f + r.
std::string write_shards(const TempDir& dir) {
  for (int f = 0; f < 4; ++f) {
    TFRecordWriter w(dir.path() + "/shard-" + std::to_string(f) + ".tfrecord");
    for (int r = 0; r < 10; ++r) {
      w.write(serialize_example({{"label", torch::tensor({100 * f + r}, torch::kInt64)}}));
    }
    w.close();
  }
  return dir.path() + "/shard-*.tfrecord";
}

const FeatureSpec kLabel = {{"label", FeatureType::kInt64, {}, std::nullopt}};

std::vector<std::int64_t> labels(const Dataset& ds) {
  std::vector<std::int64_t> out;
  for (const Element& e : ds.make_iterator()) {
    const auto t = e[0].reshape({-1}).contiguous();
    out.insert(out.end(), t.data_ptr<std::int64_t>(), t.data_ptr<std::int64_t>() + t.numel());
  }
  return out;
}

TEST(Interleave, TakesBlocksFromEachOpenFileInTurnAndInParallelKeepsTheOrder) {
  TempDir dir;
  const std::string pattern = write_shards(dir);
  auto read = [](const Element& e) { return tfrecord_dataset({to_string(e[0])}, kLabel); };
  auto files = Dataset::list_files(pattern, false);
  const auto sequential = labels(files.interleave(read, 2, 3));
  ASSERT_EQ(sequential.size(), 40u);
  EXPECT_EQ(std::vector<std::int64_t>(sequential.begin(), sequential.begin() + 8),
            (std::vector<std::int64_t>{0, 1, 2, 100, 101, 102, 3, 4}));
  EXPECT_EQ(labels(files.interleave(read, 2, 3, 2)), sequential);
  auto loose = labels(files.interleave(read, 4, 1, 4, false));
  std::sort(loose.begin(), loose.end());
  auto sorted = sequential;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(loose, sorted);
}

TEST(FileSharding, AutoGivesEachWorkerItsOwnFiles) {
  TempDir dir;
  const std::string pattern = write_shards(dir);
  auto pipeline =
      Dataset::list_files(pattern, false)
          .interleave([](const Element& e) { return tfrecord_dataset({to_string(e[0])}, kLabel); },
                      2)
          .batch(8);
  std::multiset<std::int64_t> everything;
  for (int w = 0; w < 2; ++w) {
    const auto ds = distribute_dataset(pipeline, cluster::InputContext{2, w, 2});
    EXPECT_EQ(
        ds.plan().rfind("FILE: worker " + std::to_string(w) + " of 2 reads its 2 of 4 files", 0),
        0u)
        << ds.plan();
    std::set<std::int64_t> files_seen;
    auto it = ds.make_iterator();
    while (auto b = it.next()) {
      EXPECT_LE(b->element[0].size(0), 4); // 8 per global batch, 4 per replica
      const auto t = b->element[0].contiguous();
      for (std::int64_t k = 0; k < t.numel(); ++k) {
        const auto v = t.data_ptr<std::int64_t>()[k];
        everything.insert(v);
        files_seen.insert(v / 100);
      }
    }
    EXPECT_EQ(files_seen, (std::set<std::int64_t>{w, w + 2})); // files i, i + n
  }
  EXPECT_EQ(everything.size(), 40u);
  EXPECT_EQ(std::set<std::int64_t>(everything.begin(), everything.end()).size(), 40u);
  // With fewer files than workers, FILE falls back to DATA instead of failing.
  Options file;
  file.distribute.auto_shard_policy = AutoShardPolicy::kFile;
  const auto few = distribute_dataset(
      tfrecord_dataset({dir.path() + "/shard-0.tfrecord"}, kLabel).batch(4).with_options(file),
      cluster::InputContext{2, 0, 2});
  EXPECT_EQ(few.plan().rfind("DATA:", 0), 0u) << few.plan();
  std::set<std::int64_t> covered;
  for (int w = 0; w < 2; ++w) {
    auto it = distribute_dataset(tfrecord_dataset({dir.path() + "/shard-0.tfrecord"}, kLabel)
                                     .batch(4)
                                     .with_options(file),
                                 cluster::InputContext{2, w, 2})
                  .make_iterator();
    while (auto b = it.next()) {
      const auto t = b->element[0].contiguous();
      covered.insert(t.data_ptr<std::int64_t>(), t.data_ptr<std::int64_t>() + t.numel());
    }
  }
  EXPECT_EQ(covered.size(), 10u); // each record once, across the two workers
}

TEST(FileSharding, APipelineMixingFilesAndMemoryIsShardedByData) {
  TempDir dir;
  const std::string pattern = write_shards(dir);
  auto records =
      Dataset::list_files(pattern, false)
          .interleave([](const Element& e) { return tfrecord_dataset({to_string(e[0])}, kLabel); },
                      4);
  // Zipping worker w's records with every worker's labels would pair them wrongly: DATA instead.
  const auto ds = distribute_dataset(Dataset::zip({records, Dataset::range(40)}).batch(8),
                                     cluster::InputContext{2, 0, 2});
  EXPECT_EQ(ds.plan().rfind("DATA:", 0), 0u) << ds.plan();
}

TEST(Csv, TypedColumnsHeaderAndLabel) {
  TempDir dir;
  const std::string path = dir.path() + "/data.csv";
  std::ofstream(path) << "a,b,label,c\n1.5,2,1,\"3\"\n-1,0.25,0,4e2\r\n\n";
  const auto rows = all(csv_dataset({path}, CsvOptions{{ColumnType::kFloat, ColumnType::kFloat,
                                                        ColumnType::kInt64, ColumnType::kFloat},
                                                       true,
                                                       ',',
                                                       2}));
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_TRUE(torch::equal(rows[0][0], torch::tensor({1.5f, 2.0f, 3.0f})));
  EXPECT_EQ(rows[0][1].item<std::int64_t>(), 1);
  EXPECT_EQ(rows[0][1].scalar_type(), torch::kInt64);
  EXPECT_TRUE(torch::equal(rows[1][0], torch::tensor({-1.0f, 0.25f, 400.0f})));
}

TEST(Csv, BadLinesNameTheFileAndLine) {
  TempDir dir;
  const std::string path = dir.path() + "/bad.csv";
  const CsvOptions options{{ColumnType::kFloat, ColumnType::kInt64}, true, ',', 1};
  std::ofstream(path) << "x,y\n1,2\n3\n";
  EXPECT_EQ(error_of([&] { all(csv_dataset({path}, options)); }),
            path + ":3: has 1 fields; expected 2 (one per column type)");
  std::ofstream(path) << "x,y\n1,2\n3,abc\n";
  EXPECT_EQ(error_of([&] { all(csv_dataset({path}, options)); }),
            path + ":3: column 1: \"abc\" is not an integer");
  std::ofstream(path) << "x,y\nnope,2\n";
  EXPECT_EQ(error_of([&] { all(csv_dataset({path}, options)); }),
            path + ":2: column 0: \"nope\" is not a number");
}

} // namespace
} // namespace flotilla::data
