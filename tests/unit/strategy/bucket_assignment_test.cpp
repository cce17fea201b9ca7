#include "flotilla/strategy/bucket_assignment.h"

#include <gtest/gtest.h>

#include "flotilla/error.h"

namespace flotilla::strategy {
namespace {

using Plan = std::vector<std::vector<std::size_t>>;

TEST(BucketAssignment, FillsInOrderUpToTheCapAndNeverSplitsAParameter) {
  const std::vector<GradientSlot> slots = {
      {40, "Float@cpu"}, {4000, "Float@cpu"}, {40, "Float@cpu"}, {400, "Float@cpu"}};
  // 40 closes before the big one (40 + 4000 > 1000), which is a bucket on its own, then 40 + 400.
  EXPECT_EQ(assign_buckets(slots, 1000), (Plan{{0}, {1}, {2, 3}}));
  EXPECT_EQ(assign_buckets(slots, 4480), (Plan{{0, 1, 2, 3}}));
  EXPECT_EQ(assign_buckets(slots, 4479), (Plan{{0, 1, 2}, {3}}));
  EXPECT_TRUE(assign_buckets({}, 1000).empty());
}

TEST(BucketAssignment, OneKindPerBucket) {
  const std::vector<GradientSlot> slots = {
      {4, "Float@cpu"}, {2, "Half@cpu"}, {2, "Half@cpu"}, {4, "Float@cpu"}, {4, "Float@cuda:0"}};
  EXPECT_EQ(assign_buckets(slots, 1 << 20), (Plan{{0}, {1, 2}, {3}, {4}}));
}

TEST(BucketAssignment, ACapBelowOneByteIsRefused) {
  EXPECT_THROW(assign_buckets({{4, "Float@cpu"}}, 0), ConfigError);
}

} // namespace
} // namespace flotilla::strategy
