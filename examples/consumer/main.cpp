// The smallest program on an installed flotilla (README.md shows it whole; a test checks they are
// the same): a MirroredStrategy, a Keras-style Model with the user's own optimizer (parameter
// groups), loss and gradient clipping, a tf.data-style pipeline, and save/load. It exits 0 only
// if the model learned (held-out accuracy above 0.9, the same after loading).
#include <torch/torch.h>

#include <stdlib.h> // mkdtemp

#include <filesystem>
#include <iostream>
#include <stdexcept>
#include <string>

#include "flotilla/data/dataset.h"
#include "flotilla/error.h"
#include "flotilla/strategy/strategy.h"
#include "flotilla/train/model.h"

int main() try {
  using namespace flotilla;
  torch::manual_seed(7);
  // Points in 8 dimensions, labelled by the side of a hyperplane, none within 0.5 of it.
  auto points = [](int n) {
    torch::Tensor x = torch::randn({n, 8});
    torch::Tensor side = torch::matmul(x, torch::linspace(-1.0, 1.0, 8));
    x = x.index({side.abs() > 0.5});
    const torch::Tensor y = (side.index({side.abs() > 0.5}) > 0).to(torch::kInt64);
    return data::Dataset::from_tensor_slices({x, y});
  };
  strategy::MirroredStrategy strategy; // every local device; MultiWorkerMirroredStrategy(cluster)
  auto net = strategy.scope([] {
    return torch::nn::Sequential(torch::nn::Linear(8, 32), torch::nn::ReLU(),
                                 torch::nn::Linear(32, 2));
  });
  train::Model model(strategy, net);
  train::CompileOptions compile;
  compile.optimizer.custom = [](torch::nn::Module& replica) { // weight decay on weights only
    std::vector<torch::Tensor> weights, biases;
    for (const auto& p : replica.named_parameters()) {
      (p.value().dim() > 1 ? weights : biases).push_back(p.value());
    }
    using Options = torch::optim::AdamWOptions;
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(weights, std::make_unique<Options>(Options(0.01).weight_decay(0.01)));
    groups.emplace_back(biases, std::make_unique<Options>(Options(0.01).weight_decay(0)));
    return std::make_unique<torch::optim::AdamW>(std::move(groups), Options(0.01));
  };
  compile.optimizer.global_clipnorm = 1.0; // across every replica and worker
  compile.loss.custom = [](const torch::Tensor& logits, const torch::Tensor& labels) {
    return torch::nn::functional::cross_entropy(logits, labels); // a PyTorch-style mean
  };
  model.compile(compile);

  train::FitOptions fit;
  fit.epochs = 5;
  model.fit(points(4096).shuffle(4096, /*seed=*/1).batch(32), fit);
  const auto test_set = points(1024).batch(256);
  const double accuracy = model.evaluate(test_set).at("accuracy");

  std::string dir = std::filesystem::temp_directory_path() / "flotilla-consumer-XXXXXX";
  if (!::mkdtemp(dir.data())) throw std::runtime_error("cannot make a directory in " + dir);
  model.save(dir); // weights, optimizer state and update count, verified
  train::Model again(strategy, strategy.scope([] {
    return torch::nn::Sequential(torch::nn::Linear(8, 32), torch::nn::ReLU(),
                                 torch::nn::Linear(32, 2));
  }));
  again.compile(compile);
  again.load(dir);
  const double reloaded = again.evaluate(test_set).at("accuracy");
  std::filesystem::remove_all(dir); // this program made it
  std::cout << "flotilla " << FLOTILLA_VERSION << " accuracy " << accuracy << "\n";
  return accuracy > 0.9 && reloaded == accuracy ? kExitOk : kExitFailure;
} catch (const std::exception& e) {
  std::cerr << "error: " << e.what() << "\n";
  return flotilla::exit_code(e);
}
