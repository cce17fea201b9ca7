// The SidecarEvaluator against Model::evaluate: a trainer saves real checkpoints
// (checkpoint::CheckpointManager, ModelCheckpoint) while the evaluator, on a thread of its own
// with a model of its own, reports each one; what it reports must equal the trainer's own
// evaluation of the same weights, under the policy the trainer used.
#include <gtest/gtest.h>

#include <condition_variable>
#include <mutex>
#include <thread>

#include "flotilla/checkpoint/checkpoint_manager.h"
#include "flotilla/error.h"
#include "flotilla/train/callbacks.h"
#include "flotilla/train/sidecar_evaluator.h"
#include "support/subprocess.h"
#include "support/tensorboard.h"

namespace flotilla {
namespace {

namespace nn = torch::nn;
namespace fs = std::filesystem;

struct Data {
  Data() {
    torch::manual_seed(11);
    x = torch::randn({96, 8});
    y = x.narrow(1, 0, 3).argmax(1); // learnable: the largest of the first 3 features
  }
  torch::Tensor x, y;
  data::Dataset train() const {
    return data::Dataset::from_tensor_slices({x, y}).shuffle(96, 5).batch(16, true);
  }
  // A short last batch (96 = 3 x 40 - 24), as the evaluator's own batching may have.
  data::Dataset test() const { return data::Dataset::from_tensor_slices({x, y}).batch(40); }
};

std::mutex build_mutex; // the trainer and the evaluator build their nets on different threads

nn::Sequential make_net(std::uint64_t seed) {
  std::lock_guard<std::mutex> lock(build_mutex);
  torch::manual_seed(seed);
  return nn::Sequential(nn::Linear(8, 16), nn::ReLU(), nn::Linear(16, 3));
}

train::CompileOptions sgd() {
  train::CompileOptions compile;
  compile.optimizer = train::OptimizerOptions::sgd(0.1, 0.9);
  return compile;
}

train::FitOptions one_epoch() {
  train::FitOptions fit;
  fit.epochs = 1;
  fit.verbose = train::Verbosity::kSilent;
  return fit;
}

// What a checkpoint of `model` after `epoch` epochs holds (as ModelCheckpoint writes it).
checkpoint::CheckpointData snapshot(train::Model& model, std::int64_t epoch) {
  checkpoint::CheckpointData data;
  data.model = checkpoint::model_state(model.module());
  data.optimizer = checkpoint::optimizer_state(model.optimizer());
  data.epoch = epoch;
  data.step = model.iterations();
  data.policy = train::to_string(model.policy());
  return data;
}

// The global policy back to float32 whatever a test leaves behind.
struct Float32After {
  ~Float32After() { train::set_global_policy(train::Policy::kFloat32); }
};

TEST(SidecarEvaluator, ReportsEachNewCheckpointAsModelEvaluateMeasuresIt) {
  const Data d;
  testing::TempDir dir;
  strategy::MirroredStrategy trainer_strategy;
  auto trainer_net = make_net(3);
  train::Model trainer(trainer_strategy, trainer_net);
  trainer.compile(sgd());
  checkpoint::CheckpointManager manager(dir.path() + "/ckpt", /*max_to_keep=*/5);

  // The evaluator starts from other weights: only a loaded checkpoint can make it agree.
  strategy::MirroredStrategy evaluator_strategy;
  train::Model evaluator(evaluator_strategy, make_net(99));
  evaluator.compile(sgd());

  std::mutex mutex;
  std::condition_variable changed;
  std::vector<train::SidecarResult> reported;
  bool finished = false;
  train::SidecarEvaluatorOptions options;
  options.checkpoint_dir = dir.path() + "/ckpt";
  options.log_dir = dir.path() + "/tb/evaluation";
  options.poll_interval = std::chrono::milliseconds(1);
  options.last_epoch = 3;
  options.on_result = [&](const train::SidecarResult& r) {
    std::lock_guard<std::mutex> lock(mutex);
    reported.push_back(r);
    changed.notify_all();
  };
  train::SidecarEvaluator sidecar(evaluator, d.test(), options);
  std::vector<train::SidecarResult> returned;
  std::exception_ptr error;
  std::thread watcher([&] {
    try {
      returned = sidecar.start();
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(mutex);
    finished = true;
    changed.notify_all();
  });

  // One checkpoint at a time, each saved only once the previous one was reported, so that none
  // is replaced before the evaluator has seen it.
  std::vector<train::EvalResult> expected;
  for (int epoch = 1; epoch <= 3; ++epoch) {
    trainer.fit(d.train(), one_epoch());
    expected.push_back(trainer.evaluate(d.test()));
    manager.save(trainer_strategy.communicator(), trainer_strategy.log(), snapshot(trainer, epoch),
                 epoch);
    std::unique_lock<std::mutex> lock(mutex);
    changed.wait(lock, [&] { return finished || static_cast<int>(reported.size()) == epoch; });
    if (finished) break;
  }
  watcher.join();
  if (error) std::rethrow_exception(error);

  ASSERT_EQ(reported.size(), 3u);
  ASSERT_EQ(returned.size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) {
    const auto& r = reported[i];
    SCOPED_TRACE("checkpoint " + std::to_string(i + 1));
    EXPECT_EQ(r.checkpoint, fs::path(dir.path()) / "ckpt" / ("ckpt-" + std::to_string(i + 1)));
    EXPECT_EQ(r.epoch, static_cast<std::int64_t>(i + 1));
    EXPECT_EQ(r.step, static_cast<std::int64_t>(6 * (i + 1))); // 96 / 16 updates per epoch
    EXPECT_EQ(r.policy, train::Policy::kFloat32);
    EXPECT_EQ(r.result.samples, 96);
    EXPECT_DOUBLE_EQ(r.result.loss(), expected[i].loss());
    EXPECT_EQ(r.result.at("accuracy"), expected[i].at("accuracy"));
    EXPECT_EQ(returned[i].result.loss(), r.result.loss());
  }
  // Training changed the weights between checkpoints: three different measurements.
  EXPECT_NE(reported[0].result.loss(), reported[2].result.loss());

  if (!testing::tensorboard_installed()) GTEST_SKIP() << "tensorboard is not installed";
  const auto view = testing::tensorboard_view(dir.path() + "/tb/evaluation");
  const auto& losses = view.at("scalars").at("epoch_loss");
  ASSERT_EQ(losses.size(), 3u) << view.dump();
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(losses[i].at("step").get<std::int64_t>(), static_cast<std::int64_t>(i + 1));
    EXPECT_FLOAT_EQ(losses[i].at("value").get<float>(),
                    static_cast<float>(reported[i].result.loss()));
  }
}

TEST(SidecarEvaluator, EvaluatesUnderThePolicyTheCheckpointWasTrainedWith) {
  const Float32After reset;
  const Data d;
  testing::TempDir dir;
  // The chief trains and evaluates in mixed_bfloat16 (what --precision auto picks on a CPU with
  // AVX512-BF16); the evaluator's model is compiled in float32.
  strategy::MirroredStrategy trainer_strategy;
  train::Model trainer(trainer_strategy, make_net(3));
  train::set_global_policy(train::Policy::kMixedBFloat16);
  trainer.compile(sgd());
  train::set_global_policy(train::Policy::kFloat32);
  trainer.fit(d.train(), one_epoch());
  const train::EvalResult chief = trainer.evaluate(d.test());
  checkpoint::CheckpointManager(dir.path())
      .save(trainer_strategy.communicator(), trainer_strategy.log(), snapshot(trainer, 1), 1);

  strategy::MirroredStrategy evaluator_strategy;
  train::Model evaluator(evaluator_strategy, make_net(99));
  evaluator.compile(sgd());
  ASSERT_EQ(evaluator.policy(), train::Policy::kFloat32);
  train::SidecarEvaluatorOptions options;
  options.checkpoint_dir = dir.path();
  options.max_evaluations = 1;
  const auto results = train::SidecarEvaluator(evaluator, d.test(), options).start();
  ASSERT_EQ(results.size(), 1u);
  EXPECT_EQ(results[0].policy, train::Policy::kMixedBFloat16);
  EXPECT_DOUBLE_EQ(results[0].result.loss(), chief.loss());
  EXPECT_EQ(results[0].result.at("accuracy"), chief.at("accuracy"));
  EXPECT_EQ(evaluator.policy(), train::Policy::kMixedBFloat16);
  EXPECT_EQ(train::global_policy(), train::Policy::kFloat32); // put back after the recompile

  // Told to keep its own policy, it measures the same weights in float32: another loss, which
  // is what evaluating a bf16-trained run in float32 reported before.
  options.use_checkpoint_policy = false;
  train::Model float32_evaluator(evaluator_strategy, make_net(99));
  float32_evaluator.compile(sgd());
  const auto in_float32 = train::SidecarEvaluator(float32_evaluator, d.test(), options).start();
  ASSERT_EQ(in_float32.size(), 1u);
  EXPECT_EQ(in_float32[0].policy, train::Policy::kFloat32);
  EXPECT_NE(in_float32[0].result.loss(), chief.loss());
}

TEST(SidecarEvaluator, StopsAfterTheLastEpochsCheckpointThatModelCheckpointWrote) {
  const Data d;
  testing::TempDir dir;
  strategy::MirroredStrategy trainer_strategy;
  train::Model trainer(trainer_strategy, make_net(3));
  trainer.compile(sgd());
  train::FitOptions fit = one_epoch();
  fit.epochs = 2;
  train::ModelCheckpointOptions checkpoints;
  checkpoints.filepath = dir.path();
  fit.callbacks.push_back(std::make_shared<train::ModelCheckpoint>(checkpoints));
  trainer.fit(d.train(), fit);
  const train::EvalResult final_weights = trainer.evaluate(d.test());

  strategy::MirroredStrategy evaluator_strategy;
  train::Model evaluator(evaluator_strategy, make_net(99));
  evaluator.compile(sgd());
  train::SidecarEvaluatorOptions options;
  options.checkpoint_dir = dir.path();
  options.last_epoch = 2;
  // Started after training, it sees only the newest checkpoint, as TF's does, and stops there.
  const auto results = train::SidecarEvaluator(evaluator, d.test(), options).start();
  ASSERT_EQ(results.size(), 1u);
  EXPECT_EQ(results[0].checkpoint.filename(), "ckpt-2");
  EXPECT_EQ(results[0].epoch, 2);
  EXPECT_EQ(results[0].step, 12);
  EXPECT_DOUBLE_EQ(results[0].result.loss(), final_weights.loss());
  EXPECT_EQ(results[0].result.at("accuracy"), final_weights.at("accuracy"));
}

TEST(SidecarEvaluator, WithoutANewCheckpointItTimesOutSayingWhere) {
  const Data d;
  testing::TempDir dir;
  strategy::MirroredStrategy strategy;
  train::Model model(strategy, make_net(3));
  model.compile(sgd());
  train::SidecarEvaluatorOptions options;
  options.checkpoint_dir = dir.path();
  options.poll_interval = std::chrono::milliseconds(1);
  options.timeout = std::chrono::milliseconds(0);
  try {
    train::SidecarEvaluator(model, d.test(), options).start();
    ADD_FAILURE() << "no TimeoutError";
  } catch (const TimeoutError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("no new checkpoint in " + dir.path()), std::string::npos) << what;
    EXPECT_NE(what.find("SidecarEvaluatorOptions::timeout"), std::string::npos) << what;
  }
}

TEST(SidecarEvaluator, RefusesAnEmptyDirectoryAnUncompiledModelAndNoEvaluations) {
  const Data d;
  strategy::MirroredStrategy strategy;
  train::Model model(strategy, make_net(3));
  train::SidecarEvaluatorOptions options;
  options.checkpoint_dir = "/tmp/somewhere";
  EXPECT_THROW(train::SidecarEvaluator(model, d.test(), options), ConfigError); // not compiled
  model.compile(sgd());
  options.max_evaluations = 0;
  EXPECT_THROW(train::SidecarEvaluator(model, d.test(), options), ConfigError);
  options.max_evaluations.reset();
  options.checkpoint_dir.clear();
  try {
    train::SidecarEvaluator(model, d.test(), options);
    ADD_FAILURE() << "no ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("SidecarEvaluatorOptions::checkpoint_dir is empty"),
              std::string::npos)
        << e.what();
  }
}

} // namespace
} // namespace flotilla
