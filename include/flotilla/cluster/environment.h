// The process environment as flotilla sees it. This is the one place that reads environment
// variables: everything else takes an Environment, so tests pass their own.
#pragma once

#include <map>
#include <optional>
#include <string>

namespace flotilla::cluster {

class Environment {
 public:
  Environment() = default;
  explicit Environment(std::map<std::string, std::string> vars) : vars_(std::move(vars)) {}

  // Snapshot of the variables flotilla understands: TF_CONFIG; RANK, WORLD_SIZE, MASTER_ADDR,
  // MASTER_PORT, LOCAL_WORLD_SIZE (torchrun's names, also set by `flotilla launch`);
  // FLOTILLA_TERMINAL (set by `flotilla launch` when its own output is a
  // terminal, so a worker draws a progress bar through the launcher's pipe).
  static Environment from_process();

  // The value, or nullopt when unset or empty.
  std::optional<std::string> get(const std::string& name) const;

 private:
  std::map<std::string, std::string> vars_;
};

} // namespace flotilla::cluster
