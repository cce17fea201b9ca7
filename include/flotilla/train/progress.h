// Keras-style progress on the chief: "Epoch 1/3", then a bar redrawn in place on a terminal
// (verbose 1), or a single line per epoch otherwise (verbose 2), e.g.
//   937/937 - 21s - 22ms/step - loss: 0.4620 - accuracy: 0.8331 - learning_rate: 0.0400 -
//   2843 samples/s
// Progress draws it; ProgressBar is the callback fit adds (Keras's ProgbarLogger).
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>

#include "flotilla/train/callback.h"

namespace flotilla::train {

class Progress {
 public:
  // `enabled` is false on every worker but the chief; `bar` draws the in-place bar.
  Progress(bool enabled, bool bar, std::FILE* out = stdout);

  void begin_epoch(int epoch, int epochs, std::int64_t steps);
  // After a step, with the chief's running means (the bar's values are this worker's; the
  // epoch line's are global).
  void step(std::int64_t done, const Logs& logs);
  void end_epoch(const EpochLogs& logs);
  void line(const std::string& text);
  // An elastic group's chief can change mid-fit: the new one shows progress from then on.
  void set_enabled(bool enabled) { enabled_ = enabled; }

 private:
  bool enabled_;
  bool bar_;
  std::FILE* out_;
  std::int64_t steps_ = 0;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_draw_;
};

// The cheap per-epoch profile, one line: ms per step for each phase, the input-bound share
// with TF's class, and how much all-reduce time backward hid, e.g.
//   step 42.1 ms: input 0.41 (1.0%, not input-bound) | forward 9.80 | backward 25.10 | ...
std::string phase_summary(const EpochLogs& logs);

// Keras's ProgbarLogger: a bar with ETA and running loss/metrics on a terminal (verbose 1), one
// line per epoch otherwise; chief only (whoever is chief at the time: in an elastic group the
// lowest surviving worker takes over). fit() adds one unless verbose is silent or one is given.
class ProgressBar : public Callback {
 public:
  // kAuto: fit's verbosity, resolved for `out` (resolve_verbosity).
  explicit ProgressBar(Verbosity verbose = Verbosity::kAuto, std::FILE* out = stdout);
  void on_train_begin() override;
  void on_epoch_begin(int epoch) override;
  void on_train_batch_end(std::int64_t batch, const Logs& logs) override;
  void on_epoch_end(int epoch, EpochLogs& logs) override;
  CallbackNeeds needs() const override;

 private:
  // The chief's progress, or nothing on the others.
  Progress& progress();

  Verbosity verbose_;
  std::FILE* out_;
  bool shown_ = false; // not silent
  std::optional<Progress> progress_;
};

} // namespace flotilla::train
