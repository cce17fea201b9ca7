// What a training run measured and how it was set up, in one torch-free record: per-epoch
// values (loss, metrics, learning rate, samples/s) with every worker's step-phase times, and the
// recipe's facts (precision, compiled step, batch, learning-rate scaling, threads,
// communication). The profiler fills it on the chief; the recipe doctor, the HTML report and the
// scaling planner read it. `flotilla train --profile-json FILE` writes it as JSON (schema
// "flotilla.run/1"), which `flotilla plan --profile FILE` and `flotilla doctor` read back.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "flotilla/train/step_phases.h"

namespace flotilla::profile {

// The recipe as this run used it. Unknown numbers are 0, unknown strings empty.
struct RecipeFacts {
  std::string model;          // "cnn", or a user's description
  std::string device = "cpu"; // "cpu", "cuda:0 (NVIDIA H200)"
  int workers = 1;
  int replicas_per_worker = 1;
  std::int64_t batch_per_replica = 0;
  std::int64_t global_batch = 0;
  std::int64_t max_batch_per_replica = 0; // the largest that fits, when searched (flotilla tune)
  std::int64_t memory_budget_bytes = 0;   // per worker, what that search allowed
  std::int64_t peak_memory_bytes = 0;     // this worker's peak resident memory (chief's)
  std::string precision = "float32";      // float32, mixed_float16, mixed_bfloat16
  bool hardware_bf16 = false;             // computes bfloat16 natively (AVX512-BF16/AMX; sm_80+)
  bool hardware_fp16 = false;             // fast float16 (CUDA tensor cores)
  bool loss_scaling = false;
  bool jit_compile = false;             // requested
  bool compiled_step_available = false; // a compiled (CUDA-graph) step exists on this device
  std::string optimizer;                // its description
  double base_lr = 0;                   // per base_batch examples (0: not given)
  std::int64_t base_batch = 0;
  std::string lr_scaling; // "linear", "none", "as given"
  double peak_lr = 0;
  std::string schedule; // "cosine", "constant", a description
  std::int64_t warmup_steps = 0;
  std::int64_t total_steps = 0; // optimizer updates planned
  int threads_per_worker = 0;
  int cores = 0;                   // this machine's, for this process
  int local_workers = 1;           // workers on the chief's machine
  std::int64_t parameters = 0;     // trainable elements
  std::int64_t gradient_bytes = 0; // per all-reduce step, as sent (after compression)
  // Each trainable parameter's gradient bytes (its own dtype), in the order backward fills the
  // buckets (reverse registration): the planner packs them as the gradient engine does.
  std::vector<std::int64_t> gradient_layout;
  // Each one's kind (dtype@device, strategy::gradient_kind): a bucket holds one kind only.
  std::vector<std::string> gradient_kinds;
  std::int64_t bytes_per_pack = 0;
  int buckets = 0;
  bool overlap = true;
  std::string compression = "none";
  std::string input_pipeline; // the input's plan
  // Training FLOPs per sample (forward and backward; 0: not counted): `flotilla train` counts a
  // forward pass's products (profile::counted_flops) and takes 3x it, the usual rule (the
  // backward pass computes two products for each of the forward's).
  double train_flops_per_sample = 0;
  // One worker's matrix-product rate at the run's compute precision with its threads, GFLOP/s
  // (profile::matmul_peak_gflops; measured at the end of fit on the CPU; 0: not measured).
  double matmul_peak_gflops = 0;
  // How each global batch divides among the workers: "equal", "auto" (by measured speed), or
  // fixed weights "2,1" (`--shares`).
  std::string shares = "equal";
  // Why each global batch cannot be divided by speed on this fit (train::why_no_shares_by_speed:
  // CUDA replicas, per-replica elastic batches, an input not sharded by DATA); empty where it can.
  std::string shares_refused;
};

struct EpochSummary {
  int epoch = 0; // 1-based
  std::int64_t steps = 0;
  double seconds = 0;
  double samples_per_s = 0;
  std::vector<std::pair<std::string, double>> values; // loss, metrics, learning_rate, val_...
  std::vector<train::PhaseTimes> workers;             // each worker's, in rank order
  // The value of `key`, NaN if absent.
  double value(const std::string& key) const;
};

struct RunSummary {
  std::string command; // how the run was started, for the report's header
  std::string started; // ISO 8601, UTC
  RecipeFacts recipe;
  std::vector<EpochSummary> epochs;
  // Every worker's phases over all epochs (the last epoch alone when there were several,
  // so start-up does not count): what the doctor and the planner use.
  std::vector<train::PhaseTimes> steady_phases() const;
};

nlohmann::json to_json(const RunSummary& summary);
// ConfigError naming the field and the file when something is missing or of the wrong type.
RunSummary run_summary_from_json(const nlohmann::json& json, const std::string& where);
// Atomic write (temporary file, then rename) and read.
void write_run_summary(const std::filesystem::path& path, const RunSummary& summary);
RunSummary read_run_summary(const std::filesystem::path& path);

} // namespace flotilla::profile
