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

} // namespace
} // namespace flotilla::strategy
