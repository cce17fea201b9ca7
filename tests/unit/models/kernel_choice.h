// The fused layers' tests run each kernel this CPU has: KernelChoice<name, use> lists them and
// switches to one for a scope, then back to the one chosen before.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace flotilla::models {

template <const char* (*Name)(), bool (*Use)(const std::string&)> struct KernelChoice {
  // The kernels this CPU runs ("avx512", "avx2"), leaving the one chosen as it was.
  static std::vector<std::string> runnable() {
    const std::string before = Name();
    std::vector<std::string> names;
    for (const char* name : {"avx512", "avx2"}) {
      if (Use(name)) names.push_back(name);
    }
    Use(before);
    return names;
  }
  explicit KernelChoice(const std::string& name) : before(Name()) {
    EXPECT_TRUE(Use(name)) << name;
  }
  ~KernelChoice() { Use(before); }
  std::string before;
};

} // namespace flotilla::models
