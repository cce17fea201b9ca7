// Mixed precision across workers: the loss-scale decision is the same everywhere (a forced
// overflow on one worker skips exactly one step on all), and mixed_bfloat16 trains the CNN as
// well as float32.
#include <gtest/gtest.h>

#include <mutex>

#include "flotilla/data/fashion_mnist.h"
#include "flotilla/train/callbacks.h"
#include "flotilla/train/mixed_precision.h"
#include "models/zoo.h"
#include "support/compare.h"
#include "support/ranks.h"
#include "support/subprocess.h"

namespace flotilla {
namespace {

using testing::run_ranks;
using testing::thread_cluster;
namespace nn = torch::nn;

std::mutex build_mutex; // ranks are threads sharing torch's generator


TEST(MixedPrecision, AnOverflowOnOneWorkerSkipsExactlyThatStepOnAll) {
  torch::manual_seed(1);
  auto x = torch::randn({64, 8});
  const auto y = torch::randint(0, 3, {64});
  // Worker 0's half of the third global batch of 16 (rows 32..39) holds an infinity.
  x[33][2] = std::numeric_limits<float>::infinity();
  std::vector<train::History> histories(2);
  std::vector<std::vector<float>> weights(2);
  std::vector<double> scales(2);
  std::vector<std::int64_t> updates(2);
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 2), comm);
    auto net = s.scope([] {
      std::lock_guard<std::mutex> lock(build_mutex);
      return nn::Sequential(nn::Linear(8, 16), nn::ReLU(), nn::Linear(16, 3));
    });
    train::Model model(s, net);
    train::CompileOptions compile;
    compile.optimizer = train::OptimizerOptions::sgd(0.1, 0.9);
    compile.loss_scale = train::LossScaleOptions{};
    model.compile(compile);
    train::FitOptions fit;
    fit.verbose = train::Verbosity::kSilent;
    histories[rank] = model.fit(data::Dataset::from_tensor_slices({x, y}).batch(16, true), fit);
    weights[rank] = testing::flat_parameters(*net);
    const auto state = model.training_state();
    scales[rank] = state.loss_scale;
    updates[rank] = state.iterations;
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(histories[r].epochs.at(0).steps, 4);
    EXPECT_EQ(histories[r].epochs.at(0).skipped_steps, 1);
    EXPECT_EQ(updates[r], 3); // 4 steps, 1 skipped: the schedules' step did not advance
    EXPECT_EQ(scales[r], 16384);
  }
  EXPECT_EQ(weights[0], weights[1]);
  for (float w : weights[0]) ASSERT_TRUE(std::isfinite(w));
}

struct CnnResult {
  double accuracy = 0;            // test accuracy, evaluated under the training policy
  double accuracy_in_bf16 = 0;    // the same weights evaluated under mixed_bfloat16
  double train_loss = 0;          // the epoch's mean training loss (Keras's "loss")
};

// The CNN after one epoch on 2 workers under `policy`, on the first 12000 training images,
// evaluated on the first 5000 test images (a resolution of 0.02 points, enough for the
// tolerances below; where bfloat16 is emulated, the evaluations are most of the test's time).
CnnResult train_cnn(train::Policy policy) {
  const auto train_images = data::load_fashion_mnist(data::kFashionMnistDir, data::Split::kTrain);
  const auto test_images = data::load_fashion_mnist(data::kFashionMnistDir, data::Split::kTest);
  auto normalize = [](data::Element e) {
    return data::Element{data::normalize_images(e[0]), e[1]};
  };
  constexpr std::int64_t kTrain = 12000;
  constexpr std::int64_t kTest = 5000;
  std::vector<CnnResult> results(2);
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    // Each worker builds its own pipeline, as each process would: a Dataset numbers its passes,
    // so ranks sharing one would shuffle differently, whichever began its pass first.
    const auto train_ds =
        data::Dataset::from_tensor_slices(
            {train_images.images.narrow(0, 0, kTrain), train_images.labels.narrow(0, 0, kTrain)})
            .shuffle(kTrain, 7)
            .batch(128, true)
            .map(normalize);
    const auto test_ds =
        data::Dataset::from_tensor_slices({test_images.images.narrow(0, 0, kTest),
                                           test_images.labels.narrow(0, 0, kTest)})
            .batch(500)
            .map(normalize);
    strategy::Strategy s(thread_cluster(rank, 2), comm);
    auto net = s.scope([] {
      std::lock_guard<std::mutex> lock(build_mutex);
      torch::manual_seed(5);
      return models::make_model("cnn");
    });
    train::Model model(s, net);
    train::CompileOptions compile;
    compile.optimizer = train::OptimizerOptions::sgd(0.05, 0.9);
    {
      std::lock_guard<std::mutex> lock(build_mutex);
      train::set_global_policy(policy); // compile() reads the process-wide policy
      model.compile(compile);
      train::set_global_policy(train::Policy::kFloat32);
    }
    EXPECT_EQ(model.policy(), policy);
    train::FitOptions fit;
    fit.verbose = train::Verbosity::kSilent;
    const auto history = model.fit(train_ds, fit);
    EXPECT_EQ(history.epochs.at(0).skipped_steps, 0);
    results[rank].accuracy = model.evaluate(test_ds).at("accuracy");
    results[rank].train_loss = history.epochs.at(0).values.at("loss");
    if (policy == train::Policy::kMixedBFloat16) { // evaluated in bf16 already
      results[rank].accuracy_in_bf16 = results[rank].accuracy;
      return;
    }
    train::Model bf16_view(s, net);
    {
      std::lock_guard<std::mutex> lock(build_mutex);
      train::set_global_policy(train::Policy::kMixedBFloat16);
      bf16_view.compile(compile);
      train::set_global_policy(train::Policy::kFloat32);
    }
    results[rank].accuracy_in_bf16 = bf16_view.evaluate(test_ds).at("accuracy");
  });
  EXPECT_EQ(results[0].accuracy, results[1].accuracy);
  return results[0];
}

// Two trainings that differ only in rounding drift apart: after one short epoch their test
// accuracies differ by up to 2.2 points either way (measured, seeds 5 to 8 on an Intel Xeon:
// 0.7754 against 0.7972, 0.8048 against 0.7946, ...), so one final accuracy is a race, and a
// two-sided bound on it failed whichever precision came out ahead. Asserted instead:
// - the same weights classify within 0.5 points in either precision;
// - the epoch's mean training loss, an average over its 93 steps, agrees within 3% (measured:
//   0.01% to 1.1% apart over those seeds; a training that learned half as fast, or not at all,
//   is tens of percent away);
// - both learned, and bf16 is not behind float32 by more than that race's width.
TEST(MixedPrecision, BFloat16CnnMatchesFloat32) {
  if (!testing::fashion_mnist_present()) GTEST_SKIP() << "dataset-fashion-mnist absent";
  const CnnResult fp32 = train_cnn(train::Policy::kFloat32);
  const CnnResult bf16 = train_cnn(train::Policy::kMixedBFloat16);
  std::printf("CNN, one epoch on 12000 images: float32 training %.4f (evaluated in bf16: %.4f), "
              "mean training loss %.4f; mixed_bfloat16 training %.4f, mean training loss %.4f\n",
              fp32.accuracy, fp32.accuracy_in_bf16, fp32.train_loss, bf16.accuracy,
              bf16.train_loss);
  EXPECT_GT(fp32.accuracy, 0.75); // it learned
  EXPECT_GT(bf16.accuracy, 0.75);
  EXPECT_NEAR(fp32.accuracy_in_bf16, fp32.accuracy, 0.005);
  EXPECT_NEAR(bf16.train_loss, fp32.train_loss, 0.03 * fp32.train_loss);
  EXPECT_GT(bf16.accuracy, fp32.accuracy - 0.03);
}

} // namespace
} // namespace flotilla
