#include <gtest/gtest.h>

#include "flotilla/error.h"
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
  };
  for (const auto& name : model_names()) {
    auto m = make_model(name);
    EXPECT_EQ(parameter_count(m), expected.at(name)) << name;
    const auto y = m->forward(torch::randn({3, 1, 28, 28}));
    EXPECT_EQ(y.sizes(), (std::vector<std::int64_t>{3, 10})) << name;
  }
}

TEST(Zoo, UnknownModelListsTheKnownOnes) {
  try {
    make_model("resnet");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()),
              "model \"resnet\" is not built in; use one of: mlp, mlp-wide, cnn");
  }
}

} // namespace
} // namespace flotilla::models
