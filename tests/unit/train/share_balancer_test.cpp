// The share balancer's arithmetic (train/share_balancer.h): rows in proportion to speed, the
// compute time a division costs, and shares that fit Strategy::set_shares' bound.
#include "train/share_balancer.h"

#include <gtest/gtest.h>

#include <numeric>

#include "flotilla/cluster/input_context.h"

using namespace flotilla;
using namespace flotilla::train::detail;

TEST(ShareBalancer, RowsFollowTheSpeedsInWholeRowsThatSumToTheGlobalBatch) {
  EXPECT_EQ(rows_by_speed({2000, 1000}, 256), (std::vector<std::int64_t>{170, 86}));
  EXPECT_EQ(rows_by_speed({1, 1, 1}, 100), (std::vector<std::int64_t>{34, 33, 33}));
  // Each worker keeps at least one row, however slow.
  EXPECT_EQ(rows_by_speed({1000, 1}, 8), (std::vector<std::int64_t>{7, 1}));
  // A step takes as long as its slowest worker's rows over its speed.
  EXPECT_DOUBLE_EQ(step_compute_seconds({128, 128}, {2000, 1000}), 0.128);
  EXPECT_DOUBLE_EQ(step_compute_seconds({171, 85}, {2000, 1000}), 0.0855);
}

// A global batch of more rows than a share may weigh (2^20) divides by weights scaled into the
// bound: before, set_shares refused the rows themselves mid-fit.
TEST(ShareBalancer, AGlobalBatchLargerThanAShareWeightsBoundIsDividedByScaledWeights) {
  const std::vector<std::int64_t> small = {171, 85};
  EXPECT_EQ(weights_of(small), small);
  const std::int64_t global = std::int64_t{3} << 20;
  const std::vector<std::int64_t> rows = rows_by_speed({2000, 1000}, global);
  const std::vector<std::int64_t> weights = weights_of(rows);
  ASSERT_EQ(weights.size(), 2u);
  EXPECT_EQ(weights[0], cluster::kMaxShareWeight);
  EXPECT_NO_THROW(cluster::check_shares(weights, 2));
  cluster::InputContext context{2, 0, 2};
  context.shares = weights;
  // The division the weights give is within a row per 2^20 of the one asked for.
  for (int w = 0; w < 2; ++w) {
    EXPECT_NEAR(static_cast<double>(context.part_of(w).rows(global)),
                static_cast<double>(rows[static_cast<std::size_t>(w)]), 4.0)
        << "worker " << w;
  }
  EXPECT_EQ(context.part_of(0).rows(global) + context.part_of(1).rows(global), global);
  // However slow a worker, its weight stays at least 1.
  EXPECT_EQ(weights_of({std::int64_t{1} << 30, 1}).back(), 1);
}
