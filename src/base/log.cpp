#include "flotilla/log.h"

#include <cstdio>
#include <mutex>

namespace flotilla {

Logger::Logger(int rank, int world_size)
    : tag_("[worker " + std::to_string(rank) + "/" + std::to_string(world_size) + "] ") {}

Logger::Logger(int rank, int world_size, std::uint64_t generation)
    : tag_("[worker " + std::to_string(rank) + "/" + std::to_string(world_size) + " g" +
           std::to_string(generation) + "] ") {}

namespace {

std::mutex& log_mutex() { // one line at a time, whole, from any thread
  static std::mutex mutex;
  return mutex;
}

std::function<std::string(const std::string&)>& log_rewrite() {
  static std::function<std::string(const std::string&)> rewrite;
  return rewrite;
}

} // namespace

void set_log_rewrite(std::function<std::string(const std::string&)> rewrite) {
  std::lock_guard<std::mutex> lock(log_mutex());
  log_rewrite() = std::move(rewrite);
}

void Logger::write(LogLevel level, const std::string& message) const {
  const char* prefix = level == LogLevel::kWarning ? "warning: "
                       : level == LogLevel::kError ? "error: "
                                                   : "";
  std::lock_guard<std::mutex> lock(log_mutex());
  const auto& rewrite = log_rewrite();
  std::fprintf(stderr, "%s%s%s\n", tag_.c_str(), prefix,
               (rewrite ? rewrite(message) : message).c_str());
  std::fflush(stderr);
}

} // namespace flotilla
