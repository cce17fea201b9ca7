// Elastic healing's state transfer: a worker that rejoins gets the whole training state from a
// live peer over the network (share_training_state), not from disk.
#include <gtest/gtest.h>

#include <torch/nn.h>
#include <torch/optim/rmsprop.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "flotilla/checkpoint/checkpoint_manager.h"
#include "flotilla/checkpoint/model_checkpoint.h"
#include "flotilla/collective/agreement.h"
#include "flotilla/error.h"
#include "flotilla/train/model.h"
#include "flotilla/train/training_state.h"
#include "support/ranks.h"

namespace flotilla {
namespace {

namespace nn = torch::nn;
using testing::run_ranks;
using testing::thread_cluster;

nn::Sequential net(std::uint64_t seed, int hidden = 16) {
  torch::manual_seed(seed);
  return nn::Sequential(nn::Linear(8, hidden), nn::ReLU(), nn::Linear(hidden, 3));
}

train::CompileOptions adam() {
  train::CompileOptions options;
  options.optimizer = train::OptimizerOptions::adam(0.01);
  options.loss_scale = train::LossScaleOptions{};
  return options;
}

collective::CommunicationOptions with_token() {
  auto options = testing::test_options();
  options.cluster_token = "the-cluster-token-0123456789abcdef";
  return options;
}

// Under a cluster token the state transfer is sealed (collective::seal: an HMAC-SHA256 keyed by
// the token): a joiner refuses a state that changed on the way or that a process without the
// token sent. Before, the transfer carried no check at all.
TEST(StateTransfer, UnderATokenAChangedOrForeignMessageIsRefused) {
  const std::optional<std::string> token = "the-cluster-token-0123456789abcdef";
  const std::string purpose = "the training state from rank 0";
  const std::string sealed = collective::seal(token, purpose, "weights");
  ASSERT_EQ(sealed.size(), std::string("weights").size() + 32);
  EXPECT_EQ(collective::open_sealed(token, purpose, sealed), "weights");
  std::string changed = sealed;
  changed[2] ^= 1;
  EXPECT_EQ(collective::open_sealed(token, purpose, changed), std::nullopt);
  EXPECT_EQ(collective::open_sealed(std::string("another-token"), purpose, sealed), std::nullopt);
  EXPECT_EQ(collective::open_sealed(token, "the training state from rank 1", sealed), std::nullopt);
  EXPECT_EQ(collective::open_sealed(token, purpose, "short"), std::nullopt);
  // A sender without the token sends it bare: refused too.
  EXPECT_EQ(collective::open_sealed(token, purpose, collective::seal(std::nullopt, purpose,
                                                                     std::string(64, 'w'))),
            std::nullopt);
  // Without a token there is no key: the message passes as it is.
  EXPECT_EQ(collective::seal(std::nullopt, purpose, "weights"), "weights");
  EXPECT_EQ(collective::open_sealed(std::nullopt, purpose, "weights"), "weights");
}

TEST(StateTransfer, AJoinerGetsWeightsOptimizerStateAndPositionBitForBitFromALivePeer) {
  // The donor trains 5 steps alone (Adam's moments and step count exist); the joiner is a fresh
  // model from another seed whose optimizer has never stepped.
  auto solo = collective::Communicator::local_group(1);
  strategy::Strategy donor_strategy(thread_cluster(0, 1), solo[0]);
  auto donor_net = donor_strategy.scope([] { return net(1); });
  train::Model donor(donor_strategy, donor_net);
  donor.compile(adam());
  torch::manual_seed(5);
  const auto x = torch::randn({40, 8});
  const auto y = torch::randint(0, 3, {40});
  train::FitOptions fit;
  fit.verbose = train::Verbosity::kSilent;
  donor.fit(data::Dataset::from_tensor_slices({x, y}).batch(8), fit);
  train::TrainingState sent = donor.training_state();
  sent.epoch = 3;
  sent.step_in_epoch = 2;
  sent.iterator = data::IteratorState{4, 2, "batch(8)<-slices"};
  ASSERT_EQ(sent.iterations, 5);
  ASSERT_GT(sent.loss_scale, 0);

  auto joiner_net = donor_strategy.scope([] { return net(2); });
  train::Model joiner(donor_strategy, joiner_net);
  joiner.compile(adam());
  ASSERT_FALSE(torch::equal(joiner_net->parameters()[0], donor_net->parameters()[0]));

  train::TrainingState received;
  run_ranks(
      2,
      [&](int rank, collective::Communicator& comm) {
        if (rank == 0) {
          train::share_training_state(donor, comm, 0, sent);
        } else {
          received = train::share_training_state(joiner, comm, 0, {});
        }
      },
      with_token()); // sealed with an HMAC under the token, checked by the joiner
  const auto a = checkpoint::model_state(*donor_net);
  const auto b = checkpoint::model_state(*joiner_net);
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first, b[i].first);
    EXPECT_TRUE(torch::equal(a[i].second, b[i].second)) << a[i].first;
  }
  const auto sa = checkpoint::optimizer_state(donor.optimizer());
  const auto sb = checkpoint::optimizer_state(joiner.optimizer());
  ASSERT_EQ(sa.size(), sb.size());
  ASSERT_GT(sa.size(), 0u);
  for (std::size_t i = 0; i < sa.size(); ++i) {
    EXPECT_EQ(sa[i].first, sb[i].first);
    EXPECT_TRUE(torch::equal(sa[i].second, sb[i].second)) << sa[i].first;
  }
  EXPECT_EQ(received.iterations, 5);
  EXPECT_EQ(received.epoch, 3);
  EXPECT_EQ(received.step_in_epoch, 2);
  ASSERT_TRUE(received.iterator);
  EXPECT_EQ(received.iterator->iteration, 4);
  EXPECT_EQ(received.iterator->produced, 2);
  EXPECT_EQ(received.iterator->fingerprint, "batch(8)<-slices");
  EXPECT_EQ(received.loss_scale, sent.loss_scale);
  EXPECT_EQ(received.loss_scale_good_steps, sent.loss_scale_good_steps);
  joiner.restore_training_state(received);
  EXPECT_EQ(joiner.iterations(), 5);
  EXPECT_EQ(joiner.training_state().loss_scale, sent.loss_scale);

  // A joiner whose model differs is told which tensor, and where it came from.
  auto other_net = donor_strategy.scope([] { return net(3, 32); });
  train::Model other(donor_strategy, other_net);
  other.compile(adam());
  std::string error;
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    if (rank == 0) {
      train::share_training_state(donor, comm, 0, sent);
      return;
    }
    try {
      train::share_training_state(other, comm, 0, {});
    } catch (const CheckpointError& e) {
      error = e.what();
    }
  });
  EXPECT_NE(error.find("the training state from rank 0"), std::string::npos) << error;
}

// RMSprop in two groups (LibTorch's archive of it is what travels).
std::unique_ptr<torch::optim::Optimizer> grouped_rmsprop(nn::Module& m) {
  std::vector<torch::Tensor> weights, biases;
  for (const auto& p : m.named_parameters()) {
    (p.value().dim() > 1 ? weights : biases).push_back(p.value());
  }
  using Options = torch::optim::RMSpropOptions;
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(weights, std::make_unique<Options>(Options(0.01).momentum(0.5)));
  groups.emplace_back(biases, std::make_unique<Options>(Options(0.005).momentum(0.5)));
  return std::make_unique<torch::optim::RMSprop>(std::move(groups), Options(0.01));
}

// An optimizer of the user's own (OptimizerOptions::custom) reaches a joiner too: after the
// transfer, donor and joiner take the same next steps bit for bit; a joiner that got the weights
// alone (its RMSprop averages empty) steps elsewhere.
TEST(StateTransfer, AJoinerGetsAnOptimizerOfTheUsersOwnFromALivePeer) {
  auto solo = collective::Communicator::local_group(1);
  strategy::Strategy s(thread_cluster(0, 1), solo[0]);
  train::CompileOptions compile;
  compile.optimizer.custom = grouped_rmsprop;
  torch::manual_seed(5);
  const auto data =
      data::Dataset::from_tensor_slices({torch::randn({40, 8}), torch::randint(0, 3, {40})})
          .batch(8);
  train::FitOptions fit;
  fit.verbose = train::Verbosity::kSilent;
  auto donor_net = s.scope([] { return net(1); });
  train::Model donor(s, donor_net);
  donor.compile(compile);
  donor.fit(data, fit);
  const train::TrainingState sent = donor.training_state();

  auto joined = [&](bool with_state) {
    auto joiner_net = s.scope([] { return net(2); });
    auto joiner = std::make_unique<train::Model>(s, joiner_net);
    joiner->compile(compile);
    run_ranks(2, [&](int rank, collective::Communicator& comm) {
      if (rank == 0) {
        train::share_training_state(donor, comm, 0, sent);
      } else {
        // Weights and optimizer state arrive; the position (the donor's finished fit) is not
        // restored, so the next fit is a whole pass for both.
        train::share_training_state(*joiner, comm, 0, {});
      }
    });
    if (!with_state) { // the weights alone
      auto fresh_net = s.scope([] { return net(2); });
      auto fresh = std::make_unique<train::Model>(s, fresh_net);
      fresh->compile(compile);
      torch::NoGradGuard no_grad;
      for (std::size_t i = 0; i < fresh_net->parameters().size(); ++i) {
        fresh_net->parameters()[i].copy_(joiner_net->parameters()[i]);
      }
      return std::make_pair(std::move(fresh), fresh_net);
    }
    return std::make_pair(std::move(joiner), joiner_net);
  };
  auto [joiner, joiner_net] = joined(true);
  auto [weights_only, weights_only_net] = joined(false);
  for (auto* m : {&donor, joiner.get(), weights_only.get()}) m->fit(data, fit);
  for (std::size_t i = 0; i < donor_net->parameters().size(); ++i) {
    EXPECT_TRUE(torch::equal(joiner_net->parameters()[i], donor_net->parameters()[i])) << i;
  }
  EXPECT_FALSE(torch::equal(weights_only_net->parameters()[0], donor_net->parameters()[0]));
}

} // namespace
} // namespace flotilla
