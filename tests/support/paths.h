// Test support: where the programs under test are, found from the test executable's own path
// (build/tests/<suite>), so no absolute path is compiled in and a fresh clone's build hits
// ccache.
#pragma once

#include <unistd.h>

#include <string>

namespace flotilla::testing {

inline std::string test_bin_dir() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  std::string exe(buf, n > 0 ? static_cast<std::size_t>(n) : 0);
  return exe.substr(0, exe.rfind('/'));
}

inline std::string flotilla_cli() {
  return test_bin_dir() + "/../flotilla";
}
// The project venv's Python (linked here by CMake), which has safetensors for interop tests.
inline std::string test_python() {
  return test_bin_dir() + "/python";
}

} // namespace flotilla::testing
