// The CLI's flags for the library's API names. The library's messages and the doctor's advice
// name what to change in API terms ("FitOptions::steps_per_epoch", "CompileOptions::jit_compile",
// "strategy::parse_devices"), which is what a C++ user sets; a user of the CLI sets a flag
// instead. This is the one table between the two: main() applies it to error lines and, through
// the logger's rewrite hook, to log lines; the doctor's findings are shown with it.
#pragma once

#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "flotilla/profile/doctor.h"

namespace flotilla::tools {

struct FlagFor {
  // How a value of the API name becomes the flag's.
  enum class Form {
    kValue,         // "--flag VALUE"
    kSwitch,        // true: "--flag"; false: "without --flag"
    kNegatedSwitch, // the flag turns the option off: true: "without --flag"; false: "--flag"
    kEpochs,        // the API counts optimizer updates, the flag epochs of them
  };
  const char* api;  // "FitOptions::steps_per_epoch"
  const char* flag; // "--steps-per-epoch" (or the command that does it: "flotilla plan")
  Form form = Form::kValue;
};

// Every API name a flotilla command has a flag for.
const std::vector<FlagFor>& flag_table();
// The entry for `api`; nullptr when the CLI has no flag for it.
const FlagFor* flag_for(std::string_view api);

// `message` with each API name of the table followed by its flag: "set FitOptions::epochs
// (--epochs)"; a call's arguments stay with the name ("strategy::parse_devices(\"cpu\")
// (--devices)"), and inside parentheses the flag joins them ("(FitOptions::epochs, --epochs)"). A
// name already followed by its flag is left as it is.
std::string with_flags(const std::string& message);

// A doctor's setting as the flag that makes it ("--precision mixed_bfloat16", "--jit-compile",
// "without --no-overlap"); API terms (profile::to_string) where the CLI has no flag for it.
// `updates_per_epoch` converts the kEpochs form (0: unknown, API terms).
std::string setting_as_flag(const profile::Setting& setting, std::int64_t updates_per_epoch = 0);

// The seconds given to `flag` as a duration: ConfigError unless they are a finite number above 0
// and at most a week (inf, nan or a huge number has no duration; converting one was undefined).
std::chrono::milliseconds seconds_flag(double seconds, const std::string& flag);

// Checks for numeric flags. CLI11's PositiveNumber, NonNegativeNumber and Range let NaN through
// (every comparison with NaN is false), so `--lr nan` trained; these take finite numbers only,
// each with an upper bound too (a huge batch grew to std::bad_alloc, a huge rate overflowed with
// no flag named), and say so: "--lr: takes a finite number above 0 and at most 1000; saw 1e300".
CLI::Validator positive_number(double max);
CLI::Validator non_negative_number(double max);
CLI::Validator number_in(double lo, double hi); // lo <= x <= hi

// The doctor's findings as the CLI shows them: settings as flags, the API names in the advice
// followed by their flags.
profile::FindingFormat cli_findings_format(std::int64_t updates_per_epoch);

} // namespace flotilla::tools
