// What this process may use of the machine, and the clock flotilla times itself with.
#pragma once

#include <chrono>
#include <string>

namespace flotilla::base {

// Cores this process may run on (its affinity mask: taskset, cgroups, Slurm), at least 1.
int available_cores();

// Every duration flotilla measures (step phases, epochs, votes, timeouts) is on this clock.
using Clock = std::chrono::steady_clock;

inline double seconds_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}
inline double seconds_since(Clock::time_point from) {
  return seconds_between(from, Clock::now());
}

// The wall-clock time now, for records people read: ISO 8601 in UTC, "2026-12-03T07:10:49Z".
std::string utc_now();

} // namespace flotilla::base
