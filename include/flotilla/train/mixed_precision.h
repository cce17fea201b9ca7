// Keras's mixed precision: a global policy (float32, mixed_float16, mixed_bfloat16) under which
// variables stay float32 while the forward pass computes in the policy's dtype (LibTorch
// autocast: bfloat16 on CPU; float16 or bfloat16 on CUDA), and a dynamic loss scale that keeps
// float16 gradients from underflowing. The policy is the one process-wide setting, as in Keras:
// set it before compile(); compile() reads it.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <string>

namespace flotilla::train {

enum class Policy { kFloat32, kMixedFloat16, kMixedBFloat16 };

// "float32", "mixed_float16", "mixed_bfloat16"; ConfigError otherwise.
Policy parse_policy(const std::string& name);
std::string to_string(Policy policy);
void set_global_policy(Policy policy);
void set_global_policy(const std::string& name);
Policy global_policy();
// The dtype the forward pass computes in (float32 for the float32 policy).
torch::ScalarType compute_dtype(Policy policy);
// Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX): only then does
// mixed_bfloat16 make a CPU step faster rather than slower.
bool cpu_has_native_bf16();
// Whether CUDA device `index` computes bfloat16 natively (compute capability 8.0 or newer: A100,
// H100, H200); there mixed_bfloat16 is the GPU's mixed precision and needs no loss scaling.
// False where no such device is visible.
bool cuda_has_native_bf16(int index = 0);
// The mixed precision that helps on `device`: mixed_bfloat16 where it computes bfloat16
// natively, mixed_float16 (with loss scaling) on older GPUs, float32 on other CPUs.
Policy fastest_policy(const torch::Device& device);

// Autocast on this thread for `device` while alive (autocast state is per thread: each replica's
// thread makes its own). Does nothing under the float32 policy.
class AutocastGuard {
 public:
  AutocastGuard(Policy policy, torch::DeviceType device);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  bool active_ = false;
  torch::DeviceType device_;
  bool was_enabled_ = false;
  torch::ScalarType previous_dtype_ = torch::kFloat32;
};

// Keras's LossScaleOptimizer settings.
struct LossScaleOptions {
  bool dynamic = true;
  double initial_scale = 32768; // 2^15
  std::int64_t growth_interval = 2000; // finite steps before the scale doubles
};

// The dynamic loss scale: multiply the loss by scale() before backward, divide the gradients by
// it after the all-reduce, and report whether they were all finite. A non-finite step is
// skipped and halves the scale; `growth_interval` finite steps in a row double it. The decision
// is taken on the all-reduced gradients, which are the same on every worker, so every worker
// skips the same steps without another collective.
class LossScale {
 public:
  explicit LossScale(const LossScaleOptions& options = {});
  double scale() const { return scale_; }
  std::int64_t good_steps() const { return good_steps_; }
  // After a step: true to apply it, false to skip it.
  bool update(bool finite);
  // For checkpoints.
  void restore(double scale, std::int64_t good_steps);
  const LossScaleOptions& options() const { return options_; }

 private:
  LossScaleOptions options_;
  double scale_;
  std::int64_t good_steps_ = 0;
};

} // namespace flotilla::train
