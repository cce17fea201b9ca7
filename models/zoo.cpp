#include "models/zoo.h"

#include <torch/nn.h>

#include "flotilla/error.h"

namespace flotilla::models {
namespace nn = torch::nn;

const std::vector<std::string>& model_names() {
  static const std::vector<std::string> kNames = {"mlp", "mlp-wide", "cnn"};
  return kNames;
}

namespace {

nn::Sequential mlp(std::int64_t hidden) {
  return nn::Sequential(nn::Flatten(), nn::Linear(784, hidden), nn::ReLU(),
                        nn::Linear(hidden, hidden), nn::ReLU(), nn::Linear(hidden, 10));
}

nn::Sequential cnn() {
  return nn::Sequential(nn::Conv2d(nn::Conv2dOptions(1, 32, 3).padding(1)), nn::ReLU(),
                        nn::MaxPool2d(2), nn::Conv2d(nn::Conv2dOptions(32, 64, 3).padding(1)),
                        nn::ReLU(), nn::MaxPool2d(2), nn::Flatten(), nn::Linear(3136, 128),
                        nn::ReLU(), nn::Linear(128, 10));
}

} // namespace

nn::Sequential make_model(const std::string& name) {
  if (name == "mlp") return mlp(256);
  if (name == "mlp-wide") return mlp(2048);
  if (name == "cnn") return cnn();
  std::string known;
  for (const auto& n : model_names()) known += (known.empty() ? "" : ", ") + n;
  throw ConfigError("model \"" + name + "\" is not built in; use one of: " + known);
}

} // namespace flotilla::models
