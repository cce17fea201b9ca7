// Private: reading a monitored logs key the way Keras's ModelCheckpoint and EarlyStopping do.
#pragma once

#include <optional>
#include <string>

#include "flotilla/train/callback.h"

namespace flotilla::train {

inline bool maximizes(MonitorMode mode, const std::string& monitor) {
  if (mode != MonitorMode::kAuto) return mode == MonitorMode::kMax;
  // Keras's rule: accuracies and AUC improve upward, everything else downward.
  return monitor.find("acc") != std::string::npos || monitor.find("auc") != std::string::npos;
}

inline bool improved(double value, std::optional<double> best, bool maximize,
                     double min_delta = 0) {
  if (!best) return true;
  return maximize ? value - min_delta > *best : value + min_delta < *best;
}

} // namespace flotilla::train
