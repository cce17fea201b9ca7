// The recipe doctor: checks each item of the single-machine performance recipe against what a
// run measured, and says what to do, most valuable first. The seeds' first rule is to optimise one
// machine before adding workers ("input bound < 5%? mixed precision on? XLA on? batch size the
// largest memory allows?"); the doctor answers each question with the run's own numbers.
// Torch-free: it reads a RunSummary. fit() prints it at the end (`flotilla train`), the HTML
// report shows it, and `flotilla doctor -- <train command>` runs a command and prints it.
#pragma once

#include <string>
#include <vector>

#include "flotilla/profile/run_summary.h"

namespace flotilla::profile {

struct Finding {
  enum class Status { kGood, kConsider, kAct, kUnknown };
  std::string item; // "input pipeline", "mixed precision", "compiled step", ...
  Status status = Status::kUnknown;
  std::string evidence;       // the measured numbers behind the verdict
  std::string recommendation; // a concrete next step (a flag, a call); empty when kGood
  // Estimated share of step time to gain (0..1) by following the recommendation: the order of
  // the report. 0 when nothing to gain or not measurable.
  double gain = 0;
};
const char* to_string(Finding::Status status); // "ok", "consider", "act", "unknown"

// One finding per recipe item, sorted most valuable first (kAct before kConsider before kGood,
// then by gain).
std::vector<Finding> diagnose(const RunSummary& run);
// The short text report: a heading line and one line (plus one for the recommendation) per item.
std::string format_findings(const std::vector<Finding>& findings);

} // namespace flotilla::profile
