// Model's numbers are global: every worker reports the same loss and accuracy, and they equal
// what one worker computes over the whole dataset.
#include <gtest/gtest.h>

#include <torch/optim/adagrad.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/sgd.h>

#include <filesystem>
#include <functional>
#include <mutex>

#include "flotilla/error.h"
#include "flotilla/train/model.h"
#include "support/ranks.h"
#include "support/subprocess.h"

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
    results[rank] = model.evaluate(data::Dataset::from_tensor_slices({data.x, data.y}).batch(10));
  });
  for (int r = 1; r < world; ++r) {
    EXPECT_EQ(results[r].loss(), results[0].loss());
    EXPECT_EQ(results[r].at("accuracy"), results[0].at("accuracy"));
  }
  return results[0];
}

TEST(Model, EvaluateIsGlobalAndEqualsOneWorkersResult) {
  const Data data;
  const auto one = evaluate_on(1, data);
  const auto two = evaluate_on(2, data);
  EXPECT_EQ(one.samples, 101);
  EXPECT_EQ(two.samples, 101);
  EXPECT_NEAR(two.loss(), one.loss(), 1e-6);
  EXPECT_DOUBLE_EQ(two.at("accuracy"), one.at("accuracy"));
  EXPECT_GT(one.loss(), 0.5); // an untrained 3-class model: about ln 3
}

TEST(Model, FitReportsTheSameGlobalEpochOnEveryWorker) {
  const Data data;
  std::vector<train::History> histories(2);
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 2), comm);
    auto net = s.scope([] { return nn::Linear(8, 3); });
    train::Model model(s, net);
    model.compile({});
    const auto ds =
        data::Dataset::from_tensor_slices({data.x, data.y}).shuffle(101, 1).batch(20, true);
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
    EXPECT_EQ(a.values.at("loss"), b.values.at("loss"));
    EXPECT_EQ(a.values.at("accuracy"), b.values.at("accuracy"));
    // Accuracy is a count over the 100 examples of the epoch.
    EXPECT_NEAR(a.values.at("accuracy") * 100, std::round(a.values.at("accuracy") * 100), 1e-9);
  }
}

// Model::save, then load into a fresh model of the same architecture built from another seed:
// the weights, the optimizer's momentum and its update count come back, so fitting on from the
// load ends where the saved model ended fitting on, bit for bit (torch::equal), on both workers.
// A model of another shape is refused, saying so.
// Adagrad (kept in LibTorch's archive), the first layer at twice the others' rate.
std::unique_ptr<torch::optim::Optimizer> grouped_adagrad(nn::Module& net) {
  std::vector<torch::Tensor> first, rest;
  for (const auto& item : net.named_parameters()) {
    (item.key().rfind("0.", 0) == 0 ? first : rest).push_back(item.value());
  }
  using Options = torch::optim::AdagradOptions;
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(first, std::make_unique<Options>(0.2));
  groups.emplace_back(rest, std::make_unique<Options>(0.1));
  return std::make_unique<torch::optim::Adagrad>(std::move(groups), Options(0.1));
}

void save_then_load(bool own_optimizer);

TEST(Model, SaveThenLoadIntoAFreshModelGoesOnAsTheSavedOneDid) {
  for (const bool own_optimizer : {false, true}) {
    SCOPED_TRACE(own_optimizer ? "Adagrad with groups (OptimizerOptions::custom)" : "SGD");
    save_then_load(own_optimizer);
  }
}

void save_then_load(bool own_optimizer) {
  testing::TempDir dir;
  const std::string saved = dir.path() + "/saved";
  const Data data;
  const auto ds = data::Dataset::from_tensor_slices({data.x, data.y}).batch(20, true);
  std::vector<std::vector<torch::Tensor>> went_on(2), loaded(2);
  std::vector<std::int64_t> updates(2);
  std::vector<std::string> refusal(2);
  auto parameters = [](const nn::Module& m) {
    std::vector<torch::Tensor> out;
    for (const auto& p : m.parameters()) out.push_back(p.detach().clone());
    return out;
  };
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 2), comm);
    auto build = [&](int seed, int hidden) {
      return s.scope([seed, hidden] {
        std::lock_guard<std::mutex> lock(build_mutex);
        torch::manual_seed(seed);
        return nn::Sequential(nn::Linear(8, hidden), nn::ReLU(), nn::Linear(hidden, 3));
      });
    };
    train::CompileOptions compile;
    compile.optimizer = train::OptimizerOptions::sgd(0.1, 0.9);
    if (own_optimizer) compile.optimizer.custom = grouped_adagrad;
    train::FitOptions fit;
    fit.verbose = train::Verbosity::kSilent;

    auto net = build(3, 16);
    train::Model model(s, net);
    model.compile(compile);
    model.fit(ds, fit);
    model.save(saved);
    model.fit(ds, fit);
    went_on[rank] = parameters(*net);

    auto fresh = build(4, 16);
    train::Model again(s, fresh);
    again.compile(compile);
    again.load(saved);
    updates[rank] = again.iterations();
    again.fit(ds, fit);
    loaded[rank] = parameters(*fresh);

    auto other = build(3, 12);
    train::Model wider(s, other);
    wider.compile(compile);
    try {
      wider.load(saved);
    } catch (const CheckpointError& e) {
      refusal[rank] = e.what();
    }
  });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(updates[rank], 5) << "rank " << rank; // one epoch of 5 global batches
    ASSERT_EQ(loaded[rank].size(), went_on[rank].size());
    for (std::size_t i = 0; i < loaded[rank].size(); ++i) {
      EXPECT_TRUE(torch::equal(loaded[rank][i], went_on[rank][i])) << "parameter " << i;
    }
    EXPECT_NE(refusal[rank].find("saved from another model"), std::string::npos) << refusal[rank];
  }
  EXPECT_TRUE(std::filesystem::exists(saved + "/model-5/manifest.json"));
  EXPECT_TRUE(std::filesystem::exists(saved + "/checkpoint"));
}

// What OptimizerOptions::custom returns must be an optimizer over the replica's own parameters
// that fit() can step; compile() says what is wrong otherwise.
TEST(Model, AnOptimizerOfYourOwnThatCannotTrainIsRefusedAtCompile) {
  using Factory = std::function<std::unique_ptr<torch::optim::Optimizer>(nn::Module&)>;
  const torch::Tensor stranger = torch::zeros({2}, torch::requires_grad());
  const std::vector<std::pair<Factory, std::string>> cases = {
      {[](nn::Module&) { return nullptr; }, "OptimizerOptions::custom returned no optimizer"},
      {[](nn::Module& m) {
         return std::make_unique<torch::optim::LBFGS>(m.parameters(),
                                                      torch::optim::LBFGSOptions(1));
       },
       "OptimizerOptions::custom returned an LBFGS, which steps with a closure"},
      {[&](nn::Module& m) {
         auto params = m.parameters();
         params.push_back(stranger);
         return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1));
       },
       "OptimizerOptions::custom returned an optimizer whose group 0 holds a tensor (number 2) "
       "that is not a parameter of the replica it was given"},
      {[](nn::Module& m) {
         return std::make_unique<torch::optim::SGD>(m.parameters(), torch::optim::SGDOptions(0));
       },
       "OptimizerOptions::custom returned an optimizer whose first group's learning rate is "
       "0.000000; it must be positive"},
  };
  run_ranks(1, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 1), comm);
    for (const auto& [factory, expected] : cases) {
      train::Model model(s, nn::Linear(2, 2));
      train::CompileOptions compile;
      compile.optimizer.custom = factory;
      try {
        model.compile(compile);
        ADD_FAILURE() << "compiled; expected: " << expected;
      } catch (const ConfigError& e) {
        EXPECT_EQ(std::string(e.what()).rfind(expected, 0), 0u) << e.what();
      }
    }
  });
}

// A short last global batch (101 = 5 x 20 + 1) is split across workers — one gets nothing — and
// still every step is the one-worker step: parameters match 1, 2 and 4 workers.
TEST(Model, AShortLastBatchIsWeighedExactlyOnAnyNumberOfWorkers) {
  const Data data;
  auto train_on = [&](int world) {
    std::vector<torch::Tensor> out;
    run_ranks(world, [&](int rank, collective::Communicator& comm) {
      strategy::Strategy s(thread_cluster(rank, world), comm);
      auto net = s.scope([] {
        std::lock_guard<std::mutex> lock(build_mutex);
        torch::manual_seed(9);
        return nn::Sequential(nn::Linear(8, 16), nn::ReLU(), nn::Linear(16, 3));
      });
      train::Model model(s, net);
      train::CompileOptions compile;
      compile.optimizer.learning_rate = 0.5; // large steps make any weighting error visible
      model.compile(compile);
      train::FitOptions fit;
      fit.epochs = 2;
      fit.verbose = train::Verbosity::kSilent;
      const auto history = model.fit(
          data::Dataset::from_tensor_slices({data.x, data.y}).shuffle(101, 4).batch(20), fit);
      EXPECT_EQ(history.epochs.at(0).steps, 6);
      if (rank == 0) {
        for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
      }
    });
    return out;
  };
  const auto one = train_on(1);
  for (int world : {2, 4}) { // 101 = 5 x 20 + 1: the last batch leaves slices empty
    const auto many = train_on(world);
    for (std::size_t i = 0; i < one.size(); ++i) {
      EXPECT_TRUE(torch::allclose(many[i], one[i], 1e-5, 1e-6))
          << world << " workers, parameter " << i;
    }
  }
}

TEST(Model, UsingItBeforeCompileSaysSo) {
  run_ranks(1, [](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 1), comm);
    train::Model model(s, nn::Linear(2, 2));
    try {
      model.fit(data::Dataset::from_tensor_slices(
                    {torch::randn({4, 2}), torch::zeros({4}, torch::kInt64)})
                    .batch(2));
      FAIL();
    } catch (const ConfigError& e) {
      EXPECT_EQ(std::string(e.what()), "Model.fit() before compile(); call compile() first");
    }
  });
}

// An endless dataset (repeat()) trains for steps_per_epoch steps per epoch, continuing the stream;
// without steps_per_epoch an epoch would never end, which is said before training starts.
TEST(Model, AnEndlessDatasetNeedsStepsPerEpoch) {
  run_ranks(2, [](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 2), comm);
    auto net = s.scope([] { return nn::Sequential(nn::Linear(2, 2)); });
    train::Model model(s, net);
    model.compile({});
    const auto endless = data::Dataset::from_tensor_slices(
                             {torch::randn({6, 2}), torch::zeros({6}, torch::kInt64)})
                             .repeat()
                             .batch(4);
    train::FitOptions fit;
    fit.verbose = train::Verbosity::kSilent;
    try {
      model.fit(endless, fit);
      FAIL() << "an endless epoch started";
    } catch (const ConfigError& e) {
      EXPECT_EQ(std::string(e.what()),
                "the training dataset is endless (repeat() without a count), so an epoch would "
                "never end; set FitOptions::steps_per_epoch");
    }
    fit.epochs = 2;
    fit.steps_per_epoch = 5; // more than one pass of 6 elements in batches of 4
    const auto history = model.fit(endless, fit);
    ASSERT_EQ(history.epochs.size(), 2u);
    EXPECT_EQ(history.epochs[1].steps, 5);
  });
}

} // namespace
} // namespace flotilla
