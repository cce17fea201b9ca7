#include "flotilla/train/progress.h"

#include <cmath>

#include "flotilla/train/model.h"

namespace flotilla::train {
namespace {

std::string duration(double seconds) {
  char buf[32];
  if (seconds < 60) {
    std::snprintf(buf, sizeof buf, "%.0fs", seconds);
  } else {
    std::snprintf(buf, sizeof buf, "%dm%02ds", static_cast<int>(seconds) / 60,
                  static_cast<int>(seconds) % 60);
  }
  return buf;
}

// " - loss: 0.4620 - accuracy: 0.8331" (learning rates and tiny values in %g).
std::string format_logs(const Logs& logs) {
  std::string text;
  char buf[96];
  for (const auto& [key, value] : logs.items()) {
    const bool tiny = value != 0 && std::fabs(value) < 1e-3;
    std::snprintf(buf, sizeof buf,
                  tiny || key.find("learning_rate") != std::string::npos ? " - %s: %.4g"
                                                                         : " - %s: %.4f",
                  key.c_str(), value);
    text += buf;
  }
  return text;
}

} // namespace

std::string phase_summary(const EpochLogs& logs) {
  const PhaseTimes& p = logs.phases;
  if (p.steps == 0) return "";
  const double per_step = 1000.0 / static_cast<double>(p.steps);
  char buf[160];
  const double share = p.input_share();
  std::snprintf(buf, sizeof buf, "step %.1f ms: input %.2f (%.1f%%, %s)", p.step_seconds * per_step,
                p[Phase::kInput] * per_step, 100.0 * share, to_string(classify_input_bound(share)));
  std::string text = buf;
  for (Phase phase : {Phase::kCopy, Phase::kForward, Phase::kBackward, Phase::kAllReduce,
                      Phase::kOptimizer, Phase::kMetrics, Phase::kCallbacks}) {
    const double ms = p[phase] * per_step;
    if (phase == Phase::kCopy && ms < 0.005) continue; // the batch was on the device already
    if (phase == Phase::kAllReduce && p.comm_seconds > 0) {
      std::snprintf(buf, sizeof buf, " | all-reduce waited %.2f (%.0f%% of %.2f in flight hidden)",
                    ms, 100.0 * p.hidden_share(), p.comm_seconds * per_step);
    } else {
      std::snprintf(buf, sizeof buf, " | %s %.2f", phase_name(phase), ms);
    }
    text += buf;
  }
  // The worker that waits longest for input sets everyone's pace.
  int slowest = -1;
  for (std::size_t w = 0; w < logs.worker_phases.size(); ++w) {
    if (slowest < 0 || logs.worker_phases[w].input_share() >
                           logs.worker_phases[static_cast<std::size_t>(slowest)].input_share()) {
      slowest = static_cast<int>(w);
    }
  }
  if (slowest > 0) {
    std::snprintf(buf, sizeof buf, "; most input wait: worker %d, %.1f%%", slowest,
                  100.0 * logs.worker_phases[static_cast<std::size_t>(slowest)].input_share());
    text += buf;
  }
  return text;
}

Progress::Progress(bool enabled, bool bar, std::FILE* out)
    : enabled_(enabled), bar_(bar), out_(out) {}

void Progress::begin_epoch(int epoch, int epochs, std::int64_t steps) {
  steps_ = steps;
  start_ = last_draw_ = std::chrono::steady_clock::now();
  if (!enabled_) return;
  std::fprintf(out_, "Epoch %d/%d\n", epoch, epochs);
  std::fflush(out_);
}

void Progress::step(std::int64_t done, const Logs& logs) {
  if (!enabled_ || !bar_) return;
  const auto now = std::chrono::steady_clock::now();
  if (done != steps_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
  last_draw_ = now;
  if (steps_ <= 0) { // the pass's length is unknown: count, as Keras does
    std::fprintf(out_, "\r%lld/Unknown%s   ", static_cast<long long>(done),
                 format_logs(logs).c_str());
    std::fflush(out_);
    return;
  }
  // An elastic group keeping the per-replica batch can take more steps than the full cluster's.
  const std::int64_t steps = std::max(done, steps_);
  constexpr int kWidth = 30;
  const int filled = static_cast<int>(kWidth * done / steps);
  std::string bar(static_cast<std::size_t>(filled), '=');
  if (filled < kWidth) bar += '>';
  bar.resize(kWidth, '.');
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const double eta = done > 0 ? elapsed / static_cast<double>(done) * (steps - done) : 0;
  std::fprintf(out_, "\r%lld/%lld [%s] - ETA: %s%s   ", static_cast<long long>(done),
               static_cast<long long>(steps), bar.c_str(), duration(eta).c_str(),
               format_logs(logs).c_str());
  std::fflush(out_);
}

void Progress::end_epoch(const EpochLogs& logs) {
  if (!enabled_) return;
  const double ms_per_step = logs.steps > 0 ? 1000.0 * logs.seconds / logs.steps : 0;
  if (bar_) std::fprintf(out_, "\r");
  std::fprintf(out_, "%lld/%lld%s - %s - %.0fms/step%s - %.0f samples/s\n",
               static_cast<long long>(logs.steps), static_cast<long long>(logs.steps),
               bar_ ? " [==============================]" : "", duration(logs.seconds).c_str(),
               ms_per_step, format_logs(logs.values).c_str(), logs.samples_per_s);
  if (logs.skipped_steps > 0) {
    std::fprintf(out_, "  loss scaling: %lld step(s) skipped (non-finite gradients)\n",
                 static_cast<long long>(logs.skipped_steps));
  }
  if (logs.phases.steps > 0) std::fprintf(out_, "  %s\n", phase_summary(logs).c_str());
  std::fflush(out_);
}

void Progress::line(const std::string& text) {
  if (!enabled_) return;
  std::fprintf(out_, "%s\n", text.c_str());
  std::fflush(out_);
}

ProgressBar::ProgressBar(Verbosity verbose, std::FILE* out) : verbose_(verbose), out_(out) {}

CallbackNeeds ProgressBar::needs() const {
  CallbackNeeds needs;
  needs.shows_progress = true;
  return needs;
}

void ProgressBar::on_train_begin() {
  const Verbosity verbose =
      resolve_verbosity(verbose_ == Verbosity::kAuto ? params().verbose : verbose_, out_);
  shown_ = verbose != Verbosity::kSilent;
  progress_.emplace(shown_ && is_chief(), verbose == Verbosity::kProgressBar, out_);
}

Progress& ProgressBar::progress() {
  progress_->set_enabled(shown_ && is_chief());
  return *progress_;
}

void ProgressBar::on_epoch_begin(int epoch) {
  progress().begin_epoch(epoch + 1, params().epochs, params().steps);
}

void ProgressBar::on_train_batch_end(std::int64_t batch, const Logs& logs) {
  progress().step(batch + 1, logs);
}

void ProgressBar::on_epoch_end(int epoch, EpochLogs& logs) {
  progress().end_epoch(logs);
}

} // namespace flotilla::train
