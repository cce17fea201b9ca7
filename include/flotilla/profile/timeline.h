// The timeline: every worker's step phases as one Chrome trace-event JSON file (opens in
// Perfetto, ui.perfetto.dev, or chrome://tracing). One process track per worker, one thread track
// per phase beneath it, plus a "step" track and an "all-reduce" track with each gradient
// bucket's time in flight, so communication hidden behind backward is visible as overlap.
// Torch-free; the Profiler gathers the workers' traces on the chief and writes the file.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "flotilla/train/step_phases.h"

namespace flotilla::profile {

// Track ids under each worker's process: 0 the steps, 1..kPhaseCount the phases in Phase order,
// then the all-reduces.
inline constexpr int kStepTrack = 0;
inline constexpr int kAllReduceTrack = train::kPhaseCount + 1;

// `workers[r]`: worker r's steps; `names[r]`: its label ("worker 0 (chief)", an address...).
nlohmann::json chrome_trace(const std::vector<std::vector<train::StepTrace>>& workers,
                            const std::vector<std::string>& names);

// A worker's steps as a flat list of numbers and back, to send them to the chief in one
// collective.
std::vector<double> pack_traces(const std::vector<train::StepTrace>& steps);
std::vector<train::StepTrace> unpack_traces(const std::vector<double>& packed);

} // namespace flotilla::profile
