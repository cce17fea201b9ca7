// The recipe doctor: checks each item of the single-machine performance recipe against what a
// run measured, and says what to do, most valuable first. The seeds' first rule is to optimise one
// machine before adding workers ("input bound < 5%? mixed precision on? XLA on? batch size the
// largest memory allows?"); the doctor answers each question with the run's own numbers.
// Torch-free: it reads a RunSummary. fit() prints it at the end (`flotilla train`), the HTML
// report shows it, and `flotilla doctor -- <train command>` runs a command and prints it. Its
// advice names the library's options (Setting, API names in the text); the CLI shows its own
// flags for them through a FindingFormat.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "flotilla/profile/run_summary.h"

namespace flotilla::profile {

// One thing to set, in API terms: `option` is a field ("CompileOptions::jit_compile",
// "CommunicationOptions::bytes_per_pack") or a function that takes the value
// ("train::set_global_policy", "torch::set_num_threads"); `value` is what to give it, as text
// ("true", "262144", "mixed_bfloat16"). Where the library has no single option for a recipe
// item, the name is the RunSummary's own field for it ("RecipeFacts::batch_per_replica").
struct Setting {
  std::string option;
  std::string value;
  bool operator==(const Setting& other) const {
    return option == other.option && value == other.value;
  }
};
// "CompileOptions::jit_compile = true" for a field, "torch::set_num_threads(1)" for a function
// (by the house style: a lowercase namespace before the last "::", a PascalCase type for a field).
std::string to_string(const Setting& setting);

struct Finding {
  enum class Status { kGood, kConsider, kAct, kUnknown };
  std::string item; // "input pipeline", "mixed precision", "compiled step", ...
  Status status = Status::kUnknown;
  std::string evidence; // the measured numbers behind the verdict
  // The next step in words and API terms (what the settings do, what else to do); empty when
  // kGood.
  std::string recommendation;
  // Estimated share of step time to gain (0..1) by following the recommendation: the order of
  // the report. 0 when nothing to gain or not measurable.
  double gain = 0;
  // What to set, most important first; empty when there is nothing to set (kGood, or advice
  // that is not a setting).
  std::vector<Setting> settings;
};
const char* to_string(Finding::Status status); // "ok", "consider", "act", "unknown"

// One finding per recipe item, sorted most valuable first (kAct before kConsider before kGood,
// then by gain).
std::vector<Finding> diagnose(const RunSummary& run);

// How settings and the API names in a recommendation are shown. By default in API terms; a
// program with options of its own shows those (the flotilla CLI: "--precision mixed_bfloat16").
struct FindingFormat {
  std::function<std::string(const Setting&)> setting;  // empty: to_string(setting)
  std::function<std::string(const std::string&)> text; // the recommendation; empty: as written
};
// A finding's settings and recommendation on one line: "<setting>, <setting>: <text>"; empty
// when it has neither.
std::string format_recommendation(const Finding& finding, const FindingFormat& format = {});
// The short text report: a heading line and one line (plus one for the recommendation) per item.
std::string format_findings(const std::vector<Finding>& findings, const FindingFormat& format = {});

} // namespace flotilla::profile
