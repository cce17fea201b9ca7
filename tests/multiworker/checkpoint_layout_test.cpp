// The seeds' saving rule: every worker saves; only the chief's copy, in model_dir, remains.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "flotilla/checkpoint/model_checkpoint.h"
#include "flotilla/error.h"
#include "flotilla/train/callbacks.h"
#include "flotilla/train/model.h"
#include "support/ranks.h"
#include "support/subprocess.h"

namespace flotilla {
namespace {

using testing::run_ranks;
using testing::thread_cluster;
namespace fs = std::filesystem;
namespace nn = torch::nn;

using testing::entries;

TEST(CheckpointLayout, OnlyTheChiefsCheckpointRemainsAfterFit) {
  testing::TempDir root;
  const fs::path model_dir = fs::path(root.path()) / "model";
  std::vector<torch::Tensor> trained(2);
  const auto x = torch::randn({40, 16});
  const auto y = torch::randint(0, 3, {40});
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    // Each worker builds its own pipeline, as each process would.
    const auto ds = data::Dataset::from_tensor_slices({x, y}).shuffle(40, 0).batch(8, true);
    strategy::Strategy s(thread_cluster(rank, 2), comm);
    auto net = s.scope([] { return nn::Sequential(nn::Flatten(), nn::Linear(16, 3)); });
    train::Model model(s, net);
    model.compile({});
    train::FitOptions fit;
    fit.epochs = 2;
    fit.verbose = train::Verbosity::kSilent;
    train::ModelCheckpointOptions checkpoints;
    checkpoints.filepath = (model_dir / "ckpt-{epoch}.safetensors").string();
    checkpoints.save_weights_only = true;
    fit.callbacks.push_back(std::make_shared<train::ModelCheckpoint>(checkpoints));
    model.fit(ds, fit);
    trained[rank] = net[1]->as<nn::Linear>()->weight.detach().clone();
  });
  EXPECT_EQ(entries(root.path()), std::vector<std::string>{"model"}); // no worker dir beside it
  EXPECT_EQ(entries(model_dir),
            (std::vector<std::string>{"ckpt-1.safetensors", "ckpt-2.safetensors"}));
  auto fresh = nn::Sequential(nn::Flatten(), nn::Linear(16, 3));
  const auto metadata = checkpoint::load_model(*fresh, model_dir / "ckpt-2.safetensors");
  EXPECT_EQ(metadata.at("epoch"), "2");
  EXPECT_TRUE(torch::equal(fresh[1]->as<nn::Linear>()->weight, trained[0]));
}

TEST(CheckpointLayout, NonChiefWritesIntoAUniqueTemporaryDirectoryThatGoesAway) {
  testing::TempDir root;
  const fs::path model_dir = fs::path(root.path()) / "model";
  fs::path seen;
  {
    checkpoint::WriteLocation a(model_dir, /*is_chief=*/false, 1);
    checkpoint::WriteLocation b(model_dir, /*is_chief=*/false, 1);
    EXPECT_TRUE(a.is_temporary());
    EXPECT_NE(a.dir(), b.dir()); // unique even for the same rank
    EXPECT_EQ(a.dir().parent_path(), model_dir.parent_path());
    EXPECT_EQ(a.dir().filename().string().rfind("model.worker1-", 0), 0u);
    std::ofstream(a.dir() / "f") << "x";
    seen = a.dir();
  }
  EXPECT_FALSE(fs::exists(seen));
  checkpoint::WriteLocation chief(model_dir, /*is_chief=*/true, 0);
  EXPECT_EQ(chief.dir(), model_dir);
  EXPECT_FALSE(chief.is_temporary());
}

TEST(CheckpointLayout, AFailureOnTheChiefIsReportedOnEveryWorkerWithoutAHang) {
  testing::TempDir root;
  // model_dir is a file: the chief cannot create it, the worker's own directory beside it is fine.
  const fs::path model_dir = fs::path(root.path()) / "model";
  std::ofstream(model_dir) << "not a directory";
  std::vector<std::string> errors(2);
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 2), comm);
    auto net = s.scope([] { return nn::Linear(2, 2); });
    try {
      checkpoint::save_model(s.communicator(), *net, model_dir, "ckpt-1.safetensors");
    } catch (const CheckpointError& e) {
      errors[rank] = e.what();
    }
  });
  EXPECT_EQ(errors[0].rfind("cannot create " + model_dir.string() + " (", 0), 0u) << errors[0];
  EXPECT_EQ(errors[1], "saving ckpt-1.safetensors failed on another worker; see its output. The "
                       "previous checkpoint in " +
                           model_dir.string() + " is intact");
  EXPECT_EQ(entries(root.path()), std::vector<std::string>{"model"}); // worker cleaned up
}

// Fencing a weights file (ModelCheckpoint with save_weights_only in an elastic fit): the stale
// chief's save over weights of its own training that a newer generation decided, or that have
// more updates, is refused and leaves the file as it was; a save of another training, or an
// unfenced one, replaces it. Before the fence the stale save replaced its successor's weights.
TEST(CheckpointLayout, AFencedWeightsFileRefusesAnOlderWriterOfItsTraining) {
  testing::TempDir root;
  const fs::path model_dir = fs::path(root.path()) / "model";
  const fs::path file = model_dir / "weights.safetensors";
  std::string refusal;
  run_ranks(1, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 1), comm);
    auto net = s.scope([] { return nn::Linear(2, 2); });
    const auto save = [&](const std::string& training, std::int64_t generation,
                          std::int64_t update) {
      checkpoint::save_model(s.communicator(), *net, model_dir, "weights.safetensors",
                             {{"format", "flotilla"}},
                             checkpoint::WeightsFence{training, generation, update});
    };
    const auto refused = [&](const std::string& training, std::int64_t generation,
                             std::int64_t update) {
      try {
        save(training, generation, update);
      } catch (const CheckpointError& e) {
        return std::string(e.what());
      }
      return std::string();
    };
    save("a", 1, 20); // the successor's
    const std::string before = testing::read_file(file);
    torch::NoGradGuard no_grad;
    net->weight.add_(1); // the stale chief's weights differ
    refusal = refused("a", 0, 30);
    EXPECT_EQ(refused("a", 1, 10), "refused (fencing): these weights are of generation 1, update "
                                   "10, older than the file there, " +
                                       file.string() + " (generation 1, update 20)");
    EXPECT_EQ(testing::read_file(file), before);
    EXPECT_EQ(refused("a", 2, 20), ""); // a newer generation
    EXPECT_EQ(refused("b", 0, 1), "");  // another training
    EXPECT_EQ(checkpoint::read_safetensors_metadata(file),
              (std::map<std::string, std::string>{{"flotilla.generation", "0"},
                                                  {"flotilla.training", "b"},
                                                  {"flotilla.update", "1"},
                                                  {"format", "flotilla"}}));
    checkpoint::save_model(s.communicator(), *net, model_dir, "weights.safetensors");
    EXPECT_TRUE(checkpoint::read_safetensors_metadata(file).empty()); // unfenced: replaced
  });
  EXPECT_EQ(refusal.rfind("refused (fencing): these weights are of generation 0, update 30, and "
                          "the file there, " +
                              file.string() +
                              " (generation 1, update 20), was decided by a newer generation of "
                              "the group: this process was replaced",
                          0),
            0u)
      << refusal;
}

} // namespace
} // namespace flotilla
