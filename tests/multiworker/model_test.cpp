// Model's numbers are global: every worker reports the same loss and accuracy, and they equal
// what one worker computes over the whole dataset.
#include <gtest/gtest.h>

#include <mutex>

#include "flotilla/error.h"
#include "flotilla/train/model.h"
#include "support/ranks.h"

namespace flotilla {
namespace {

using testing::run_ranks;
using testing::thread_cluster;
namespace nn = torch::nn;

std::mutex build_mutex; // ranks are threads sharing torch's generator

struct Data {
  torch::Tensor x = torch::randn({101, 8}); // 101: uneven across 2 workers and batches
  torch::Tensor y = torch::randint(0, 3, {101});
};

train::EvalResult evaluate_on(int world, const Data& data) {
  std::vector<train::EvalResult> results(world);
  run_ranks(world, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, world), comm);
    auto net = s.scope([] {
      std::lock_guard<std::mutex> lock(build_mutex);
      torch::manual_seed(3);
      return nn::Sequential(nn::Linear(8, 16), nn::ReLU(), nn::Linear(16, 3));
    });
    train::Model model(s, net);
    model.compile({});
    data::ShardedDataset ds(data.x, data.y, s.input_context(), {10, false, 0, false});
    results[rank] = model.evaluate(ds);
  });
  for (int r = 1; r < world; ++r) {
    EXPECT_EQ(results[r].loss, results[0].loss);
    EXPECT_EQ(results[r].accuracy, results[0].accuracy);
  }
  return results[0];
}

TEST(Model, EvaluateIsGlobalAndEqualsOneWorkersResult) {
  const Data data;
  const auto one = evaluate_on(1, data);
  const auto two = evaluate_on(2, data);
  EXPECT_EQ(one.samples, 101);
  EXPECT_EQ(two.samples, 101);
  EXPECT_NEAR(two.loss, one.loss, 1e-6);
  EXPECT_DOUBLE_EQ(two.accuracy, one.accuracy);
  EXPECT_GT(one.loss, 0.5); // an untrained 3-class model: about ln 3
}

TEST(Model, FitReportsTheSameGlobalEpochOnEveryWorker) {
  const Data data;
  std::vector<train::History> histories(2);
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 2), comm);
    auto net = s.scope([] { return nn::Linear(8, 3); });
    train::Model model(s, net);
    model.compile({});
    data::ShardedDataset ds(data.x, data.y, s.input_context(), {20, true, 1, true});
    train::FitOptions fit;
    fit.epochs = 2;
    fit.verbose = train::Verbosity::kSilent;
    histories[rank] = model.fit(ds, fit);
  });
  ASSERT_EQ(histories[0].epochs.size(), 2u);
  for (int e = 0; e < 2; ++e) {
    const auto& a = histories[0].epochs[e];
    const auto& b = histories[1].epochs[e];
    EXPECT_EQ(a.steps, 5); // 101 / 20, the partial batch dropped
    EXPECT_EQ(a.loss, b.loss);
    EXPECT_EQ(a.accuracy, b.accuracy);
    // Accuracy is a count over the 100 examples of the epoch.
    EXPECT_NEAR(a.accuracy * 100, std::round(a.accuracy * 100), 1e-9);
  }
}

TEST(Model, FitRefusesADatasetThatKeepsPartialBatches) {
  run_ranks(1, [](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 1), comm);
    auto net = s.scope([] { return nn::Linear(2, 2); });
    train::Model model(s, net);
    model.compile({});
    data::ShardedDataset ds(torch::randn({10, 2}), torch::zeros({10}, torch::kInt64),
                            s.input_context(), {4, true, 0, false});
    try {
      model.fit(ds);
      FAIL();
    } catch (const ConfigError& e) {
      EXPECT_EQ(std::string(e.what()),
                "fit() needs a training dataset with drop_remainder: each step is a collective, "
                "so every worker must run the same number of full steps; set "
                "ShardOptions.drop_remainder = true");
    }
  });
}

TEST(Model, UsingItBeforeCompileSaysSo) {
  run_ranks(1, [](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 1), comm);
    train::Model model(s, nn::Linear(2, 2));
    data::ShardedDataset ds(torch::randn({4, 2}), torch::zeros({4}, torch::kInt64),
                            s.input_context(), {2, false, 0, true});
    try {
      model.fit(ds);
      FAIL();
    } catch (const ConfigError& e) {
      EXPECT_EQ(std::string(e.what()), "Model.fit() before compile(); call compile() first");
    }
  });
}

} // namespace
} // namespace flotilla
