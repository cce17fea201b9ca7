// Test support: what the real TensorBoard reads from a log directory (EventAccumulator, through
// tests/unit/train/read_events.py and the test venv's Python).
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "support/paths.h"
#include "support/subprocess.h"

namespace flotilla::testing {

// The source tree, from the build's CMakeCache.txt (tests compile in no absolute path).
inline std::string source_dir() {
  std::ifstream cache(test_bin_dir() + "/../CMakeCache.txt");
  const std::string key = "CMAKE_HOME_DIRECTORY:INTERNAL=";
  for (std::string line; std::getline(cache, line);) {
    if (line.rfind(key, 0) == 0) return line.substr(key.size());
  }
  return "";
}

inline bool tensorboard_installed() {
  return run_process({test_python(), "-c",
                      "from tensorboard.backend.event_processing import event_accumulator"})
             .exit_code == 0;
}

// {"file_version", "first_event_timestamp", "scalars": {tag: [{"step", "value", "wall_time"}]}}
inline nlohmann::json tensorboard_view(const std::string& logdir) {
  const std::string script = source_dir() + "/tests/unit/train/read_events.py";
  EXPECT_TRUE(std::filesystem::exists(script)) << script;
  const auto result = run_process({test_python(), script, logdir});
  EXPECT_EQ(result.exit_code, 0) << result.err;
  const auto brace = result.out.find('{');
  if (result.exit_code != 0 || brace == std::string::npos) return nlohmann::json::object();
  return nlohmann::json::parse(result.out.substr(brace));
}

} // namespace flotilla::testing
