#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "flotilla/checkpoint/safetensors.h"
#include "flotilla/error.h"
#include "support/paths.h"
#include "support/subprocess.h"

namespace flotilla::checkpoint {
namespace {

using flotilla::testing::TempDir;
namespace fs = std::filesystem;

std::string error_of(const std::string& path) {
  try {
    load_safetensors(path);
  } catch (const CheckpointError& e) {
    return e.what();
  }
  return "no error";
}

TEST(Safetensors, RoundTripsEveryDtypeAndMetadata) {
  TempDir dir;
  const std::string path = dir.path() + "/m.safetensors";
  NamedTensors tensors = {
      {"w", torch::randn({3, 5})},
      {"b", torch::arange(7, torch::kFloat64)},
      {"h", torch::randn({4}).to(torch::kFloat16)},
      {"bf", torch::randn({2, 2}).to(torch::kBFloat16)},
      {"steps", torch::tensor({int64_t{1} << 40})},
      {"i32", torch::tensor({-3, 4}, torch::kInt32)},
      {"mask", torch::tensor({true, false, true})},
      {"bytes", torch::tensor({0, 255}, torch::kUInt8)},
      {"empty", torch::zeros({0, 3})},
      {"strided", torch::randn({4, 6}).t()}, // not contiguous
  };
  save_safetensors(path, tensors, {{"epoch", "3"}});
  const auto loaded = load_safetensors(path);
  EXPECT_EQ(loaded.metadata.at("epoch"), "3");
  ASSERT_EQ(loaded.tensors.size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    const auto& got = loaded.tensors.at(name);
    EXPECT_EQ(got.scalar_type(), t.scalar_type()) << name;
    EXPECT_TRUE(torch::equal(got, t)) << name;
  }
  // Header length is a multiple of 8, so the data that follows is aligned.
  std::ifstream in(path, std::ios::binary);
  std::uint64_t header = 0;
  in.read(reinterpret_cast<char*>(&header), 8);
  EXPECT_EQ(header % 8, 0u);
}

TEST(Safetensors, CorruptFilesAreNamedNotLoaded) {
  TempDir dir;
  const std::string path = dir.path() + "/m.safetensors";
  save_safetensors(path, {{"w", torch::ones({100})}});
  const auto size = fs::file_size(path);
  fs::resize_file(path, size - 10);
  EXPECT_EQ(error_of(path), path + ": tensor \"w\" claims bytes [0, 400) for 400 bytes of data "
                                   "in a 390-byte section; the file is corrupt");
  fs::resize_file(path, 5);
  EXPECT_EQ(error_of(path), path + ": truncated: 5 bytes, shorter than the 8-byte header length");
  std::ofstream(path, std::ios::binary)
      << std::string("\xff\xff\xff\xff\x00\x00\x00\x00", 8) << "{}";
  EXPECT_EQ(error_of(path), path + ": header length 4294967295 does not fit in a file of 10 "
                                   "bytes; the file is truncated or not safetensors");
  EXPECT_EQ(error_of(dir.path() + "/none"), dir.path() + "/none: cannot open it; check the path");
  // A shape far larger than the file is refused before anything is allocated.
  const std::string header =
      R"({"w":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,16]}})";
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(header.size() >> (8 * i));
  std::ofstream(path, std::ios::binary) << bytes << header << std::string(16, '\0');
  EXPECT_EQ(error_of(path), path + ": tensor \"w\" has shape [4611686018427387904, 4], larger "
                                   "than the file's 16-byte data section; the file is corrupt");
  // A dimension beyond 64 bits (a float to JSON) is named, never converted (fuzz_safetensors
  // found that conversion undefined).
  const std::string beyond =
      R"({"w":{"dtype":"F32","shape":[109916277099511627776],"data_offsets":[0,4]}})";
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(beyond.size() >> (8 * i));
  std::ofstream(path, std::ios::binary) << bytes << beyond << std::string(4, '\0');
  EXPECT_EQ(error_of(path), path + ": tensor \"w\"'s shape holds 1.0991627709951163e+20, not an "
                                   "integer in [-2^63, 2^63); the file is corrupt");
}

// The Python safetensors package (a real client) reads what we write, and we read what it writes.
TEST(Safetensors, InteroperatesWithPythonSafetensors) {
  const std::string python = flotilla::testing::test_python();
  ASSERT_EQ(flotilla::testing::run_process({python, "-c", "import safetensors"}).exit_code, 0)
      << "the test venv lacks safetensors (" << python << "); run scripts/bootstrap";
  TempDir dir;
  const std::string ours = dir.path() + "/ours.safetensors";
  const std::string theirs = dir.path() + "/theirs.safetensors";
  save_safetensors(ours,
                   {{"a", torch::arange(6, torch::kFloat32).reshape({2, 3})},
                    {"b", torch::tensor({1.5}, torch::kBFloat16)}},
                   {{"epoch", "7"}});
  const std::string script = R"(
import json, sys, torch
from safetensors import safe_open
from safetensors.torch import save_file
with safe_open(sys.argv[1], framework="pt") as f:
    out = {k: [list(f.get_tensor(k).shape), float(f.get_tensor(k).float().sum())] for k in f.keys()}
    out["__metadata__"] = f.metadata()
print(json.dumps(out))
save_file({"x": torch.arange(4, dtype=torch.int64), "y": torch.full((2, 2), 0.25)}, sys.argv[2],
          metadata={"by": "python"})
)";
  const auto result = flotilla::testing::run_process({python, "-c", script, ours, theirs});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  const auto json = nlohmann::json::parse(result.out.substr(result.out.find('{')));
  EXPECT_EQ(json["a"][0], nlohmann::json({2, 3}));
  EXPECT_EQ(json["a"][1], 15.0);
  EXPECT_EQ(json["b"][1], 1.5);
  EXPECT_EQ(json["__metadata__"]["epoch"], "7");
  const auto loaded = load_safetensors(theirs);
  EXPECT_TRUE(torch::equal(loaded.tensors.at("x"), torch::arange(4, torch::kInt64)));
  EXPECT_TRUE(torch::equal(loaded.tensors.at("y"), torch::full({2, 2}, 0.25)));
  EXPECT_EQ(loaded.metadata.at("by"), "python");
}

} // namespace
} // namespace flotilla::checkpoint
