#include "flotilla/base/atomic_file.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "flotilla/error.h"
#include "support/subprocess.h"

namespace flotilla::base {
namespace {

namespace fs = std::filesystem;
using flotilla::testing::TempDir;

TEST(AtomicFile, AnAbandonedWriteLeavesThePreviousFileAndNoTemporary) {
  TempDir dir;
  const fs::path target = fs::path(dir.path()) / "ckpt";
  write_file_atomic(target, "good");
  {
    AtomicFile file(target);
    file.write("half of a new one");
    // destroyed without commit(), as when an exception unwinds mid-save
  }
  EXPECT_EQ(flotilla::testing::read_file(target), "good");
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1);
  write_file_atomic(target, "better");
  EXPECT_EQ(flotilla::testing::read_file(target), "better");
}

TEST(AtomicFile, UnwritableDirectoryIsACheckpointError) {
  EXPECT_THROW(write_file_atomic("/nonexistent/dir/file", "x"), CheckpointError);
}

} // namespace
} // namespace flotilla::base
