// One small logger. Every line carries the worker's identity, "[worker i/N]" (and in an elastic
// group its generation, "[worker i/N gG]"), so interleaved output from several processes stays
// attributable. Progress lines (Keras-style) are not log lines: the chief prints those itself,
// untagged.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace flotilla {

enum class LogLevel { kInfo, kWarning, kError };

class Logger {
 public:
  Logger() = default; // untagged: before the cluster is known
  Logger(int rank, int world_size);
  // An elastic group's member: the tag names the generation its rank belongs to
  // ("[worker 0/3 g2] "), so every line says which group decided what it tells.
  Logger(int rank, int world_size, std::uint64_t generation);

  void info(const std::string& message) const { write(LogLevel::kInfo, message); }
  void warn(const std::string& message) const { write(LogLevel::kWarning, message); }
  void error(const std::string& message) const { write(LogLevel::kError, message); }
  void write(LogLevel level, const std::string& message) const;

  const std::string& tag() const { return tag_; }

 private:
  std::string tag_;
};

// A rewrite of every log line's message before it is written, for a program that shows the
// library's API names its own way: the flotilla CLI follows each name with its flag
// ("FitOptions::steps_per_epoch (--steps-per-epoch)"), as it does on its error lines. Process-wide,
// like the mixed-precision policy: set it once at start-up, before other threads log. Empty (the
// default): messages as written.
void set_log_rewrite(std::function<std::string(const std::string&)> rewrite);

} // namespace flotilla
