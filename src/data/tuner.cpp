#include "data/tuner.h"

#include <algorithm>

namespace flotilla::data::detail {

void Tuner::add(Knob* knob) {
  std::lock_guard<std::mutex> lock(mutex_);
  knobs_.push_back(knob);
}

void Tuner::remove(Knob* knob) {
  std::lock_guard<std::mutex> lock(mutex_);
  knobs_.erase(std::remove(knobs_.begin(), knobs_.end(), knob), knobs_.end());
}

void Tuner::maybe_tune() {
  const auto now = Clock::now();
  std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
  if (!lock.owns_lock() || now - window_start_ < kWindow) return;
  const double window_ns = static_cast<double>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(now - window_start_).count());
  window_start_ = now;

  std::int64_t ram_used = 0;
  for (const Knob* k : knobs_) ram_used += k->value() * k->bytes_per_unit();
  for (Knob* k : knobs_) {
    const double waited =
        static_cast<double>(k->counters_.consumer_wait_ns.exchange(0)) / window_ns;
    const double full = static_cast<double>(k->counters_.producer_full_ns.exchange(0)) / window_ns;
    if (!enabled_) continue;
    const std::int64_t value = k->value();
    const std::int64_t step = std::max<std::int64_t>(1, value / 4);
    const std::int64_t extra_bytes = step * k->bytes_per_unit();
    if (waited > kWaitingShare && full > kFullShare && value < k->max_ &&
        ram_used + extra_bytes <= ram_budget_) {
      k->value_.store(std::min(k->max_, value + step));
      ram_used += extra_bytes;
    }
  }
}

} // namespace flotilla::data::detail
