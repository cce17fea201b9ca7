#include "flotilla/train/mixed_precision.h"

#include <ATen/cpu/Utils.h>

#include <ATen/autocast_mode.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/DeviceGuard.h>
#include <torch/cuda.h>

#include <atomic>

#include "flotilla/error.h"

namespace flotilla::train {
namespace {
// Keras's global policy: the one process-wide setting (design.md allows it for this object).
std::atomic<Policy> g_policy{Policy::kFloat32};
} // namespace

Policy parse_policy(const std::string& name) {
  if (name == "float32") return Policy::kFloat32;
  if (name == "mixed_float16") return Policy::kMixedFloat16;
  if (name == "mixed_bfloat16") return Policy::kMixedBFloat16;
  throw ConfigError("precision policy \"" + name +
                    "\" is not available; use float32, mixed_float16 or mixed_bfloat16");
}

std::string to_string(Policy policy) {
  switch (policy) {
  case Policy::kFloat32:
    return "float32";
  case Policy::kMixedFloat16:
    return "mixed_float16";
  case Policy::kMixedBFloat16:
    return "mixed_bfloat16";
  }
  return "unknown";
}

void set_global_policy(Policy policy) {
  g_policy = policy;
}
void set_global_policy(const std::string& name) {
  g_policy = parse_policy(name);
}
Policy global_policy() {
  return g_policy;
}

torch::ScalarType compute_dtype(Policy policy) {
  switch (policy) {
  case Policy::kMixedFloat16:
    return torch::kFloat16;
  case Policy::kMixedBFloat16:
    return torch::kBFloat16;
  default:
    return torch::kFloat32;
  }
}

AutocastGuard::AutocastGuard(Policy policy, torch::DeviceType device) : device_(device) {
  if (policy == Policy::kFloat32) return;
  active_ = true;
  was_enabled_ = at::autocast::is_autocast_enabled(device);
  previous_dtype_ = at::autocast::get_autocast_dtype(device);
  at::autocast::set_autocast_enabled(device, true);
  at::autocast::set_autocast_dtype(device, compute_dtype(policy));
  at::autocast::increment_nesting();
}

AutocastGuard::~AutocastGuard() {
  if (!active_) return;
  // Leaving the outermost region frees the casts of the weights it cached.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(device_, was_enabled_);
  at::autocast::set_autocast_dtype(device_, previous_dtype_);
}

LossScale::LossScale(const LossScaleOptions& options)
    : options_(options), scale_(options.initial_scale) {
  if (!(options.initial_scale > 0)) {
    throw ConfigError("the initial loss scale must be positive; saw " +
                      std::to_string(options.initial_scale));
  }
  if (options.growth_interval < 1) {
    throw ConfigError("the loss scale's growth_interval must be at least 1; saw " +
                      std::to_string(options.growth_interval));
  }
}

bool LossScale::update(bool finite) {
  if (!finite) {
    // A fixed scale still skips the step: its gradients are unusable either way.
    if (options_.dynamic) scale_ = std::max(1.0, scale_ / 2);
    good_steps_ = 0;
    return false;
  }
  if (options_.dynamic && ++good_steps_ >= options_.growth_interval) {
    scale_ *= 2;
    good_steps_ = 0;
  }
  return true;
}

void LossScale::restore(double scale, std::int64_t good_steps) {
  scale_ = scale;
  good_steps_ = good_steps;
}

bool cpu_has_native_bf16() {
  const auto caps = at::cpu::get_cpu_capabilities();
  for (const char* key : {"avx512_bf16", "amx_bf16"}) {
    auto it = caps.find(key);
    if (it != caps.end() && it->second.isBool() && it->second.toBool()) return true;
  }
  return false;
}

bool cuda_has_native_bf16(int index) {
  if (!torch::cuda::is_available() || index < 0 ||
      index >= static_cast<int>(torch::cuda::device_count())) {
    return false;
  }
  // The hooks answer for the current device: cuDNN 8+ and compute capability 8.0+.
  const c10::DeviceGuard guard(torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index)));
  return at::detail::getCUDAHooks().supportsBFloat16ConvolutionWithCuDNNv8();
}

Policy fastest_policy(const torch::Device& device) {
  if (device.is_cuda()) {
    return cuda_has_native_bf16(device.has_index() ? device.index() : 0) ? Policy::kMixedBFloat16
                                                                         : Policy::kMixedFloat16;
  }
  return cpu_has_native_bf16() ? Policy::kMixedBFloat16 : Policy::kFloat32;
}

} // namespace flotilla::train
