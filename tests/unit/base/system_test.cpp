#include "flotilla/base/system.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <cstdlib>
#include <vector>

namespace flotilla::base {
namespace {

long minor_faults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

// A step's activations: a few large blocks, written through, then all freed.
void one_step() {
  constexpr std::size_t kBlock = 24u << 20;
  std::vector<volatile char*> blocks;
  for (int b = 0; b < 4; ++b) {
    auto* p = static_cast<volatile char*>(std::malloc(kBlock));
    ASSERT_NE(p, nullptr);
    for (std::size_t i = 0; i < kBlock; i += 4096) p[i] = 1;
    blocks.push_back(p);
  }
  for (auto* p : blocks) std::free(const_cast<char*>(p));
}

#if defined(__GLIBC__)
TEST(System, KeepFreedMemoryLetsTheNextStepReuseItsBlocksWithoutPageFaults) {
  ASSERT_TRUE(keep_freed_memory());
  one_step(); // the first step faults its pages in
  const long before = minor_faults();
  for (int step = 0; step < 3; ++step) one_step();
  const long faults = minor_faults() - before;
  // Each step writes 96 MiB, 24576 pages: with malloc's defaults every one is unmapped when
  // freed and faulted in again by the next step (73728 faults in three steps). Kept, the steps
  // reuse the heap: at most a block's worth faults in while it settles.
  EXPECT_LT(faults, 24576) << "three steps faulted " << faults << " pages in";
}
#endif

} // namespace
} // namespace flotilla::base
