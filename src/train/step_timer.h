// Private: times a step's phases (step_phases.h). Each mark() charges the time since the previous
// mark to a phase, so the phases of a step are consecutive and add up to its wall-clock time: a
// few clock reads a step. While tracing, each step's spans (and its buckets' all-reduces) are
// kept for the timeline, up to a number of steps; tracing lasts one fit.
#pragma once

#include <torch/cuda.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "flotilla/base/system.h"
#include "flotilla/train/step_phases.h"

namespace flotilla::train::detail {

class StepTimer {
 public:
  using Clock = base::Clock;

  PhaseTimes epoch; // this epoch's sums

  // Every worker has just left the same collective: the timelines' common zero.
  void set_origin(Clock::time_point origin) { origin_ = origin; }
  void set_tracing(bool on, std::int64_t max_steps) {
    tracing_ = on;
    max_traced_ = max_steps;
  }
  std::vector<StepTrace> take_traces() { return std::exchange(traces_, {}); }
  // Tracing lasts one fit. On CUDA, tracing waits for the kernels at each mark, so the spans are
  // the kernels' real times.
  void begin_fit(bool cuda) {
    traces_.clear();
    sync_cuda_ = tracing_ && cuda;
  }
  void end_fit() { tracing_ = false; }

  void start_step(int epoch_index, std::int64_t step) {
    trace_ = nullptr;
    if (tracing_ && static_cast<std::int64_t>(traces_.size()) < max_traced_) {
      trace_ = &traces_.emplace_back();
      trace_->epoch = epoch_index;
      trace_->step = step;
    }
    step_start_ = last_ = Clock::now();
    active_ = true;
  }
  // There was no step after all (the pass ended): its wait is charged nowhere, nor traced.
  void cancel_step() {
    active_ = false;
    if (trace_) traces_.pop_back();
    trace_ = nullptr;
  }
  void mark(Phase phase) {
    if (!active_) return;
    if (sync_cuda_) torch::cuda::synchronize();
    const auto now = Clock::now();
    const double seconds = base::seconds_between(last_, now);
    epoch[phase] += seconds;
    if (trace_) {
      if (!trace_->spans.empty() && trace_->spans.back().phase == phase) {
        trace_->spans.back().seconds += seconds; // one span per stretch of a phase
      } else {
        trace_->spans.push_back({phase, base::seconds_between(origin_, last_), seconds});
      }
    }
    last_ = now;
  }
  // Whether this step is traced (record_all_reduces has something to do).
  bool tracing_step() const { return trace_ != nullptr; }
  // This step's bucket all-reduces, for its trace.
  void record_all_reduces(
      const std::vector<std::pair<Clock::time_point, Clock::time_point>>& intervals) {
    if (!trace_) return;
    for (const auto& [begin, end] : intervals) {
      trace_->all_reduces.emplace_back(base::seconds_between(origin_, begin),
                                       base::seconds_between(origin_, end));
    }
  }
  // The step's tail since the last mark (its bookkeeping) counts as callbacks' time.
  void end_step() {
    if (!active_) return;
    mark(Phase::kCallbacks);
    epoch.step_seconds += base::seconds_between(step_start_, last_);
    ++epoch.steps;
    trace_ = nullptr;
    active_ = false;
  }

 private:
  Clock::time_point origin_;
  bool tracing_ = false;
  std::int64_t max_traced_ = 0;
  bool sync_cuda_ = false;
  std::vector<StepTrace> traces_;
  StepTrace* trace_ = nullptr; // the step being traced, if any
  Clock::time_point step_start_;
  Clock::time_point last_;
  bool active_ = false; // between start_step() and end_step(): work outside steps is not charged
};

} // namespace flotilla::train::detail
