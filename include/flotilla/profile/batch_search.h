// The largest per-replica batch that fits: the recipe's "batch size as large as memory allows",
// found by trying. search_max_batch() doubles the batch until a probe fails, then bisects
// between the last batch that fit and the first that did not, to a resolution (multiples of 8
// by default), within a bounded number of probes; it never returns a batch that was not seen to
// fit. The probes are real training steps of a built-in model: on the CPU the step's peak
// resident memory (VmHWM) against a memory budget, on CUDA the step itself, an out-of-memory
// error meaning "does not fit". `flotilla tune --max-batch` and `flotilla doctor --max-batch`
// run it.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace flotilla::profile {

// One probe's outcome.
struct FitResult {
  bool fits = false;
  std::int64_t peak_bytes = 0; // the peak the probe measured (0: not measured)
  std::string note;            // why it did not fit, for the report ("out of memory", ...)
};
using FitsFn = std::function<FitResult(std::int64_t batch)>;

struct BatchSearchOptions {
  std::int64_t start = 32;        // the first batch tried
  std::int64_t max_batch = 65536; // never tried beyond: ends the search on a machine with lots
                                  // of memory
  std::int64_t resolution = 8;    // bisection tries only multiples of this and stops when no
                                  // multiple lies between the last fit and the first failure
  int max_probes = 32;            // at most this many calls of the predicate (a 65536 cap at
                                  // resolution 1 needs 27)
};

struct Probe {
  std::int64_t batch = 0;
  FitResult result;
};

struct BatchSearchResult {
  std::int64_t batch = 0;         // the largest batch seen to fit
  std::int64_t peak_bytes = 0;    // its peak
  std::int64_t first_failure = 0; // the smallest batch seen not to fit (0: none failed)
  bool capped = false;            // max_batch fitted: the real limit is higher
  bool out_of_probes = false;     // max_probes ran out before the bracket closed
  std::vector<Probe> probes;      // in the order made
};

// ConfigError when options are inconsistent, or when nothing fits (not even batch 1): the
// message names the smallest batch tried and its peak.
BatchSearchResult search_max_batch(const FitsFn& fits, const BatchSearchOptions& options = {});

// The model a step probe measures: a module and its forward ([N, 1, 28, 28] images to [N, 10]
// logits). probe_model(holder) makes one from a module holder (torch::nn::Sequential, ...).
struct ProbeModel {
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor(const at::Tensor&)> forward;
};
template <class Holder> ProbeModel probe_model(Holder holder) {
  auto module = holder.ptr();
  return {module, [module](const at::Tensor& images) { return module->forward(images); }};
}

// A training step of the caller's model on Fashion-MNIST-shaped random input (N x 1 x 28 x 28,
// 10 classes): forward, loss, backward and an optimizer update.
struct StepProbeOptions {
  // Builds the model, afresh for each probe (no probe inherits another's optimizer state or
  // cached buffers); its forward takes [N, 1, 28, 28] images and returns [N, 10] logits.
  std::function<ProbeModel()> model;
  std::string precision = "float32"; // float32, mixed_float16, mixed_bfloat16
  std::string optimizer = "sgd";     // sgd (momentum 0.9), adam, adamw: their state counts too
  std::string device = "cpu";        // "cpu" or "cuda" (device 0)
  // CPU: a probe fits when the step's peak resident memory is at most this. CUDA: 0 means the
  // device's own memory is the limit (an out-of-memory error), else the allocator's peak must
  // also be at most this.
  std::int64_t memory_budget_bytes = 0;
};

// The predicate for search_max_batch. CPU: resets the process's resident high-water mark
// (/proc/self/clear_refs), runs one step, reads VmHWM: the process's real peak, libraries and
// all, as a training process of the same model would have it (less the data set and the
// pipeline's buffers, which the budget's safety factor is for). CUDA: runs one step; an
// out-of-memory error is "does not fit", after which the allocator's cached blocks are released.
// ConfigError for a missing model, an unknown precision or device, or a CPU probe without a
// budget; what building the model throws, as it is.
FitsFn step_probe(const StepProbeOptions& options);

// Whether LibTorch sees a CUDA device.
bool cuda_available();

// This process's resident peak (VmHWM) and current resident size (VmRSS), in bytes, from
// /proc/self/status; and the reset of the peak to the current size.
std::int64_t resident_peak_bytes();
std::int64_t resident_bytes();
void reset_resident_peak();

// The default CPU memory budget per worker: MemAvailable (/proc/meminfo) / local_workers x
// safety. ConfigError when /proc/meminfo cannot be read.
std::int64_t default_memory_budget(int local_workers, double safety = 0.8);

// "8GiB", "512MiB", "1.5G", "300MB", "123456" (bytes) -> bytes. K, M, G and T are powers of 1024
// however spelt ("8G" = "8GB" = "8GiB"): memory is sized that way. ConfigError naming `what`
// for anything else.
std::int64_t parse_bytes(const std::string& text, const std::string& what);
// "1.50 GiB", "320.0 MiB", ...
std::string format_bytes(std::int64_t bytes);

} // namespace flotilla::profile
