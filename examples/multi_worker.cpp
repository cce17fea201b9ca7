// The seeds' first program, "MultiWorker setup — TF_CONFIG", in C++. Every worker runs this same
// code; only TF_CONFIG differs. On one machine:
//   build/flotilla launch --workers 3 -- build/examples/multi_worker
// On several, set TF_CONFIG on each host (flotilla tf-config ... --index i prints it).
// Arguments (optional, for short runs): EPOCHS STEPS_PER_EPOCH.
#include <cstdlib>
#include <iostream>

#include "flotilla/cluster/resolvers.h"
#include "flotilla/data/fashion_mnist.h"
#include "flotilla/error.h"
#include "flotilla/strategy/strategy.h"
#include "flotilla/train/model.h"
#include "models/zoo.h"

using namespace flotilla;

// build_and_compile_model(): the model is built in the strategy's scope, so every replica
// starts from the chief's variables, then compiled.
std::unique_ptr<train::Model> build_and_compile_model(strategy::Strategy& strategy) {
  auto net = strategy.scope([] { return models::make_model("cnn"); });
  auto model = std::make_unique<train::Model>(strategy, net);
  train::CompileOptions compile;
  compile.optimizer = train::OptimizerOptions::sgd(0.02, /*momentum=*/0.9);
  compile.loss.kind = train::LossKind::kSparseCategoricalCrossentropy;
  compile.metrics = {"accuracy"};
  model->compile(compile);
  return model;
}

int main(int argc, char** argv) try {
  // TF_CONFIG, set on each worker before starting (by `flotilla launch`, a TFJob, or by hand):
  // {"cluster": {"worker": ["host1:port", "host2:port", "host3:port"]},
  //  "task": {"type": "worker", "index": 0}}   <- different on each worker
  const auto cluster = cluster::resolve_cluster(cluster::Environment::from_process());

  // Strategy setup — same code on every worker. The seed asks for NCCL: that is what AUTO picks
  // for CUDA tensors; on CPUs the collectives run over Gloo's TCP ring.
  collective::CommunicationOptions communication_options;
  communication_options.implementation = collective::Implementation::kAuto;
  strategy::MultiWorkerMirroredStrategy strategy(cluster, communication_options);

  auto model = build_and_compile_model(strategy);

  const int NUM_WORKERS = strategy.num_workers();
  const int GPUS_PER_WORKER = strategy.replicas_per_worker(); // replicas per worker here
  const std::int64_t BATCH_PER_REPLICA = 64;
  const std::int64_t GLOBAL_BATCH = BATCH_PER_REPLICA * NUM_WORKERS * GPUS_PER_WORKER;

  const auto dataset = data::fashion_mnist(data::kFashionMnistDir, data::Split::kTrain)
                           .shuffle(10000, /*seed=*/42)
                           .batch(GLOBAL_BATCH, /*drop_remainder=*/true)
                           .map(
                               [](data::Element e) {
                                 return data::Element{data::normalize_images(e[0]), e[1]};
                               },
                               data::kAutotune)
                           .prefetch(data::kAutotune);

  train::FitOptions fit;
  fit.epochs = argc > 1 ? std::atoi(argv[1]) : 50;
  if (argc > 2) fit.steps_per_epoch = std::atoll(argv[2]);
  const auto history = model->fit(dataset, fit); // model.fit(dataset, epochs=50)
  if (strategy.is_chief()) {
    std::cout << "final training accuracy " << history["accuracy"].back() << "\n";
  }
} catch (const std::exception& e) {
  std::cerr << "error: " << e.what() << "\n"; // flotilla's errors say what to do
  return flotilla::exit_code(e);
}
