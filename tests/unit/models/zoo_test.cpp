#include <gtest/gtest.h>

#include "flotilla/error.h"
#include "flotilla/kernels/choice.h"
#include "flotilla/kernels/compile.h"
#include "flotilla/profile/compute.h"
#include "flotilla/train/mixed_precision.h"
#include "flotilla/train/sync_batchnorm.h"
#include "models/zoo.h"

namespace flotilla::models {
namespace {

std::int64_t parameter_count(torch::nn::Sequential& m) {
  std::int64_t n = 0;
  for (const auto& p : m->parameters()) n += p.numel();
  return n;
}

TEST(Zoo, ShapesMatchWhatPeersBuild) {
  // Counts by hand: weights + biases of each layer.
  const std::map<std::string, std::int64_t> expected = {
      {"mlp", 784 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10},
      {"mlp-wide", 784 * 2048 + 2048 + 2048 * 2048 + 2048 + 2048 * 10 + 10},
      {"cnn", (32 * 9 + 32) + (64 * 32 * 9 + 64) + (3136 * 128 + 128) + (128 * 10 + 10)},
      // The same layers' counts in PyTorch and Keras (bench/peers): an independent build.
      {"resnet20", 272186},
      {"resnet18", 11172810},
      {"vit-tiny", 2684554},
  };
  for (const auto& name : model_names()) {
    auto m = make_model(name);
    EXPECT_EQ(parameter_count(m), expected.at(name)) << name;
    const auto y = m->forward(torch::randn({3, 1, 28, 28}));
    EXPECT_EQ(y.sizes(), (std::vector<std::int64_t>{3, 10})) << name;
  }
}

// The doctor's FLOP count (profile::counted_flops) of one forward pass, per sample: the CNN's
// by hand; the others equal torch.utils.flop_counter's count of their PyTorch twins
// (bench/peers/utilisation.py flops MODEL), an independent counter, which leaves out the CPU's
// fused attention kernel: ViT-tiny's attention is added by hand (6 layers, 3 heads, 50 tokens
// of 64: Q K^T and the weights times V, 2 x 50 x 50 x 64 each).
TEST(Zoo, ForwardFlopsCountedFromShapesEqualIndependentCounts) {
  const std::map<std::string, std::int64_t> expected = {
      {"mlp", 2 * (784 * 256 + 256 * 256 + 256 * 10)},
      {"cnn", 2 * (28 * 28 * 32 * 9 + 14 * 14 * 64 * 32 * 9 + 3136 * 128 + 128 * 10)},
      {"resnet20", 62043904},
      {"resnet18", 911601664},
      {"vit-tiny", 265725696 + 6 * 3 * 2 * (2 * 50 * 50 * 64)},
  };
  torch::NoGradGuard no_grad;
  for (const auto& [name, flops] : expected) {
    auto m = make_model(name);
    m->eval();
    const torch::Tensor x = torch::zeros({4, 1, 28, 28});
    EXPECT_EQ(profile::counted_flops([&] { m->forward(x); }), 4.0 * static_cast<double>(flops))
        << name;
    // The same under bf16 autocast: the count does not depend on the precision.
    EXPECT_EQ(profile::counted_flops([&] {
                train::AutocastGuard autocast(train::Policy::kMixedBFloat16, torch::kCPU);
                m->forward(x);
              }),
              4.0 * static_cast<double>(flops))
        << name << " under autocast";
  }
  EXPECT_EQ(profile::counted_flops([] {}), 0.0);
}

TEST(Zoo, TheResNetsConvertToSyncBatchNormWithTheirNamesAndValues) {
  torch::manual_seed(3);
  auto net = make_model("resnet20");
  // Running statistics away from their initial values, so the copy is checked.
  net->train();
  net->forward(torch::randn({8, 1, 28, 28}) * 2 + 1);
  net->eval();
  const auto x = torch::randn({4, 1, 28, 28});
  const auto before = net->forward(x);
  const auto names_before = net->named_parameters().keys();
  const auto buffers_before = net->named_buffers();

  auto sync = train::convert_sync_batchnorm(net);
  int converted = 0;
  for (const auto& m : sync->modules()) {
    EXPECT_EQ(dynamic_cast<torch::nn::BatchNorm2dImpl*>(m.get()), nullptr);
    if (dynamic_cast<train::SyncBatchNormImpl*>(m.get())) ++converted;
  }
  EXPECT_EQ(converted, 21); // the stem's, two per block (9), two projection shortcuts
  EXPECT_EQ(sync->named_parameters().keys(), names_before);
  const auto buffers_after = sync->named_buffers();
  ASSERT_EQ(buffers_after.size(), buffers_before.size());
  for (const auto& b : buffers_before) {
    EXPECT_TRUE(torch::equal(buffers_after[b.key()], b.value())) << b.key();
  }
  EXPECT_TRUE(torch::equal(sync->forward(x), before)); // evaluation: the same BatchNorm

  // A replica's copy is its own: its parameters and buffers are not the original's.
  auto copy = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(sync->clone());
  ASSERT_TRUE(copy);
  EXPECT_TRUE(torch::equal(copy->forward(x), before));
  torch::NoGradGuard no_grad;
  for (auto& p : copy->parameters()) p.zero_();
  EXPECT_TRUE(torch::equal(sync->forward(x), before));
}

// The zoo is plain torch::nn: its speed comes from the compile step, as a user's model's does.
// What the step rewrites in each model and what it leaves, with SyncBatchNorm's left alone.
TEST(Zoo, TheCompileStepRewritesEachModelsLayers) {
  using Counts = std::map<std::string, int>;
  const std::map<std::string, std::pair<Counts, Counts>> expected = {
      {"mlp", {{}, {}}},
      {"cnn",
       {{{"first layers (Conv2d, ReLU, MaxPool2d)", 1}, {"ReLU+MaxPool2d", 1}},
        {{"Conv2d (with a bias)", 1}}}},
      // 18 3x3 convolutions in the blocks, 2 of stride 2; the stem's and each block's first
      // "BatchNorm, ReLU"; each block's last BatchNorm (before the sum) and the shortcuts'.
      {"resnet20",
       {{{"3x3 convolutions", 16}, {"BatchNorm+ReLU", 10}},
        {{"Conv2d (channels not multiples of 16 up to 512)", 1},
         {"Conv2d (stride 2)", 2},
         {"Conv2d (not 3x3)", 2},
         {"BatchNorm2d (not followed by ReLU)", 11}}}},
      {"vit-tiny",
       {{{"GELU+Dropout", 6}, {"Dropout", 13}}, {{"Conv2d (outside a Sequential)", 1}}}},
  };
  for (const auto& [name, counts] : expected) {
    auto m = make_model(name);
    const kernels::CompileReport report = kernels::compile(*m);
    EXPECT_EQ(report.rewritten, counts.first) << name << ": " << report.summary();
    EXPECT_EQ(report.left, counts.second) << name << ": " << report.summary();
  }
  auto synced = train::convert_sync_batchnorm(make_model("resnet20"));
  const kernels::CompileReport report = kernels::compile(*synced);
  EXPECT_EQ(report.rewritten.count("BatchNorm+ReLU"), 0u) << report.summary();
  EXPECT_EQ(report.rewritten.at("3x3 convolutions"), 16) << report.summary();
}

TEST(Zoo, UnknownModelListsTheKnownOnes) {
  try {
    make_model("resnet");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()),
              "model \"resnet\" is not built in; use one of: mlp, mlp-wide, cnn, resnet20, "
              "resnet18, vit-tiny");
  }
}

} // namespace
} // namespace flotilla::models
