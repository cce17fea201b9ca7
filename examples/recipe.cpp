// The seeds' second program, "performance recipe stack", in C++, item by item:
//   1. linear LR scaling with the batch size (+ warmup and cosine decay)
//   2. an AUTOTUNE input pipeline
//   3. compiled steps (jit_compile)
//   4. mixed precision matched to the hardware
// Run it alone or as a cluster: build/flotilla launch --workers 2 -- build/examples/recipe
// Arguments (optional, for short runs): EPOCHS STEPS_PER_EPOCH.
#include <cstdlib>
#include <iostream>

#include "flotilla/cluster/resolvers.h"
#include "flotilla/data/fashion_mnist.h"
#include "flotilla/error.h"
#include "flotilla/strategy/strategy.h"
#include "flotilla/train/callbacks.h"
#include "flotilla/train/mixed_precision.h"
#include "flotilla/train/model.h"
#include "flotilla/train/schedules.h"
#include "models/zoo.h"

using namespace flotilla;

int main(int argc, char** argv) try {
  strategy::MultiWorkerMirroredStrategy strategy(
      cluster::resolve_cluster(cluster::Environment::from_process()));
  const auto fashion = data::load_fashion_mnist(data::kFashionMnistDir, data::Split::kTrain);
  const torch::Tensor& x_train = fashion.images;
  const torch::Tensor& y_train = fashion.labels;
  const std::int64_t steps_per_epoch = argc > 2 ? std::atoll(argv[2]) : 60000 / 512;

  // 1. Linear LR scaling with batch size
  const double BASE_LR = 1e-3;
  const std::int64_t GLOBAL_BATCH_SIZE = 512;
  const std::int64_t WARMUP_EPOCHS = 5;
  train::CosineDecayOptions cosine;
  cosine.initial_learning_rate = BASE_LR * (GLOBAL_BATCH_SIZE / 32.0);
  cosine.decay_steps = 1000;
  cosine.warmup_steps = WARMUP_EPOCHS * steps_per_epoch;
  // As in the seed, warmup_target is not set, so TF's CosineDecay does no warmup at all;
  // compile() warns about it. To warm up, set initial_learning_rate = 0 and
  // warmup_target = BASE_LR * (GLOBAL_BATCH_SIZE / 32.0).
  const auto lr_schedule = std::make_shared<train::CosineDecay>(cosine);

  // 2. AUTOTUNE pipeline
  const auto AUTOTUNE = data::kAutotune;
  auto preprocess = [](data::Element e) {
    return data::Element{data::normalize_images(e[0]), e[1]};
  };
  const auto train_ds = data::Dataset::from_tensor_slices({x_train, y_train})
                            .shuffle(10000, /*seed=*/42) // the same order on every worker
                            .batch(GLOBAL_BATCH_SIZE, /*drop_remainder=*/true) // for TPU
                            .map(preprocess, AUTOTUNE)
                            .prefetch(AUTOTUNE)
                            .cache();

  // 4. Mixed precision (matches hardware). Unlike the seed's order, the policy is set before
  // compile(), which reads it (in Keras too, it only affects layers built afterwards).
  // mixed_float16 on GPUs; on CPUs mixed_bfloat16, which is faster only where the CPU computes
  // bfloat16 natively (AVX512-BF16, AMX).
  train::set_global_policy("mixed_bfloat16");

  auto net = strategy.scope([] { return models::make_model("cnn"); });
  train::Model model(strategy, net);
  // 3. XLA compilation
  train::CompileOptions compile;
  compile.optimizer = train::OptimizerOptions::adam();
  compile.optimizer.schedule = lr_schedule;
  compile.loss.kind = train::parse_loss("sparse_categorical_crossentropy");
  compile.jit_compile = true; // GPU: the step as a CUDA graph; CPU: the compile step (also the default)
  model.compile(compile);

  train::FitOptions fit;
  fit.epochs = argc > 1 ? std::atoi(argv[1]) : 3;
  fit.steps_per_epoch = steps_per_epoch;
  const auto history = model.fit(train_ds.repeat(), fit);
  if (strategy.is_chief()) {
    std::cout << "final training accuracy " << history["accuracy"].back() << "\n";
  }
} catch (const std::exception& e) {
  std::cerr << "error: " << e.what() << "\n";
  return flotilla::exit_code(e);
}
