#include "flotilla/profile/report.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string_view>
#include <utility>

#include "flotilla/base/atomic_file.h"
#include "flotilla/error.h"

namespace flotilla::profile {

namespace {

using train::Phase;
using train::PhaseTimes;

// ---- Text and numbers ------------------------------------------------------------------------

// Everything that came from outside (command line, model name, metric names, the doctor's
// text) goes through here: the page must show "<", "&" and quotes, not be broken by them.
std::string escape(std::string_view text) {
  std::string out;
  out.reserve(text.size() + 16);
  for (char c : text) {
    switch (c) {
    case '&':
      out += "&amp;";
      break;
    case '<':
      out += "&lt;";
      break;
    case '>':
      out += "&gt;";
      break;
    case '"':
      out += "&quot;";
      break;
    case '\'':
      out += "&#39;";
      break;
    default:
      out += c;
    }
  }
  return out;
}

std::string fixed(double v, int decimals) {
  if (!std::isfinite(v)) return "–";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  // "-0.0" reads as a sign error on an axis.
  std::string s = buf;
  if (s[0] == '-' && s.find_first_not_of("-0.") == std::string::npos) s.erase(0, 1);
  return s;
}

// An SVG coordinate. A non-finite one would make the browser log an error and drop the
// element; the callers never pass one, and this keeps a bug from reaching the markup.
std::string coord(double v) {
  return std::isfinite(v) ? fixed(v, 1) : "0";
}

std::string grouped(double v) {
  if (!std::isfinite(v)) return "–";
  const bool negative = v < 0;
  std::string digits = fixed(std::fabs(v), 0);
  std::string out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return negative ? "-" + out : out;
}

// Four significant figures for a loss or metric, grouping for large values.
std::string value_text(double v) {
  if (!std::isfinite(v)) return "–";
  const double a = std::fabs(v);
  if (a >= 1000) return grouped(v);
  if (a >= 100) return fixed(v, 1);
  if (a >= 1 || a == 0) return fixed(v, a == 0 ? 0 : 3);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

std::string percent(double share, int decimals = 1) {
  return fixed(share * 100, decimals) + "%";
}

std::string bytes_text(std::int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  return fixed(v, u == 0 ? 0 : 1) + " " + units[u];
}

std::string count_text(std::int64_t n) {
  const double v = static_cast<double>(n);
  if (v >= 1e9) return fixed(v / 1e9, 2) + " G";
  if (v >= 1e6) return fixed(v / 1e6, 2) + " M";
  if (v >= 1e4) return fixed(v / 1e3, 1) + " k";
  return grouped(v);
}

// ---- Axes ------------------------------------------------------------------------------------

struct Axis {
  double lo = 0, hi = 1, step = 1;
  std::vector<double> ticks() const {
    std::vector<double> out;
    const int n = static_cast<int>(std::lround((hi - lo) / step));
    for (int i = 0; i <= n; ++i) {
      double t = lo + i * step;
      if (std::fabs(t) < step * 1e-9) t = 0;
      out.push_back(t);
    }
    return out;
  }
  // 0 at lo, 1 at hi.
  double fraction(double v) const { return (v - lo) / (hi - lo); }
};

// Steps of 1, 2 or 5 times a power of ten, the domain widened to whole steps, so tick labels
// are round numbers and the extreme values sit on or inside the plot's edges.
Axis nice_axis(double lo, double hi, bool include_zero, int target_ticks = 5) {
  const bool nonnegative = lo >= 0;
  if (include_zero) {
    lo = std::min(lo, 0.0);
    hi = std::max(hi, 0.0);
  }
  if (!(hi > lo)) { // one value: give it room
    const double pad = lo == 0 ? 1 : std::fabs(lo) * 0.1;
    lo -= pad;
    hi += pad;
    if (include_zero && nonnegative) lo = std::max(lo, 0.0);
  }
  const double rough = (hi - lo) / std::max(1, target_ticks - 1);
  const double magnitude = std::pow(10.0, std::floor(std::log10(rough)));
  const double r = rough / magnitude;
  const double step = (r < 1.5 ? 1 : r < 3 ? 2 : r < 7 ? 5 : 10) * magnitude;
  // The tolerance keeps 0.9/0.1 = 9.000000000000002 from adding a whole empty step.
  Axis axis;
  axis.step = step;
  axis.lo = std::floor(lo / step + 1e-9) * step;
  axis.hi = std::ceil(hi / step - 1e-9) * step;
  if (!(axis.hi > axis.lo)) axis.hi = axis.lo + step;
  return axis;
}

std::string tick_text(double v, double step) {
  if (std::fabs(v) >= 10000 && std::fmod(std::fabs(v), 1000) == 0) return grouped(v / 1000) + "k";
  if (step >= 1) return grouped(v);
  const int decimals = static_cast<int>(std::ceil(-std::log10(step) - 1e-9));
  if (decimals <= 4) return fixed(v, decimals);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2g", v);
  std::string s = buf; // "2e-05" -> "2e-5"
  const auto e = s.find("e-0");
  if (e != std::string::npos) s.erase(e + 2, 1);
  return s;
}

// ---- Palette ---------------------------------------------------------------------------------

// One colour per phase, everywhere on the page. Compute phases are blues, waiting is warm
// (input orange, exposed all-reduce red), the bookkeeping phases are muted.
constexpr std::array<const char*, train::kPhaseCount> kPhaseColour = {
    "#e8833a", // input
    "#d4b24c", // copy
    "#8fb8de", // forward
    "#3b6ea5", // backward
    "#c8474b", // allreduce
    "#5aa469", // optimizer
    "#9b8ac4", // metrics
    "#a39382", // callbacks
};
constexpr const char* kOtherColour = "#d5d8de";
constexpr const char* kTrainColour = "#3b6ea5";
constexpr const char* kValColour = "#e8833a";

// Text on a segment: dark on the light fills, white on the dark ones. Set as a style: the page's
// CSS for svg text would override a fill attribute.
const char* text_on(const char* fill) {
  const std::string_view f = fill;
  return (f == "#8fb8de" || f == "#d4b24c" || f == kOtherColour) ? "#1d2330" : "#ffffff";
}

// ---- Line charts -----------------------------------------------------------------------------

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

constexpr double kChartW = 560, kChartH = 250;
constexpr double kPlotL = 58, kPlotT = 14, kPlotR = 14, kPlotB = 40;
constexpr double kPlotW = kChartW - kPlotL - kPlotR, kPlotH = kChartH - kPlotT - kPlotB;
// Points stay clear of the axes.
constexpr double kInset = 12;

std::string legend_html(const std::vector<Series>& series) {
  std::string out = "<div class=\"legend\">";
  for (const auto& s : series) {
    if (s.points.empty()) continue;
    out += "<span><svg class=\"swatch\" viewBox=\"0 0 22 10\" width=\"22\" height=\"10\" "
           "aria-hidden=\"true\"><line x1=\"1\" y1=\"5\" x2=\"21\" y2=\"5\" stroke=\"";
    out += s.colour;
    out += "\" stroke-width=\"2.5\"";
    if (s.dashed) out += " stroke-dasharray=\"5 3\"";
    out += "/></svg>" + escape(s.key) + "</span>";
  }
  return out + "</div>";
}

std::string render_chart(const Chart& chart) {
  double ylo = INFINITY, yhi = -INFINITY, xlo = INFINITY, xhi = -INFINITY;
  for (const auto& s : chart.series) {
    for (const auto& [x, y] : s.points) {
      ylo = std::min(ylo, y);
      yhi = std::max(yhi, y);
      xlo = std::min(xlo, x);
      xhi = std::max(xhi, x);
    }
  }
  const bool empty = !(ylo <= yhi);

  std::string out = "<figure class=\"chart-card\"><div class=\"chart-head\"><h3>" +
                    escape(chart.title) + "</h3>" + legend_html(chart.series) + "</div>";
  out += "<svg class=\"chart\" data-chart=\"" + escape(chart.id) + "\" viewBox=\"0 0 " +
         coord(kChartW) + " " + coord(kChartH) + "\" role=\"img\" aria-label=\"" +
         escape(chart.title) + " per epoch\" data-plot=\"" + coord(kPlotL) + " " + coord(kPlotT) +
         " " + coord(kPlotW) + " " + coord(kPlotH) + "\"";
  if (empty) {
    out += ">";
    out += "<rect x=\"" + coord(kPlotL) + "\" y=\"" + coord(kPlotT) + "\" width=\"" +
           coord(kPlotW) + "\" height=\"" + coord(kPlotH) + "\" class=\"empty\"/>";
    out += "<text x=\"" + coord(kPlotL + kPlotW / 2) + "\" y=\"" + coord(kPlotT + kPlotH / 2) +
           "\" text-anchor=\"middle\" class=\"muted\">no finite values recorded</text>";
    return out + "</svg></figure>";
  }

  const Axis y = nice_axis(ylo, yhi, chart.zero_based);
  // Epochs are whole numbers: integer ticks, and one epoch sits in the middle.
  Axis x;
  if (xhi > xlo) {
    x = nice_axis(xlo, xhi, false, 8);
    x.step = std::max(1.0, x.step);
    x.lo = xlo;
    x.hi = xhi;
  } else {
    x.lo = xlo - 1;
    x.hi = xlo + 1;
    x.step = 1;
  }
  auto px = [&](double v) { return kPlotL + kInset + x.fraction(v) * (kPlotW - 2 * kInset); };
  auto py = [&](double v) { return kPlotT + (1 - y.fraction(v)) * kPlotH; };

  char domain[80];
  std::snprintf(domain, sizeof domain, "%.9g %.9g", y.lo, y.hi);
  out += std::string(" data-y-domain=\"") + domain + "\">";

  // Grid and y ticks.
  out += "<g class=\"grid\">";
  for (double t : y.ticks()) {
    const std::string yy = coord(py(t));
    out += "<line x1=\"" + coord(kPlotL) + "\" x2=\"" + coord(kPlotL + kPlotW) + "\" y1=\"" + yy +
           "\" y2=\"" + yy + "\"/>";
  }
  out += "</g><g class=\"tick-labels\">";
  for (double t : y.ticks()) {
    out += "<text x=\"" + coord(kPlotL - 8) + "\" y=\"" + coord(py(t) + 4) +
           "\" text-anchor=\"end\">" + escape(tick_text(t, y.step)) + "</text>";
  }
  // x ticks: whole epochs, multiples of the step; one epoch gets its own tick alone.
  std::vector<double> epoch_ticks;
  if (xhi > xlo) {
    for (double e = std::ceil(x.lo / x.step - 1e-9) * x.step; e <= x.hi + 1e-9; e += x.step) {
      epoch_ticks.push_back(e);
    }
  } else {
    epoch_ticks.push_back(xlo);
  }
  for (double e : epoch_ticks) {
    const std::string xx = coord(px(e));
    out += "<line class=\"tick\" x1=\"" + xx + "\" x2=\"" + xx + "\" y1=\"" +
           coord(kPlotT + kPlotH) + "\" y2=\"" + coord(kPlotT + kPlotH + 4) + "\"/>";
    out += "<text x=\"" + xx + "\" y=\"" + coord(kPlotT + kPlotH + 17) +
           "\" text-anchor=\"middle\">" + grouped(e) + "</text>";
  }
  out += "<text class=\"axis-title\" x=\"" + coord(kPlotL + kPlotW / 2) + "\" y=\"" +
         coord(kChartH - 4) + "\" text-anchor=\"middle\">epoch</text>";
  out += "</g>";
  out += "<line class=\"axis\" x1=\"" + coord(kPlotL) + "\" x2=\"" + coord(kPlotL + kPlotW) +
         "\" y1=\"" + coord(kPlotT + kPlotH) + "\" y2=\"" + coord(kPlotT + kPlotH) + "\"/>";

  // Series: the line, then a marker per epoch with a native tooltip. A single epoch is a
  // marker alone (a one-point path draws nothing).
  for (const auto& s : chart.series) {
    if (s.points.empty()) continue;
    std::string d;
    for (std::size_t i = 0; i < s.points.size(); ++i) {
      d += (i == 0 ? "M" : " L") + coord(px(s.points[i].first)) + " " +
           coord(py(s.points[i].second));
    }
    out += "<path class=\"series\" data-series=\"" + escape(s.key) + "\" data-points=\"" +
           std::to_string(s.points.size()) + "\" d=\"" + d + "\" fill=\"none\" stroke=\"" +
           s.colour + "\" stroke-width=\"2.25\"" +
           " stroke-linejoin=\"round\" stroke-linecap=\"round\"" +
           (s.dashed ? " stroke-dasharray=\"6 4\"" : "") + "/>";
    const double r = s.points.size() <= 30 ? 3.5 : 2.25;
    out += "<g class=\"markers\">";
    for (const auto& [e, v] : s.points) {
      out += "<circle data-series=\"" + escape(s.key) + "\" data-epoch=\"" + grouped(e) +
             "\" cx=\"" + coord(px(e)) + "\" cy=\"" + coord(py(v)) + "\" r=\"" + coord(r) +
             "\" fill=\"" + (s.dashed ? "#ffffff" : s.colour) + "\" stroke=\"" + s.colour +
             "\" stroke-width=\"1.5\"><title>epoch " + grouped(e) + " · " + escape(s.key) + " " +
             escape(value_text(v)) + "</title></circle>";
    }
    out += "</g>";
  }
  return out + "</svg></figure>";
}

// Loss first, then the metrics in the order fit() logged them, each with its val_ twin; the
// learning rate last, then throughput.
std::vector<Chart> curve_charts(const RunSummary& run) {
  std::vector<std::string> keys;
  for (const auto& e : run.epochs) {
    for (const auto& kv : e.values) {
      if (std::find(keys.begin(), keys.end(), kv.first) == keys.end()) keys.push_back(kv.first);
    }
  }
  auto base_of = [](const std::string& k) { return k.rfind("val_", 0) == 0 ? k.substr(4) : k; };
  std::vector<std::string> bases;
  for (const auto& k : keys) {
    const std::string b = base_of(k);
    if (std::find(bases.begin(), bases.end(), b) == bases.end()) bases.push_back(b);
  }
  std::stable_partition(bases.begin(), bases.end(),
                        [](const std::string& b) { return b == "loss"; });
  std::stable_partition(bases.begin(), bases.end(),
                        [](const std::string& b) { return b != "learning_rate"; });

  auto series_of = [&](const std::string& key, const char* colour, bool dashed) {
    Series s{key, colour, dashed, {}};
    for (const auto& e : run.epochs) {
      const double v = e.value(key);
      if (std::isfinite(v)) s.points.emplace_back(e.epoch, v);
    }
    return s;
  };
  auto title_of = [](const std::string& b) {
    if (b == "loss") return std::string("Loss");
    if (b == "accuracy") return std::string("Accuracy");
    if (b == "learning_rate") return std::string("Learning rate");
    return b;
  };

  std::vector<Chart> charts;
  for (const auto& b : bases) {
    Chart c{b, title_of(b), b == "learning_rate", {}};
    const bool has_train = std::find(keys.begin(), keys.end(), b) != keys.end();
    const bool has_val = std::find(keys.begin(), keys.end(), "val_" + b) != keys.end();
    if (has_train)
      c.series.push_back(series_of(b, b == "learning_rate" ? "#5aa469" : kTrainColour, false));
    if (has_val) c.series.push_back(series_of("val_" + b, kValColour, true));
    charts.push_back(std::move(c));
  }
  Chart throughput{"samples_per_s", "Throughput (samples/s)", true, {}};
  Series s{"samples/s", "#7a68b3", false, {}};
  for (const auto& e : run.epochs) {
    // 0 means not measured.
    if (std::isfinite(e.samples_per_s) && e.samples_per_s > 0) {
      s.points.emplace_back(e.epoch, e.samples_per_s);
    }
  }
  throughput.series.push_back(std::move(s));
  charts.push_back(std::move(throughput));
  return charts;
}

// ---- Step-time bars --------------------------------------------------------------------------

double ms_per_step(double seconds, std::int64_t steps) {
  return steps > 0 && std::isfinite(seconds) ? seconds * 1000.0 / static_cast<double>(steps) : 0;
}

// Clock reads between phases leave a little of the step unattributed; shown as "other" only
// when it is more than noise.
double other_ms(const PhaseTimes& p) {
  const double gap = ms_per_step(p.step_seconds - p.sum(), p.steps);
  return gap > 0.01 * ms_per_step(p.step_seconds, p.steps) ? gap : 0;
}

std::string phase_legend(bool with_other) {
  std::string out = "<div class=\"legend phase-legend\">";
  for (int i = 0; i < train::kPhaseCount; ++i) {
    out += "<span><i style=\"background:" + std::string(kPhaseColour[static_cast<std::size_t>(i)]) +
           "\"></i>" + train::phase_name(static_cast<Phase>(i)) + "</span>";
  }
  if (with_other)
    out += "<span><i style=\"background:" + std::string(kOtherColour) + "\"></i>other</span>";
  return out + "</div>";
}

std::string render_bars(const std::vector<PhaseTimes>& workers) {
  constexpr double kW = 1100, kLeft = 84, kRight = 84, kTop = 8, kRow = 36, kBar = 24, kBottom = 40;
  const double plot_w = kW - kLeft - kRight;
  const double h = kTop + kRow * static_cast<double>(workers.size()) + kBottom;

  double longest = 0;
  for (const auto& w : workers) {
    double total = other_ms(w);
    for (double s : w.seconds) total += ms_per_step(s, w.steps);
    longest = std::max(longest, total);
  }
  const Axis x = nice_axis(0, longest > 0 ? longest : 1, true, 7);
  auto px = [&](double ms) { return kLeft + x.fraction(ms) * plot_w; };
  const double plot_bottom = kTop + kRow * static_cast<double>(workers.size());

  std::string out = "<svg class=\"chart bars\" data-chart=\"step_phases\" viewBox=\"0 0 " +
                    coord(kW) + " " + coord(h) + "\" role=\"img\" aria-label=\"Step time by " +
                    "phase, per worker\">";
  out += "<g class=\"grid\">";
  for (double t : x.ticks()) {
    out += "<line x1=\"" + coord(px(t)) + "\" x2=\"" + coord(px(t)) + "\" y1=\"" + coord(kTop) +
           "\" y2=\"" + coord(plot_bottom) + "\"/>";
  }
  out += "</g><g class=\"tick-labels\">";
  for (double t : x.ticks()) {
    out += "<text x=\"" + coord(px(t)) + "\" y=\"" + coord(plot_bottom + 16) +
           "\" text-anchor=\"middle\">" + escape(tick_text(t, x.step)) + "</text>";
  }
  out += "<text class=\"axis-title\" x=\"" + coord(kLeft + plot_w / 2) + "\" y=\"" + coord(h - 4) +
         "\" text-anchor=\"middle\">milliseconds per step</text></g>";

  for (std::size_t r = 0; r < workers.size(); ++r) {
    const PhaseTimes& w = workers[r];
    const double y = kTop + kRow * static_cast<double>(r) + (kRow - kBar) / 2;
    const std::string rank = std::to_string(r);
    out += "<g class=\"bar\" data-worker=\"" + rank + "\">";
    out += "<text class=\"row-label\" x=\"" + coord(kLeft - 10) + "\" y=\"" +
           coord(y + kBar / 2 + 4) + "\" text-anchor=\"end\">worker " + rank + "</text>";
    if (w.steps <= 0) {
      out += "<text class=\"muted\" x=\"" + coord(kLeft + 6) + "\" y=\"" + coord(y + kBar / 2 + 4) +
             "\">no steps timed</text></g>";
      continue;
    }
    const double step_ms = ms_per_step(w.step_seconds, w.steps);
    double at = 0;
    auto segment = [&](const char* name, const char* fill, double ms) {
      if (!(ms > 0)) return;
      const double x0 = px(at), x1 = px(at + ms);
      out += "<rect data-phase=\"" + std::string(name) + "\" x=\"" + coord(x0) + "\" y=\"" +
             coord(y) + "\" width=\"" + coord(std::max(0.0, x1 - x0)) + "\" height=\"" +
             coord(kBar) + "\" fill=\"" + fill + "\"><title>worker " + rank + " · " + name + ": " +
             fixed(ms, 2) + " ms per step (" + percent(step_ms > 0 ? ms / step_ms : 0) +
             ")</title></rect>";
      // A value where it fits; the table below has them all.
      if (x1 - x0 >= 44) {
        out += "<text class=\"in-bar\" x=\"" + coord((x0 + x1) / 2) + "\" y=\"" +
               coord(y + kBar / 2 + 4) + "\" text-anchor=\"middle\" style=\"fill:" + text_on(fill) +
               "\">" + fixed(ms, ms < 10 ? 2 : 1) + "</text>";
      }
      at += ms;
    };
    for (int i = 0; i < train::kPhaseCount; ++i) {
      segment(train::phase_name(static_cast<Phase>(i)), kPhaseColour[static_cast<std::size_t>(i)],
              ms_per_step(w.seconds[static_cast<std::size_t>(i)], w.steps));
    }
    segment("other", kOtherColour, other_ms(w));
    out += "<text class=\"total\" x=\"" + coord(px(at) + 8) + "\" y=\"" + coord(y + kBar / 2 + 4) +
           "\">" + fixed(step_ms, 2) + " ms</text>";
    out += "</g>";
  }
  out += "<line class=\"axis\" x1=\"" + coord(kLeft) + "\" x2=\"" + coord(kLeft) + "\" y1=\"" +
         coord(kTop) + "\" y2=\"" + coord(plot_bottom) + "\"/>";
  return out + "</svg>";
}

std::string phase_table(const std::vector<PhaseTimes>& workers) {
  std::string out = "<table class=\"phases\"><thead><tr><th>worker</th>";
  for (int i = 0; i < train::kPhaseCount; ++i) {
    out += "<th><i style=\"background:" + std::string(kPhaseColour[static_cast<std::size_t>(i)]) +
           "\"></i>" + train::phase_name(static_cast<Phase>(i)) + "</th>";
  }
  out += "<th>step</th><th>input share</th><th>all-reduce in flight</th><th>hidden</th>"
         "</tr></thead><tbody>";
  for (std::size_t r = 0; r < workers.size(); ++r) {
    const PhaseTimes& w = workers[r];
    out += "<tr><td>" + std::to_string(r) + "</td>";
    for (double s : w.seconds) out += "<td>" + fixed(ms_per_step(s, w.steps), 2) + "</td>";
    out += "<td><b>" + fixed(ms_per_step(w.step_seconds, w.steps), 2) + "</b></td>";
    out += "<td>" + percent(w.input_share()) + "</td>";
    if (w.comm_seconds > 0) {
      out += "<td>" + fixed(ms_per_step(w.comm_seconds, w.steps), 2) + "</td><td>" +
             percent(w.hidden_share(), 0) + "</td>";
    } else {
      out += "<td>–</td><td>–</td>";
    }
    out += "</tr>";
  }
  return out + "</tbody></table><p class=\"caption\">Milliseconds per step (phase seconds over "
               "steps), from the last epoch. The phases run one after another and add up to the "
               "step.</p>";
}

// ---- Page sections ---------------------------------------------------------------------------

// The latest finite value of `key`, NaN if none.
double last_value(const RunSummary& run, const std::string& key) {
  for (auto it = run.epochs.rbegin(); it != run.epochs.rend(); ++it) {
    const double v = it->value(key);
    if (std::isfinite(v)) return v;
  }
  return NAN;
}

std::string accuracy_key(const RunSummary& run) {
  for (const auto& e : run.epochs) {
    for (const auto& kv : e.values) {
      if (kv.first.rfind("val_", 0) != 0 && kv.first.find("accuracy") != std::string::npos) {
        return kv.first;
      }
    }
  }
  return "accuracy";
}

std::string card(const std::string& label, const std::string& value, const std::string& note,
                 const std::string& tone = "") {
  return "<div class=\"card" + (tone.empty() ? "" : " " + tone) + "\"><div class=\"label\">" +
         label + "</div><div class=\"value\">" + value + "</div><div class=\"note\">" + note +
         "</div></div>";
}

std::string plural(std::int64_t n, const char* one, const char* many) {
  return grouped(static_cast<double>(n)) + " " + (n == 1 ? one : many);
}

std::string header_html(const RunSummary& run) {
  const RecipeFacts& f = run.recipe;
  std::string out = "<header><div class=\"eyebrow\">flotilla · training report</div><h1>" +
                    escape(f.model.empty() ? "training run" : f.model) + "</h1>";
  std::vector<std::string> facts;
  std::string topology = plural(f.workers, "worker", "workers") + " × " +
                         plural(f.replicas_per_worker, "replica", "replicas");
  const std::int64_t in_sync = static_cast<std::int64_t>(f.workers) * f.replicas_per_worker;
  if (in_sync > 1 && f.replicas_per_worker > 1) topology += " (" + grouped(in_sync) + " in sync)";
  facts.push_back(topology);
  if (f.global_batch > 0) {
    std::string batch = "global batch " + grouped(static_cast<double>(f.global_batch));
    if (f.batch_per_replica > 0) {
      batch += " (" + grouped(static_cast<double>(f.batch_per_replica)) + " per replica)";
    }
    facts.push_back(batch);
  }
  if (!f.precision.empty()) facts.push_back(escape(f.precision));
  if (!f.device.empty()) facts.push_back(escape(f.device));
  if (!run.started.empty()) facts.push_back("started " + escape(run.started));
  out += "<p class=\"sub\">";
  for (std::size_t i = 0; i < facts.size(); ++i) {
    out += (i ? "<span class=\"dot\">·</span>" : "") + facts[i];
  }
  out += "</p>";
  if (!run.command.empty()) {
    out += "<pre class=\"cmd\"><code><span class=\"prompt\">$ </span>" + escape(run.command) +
           "</code></pre>";
  }
  return out + "</header>";
}

std::string figures_html(const RunSummary& run, const std::vector<PhaseTimes>& steady) {
  std::string out = "<section class=\"cards\" aria-label=\"Key figures\">";
  const double loss = last_value(run, "loss"), val_loss = last_value(run, "val_loss");
  out += card("Final loss", value_text(loss),
              std::isfinite(val_loss) ? "val_loss " + value_text(val_loss) : "training loss");
  const std::string acc_key = accuracy_key(run);
  const double acc = last_value(run, acc_key), val_acc = last_value(run, "val_" + acc_key);
  auto acc_text = [](double v) {
    return std::isfinite(v) && v >= 0 && v <= 1 ? percent(v, 2) : value_text(v);
  };
  out += card("Final " + escape(acc_key), acc_text(acc),
              std::isfinite(val_acc) ? "val " + acc_text(val_acc) : "training");

  double samples = NAN;
  if (!run.epochs.empty() && run.epochs.back().samples_per_s > 0) {
    samples = run.epochs.back().samples_per_s;
  }
  out += card("Throughput", grouped(samples), "samples/s, last epoch");

  PhaseTimes all;
  double slowest = 0;
  std::size_t slowest_rank = 0;
  for (std::size_t r = 0; r < steady.size(); ++r) {
    all += steady[r];
    const double ms = ms_per_step(steady[r].step_seconds, steady[r].steps);
    if (ms > slowest) {
      slowest = ms;
      slowest_rank = r;
    }
  }
  if (all.steps > 0) {
    out +=
        card("Step time", fixed(ms_per_step(all.step_seconds, all.steps), 2) + "<small> ms</small>",
             steady.size() > 1 ? "mean; slowest: worker " + std::to_string(slowest_rank) + ", " +
                                     fixed(slowest, 2) + " ms"
                               : "per step, last epoch");
    const double share = all.input_share();
    const auto bound = train::classify_input_bound(share);
    const char* tone = bound == train::InputBound::kNo           ? "good"
                       : bound == train::InputBound::kModerately ? "warn"
                                                                 : "bad";
    out += card("Input-bound", percent(share), train::to_string(bound), tone);
    if (all.comm_seconds > 0) {
      out += card("All-reduce hidden", percent(all.hidden_share(), 0),
                  "behind backward; " + fixed(ms_per_step(all[Phase::kAllReduce], all.steps), 2) +
                      " ms exposed per step");
    }
  } else {
    out += card("Step time", "–", "no steps timed");
    out += card("Input-bound", "–", "no steps timed");
  }
  return out + "</section>";
}

std::string setup_html(const RecipeFacts& f) {
  std::vector<std::pair<std::string, std::string>> rows;
  auto add = [&](const char* k, const std::string& v) {
    if (!v.empty()) rows.emplace_back(k, v);
  };
  if (f.parameters > 0) add("parameters", count_text(f.parameters));
  add("optimizer", escape(f.optimizer));
  if (f.peak_lr > 0) {
    std::string lr = value_text(f.peak_lr);
    if (!f.lr_scaling.empty()) lr += " (" + escape(f.lr_scaling) + " scaling";
    if (f.base_lr > 0 && f.base_batch > 0) {
      lr += ", " + value_text(f.base_lr) + " per " + grouped(static_cast<double>(f.base_batch));
    }
    if (!f.lr_scaling.empty()) lr += ")";
    add("peak learning rate", lr);
  }
  if (!f.schedule.empty()) {
    std::string s = escape(f.schedule);
    if (f.warmup_steps > 0) s += ", " + grouped(static_cast<double>(f.warmup_steps)) + " warmup";
    if (f.total_steps > 0) s += ", " + grouped(static_cast<double>(f.total_steps)) + " steps";
    add("schedule", s);
  }
  std::string precision = escape(f.precision);
  if (f.loss_scaling) precision += ", loss scaling";
  if (f.hardware_bf16) precision += ", native bf16";
  if (f.hardware_fp16) precision += ", fast fp16";
  add("precision", precision);
  add("compiled step",
      f.jit_compile ? "requested" + std::string(f.compiled_step_available ? ", available"
                                                                          : ", not available here")
                    : (f.compiled_step_available ? "off (available)" : "off"));
  if (f.threads_per_worker > 0) {
    add("threads", std::to_string(f.threads_per_worker) + " per worker" +
                       (f.cores > 0 ? ", " + std::to_string(f.cores) + " cores" : "") +
                       (f.local_workers > 1
                            ? ", " + std::to_string(f.local_workers) + " workers on this machine"
                            : ""));
  }
  if (f.max_batch_per_replica > 0) {
    add("largest batch that fits",
        grouped(static_cast<double>(f.max_batch_per_replica)) + " per replica");
  }
  if (f.peak_memory_bytes > 0) {
    add("peak memory",
        bytes_text(f.peak_memory_bytes) +
            (f.memory_budget_bytes > 0 ? " of " + bytes_text(f.memory_budget_bytes) + " budget"
                                       : ""));
  }
  if (f.gradient_bytes > 0) {
    std::string g = bytes_text(f.gradient_bytes) + " per step";
    if (f.buckets > 0) g += " in " + plural(f.buckets, "bucket", "buckets");
    if (f.bytes_per_pack > 0) g += " of " + bytes_text(f.bytes_per_pack);
    g += f.overlap ? ", overlapped" : ", not overlapped";
    if (!f.compression.empty() && f.compression != "none") g += ", " + escape(f.compression);
    add("all-reduce", g);
  }
  add("input pipeline", escape(f.input_pipeline));
  if (rows.empty()) return "";
  std::string out = "<section><h2>Setup</h2><dl class=\"setup\">";
  for (const auto& [k, v] : rows) out += "<div><dt>" + k + "</dt><dd>" + v + "</dd></div>";
  return out + "</dl></section>";
}

// The same words as to_string(Finding::Status); kept here so the page's CSS classes do not
// depend on the doctor's text.
const char* status_word(Finding::Status s) {
  switch (s) {
  case Finding::Status::kGood:
    return "ok";
  case Finding::Status::kConsider:
    return "consider";
  case Finding::Status::kAct:
    return "act";
  case Finding::Status::kUnknown:
    return "unknown";
  }
  return "unknown";
}

std::string findings_html(const std::vector<Finding>& findings, const FindingFormat& format) {
  std::string out = "<section><h2>Recipe checklist</h2>";
  if (findings.empty()) {
    return out + "<p class=\"muted\">The recipe doctor reported nothing for this run.</p>"
                 "</section>";
  }
  std::array<int, 4> counts{};
  for (const auto& f : findings) ++counts[static_cast<std::size_t>(f.status)];
  out += "<p class=\"summary\">";
  const std::array<Finding::Status, 4> order = {Finding::Status::kAct, Finding::Status::kConsider,
                                                Finding::Status::kGood, Finding::Status::kUnknown};
  for (auto s : order) {
    const int n = counts[static_cast<std::size_t>(s)];
    if (n > 0) {
      out += "<span class=\"badge " + std::string(status_word(s)) + "\">" + std::to_string(n) +
             " " + status_word(s) + "</span>";
    }
  }
  out += "<span class=\"muted\">most valuable first</span></p>";
  out += "<table class=\"findings\"><thead><tr><th></th><th>item</th><th>status</th>"
         "<th>evidence</th><th>what to do</th></tr></thead><tbody>";
  for (std::size_t i = 0; i < findings.size(); ++i) {
    const Finding& f = findings[i];
    const char* word = status_word(f.status);
    out += "<tr class=\"finding " + std::string(word) + "\"><td class=\"n\">" +
           std::to_string(i + 1) + "</td><td class=\"item\">" + escape(f.item) +
           "</td><td><span class=\"badge " + word + "\">" + word + "</span></td><td>" +
           escape(f.evidence) + "</td><td>";
    out += escape(format_recommendation(f, format));
    // A gain that rounds to 0% says nothing; a passed item has nothing left to gain.
    if (f.status != Finding::Status::kGood && std::isfinite(f.gain) && f.gain >= 0.005) {
      out += " <span class=\"gain\">up to " + percent(f.gain, 0) + " of step time</span>";
    }
    out += "</td></tr>";
  }
  return out + "</tbody></table></section>";
}

constexpr const char* kStyle = R"css(
:root{--ink:#1d2330;--muted:#5d6675;--line:#e2e5ea;--bg:#f5f6f8;--card:#fff}
*{box-sizing:border-box}
html{-webkit-print-color-adjust:exact;print-color-adjust:exact}
body{margin:0;background:var(--bg);color:var(--ink);
  font:14px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif}
main{max-width:1180px;margin:0 auto;padding:32px 28px 40px}
header h1{font-size:30px;line-height:1.2;margin:4px 0 6px;font-weight:700;letter-spacing:-.01em}
.eyebrow{text-transform:uppercase;letter-spacing:.09em;font-size:11.5px;color:var(--muted);
  font-weight:600}
.sub{color:var(--muted);margin:0 0 14px;font-size:14.5px}
.dot{margin:0 .5em;color:#b0b6c0}
.cmd{margin:0;background:#1f2633;color:#e6eaf0;padding:10px 14px;border-radius:8px;
  font:12.5px/1.55 ui-monospace,SFMono-Regular,Menlo,Consolas,"Liberation Mono",monospace;
  white-space:pre-wrap;word-break:break-all}
.cmd .prompt{color:#8e99ab;user-select:none}
section{margin-top:26px}
h2{font-size:17px;margin:0 0 12px;font-weight:650}
h3{font-size:14px;margin:0;font-weight:600}
.muted{color:var(--muted);fill:var(--muted)}
.cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(165px,1fr));gap:12px}
.card{background:var(--card);border:1px solid var(--line);border-radius:10px;padding:12px 14px;
  border-top:3px solid #c9ced6}
.card.good{border-top-color:#5aa469}.card.warn{border-top-color:#e0a33a}
.card.bad{border-top-color:#c8474b}
.card .label{font-size:11.5px;color:var(--muted);text-transform:uppercase;letter-spacing:.05em;
  font-weight:600}
.card .value{font-size:25px;font-weight:650;font-variant-numeric:tabular-nums;line-height:1.3;
  margin-top:2px}
.card .value small{font-size:14px;font-weight:500;color:var(--muted)}
.card .note{font-size:12.5px;color:var(--muted)}
.setup{display:grid;grid-template-columns:repeat(2,1fr);gap:0 32px;margin:0;
  background:var(--card);border:1px solid var(--line);border-radius:10px;padding:6px 16px}
.setup div{display:flex;gap:10px;padding:7px 0;border-bottom:1px solid #eef0f3}
.setup dt{color:var(--muted);width:150px;flex:none}
.setup dd{margin:0;font-variant-numeric:tabular-nums}
.charts{display:grid;grid-template-columns:1fr 1fr;gap:14px}
.chart-card,.panel{margin:0;background:var(--card);border:1px solid var(--line);
  border-radius:10px;padding:12px 14px 6px}
.chart-head{display:flex;justify-content:space-between;align-items:center;gap:12px;
  margin-bottom:2px}
.legend{display:flex;gap:14px;flex-wrap:wrap;font-size:12.5px;color:var(--muted)}
.legend span{display:inline-flex;align-items:center;gap:6px}
.legend i,.phases th i{display:inline-block;width:11px;height:11px;border-radius:2px}
.phase-legend{margin:2px 0 8px}
svg.chart{display:block;width:100%;height:auto}
svg text{font-size:11px;fill:#5d6675;font-variant-numeric:tabular-nums}
svg .axis-title{font-size:11px;fill:#8a93a1}
svg .grid line{stroke:#eceef2;stroke-width:1}
svg .axis,svg .tick{stroke:#9aa2ae;stroke-width:1}
svg .empty{fill:#fafbfc;stroke:#eceef2}
svg .row-label{font-size:12.5px;fill:#1d2330;font-weight:600}
svg .total{font-size:12px;fill:#1d2330;font-weight:600}
svg text.in-bar{font-size:11px;font-weight:600}
svg circle:hover{stroke-width:3}
svg rect[data-phase]:hover{opacity:.85}
.note-line{margin:6px 0 0;color:var(--ink)}
.note-line.muted{color:var(--muted)}
table{border-collapse:collapse;width:100%;font-variant-numeric:tabular-nums}
th{font-weight:600;color:var(--muted);font-size:12px;text-align:left}
th,td{padding:7px 8px;border-bottom:1px solid #eef0f3;vertical-align:top}
.phases{font-size:12.5px;margin-top:6px}
.phases th,.phases td{text-align:right;white-space:nowrap}
.phases th:first-child,.phases td:first-child{text-align:left}
.phases th i{margin-right:5px;vertical-align:-1px}
.caption{font-size:12px;color:var(--muted);margin:8px 0 4px}
.findings{background:var(--card);border:1px solid var(--line);border-radius:10px;
  border-collapse:separate;border-spacing:0;overflow:hidden}
.findings th{background:#fafbfc}
.findings td{font-size:13.5px}
.findings tr:last-child td{border-bottom:none}
.findings .n{color:var(--muted);width:28px;text-align:right}
.findings .item{font-weight:600;white-space:nowrap}
.findings td:nth-child(4){color:#3b4350;max-width:420px}
.badge{display:inline-block;padding:1px 9px;border-radius:999px;font-size:12px;font-weight:600;
  white-space:nowrap;border:1px solid transparent}
.badge.ok{background:#e7f4ea;color:#1f6b34;border-color:#c7e5cf}
.badge.consider{background:#fdf3e1;color:#8a5a00;border-color:#f1dcae}
.badge.act{background:#fbe8e8;color:#a12c30;border-color:#f1c4c5}
.badge.unknown{background:#eef0f3;color:#596272;border-color:#dde1e7}
.summary{display:flex;gap:8px;align-items:center;margin:-4px 0 10px}
.gain{display:inline-block;margin-left:4px;font-size:12px;color:var(--muted)}
footer{margin-top:30px;font-size:12px;color:var(--muted)}
@media (max-width:820px){.charts{grid-template-columns:1fr}.setup{grid-template-columns:1fr}}
@media print{
  body{background:#fff;font-size:12px}
  main{max-width:none;padding:0}
  .card,.chart-card,.panel,.setup,.findings tr{break-inside:avoid}
  .cmd{background:#f3f4f6;color:#111;border:1px solid #d8dbe0}
  .cmd .prompt{color:#666}
  section{break-inside:auto}
}
)css";

} // namespace

std::string render_html_report(const RunSummary& run, const std::vector<Finding>& findings,
                               const FindingFormat& format) {
  const std::vector<PhaseTimes> steady = run.steady_phases();
  std::string title = "flotilla report";
  if (!run.recipe.model.empty()) title += " — " + run.recipe.model;
  if (!run.started.empty()) title += " — " + run.started;

  std::string out;
  out.reserve(64 * 1024);
  out += "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
         "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
         "<meta name=\"generator\" content=\"flotilla\"><title>" +
         escape(title) + "</title><style>" + kStyle + "</style></head><body><main>\n";
  out += header_html(run) + "\n";
  out += figures_html(run, steady) + "\n";
  out += setup_html(run.recipe) + "\n";

  out += "<section><h2>Training curves</h2>";
  if (run.epochs.empty()) {
    out += "<p class=\"muted\">No epochs were recorded.</p>";
  } else {
    out += "<div class=\"charts\">";
    for (const auto& chart : curve_charts(run)) out += render_chart(chart) + "\n";
    out += "</div>";
  }
  out += "</section>\n";

  out += "<section><h2>Step time by phase</h2><div class=\"panel\">";
  bool timed = false;
  bool with_other = false;
  PhaseTimes all;
  for (const auto& w : steady) {
    timed = timed || w.steps > 0;
    with_other = with_other || (w.steps > 0 && other_ms(w) > 0);
    all += w;
  }
  if (!timed) {
    out += "<p class=\"muted\">No step timings were recorded.</p>";
  } else {
    out += phase_legend(with_other) + render_bars(steady) + phase_table(steady);
    if (all.comm_seconds > 0) {
      out += "<p class=\"note-line\">Gradient all-reduce: " +
             fixed(ms_per_step(all.comm_seconds, all.steps), 2) + " ms per step in flight, <b>" +
             percent(all.hidden_share(), 0) + " hidden behind backward</b>; " +
             fixed(ms_per_step(all[Phase::kAllReduce], all.steps), 2) +
             " ms per step exposed (the allreduce phase).</p>";
    } else {
      out += "<p class=\"note-line muted\">No gradient all-reduce was timed (a single worker, "
             "or communication was not measured).</p>";
    }
  }
  out += "</div></section>\n";

  out += findings_html(findings, format) + "\n";
  out += "<footer>Generated by flotilla";
#ifdef FLOTILLA_VERSION
  out += " " + escape(FLOTILLA_VERSION);
#endif
  out += ". A self-contained page: no scripts, fonts or network needed. Hover a point or a "
         "segment for its value.</footer>\n</main></body></html>\n";
  return out;
}

void write_html_report(const std::filesystem::path& path, const RunSummary& run,
                       const std::vector<Finding>& findings, const FindingFormat& format) {
  if (path.empty()) {
    throw ConfigError("the HTML report needs a file name (saw an empty path); give "
                      "profile::write_html_report a path such as report.html");
  }
  base::write_file_atomic(path, render_html_report(run, findings, format));
}

} // namespace flotilla::profile
