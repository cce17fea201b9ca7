#include "profile/report_figures.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>

namespace flotilla::profile::detail {

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
static std::string coord(double v) {
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

std::string percent(double share, int decimals) {
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

namespace {

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

} // namespace

// ---- Line charts -----------------------------------------------------------------------------

constexpr double kChartW = 560, kChartH = 250;
constexpr double kPlotL = 58, kPlotT = 14, kPlotR = 14, kPlotB = 40;
constexpr double kPlotW = kChartW - kPlotL - kPlotR, kPlotH = kChartH - kPlotT - kPlotB;
// Points stay clear of the axes.
constexpr double kInset = 12;

static std::string legend_html(const std::vector<Series>& series) {
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

} // namespace flotilla::profile::detail
