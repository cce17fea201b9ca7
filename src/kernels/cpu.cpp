#include "kernels/cpu.h"

#include <cstdlib>

#include "flotilla/error.h"

namespace flotilla::kernels {

bool cpu_runs(const std::string& isa) {
  if (isa == "none") return true;
#if defined(FLOTILLA_CPU_KERNELS)
  __builtin_cpu_init();
  if (isa == "avx512") return __builtin_cpu_supports("x86-64-v4");
  if (isa == "avx512bf16") {
    return __builtin_cpu_supports("x86-64-v4") && __builtin_cpu_supports("avx512bf16");
  }
  if (isa == "avx2") return __builtin_cpu_supports("x86-64-v3");
#endif
  return false;
}

std::string best_cpu_kernel() {
  for (const char* isa : {"avx512", "avx2"}) {
    if (cpu_runs(isa)) return isa;
  }
  return "none";
}

std::string cpu_kernel_from_environment(const char* variable) {
  const char* env = std::getenv(variable);
  if (env == nullptr || *env == '\0') return best_cpu_kernel();
  const std::string name = env;
  if (name != "avx512" && name != "avx2" && name != "none") {
    throw ConfigError(std::string(variable) + " is '" + name +
                      "'; use avx512, avx2 or none (ATen's ops), or unset it for the best this "
                      "CPU runs");
  }
  if (!cpu_runs(name)) {
    throw ConfigError(std::string(variable) + " is '" + name +
                      "', which this CPU does not run (it lacks the instructions); use a lesser "
                      "one or none, or unset it");
  }
  return name;
}

} // namespace flotilla::kernels
