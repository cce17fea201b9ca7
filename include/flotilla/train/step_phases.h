// Where a training step's time goes. fit() times every step's phases on every worker — input
// wait, host-to-device copy, forward, backward, the all-reduce wait left after backward
// (exposed), optimizer, metrics, callbacks — and sums them per epoch (EpochLogs::phases). The
// phases are consecutive, so they add up to the step's wall-clock time; the all-reduce time
// hidden behind backward is inside `backward` and is reported apart (comm_seconds). Torch-free:
// the profile layer (timeline, report, doctor, planner) reads these without LibTorch.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace flotilla::train {

enum class Phase : int {
  kInput,     // waiting for the input pipeline's next batch
  kCopy,      // host -> device copy of the batch (zero when the batch is already there)
  kForward,   // forward and loss
  kBackward,  // backward, with the all-reduces that start and finish behind it
  kAllReduce, // waiting for all-reduces after backward: communication not hidden
  kOptimizer, // unscaling, finiteness check, optimizer update
  kMetrics,   // the batch's loss and metric sums, copied to the host
  kCallbacks, // batch-level callbacks (progress bar, backups, preemption vote)
};
inline constexpr int kPhaseCount = 8;
// "input", "copy", "forward", "backward", "allreduce", "optimizer", "metrics", "callbacks".
const char* phase_name(Phase phase);
// What phase_name() returns, for a test or a reader of the JSON; kPhaseCount if unknown.
int phase_index(const std::string& name);

// Summed over steps.
struct PhaseTimes {
  std::array<double, kPhaseCount> seconds{};
  double step_seconds = 0; // wall-clock from asking for the batch to the last callback
  double comm_seconds = 0; // a gradient all-reduce in flight (hidden behind backward + exposed)
  std::int64_t steps = 0;

  double& operator[](Phase p) { return seconds[static_cast<std::size_t>(p)]; }
  double operator[](Phase p) const { return seconds[static_cast<std::size_t>(p)]; }
  double sum() const; // of the phases; equals step_seconds up to the clock reads between them
  // Input wait over step time, 0..1 (TF's profiler: "input-bound share").
  double input_share() const;
  // Share of all-reduce time hidden behind backward, 0..1 (0 when there is no communication).
  double hidden_share() const;
  PhaseTimes& operator+=(const PhaseTimes& other);
};

// TF's profiler classes: < 5% "not input-bound", 5-20% "moderately input-bound", >= 20% "highly
// input-bound".
enum class InputBound { kNo, kModerately, kHighly };
InputBound classify_input_bound(double share);
const char* to_string(InputBound bound);

// One step on one worker, for the timeline. Times are seconds since the fit's origin (the moment
// every worker left fit's first collective, so workers' timelines line up).
struct StepTrace {
  struct Span {
    Phase phase;
    double begin;
    double seconds;
  };
  int epoch = 0;         // 0-based
  std::int64_t step = 0; // in the epoch
  std::vector<Span> spans;
  std::vector<std::pair<double, double>> all_reduces; // each bucket's [start, completion]
};

} // namespace flotilla::train
