#include "flotilla/train/step_phases.h"

#include <algorithm>

namespace flotilla::train {

namespace {
constexpr std::array<const char*, kPhaseCount> kNames = {
    "input", "copy", "forward", "backward", "allreduce", "optimizer", "metrics", "callbacks"};
} // namespace

const char* phase_name(Phase phase) {
  return kNames[static_cast<std::size_t>(phase)];
}

int phase_index(const std::string& name) {
  for (int i = 0; i < kPhaseCount; ++i) {
    if (name == kNames[static_cast<std::size_t>(i)]) return i;
  }
  return kPhaseCount;
}

double PhaseTimes::sum() const {
  double total = 0;
  for (double s : seconds) total += s;
  return total;
}

double PhaseTimes::input_share() const {
  return step_seconds > 0 ? (*this)[Phase::kInput] / step_seconds : 0.0;
}

double PhaseTimes::hidden_share() const {
  if (comm_seconds <= 0) return 0.0;
  return std::clamp(1.0 - (*this)[Phase::kAllReduce] / comm_seconds, 0.0, 1.0);
}

PhaseTimes& PhaseTimes::operator+=(const PhaseTimes& other) {
  for (std::size_t i = 0; i < seconds.size(); ++i) seconds[i] += other.seconds[i];
  step_seconds += other.step_seconds;
  comm_seconds += other.comm_seconds;
  steps += other.steps;
  return *this;
}

InputBound classify_input_bound(double share) {
  if (share < 0.05) return InputBound::kNo;
  if (share < 0.20) return InputBound::kModerately;
  return InputBound::kHighly;
}

const char* to_string(InputBound bound) {
  switch (bound) {
  case InputBound::kNo:
    return "not input-bound";
  case InputBound::kModerately:
    return "moderately input-bound";
  case InputBound::kHighly:
    return "highly input-bound";
  }
  return "?";
}

} // namespace flotilla::train
