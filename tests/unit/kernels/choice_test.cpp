// The measured choice between flotilla's kernels and ATen's (flotilla/kernels/choice.h): what
// each mode runs, what the cache file holds and how a second process reads it, each candidate
// forced through the file, and files that are not flotilla's left alone.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "flotilla/error.h"
#include "flotilla/kernels/batch_norm_relu.h"
#include "flotilla/kernels/choice.h"
#include "flotilla/kernels/winograd.h"
#include "kernel_choice.h"
#include "support/subprocess.h"

namespace flotilla::kernels {
namespace {

namespace fs = std::filesystem;
const auto kChannelsLast = torch::MemoryFormat::ChannelsLast;

// A cache directory of the test's own and a mode, for the scope; this process's decisions
// forgotten on the way in and out.
struct Scope {
  testing::TempDir dir;
  KernelMode mode;
  explicit Scope(Mode m) : mode(m) {
    set_cache_directory(fs::path(dir.path()));
    reset_decisions();
  }
  ~Scope() {
    set_cache_directory(std::nullopt);
    reset_decisions();
  }
};

std::string read(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A 3x3 convolution where Winograd's kernels apply: 16 -> 16 channels, 8x8 images, channels-last.
struct Conv {
  torch::Tensor x = torch::randn({4, 16, 8, 8}).contiguous(kChannelsLast);
  torch::Tensor w = torch::randn({16, 16, 3, 3}).contiguous(kChannelsLast);
  torch::Tensor run() const {
    torch::NoGradGuard no_grad;
    return kernels::conv2d(x, w, std::nullopt, {1, 1}, {1, 1}, {1, 1}, 1);
  }
  torch::Tensor winograd() const {
    torch::NoGradGuard no_grad;
    return winograd_conv3x3(x, w);
  }
  torch::Tensor aten() const {
    torch::NoGradGuard no_grad;
    return at::conv2d(x, w, {}, 1, 1);
  }
};

bool has_kernel() {
  return std::string(winograd_kernel()) != "none";
}

TEST(KernelChoice, FixedRunsFlotillasKernelAndNoneRunsATens) {
  if (!has_kernel()) GTEST_SKIP() << "this CPU has neither AVX-512 nor AVX2";
  torch::manual_seed(1);
  const Conv c;
  ASSERT_FALSE(torch::equal(c.winograd(), c.aten())); // the two can be told apart
  {
    Scope scope(Mode::kFixed);
    EXPECT_TRUE(torch::equal(c.run(), c.winograd()));
    ASSERT_EQ(decisions().size(), 1u);
    EXPECT_TRUE(decisions()[0].flotilla);
    EXPECT_EQ(decisions()[0].op, "conv3x3");
    EXPECT_EQ(decisions()[0].flotilla_ms, 0); // nothing timed
    EXPECT_FALSE(fs::exists(cache_file())) << "fixed writes no cache";
  }
  {
    Scope scope(Mode::kNone);
    EXPECT_TRUE(torch::equal(c.run(), c.aten()));
    EXPECT_TRUE(decisions().empty());
  }
}

// The first use times both and keeps the faster; the file holds it; a second process (here: this
// one, its decisions forgotten) reads it and times nothing.
TEST(KernelChoice, MeasuresOnceAndASecondRunReadsTheCache) {
  if (!has_kernel()) GTEST_SKIP() << "this CPU has neither AVX-512 nor AVX2";
  torch::manual_seed(2);
  const Conv c;
  Scope scope(Mode::kMeasure);
  const torch::Tensor first = c.run();
  ASSERT_EQ(decisions().size(), 1u);
  const Decision d = decisions()[0];
  EXPECT_FALSE(d.from_cache);
  EXPECT_GT(d.flotilla_ms, 0);
  EXPECT_GT(d.aten_ms, 0);
  EXPECT_EQ(d.flotilla, d.flotilla_ms < d.aten_ms);
  EXPECT_TRUE(torch::equal(first, d.flotilla ? c.winograd() : c.aten()));
  EXPECT_GT(seconds_measuring(), 0);
  // The key names the shape, the output channels, the type, no gradient and the threads.
  EXPECT_NE(d.key.find("4x16x8x8>16 f32 infer t"), std::string::npos) << d.key;

  ASSERT_TRUE(fs::exists(cache_file()));
  EXPECT_EQ(cache_file().parent_path(), cache_directory());
  const auto doc = nlohmann::json::parse(read(cache_file()));
  EXPECT_EQ(doc["format"], "flotilla kernel choices");
  const auto& entry = doc["choices"]["conv3x3 " + d.key];
  EXPECT_EQ(entry["kernel"], d.flotilla ? "flotilla" : "aten");
  EXPECT_DOUBLE_EQ(entry["flotilla_ms"].get<double>(), d.flotilla_ms);

  reset_decisions();
  EXPECT_TRUE(torch::equal(c.run(), first));
  ASSERT_EQ(decisions().size(), 1u);
  EXPECT_TRUE(decisions()[0].from_cache);
  EXPECT_EQ(decisions()[0].flotilla, d.flotilla);
  EXPECT_EQ(seconds_measuring(), 0);
}

// The file decides which runs: set to each candidate in turn, each runs, to the bit.
TEST(KernelChoice, EachCandidateRunsWhereTheCacheChoosesIt) {
  if (!has_kernel()) GTEST_SKIP() << "this CPU has neither AVX-512 nor AVX2";
  torch::manual_seed(3);
  const Conv c;
  Scope scope(Mode::kMeasure);
  c.run();
  const std::string key = "conv3x3 " + decisions().at(0).key;
  for (const std::string kernel : {"aten", "flotilla", "aten"}) {
    auto doc = nlohmann::json::parse(read(cache_file()));
    doc["choices"][key]["kernel"] = kernel;
    std::ofstream(cache_file()) << doc.dump();
    reset_decisions();
    EXPECT_TRUE(torch::equal(c.run(), kernel == "flotilla" ? c.winograd() : c.aten())) << kernel;
    EXPECT_EQ(decisions().at(0).flotilla, kernel == "flotilla");
    EXPECT_TRUE(decisions().at(0).from_cache);
  }
}

// A damaged file, one of another CPU, or one with a choice flotilla never writes: ignored with a
// warning, the choice measured in memory, and the file left exactly as it was.
TEST(KernelChoice, AFileThatIsNotOursIsIgnoredAndLeftAlone) {
  if (!has_kernel()) GTEST_SKIP() << "this CPU has neither AVX-512 nor AVX2";
  torch::manual_seed(4);
  const Conv c;
  std::string good;
  {
    Scope scope(Mode::kMeasure);
    c.run();
    good = read(cache_file());
  }
  auto edited = nlohmann::json::parse(good);
  edited["cpu"] = "another CPU";
  auto wrong_kernel = nlohmann::json::parse(good);
  for (auto& [key, entry] : wrong_kernel["choices"].items()) entry["kernel"] = "mine";
  auto negative = nlohmann::json::parse(good);
  for (auto& [key, entry] : negative["choices"].items()) entry["aten_ms"] = -1;
  for (const std::string contents :
       {std::string("{not json"), std::string("[]"), edited.dump(), wrong_kernel.dump(),
        negative.dump(), std::string("")}) {
    Scope scope(Mode::kMeasure);
    fs::create_directories(cache_file().parent_path());
    std::ofstream(cache_file()) << contents;
    ::testing::internal::CaptureStderr();
    const torch::Tensor y = c.run();
    const std::string said = ::testing::internal::GetCapturedStderr();
    ASSERT_EQ(decisions().size(), 1u) << contents;
    EXPECT_FALSE(decisions()[0].from_cache) << contents;
    EXPECT_GT(decisions()[0].flotilla_ms, 0) << contents;
    EXPECT_TRUE(torch::equal(y, decisions()[0].flotilla ? c.winograd() : c.aten()));
    EXPECT_NE(said.find(cache_file().string()), std::string::npos) << said;
    EXPECT_NE(said.find("ignored and left as it is"), std::string::npos) << said;
    EXPECT_EQ(read(cache_file()), contents);
  }
}

// No cache directory: every process measures for itself, nothing is written, nothing fails.
TEST(KernelChoice, WithoutACacheDirectoryItMeasuresInMemory) {
  if (!has_kernel()) GTEST_SKIP() << "this CPU has neither AVX-512 nor AVX2";
  const Conv c;
  KernelMode mode(Mode::kMeasure);
  set_cache_directory(fs::path());
  reset_decisions();
  EXPECT_EQ(cache_file(), fs::path());
  c.run();
  EXPECT_EQ(decisions().size(), 1u);
  EXPECT_FALSE(decisions()[0].from_cache);
  set_cache_directory(std::nullopt);
  reset_decisions();
}

// Training keys time forward and backward; a measurement leaves no gradient, no running
// statistic and no draw from the default generator behind.
TEST(KernelChoice, AMeasurementLeavesTheTrainingAroundItAsItWas) {
  if (std::string(batch_norm_relu_kernel()) == "none") GTEST_SKIP() << "no AVX2 or AVX-512";
  Scope scope(Mode::kMeasure);
  torch::manual_seed(5);
  torch::nn::BatchNorm2d bn(16);
  const torch::Tensor x = torch::randn({4, 16, 6, 6}).contiguous(kChannelsLast).requires_grad_();
  torch::manual_seed(6);
  const torch::Tensor expected_draw = torch::rand({1});
  torch::manual_seed(6);
  const torch::Tensor y = batch_norm_relu(*bn, x);
  EXPECT_TRUE(torch::equal(torch::rand({1}), expected_draw));
  ASSERT_EQ(decisions().size(), 1u);
  EXPECT_NE(decisions()[0].key.find(" train "), std::string::npos) << decisions()[0].key;
  EXPECT_FALSE(x.grad().defined());
  EXPECT_FALSE(bn->weight.grad().defined());
  EXPECT_EQ(bn->num_batches_tracked.item<int>(), 1); // this forward's, once
  y.sum().backward();
  EXPECT_TRUE(x.grad().defined());
}

TEST(KernelChoice, ModesAreNamedAsTheFlagTakesThem) {
  for (const Mode m : {Mode::kMeasure, Mode::kFixed, Mode::kNone}) {
    EXPECT_EQ(parse_mode(to_string(m)), m);
  }
  try {
    parse_mode("fast");
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("\"fast\""), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("measure"), std::string::npos) << e.what();
  }
}

} // namespace
} // namespace flotilla::kernels
