// Data parallelism must not change the mathematics: from the same initial parameters and data
// order, 2 workers with batch 32 each take the same SGD steps as 1 worker with batch 64.
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>

#include "flotilla/checkpoint/safetensors.h"
#include "flotilla/data/fashion_mnist.h"
#include "flotilla/strategy/strategy.h"
#include "flotilla/train/model.h"
#include "flotilla/train/schedules.h"
#include "models/zoo.h"
#include "support/compare.h"
#include "support/ranks.h"
#include "support/subprocess.h"

namespace flotilla {
namespace {

using testing::max_relative_difference;
using testing::run_ranks;
using testing::thread_cluster;

constexpr std::int64_t kGlobalBatch = 64;
constexpr std::int64_t kSteps = 30;

// Builds one model at a time from the same seed: ranks are threads sharing torch's generator.
std::mutex build_mutex;

// The global batches every run here takes, in order, in float64.
data::Dataset global_batches(const data::Dataset& images) {
  return images.shuffle(10000, /*seed=*/5)
      .batch(kGlobalBatch, /*drop_remainder=*/true)
      .map(
          [](data::Element e) {
            return data::Element{data::normalize_images(e[0]).to(torch::kFloat64), e[1]};
          },
          data::kAutotune);
}

torch::nn::Sequential seeded_cnn() {
  std::lock_guard<std::mutex> lock(build_mutex);
  torch::manual_seed(1234);
  auto m = models::make_model("cnn");
  // In float64 the comparison tests the algorithm, not float32 rounding, which 30 steps of
  // ReLU kinks amplify chaotically (seen: 4e-7 to 3e-4 depending on the learning rate).
  m->to(torch::kFloat64);
  return m;
}

std::vector<torch::Tensor>
train(strategy::Strategy& strategy, const data::Dataset& images, strategy::InputContext context,
      const std::function<void(train::CompileOptions&)>& configure = {}) {
  auto net = strategy.scope([] { return seeded_cnn(); });
  train::Model model(strategy, net);
  train::CompileOptions compile;
  compile.optimizer.learning_rate = 0.05;
  compile.optimizer.momentum = 0.9;
  if (configure) configure(compile);
  model.compile(compile);
  const auto dataset = data::distribute_dataset(global_batches(images), context);
  train::FitOptions fit;
  fit.steps_per_epoch = kSteps;
  fit.verbose = train::Verbosity::kSilent;
  model.fit(dataset, fit);
  std::vector<torch::Tensor> out;
  for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

TEST(Equivalence, TwoWorkersOfBatch32OrOfShares2To1StepLikeOneWorkerOfBatch64) {
  if (!testing::fashion_mnist_present()) GTEST_SKIP() << "dataset-fashion-mnist absent";
  const auto images = data::fashion_mnist(data::kFashionMnistDir, data::Split::kTrain);

  std::vector<torch::Tensor> single;
  run_ranks(1, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 1), comm);
    single = train(s, images, s.input_context());
  });

  std::vector<std::vector<torch::Tensor>> pair(2);
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 2), comm);
    pair[rank] = train(s, images, s.input_context());
  });

  // Shares by speed: worker 0 takes rows 0-41 of each 64 and worker 1 rows 42-63 (weights 2:1),
  // and the steps are the same (each replica's loss sum over G/R, averaged: the global batch's
  // mean).
  std::vector<std::vector<torch::Tensor>> shared(2);
  std::vector<std::string> plans(2);
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 2), comm);
    s.set_shares({2, 1});
    shared[rank] = train(s, images, s.input_context());
    plans[rank] = data::distribute_dataset(global_batches(images), s.input_context()).plan();
  });
  EXPECT_NE(plans[0].find("rows 0 to 41 of each global batch (shares 2,1)"), std::string::npos)
      << plans[0];
  EXPECT_NE(plans[1].find("rows 42 to 63 of each global batch (shares 2,1)"), std::string::npos)
      << plans[1];

  // Control: worker 0's half of each batch without synchronisation drifts far away, so the
  // comparison above can tell synchronised training from unsynchronised.
  std::vector<torch::Tensor> alone;
  run_ranks(1, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 1), comm);
    alone = train(s, images, strategy::InputContext{2, 0, 2});
  });

  const double diff = max_relative_difference(pair[0], single);
  RecordProperty("max_relative_difference", std::to_string(diff));
  EXPECT_LT(diff, 1e-8); // the issue asks < 1e-4; float64 makes 1e-8 safe
  EXPECT_LT(max_relative_difference(shared[0], single), 1e-8);
  EXPECT_GT(max_relative_difference(alone, single), 1e-2);
  // All workers hold bitwise identical parameters after training.
  for (std::size_t i = 0; i < pair[0].size(); ++i) {
    EXPECT_TRUE(torch::equal(pair[0][i], pair[1][i])) << "parameter " << i;
    EXPECT_TRUE(torch::equal(shared[0][i], shared[1][i])) << "parameter " << i;
  }
}

// kSteps steps of a plain LibTorch loop (PyTorch as its users write it: mean loss, backward,
// `before_step`, the optimizer: SGD unless `make_optimizer` builds another) on the global
// batches; the parameters it ends with.
using BeforeStep = std::function<void(torch::nn::Module&, torch::optim::Optimizer&, std::int64_t)>;
std::vector<torch::Tensor>
reference_loop(const data::Dataset& images,
               const std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)>& loss,
               const BeforeStep& before_step = {},
               const std::function<std::unique_ptr<torch::optim::Optimizer>(torch::nn::Module&)>&
                   make_optimizer = {}) {
  auto net = seeded_cnn();
  auto optimizer = make_optimizer
                       ? make_optimizer(*net)
                       : std::make_unique<torch::optim::SGD>(
                             net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  auto batches = global_batches(images).make_iterator();
  for (std::int64_t step = 0; step < kSteps; ++step) {
    const auto batch = batches.next();
    if (!batch) throw std::runtime_error("the dataset ended early");
    optimizer->zero_grad();
    loss(net->forward((*batch)[0]), (*batch)[1]).backward();
    if (before_step) before_step(*net, *optimizer, step);
    optimizer->step();
  }
  std::vector<torch::Tensor> out;
  for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

// Global-norm clipping clips the whole global batch's gradient, after the all-reduce: two workers
// of batch 32 take the steps of a plain LibTorch loop (PyTorch's clip_grad_norm_ after
// backward, as DDP users clip) on the batches of 64, within 1e-9 in float64. The clip acts at
// every step here (the gradient's norm is above 0.5 throughout): unclipped, the run ends far away.
TEST(Equivalence, GlobalNormClippingOnTwoWorkersIsClipGradNormOnTheGlobalBatch) {
  if (!testing::fashion_mnist_present()) GTEST_SKIP() << "dataset-fashion-mnist absent";
  const auto images = data::fashion_mnist(data::kFashionMnistDir, data::Split::kTrain);
  constexpr double kClip = 0.5;

  int clipped = 0;
  const auto reference = reference_loop(
      images,
      [](const torch::Tensor& outputs, const torch::Tensor& labels) {
        return torch::nn::functional::cross_entropy(outputs, labels);
      },
      [&](torch::nn::Module& net, torch::optim::Optimizer&, std::int64_t) {
        clipped += torch::nn::utils::clip_grad_norm_(net.parameters(), kClip) > kClip;
      });
  EXPECT_EQ(clipped, kSteps);

  std::vector<std::vector<torch::Tensor>> pair(2);
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 2), comm);
    pair[rank] = train(s, images, s.input_context(), [&](train::CompileOptions& compile) {
      compile.optimizer.global_clipnorm = kClip;
    });
  });
  const double diff = max_relative_difference(pair[0], reference);
  RecordProperty("max_relative_difference", std::to_string(diff));
  EXPECT_LT(diff, 1e-9);
  for (std::size_t i = 0; i < pair[0].size(); ++i) {
    EXPECT_TRUE(torch::equal(pair[0][i], pair[1][i])) << "parameter " << i;
  }

  std::vector<torch::Tensor> unclipped;
  run_ranks(1, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 1), comm);
    unclipped = train(s, images, s.input_context());
  });
  EXPECT_GT(max_relative_difference(unclipped, reference), 1e-2);
}

// A loss of the user's own, as a PyTorch user writes it (a scalar: the mean over the examples it
// is given), on two workers of batch 32 trains as PyTorch's loop does on the batches of 64,
// within 1e-9 in float64; the same loss given per example does too. Each worker's scalar covers
// its half; fit() weighs it to the global batch's mean.
TEST(Equivalence, AUsersOwnLossOnTwoWorkersTrainsAsPyTorchsLoopOnTheGlobalBatch) {
  if (!testing::fashion_mnist_present()) GTEST_SKIP() << "dataset-fashion-mnist absent";
  const auto images = data::fashion_mnist(data::kFashionMnistDir, data::Split::kTrain);
  namespace F = torch::nn::functional;
  const auto smoothed = F::CrossEntropyFuncOptions().label_smoothing(0.2);
  const auto reference =
      reference_loop(images, [&](const torch::Tensor& outputs, const torch::Tensor& labels) {
        return F::cross_entropy(outputs, labels, smoothed);
      });
  for (const bool per_example : {false, true}) {
    std::vector<std::vector<torch::Tensor>> pair(2);
    run_ranks(2, [&](int rank, collective::Communicator& comm) {
      strategy::Strategy s(thread_cluster(rank, 2), comm);
      pair[rank] = train(s, images, s.input_context(), [&](train::CompileOptions& compile) {
        compile.loss.custom = [&](const torch::Tensor& outputs, const torch::Tensor& labels) {
          return F::cross_entropy(
              outputs, labels,
              F::CrossEntropyFuncOptions().label_smoothing(0.2).reduction(
                  per_example ? torch::nn::CrossEntropyLossOptions::reduction_t(torch::kNone)
                              : torch::nn::CrossEntropyLossOptions::reduction_t(torch::kMean)));
        };
      });
    });
    const double diff = max_relative_difference(pair[0], reference);
    EXPECT_LT(diff, 1e-9) << (per_example ? "per example" : "scalar");
  }
  // Control: the built-in loss without smoothing ends elsewhere.
  std::vector<torch::Tensor> plain;
  run_ranks(1, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 1), comm);
    plain = train(s, images, s.input_context());
  });
  EXPECT_GT(max_relative_difference(plain, reference), 1e-3);
}

// A PyTorch user's optimizer with parameter groups: RMSprop (which flotilla has no name for), the
// weights at 0.01 with weight decay, the biases at a quarter of that rate without.
std::unique_ptr<torch::optim::Optimizer> grouped_rmsprop(torch::nn::Module& net) {
  std::vector<torch::Tensor> weights, biases;
  for (const auto& item : net.named_parameters()) {
    (item.value().dim() > 1 ? weights : biases).push_back(item.value());
  }
  using Options = torch::optim::RMSpropOptions;
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(weights,
                      std::make_unique<Options>(Options(0.01).momentum(0.5).weight_decay(1e-3)));
  groups.emplace_back(biases, std::make_unique<Options>(Options(0.0025).momentum(0.5)));
  return std::make_unique<torch::optim::RMSprop>(std::move(groups), Options(0.01));
}

// Your own optimizer, with groups, under a cosine decay: two workers of batch 32 train as
// PyTorch's loop does on the batches of 64 (LambdaLR-style: every group's rate is its own base
// rate times the schedule's factor), within 1e-9 in float64; every worker ends bit-identical.
// Control: the same loop giving both groups the schedule's rate ends elsewhere.
TEST(Equivalence, AUsersOwnOptimizerWithParameterGroupsTrainsAsPyTorchsLoop) {
  if (!testing::fashion_mnist_present()) GTEST_SKIP() << "dataset-fashion-mnist absent";
  const auto images = data::fashion_mnist(data::kFashionMnistDir, data::Split::kTrain);
  const auto schedule = std::make_shared<train::CosineDecay>(
      train::CosineDecayOptions{/*initial_learning_rate=*/0.01, /*decay_steps=*/kSteps});
  const auto reference = [&](bool keep_ratio) {
    return reference_loop(
        images,
        [](const torch::Tensor& outputs, const torch::Tensor& labels) {
          return torch::nn::functional::cross_entropy(outputs, labels);
        },
        [&](torch::nn::Module&, torch::optim::Optimizer& optimizer, std::int64_t step) {
          optimizer.param_groups()[0].options().set_lr((*schedule)(step));
          optimizer.param_groups()[1].options().set_lr((*schedule)(step) * (keep_ratio ? 0.25 : 1));
        },
        grouped_rmsprop);
  };
  const auto expected = reference(true);

  std::vector<std::vector<torch::Tensor>> pair(2);
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 2), comm);
    pair[rank] = train(s, images, s.input_context(), [&](train::CompileOptions& compile) {
      compile.optimizer.custom = grouped_rmsprop;
      compile.optimizer.schedule = schedule;
    });
  });
  const double diff = max_relative_difference(pair[0], expected);
  RecordProperty("max_relative_difference", std::to_string(diff));
  EXPECT_LT(diff, 1e-9);
  for (std::size_t i = 0; i < pair[0].size(); ++i) {
    EXPECT_TRUE(torch::equal(pair[0][i], pair[1][i])) << "parameter " << i;
  }
  EXPECT_GT(max_relative_difference(reference(false), expected), 1e-3);
}

// A model of two inputs and two outputs: the image and its brightness in, the class and
// "is it upper-body clothing" (classes 0, 2, 3, 4, 6) out.
struct TwoHeadsImpl : torch::nn::Module {
  torch::nn::Conv2d conv{torch::nn::Conv2dOptions(1, 4, 3).padding(1)};
  torch::nn::Linear side{1, 4}, classes{4 * 14 * 14 + 4, 10}, upper{4 * 14 * 14 + 4, 2};
  TwoHeadsImpl() {
    register_module("conv", conv);
    register_module("side", side);
    register_module("classes", classes);
    register_module("upper", upper);
  }
  train::Tensors forward(const train::Tensors& in) {
    torch::Tensor h = torch::max_pool2d(torch::relu(conv(in[0])), 2).flatten(1);
    h = torch::cat({h, torch::relu(side(in[1]))}, 1);
    return {classes(h), upper(h)};
  }
};
TORCH_MODULE(TwoHeads);

TwoHeads seeded_two_heads() {
  std::lock_guard<std::mutex> lock(build_mutex);
  torch::manual_seed(77);
  TwoHeads m;
  m->to(torch::kFloat64);
  return m;
}

// (image, brightness, class, upper body) from (image, class).
data::Element two_heads_element(const data::Element& e) {
  const torch::Tensor brightness = e[0].mean({1, 2, 3}).unsqueeze(1);
  const torch::Tensor c = e[1];
  const torch::Tensor upper =
      ((c == 0) | (c == 2) | (c == 3) | (c == 4) | (c == 6)).to(torch::kLong);
  return {e[0], brightness, c, upper};
}

// Two workers train a model of two inputs and two outputs with the built-in loss on each
// output, weighted 1 and 0.5, as LibTorch's loop does on the global batches (within 1e-9 in
// float64); evaluate() reports each output's accuracy, and predict_outputs() gives every worker
// both outputs of every element in the dataset's order.
TEST(Equivalence, AModelOfTwoInputsAndTwoOutputsTrainsAsPyTorchsLoop) {
  if (!testing::fashion_mnist_present()) GTEST_SKIP() << "dataset-fashion-mnist absent";
  const auto images = data::fashion_mnist(data::kFashionMnistDir, data::Split::kTrain);
  // A new dataset for each run: each iteration of one reshuffles (TF's default).
  const auto batches = [&] { return global_batches(images).map(two_heads_element); };
  const std::vector<double> weights = {1.0, 0.5};
  const auto reference = [&](double upper_weight) {
    auto net = seeded_two_heads();
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    auto it = batches().make_iterator();
    for (std::int64_t step = 0; step < kSteps; ++step) {
      const auto e = it.next().value();
      sgd.zero_grad();
      const auto out = net->forward({e[0], e[1]});
      (torch::nn::functional::cross_entropy(out[0], e[2]) +
       upper_weight * torch::nn::functional::cross_entropy(out[1], e[3]))
          .backward();
      sgd.step();
    }
    std::vector<torch::Tensor> out;
    for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
    return std::make_pair(out, net);
  };
  auto [expected, expected_net] = reference(weights[1]);

  const torch::Tensor probe_x = torch::randn({21, 1, 28, 28}, torch::kFloat64);
  const torch::Tensor probe_s = torch::randn({21, 1}, torch::kFloat64);
  const auto probe = data::Dataset::from_tensor_slices({probe_x, probe_s}).batch(8);
  std::vector<std::vector<torch::Tensor>> pair(2);
  std::vector<train::EvalResult> evaluated(2);
  std::vector<train::Tensors> predicted(2);
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 2), comm);
    auto net = s.scope([] { return seeded_two_heads(); });
    train::Model model(
        s, net.ptr(), [impl = net.ptr()](const train::Tensors& in) { return impl->forward(in); },
        train::Signature{2, 2});
    train::CompileOptions compile;
    compile.optimizer = train::OptimizerOptions::sgd(0.05, 0.9);
    compile.loss.loss_weights = weights;
    model.compile(compile);
    train::FitOptions fit;
    fit.steps_per_epoch = kSteps;
    fit.verbose = train::Verbosity::kSilent;
    model.fit(data::distribute_dataset(batches(), s.input_context()), fit);
    for (const auto& p : net->parameters()) pair[rank].push_back(p.detach().clone());
    evaluated[rank] = model.evaluate(batches().take(3));
    predicted[rank] = model.predict_outputs(probe);
  });
  const double diff = max_relative_difference(pair[0], expected);
  RecordProperty("max_relative_difference", std::to_string(diff));
  EXPECT_LT(diff, 1e-9);
  EXPECT_GT(max_relative_difference(reference(0).first, expected), 1e-3); // the weight counts
  for (std::size_t i = 0; i < pair[0].size(); ++i) {
    EXPECT_TRUE(torch::equal(pair[0][i], pair[1][i])) << "parameter " << i;
  }
  for (const std::string key : {"loss", "output_0_accuracy", "output_1_accuracy"}) {
    EXPECT_TRUE(evaluated[0].values.get(key).has_value()) << key;
  }
  EXPECT_GT(evaluated[0].at("output_1_accuracy"), evaluated[0].at("output_0_accuracy"));
  EXPECT_EQ(evaluated[0].samples, 3 * kGlobalBatch);

  // Predicting: every worker has both outputs of all 21 elements, as the trained model gives.
  torch::NoGradGuard no_grad;
  expected_net->eval();
  const auto direct = expected_net->forward({probe_x, probe_s});
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_EQ(predicted[rank].size(), 2u);
    for (std::size_t o = 0; o < 2; ++o) {
      ASSERT_EQ(predicted[rank][o].sizes(), direct[o].sizes()) << "output " << o;
      EXPECT_LT((predicted[rank][o] - direct[o].to(torch::kFloat32)).abs().max().item<double>(),
                1e-5)
          << "rank " << rank << ", output " << o;
    }
  }
}

// Channels-last changes where each number sits in memory, not the mathematics: a ResNet-20
// (convolutions of many channels, BatchNorm, a one-channel input) trained 6 steps with NHWC
// weights and activations ends where the NCHW run does, within 1e-9 in float64; its gradients
// live in NHWC too, and what it saves is in NCHW order (the files do not depend on the layout).
TEST(Equivalence, AChannelsLastRunTrainsTheSameWeightsAsAnNchwRun) {
  if (!testing::fashion_mnist_present()) GTEST_SKIP() << "dataset-fashion-mnist absent";
  const auto images = data::fashion_mnist(data::kFashionMnistDir, data::Split::kTrain);
  std::vector<torch::Tensor> initial;
  auto run = [&](bool channels_last) {
    std::vector<torch::Tensor> out;
    run_ranks(1, [&](int rank, collective::Communicator& comm) {
      strategy::Strategy s(thread_cluster(rank, 1), comm);
      torch::manual_seed(1234);
      // In float64, as the test above: the layouts' kernels sum in different orders, and in
      // float32 BatchNorm's near-zero biases turn that rounding into percents (PyTorch's too).
      auto net = s.scope([] {
        auto m = models::make_model("resnet20");
        m->to(torch::kFloat64);
        return m;
      });
      if (initial.empty()) {
        for (const auto& p : net->parameters()) initial.push_back(p.detach().clone());
      }
      train::Model model(s, net);
      train::CompileOptions compile;
      compile.optimizer.learning_rate = 0.05;
      compile.optimizer.momentum = 0.9;
      compile.channels_last = channels_last;
      model.compile(compile);
      EXPECT_EQ(model.channels_last(), channels_last);
      train::FitOptions fit;
      fit.steps_per_epoch = 6;
      fit.verbose = train::Verbosity::kSilent;
      model.fit(images.take(6 * 32).batch(32).map([](data::Element e) {
        return data::Element{data::normalize_images(e[0]).to(torch::kFloat64), e[1]};
      }),
                fit);
      // The second convolution's weight (16 -> 16 channels) and its gradient.
      const auto params = net->named_parameters();
      const torch::Tensor& weight = params["3.body.0.weight"];
      const auto expected =
          channels_last ? torch::MemoryFormat::ChannelsLast : torch::MemoryFormat::Contiguous;
      EXPECT_EQ(weight.suggest_memory_format(), expected);
      EXPECT_EQ(weight.grad().suggest_memory_format(), expected);
      EXPECT_FALSE(weight.is_contiguous() && channels_last);
      // Saved: the bytes of the NCHW-contiguous tensor.
      testing::TempDir dir;
      checkpoint::save_safetensors(dir.path() + "/w.safetensors", {{"w", weight}});
      const auto loaded = checkpoint::load_safetensors(dir.path() + "/w.safetensors");
      EXPECT_TRUE(torch::equal(loaded.tensors.at("w"), weight.contiguous()));
      EXPECT_TRUE(loaded.tensors.at("w").is_contiguous());
      for (const auto& p : net->parameters()) out.push_back(p.detach().contiguous().clone());
    });
    return out;
  };
  const auto nchw = run(false);
  const auto nhwc = run(true);
  const double diff = max_relative_difference(nhwc, nchw);
  RecordProperty("max_relative_difference", std::to_string(diff));
  EXPECT_LT(diff, 1e-9);
  EXPECT_GT(max_relative_difference(nchw, initial), 1e-2); // the steps moved the weights
}

} // namespace
} // namespace flotilla
