#include "flotilla/profile/batch_search.h"

#include <malloc.h>

#include <ATen/DeviceAccelerator.h>
#include <c10/util/Exception.h>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <optional>
#include <sstream>

#include "flotilla/error.h"
#include "flotilla/train/mixed_precision.h"
#include "flotilla/train/optimizers.h"

namespace flotilla::profile {

namespace {

// The value of a "Key:   1234 kB" line of a /proc file, in bytes; -1 when absent.
std::int64_t proc_kib_field(const char* path, const std::string& key) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.compare(0, key.size(), key) != 0 || line.size() <= key.size() ||
        line[key.size()] != ':') {
      continue;
    }
    std::istringstream fields(line.substr(key.size() + 1));
    long long kib = -1;
    fields >> kib;
    return kib < 0 ? -1 : kib * 1024;
  }
  return -1;
}

std::int64_t status_field(const char* key) {
  const std::int64_t v = proc_kib_field("/proc/self/status", key);
  if (v < 0) {
    throw ConfigError(std::string("/proc/self/status has no ") + key +
                      " line; measuring a step's peak memory needs Linux's /proc; choose the "
                      "batch per replica yourself (RecipeFacts::batch_per_replica)");
  }
  return v;
}

std::string describe_probe(const Probe& p) {
  std::string s = "batch " + std::to_string(p.batch);
  if (p.result.peak_bytes > 0) s += " (peak " + format_bytes(p.result.peak_bytes) + ")";
  if (!p.result.note.empty()) s += ": " + p.result.note;
  return s;
}

// The pieces of one training step, made fresh for every probe so that no probe inherits
// another's optimizer state or cached buffers.
struct Step {
  ProbeModel net;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  torch::Tensor images, labels;
};

train::OptimizerOptions optimizer_options(const std::string& name) {
  switch (train::parse_optimizer(name)) {
  case train::OptimizerKind::kSGD:
    return train::OptimizerOptions::sgd(0.01, 0.9); // momentum: one buffer per parameter
  case train::OptimizerKind::kAdam:
    return train::OptimizerOptions::adam();
  case train::OptimizerKind::kAdamW:
    return train::OptimizerOptions::adamw();
  }
  return {};
}

void run_step(const StepProbeOptions& o, train::Policy policy, torch::Device device,
              std::int64_t batch) {
  Step s;
  s.net = o.model();
  s.net.module->to(device);
  s.optimizer = train::make_optimizer(optimizer_options(o.optimizer), s.net.module->parameters());
  const auto on = torch::TensorOptions().device(device);
  s.images = torch::rand({batch, 1, 28, 28}, on.dtype(torch::kFloat32));
  s.labels = torch::randint(0, 10, {batch}, on.dtype(torch::kLong));
  torch::Tensor loss;
  {
    train::AutocastGuard autocast(policy, device.type());
    const torch::Tensor logits = s.net.forward(s.images);
    loss = torch::nn::functional::cross_entropy(logits.to(torch::kFloat32), s.labels);
  }
  s.optimizer->zero_grad();
  loss.backward();
  s.optimizer->step();
  if (device.is_cuda()) torch::cuda::synchronize();
}

FitResult cpu_probe(const StepProbeOptions& o, train::Policy policy, std::int64_t batch) {
  // Give back what earlier probes freed, so the peak below is this step's and not a larger
  // earlier step's pages still held by malloc.
  ::malloc_trim(0);
  reset_resident_peak();
  FitResult r;
  try {
    run_step(o, policy, torch::Device(torch::kCPU), batch);
  } catch (const std::bad_alloc&) { // the allocator refused: certainly does not fit
    r.peak_bytes = resident_peak_bytes();
    r.note = "the allocation failed";
    return r;
  } catch (const c10::Error& e) {
    if (std::string(e.what()).find("not enough memory") == std::string::npos) throw;
    r.peak_bytes = resident_peak_bytes();
    r.note = "the allocation failed";
    return r;
  }
  r.peak_bytes = resident_peak_bytes();
  r.fits = r.peak_bytes <= o.memory_budget_bytes;
  if (!r.fits) r.note = "over the " + format_bytes(o.memory_budget_bytes) + " budget";
  return r;
}

// Untested here: no CUDA device on the development machine. The allocator is reached through
// at::accelerator (the device-generic API), so this compiles and links without c10_cuda.
FitResult cuda_probe(const StepProbeOptions& o, train::Policy policy, std::int64_t batch) {
  constexpr auto kAggregate = static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  FitResult r;
  at::accelerator::emptyCache();
  at::accelerator::resetPeakStats(0);
  try {
    run_step(o, policy, torch::Device(torch::kCUDA, 0), batch);
  } catch (const c10::OutOfMemoryError&) {
    // The step's tensors are gone with its scope; hand the cached blocks back too, so the next,
    // smaller probe starts from an empty device rather than a fragmented cache.
    at::accelerator::emptyCache();
    r.fits = false;
    r.note = "out of memory";
    return r;
  }
  r.peak_bytes = at::accelerator::getDeviceStats(0).reserved_bytes[kAggregate].peak;
  r.fits = o.memory_budget_bytes <= 0 || r.peak_bytes <= o.memory_budget_bytes;
  if (!r.fits) r.note = "over the " + format_bytes(o.memory_budget_bytes) + " budget";
  at::accelerator::emptyCache();
  return r;
}

} // namespace

BatchSearchResult search_max_batch(const FitsFn& fits, const BatchSearchOptions& options) {
  if (options.start < 1 || options.max_batch < 1 || options.resolution < 1 ||
      options.max_probes < 1) {
    throw ConfigError("batch search: start " + std::to_string(options.start) + ", max " +
                      std::to_string(options.max_batch) + ", resolution " +
                      std::to_string(options.resolution) + " and max probes " +
                      std::to_string(options.max_probes) + " must all be at least 1");
  }
  BatchSearchResult result;
  std::int64_t lo = 0; // largest seen to fit
  std::int64_t hi = 0; // smallest seen not to fit (0: none yet)
  // Makes one probe unless they are used up; records it and moves the bracket.
  auto probe = [&](std::int64_t batch) -> std::optional<bool> {
    if (static_cast<int>(result.probes.size()) >= options.max_probes) {
      result.out_of_probes = true;
      return std::nullopt;
    }
    Probe p{batch, fits(batch)};
    result.probes.push_back(p);
    if (p.result.fits && batch > lo) {
      lo = batch;
      result.peak_bytes = p.result.peak_bytes;
    } else if (!p.result.fits && (hi == 0 || batch < hi)) {
      hi = batch;
    }
    return p.result.fits;
  };

  // Up: double from the start until something fails or the cap fits.
  std::int64_t b = std::min(options.start, options.max_batch);
  for (;;) {
    const auto ok = probe(b);
    if (!ok || !*ok) break;
    if (b >= options.max_batch) {
      result.capped = true;
      break;
    }
    b = std::min(b * 2, options.max_batch);
  }
  // Down: the start itself did not fit; halve until something does.
  if (lo == 0 && hi != 0) {
    for (b = hi / 2; b >= 1; b /= 2) {
      const auto ok = probe(b);
      if (!ok || *ok) break;
    }
  }
  if (lo == 0) {
    if (result.probes.empty()) throw ConfigError("batch search: no probe was made");
    const Probe& smallest =
        *std::min_element(result.probes.begin(), result.probes.end(),
                          [](const Probe& a, const Probe& c) { return a.batch < c.batch; });
    throw ConfigError(
        std::string(result.out_of_probes ? "no batch was seen to fit within "
                                         : "no batch fits, not even the smallest tried; ") +
        (result.out_of_probes ? std::to_string(options.max_probes) + " probes; " : "") +
        "smallest tried: " + describe_probe(smallest) +
        "; raise the memory budget, or pick a smaller model or precision");
  }
  // Bisect between the last fit and the first failure, on multiples of the resolution.
  const std::int64_t res = options.resolution;
  while (hi != 0 && !result.capped) {
    const std::int64_t next_multiple = (lo / res + 1) * res;
    if (next_multiple >= hi) break;
    const std::int64_t mid = std::max(next_multiple, (lo + (hi - lo) / 2) / res * res);
    if (!probe(mid)) break;
  }
  result.batch = lo;
  result.first_failure = hi;
  return result;
}

FitsFn step_probe(const StepProbeOptions& options) {
  const train::Policy policy = train::parse_policy(options.precision);
  train::parse_optimizer(options.optimizer); // fails now, not at the first probe
  if (!options.model) {
    throw ConfigError("a step probe needs StepProbeOptions::model, the function that builds the "
                      "model to measure");
  }
  options.model(); // fails now, not at the first probe
  if (options.device == "cpu") {
    if (options.memory_budget_bytes <= 0) {
      throw ConfigError("a CPU batch search needs a memory budget; saw " +
                        std::to_string(options.memory_budget_bytes) +
                        " bytes; set StepProbeOptions::memory_budget_bytes, e.g. to 8 GiB");
    }
    return [options, policy](std::int64_t batch) { return cpu_probe(options, policy, batch); };
  }
  if (options.device == "cuda") {
    if (!cuda_available()) {
      throw ConfigError("device \"cuda\": LibTorch sees no CUDA device here; set "
                        "StepProbeOptions::device to \"cpu\"");
    }
    return [options, policy](std::int64_t batch) { return cuda_probe(options, policy, batch); };
  }
  throw ConfigError("device \"" + options.device +
                    "\" is not one a batch search runs on; use "
                    "cpu or cuda");
}

bool cuda_available() {
  return torch::cuda::is_available();
}

std::int64_t resident_peak_bytes() {
  return status_field("VmHWM");
}
std::int64_t resident_bytes() {
  return status_field("VmRSS");
}

void reset_resident_peak() {
  // "5" resets VmHWM to the current resident size (Linux 4.0+, proc(5)).
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  if (!out) {
    throw ConfigError("cannot write /proc/self/clear_refs to reset the resident-memory peak "
                      "(Linux 4.0+ allows it); measure on Linux, or choose the batch per replica "
                      "yourself (RecipeFacts::batch_per_replica)");
  }
}

std::int64_t default_memory_budget(int local_workers, double safety) {
  const std::int64_t available = proc_kib_field("/proc/meminfo", "MemAvailable");
  if (available <= 0) {
    throw ConfigError("/proc/meminfo gives no MemAvailable to size a memory budget from; set "
                      "StepProbeOptions::memory_budget_bytes, e.g. to 8 GiB");
  }
  return static_cast<std::int64_t>(static_cast<double>(available) / std::max(1, local_workers) *
                                   safety);
}

std::int64_t parse_bytes(const std::string& text, const std::string& what) {
  const auto bad = [&] {
    return ConfigError(what + " \"" + text +
                       "\" is not a size; write bytes or a number with a "
                       "unit K, M, G or T (powers of 1024), e.g. 8GiB or 512M");
  };
  std::size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    throw bad();
  }
  std::string unit = text.substr(used);
  unit.erase(
      std::remove_if(unit.begin(), unit.end(), [](unsigned char c) { return std::isspace(c); }),
      unit.end());
  for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  // Memory is sized in powers of 1024 whatever the spelling: "8G", "8GB" and "8GiB" agree.
  double scale = 1;
  if (!unit.empty() && unit != "B") {
    const std::string prefixes = "KMGT";
    const auto at = prefixes.find(unit[0]);
    const std::string rest = unit.substr(1);
    if (at == std::string::npos || !(rest.empty() || rest == "B" || rest == "I" || rest == "IB")) {
      throw bad();
    }
    scale = std::pow(1024.0, static_cast<double>(at + 1));
  }
  const double bytes = value * scale;
  if (!std::isfinite(bytes) || bytes < 1 || bytes > 9.0e18) throw bad();
  return static_cast<std::int64_t>(bytes);
}

std::string format_bytes(std::int64_t n) {
  char buf[64];
  const double b = static_cast<double>(n);
  if (b >= 1024.0 * 1024 * 1024) {
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1024.0 * 1024 * 1024));
  } else if (b >= 1024.0 * 1024) {
    std::snprintf(buf, sizeof buf, "%.1f MiB", b / (1024.0 * 1024));
  } else if (b >= 1024.0) {
    std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024.0);
  } else {
    std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(n));
  }
  return buf;
}

} // namespace flotilla::profile
