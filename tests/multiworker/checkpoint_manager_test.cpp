// Checkpoint directories (model + optimizer safetensors, manifest with SHA-256s, TensorFlow's
// pointer file) saved collectively by thread-ranks: what stays on disk, exact resumption of
// training, readers outside flotilla, damaged files, and failures on one worker.
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/version.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <regex>

#include "flotilla/base/hashes.h"
#include "flotilla/checkpoint/checkpoint_manager.h"
#include "flotilla/error.h"
#include "flotilla/strategy/strategy.h"
#include "support/paths.h"
#include "support/ranks.h"
#include "support/subprocess.h"

namespace flotilla {
namespace {

using checkpoint::CheckpointData;
using checkpoint::CheckpointManager;
using testing::read_file;
using testing::run_ranks;
using testing::TempDir;
using testing::thread_cluster;
namespace fs = std::filesystem;
namespace nn = torch::nn;

using testing::entries;

// Small, deterministic data: every rank builds the same from `epoch` without touching the RNG.
CheckpointData sample(std::int64_t epoch) {
  CheckpointData data;
  data.model = {{"0.weight", torch::arange(12, torch::kFloat32).reshape({3, 4}) * epoch},
                {"0.bias", torch::full({3}, 0.5 * epoch)}};
  data.optimizer = {{"state.0.momentum_buffer", torch::ones({3, 4}) * epoch},
                    {"param_groups.0.lr", torch::scalar_tensor(0.1, torch::kFloat64)}};
  data.epoch = epoch;
  data.step = 100 * epoch;
  data.policy = "mixed_bfloat16";
  data.state = {{"loss_scale", 32768.0},
                {"iterator", {{"epoch", epoch}, {"position", 17}}},
                {"rng", "00ff10ab"},
                {"lr_step", 100 * epoch}};
  return data;
}

struct SaveOutcome {
  std::vector<fs::path> paths;     // per rank, when it returned
  std::vector<std::string> errors; // per rank, its CheckpointError
};

// Every rank calls save(); `make` gives each rank its data and number.
SaveOutcome
save_on_ranks(int world, const fs::path& dir, int keep,
              const std::function<std::pair<CheckpointData, std::int64_t>(int rank)>& make) {
  SaveOutcome outcome;
  outcome.paths.resize(world);
  outcome.errors.resize(world);
  run_ranks(world, [&](int rank, collective::Communicator& comm) {
    CheckpointManager manager(dir, keep);
    auto [data, number] = make(rank);
    try {
      outcome.paths[rank] = manager.save(comm, Logger(rank, world), data, number);
    } catch (const CheckpointError& e) {
      outcome.errors[rank] = e.what();
    }
  });
  return outcome;
}

void save_all(int world, const fs::path& dir, int keep, std::int64_t number) {
  const auto outcome =
      save_on_ranks(world, dir, keep, [&](int) { return std::make_pair(sample(number), number); });
  for (const auto& e : outcome.errors) ASSERT_EQ(e, "");
}

nlohmann::json manifest_of(const fs::path& checkpoint_dir) {
  return nlohmann::json::parse(read_file(checkpoint_dir / "manifest.json"));
}

TEST(CheckpointManager, KeepsTheNewestMaxToKeepAndPointsAtTheNewest) {
  TempDir root;
  const fs::path dir = fs::path(root.path()) / "ckpts";
  for (std::int64_t number = 1; number <= 3; ++number) {
    const auto outcome =
        save_on_ranks(2, dir, 2, [&](int) { return std::make_pair(sample(number), number); });
    EXPECT_EQ(outcome.errors, std::vector<std::string>(2));
    // Every worker is told where the chief's checkpoint is.
    EXPECT_EQ(outcome.paths, std::vector<fs::path>(2, dir / ("ckpt-" + std::to_string(number))));
  }
  // No worker directory beside it, no temporary or half-deleted directory inside it.
  EXPECT_EQ(entries(root.path()), std::vector<std::string>{"ckpts"});
  EXPECT_EQ(entries(dir), (std::vector<std::string>{"checkpoint", "ckpt-2", "ckpt-3"}));
  EXPECT_EQ(entries(dir / "ckpt-3"),
            (std::vector<std::string>{"manifest.json", "manifest.sha256", "model.safetensors",
                                      "optimizer.safetensors"}));
  // TensorFlow's CheckpointState text, relative paths, oldest first.
  EXPECT_EQ(read_file(dir / "checkpoint"), "model_checkpoint_path: \"ckpt-3\"\n"
                                           "all_model_checkpoint_paths: \"ckpt-2\"\n"
                                           "all_model_checkpoint_paths: \"ckpt-3\"\n");
  CheckpointManager manager(dir, 2);
  EXPECT_EQ(manager.latest(), dir / "ckpt-3");
  EXPECT_EQ(manager.checkpoints(), (std::vector<fs::path>{dir / "ckpt-2", dir / "ckpt-3"}));

  // A new manager over the same directory (a restarted job) carries on from the pointer file.
  save_all(1, dir, 2, 4);
  EXPECT_EQ(entries(dir), (std::vector<std::string>{"checkpoint", "ckpt-3", "ckpt-4"}));
  EXPECT_EQ(manager.latest(), dir / "ckpt-4");
}

TEST(CheckpointManager, ManifestDescribesTheCheckpointAndItsFiles) {
  TempDir root;
  const fs::path dir = fs::path(root.path()) / "ckpts";
  save_all(2, dir, 3, 7);
  const fs::path ckpt = dir / "ckpt-7";
  const auto manifest = manifest_of(ckpt);
  EXPECT_EQ(manifest["format"], "flotilla-checkpoint");
  EXPECT_EQ(manifest["format_version"], 2);
  // The manifest's own checksum, in the form `sha256sum -c` checks.
  EXPECT_EQ(read_file(ckpt / "manifest.sha256"),
            base::sha256_file(ckpt / "manifest.json") + "  manifest.json\n");
  EXPECT_EQ(manifest["number"], 7);
  EXPECT_EQ(manifest["epoch"], 7);
  EXPECT_EQ(manifest["step"], 700);
  EXPECT_EQ(manifest["policy"], "mixed_bfloat16");
  EXPECT_EQ(manifest["cluster_size"], 2);
  EXPECT_EQ(manifest["flotilla_version"], FLOTILLA_VERSION);
  EXPECT_EQ(manifest["libtorch_version"], TORCH_VERSION);
  EXPECT_TRUE(std::regex_match(manifest["created"].get<std::string>(),
                               std::regex(R"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)")))
      << manifest["created"];
  EXPECT_EQ(manifest["state"], sample(7).state);
  ASSERT_EQ(manifest["files"].size(), 2u);
  for (const char* name : {"model.safetensors", "optimizer.safetensors"}) {
    EXPECT_EQ(manifest["files"][name]["sha256"], base::sha256_file(ckpt / name)) << name;
    EXPECT_EQ(manifest["files"][name]["bytes"], fs::file_size(ckpt / name)) << name;
  }

  const CheckpointData read = checkpoint::read_checkpoint(ckpt);
  EXPECT_EQ(read.epoch, 7);
  EXPECT_EQ(read.step, 700);
  EXPECT_EQ(read.policy, "mixed_bfloat16");
  EXPECT_EQ(read.state, sample(7).state);
  const CheckpointData expected = sample(7);
  ASSERT_EQ(read.model.size(), expected.model.size());
  for (const auto& [name, tensor] : expected.model) {
    const auto it = std::find_if(read.model.begin(), read.model.end(),
                                 [&](const auto& item) { return item.first == name; });
    ASSERT_NE(it, read.model.end()) << name;
    EXPECT_TRUE(torch::equal(it->second, tensor)) << name;
  }
  EXPECT_EQ(read.optimizer.size(), expected.optimizer.size());
}

TEST(CheckpointManager, SavingANumberAgainReplacesIt) {
  TempDir root;
  const fs::path dir = fs::path(root.path()) / "ckpts";
  save_all(2, dir, 3, 1);
  save_all(2, dir, 3, 2);
  const auto outcome =
      save_on_ranks(2, dir, 3, [](int) { return std::make_pair(sample(5), std::int64_t{1}); });
  EXPECT_EQ(outcome.errors, std::vector<std::string>(2));
  EXPECT_EQ(checkpoint::read_checkpoint(dir / "ckpt-1").epoch, 5);
  EXPECT_EQ(entries(dir), (std::vector<std::string>{"checkpoint", "ckpt-1", "ckpt-2"}));
  // The re-saved one is now the newest.
  EXPECT_EQ(read_file(dir / "checkpoint"), "model_checkpoint_path: \"ckpt-1\"\n"
                                           "all_model_checkpoint_paths: \"ckpt-2\"\n"
                                           "all_model_checkpoint_paths: \"ckpt-1\"\n");
}

TEST(CheckpointManager, DebrisOfAnInterruptedSaveGoesWithTheNextSave) {
  TempDir root;
  const fs::path dir = fs::path(root.path()) / "ckpts";
  save_all(2, dir, 3, 1);
  // What a kill between the steps of a save or a deletion leaves: never a checkpoint's name.
  for (const char* debris :
       {".ckpt-2.tmp-1f2e", ".ckpt-1.old-77", "..ckpt-1.old-77.deleting-5", ".ckpt-0.deleting-9"}) {
    fs::create_directories(dir / debris);
    std::ofstream(dir / debris / "model.safetensors") << "partial";
  }
  fs::create_directories(dir / ".mine"); // not ours: left alone
  // A save still being written beside this one (a replaced chief's, in an elastic group) holds
  // its staging directory locked: the sweep passes it over until the lock is gone.
  fs::create_directories(dir / ".ckpt-3.tmp-a1");
  const int writer = ::open((dir / ".ckpt-3.tmp-a1").c_str(), O_RDONLY | O_DIRECTORY);
  ASSERT_GE(writer, 0);
  ASSERT_EQ(::flock(writer, LOCK_EX), 0);
  EXPECT_EQ(checkpoint::restore_latest(dir)->epoch, 1);
  save_all(2, dir, 3, 2);
  EXPECT_EQ(entries(dir), (std::vector<std::string>{".ckpt-3.tmp-a1", ".mine", "checkpoint",
                                                    "ckpt-1", "ckpt-2"}));
  ::close(writer);
  save_all(2, dir, 3, 3);
  EXPECT_EQ(entries(dir),
            (std::vector<std::string>{".mine", "checkpoint", "ckpt-1", "ckpt-2", "ckpt-3"}));
}

// max_to_keep deletes old checkpoints, and the next save sweeps debris: only ever flotilla's
// files. A checkpoint or debris directory holding anything else is left whole, with a warning.
TEST(CheckpointManager, ACheckpointHoldingAFileFlotillaDidNotWriteIsNeverDeleted) {
  TempDir root;
  const fs::path dir = fs::path(root.path()) / "ckpts";
  save_all(1, dir, 2, 1);
  save_all(1, dir, 2, 2);
  std::ofstream(dir / "ckpt-1" / "notes.txt") << "mine";
  fs::create_directories(dir / ".ckpt-5.tmp-1f2e" / "results");
  std::ofstream(dir / ".ckpt-5.tmp-1f2e" / "model.safetensors") << "partial";
  save_all(1, dir, 2, 3); // ckpt-1 is beyond max_to_keep now
  EXPECT_EQ(entries(dir), (std::vector<std::string>{".ckpt-5.tmp-1f2e", "checkpoint", "ckpt-1",
                                                    "ckpt-2", "ckpt-3"}));
  EXPECT_EQ(entries(dir / "ckpt-1"),
            (std::vector<std::string>{"manifest.json", "manifest.sha256", "model.safetensors",
                                      "notes.txt", "optimizer.safetensors"}));
  EXPECT_EQ(entries(dir / ".ckpt-5.tmp-1f2e"),
            (std::vector<std::string>{"model.safetensors", "results"}));
  EXPECT_EQ(CheckpointManager(dir, 2).checkpoints(),
            (std::vector<fs::path>{dir / "ckpt-2", dir / "ckpt-3"}));
}

TEST(CheckpointManager, ReadsAPointerFileTensorFlowWrote) {
  TempDir root;
  const fs::path dir = root.path();
  // As tf.train.CheckpointManager writes it (text_format of CheckpointState).
  std::ofstream(dir / "checkpoint") << "model_checkpoint_path: \"ckpt-7\"\n"
                                       "all_model_checkpoint_paths: \"ckpt-6\"\n"
                                       "all_model_checkpoint_paths: \"ckpt-7\"\n"
                                       "all_model_checkpoint_timestamps: 1700000000.5\n"
                                       "all_model_checkpoint_timestamps: 1700000100.25\n"
                                       "last_preserved_timestamp: 1699999999.0\n";
  CheckpointManager manager(dir);
  EXPECT_EQ(manager.latest(), dir / "ckpt-7");
  EXPECT_EQ(manager.checkpoints(), (std::vector<fs::path>{dir / "ckpt-6", dir / "ckpt-7"}));
  std::ofstream(dir / "checkpoint") << "all_model_checkpoint_paths: \"ckpt-6\n";
  EXPECT_THROW(manager.latest(), CheckpointError);
  fs::remove(dir / "checkpoint");
  EXPECT_EQ(manager.latest(), std::nullopt);
  EXPECT_TRUE(manager.checkpoints().empty());
  EXPECT_THROW(CheckpointManager(dir, 0), ConfigError);
  EXPECT_THROW(CheckpointManager(dir, 2, "../up"), ConfigError);
}

// ---- resuming training exactly ------------------------------------------------------------------

std::mutex seed_mutex; // ranks are threads sharing torch's generator

nn::Sequential make_net(std::uint64_t seed) {
  std::lock_guard<std::mutex> lock(seed_mutex);
  torch::manual_seed(seed);
  nn::Sequential net(nn::Linear(6, 8), nn::BatchNorm1d(8), nn::ReLU(), nn::Linear(8, 3));
  // A frozen parameter never gets a gradient, so an optimizer never holds state for it.
  net[1]->as<nn::BatchNorm1d>()->weight.requires_grad_(false);
  return net;
}

// Two parameter groups (the first layer at its own rate); hyperparameters that use the state.
using OptimizerFactory = std::function<std::unique_ptr<torch::optim::Optimizer>(nn::Sequential&)>;

template <class Optimizer, class Options>
std::unique_ptr<torch::optim::Optimizer> grouped(nn::Sequential& net, const Options& defaults,
                                                 double first_lr) {
  std::vector<torch::Tensor> first = net[0]->parameters(), rest;
  for (std::size_t i = 1; i < net->size(); ++i) {
    for (const auto& p : net[i]->parameters()) rest.push_back(p);
  }
  Options first_options = defaults;
  first_options.lr(first_lr);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(first, std::make_unique<Options>(first_options));
  groups.emplace_back(rest);
  return std::make_unique<Optimizer>(groups, defaults);
}

const std::vector<std::pair<std::string, OptimizerFactory>>& optimizers() {
  static const std::vector<std::pair<std::string, OptimizerFactory>> kOptimizers = {
      {"SGD momentum",
       [](nn::Sequential& net) {
         return grouped<torch::optim::SGD>(
             net, torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true), 0.02);
       }},
      {"Adam",
       [](nn::Sequential& net) {
         return grouped<torch::optim::Adam>(net, torch::optim::AdamOptions(0.01).weight_decay(1e-3),
                                            0.005);
       }},
      {"AdamW amsgrad",
       [](nn::Sequential& net) {
         return grouped<torch::optim::AdamW>(net, torch::optim::AdamWOptions(0.01).amsgrad(true),
                                             0.005);
       }},
      // Kept in LibTorch's archive of them (not SGD, Adam or AdamW).
      {"RMSprop centered momentum",
       [](nn::Sequential& net) {
         return grouped<torch::optim::RMSprop>(
             net, torch::optim::RMSpropOptions(0.01).momentum(0.5).centered(true), 0.005);
       }},
      {"Adagrad",
       [](nn::Sequential& net) {
         return grouped<torch::optim::Adagrad>(net, torch::optim::AdagradOptions(0.05), 0.02);
       }},
  };
  return kOptimizers;
}

struct Batches {
  std::vector<torch::Tensor> x, y;
  Batches() {
    std::lock_guard<std::mutex> lock(seed_mutex);
    torch::manual_seed(3);
    for (int i = 0; i < 6; ++i) {
      x.push_back(torch::randn({10, 6}));
      y.push_back(torch::randint(0, 3, {10}));
    }
  }
};

void train(nn::Sequential& net, torch::optim::Optimizer& optimizer, const Batches& data, int from,
           int to) {
  net->train();
  for (int i = from; i < to; ++i) {
    optimizer.zero_grad();
    torch::nn::functional::cross_entropy(net->forward(data.x[i]), data.y[i]).backward();
    optimizer.step();
  }
}

bool same_weights(const nn::Module& a, const nn::Module& b) {
  const auto sa = checkpoint::model_state(a), sb = checkpoint::model_state(b);
  if (sa.size() != sb.size()) return false;
  for (std::size_t i = 0; i < sa.size(); ++i) {
    if (sa[i].first != sb[i].first || !torch::equal(sa[i].second, sb[i].second)) return false;
  }
  return true;
}

fs::path save_one(const fs::path& dir, const CheckpointData& data, std::int64_t number) {
  fs::path saved;
  run_ranks(1, [&](int rank, collective::Communicator& comm) {
    saved = CheckpointManager(dir).save(comm, Logger(rank, 1), data, number);
  });
  return saved;
}

TEST(CheckpointManager, ResumedTrainingMatchesUninterruptedTrainingBitForBit) {
  const Batches data;
  for (const auto& [name, make_optimizer] : optimizers()) {
    SCOPED_TRACE(name);
    TempDir root;
    const fs::path dir = fs::path(root.path()) / "ckpts";
    // Uninterrupted: 6 steps, with the first group's rate changed (as a schedule would) after 3.
    auto net = make_net(1);
    auto optimizer = make_optimizer(net);
    train(net, *optimizer, data, 0, 3);
    optimizer->param_groups()[0].options().set_lr(0.03);
    CheckpointData saved;
    saved.model = checkpoint::model_state(*net);
    saved.optimizer = checkpoint::optimizer_state(*optimizer);
    saved.epoch = 1;
    saved.step = 3;
    const fs::path path = save_one(dir, saved, 3);
    train(net, *optimizer, data, 3, 6);

    // Resumed: a differently initialised model and a fresh optimizer, restored from disk.
    std::vector<std::string> skipped;
    fs::path from;
    const auto restored = checkpoint::restore_latest(dir, &skipped, &from);
    ASSERT_TRUE(restored.has_value());
    EXPECT_TRUE(skipped.empty());
    EXPECT_EQ(from, path);
    EXPECT_EQ(restored->step, 3);
    auto resumed = make_net(2);
    auto resumed_optimizer = make_optimizer(resumed);
    checkpoint::load_model_state(*resumed, restored->model);
    checkpoint::load_optimizer_state(*resumed_optimizer, restored->optimizer);
    EXPECT_EQ(resumed_optimizer->param_groups()[0].options().get_lr(), 0.03);
    // The frozen BatchNorm weight (parameter 2) never had state and still has none.
    const auto state = checkpoint::optimizer_state(*resumed_optimizer);
    for (const auto& item : state) EXPECT_NE(item.first.rfind("state.2.", 0), 0u) << item.first;
    train(resumed, *resumed_optimizer, data, 3, 6);
    EXPECT_TRUE(same_weights(*resumed, *net));
    const auto a = checkpoint::optimizer_state(*resumed_optimizer);
    const auto b = checkpoint::optimizer_state(*optimizer);
    ASSERT_EQ(a.size(), b.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i].first, b[i].first);
      // An archive names each state by its parameter's address: the bytes differ.
      if (a[i].first == "torch_archive") continue;
      EXPECT_TRUE(torch::equal(a[i].second, b[i].second)) << a[i].first;
    }

    // The comparison can tell: the weights alone, with the optimizer's state lost, diverge.
    auto weights_only = make_net(2);
    auto fresh_optimizer = make_optimizer(weights_only);
    checkpoint::load_model_state(*weights_only, restored->model);
    fresh_optimizer->param_groups()[0].options().set_lr(0.03);
    train(weights_only, *fresh_optimizer, data, 3, 6);
    EXPECT_FALSE(same_weights(*weights_only, *net));
  }
}

std::string load_optimizer_error(torch::optim::Optimizer& optimizer,
                                 const checkpoint::NamedTensors& state) {
  try {
    checkpoint::load_optimizer_state(optimizer, state);
  } catch (const CheckpointError& e) {
    return e.what();
  }
  return "no error";
}

TEST(CheckpointManager, OptimizerStateThatDoesNotFitIsNamed) {
  const Batches data;
  auto net = make_net(1);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  train(net, sgd, data, 0, 1);
  const auto sgd_state = checkpoint::optimizer_state(sgd);
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(0.1));
  EXPECT_EQ(load_optimizer_error(adam, sgd_state),
            "optimizer state: unexpected tensor \"state.0.momentum_buffer\": this Adam optimizer "
            "has no state \"momentum_buffer\"; it was saved from a different optimizer or model");
  EXPECT_TRUE(adam.state().empty()); // nothing was changed

  // Another model: parameter 0 has another shape.
  nn::Sequential other(nn::Linear(5, 8), nn::BatchNorm1d(8), nn::ReLU(), nn::Linear(8, 3));
  torch::optim::SGD other_sgd(other->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  EXPECT_EQ(load_optimizer_error(other_sgd, sgd_state),
            "optimizer state: tensor \"state.0.momentum_buffer\" has shape [8, 6], parameter 0 "
            "has shape [8, 5]; it was saved from a different model");

  torch::optim::Adam amsgrad(net->parameters(), torch::optim::AdamOptions(0.1).amsgrad(true));
  train(net, amsgrad, data, 0, 1);
  torch::optim::Adam plain(net->parameters(), torch::optim::AdamOptions(0.1));
  EXPECT_EQ(load_optimizer_error(plain, checkpoint::optimizer_state(amsgrad)),
            "optimizer state: unexpected tensor \"state.0.max_exp_avg_sq\": this Adam optimizer "
            "has no state \"max_exp_avg_sq\" (amsgrad is off); it was saved from a different "
            "optimizer or model");
  EXPECT_EQ(load_optimizer_error(amsgrad, {}),
            "optimizer state: has no \"param_groups.0.lr\"; it was saved from a different "
            "optimizer");
  auto partial = checkpoint::optimizer_state(amsgrad);
  partial.erase(std::remove_if(partial.begin(), partial.end(),
                               [](const auto& item) { return item.first == "state.0.exp_avg"; }),
                partial.end());
  const std::string missing = load_optimizer_error(amsgrad, partial);
  EXPECT_EQ(missing.rfind("optimizer state: parameter 0 has state but no \"state.0.exp_avg\"", 0),
            0u)
      << missing;

  auto small = make_net(1);
  checkpoint::NamedTensors model = checkpoint::model_state(*net);
  model.erase(model.begin()); // "0.weight"
  const auto before = small[0]->as<nn::Linear>()->bias.clone();
  try {
    checkpoint::load_model_state(*small, model);
    ADD_FAILURE() << "no error";
  } catch (const CheckpointError& e) {
    EXPECT_STREQ(e.what(), "checkpoint: has no tensor \"0.weight\"; it was saved from a "
                           "different model");
  }
  EXPECT_TRUE(torch::equal(small[0]->as<nn::Linear>()->bias, before)); // checked before copying
}

// An optimizer of your own that saves nothing: torch::optim::Optimizer's own save().
class PlainSgd : public torch::optim::Optimizer {
 public:
  explicit PlainSgd(std::vector<torch::Tensor> params)
      : Optimizer({torch::optim::OptimizerParamGroup(std::move(params))},
                  std::make_unique<torch::optim::SGDOptions>(0.1)) {}
  torch::Tensor step(LossClosure) override {
    torch::NoGradGuard no_grad;
    for (auto& p : param_groups()[0].params()) {
      if (p.grad().defined()) p.sub_(p.grad() * param_groups()[0].options().get_lr());
    }
    return {};
  }
};

// RMSprop's square_avg for parameter `index`, cloned.
torch::Tensor square_avg(torch::optim::RMSprop& optimizer, std::size_t index) {
  const auto& param = optimizer.param_groups()[0].params().at(index);
  return static_cast<torch::optim::RMSpropParamState&>(
             *optimizer.state().at(param.unsafeGetTensorImpl()))
      .square_avg()
      .clone();
}

TEST(CheckpointManager, ArchivedOptimizerStateThatDoesNotFitIsNamedAndNothingChanges) {
  const Batches data;
  auto net = make_net(1);
  torch::optim::RMSprop rmsprop(net->parameters(), torch::optim::RMSpropOptions(0.01));
  train(net, rmsprop, data, 0, 1);
  const auto archived = checkpoint::optimizer_state(rmsprop);
  ASSERT_EQ(archived.size(), 1u);
  EXPECT_EQ(archived[0].first, "torch_archive");
  EXPECT_EQ(archived[0].second.scalar_type(), torch::kUInt8);

  // Another model of as many parameters: checked after LibTorch's load, and put back.
  nn::Sequential other(nn::Linear(5, 8), nn::BatchNorm1d(8), nn::ReLU(), nn::Linear(8, 3));
  torch::optim::RMSprop other_rmsprop(other->parameters(), torch::optim::RMSpropOptions(0.02));
  other_rmsprop.zero_grad();
  for (auto& p : other->parameters()) p.mutable_grad() = torch::ones_like(p);
  other_rmsprop.step();
  const torch::Tensor before = square_avg(other_rmsprop, 0);
  EXPECT_EQ(load_optimizer_error(other_rmsprop, archived),
            "optimizer state: could not load it into this torch::optim::RMSprop (optimizer "
            "state: parameter 0's \"square_avg\" has shape [8, 6], the parameter has shape "
            "[8, 5]; it was saved from a different model); it was saved from a different "
            "optimizer or model");
  EXPECT_TRUE(torch::equal(square_avg(other_rmsprop, 0), before));
  EXPECT_EQ(other_rmsprop.param_groups()[0].options().get_lr(), 0.02);

  torch::optim::Adagrad adagrad(net->parameters(), torch::optim::AdagradOptions(0.1));
  train(net, adagrad, data, 0, 1);
  const std::string wrong_type =
      load_optimizer_error(rmsprop, checkpoint::optimizer_state(adagrad));
  EXPECT_EQ(
      wrong_type.rfind("optimizer state: could not load it into this torch::optim::RMSprop (", 0),
      0u)
      << wrong_type;

  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  train(net, sgd, data, 0, 1);
  EXPECT_EQ(load_optimizer_error(rmsprop, checkpoint::optimizer_state(sgd)),
            "optimizer state: this torch::optim::RMSprop keeps its state in LibTorch's archive "
            "(\"torch_archive\"); saw \"state.0.momentum_buffer\": it was saved from another "
            "optimizer");
  EXPECT_EQ(load_optimizer_error(sgd, archived),
            "optimizer state: unexpected tensor \"torch_archive\": that is LibTorch's archive of "
            "an optimizer other than SGD, Adam and AdamW; it was saved from a different "
            "optimizer or model");

  PlainSgd plain(net->parameters());
  try {
    checkpoint::optimizer_state(plain);
    ADD_FAILURE() << "no error";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("does not save its state (its save() writes nothing)"),
              std::string::npos)
        << e.what();
  }
}

// ---- readers outside flotilla -------------------------------------------------------------------

TEST(CheckpointManager, PythonSafetensorsAndPyTorchReadTheCheckpoint) {
  const std::string python = testing::test_python();
  ASSERT_EQ(testing::run_process({python, "-c", "import safetensors, torch"}).exit_code, 0)
      << "the test venv lacks safetensors or torch (" << python << "); run scripts/bootstrap";
  const Batches data;
  auto net = make_net(1);
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(0.01));
  train(net, adam, data, 0, 2);
  CheckpointData saved;
  saved.model = checkpoint::model_state(*net);
  saved.optimizer = checkpoint::optimizer_state(adam);
  TempDir root;
  const fs::path ckpt = save_one(fs::path(root.path()) / "ckpts", saved, 2);
  // The same architecture in PyTorch loads the weights strictly (every name, no extra), the
  // manifest's hashes are hashlib's, and the optimizer file opens too.
  const std::string script = R"(
import hashlib, json, os, sys, torch
from safetensors import safe_open
from safetensors.torch import load_file
ckpt = sys.argv[1]
net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                          torch.nn.Linear(8, 3))
net.load_state_dict(load_file(os.path.join(ckpt, "model.safetensors")), strict=True)
manifest = json.load(open(os.path.join(ckpt, "manifest.json")))
for name, entry in manifest["files"].items():
    data = open(os.path.join(ckpt, name), "rb").read()
    assert hashlib.sha256(data).hexdigest() == entry["sha256"], name
    assert len(data) == entry["bytes"], name
with safe_open(os.path.join(ckpt, "optimizer.safetensors"), framework="pt") as f:
    keys = sorted(f.keys())
    lr = f.get_tensor("param_groups.0.lr").item()
print(json.dumps({"w0": net[0].weight.double().sum().item(),
                  "tracked": net[1].num_batches_tracked.item(), "keys": keys, "lr": lr}))
)";
  const auto result = testing::run_process({python, "-c", script, ckpt.string()});
  ASSERT_EQ(result.exit_code, 0) << result.err;
  const auto json = nlohmann::json::parse(result.out.substr(result.out.find('{')));
  EXPECT_NEAR(json["w0"].get<double>(),
              net[0]->as<nn::Linear>()->weight.to(torch::kFloat64).sum().item<double>(), 1e-12);
  EXPECT_EQ(json["tracked"], 2);
  EXPECT_EQ(json["lr"], 0.01);
  std::vector<std::string> expected_keys;
  for (const auto& item : saved.optimizer) expected_keys.push_back(item.first);
  std::sort(expected_keys.begin(), expected_keys.end());
  EXPECT_EQ(json["keys"].get<std::vector<std::string>>(), expected_keys);
}

// ---- damaged checkpoints ------------------------------------------------------------------------

std::string read_error(const fs::path& checkpoint_dir) {
  try {
    checkpoint::read_checkpoint(checkpoint_dir);
  } catch (const CheckpointError& e) {
    return e.what();
  }
  return "no error";
}

TEST(CheckpointManager, AChangedByteIsCaughtAndRestoreFallsBackToTheCheckpointBefore) {
  TempDir root;
  const fs::path dir = fs::path(root.path()) / "ckpts";
  save_all(2, dir, 3, 1);
  save_all(2, dir, 3, 2);
  const fs::path damaged = dir / "ckpt-2" / "model.safetensors";
  const std::string expected = base::sha256_file(damaged);
  {
    // One bit of the last tensor's data: the file still parses, only the hash can tell.
    std::fstream file(damaged, std::ios::in | std::ios::out | std::ios::binary);
    file.seekg(-1, std::ios::end);
    const char byte = static_cast<char>(file.get());
    file.seekp(-1, std::ios::end);
    file.put(static_cast<char>(byte ^ 0x01));
  }
  const std::string actual = base::sha256_file(damaged);
  ASSERT_NE(actual, expected);
  EXPECT_EQ(read_error(dir / "ckpt-2"),
            damaged.string() + ": SHA-256 is " + actual + ", the manifest says " + expected +
                "; the file changed after it was written (damaged). Restore from an older "
                "checkpoint (restore_latest falls back to one) or delete " +
                (dir / "ckpt-2").string());

  std::vector<std::string> skipped;
  fs::path from;
  const auto restored = checkpoint::restore_latest(dir, &skipped, &from);
  ASSERT_TRUE(restored.has_value());
  EXPECT_EQ(from, dir / "ckpt-1");
  EXPECT_EQ(restored->epoch, 1);
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_EQ(skipped[0].rfind((dir / "ckpt-2").string() + ": ", 0), 0u) << skipped[0];
  EXPECT_NE(skipped[0].find("model.safetensors: SHA-256 is"), std::string::npos) << skipped[0];

  // Nothing verifies: nullopt, each one reported.
  fs::resize_file(dir / "ckpt-1" / "optimizer.safetensors", 10);
  skipped.clear();
  EXPECT_FALSE(checkpoint::restore_latest(dir, &skipped).has_value());
  ASSERT_EQ(skipped.size(), 2u);
  EXPECT_NE(skipped[1].find("optimizer.safetensors: 10 bytes, the manifest says"),
            std::string::npos)
      << skipped[1];
  EXPECT_FALSE(checkpoint::restore_latest(fs::path(root.path()) / "none").has_value());
}

TEST(CheckpointManager, ATruncatedOrMissingManifestIsAClearError) {
  TempDir root;
  const fs::path dir = fs::path(root.path()) / "ckpts";
  save_all(1, dir, 3, 1);
  save_all(1, dir, 3, 2);
  const fs::path manifest = dir / "ckpt-2" / "manifest.json";
  const std::string whole = read_file(manifest);
  fs::resize_file(manifest, fs::file_size(manifest) / 2);
  // The manifest's checksum catches it first.
  const std::string checksum_error = read_error(dir / "ckpt-2");
  EXPECT_EQ(checksum_error.rfind(manifest.string() + ": SHA-256 is ", 0), 0u) << checksum_error;
  EXPECT_NE(checksum_error.find(", manifest.sha256 says " +
                                base::sha256_hex(whole.data(), whole.size()) +
                                "; the manifest (the training state: epoch, step, position) "
                                "changed after it was written. Restore from an older checkpoint"),
            std::string::npos)
      << checksum_error;
  // Without the checksum file (a version 1 checkpoint had none), parsing still catches it.
  fs::remove(dir / "ckpt-2" / "manifest.sha256");
  const std::string error = read_error(dir / "ckpt-2");
  EXPECT_EQ(error.rfind(manifest.string() + ": not valid JSON (", 0), 0u) << error;
  EXPECT_NE(error.find("); the file is truncated or damaged. Restore from an older checkpoint"),
            std::string::npos)
      << error;
  std::vector<std::string> skipped;
  fs::path from;
  ASSERT_TRUE(checkpoint::restore_latest(dir, &skipped, &from).has_value());
  EXPECT_EQ(from, dir / "ckpt-1");
  EXPECT_EQ(skipped.size(), 1u);

  // A whole version 2 manifest whose checksum file is missing: incomplete.
  std::ofstream(manifest) << whole;
  EXPECT_EQ(read_error(dir / "ckpt-2")
                .rfind((dir / "ckpt-2" / "manifest.sha256").string() +
                           ": missing, though the manifest is of format version 2",
                       0),
            0u)
      << read_error(dir / "ckpt-2");
  std::ofstream(manifest) << R"({"format": "something-else"})";
  EXPECT_EQ(read_error(dir / "ckpt-2"),
            manifest.string() + ": format is \"something-else\", expected "
                                "\"flotilla-checkpoint\"; this is not a flotilla checkpoint");
  fs::remove(manifest);
  EXPECT_EQ(read_error(dir / "ckpt-2")
                .rfind(manifest.string() + ": missing, so this is not a "
                                           "complete flotilla checkpoint",
                       0),
            0u);
}

// The probe's case: manifest.sha256 is a checksum anyone can recompute, so an edited training
// state passed as intact. With a cluster token the manifest also carries its HMAC under the
// token, and a reader with the token refuses one edited, one saved without it or under another.
TEST(CheckpointManager, WithAClusterTokenTheManifestIsKeyedAndAnEditRecomputedIsRefused) {
  TempDir root;
  const fs::path dir = fs::path(root.path()) / "ckpts";
  collective::CommunicationOptions options;
  options.cluster_token = "the job's secret";
  options.checkpoint_key = options.cluster_token;
  auto group = collective::Communicator::local_group(1, options);
  CheckpointManager manager(dir, 3);
  manager.save(group.front(), Logger(0, 1), sample(1), 1);
  const fs::path saved = manager.save(group.front(), Logger(0, 1), sample(2), 2);
  EXPECT_EQ(checkpoint::read_checkpoint(saved, options.checkpoint_key).epoch, 2);
  EXPECT_EQ(read_file(saved / "manifest.hmac").size(), 65u); // 64 hex digits and a newline

  // Someone without the token makes epoch 2 look like epoch 7 and recomputes the checksum.
  const fs::path manifest = saved / "manifest.json";
  std::string text = read_file(manifest);
  const auto at = text.find("\"epoch\": 2");
  ASSERT_NE(at, std::string::npos) << text;
  text.replace(at, std::string("\"epoch\": 2").size(), "\"epoch\": 7");
  std::ofstream(manifest, std::ios::trunc) << text;
  std::ofstream(saved / "manifest.sha256", std::ios::trunc)
      << base::sha256_hex(text.data(), text.size()) << "  manifest.json\n";
  EXPECT_EQ(checkpoint::read_checkpoint(saved).epoch, 7); // without the key, nothing can tell
  const auto refusal = [&](const std::optional<std::string>& key) {
    try {
      checkpoint::read_checkpoint(saved, key);
    } catch (const CheckpointError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(refusal(options.checkpoint_key)
                .rfind(manifest.string() + ": its HMAC under this job's "
                                           "cluster token is not the one manifest.hmac holds",
                       0),
            0u)
      << refusal(options.checkpoint_key);
  std::vector<std::string> skipped;
  fs::path from;
  const auto restored =
      checkpoint::restore_latest(dir, &skipped, &from, {}, options.checkpoint_key);
  ASSERT_TRUE(restored.has_value());
  EXPECT_EQ(from, dir / "ckpt-1"); // the edited one passed over
  EXPECT_EQ(restored->epoch, 1);
  ASSERT_EQ(skipped.size(), 1u);

  fs::remove(saved / "manifest.hmac");
  EXPECT_EQ(refusal(options.checkpoint_key)
                .rfind((saved / "manifest.hmac").string() + ": missing, and this job has a "
                                                            "cluster token",
                       0),
            0u)
      << refusal(options.checkpoint_key);
  // ckpt-1, intact, read under another token.
  try {
    checkpoint::read_checkpoint(dir / "ckpt-1", std::string("another token"));
    ADD_FAILURE() << "ckpt-1 read under another token";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("its HMAC under this job's cluster token is not the one"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(checkpoint::read_checkpoint(dir / "ckpt-1", options.checkpoint_key).epoch, 1);
}

TEST(CheckpointManager, WithoutAPointerFileRestoreStillFindsTheCheckpointDirectories) {
  TempDir root;
  const fs::path dir = fs::path(root.path()) / "ckpts";
  save_all(1, dir, 5, 9);
  save_all(1, dir, 5, 10);
  fs::remove(dir / "checkpoint");
  fs::path from;
  const auto restored = checkpoint::restore_latest(dir, nullptr, &from);
  ASSERT_TRUE(restored.has_value());
  EXPECT_EQ(from, dir / "ckpt-10"); // by number, not by name
}

// ---- a failure on one worker --------------------------------------------------------------------

struct Snapshot {
  std::vector<std::string> root, dir;
  std::string pointer, model_hash;
};

Snapshot snapshot(const fs::path& root, const fs::path& dir) {
  return {entries(root), entries(dir), read_file(dir / "checkpoint"),
          base::sha256_file(dir / "ckpt-1" / "model.safetensors")};
}

// save_one's CheckpointError message; "" when the save went through.
std::string save_refusal(const fs::path& dir, const CheckpointData& data, std::int64_t number) {
  try {
    save_one(dir, data, number);
  } catch (const CheckpointError& e) {
    return e.what();
  }
  return "";
}

void expect_unchanged(const Snapshot& before, const fs::path& root, const fs::path& dir) {
  const Snapshot after = snapshot(root, dir);
  EXPECT_EQ(after.root, before.root); // no worker directory left beside it
  EXPECT_EQ(after.dir, before.dir);   // no new or temporary checkpoint directory
  EXPECT_EQ(after.pointer, before.pointer);
  EXPECT_EQ(after.model_hash, before.model_hash);
  EXPECT_EQ(checkpoint::read_checkpoint(dir / "ckpt-1").epoch, 1);
}

// Fencing (CheckpointData::generation): a writer of an older generation, or of fewer updates,
// than the newest checkpoint on disk is refused and changes nothing; the same or newer goes
// through; an unfenced save (generation -1) is never refused. Before fencing, each of the
// refused saves below moved the pointer to an older state.
TEST(CheckpointManager, AFencedSaveOfAnOlderGenerationOrUpdateIsRefusedAndChangesNothing) {
  TempDir root;
  const fs::path dir = fs::path(root.path()) / "backups";
  const auto fenced = [](std::int64_t epoch, std::int64_t generation) {
    CheckpointData data = sample(epoch);
    data.generation = generation;
    return data;
  };
  const auto refusal = [&](const CheckpointData& data, std::int64_t number) {
    return save_refusal(dir, data, number);
  };
  save_one(dir, fenced(1, 0), 1); // generation 0, update 100
  save_one(dir, fenced(2, 1), 2); // generation 1, update 200: the group moved on
  EXPECT_EQ(manifest_of(dir / "ckpt-2")["generation"], 1);
  const Snapshot before = snapshot(root.path(), dir);
  // The replaced chief, woken: generation 0 (even with more updates).
  const std::string stale = refusal(fenced(3, 0), 3);
  EXPECT_NE(stale.find("refused (fencing): this writer's state is of generation 0, update 300, "
                       "and the newest checkpoint there, " +
                       (dir / "ckpt-2").string() +
                       " (generation 1, update 200), was decided by "
                       "a newer generation"),
            std::string::npos)
      << stale;
  EXPECT_NE(stale.find("The previous checkpoints in " + dir.string()), std::string::npos) << stale;
  // The same generation with fewer updates.
  const std::string older = refusal(fenced(1, 1), 3);
  EXPECT_NE(older.find("update 100, older than the newest checkpoint there"), std::string::npos)
      << older;
  expect_unchanged(before, root.path(), dir);
  EXPECT_EQ(checkpoint::read_checkpoint(dir / "ckpt-2").generation, 1);
  // The same state again, a newer generation, and an unfenced save all go through.
  EXPECT_EQ(refusal(fenced(2, 1), 3), "");
  EXPECT_EQ(refusal(fenced(2, 4), 4), "");
  EXPECT_EQ(refusal(sample(1), 5), "");
  EXPECT_FALSE(manifest_of(dir / "ckpt-5").contains("generation"));
}

// Fencing by training (the state's "training", ModelCheckpoint in an elastic fit): the newest
// checkpoint fences writers of its own training only. A job started afresh in the same
// directory, with a new id and its rendezvous counting generations from 0, replaces the earlier
// job's checkpoints as Keras's callbacks do; a stale writer of the same training is refused.
// Without the id, the fresh job's first save was refused (generation 0 against 3).
TEST(CheckpointManager, AFencedSaveIsRefusedOnlyByACheckpointOfItsOwnTraining) {
  TempDir root;
  const fs::path dir = fs::path(root.path()) / "ckpts";
  const auto of = [](const std::string& training, std::int64_t epoch, std::int64_t generation) {
    CheckpointData data = sample(epoch);
    data.state["training"] = training;
    data.generation = generation;
    return data;
  };
  const auto refusal = [&](const CheckpointData& data, std::int64_t number) {
    return save_refusal(dir, data, number);
  };
  save_one(dir, of("a", 3, 3), 3); // generation 3, update 300
  EXPECT_NE(refusal(of("a", 2, 2), 2).find("refused (fencing)"), std::string::npos);
  EXPECT_EQ(refusal(of("b", 1, 0), 1), ""); // a fresh training: replaces
  EXPECT_EQ(checkpoint::CheckpointManager(dir).latest(), dir / "ckpt-1");
  // Now b's checkpoint fences b's writers: fewer updates than its 100.
  EXPECT_NE(refusal(of("b", 0, 0), 4).find("update 0, older than the newest checkpoint there"),
            std::string::npos);
}

TEST(CheckpointManager, AFailureOnOneWorkerFailsTheSaveEverywhereAndKeepsThePrevious) {
  for (int failing : {1, 0}) {
    SCOPED_TRACE("failing rank " + std::to_string(failing));
    TempDir root;
    const fs::path dir = fs::path(root.path()) / "ckpts";
    save_all(2, dir, 2, 1);
    const Snapshot before = snapshot(root.path(), dir);
    // That worker's model holds a tensor safetensors cannot store: its write fails midway.
    const auto outcome = save_on_ranks(2, dir, 2, [&](int rank) {
      CheckpointData data = sample(2);
      if (rank == failing) data.model.emplace_back("bad", torch::zeros({2}, torch::kComplexFloat));
      return std::make_pair(data, std::int64_t{2});
    });
    const std::string intact =
        "The previous checkpoints in " + dir.string() + " and its pointer file are intact";
    EXPECT_NE(outcome.errors[failing].find("tensor \"bad\" has dtype ComplexFloat"),
              std::string::npos)
        << outcome.errors[failing];
    EXPECT_NE(outcome.errors[failing].find(intact), std::string::npos);
    EXPECT_EQ(outcome.errors[1 - failing],
              "saving checkpoint ckpt-2 failed on another worker; see its output. " + intact);
    expect_unchanged(before, root.path(), dir);
  }
}

TEST(CheckpointManager, AFileInTheChiefsWayFailsTheSaveEverywhere) {
  TempDir root;
  const fs::path dir = fs::path(root.path()) / "ckpts";
  save_all(2, dir, 2, 1);
  std::ofstream(dir / "ckpt-2") << "not a checkpoint";
  const Snapshot before = snapshot(root.path(), dir);
  const auto outcome =
      save_on_ranks(2, dir, 2, [](int) { return std::make_pair(sample(2), std::int64_t{2}); });
  EXPECT_EQ(outcome.errors[0].rfind("cannot save checkpoint ckpt-2 in " + dir.string() + ": " +
                                        (dir / "ckpt-2").string() +
                                        " exists and is not a checkpoint directory",
                                    0),
            0u)
      << outcome.errors[0];
  EXPECT_EQ(outcome.errors[1].rfind("saving checkpoint ckpt-2 failed on another worker", 0), 0u);
  expect_unchanged(before, root.path(), dir);
  EXPECT_EQ(read_file(dir / "ckpt-2"), "not a checkpoint");
}

TEST(CheckpointManager, WorkersThatSaveDifferentNumbersAllFail) {
  TempDir root;
  const fs::path dir = fs::path(root.path()) / "ckpts";
  save_all(2, dir, 2, 1);
  const Snapshot before = snapshot(root.path(), dir);
  const auto outcome = save_on_ranks(
      2, dir, 2, [](int rank) { return std::make_pair(sample(2), std::int64_t{2} + rank); });
  for (const auto& error : outcome.errors) {
    EXPECT_EQ(error.rfind("workers saved different checkpoint numbers (2 to 3)", 0), 0u) << error;
  }
  expect_unchanged(before, root.path(), dir);
}

} // namespace
} // namespace flotilla
