// The seeds' program in C++: every worker runs this same code with its own TF_CONFIG.
//   build/flotilla launch --workers 3 -- build/examples/multi_worker
// (or set TF_CONFIG by hand on each host: flotilla tf-config ... --index i).
#include <iostream>

#include "flotilla/cluster/resolvers.h"
#include "flotilla/data/fashion_mnist.h"
#include "flotilla/error.h"
#include "flotilla/strategy/strategy.h"
#include "flotilla/train/model.h"
#include "models/zoo.h"

int main() try {
  using namespace flotilla;
  // TF_CONFIG names every worker and says which one this is.
  const auto cluster = cluster::resolve_cluster(cluster::Environment::from_process());
  collective::CommunicationOptions communication; // AUTO: NCCL for CUDA tensors, else ring
  strategy::MultiWorkerMirroredStrategy strategy(cluster, communication);

  // Variables created in the scope are mirrored: every replica starts from the chief's.
  auto net = strategy.scope([] { return models::make_model("cnn"); });
  train::Model model(strategy, net);
  train::CompileOptions compile;
  compile.optimizer.learning_rate = 0.02;
  compile.optimizer.momentum = 0.9;
  model.compile(compile);

  // Scale the batch with the replicas: each one sees BATCH_PER_REPLICA examples a step.
  const std::int64_t batch_per_replica = 32;
  const std::int64_t global_batch = batch_per_replica * strategy.num_replicas_in_sync();
  // The recipe's pipeline, batched by the GLOBAL batch; fit() gives each replica its slice.
  const auto dataset = data::fashion_mnist(data::kFashionMnistDir, data::Split::kTrain)
                           .shuffle(10000, /*seed=*/42)
                           .batch(global_batch, /*drop_remainder=*/true)
                           .map(
                               [](data::Element e) {
                                 return data::Element{data::normalize_images(e[0]), e[1]};
                               },
                               data::kAutotune)
                           .prefetch(data::kAutotune);

  train::FitOptions fit;
  fit.epochs = 1;
  fit.model_dir = "/tmp/flotilla-example"; // chief keeps it; others save to temporary dirs
  const auto history = model.fit(dataset, fit);
  if (strategy.is_chief()) {
    std::cout << "final training accuracy " << history.epochs.back().accuracy << "\n";
  }
} catch (const std::exception& e) {
  std::cerr << "error: " << e.what() << "\n"; // flotilla's errors say what to do
  return flotilla::exit_code(e);
}
