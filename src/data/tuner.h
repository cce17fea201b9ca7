// Private: AUTOTUNE. Stages whose parallelism or buffer size was left to the runtime register a
// Knob. While the pipeline runs, the consumer's next() calls Tuner::maybe_tune(), which every
// window (100 ms) hands each knob what was measured in it: how long the stage's consumer
// waited, how long its producer sat idle because the knob was full. A knob grows while its
// consumer waits and the knob, not its input, is what holds it back — within the cores and the
// RAM budget — so the choices are explainable from Iterator::stats().
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <vector>

namespace flotilla::data::detail {

// Time counters a stage accumulates; the tuner reads and resets them each window.
struct WaitCounters {
  std::atomic<std::int64_t> consumer_wait_ns{0};       // consumer blocked on an empty stage
  std::atomic<std::int64_t> producer_full_ns{0};       // producer blocked because the knob was full
  std::atomic<std::int64_t> consumer_wait_total_ns{0}; // since start, for stats
};

class Knob {
 public:
  Knob(std::int64_t initial, std::int64_t max, std::int64_t bytes_per_unit)
      : value_(initial), max_(max), bytes_per_unit_(bytes_per_unit) {}
  std::int64_t value() const { return value_.load(); }
  std::int64_t max() const { return max_; }
  WaitCounters& counters() { return counters_; }
  const WaitCounters& counters() const { return counters_; }
  // Bytes one more unit of this knob holds (a buffered element), learned as elements pass.
  void observe_element_bytes(std::int64_t bytes) { bytes_per_unit_.store(bytes); }
  std::int64_t bytes_per_unit() const { return bytes_per_unit_.load(); }

 private:
  friend class Tuner;
  std::atomic<std::int64_t> value_;
  std::int64_t max_;
  std::atomic<std::int64_t> bytes_per_unit_;
  WaitCounters counters_;
};

class Tuner {
 public:
  Tuner(bool enabled, std::int64_t ram_budget_bytes)
      : enabled_(enabled), ram_budget_(ram_budget_bytes), window_start_(Clock::now()) {}

  void add(Knob* knob);
  void remove(Knob* knob);
  // Cheap unless a window has passed; then adjusts the knobs.
  void maybe_tune();
  std::int64_t ram_budget() const { return ram_budget_; }

  // The window: long enough to average a few steps, short enough to converge within an epoch.
  static constexpr std::chrono::milliseconds kWindow{100};
  // A consumer that waits this share of a window is held back.
  static constexpr double kWaitingShare = 0.02;
  // A producer idle this share of a window because the knob was full is limited by the knob.
  static constexpr double kFullShare = 0.10;

 private:
  using Clock = std::chrono::steady_clock;
  bool enabled_;
  std::int64_t ram_budget_;
  std::mutex mutex_;
  std::vector<Knob*> knobs_;
  Clock::time_point window_start_;
};

} // namespace flotilla::data::detail
