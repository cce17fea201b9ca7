// Training throughput of flotilla's fit() on one device, for the GPU comparison against PyTorch
// (bench/gpu/torch_peer.py trains the same layers on the same kind of batches). The input is a
// few random batches already on the device, repeated without end: the benchmark measures the
// training step (forward, backward, all-reduce, optimizer, loss bookkeeping), not a data
// pipeline or host-to-device copies. Timing: after `warmup` steps the device is synchronised
// and the clock starts; after `steps` more it is synchronised again. The chief prints one JSON
// line. Under `flotilla launch --workers N` every worker trains on its own per-replica batch.
//
//   gpu_train_bench --model cnn --batch 256 --precision mixed_bfloat16 [--jit-compile]
//       [--devices cuda:0] [--steps 200] [--warmup 50] [--optimizer sgd|adam]
//       [--implementation auto|ring|nccl] [--steps-per-execution 50]
//
// On a machine without a GPU, `--devices cpu --steps 5 --warmup 2` checks it end to end.
#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "flotilla/cluster/cluster_token.h"
#include "flotilla/cluster/resolvers.h"
#include "flotilla/data/distribute.h"
#include "flotilla/error.h"
#include "flotilla/strategy/strategy.h"
#include "flotilla/train/callbacks.h"
#include "flotilla/train/model.h"
#include "models/zoo.h"

namespace {

using namespace flotilla;
using Clock = std::chrono::steady_clock;

struct Args {
  std::string model = "cnn";
  std::int64_t batch = 256;
  std::string precision = "float32";
  bool jit_compile = false;
  std::string channels_last = "auto"; // CompileOptions::channels_last: auto (unset), on, off
  std::string devices = "cuda:0";
  std::int64_t steps = 200;
  std::int64_t warmup = 50;
  std::string optimizer = "sgd";
  std::string implementation = "auto";
  int steps_per_execution = 50;
  int distinct_batches = 8;
  std::uint64_t seed = 42;
  double timeout_s = 120;
};

void synchronize(const torch::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

// Starts the clock at the first step at or after the warmup (fit() calls batch hooks only every
// steps_per_execution steps, so the warmup is a multiple of it) and stops it after the last step.
class StepTimer : public train::Callback {
 public:
  StepTimer(torch::Device device, std::int64_t first_timed, std::int64_t last)
      : device_(device), first_timed_(first_timed), last_(last) {}
  void on_train_batch_begin(std::int64_t batch) override {
    if (batch != first_timed_) return;
    synchronize(device_);
    start_ = Clock::now();
  }
  void on_train_batch_end(std::int64_t batch, const train::Logs&) override {
    if (batch != last_) return;
    synchronize(device_);
    end_ = Clock::now();
  }
  // ConfigError when the hooks did not fire where expected (the timing would be wrong).
  double seconds() const {
    if (!start_ || !end_) {
      throw ConfigError("the step timer did not see steps " + std::to_string(first_timed_) +
                        " and " + std::to_string(last_) + "; fit() ran fewer steps than asked");
    }
    return std::chrono::duration<double>(*end_ - *start_).count();
  }

 private:
  torch::Device device_;
  std::int64_t first_timed_, last_;
  std::optional<Clock::time_point> start_, end_;
};

int run(const Args& a) {
  const auto env = cluster::Environment::from_process();
  const cluster::ClusterSpec spec = cluster::resolve_cluster(env);
  const std::vector<torch::Device> devices = strategy::parse_devices(a.devices);
  if (devices.size() != 1) {
    throw ConfigError("--devices \"" + a.devices + "\" names " + std::to_string(devices.size()) +
                      " devices; this benchmark trains one replica per process: name one");
  }
  const torch::Device device = devices.front();
  const train::Policy policy = train::parse_policy(a.precision);
  const train::OptimizerKind kind = train::parse_optimizer(a.optimizer);
  if (a.batch < 1 || a.steps < 1 || a.warmup < 0 || a.steps_per_execution < 1) {
    throw ConfigError("--batch and --steps must be at least 1, --warmup at least 0, "
                      "--steps-per-execution at least 1");
  }
  // fit() calls batch hooks every steps_per_execution steps: the warmup must end on one. A short
  // warmup (a CPU check) lowers steps_per_execution to it rather than growing the warmup.
  int every = a.steps_per_execution;
  if (a.warmup > 0 && a.warmup < every) every = static_cast<int>(a.warmup);
  const std::int64_t warmup = (a.warmup + every - 1) / every * every;

  collective::CommunicationOptions comm;
  comm.implementation = collective::parse_implementation(a.implementation);
  comm.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(a.timeout_s * 1000));
  comm.cluster_token = cluster::cluster_token(env); // set by `flotilla launch`
  std::optional<strategy::MultiWorkerMirroredStrategy> multi;
  std::optional<strategy::MirroredStrategy> single;
  if (spec.world_size > 1) {
    multi.emplace(spec, comm, devices);
  } else {
    single.emplace(devices, comm);
  }
  strategy::Strategy& strategy = multi ? static_cast<strategy::Strategy&>(*multi) : *single;

  torch::manual_seed(a.seed + static_cast<std::uint64_t>(strategy.worker_index()));
  // A few distinct batches, so the step does not see the very same input every time; resident
  // on the device, so no step waits for a copy.
  const auto on_device = torch::TensorOptions().device(device);
  const torch::Tensor images =
      torch::randn({a.distinct_batches, a.batch, 1, 28, 28}, on_device.dtype(torch::kFloat32));
  const torch::Tensor labels =
      torch::randint(0, 10, {a.distinct_batches, a.batch}, on_device.dtype(torch::kInt64));
  // Each worker builds its own pipeline of per-replica batches (nothing to shard or rewrite);
  // slicing a device tensor is a view, so the pipeline costs a few host operations per step.
  const auto train_set = data::distribute_datasets_from_function(
      [&](const strategy::InputContext&) {
        return data::Dataset::from_tensor_slices({images, labels}).repeat();
      },
      strategy.input_context());

  train::set_global_policy(policy);
  auto net = strategy.scope([&] { return models::make_model(a.model); });
  train::Model model(strategy, net);
  train::CompileOptions compile;
  // Matches torch_peer.py: SGD(lr=0.01, momentum=0.9); Adam(lr=1e-3, eps=1e-7);
  // AdamW(lr=1e-3, eps=1e-7, weight_decay=0.004).
  switch (kind) {
  case train::OptimizerKind::kSGD:
    compile.optimizer = train::OptimizerOptions::sgd(0.01, 0.9);
    break;
  case train::OptimizerKind::kAdam:
    compile.optimizer = train::OptimizerOptions::adam(0.001);
    break;
  case train::OptimizerKind::kAdamW:
    compile.optimizer = train::OptimizerOptions::adamw();
    break;
  }
  // The PyTorch loop computes no accuracy either: only the loss, which fit() always reports.
  compile.metrics = {};
  compile.jit_compile = a.jit_compile;
  if (a.channels_last != "auto") compile.channels_last = a.channels_last == "on";
  compile.steps_per_execution = every;
  model.compile(compile);

  auto timer = std::make_shared<StepTimer>(device, warmup, warmup + a.steps - 1);
  train::FitOptions fit;
  fit.epochs = 1;
  fit.steps_per_epoch = warmup + a.steps;
  fit.verbose = train::Verbosity::kSilent;
  fit.callbacks = {timer};
  model.fit(train_set, fit);
  const double seconds = timer->seconds();

  // A sanity figure, the same as torch_peer.py's: the loss on the first batch after training.
  const torch::Tensor logits = model.predict(images[0]);
  const double final_loss =
      torch::nn::functional::cross_entropy(logits.to(torch::kFloat32), labels[0]).item<double>();

  if (strategy.is_chief()) {
    const double samples = static_cast<double>(a.steps * a.batch * strategy.num_replicas_in_sync());
    const nlohmann::ordered_json line = {
        {"bench", "gpu_train"},
        {"impl", "flotilla"},
        {"model", a.model},
        {"batch", a.batch},
        {"precision", train::to_string(policy)},
        {"cuda_graph", a.jit_compile && device.is_cuda()},
        {"memory_format", model.channels_last() ? "channels_last" : "nchw"},
        {"workers", strategy.num_workers()},
        {"samples_per_s", samples / seconds},
        {"step_ms", seconds * 1000 / static_cast<double>(a.steps)},
        {"final_loss", final_loss},
        {"device", device.str()},
        {"optimizer", a.optimizer},
        {"implementation", std::string(collective::to_string(comm.implementation))},
        {"steps", a.steps},
        {"warmup", warmup},
        {"steps_per_execution", every},
    };
    std::printf("%s\n", line.dump().c_str());
    std::fflush(stdout);
  }
  return kExitOk;
}

} // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"flotilla training throughput on one device (bench/gpu)"};
  app.name("gpu_train_bench");
  app.add_option("--model", a.model, "a model of the zoo (models/zoo.h)")
      ->check(CLI::IsMember(models::model_names()))
      ->capture_default_str();
  app.add_option("--batch", a.batch, "Per-replica batch")->capture_default_str();
  app.add_option("--precision", a.precision, "float32, mixed_bfloat16 or mixed_float16")
      ->check(CLI::IsMember({"float32", "mixed_bfloat16", "mixed_float16"}))
      ->capture_default_str();
  app.add_flag("--jit-compile", a.jit_compile, "Capture the step as a CUDA graph");
  app.add_option("--channels-last", a.channels_last,
                 "auto (on for models with 2-D convolutions), on or off")
      ->check(CLI::IsMember({"auto", "on", "off"}))
      ->capture_default_str();
  app.add_option("--devices", a.devices, "One device: cuda:0, cpu")->capture_default_str();
  app.add_option("--steps", a.steps, "Timed steps")->capture_default_str();
  app.add_option("--warmup", a.warmup,
                 "Untimed steps first (rounded up to a multiple of --steps-per-execution)")
      ->capture_default_str();
  app.add_option("--optimizer", a.optimizer, "sgd (lr 0.01, momentum 0.9), adam, adamw")
      ->check(CLI::IsMember({"sgd", "adam", "adamw"}))
      ->capture_default_str();
  app.add_option("--implementation", a.implementation,
                 "Collectives: auto (NCCL for CUDA tensors), ring (Gloo), nccl")
      ->check(CLI::IsMember({"auto", "ring", "nccl"}, CLI::ignore_case))
      ->capture_default_str();
  app.add_option("--steps-per-execution", a.steps_per_execution,
                 "Steps between host reads of the logs")
      ->capture_default_str();
  app.add_option("--distinct-batches", a.distinct_batches, "Random batches kept on the device")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--seed", a.seed, "Seed of the weights and batches")->capture_default_str();
  app.add_option("--timeout", a.timeout_s, "Seconds any collective may take")
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "gpu_train_bench: error: " << e.what() << " (see --help)\n";
    return kExitBadInput;
  }
  try {
    return run(a);
  } catch (const c10::Error& e) { // LibTorch's own: its message, not its backtrace
    std::cerr << "gpu_train_bench: error: " << e.what_without_backtrace() << "\n";
    return kExitFailure;
  } catch (const std::exception& e) {
    std::cerr << "gpu_train_bench: error: " << e.what() << "\n";
    return exit_code(e);
  }
}
