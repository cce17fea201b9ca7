// BatchNorm under data parallelism: running statistics mirrored on every replica of every worker
// wherever they are read (TF's ON_READ MEAN), and SyncBatchNorm's global-batch statistics, so
// N workers x B/N train as one worker x B.
#include <gtest/gtest.h>

#include <torch/nn.h>

#include <mutex>

#include "flotilla/checkpoint/model_checkpoint.h"
#include "flotilla/strategy/strategy.h"
#include "flotilla/train/callbacks.h"
#include "flotilla/train/model.h"
#include "flotilla/train/sync_batchnorm.h"
#include "models/zoo.h"
#include "support/compare.h"
#include "support/ranks.h"
#include "support/subprocess.h"

namespace flotilla {
namespace {

using testing::max_relative_difference;
using testing::run_ranks;
using testing::thread_cluster;

std::mutex build_mutex; // ranks are threads sharing torch's generator

// Random images and labels, the same on every rank.
data::Element random_images(std::int64_t n, std::int64_t side, std::uint64_t seed) {
  std::lock_guard<std::mutex> lock(build_mutex);
  torch::manual_seed(seed);
  return {torch::randn({n, 1, side, side}) * 2 + 0.5, torch::randint(0, 10, {n}, torch::kLong)};
}

std::vector<torch::Tensor> float_buffers(const torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& b : m.buffers()) {
    if (b.is_floating_point()) out.push_back(b.detach().clone());
  }
  return out;
}

TEST(MirroredBuffers, EveryReplicaOfEveryWorkerHoldsTheSameStatisticsAfterFit) {
  const auto images = random_images(64, 28, 11);
  std::vector<std::vector<std::vector<torch::Tensor>>> buffers(2); // [worker][replica]
  std::vector<int> differed_mid_epoch(2, 0);
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 2), comm, 2);
    auto net = s.scope([] {
      std::lock_guard<std::mutex> lock(build_mutex);
      torch::manual_seed(5);
      return models::make_model("resnet20");
    });
    train::Model model(s, net);
    model.compile({});
    // Inside the epoch each replica keeps its own statistics (the control: without mirroring
    // they would stay apart).
    auto peek = std::make_shared<train::LambdaCallback>();
    peek->batch_end = [&, rank](std::int64_t, const train::Logs&) {
      const auto replicas = model.local_replicas();
      differed_mid_epoch[rank] |=
          !torch::equal(float_buffers(*replicas[0])[0], float_buffers(*replicas[1])[0]);
    };
    train::FitOptions fit;
    fit.verbose = train::Verbosity::kSilent;
    fit.callbacks = {peek};
    model.fit(data::Dataset::from_tensor_slices(images).batch(16), fit); // 4 steps, 4 per replica
    for (const auto& replica : model.local_replicas()) buffers[rank].push_back(float_buffers(*replica));
  });
  EXPECT_TRUE(differed_mid_epoch[0] && differed_mid_epoch[1]);
  const auto& reference = buffers[0][0];
  ASSERT_EQ(reference.size(), 42u); // 21 BatchNorms: running mean and variance
  for (int w = 0; w < 2; ++w) {
    for (int r = 0; r < 2; ++r) {
      for (std::size_t k = 0; k < reference.size(); ++k) {
        EXPECT_TRUE(torch::equal(buffers[w][r][k], reference[k]))
            << "worker " << w << " replica " << r << " buffer " << k;
      }
    }
  }
  // They moved from their initial values (zeros and ones): the mean of what the replicas saw.
  EXPECT_GT(reference[0].abs().max().item<double>(), 1e-3);
}

// Shares by speed: worker 0 takes 12 rows of the global batch of 16 and worker 1 the last 4,
// which lie 5 higher. Mirrored by share, the running mean after the one step is the one-worker
// running mean of all 16 rows (momentum 0.1 from zeros: a tenth of their mean); an unweighted
// mirror would give the mean of the two workers' means, 1.25 higher.
TEST(MirroredBuffers, SharesWeighEachWorkersStatisticsByItsRows) {
  torch::Tensor x = torch::randn({16, 4}, torch::kFloat64);
  x.slice(0, 12, 16).add_(5.0);
  const torch::Tensor y = torch::zeros({16}, torch::kLong);
  std::vector<torch::Tensor> means(2);
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 2), comm);
    s.set_shares({3, 1});
    auto net = s.scope([] {
      std::lock_guard<std::mutex> lock(build_mutex);
      torch::manual_seed(5);
      torch::nn::Sequential m(torch::nn::BatchNorm1d(4), torch::nn::Linear(4, 3));
      m->to(torch::kFloat64);
      return m;
    });
    train::Model model(s, net);
    model.compile({});
    train::FitOptions fit;
    fit.verbose = train::Verbosity::kSilent;
    model.fit(data::Dataset::from_tensor_slices({x, y}).batch(16), fit);
    means[rank] = net[0]->named_buffers()["running_mean"].clone();
  });
  const torch::Tensor expected = 0.1 * x.mean(0);
  for (int w = 0; w < 2; ++w) {
    EXPECT_TRUE(torch::allclose(means[w], expected, 0, 1e-12))
        << "worker " << w << ": " << means[w] << " against " << expected;
  }
}

TEST(MirroredBuffers, TwoWorkersEvaluateAsOneWorkerEvaluatesTheChiefsCheckpoint) {
  const auto train_images = random_images(64, 28, 12);
  const auto test_images = random_images(40, 28, 13);
  testing::TempDir dir;
  const std::string file = dir.path() + "/resnet20.safetensors";
  std::vector<train::EvalResult> pair(2);
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 2), comm);
    auto net = s.scope([] {
      std::lock_guard<std::mutex> lock(build_mutex);
      torch::manual_seed(6);
      return models::make_model("resnet20");
    });
    train::Model model(s, net);
    model.compile({});
    train::ModelCheckpointOptions save;
    save.filepath = file;
    save.save_weights_only = true;
    train::FitOptions fit;
    fit.verbose = train::Verbosity::kSilent;
    fit.callbacks = {std::make_shared<train::ModelCheckpoint>(save)};
    model.fit(data::Dataset::from_tensor_slices(train_images).batch(16), fit);
    pair[rank] = model.evaluate(data::Dataset::from_tensor_slices(test_images).batch(20));
  });
  train::EvalResult single;
  run_ranks(1, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 1), comm);
    auto net = s.scope([] { return models::make_model("resnet20"); });
    checkpoint::load_model(*net.ptr(), file);
    train::Model model(s, net);
    model.compile({});
    single = model.evaluate(data::Dataset::from_tensor_slices(test_images).batch(20));
  });
  EXPECT_EQ(pair[0].samples, 40);
  EXPECT_NEAR(pair[0].loss(), single.loss(), 1e-6 * single.loss());
  EXPECT_EQ(pair[0].at("accuracy"), single.at("accuracy"));
  EXPECT_EQ(pair[1].loss(), pair[0].loss());
}

// A small BatchNorm CNN on 12×12 images: two BatchNorms, one after a stride-2 conv.
torch::nn::Sequential bn_cnn() {
  namespace nn = torch::nn;
  return nn::Sequential(nn::Conv2d(nn::Conv2dOptions(1, 4, 3).padding(1)), nn::BatchNorm2d(4),
                        nn::ReLU(), nn::Conv2d(nn::Conv2dOptions(4, 8, 3).stride(2).padding(1)),
                        nn::BatchNorm2d(8), nn::ReLU(), nn::AdaptiveAvgPool2d(1), nn::Flatten(),
                        nn::Linear(8, 10));
}

struct Trained {
  std::vector<torch::Tensor> parameters, buffers;
};

// 20 float32 SGD steps with global batch 16 over 307 images: the last batch has 3, so one of
// 4 replicas gets none. `shares`: the workers' weights (Strategy::set_shares); empty: equal.
Trained train_bn_cnn(int workers, int replicas, bool sync,
                     const std::vector<std::int64_t>& shares = {}) {
  const auto images = random_images(19 * 16 + 3, 12, 14);
  std::vector<Trained> out(static_cast<std::size_t>(workers));
  run_ranks(workers, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, workers), comm, replicas);
    s.set_shares(shares);
    auto net = s.scope([&] {
      std::lock_guard<std::mutex> lock(build_mutex);
      torch::manual_seed(8);
      auto m = bn_cnn();
      return sync ? train::convert_sync_batchnorm(m) : m;
    });
    train::Model model(s, net);
    train::CompileOptions compile;
    compile.optimizer.learning_rate = 0.1;
    compile.optimizer.momentum = 0.9;
    model.compile(compile);
    train::FitOptions fit;
    fit.verbose = train::Verbosity::kSilent;
    const auto history = model.fit(data::Dataset::from_tensor_slices(images).batch(16), fit);
    EXPECT_EQ(history.epochs.at(0).steps, 20);
    for (const auto& p : net->parameters()) out[rank].parameters.push_back(p.detach().clone());
    out[rank].buffers = float_buffers(*net);
  });
  return out[0];
}

TEST(SyncBatchNorm, WorkersAndReplicasOfBPerNTrainAsOneWorkerOfB) {
  const Trained single = train_bn_cnn(1, 1, false); // plain BatchNorm over the whole batch
  for (const auto& [workers, replicas] : {std::pair{2, 1}, std::pair{2, 2}}) {
    const Trained synced = train_bn_cnn(workers, replicas, true);
    const double weights = max_relative_difference(synced.parameters, single.parameters);
    const double statistics = max_relative_difference(synced.buffers, single.buffers);
    RecordProperty("weights_" + std::to_string(workers) + "x" + std::to_string(replicas),
                   std::to_string(weights));
    EXPECT_LT(weights, 1e-5) << workers << " workers x " << replicas << " replicas";
    EXPECT_LT(statistics, 1e-5) << workers << " workers x " << replicas << " replicas";
  }
  // Control: per-replica statistics (plain BatchNorm) over 4 replicas are another training.
  const Trained local = train_bn_cnn(2, 2, false);
  EXPECT_GT(max_relative_difference(local.parameters, single.parameters), 1e-3);
}

// Shares by speed: worker 0 takes 12 rows of each 16 and worker 1 the other 4 (the last batch
// of 3: 2 and 1), and the global statistics are counted by rows, not averaged per worker, so
// the training is still the one worker's of B. Control: plain BatchNorm with those shares.
TEST(SyncBatchNorm, UnequalSharesOfTheGlobalBatchTrainAsOneWorkerOfB) {
  const Trained single = train_bn_cnn(1, 1, false);
  for (const auto& [replicas, shares] :
       {std::pair{1, std::vector<std::int64_t>{3, 1}}, std::pair{2, std::vector<std::int64_t>{1, 3}}}) {
    const Trained synced = train_bn_cnn(2, replicas, true, shares);
    EXPECT_LT(max_relative_difference(synced.parameters, single.parameters), 1e-5)
        << "shares " << shares[0] << "," << shares[1] << ", " << replicas << " replica(s)";
    EXPECT_LT(max_relative_difference(synced.buffers, single.buffers), 1e-5)
        << "shares " << shares[0] << "," << shares[1] << ", " << replicas << " replica(s)";
  }
  const Trained local = train_bn_cnn(2, 1, false, {3, 1});
  EXPECT_GT(max_relative_difference(local.parameters, single.parameters), 1e-3);
}

} // namespace
} // namespace flotilla
