// The profiler: a Keras-style callback that turns what fit() measures into the run's record and
// its outputs. Add it to FitOptions::callbacks on every worker (it gathers from all of them):
//   - the RunSummary (per-epoch values, every worker's step phases, the recipe's facts), as
//     JSON with `summary` set;
//   - the timeline with `trace` set: every step's phases on every worker, gathered on the chief
//     into one Chrome trace-event file (this turns on fit()'s per-step recording);
//   - the HTML report with `report` set;
//   - the recipe doctor's findings, printed by the chief at the end of fit() with `doctor`.
// Without `trace`, it costs nothing during the steps: fit() keeps per-epoch phase sums anyway.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>

#include "flotilla/profile/doctor.h"
#include "flotilla/profile/run_summary.h"
#include "flotilla/train/callbacks.h"

namespace flotilla::profile {

struct ProfilerOptions {
  std::filesystem::path trace;           // Chrome trace-event JSON; empty: no timeline
  std::int64_t max_traced_steps = 10000; // per worker, from the first step
  std::filesystem::path summary;         // RunSummary JSON ("flotilla.run/1"); empty: none
  std::filesystem::path report;          // self-contained HTML report; empty: none
  bool doctor = true;                    // print the recipe doctor at the end of fit (chief)
  // What the caller knows that the model cannot tell (model name, LR scaling, the input's
  // plan, workers per machine); the rest is filled in from the model and this process.
  RecipeFacts recipe;
  std::string command;     // how the run was started, for the report
  std::FILE* out = stdout; // where the doctor prints
  // How the doctor's settings and advice are shown, printed and in the report: API terms
  // ("CompileOptions::jit_compile = true") unless a program shows its own options (the CLI's
  // flags).
  FindingFormat findings_format;
};

class Profiler : public train::Callback {
 public:
  explicit Profiler(ProfilerOptions options);
  void on_train_begin() override;
  void on_epoch_end(int epoch, train::EpochLogs& logs) override;
  void on_train_end() override;

  // The record so far (complete after on_train_end on the chief; other workers hold their
  // epochs' values and phases too).
  const RunSummary& summary() const { return summary_; }

 private:
  void write_timeline();

  ProfilerOptions options_;
  RunSummary summary_;
};

// The recipe facts this process can tell about `model` after fit: device, precision, compiled
// step, optimizer, threads, cores, parameters, gradient bytes and buckets, peak memory; fields
// already set in `known` win.
RecipeFacts observe_recipe(train::Model& model, RecipeFacts known);

} // namespace flotilla::profile
