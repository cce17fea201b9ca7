// Models from Python: modules scripted by the venv's real torch (tests/fixtures/
// torchscript_reference.py), trained by flotilla, compared with the same steps taken by PyTorch
// itself; flotilla's checkpoint loaded back into the original nn.Module.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "flotilla/checkpoint/checkpoint_manager.h"
#include "flotilla/checkpoint/safetensors.h"
#include "flotilla/data/fashion_mnist.h"
#include "flotilla/error.h"
#include "flotilla/strategy/strategy.h"
#include "flotilla/train/checkpoint_callbacks.h"
#include "flotilla/train/model.h"
#include "flotilla/train/torchscript.h"
#include "support/compare.h"
#include "support/ranks.h"
#include "support/subprocess.h"
#include "support/tensorboard.h"

namespace flotilla {
namespace {

namespace fs = std::filesystem;
using testing::run_ranks;
using testing::thread_cluster;

constexpr std::int64_t kSteps = 20;
constexpr std::int64_t kBatch = 16;

void python(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {testing::test_python(),
                                   testing::source_dir() + "/tests/fixtures/torchscript_reference.py"};
  argv.insert(argv.end(), args.begin(), args.end());
  const auto r = testing::run_process(argv);
  ASSERT_EQ(r.exit_code, 0) << r.err;
}

class TorchScript : public ::testing::Test {
 protected:
  // One directory for the suite: the scripted modules and the fixed batches (the first
  // kSteps x kBatch Fashion-MNIST training images, normalised), written once.
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir();
    python({"make", dir_->path()});
    const auto all = data::load_fashion_mnist(data::kFashionMnistDir, data::Split::kTrain);
    images_ = data::normalize_images(all.images.slice(0, 0, kSteps * kBatch));
    labels_ = all.labels.slice(0, 0, kSteps * kBatch).clone();
    checkpoint::save_safetensors(fs::path(dir_->path()) / "batches.safetensors",
                                 {{"images", images_}, {"labels", labels_}});
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override {
    if (!testing::fashion_mnist_present()) GTEST_SKIP() << "dataset-fashion-mnist absent";
  }

  static std::string path(const std::string& name) { return fs::path(dir_->path()) / name; }

  // flotilla's kSteps SGD steps on the fixed batches, in order, with `workers` thread-ranks.
  // Returns the chief's state: named parameters and buffers after fit (buffers mirrored).
  // `callbacks`: each worker's own (checkpoints are collective: every worker saves, the others
  // into temporary directories).
  using Callbacks = std::function<std::vector<std::shared_ptr<train::Callback>>()>;
  static std::map<std::string, torch::Tensor> train(const std::string& name, int workers,
                                                    torch::Dtype dtype = torch::kFloat32,
                                                    const Callbacks& callbacks = {},
                                                    int replicas_per_worker = 1,
                                                    bool sync_batchnorm = false) {
    std::map<std::string, torch::Tensor> state;
    run_ranks(workers, [&](int rank, collective::Communicator& comm) {
      strategy::Strategy s(thread_cluster(rank, workers), comm, replicas_per_worker);
      train::TorchScriptModule script = train::load_torchscript(path(name + ".pt"));
      if (sync_batchnorm) EXPECT_EQ(script->convert_sync_batchnorm(), 1);
      script->to(dtype);
      train::Model model(s, script);
      train::CompileOptions compile;
      compile.optimizer = train::OptimizerOptions::sgd(0.05, 0.9);
      model.compile(compile);
      train::FitOptions fit;
      fit.verbose = train::Verbosity::kSilent;
      if (callbacks) fit.callbacks = callbacks();
      model.fit(data::distribute_dataset(
                    data::Dataset::from_tensor_slices({images_.to(dtype), labels_})
                        .batch(kBatch, true),
                    s.input_context()),
                fit);
      if (rank == 0) {
        for (const auto& p : script->named_parameters()) state[p.key()] = p.value().detach().clone();
        for (const auto& b : script->named_buffers()) state[b.key()] = b.value().detach().clone();
      }
    });
    return state;
  }

  static void expect_equal_to(const std::map<std::string, torch::Tensor>& ours,
                              const std::string& expected_file, double tolerance) {
    const auto expected = checkpoint::load_safetensors(path(expected_file)).tensors;
    ASSERT_EQ(ours.size(), expected.size());
    for (const auto& [name, tensor] : expected) {
      ASSERT_TRUE(ours.count(name)) << name;
      const torch::Tensor mine = ours.at(name);
      if (tensor.is_floating_point()) {
        EXPECT_LT((mine - tensor).abs().max().item<double>(), tolerance) << name;
      } else {
        EXPECT_TRUE(torch::equal(mine, tensor)) << name << ": " << mine << " vs " << tensor;
      }
    }
  }

  // Float32 sums in another order (another thread count, another split of the batch) differ in
  // their last bits, and 20 steps amplify that past 1e-5: PyTorch here runs on one thread, and
  // so does flotilla for those comparisons.
  struct OneThread {
    int before = torch::get_num_threads();
    OneThread() { torch::set_num_threads(1); }
    ~OneThread() { torch::set_num_threads(before); }
  };

  static testing::TempDir* dir_;
  static torch::Tensor images_, labels_;
};

testing::TempDir* TorchScript::dir_ = nullptr;
torch::Tensor TorchScript::images_;
torch::Tensor TorchScript::labels_;

// flotilla keeps these conv models channels-last (CompileOptions::channels_last's default), so
// the reference trains channels-last too: the same kernels, summing in the same order.
TEST_F(TorchScript, TwentySgdStepsEqualPyTorchsOwn) {
  OneThread one;
  const auto ours = train("bn", 1);
  python({"train", dir_->path(), "bn", "1", std::to_string(kSteps), "float32", "channels_last"});
  expect_equal_to(ours, "expected_bn_1.safetensors", 1e-5);
  // Control: the steps moved the weights well beyond the tolerance.
  const auto initial = train::load_torchscript(path("bn.pt"));
  EXPECT_GT((initial->named_parameters()["conv.weight"] - ours.at("conv.weight")).abs().max().item<double>(),
            1e-3);
}

TEST_F(TorchScript, ATracedModuleTrainsLikeTheScriptedOne) {
  // The same weights (same seed), traced in training mode: the same 20 steps.
  OneThread one;
  const auto ours = train("bn_traced", 1);
  python({"train", dir_->path(), "bn", "1", std::to_string(kSteps), "float32", "channels_last"});
  expect_equal_to(ours, "expected_bn_1.safetensors", 1e-5);
}

TEST_F(TorchScript, TwoWorkersOfHalfBatchesEqualPyTorchsTwoReplicas) {
  // BatchNorm normalises each replica's half with its own statistics (as DDP does without
  // SyncBatchNorm), so the reference is PyTorch with two replicas: gradients averaged, buffers
  // averaged at the end.
  OneThread one;
  const auto ours = train("bn", 2);
  python({"train", dir_->path(), "bn", "2", std::to_string(kSteps), "float32", "channels_last"});
  expect_equal_to(ours, "expected_bn_2.safetensors", 1e-5);
}

TEST_F(TorchScript, TwoReplicasOnOneWorkerEqualPyTorchsTwoReplicas) {
  // Replica 1 is a deep copy (TorchScriptModuleImpl::clone) on its own thread.
  OneThread one;
  const auto ours = train("bn", 1, torch::kFloat32, {}, 2);
  python({"train", dir_->path(), "bn", "2", std::to_string(kSteps), "float32", "channels_last"});
  expect_equal_to(ours, "expected_bn_2.safetensors", 1e-5);
}

TEST_F(TorchScript, WithSyncBatchNormTwoWorkersOfHalfBatchesEqualOneWorker) {
  // The module's compiled batch_norm calls become SyncBatchNorm's: the statistics of the whole
  // global batch, so the split cannot change the mathematics. Scripted and traced; float64, so
  // that the comparison tests the algorithm.
  for (const std::string name : {"bn", "bn_traced"}) {
    const auto one = train(name, 1, torch::kFloat64);
    const auto two = train(name, 2, torch::kFloat64, {}, 1, /*sync_batchnorm=*/true);
    const auto replicas = train(name, 1, torch::kFloat64, {}, 2, /*sync_batchnorm=*/true);
    for (const auto& [key, tensor] : one) {
      if (!tensor.is_floating_point()) {
        EXPECT_TRUE(torch::equal(tensor, two.at(key))) << name << " " << key;
        continue;
      }
      EXPECT_LT((tensor - two.at(key)).abs().max().item<double>(), 1e-9) << name << " " << key;
      EXPECT_LT((tensor - replicas.at(key)).abs().max().item<double>(), 1e-9) << name << " " << key;
    }
    // Control: without it, the halves' own statistics end elsewhere.
    const auto plain = train(name, 2, torch::kFloat64);
    EXPECT_GT((one.at("norm.running_var") - plain.at("norm.running_var")).abs().max().item<double>(),
              1e-3);
  }
  train::TorchScriptModule ran = train::load_torchscript(path("bn.pt"));
  ran->forward(images_.slice(0, 0, 2));
  EXPECT_THROW(ran->convert_sync_batchnorm(), ConfigError);
  EXPECT_EQ(train::load_torchscript(path("plain.pt"))->convert_sync_batchnorm(), 0);
}

TEST_F(TorchScript, TwoWorkersOfHalfBatchesEqualOneWorkerWithoutBatchNorm) {
  // GroupNorm normalises each image alone: the split cannot change the mathematics. In float64,
  // so that the comparison tests the algorithm, not float32 sums in another order (seen: 1e-4).
  const auto one = train("plain", 1, torch::kFloat64);
  const auto two = train("plain", 2, torch::kFloat64);
  for (const auto& [name, tensor] : one) {
    EXPECT_LT((tensor - two.at(name)).abs().max().item<double>(), 1e-5) << name;
  }
}

TEST_F(TorchScript, PythonLoadsTheCheckpointIntoTheOriginalModule) {
  testing::TempDir checkpoints;
  train::ModelCheckpointOptions options;
  options.filepath = fs::path(checkpoints.path()) / "ckpt";
  const auto ours = train("bn", 2, torch::kFloat32, [&] {
    return std::vector<std::shared_ptr<train::Callback>>{
        std::make_shared<train::ModelCheckpoint>(options)};
  });
  const fs::path model_file = fs::path(checkpoints.path()) / "ckpt" / "ckpt-1" /
                              checkpoint::kModelFile;
  ASSERT_TRUE(fs::exists(model_file)) << model_file;
  python({"load", dir_->path(), "bn", model_file.string()});
  // Python's eval outputs from the loaded state equal flotilla's from its own.
  train::TorchScriptModule script = train::load_torchscript(path("bn.pt"));
  torch::NoGradGuard no_grad;
  for (auto& p : script->named_parameters()) p.value().copy_(ours.at(p.key()));
  for (auto& b : script->named_buffers()) b.value().copy_(ours.at(b.key()));
  script->eval();
  const torch::Tensor mine = script->forward(images_.slice(0, 0, 8));
  const torch::Tensor theirs =
      checkpoint::load_safetensors(path("outputs.safetensors")).tensors.at("outputs");
  EXPECT_LT((mine - theirs).abs().max().item<double>(), 1e-6);
}

struct Crash : std::runtime_error {
  Crash() : std::runtime_error("crash") {}
};
class CrashAfter : public train::Callback {
 public:
  explicit CrashAfter(int updates) : updates_(updates) {}
  void on_train_batch_end(std::int64_t, const train::Logs&) override {
    if (++seen_ == updates_) throw Crash();
  }

 private:
  int updates_, seen_ = 0;
};

TEST_F(TorchScript, ABackupResumesTheParametersBitForBit) {
  // 2 workers, 2 epochs of 20 updates, backups every 8: a crash after update 27 resumes from the
  // backup at 24 and ends where the uninterrupted run ends.
  testing::TempDir dir;
  const fs::path backup = fs::path(dir.path()) / "backup";
  std::vector<std::vector<torch::Tensor>> uninterrupted(2), resumed(2);
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 2), comm);
    const auto data = data::Dataset::from_tensor_slices({images_, labels_}).batch(kBatch, true);
    auto run = [&](std::vector<std::shared_ptr<train::Callback>> callbacks) {
      train::TorchScriptModule script = train::load_torchscript(path("bn.pt"));
      train::Model model(s, script);
      train::CompileOptions compile;
      compile.optimizer = train::OptimizerOptions::sgd(0.05, 0.9);
      model.compile(compile);
      train::FitOptions fit;
      fit.epochs = 2;
      fit.verbose = train::Verbosity::kSilent;
      fit.callbacks = std::move(callbacks);
      model.fit(data::distribute_dataset(data, s.input_context()), fit);
      std::vector<torch::Tensor> state;
      for (const auto& p : script->parameters()) state.push_back(p.detach().clone());
      for (const auto& b : script->buffers()) state.push_back(b.detach().clone());
      return state;
    };
    uninterrupted[rank] = run({});
    EXPECT_THROW(run({std::make_shared<train::BackupAndRestore>(train::BackupOptions{backup, 8}),
                      std::make_shared<CrashAfter>(27)}),
                 Crash);
    resumed[rank] =
        run({std::make_shared<train::BackupAndRestore>(train::BackupOptions{backup, 8})});
  });
  // The parameters bit for bit. The BatchNorm statistics were saved as their mean over the
  // workers (TF's ON_READ value; each worker had its own until then) and the resumed run goes on
  // from that mean: the final mean is the same sum, rounded in another order.
  constexpr std::size_t kParameters = 6;
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_EQ(resumed[rank].size(), uninterrupted[rank].size());
    for (std::size_t k = 0; k < resumed[rank].size(); ++k) {
      if (k < kParameters || !resumed[rank][k].is_floating_point()) {
        EXPECT_TRUE(torch::equal(resumed[rank][k], uninterrupted[rank][k])) << rank << " " << k;
      } else {
        EXPECT_LT(testing::max_relative_difference({resumed[rank][k]}, {uninterrupted[rank][k]}),
                  1e-6)
            << rank << " " << k;
      }
    }
  }
}

TEST_F(TorchScript, AFileThatIsNotAModuleIsOneClearError) {
  const std::string bogus = path("not_a_module.pt");
  std::ofstream(bogus) << "this is not a zip archive";
  try {
    train::load_torchscript(bogus);
    FAIL() << "loaded a text file";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(bogus + " is not a TorchScript module"), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
  EXPECT_THROW(train::load_torchscript(path("absent.pt")), ConfigError);
}

TEST_F(TorchScript, AForwardThatRejectsTheBatchNamesItsShapeAndLeavesTheBuffersAlone) {
  train::TorchScriptModule script = train::load_torchscript(path("bn.pt"));
  const torch::Tensor mean_before = script->named_buffers()["norm.running_mean"].clone();
  {
    // Control: a forward in training mode moves the running statistics.
    torch::NoGradGuard no_grad;
    auto copy = std::dynamic_pointer_cast<train::TorchScriptModuleImpl>(script->clone());
    copy->train();
    copy->forward(images_.slice(0, 0, 2));
    EXPECT_FALSE(torch::equal(copy->named_buffers()["norm.running_mean"], mean_before));
  }
  script->eval(); // check_forward runs it in training mode, then puts the mode back
  train::check_forward(script, images_.slice(0, 0, 2)); // fits: no change to the statistics
  EXPECT_TRUE(torch::equal(script->named_buffers()["norm.running_mean"], mean_before));
  EXPECT_FALSE(script->is_training());
  try {
    train::check_forward(script, torch::zeros({2, 3, 32, 32}));
    FAIL() << "a 3-channel batch went through a 1-channel conv";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("forward failed on a batch of shape [2, 3, 32, 32] Float"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("channels"), std::string::npos) << what; // torch's own words
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
  EXPECT_FALSE(script->is_training()); // restored after a failure too
}

TEST_F(TorchScript, ATiedWeightIsTrainedOnceAndATraceInTrainingModeIsNamed) {
  // a.weight and b.weight are one tensor: registered (so optimised, and all-reduced) once.
  const auto tied = train::load_torchscript(path("tied.pt"));
  EXPECT_EQ(tied->named_parameters().keys(),
            (std::vector<std::string>{"a.weight", "a.bias", "b.bias"}));
  EXPECT_TRUE(train::load_torchscript(path("bn_traced.pt"))->traced_in_training_mode());
  EXPECT_FALSE(train::load_torchscript(path("bn.pt"))->traced_in_training_mode());
}

// A scripted module of two inputs (an image, a side feature) and two outputs (a tuple: class
// logits, a regression), trained by two workers on half batches with a loss of both outputs
// (LossOptions::custom_outputs), ends as PyTorch's two replicas do (1e-5, one thread); evaluate()
// reports each output's own metric, and predict_outputs() gives both outputs of every element.
TEST_F(TorchScript, AModuleOfTwoInputsAndTwoOutputsTrainsAsPyTorchDoes) {
  OneThread one;
  namespace F = torch::nn::functional;
  const torch::Tensor side = images_.mean({1, 2, 3}).unsqueeze(1);
  const torch::Tensor targets = images_.flatten(1).std(1);
  checkpoint::save_safetensors(
      path("two_io_batches.safetensors"),
      {{"images", images_}, {"side", side}, {"labels", labels_}, {"targets", targets}});
  const auto elements = data::Dataset::from_tensor_slices({images_, side, labels_, targets});
  std::map<std::string, torch::Tensor> ours;
  std::vector<train::EvalResult> evaluated(2);
  std::vector<train::Tensors> predicted(2);
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 2), comm);
    train::TorchScriptModule script = train::load_torchscript(path("two_io.pt"));
    EXPECT_EQ(script->inputs(), 2);
    train::Model model(s, script.ptr(), train::torchscript_forward(script),
                       train::Signature{2, 2}, train::torchscript_clone(script));
    train::CompileOptions compile;
    compile.optimizer = train::OptimizerOptions::sgd(0.05, 0.9);
    compile.loss.custom_outputs = [](const train::Tensors& out, const train::Tensors& labels) {
      return F::cross_entropy(out[0], labels[0],
                              F::CrossEntropyFuncOptions().reduction(torch::kNone)) +
             0.1 * (out[1].squeeze(1) - labels[1]).square();
    };
    compile.output_metrics = std::vector<std::vector<std::string>>{{"accuracy"}, {"mae"}};
    model.compile(compile);
    train::FitOptions fit;
    fit.verbose = train::Verbosity::kSilent;
    model.fit(data::distribute_dataset(elements.batch(kBatch, true), s.input_context()), fit);
    if (rank == 0) {
      for (const auto& p : script->named_parameters()) ours[p.key()] = p.value().detach().clone();
    }
    evaluated[rank] = model.evaluate(elements.batch(kBatch));
    predicted[rank] = model.predict_outputs(
        data::Dataset::from_tensor_slices({images_.slice(0, 0, 10), side.slice(0, 0, 10)})
            .batch(4));
  });
  python({"train_two_io", dir_->path(), std::to_string(kSteps)});
  expect_equal_to(ours, "expected_two_io_2.safetensors", 1e-5);

  EXPECT_EQ(evaluated[0].at("output_0_accuracy"), evaluated[1].at("output_0_accuracy"));
  EXPECT_GT(evaluated[0].at("output_1_mae"), 0);
  EXPECT_FALSE(evaluated[0].values.get("output_1_accuracy").has_value());
  // The trained module's own outputs for the first 10 elements.
  train::TorchScriptModule trained = train::load_torchscript(path("two_io.pt"));
  {
    torch::NoGradGuard no_grad;
    for (auto& p : trained->named_parameters()) p.value().copy_(ours.at(p.key()));
  }
  trained->eval();
  torch::NoGradGuard no_grad;
  const auto direct = trained->forward_all({images_.slice(0, 0, 10), side.slice(0, 0, 10)});
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_EQ(predicted[rank].size(), 2u);
    for (std::size_t o = 0; o < 2; ++o) {
      EXPECT_LT((predicted[rank][o] - direct[o]).abs().max().item<double>(), 1e-5)
          << "rank " << rank << ", output " << o;
    }
  }
  // Its one-tensor forward says what to use instead.
  try {
    trained->forward(images_.slice(0, 0, 2));
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("forward takes 2 inputs; give the Model "
                                         "torchscript_forward() and a Signature of 2 inputs"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(TorchScript, ReplicasAreDeepCopiesUnderTheSameNames) {
  train::TorchScriptModule script = train::load_torchscript(path("bn.pt"));
  auto copy = std::dynamic_pointer_cast<train::TorchScriptModuleImpl>(script->clone());
  ASSERT_TRUE(copy);
  const auto mine = script->named_parameters();
  const auto theirs = copy->named_parameters();
  ASSERT_EQ(mine.keys(), theirs.keys());
  EXPECT_EQ(mine.keys(), (std::vector<std::string>{"conv.weight", "conv.bias", "norm.weight",
                                                    "norm.bias", "head.weight", "head.bias"}));
  torch::NoGradGuard no_grad;
  theirs["conv.bias"].add_(1);
  EXPECT_FALSE(torch::equal(mine["conv.bias"], theirs["conv.bias"]));
  // The copy's forward reads the copy's parameters.
  script->eval();
  copy->eval();
  EXPECT_FALSE(torch::equal(script->forward(images_.slice(0, 0, 2)),
                            copy->forward(images_.slice(0, 0, 2))));
}

} // namespace
} // namespace flotilla
