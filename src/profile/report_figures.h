// Private to src/profile: the report page's building blocks that know nothing of its layout:
// text and numbers as the page shows them (escaped, grouped, percentages, sizes), and the SVG
// figures (line charts of the epoch curves, the step-time bars per worker and their table).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "flotilla/profile/run_summary.h"
#include "flotilla/train/step_phases.h"

namespace flotilla::profile::detail {

// ---- Text and numbers (everything from outside goes through escape) ----
std::string escape(std::string_view text);
std::string fixed(double v, int decimals);
std::string grouped(double v);
std::string value_text(double v);
std::string percent(double share, int decimals = 1);
std::string bytes_text(std::int64_t bytes);
std::string count_text(std::int64_t n);

// ---- Line charts ----
struct Series {
  std::string key;
  const char* colour;
  bool dashed = false;
  std::vector<std::pair<double, double>> points; // (epoch, value), finite only
};

struct Chart {
  std::string id;
  std::string title;
  bool zero_based = false;
  std::vector<Series> series;
};

// Loss first, then the metrics in the order fit() logged them, each with its val_ twin; the
// learning rate last, then throughput.
std::vector<Chart> curve_charts(const RunSummary& run);
std::string render_chart(const Chart& chart);

// ---- Step-time bars ----
double ms_per_step(double seconds, std::int64_t steps);
// The step's time no phase accounts for, when it is more than noise; 0 otherwise.
double other_ms(const train::PhaseTimes& p);
std::string phase_legend(bool with_other);
std::string render_bars(const std::vector<train::PhaseTimes>& workers);
std::string phase_table(const std::vector<train::PhaseTimes>& workers);

} // namespace flotilla::profile::detail
