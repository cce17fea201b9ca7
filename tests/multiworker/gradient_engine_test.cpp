// The gradient engine: bucket plans, gradients as bucket views, overlap, unused parameters,
// compression, several replicas per worker, accumulation, the start-up consistency check and
// timeouts that name the missing rank. Ranks are threads over an in-memory store.
#include <gtest/gtest.h>

#include <map>
#include <mutex>

#include "flotilla/data/fashion_mnist.h"
#include "flotilla/error.h"
#include "flotilla/strategy/strategy.h"
#include "flotilla/train/model.h"
#include "models/zoo.h"
#include "support/compare.h"
#include "support/ranks.h"
#include "support/subprocess.h"

namespace flotilla::strategy {
namespace {

using flotilla::testing::max_relative_difference;
using flotilla::testing::run_ranks;
using flotilla::testing::thread_cluster;
namespace nn = torch::nn;

std::mutex build_mutex; // ranks are threads sharing torch's generator

collective::CommunicationOptions with_pack(std::int64_t bytes, bool overlap = true) {
  auto options = flotilla::testing::test_options();
  options.bytes_per_pack = bytes;
  options.overlap = overlap;
  return options;
}

TEST(GradientEngine, BucketsFollowReverseRegistrationOrderUpToBytesPerPack) {
  auto net = nn::Sequential(nn::Linear(10, 10), nn::Linear(10, 5)); // 100, 10, 50, 5 floats
  auto comm = collective::Communicator::local_group(1).front();
  GradientReducer reducer(comm, {net->parameters()}, with_pack(240));
  const auto& buckets = reducer.buckets();
  ASSERT_EQ(buckets.size(), 3u);
  EXPECT_EQ(buckets[0].params, (std::vector<std::size_t>{3, 2})); // 1.bias, 1.weight: 220 B
  EXPECT_EQ(buckets[0].offsets, (std::vector<std::int64_t>{0, 5}));
  EXPECT_EQ(buckets[1].params, (std::vector<std::size_t>{1})); // 0.bias
  EXPECT_EQ(buckets[2].params, (std::vector<std::size_t>{0})); // 0.weight alone exceeds it
  EXPECT_EQ(buckets[2].numel, 100);
  EXPECT_EQ(reducer.plan(), "3 bucket(s): [Float x 55, params 3 2] [Float x 10, params 1] "
                            "[Float x 100, params 0]");
  GradientReducer one(comm, {net->parameters()}, with_pack(25 << 20));
  EXPECT_EQ(one.buckets().size(), 1u);
}

// Parameters registered float, double, float: a bucket never mixes dtypes, so the plan has
// three buckets even though all would fit in one.
struct Mixed : nn::Module {
  Mixed() {
    a = register_parameter("a", torch::ones({4}));
    b = register_parameter("b", torch::ones({3}, torch::kFloat64));
    c = register_parameter("c", torch::ones({2}));
  }
  torch::Tensor a, b, c;
};

TEST(GradientEngine, BucketPlanSplitsByDtype) {
  Mixed m;
  auto comm = collective::Communicator::local_group(1).front();
  GradientReducer reducer(comm, {m.parameters()}, with_pack(25 << 20));
  const auto& buckets = reducer.buckets();
  ASSERT_EQ(buckets.size(), 3u);
  EXPECT_EQ(buckets[0].params, (std::vector<std::size_t>{2}));
  EXPECT_EQ(buckets[0].dtype, torch::kFloat32);
  EXPECT_EQ(buckets[1].params, (std::vector<std::size_t>{1}));
  EXPECT_EQ(buckets[1].dtype, torch::kFloat64);
  EXPECT_EQ(buckets[2].params, (std::vector<std::size_t>{0}));
  // Each gradient is a view of its own dtype, and backward fills it in place.
  (m.a.sum() + 2 * m.b.sum() + 3 * m.c.sum()).backward();
  EXPECT_EQ(m.b.grad().scalar_type(), torch::kFloat64);
  EXPECT_TRUE(torch::equal(m.b.grad(), torch::full({3}, 2.0, torch::kFloat64)));
  EXPECT_TRUE(torch::equal(m.c.grad(), torch::full({2}, 3.0f)));
}

TEST(GradientEngine, GradientsAreViewsIntoTheBucketAcrossSteps) {
  run_ranks(2, [](int rank, collective::Communicator& comm) {
    auto net = nn::Sequential(nn::Linear(6, 4), nn::Linear(4, 2));
    auto params = net->parameters();
    GradientReducer reducer(comm, {params}, with_pack(25 << 20)); // one bucket
    std::vector<const void*> where;
    for (auto& p : params) where.push_back(p.grad().data_ptr());
    for (int step = 0; step < 3; ++step) {
      reducer.zero_grad();
      reducer.prepare();
      net->forward(torch::full({2, 6}, static_cast<float>(rank + step))).sum().backward();
      // Already in the bucket when backward returns: autograd wrote there, finish() copies nothing.
      for (auto& p : params)
        EXPECT_TRUE(p.grad().storage().is_alias_of(params[0].grad().storage()));
      reducer.finish();
      for (std::size_t k = 0; k < params.size(); ++k) {
        // Same memory every step: autograd accumulated into the bucket, nothing was copied out.
        EXPECT_EQ(params[k].grad().data_ptr(), where[k]) << "param " << k << " step " << step;
        // And that memory is the one bucket's: every gradient shares one storage.
        EXPECT_TRUE(params[k].grad().storage().is_alias_of(params[0].grad().storage()))
            << "param " << k << " has a gradient of its own, not a bucket view";
      }
    }
  });
}

// Rank 0 never produces a gradient for parameter 1 (a layer unused on this replica); nobody
// produces one for parameter 0 (unused everywhere). Nothing hangs; the mean counts the missing
// gradient as zero; the globally unused parameter keeps no gradient.
TEST(GradientEngine, UnusedParametersNeitherHangNorGetAGradient) {
  for (bool overlap : {true, false}) {
    run_ranks(2, [overlap](int rank, collective::Communicator& comm) {
      auto net = nn::Sequential(nn::Linear(3, 2), nn::Linear(2, 1), nn::Linear(1, 1));
      auto params = net->parameters();
      GradientReducer reducer(comm, {params}, with_pack(16, overlap)); // several buckets
      for (int step = 0; step < 2; ++step) {
        reducer.zero_grad();
        reducer.prepare();
        torch::Tensor loss = torch::zeros({});
        for (std::size_t k = 0; k < params.size(); ++k) {
          if ((rank == 0 && k == 1) || k == 0) continue;
          loss = loss + params[k].sum() * static_cast<float>((rank + 1) * (k + 1));
        }
        loss.backward();
        reducer.finish();
        EXPECT_FALSE(params[0].grad().defined()) << "unused everywhere: no gradient, no update";
        for (std::size_t k = 0; k < params.size(); ++k) {
          if (k == 0) continue;
          ASSERT_TRUE(params[k].grad().defined()) << k;
          const float expected = k == 1 ? (2.0f * 2) / 2 : (1.0f + 2.0f) * (k + 1) / 2;
          EXPECT_TRUE(torch::allclose(params[k].grad(), torch::full_like(params[k], expected)))
              << "param " << k << " overlap " << overlap;
        }
      }
      const auto stats = reducer.stats();
      EXPECT_EQ(stats.syncs, 2);
      if (!overlap) EXPECT_EQ(stats.buckets_in_backward, 0);
      // The last layers' buckets are complete on both ranks: with overlap they start inside
      // backward (the first layer's waits for finish(), and so do those after it in the plan).
      if (overlap) EXPECT_GT(stats.buckets_in_backward, 0);
    });
  }
}

// A second backward in one step would add into a bucket already on the wire: refused, as DDP
// refuses it, instead of a silently wrong mean.
TEST(GradientEngine, ASecondBackwardInOneStepIsRefused) {
  run_ranks(2, [](int rank, collective::Communicator& comm) {
    auto net = nn::Sequential(nn::Linear(4, 3));
    GradientReducer reducer(comm, {net->parameters()}, with_pack(25 << 20));
    reducer.zero_grad();
    reducer.prepare();
    auto loss = net->forward(torch::ones({2, 4})).sum();
    loss.backward({}, /*retain_graph=*/true); // the bucket starts in here
    try {
      loss.backward();
      ADD_FAILURE() << "rank " << rank << ": the second backward was accepted";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("got a second gradient in one step, after its "
                                           "bucket's all-reduce started"),
                std::string::npos)
          << e.what();
    }
    reducer.finish(); // the first backward's all-reduce still completes on both ranks
    // Refused before it was added: the bucket carried the first backward's gradient only.
    EXPECT_TRUE(torch::equal(net->parameters()[0].grad(), torch::full({3, 4}, 2.0f)));
    // A step that fails midway leaves the ranks out of step: the engine says so from then on.
    reducer.abort_step();
    try {
      reducer.zero_grad();
      ADD_FAILURE() << "a broken engine took another step";
    } catch (const CommError& e) {
      EXPECT_NE(std::string(e.what()).find("restart the workers"), std::string::npos) << e.what();
    }
  });
}

TEST(GradientEngine, CompressionHalvesTheBytesAndKeepsTheMean) {
  for (auto compression : {collective::Compression::kFp16, collective::Compression::kBf16}) {
    std::vector<torch::Tensor> exact(2), compressed(2);
    std::vector<std::int64_t> bytes(2);
    for (int pass = 0; pass < 2; ++pass) {
      auto options = with_pack(25 << 20);
      if (pass == 1) options.compression = compression;
      run_ranks(
          2,
          [&, pass](int rank, collective::Communicator& comm) {
            nn::Sequential net;
            torch::Tensor input;
            {
              std::lock_guard<std::mutex> lock(build_mutex);
              torch::manual_seed(7);
              net = nn::Sequential(nn::Linear(32, 16), nn::Linear(16, 4));
              torch::manual_seed(100 + rank);
              input = torch::randn({8, 32});
            }
            GradientReducer reducer(comm, {net->parameters()}, options);
            reducer.zero_grad();
            reducer.prepare();
            net->forward(input).pow(2).sum().backward();
            reducer.finish();
            if (rank == 0) {
              std::vector<torch::Tensor> grads;
              for (auto& p : net->parameters()) grads.push_back(p.grad().reshape({-1}));
              (pass == 0 ? exact : compressed)[0] = torch::cat(grads);
              bytes[pass] = reducer.stats().wire_bytes;
            }
          },
          options);
    }
    EXPECT_EQ(bytes[1] * 2, bytes[0]) << "half the bytes on the wire";
    const double tolerance = compression == collective::Compression::kFp16 ? 2e-3 : 1e-2;
    const double error =
        ((compressed[0] - exact[0]).abs().max() / exact[0].abs().max()).item<double>();
    EXPECT_LT(error, tolerance) << collective::to_string(compression);
    EXPECT_GT(error, 0) << "compression that changes nothing did not compress";
  }
}

// --- Equivalence: every way of splitting the work takes the same SGD steps -----------------

constexpr std::int64_t kGlobalBatch = 64;
constexpr std::int64_t kSteps = 5;

struct Layout {
  int workers = 1;
  int replicas_per_worker = 1;
  int accumulation = 1;
  bool overlap = true;
  collective::Compression compression = collective::Compression::kNone;
  std::int64_t steps = kSteps;
  bool edit_after_compile = false; // halve every weight after compile(), as a checkpoint load would
  std::vector<std::int64_t> shares; // each worker's weight (Strategy::set_shares); empty: equal
};

std::vector<torch::Tensor> train_mlp(const Layout& setup, const data::Dataset& images,
                                     double* accuracy = nullptr) {
  std::vector<torch::Tensor> out;
  auto options = with_pack(64 << 10, setup.overlap); // several buckets, so overlap matters
  options.compression = setup.compression;
  run_ranks(
      setup.workers,
      [&](int rank, collective::Communicator& comm) {
        Strategy strategy(thread_cluster(rank, setup.workers), comm, setup.replicas_per_worker);
        strategy.set_shares(setup.shares);
        auto net = strategy.scope([] {
          std::lock_guard<std::mutex> lock(build_mutex);
          torch::manual_seed(1234);
          return models::make_model("mlp");
        });
        train::Model model(strategy, net);
        train::CompileOptions compile;
        compile.optimizer.learning_rate = 0.05;
        compile.optimizer.momentum = 0.9;
        compile.gradient_accumulation_steps = setup.accumulation;
        model.compile(compile);
        if (setup.edit_after_compile) {
          torch::NoGradGuard no_grad;
          for (auto& p : net->parameters()) p.mul_(0.5);
        }
        const auto dataset = data::distribute_dataset(
            images.shuffle(10000, /*seed=*/5)
                .batch(kGlobalBatch / setup.accumulation, /*drop_remainder=*/true)
                .map([](data::Element e) {
                  return data::Element{data::normalize_images(e[0]), e[1]};
                }),
            strategy.input_context());
        train::FitOptions fit;
        fit.steps_per_epoch = setup.steps * setup.accumulation;
        fit.verbose = train::Verbosity::kSilent;
        if (setup.steps > 0) model.fit(dataset, fit);
        if (accuracy) {
          const auto test = data::fashion_mnist(data::kFashionMnistDir, data::Split::kTest)
                                .take(2000)
                                .batch(500)
                                .map([](data::Element e) {
                                  return data::Element{data::normalize_images(e[0]), e[1]};
                                });
          const double acc = model.evaluate(test).at("accuracy");
          if (rank == 0) *accuracy = acc;
        }
        if (rank == 0) {
          for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
        }
      },
      options);
  return out;
}

class EngineEquivalence : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!flotilla::testing::fashion_mnist_present()) GTEST_SKIP() << "dataset absent";
    images_ = std::make_unique<data::Dataset>(
        data::fashion_mnist(data::kFashionMnistDir, data::Split::kTrain).take(4096));
    reference_ = train_mlp(Layout{}, *images_);
    initial_ = train_mlp(Layout{1, 1, 1, true, collective::Compression::kNone, 0}, *images_);
  }
  void expect_same(const Layout& setup, const char* what) {
    const auto got = train_mlp(setup, *images_);
    ASSERT_EQ(got.size(), reference_.size());
    const double difference = max_relative_difference(got, reference_);
    std::printf("%s: max relative difference %.2e\n", what, difference);
    EXPECT_LT(difference, 1e-5) << what;
    // And training moved: the comparison is not between two untouched models.
    EXPECT_GT((reference_[0] - initial_[0]).abs().max().item<double>(), 1e-4);
  }
  std::unique_ptr<data::Dataset> images_;
  std::vector<torch::Tensor> initial_;
  std::vector<torch::Tensor> reference_; // 1 worker, 1 replica, batch 64
};

TEST_F(EngineEquivalence, TwoWorkersWithOverlapOnAndOff) {
  expect_same({2, 1, 1, true}, "2 workers, overlap on");
  expect_same({2, 1, 1, false}, "2 workers, overlap off");
}

TEST_F(EngineEquivalence, SeveralReplicasPerWorker) {
  expect_same({1, 2, 1, true}, "1 worker x 2 replicas");
  expect_same({2, 2, 1, true}, "2 workers x 2 replicas");
}

TEST_F(EngineEquivalence, WeightsChangedAfterCompileReachEveryReplica) {
  Layout one;
  one.edit_after_compile = true;
  Layout two = one;
  two.replicas_per_worker = 2;
  const auto expected = train_mlp(one, *images_);
  const double difference = max_relative_difference(train_mlp(two, *images_), expected);
  EXPECT_LT(difference, 1e-5);
  EXPECT_GT(max_relative_difference(expected, reference_), 1e-2) << "the edit changed nothing";
}

TEST_F(EngineEquivalence, GradientAccumulation) {
  expect_same({1, 1, 2, true}, "1 worker, 2 micro-batches of 32");
  expect_same({2, 1, 2, true}, "2 workers, 2 micro-batches of 32");
  expect_same({2, 2, 2, false}, "2 workers x 2 replicas, 2 micro-batches, overlap off");
  // Shares by speed: each micro-batch of 32 divides 24 and 8; the gradient is still each
  // micro-batch's mean over its rows, added over the group.
  Layout shared{2, 1, 2, true};
  shared.shares = {3, 1};
  expect_same(shared, "2 workers of shares 3,1, 2 micro-batches of 32");
}

// Training with half-precision gradients on the wire ends where fp32 does, to within noise.
TEST(GradientEngine, CompressionBarelyChangesAccuracy) {
  if (!flotilla::testing::fashion_mnist_present()) GTEST_SKIP() << "dataset absent";
  const auto images = data::fashion_mnist(data::kFashionMnistDir, data::Split::kTrain);
  std::map<std::string, double> accuracy;
  for (auto compression : {collective::Compression::kNone, collective::Compression::kFp16,
                           collective::Compression::kBf16}) {
    double acc = 0;
    train_mlp({2, 1, 1, true, compression, 300}, images, &acc);
    accuracy[std::string(collective::to_string(compression))] = acc;
  }
  std::printf("accuracy after 300 steps: none %.4f, fp16 %.4f, bf16 %.4f\n", accuracy["none"],
              accuracy["fp16"], accuracy["bf16"]);
  EXPECT_GT(accuracy["none"], 0.75);
  EXPECT_NEAR(accuracy["fp16"], accuracy["none"], 0.015);
  EXPECT_NEAR(accuracy["bf16"], accuracy["none"], 0.015);
}

// --- Failing loudly instead of hanging ----------------------------------------------------

TEST(GradientEngine, DisagreeingWorkersStopWithADiffNamingTheWorkerAndField) {
  std::vector<std::string> messages(2);
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    Strategy strategy(thread_cluster(rank, 2), comm);
    auto net = strategy.scope([&] {
      std::lock_guard<std::mutex> lock(build_mutex);
      return nn::Sequential(nn::Flatten(), nn::Linear(784, 32), nn::ReLU(), nn::Linear(32, 10));
    });
    train::Model model(strategy, net);
    train::CompileOptions compile;
    compile.gradient_accumulation_steps = rank == 1 ? 2 : 1; // rank 1 was started differently
    model.compile(compile);
    auto data = data::Dataset::from_tensor_slices(
                    {torch::zeros({64, 1, 28, 28}), torch::zeros({64}, torch::kInt64)})
                    .batch(rank == 1 ? 16 : 32);
    train::FitOptions fit;
    fit.verbose = train::Verbosity::kSilent;
    // Only rank 1 divides by speed: its reports would meet the chief's gradient all-reduces.
    if (rank == 1) fit.balance_shares_every = 20;
    try {
      model.fit(data, fit);
    } catch (const ConfigError& e) {
      messages[rank] = e.what();
    }
  });
  EXPECT_EQ(messages[0], messages[1]) << "every worker stops with the same report";
  EXPECT_NE(messages[0].find("shares by speed: worker rank 1 has measured every 20 steps, "
                             "straggler floor 0.1, the chief (rank 0) has off"),
            std::string::npos)
      << messages[0];
  EXPECT_NE(messages[0].find("the workers disagree on the training setup"), std::string::npos)
      << messages[0];
  EXPECT_NE(messages[0].find("gradient accumulation steps: worker rank 1 has 2, the chief (rank "
                             "0) has 1"),
            std::string::npos)
      << messages[0];
  EXPECT_NE(messages[0].find("per-replica batch: worker rank 1 has 8, the chief (rank 0) has 16"),
            std::string::npos)
      << messages[0];
}

TEST(GradientEngine, TimeoutNamesTheRankThatDidNotArrive) {
  auto options = flotilla::testing::test_options();
  options.timeout = std::chrono::seconds(1);
  std::vector<std::string> messages(3);
  run_ranks(
      3,
      [&](int rank, collective::Communicator& comm) {
        comm.all_reduce(torch::ones({4})).wait(); // #1: everyone
        if (rank == 2) return;                    // rank 2 skips #2 (and stays connected)
        try {
          comm.all_reduce(torch::ones({4})).wait();
        } catch (const TimeoutError& e) {
          messages[rank] = e.what();
        }
      },
      options);
  for (int rank : {0, 1}) {
    EXPECT_NE(messages[rank].find("all_reduce #2 (sum, 4 x float) on rank " + std::to_string(rank) +
                                  " of 3 did not complete within 1s"),
              std::string::npos)
        << messages[rank];
    EXPECT_NE(messages[rank].find("rank 2 did not arrive (no word from it"), std::string::npos)
        << messages[rank];
    EXPECT_EQ(messages[rank].find("rank " + std::to_string(1 - rank) + " did not arrive"),
              std::string::npos)
        << "the other rank did arrive: " << messages[rank];
  }
}

} // namespace
} // namespace flotilla::strategy
