#include <gtest/gtest.h>

#include <mutex>

#include "flotilla/strategy/strategy.h"
#include "support/ranks.h"

namespace flotilla::strategy {
namespace {

using flotilla::testing::run_ranks;
using flotilla::testing::thread_cluster;
namespace nn = torch::nn;

torch::Tensor flat_state(nn::Module& m) {
  std::vector<torch::Tensor> parts;
  for (const auto& p : m.parameters()) parts.push_back(p.detach().reshape({-1}));
  for (const auto& b : m.buffers()) parts.push_back(b.detach().to(torch::kFloat32).reshape({-1}));
  return torch::cat(parts);
}

TEST(Strategy, ScopeStartsEveryReplicaFromTheChiefsParametersAndBuffers) {
  constexpr int kWorld = 3;
  std::vector<torch::Tensor> before(kWorld), after(kWorld);
  run_ranks(kWorld, [&](int rank, collective::Communicator& comm) {
    Strategy strategy(thread_cluster(rank, kWorld), comm);
    EXPECT_EQ(strategy.num_replicas_in_sync(), kWorld);
    EXPECT_EQ(strategy.is_chief(), rank == 0);
    auto net = strategy.scope([&] {
      auto m = nn::Sequential(nn::Linear(4, 3), nn::BatchNorm1d(3));
      torch::NoGradGuard no_grad;
      for (auto& p : m->parameters()) p.fill_(static_cast<float>(rank + 1));
      for (auto& b : m->buffers()) b.fill_(rank + 1); // running stats and the step counter
      before[rank] = flat_state(*m);
      return m;
    });
    after[rank] = flat_state(*net);
  });
  EXPECT_FALSE(torch::equal(before[0], before[1]));
  for (int r = 0; r < kWorld; ++r) EXPECT_TRUE(torch::equal(after[r], before[0])) << "rank " << r;
}

TEST(Strategy, ReduceGivesTheGlobalValue) {
  run_ranks(4, [](int rank, collective::Communicator& comm) {
    Strategy strategy(thread_cluster(rank, 4), comm);
    const auto value = torch::tensor({static_cast<double>(rank), 1.0});
    EXPECT_TRUE(torch::equal(strategy.reduce(ReduceOp::kSum, value), torch::tensor({6.0, 4.0})));
    EXPECT_TRUE(torch::equal(strategy.reduce(ReduceOp::kMean, value), torch::tensor({1.5, 1.0})));
    EXPECT_TRUE(torch::equal(value, torch::tensor({static_cast<double>(rank), 1.0}))); // untouched
    EXPECT_EQ(strategy.input_context().input_pipeline_id, rank);
    EXPECT_EQ(strategy.input_context().num_input_pipelines, 4);
  });
}

TEST(GradientReducer, BucketsFollowReverseRegistrationOrderUpToBytesPerPack) {
  auto net = nn::Sequential(nn::Linear(10, 10), nn::Linear(10, 5)); // 100, 10, 50, 5 floats
  auto comm = collective::Communicator::local_group(1).front();
  GradientReducer reducer(comm, net->parameters(), /*bytes_per_pack=*/240);
  const auto& buckets = reducer.buckets();
  ASSERT_EQ(buckets.size(), 3u);
  EXPECT_EQ(buckets[0].params, (std::vector<std::size_t>{3, 2})); // 1.bias, 1.weight: 220 B
  EXPECT_EQ(buckets[0].offsets, (std::vector<std::int64_t>{0, 5}));
  EXPECT_EQ(buckets[1].params, (std::vector<std::size_t>{1})); // 0.bias
  EXPECT_EQ(buckets[2].params, (std::vector<std::size_t>{0})); // 0.weight alone exceeds it
  EXPECT_EQ(buckets[2].numel, 100);
  EXPECT_EQ(buckets[2].flat.numel(), 101); // and one used-flag
  GradientReducer one(comm, net->parameters(), 25 << 20);
  EXPECT_EQ(one.buckets().size(), 1u);
}

TEST(GradientReducer, AveragesGradientsAndCountsMissingOnesAsZero) {
  run_ranks(2, [](int rank, collective::Communicator& comm) {
    auto net = nn::Sequential(nn::Linear(3, 2), nn::Linear(2, 1), nn::Linear(1, 1));
    auto params = net->parameters();
    GradientReducer reducer(comm, params, /*bytes_per_pack=*/16); // several buckets
    for (std::size_t k = 0; k < params.size(); ++k) {
      // Rank 0 never produces a gradient for parameter 1 (an unused layer on this replica);
      // nobody produces one for the last layer's weight (unused everywhere).
      if (rank == 0 && k == 1) continue;
      if (k == 4) continue;
      params[k].mutable_grad() =
          torch::full_like(params[k], static_cast<float>((rank + 1) * (k + 1)));
    }
    reducer.prepare();
    reducer.finish();
    EXPECT_FALSE(params[4].grad().defined()) << "unused everywhere: no gradient, no update";
    for (std::size_t k = 0; k < params.size(); ++k) {
      if (k == 4) continue;
      ASSERT_TRUE(params[k].grad().defined()) << k;
      const float expected = k == 1 ? (2.0f * 2) / 2 : (1.0f + 2.0f) * (k + 1) / 2;
      EXPECT_TRUE(torch::equal(params[k].grad(), torch::full_like(params[k], expected))) << k;
    }
  });
}

} // namespace
} // namespace flotilla::strategy
