#include "flotilla/base/hashes.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "flotilla/error.h"
#include "support/subprocess.h"

namespace flotilla::base {
namespace {

namespace fs = std::filesystem;
using flotilla::testing::TempDir;

TEST(Hashes, Sha256MatchesTheStandardVectors) {
  EXPECT_EQ(sha256_hex("abc", 3),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  TempDir dir;
  const fs::path path = fs::path(dir.path()) / "f";
  std::ofstream(path) << "";
  EXPECT_EQ(sha256_file(path), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  // Longer than one read: a million 'a's.
  std::ofstream(path, std::ios::binary) << std::string(1000000, 'a');
  EXPECT_EQ(sha256_file(path), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  EXPECT_THROW(sha256_file(fs::path(dir.path()) / "none"), CheckpointError);
}

TEST(Hashes, HmacSha256MatchesRfc4231) {
  const auto mac = hmac_sha256("Jefe", "what do ya want for nothing?");
  std::string hex;
  for (auto b : mac) {
    char buf[3];
    std::snprintf(buf, sizeof buf, "%02x", b);
    hex += buf;
  }
  EXPECT_EQ(hex, "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

} // namespace
} // namespace flotilla::base
