// What this process may use of the machine, and the clock flotilla times itself with.
#pragma once

#include <chrono>
#include <string>

namespace flotilla::base {

// Cores this process may run on (its affinity mask: taskset, cgroups, Slurm), at least 1.
int available_cores();

// glibc's malloc keeps what a training step frees for the next step: blocks up to 32 MiB (its
// largest setting) come from the heap instead of their own mmap, and freed memory stays with the
// process (trim threshold 1 GiB). By default each step's large activations are mapped afresh and
// unmapped when freed, so every step faults in and zeroes new pages (in a perf profile of the
// CNN at 256 images, 30% of the samples were in the kernel, mostly these faults; 5% with this).
// Costs the memory a step's freed blocks hold (~80 MiB more peak for that CNN). Process-wide;
// call it before training. False where the C library is not glibc, or refused the settings.
bool keep_freed_memory();

// Raises this process's soft limit on open files to its hard limit (as systemd does for its
// services): every Gloo pair, rendezvous and probe connection is a descriptor, and so is each
// connection a stranger opens to a listening port until it is closed. Under a soft limit of 1024,
// waves of stray connections to the Gloo ports exhausted it and aborted the workers (exit 134,
// "accept: Too many open files"). Left as it is where the system refuses.
void raise_open_file_limit();

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
