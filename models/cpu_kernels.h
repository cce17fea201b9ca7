// flotilla's own CPU kernels (the fused layers ConvMaxPool2ReLU and batch_norm_relu) are built
// once per instruction set; these choose which one a layer runs.
#pragma once

#include <string>

namespace flotilla::models {

// Whether this build has kernels for `isa` ("avx512": x86-64-v4; "avx2": x86-64-v3, with FMA)
// and this CPU runs them. "none" (ATen's operations instead) is always true.
bool cpu_runs(const std::string& isa);

// The best this CPU runs: "avx512", "avx2", or "none" where it runs neither.
std::string best_cpu_kernel();

// What the environment variable `variable` names (avx512, avx2 or none), or where it is unset
// the best this CPU runs ("none" where it runs neither). ConfigError for another value or for
// one this CPU does not run.
std::string cpu_kernel_from_environment(const char* variable);

} // namespace flotilla::models
