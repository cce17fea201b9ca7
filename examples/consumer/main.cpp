// The smallest program on an installed flotilla: a MirroredStrategy, a Keras-style Model and a
// tf.data-style pipeline over a synthetic, linearly separable problem. It exits 0 only if the
// model learned it (held-out accuracy above 0.9), so a build that links but trains wrongly fails.
#include <torch/torch.h>

#include <cstdint>
#include <iostream>
#include <utility>

#include "flotilla/data/dataset.h"
#include "flotilla/error.h"
#include "flotilla/strategy/strategy.h"
#include "flotilla/train/model.h"

namespace {

// Points in 8 dimensions labelled by the side of a fixed hyperplane they fall on, with a margin
// around it left empty so that a linear boundary reaches 100%.
std::pair<torch::Tensor, torch::Tensor> separable_points(std::int64_t n) {
  const auto normal = torch::linspace(-1.0, 1.0, 8);
  auto x = torch::randn({n, 8});
  auto side = torch::matmul(x, normal);
  const auto keep = side.abs() > 0.5;
  x = x.index({keep});
  side = side.index({keep});
  return {x, (side > 0).to(torch::kInt64)};
}

} // namespace

int main() try {
  using namespace flotilla;
  torch::manual_seed(7);
  strategy::MirroredStrategy strategy; // one worker, one replica

  auto net = strategy.scope([] {
    return torch::nn::Sequential(torch::nn::Linear(8, 32), torch::nn::ReLU(),
                                 torch::nn::Linear(32, 2));
  });
  train::Model model(strategy, net);
  model.compile(train::CompileOptions{}); // SGD, cross-entropy from logits, accuracy

  const auto [x_train, y_train] = separable_points(4096);
  const auto [x_test, y_test] = separable_points(1024);
  const auto train_set =
      data::Dataset::from_tensor_slices({x_train, y_train}).shuffle(4096, /*seed=*/1).batch(32);
  const auto test_set = data::Dataset::from_tensor_slices({x_test, y_test}).batch(256);

  train::FitOptions fit;
  fit.epochs = 5;
  model.fit(train_set, fit);
  const double accuracy = model.evaluate(test_set).at("accuracy");
  std::cout << "flotilla " << FLOTILLA_VERSION << " accuracy " << accuracy << "\n";
  return accuracy > 0.9 ? kExitOk : kExitFailure;
} catch (const std::exception& e) {
  std::cerr << "error: " << e.what() << "\n";
  return flotilla::exit_code(e);
}
