#include "flotilla/log.h"

#include <cstdio>
#include <mutex>

namespace flotilla {

Logger::Logger(int rank, int world_size)
    : tag_("[worker " + std::to_string(rank) + "/" + std::to_string(world_size) + "] ") {}

void Logger::write(LogLevel level, const std::string& message) const {
  static std::mutex mutex; // one line at a time, whole, from any thread
  const char* prefix = level == LogLevel::kWarning ? "warning: "
                       : level == LogLevel::kError ? "error: "
                                                   : "";
  std::lock_guard<std::mutex> lock(mutex);
  std::fprintf(stderr, "%s%s%s\n", tag_.c_str(), prefix, message.c_str());
  std::fflush(stderr);
}

} // namespace flotilla
