// flotilla's own CPU kernels (the fused layers ConvMaxPool2ReLU and batch_norm_relu) are built
// once per instruction set; these choose which one a layer runs.
#pragma once

#include <atomic>
#include <string>

namespace flotilla::kernels {

// Whether this build has kernels for `isa` ("avx512": x86-64-v4; "avx512bf16": that and
// AVX512_BF16; "avx2": x86-64-v3, with FMA) and this CPU runs them. "none" (ATen's operations
// instead) is always true.
bool cpu_runs(const std::string& isa);

// The best this CPU runs: "avx512", "avx2", or "none" where it runs neither.
std::string best_cpu_kernel();

// What the environment variable `variable` names (avx512, avx2 or none), or where it is unset
// the best this CPU runs ("none" where it runs neither). ConfigError for another value or for
// one this CPU does not run.
std::string cpu_kernel_from_environment(const char* variable);

// Which of one fused layer's kernels runs: at the first use, what `variable` names or the best
// this CPU runs; from then on what use() chose (tests and benchmarks switch between them).
// `Kernel` is the layer's per-instruction-set table (kAvx512, kAvx2).
template <class Kernel> class CpuKernelChoice {
 public:
  CpuKernelChoice(const char* variable, const Kernel& avx512, const Kernel& avx2)
      : entries_{{"avx512", cpu_runs("avx512") ? &avx512 : nullptr},
                 {"avx2", cpu_runs("avx2") ? &avx2 : nullptr},
                 {"none", nullptr}} {
    use(cpu_kernel_from_environment(variable));
  }
  // The kernel chosen, or null for ATen's operations ("none").
  const Kernel* kernel() const { return chosen_.load()->kernel; }
  const char* name() const { return chosen_.load()->name; }
  // For a backward: the kernel chosen, or (chosen "none" since its forward ran one) the best
  // this CPU runs. Each layer's kernels agree to the bit whatever the instruction set.
  const Kernel& kernel_for_backward() const {
    if (const Kernel* k = kernel()) return *k;
    return *(entries_[0].kernel ? entries_[0].kernel : entries_[1].kernel);
  }
  // False, and nothing changes, where `name` is unknown or this CPU lacks it.
  bool use(const std::string& name) {
    for (const Entry& e : entries_) {
      if (name == e.name && (e.kernel != nullptr || name == "none")) {
        chosen_.store(&e);
        return true;
      }
    }
    return false;
  }

 private:
  struct Entry {
    const char* name;
    const Kernel* kernel;
  };
  const Entry entries_[3];
  std::atomic<const Entry*> chosen_{&entries_[2]};
};

} // namespace flotilla::kernels
