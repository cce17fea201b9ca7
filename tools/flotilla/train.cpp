// `flotilla train`: one worker of a data-parallel training job. The cluster comes from
// TF_CONFIG (or torchrun variables, or nothing: one worker alone); start one per task, or let
// `flotilla launch` start them on this machine.
#include <unistd.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "flotilla/cluster/resolvers.h"
#include "flotilla/data/distribute.h"
#include "flotilla/data/fashion_mnist.h"
#include "flotilla/data/image.h"
#include "flotilla/error.h"
#include "flotilla/strategy/strategy.h"
#include "flotilla/train/model.h"
#include "models/zoo.h"
#include "tools/flotilla/commands.h"

namespace flotilla::tools {
namespace {

struct TrainArgs {
  std::string model = "cnn";
  std::string dataset = "fashion-mnist";
  std::string data_dir = data::kFashionMnistDir;
  int epochs = 1;
  std::int64_t steps_per_epoch = 0; // 0: the whole dataset
  std::int64_t batch_per_replica = 32;
  double lr = 0.04; // linear scaling: 0.02 per 32 examples, at the default global batch 64
  double momentum = 0.9;
  std::uint64_t seed = 42;
  std::string model_dir;
  int threads = 0; // 0: cores ÷ workers on this machine
  std::string metrics_json;
  double timeout_s = 300;
  std::string implementation = "auto";
  std::int64_t bytes_per_pack = 25 * 1024 * 1024;
  bool no_overlap = false;
  std::string compression = "none";
  int replicas_per_worker = 1;
  int accumulation_steps = 1;
  std::string verbose = "auto";
  std::int64_t shuffle_buffer = 10000;
  std::string cache = "none";
  bool augment = false;
};

void append_json_line(const std::string& path, const nlohmann::ordered_json& object) {
  std::ofstream out(path, std::ios::app);
  out << object.dump() << "\n";
  if (!out.flush()) {
    throw ConfigError("cannot append to --metrics-json file " + path + "; check the path");
  }
}

int run(const TrainArgs& a) {
  const auto env = cluster::Environment::from_process();
  const cluster::ClusterSpec spec = cluster::resolve_cluster(env);
  if (spec.is_evaluator()) {
    throw ConfigError(
        "this task is the evaluator (TF_CONFIG task.type \"evaluator\"): side-car evaluation is "
        "not supported yet, and the evaluator never joins training; start only the chief and "
        "worker tasks");
  }
  if (a.dataset != "fashion-mnist") {
    throw ConfigError("--dataset \"" + a.dataset + "\" is not available; use fashion-mnist");
  }
  const int threads =
      a.threads > 0 ? a.threads : std::max(1, available_cores() / cluster::local_world_size(env));
  torch::set_num_threads(threads);

  collective::CommunicationOptions comm;
  comm.implementation = collective::parse_implementation(a.implementation);
  comm.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(a.timeout_s * 1000));
  comm.bytes_per_pack = a.bytes_per_pack;
  comm.overlap = !a.no_overlap;
  comm.compression = collective::parse_compression(a.compression);

  const bool write_metrics = spec.is_chief() && !a.metrics_json.empty();
  if (write_metrics && !std::ofstream(a.metrics_json, std::ios::app)) {
    // Found before joining, not after an epoch of training.
    throw ConfigError("cannot append to --metrics-json file " + a.metrics_json +
                      "; check that its directory exists and is writable");
  }
  // Load (and validate) the data before joining, so a bad path fails fast on every worker.
  data::Dataset train_source = data::fashion_mnist(a.data_dir, data::Split::kTrain);
  const data::Dataset test_source = data::fashion_mnist(a.data_dir, data::Split::kTest);

  strategy::MultiWorkerMirroredStrategy strategy(spec, comm, a.replicas_per_worker);
  const std::int64_t global_batch = a.batch_per_replica * strategy.num_replicas_in_sync();
  if (strategy.is_chief()) {
    strategy.log().info(
        "MultiWorkerMirroredStrategy: " + std::to_string(strategy.num_workers()) + " worker(s), " +
        std::to_string(strategy.num_replicas_in_sync()) + " replica(s) in sync, global batch " +
        std::to_string(global_batch) + " (" + std::to_string(a.batch_per_replica) +
        " per replica), " + std::to_string(threads) + " thread(s) per worker; cluster from " +
        spec.source + (spec.world_size > 1 ? ", rendezvous " + spec.rendezvous.to_string() : ""));
  }

  torch::manual_seed(a.seed);
  auto net = strategy.scope([&] { return models::make_model(a.model); });
  train::Model model(strategy, net);
  train::CompileOptions compile;
  compile.optimizer.learning_rate = a.lr;
  compile.optimizer.momentum = a.momentum;
  compile.gradient_accumulation_steps = a.accumulation_steps;
  model.compile(compile);
  if (strategy.is_chief()) {
    strategy.log().info("gradients: " + model.gradient_reducer().plan() + "; overlap " +
                        (comm.overlap ? "on" : "off") + ", compression " +
                        std::string(collective::to_string(comm.compression)));
  }

  // The seeds' recipe: shuffle -> batch(drop_remainder) -> map(AUTOTUNE) -> prefetch(AUTOTUNE),
  // distributed so that each worker preprocesses only its own slice of every global batch.
  if (a.cache == "memory") {
    train_source = train_source.cache();
  } else if (a.cache != "none") {
    train_source = train_source.cache(a.cache);
  }
  const bool augment = a.augment;
  // Elements reach preprocess as (positions, images, labels, seed): the positions (from
  // enumerate) key each image's augmentation, so an image is flipped and cropped the same way
  // whether its batch is split across 1 worker or 8; the seed (Dataset::random) changes each
  // epoch. Stateless: reproducible and resumable.
  auto preprocess = [augment](data::Element e) {
    torch::Tensor images = e[1];
    if (augment) {
      const auto seed = static_cast<std::uint64_t>(e[3].item<std::int64_t>());
      images = data::image::random_flip_left_right(images, seed, e[0]);
      images = data::image::random_crop_with_padding(images, 2, seed ^ 0x5bd1e995u, e[0]);
    }
    return data::Element{data::normalize_images(images), e[2]};
  };
  // With --steps-per-epoch, epochs are step counts over an endless, reshuffled stream (Keras's
  // steps_per_epoch with repeat()); without, an epoch is one pass.
  data::Dataset shuffled = train_source.shuffle(a.shuffle_buffer, a.seed);
  if (a.steps_per_epoch > 0) shuffled = shuffled.repeat();
  // The pipeline's threads share this worker's cores with training, not the whole machine.
  data::Options pipeline_options;
  pipeline_options.private_threadpool_size = threads;
  // Without augmentation there is nothing to key: no positions, no per-epoch seed (enumerate
  // makes a tensor per image, measurable when the pipeline shares the cores with training).
  const data::Dataset batches =
      augment ? data::Dataset::zip({shuffled.enumerate().batch(global_batch, true),
                                    data::Dataset::random(a.seed)})
                    .map(preprocess, data::kAutotune)
              : shuffled.batch(global_batch, true)
                    .map(
                        [](data::Element e) {
                          return data::Element{data::normalize_images(e[0]), e[1]};
                        },
                        data::kAutotune);
  const auto train_set = data::distribute_dataset(
      batches.prefetch(data::kAutotune).with_options(pipeline_options), strategy.input_context());
  const auto test_set =
      data::distribute_dataset(test_source.batch(global_batch)
                                   .map(
                                       [](data::Element e) {
                                         return data::Element{data::normalize_images(e[0]), e[1]};
                                       },
                                       data::kAutotune)
                                   .prefetch(data::kAutotune)
                                   .with_options(pipeline_options),
                               strategy.input_context());
  if (strategy.is_chief()) strategy.log().info("input: " + train_set.plan());

  train::FitOptions fit;
  fit.epochs = a.epochs;
  if (a.steps_per_epoch > 0) fit.steps_per_epoch = a.steps_per_epoch;
  fit.model_dir = a.model_dir;
  if (a.verbose == "auto") {
    const bool terminal = ::isatty(STDOUT_FILENO) || env.get("FLOTILLA_TERMINAL");
    fit.verbose = terminal ? train::Verbosity::kProgressBar : train::Verbosity::kOneLinePerEpoch;
  } else {
    fit.verbose = static_cast<train::Verbosity>(std::stoi(a.verbose));
  }
  fit.on_epoch_end = [&](const train::EpochLogs& logs) {
    if (!write_metrics) return;
    append_json_line(a.metrics_json, {{"epoch", logs.epoch},
                                      {"loss", logs.loss},
                                      {"accuracy", logs.accuracy},
                                      {"samples_per_s", logs.samples_per_s},
                                      {"seconds", logs.seconds},
                                      {"input_bound_share", logs.input_seconds / logs.seconds},
                                      {"steps", logs.steps},
                                      {"comm_seconds", logs.comm_seconds},
                                      {"comm_exposed_seconds", logs.comm_exposed_seconds},
                                      {"comm_hidden_share", logs.comm_hidden_share},
                                      {"workers", strategy.num_workers()},
                                      {"replicas_in_sync", strategy.num_replicas_in_sync()},
                                      {"global_batch", global_batch}});
  };
  model.fit(train_set, fit);

  const train::EvalResult test = model.evaluate(test_set);
  if (strategy.is_chief()) {
    std::printf("Test: loss: %.4f - accuracy: %.4f (%lld samples)\n", test.loss, test.accuracy,
                static_cast<long long>(test.samples));
    std::fflush(stdout);
    if (write_metrics) {
      append_json_line(a.metrics_json, {{"test_loss", test.loss},
                                        {"test_accuracy", test.accuracy},
                                        {"test_samples", test.samples}});
    }
  }
  return kExitOk;
}

} // namespace

Command add_train(CLI::App& parent) {
  auto args = std::make_shared<TrainArgs>();
  CLI::App* app = parent.add_subcommand(
      "train", "Train a built-in model as one worker of the cluster in TF_CONFIG (or alone)");
  app->add_option("--model", args->model, "mlp, mlp-wide or cnn")
      ->check(CLI::IsMember({"mlp", "mlp-wide", "cnn"}))
      ->capture_default_str();
  app->add_option("--dataset", args->dataset, "Dataset name")
      ->check(CLI::IsMember({"fashion-mnist"}))
      ->capture_default_str();
  app->add_option("--data-dir", args->data_dir, "Directory with the dataset's IDX files")
      ->capture_default_str();
  app->add_option("--epochs", args->epochs, "Epochs to train")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app->add_option("--steps-per-epoch", args->steps_per_epoch,
                  "Steps per epoch (0: the whole dataset)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app->add_option("--batch-per-replica", args->batch_per_replica,
                  "Batch per replica; global batch = this x replicas in sync")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app->add_option("--lr", args->lr, "SGD learning rate")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app->add_option("--momentum", args->momentum, "SGD momentum")
      ->check(CLI::Range(0.0, 0.999))
      ->capture_default_str();
  app->add_option("--seed", args->seed, "Seed for initialisation and shuffling")
      ->capture_default_str();
  app->add_option("--model-dir", args->model_dir,
                  "Save a checkpoint here after each epoch (chief; others use temporary dirs)");
  app->add_option("--threads", args->threads,
                  "Intra-op threads per worker (0: cores / workers on this machine)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app->add_option("--metrics-json", args->metrics_json,
                  "Chief appends one JSON object per epoch and one with the test result");
  app->add_option("--timeout", args->timeout_s, "Seconds any rendezvous or collective may take")
      ->check(CLI::Range(0.1, 7 * 86400.0))
      ->capture_default_str();
  app->add_option("--implementation", args->implementation,
                  "Collective implementation: auto, ring or nccl")
      ->check(CLI::IsMember({"auto", "ring", "nccl"}, CLI::ignore_case))
      ->capture_default_str();
  app->add_option("--bytes-per-pack", args->bytes_per_pack, "Gradient bucket size in bytes")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app->add_flag("--no-overlap", args->no_overlap,
                "Start the gradient all-reduces after backward instead of during it");
  app->add_option("--compression", args->compression,
                  "Gradients on the wire: none, fp16 or bf16 (half the bytes)")
      ->check(CLI::IsMember({"none", "fp16", "bf16"}, CLI::ignore_case))
      ->capture_default_str();
  app->add_option("--replicas-per-worker", args->replicas_per_worker,
                  "Model replicas per worker (threads), reduced locally before the all-reduce")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app->add_option("--accumulation-steps", args->accumulation_steps,
                  "Batches whose gradients are summed before one all-reduce and optimizer step")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app->add_option("--shuffle-buffer", args->shuffle_buffer, "Elements in the shuffle buffer")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app->add_option("--cache", args->cache,
                  "Cache the decoded training set: none, memory, or a file path prefix")
      ->capture_default_str();
  app->add_flag("--augment", args->augment,
                "Random flip left-right and random crop (padding 2), seeded per batch");
  app->add_option("--verbose", args->verbose,
                  "auto (bar on a terminal, else a line per epoch), 0, 1 (bar) or 2 (line)")
      ->check(CLI::IsMember({"auto", "0", "1", "2"}))
      ->capture_default_str();
  return {app, [args] { return run(*args); }};
}

} // namespace flotilla::tools
