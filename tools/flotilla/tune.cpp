// `flotilla tune --max-batch`: the largest per-replica batch of a built-in model that fits, found
// by running real training steps (profile::search_max_batch). On the CPU a step fits when its
// peak resident memory stays within a budget (default: MemAvailable / workers on this machine
// x 0.8); on a CUDA device when it does not run out of device memory. Prints the batch, its
// peak, the budget, the probes, and the `flotilla train --batch-per-replica N` to use with the
// learning rate scaled linearly; --json prints one JSON line instead.
#include <ATen/DeviceAccelerator.h>
#include <torch/torch.h>

#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "flotilla/base/system.h"
#include "flotilla/error.h"
#include "flotilla/profile/batch_search.h"
#include "flotilla/train/mixed_precision.h"
#include "flotilla/train/recipe.h"
#include "models/zoo.h"
#include "tools/flotilla/commands.h"
#include "tools/flotilla/flags.h"

namespace flotilla::tools {
namespace {

struct TuneArgs {
  bool max_batch = false;
  std::string model = "cnn";
  std::string precision = "auto";
  std::string optimizer = "sgd";
  std::string device = "auto";
  std::string memory_budget; // "": MemAvailable / workers_per_machine x safety
  int workers_per_machine = 1;
  double safety = 0.8;
  std::int64_t start = 32;
  std::int64_t max = 65536;
  std::int64_t resolution = 8;
  int max_probes = 32;
  int threads = 0; // 0: cores / workers on this machine, as flotilla train
  double base_lr = 0.02;
  std::int64_t base_batch = 32;
  bool json = false;
};

int run(const TuneArgs& a) {
  if (!a.max_batch) {
    throw ConfigError("flotilla tune: nothing to tune was named; use --max-batch");
  }
  if (a.safety <= 0 || a.safety > 1) {
    throw ConfigError("--safety " + std::to_string(a.safety) + " is not in (0, 1]; use e.g. 0.8");
  }
  const std::string device =
      a.device == "auto" ? (profile::cuda_available() ? "cuda" : "cpu") : a.device;
  // The same choice as flotilla train's (train::choose_precision).
  const std::string precision = train::to_string(
      train::choose_precision(a.precision,
                              torch::Device(device == "cuda" ? torch::kCUDA : torch::kCPU))
          .first);
  const int threads = a.threads > 0
                          ? a.threads
                          : std::max(1, base::available_cores() / std::max(1, a.workers_per_machine));
  torch::set_num_threads(threads);

  profile::StepProbeOptions probe;
  probe.model = [name = a.model] { return profile::probe_model(models::make_model(name)); };
  probe.precision = precision;
  probe.optimizer = a.optimizer;
  probe.device = device;
  std::string budget_source;
  if (!a.memory_budget.empty()) {
    probe.memory_budget_bytes = profile::parse_bytes(a.memory_budget, "--memory-budget");
    budget_source = "--memory-budget";
  } else if (device == "cpu") {
    probe.memory_budget_bytes = profile::default_memory_budget(a.workers_per_machine, a.safety);
    char buf[160];
    std::snprintf(buf, sizeof buf, "MemAvailable / %d worker(s) x %g", a.workers_per_machine,
                  a.safety);
    budget_source = buf;
  } else {
    // An out-of-memory error is the limit; the device's size is reported as the budget. Not yet
    // run on a GPU: none was available where this was written.
    probe.memory_budget_bytes = static_cast<std::int64_t>(at::accelerator::getMemoryInfo(0).second);
    budget_source = "the device's memory";
  }

  profile::BatchSearchOptions search;
  search.start = a.start;
  search.max_batch = a.max;
  search.resolution = a.resolution;
  search.max_probes = a.max_probes;
  const profile::BatchSearchResult result =
      profile::search_max_batch(profile::step_probe(probe), search);

  const double peak_lr =
      a.base_lr * static_cast<double>(result.batch) / static_cast<double>(a.base_batch);
  const std::string suggestion =
      "flotilla train --model " + a.model + " --batch-per-replica " + std::to_string(result.batch);
  if (a.json) {
    nlohmann::ordered_json probes = nlohmann::ordered_json::array();
    for (const auto& p : result.probes) {
      probes.push_back({{"batch", p.batch},
                        {"fits", p.result.fits},
                        {"peak_bytes", p.result.peak_bytes},
                        {"note", p.result.note}});
    }
    const nlohmann::ordered_json line = {{"model", a.model},
                                         {"device", device},
                                         {"precision", precision},
                                         {"optimizer", a.optimizer},
                                         {"threads", threads},
                                         {"max_batch_per_replica", result.batch},
                                         {"peak_bytes", result.peak_bytes},
                                         {"memory_budget_bytes", probe.memory_budget_bytes},
                                         {"budget_source", budget_source},
                                         {"first_failure", result.first_failure},
                                         {"capped", result.capped},
                                         {"out_of_probes", result.out_of_probes},
                                         {"probes", probes},
                                         {"suggested", suggestion},
                                         {"peak_lr_one_replica", peak_lr}};
    std::cout << line.dump() << "\n";
    return kExitOk;
  }
  std::printf("Largest batch per replica that fits: %lld (model %s, %s, %s, %d thread(s))\n",
              static_cast<long long>(result.batch), a.model.c_str(), precision.c_str(),
              device.c_str(), threads);
  if (probe.memory_budget_bytes > 0) {
    std::printf("  peak memory %s of a %s budget (%s)\n",
                profile::format_bytes(result.peak_bytes).c_str(),
                profile::format_bytes(probe.memory_budget_bytes).c_str(), budget_source.c_str());
  } else {
    std::printf("  peak device memory %s (limit: %s)\n",
                profile::format_bytes(result.peak_bytes).c_str(), budget_source.c_str());
  }
  std::string trail;
  for (const auto& p : result.probes) {
    trail +=
        (trail.empty() ? "" : ", ") + std::to_string(p.batch) + (p.result.fits ? " ok" : " no");
  }
  std::printf("  %zu probe(s): %s\n", result.probes.size(), trail.c_str());
  if (result.capped) {
    std::printf("  the cap (--max %lld) fitted: the real limit is higher\n",
                static_cast<long long>(a.max));
  } else if (result.out_of_probes) {
    std::printf("  stopped after --max-probes %d; %lld did not fit\n", a.max_probes,
                static_cast<long long>(result.first_failure));
  } else {
    std::printf("  %lld did not fit\n", static_cast<long long>(result.first_failure));
  }
  std::printf("Suggested: %s\n", suggestion.c_str());
  std::printf("  with --lr-scaling linear (the default) the peak rate follows the global batch: "
              "%g x %lld x replicas / %lld, i.e. %g with one replica\n",
              a.base_lr, static_cast<long long>(result.batch), static_cast<long long>(a.base_batch),
              peak_lr);
  std::fflush(stdout);
  return kExitOk;
}

} // namespace

Command add_tune(CLI::App& parent) {
  auto args = std::make_shared<TuneArgs>();
  CLI::App* app = parent.add_subcommand(
      "tune", "Find the largest batch per replica that fits in memory (--max-batch)");
  app->add_flag("--max-batch", args->max_batch,
                "Search the largest per-replica batch whose training step fits");
  app->add_option("--model", args->model, "mlp, mlp-wide, cnn, resnet20, resnet18 or vit-tiny")
      ->check(CLI::IsMember(models::model_names()))
      ->capture_default_str();
  app->add_option("--precision", args->precision,
                  "auto (as flotilla train decides), float32, mixed_float16 or mixed_bfloat16")
      ->check(CLI::IsMember({"auto", "float32", "mixed_float16", "mixed_bfloat16"}))
      ->capture_default_str();
  app->add_option("--optimizer", args->optimizer, "sgd (momentum), adam or adamw: its state counts")
      ->check(CLI::IsMember({"sgd", "adam", "adamw"}))
      ->capture_default_str();
  app->add_option("--device", args->device, "auto (cuda when LibTorch sees one), cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  app->add_option("--memory-budget", args->memory_budget,
                  "Peak memory one worker may use, e.g. 8GiB (CPU default: MemAvailable / "
                  "--workers-per-machine x --safety; CUDA default: the device's memory)");
  app->add_option("--workers-per-machine", args->workers_per_machine,
                  "Workers that will share this machine's memory and cores")
      ->check(number_in(1, 4096))
      ->capture_default_str();
  app->add_option("--safety", args->safety,
                  "Share of the available memory the default budget allows (the rest is for the "
                  "data set and the input pipeline)")
      ->capture_default_str();
  app->add_option("--start", args->start, "First batch tried")
      ->check(positive_number(1 << 20))
      ->capture_default_str();
  app->add_option("--max", args->max, "Largest batch tried")
      ->check(positive_number(1 << 20))
      ->capture_default_str();
  app->add_option("--resolution", args->resolution, "The answer is a multiple of this")
      ->check(positive_number(1 << 20))
      ->capture_default_str();
  app->add_option("--max-probes", args->max_probes, "Training steps tried at most")
      ->check(number_in(1, 1000))
      ->capture_default_str();
  app->add_option("--threads", args->threads,
                  "Intra-op threads (0: cores / --workers-per-machine, as flotilla train)")
      ->check(non_negative_number(4096))
      ->capture_default_str();
  app->add_option("--base-lr", args->base_lr, "For the suggestion: rate per --base-batch examples")
      ->check(positive_number(1000))
      ->capture_default_str();
  app->add_option("--base-batch", args->base_batch,
                  "For the suggestion: the batch --base-lr is for")
      ->check(positive_number(1 << 30))
      ->capture_default_str();
  app->add_flag("--json", args->json, "One JSON line instead of the text report");
  app->footer("Example: flotilla tune --max-batch --model cnn --memory-budget 4GiB");
  return {app, [args] { return run(*args); }};
}

} // namespace flotilla::tools
