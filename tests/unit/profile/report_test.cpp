#include "flotilla/profile/report.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "support/subprocess.h"

namespace flotilla::profile {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

train::PhaseTimes phases(std::int64_t steps, double input_ms, double forward_ms, double backward_ms,
                         double allreduce_ms, double comm_ms) {
  train::PhaseTimes p;
  p.steps = steps;
  const double n = static_cast<double>(steps) / 1000.0; // ms per step -> seconds in total
  p[train::Phase::kInput] = input_ms * n;
  p[train::Phase::kForward] = forward_ms * n;
  p[train::Phase::kBackward] = backward_ms * n;
  p[train::Phase::kAllReduce] = allreduce_ms * n;
  p[train::Phase::kOptimizer] = 4 * n;
  p.step_seconds = p.sum();
  p.comm_seconds = comm_ms * n;
  return p;
}

// 2 workers, 3 epochs; val_loss missing (NaN) in the last epoch.
RunSummary two_workers_three_epochs() {
  RunSummary run;
  run.command = "flotilla train --model \"mlp<wide>\" --tag 'a&b' --report r.html";
  run.started = "2025-02-03T04:05:06Z";
  run.recipe.model = "mlp <wide> & co";
  run.recipe.workers = 2;
  run.recipe.global_batch = 256;
  run.recipe.batch_per_replica = 128;
  run.recipe.precision = "mixed_bfloat16";
  run.recipe.device = "cpu";
  const double loss[] = {0.9, 0.6, 0.45};
  const double val_loss[] = {0.85, 0.7, kNaN};
  const double accuracy[] = {0.7, 0.8, 0.85};
  const double lr[] = {0.1, 0.1, 0.05};
  const double samples[] = {1000, 1200, 1250};
  for (int e = 0; e < 3; ++e) {
    EpochSummary s;
    s.epoch = e + 1;
    s.steps = 100;
    s.seconds = 10;
    s.samples_per_s = samples[e];
    s.values = {{"loss", loss[e]},
                {"accuracy", accuracy[e]},
                {"learning_rate", lr[e]},
                {"val_loss", val_loss[e]}};
    // Worker 0: 2 + 10 + 20 + 2 + 4 = 38 ms; worker 1: 6 + 20 + 20 + 2 + 4 = 52 ms.
    s.workers = {phases(100, 2, 10, 20, 2, 8), phases(100, 6, 20, 20, 2, 8)};
    run.epochs.push_back(s);
  }
  return run;
}

std::vector<Finding> findings() {
  return {{"mixed precision", Finding::Status::kAct, "float32 while <bf16> is native",
           "pass --precision mixed_bfloat16 & re-run", 0.3},
          {"input pipeline", Finding::Status::kConsider, "input wait 11.5% of the step",
           "add prefetch(\"autotune\")", 0.1},
          {"threads", Finding::Status::kGood, "1 thread per worker on 2 cores", "", 0}};
}

// The <svg ...>...</svg> whose data-chart is `chart`; empty if none.
std::string chart_svg(const std::string& html, const std::string& chart) {
  const auto at = html.find("data-chart=\"" + chart + "\"");
  if (at == std::string::npos) return "";
  const auto begin = html.rfind("<svg", at);
  const auto end = html.find("</svg>", at);
  return html.substr(begin, end - begin);
}

// The value of attribute `name` in the first element of `text` that has `marker` (an
// attribute="value" pair), or "" if none.
std::string attribute(const std::string& text, const std::string& marker, const std::string& name) {
  const auto at = text.find(marker);
  if (at == std::string::npos) return "";
  const auto begin = text.rfind('<', at);
  const auto end = text.find('>', at);
  const std::string element = text.substr(begin, end - begin);
  const std::string key = " " + name + "=\"";
  const auto v = element.find(key);
  if (v == std::string::npos) return "";
  const auto from = v + key.size();
  return element.substr(from, element.find('"', from) - from);
}

std::vector<double> numbers(const std::string& text) {
  std::istringstream in(text);
  std::vector<double> out;
  for (double v; in >> v;) out.push_back(v);
  return out;
}

// series name -> data-points of each <path> with data-series in `svg`.
std::map<std::string, int> series_points(const std::string& svg) {
  std::map<std::string, int> out;
  for (auto at = svg.find("<path"); at != std::string::npos; at = svg.find("<path", at + 1)) {
    const std::string element = svg.substr(at, svg.find('>', at) - at);
    const auto s = element.find("data-series=\"");
    const auto p = element.find("data-points=\"");
    if (s == std::string::npos || p == std::string::npos) continue;
    const std::string name = element.substr(s + 13, element.find('"', s + 13) - (s + 13));
    out[name] = std::atoi(element.c_str() + p + 13);
  }
  return out;
}

int count(const std::string& text, const std::string& what) {
  int n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// Every geometric attribute inside every <svg> holds numbers (and path letters) only: a "nan"
// or "inf" there makes the browser log an error and drop the element.
void expect_clean_svg_numbers(const std::string& html) {
  const char* names[] = {"x",          "y",  "x1",      "x2",        "y1",
                         "y2",         "cx", "cy",      "r",         "width",
                         "height",     "d",  "viewBox", "data-plot", "data-y-domain",
                         "data-points"};
  int checked = 0;
  for (auto svg = html.find("<svg"); svg != std::string::npos; svg = html.find("<svg", svg + 1)) {
    const std::string body = html.substr(svg, html.find("</svg>", svg) - svg);
    for (const char* name : names) {
      const std::string key = std::string(" ") + name + "=\"";
      for (auto at = body.find(key); at != std::string::npos; at = body.find(key, at + 1)) {
        const auto from = at + key.size();
        const std::string value = body.substr(from, body.find('"', from) - from);
        EXPECT_EQ(value.find_first_not_of("0123456789.-+eML "), std::string::npos)
            << name << "=\"" << value << "\"";
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 0);
}

TEST(HtmlReport, EscapesTheCommandModelAndFindings) {
  const std::string html = render_html_report(two_workers_three_epochs(), findings());
  EXPECT_NE(html.find("flotilla train --model &quot;mlp&lt;wide&gt;&quot; --tag &#39;a&amp;b&#39; "
                      "--report r.html"),
            std::string::npos);
  EXPECT_EQ(html.find("mlp<wide>"), std::string::npos);
  EXPECT_NE(html.find("<h1>mlp &lt;wide&gt; &amp; co</h1>"), std::string::npos);
  EXPECT_EQ(html.find("<bf16>"), std::string::npos);
  // Each finding's text, escaped, in the doctor's order.
  std::size_t last = 0;
  for (const char* text : {"mixed precision", "float32 while &lt;bf16&gt; is native",
                           "pass --precision mixed_bfloat16 &amp; re-run", "input pipeline",
                           "input wait 11.5% of the step", "add prefetch(&quot;autotune&quot;)",
                           "threads", "1 thread per worker on 2 cores"}) {
    const auto at = html.find(text, last);
    ASSERT_NE(at, std::string::npos) << text;
    last = at;
  }
  EXPECT_NE(html.find("up to 30% of step time"), std::string::npos);
  EXPECT_NE(html.find("up to 10% of step time"), std::string::npos);
  EXPECT_EQ(count(html, "<span class=\"badge act\">act</span>"), 1);
  EXPECT_EQ(count(html, "<span class=\"badge consider\">consider</span>"), 1);
  EXPECT_EQ(count(html, "<span class=\"badge ok\">ok</span>"), 1);
}

TEST(HtmlReport, SettingsShowInApiTermsOrAsTheCallersFormat) {
  auto with_settings = findings();
  with_settings[0].recommendation = "tensor cores <idle>";
  with_settings[0].settings = {{"train::set_global_policy", "mixed_bfloat16"},
                               {"CompileOptions::jit_compile", "true"}};
  const std::string api = render_html_report(two_workers_three_epochs(), with_settings);
  EXPECT_NE(api.find("<td>train::set_global_policy(mixed_bfloat16), CompileOptions::jit_compile = "
                     "true: tensor cores &lt;idle&gt;"),
            std::string::npos)
      << api;
  FindingFormat flags;
  flags.setting = [](const Setting& s) { return "--" + s.value + " <flag>"; };
  const std::string cli = render_html_report(two_workers_three_epochs(), with_settings, flags);
  EXPECT_NE(cli.find("<td>--mixed_bfloat16 &lt;flag&gt;, --true &lt;flag&gt;: tensor cores "
                     "&lt;idle&gt;"),
            std::string::npos)
      << cli;
  EXPECT_EQ(cli.find("train::set_global_policy"), std::string::npos);
}

TEST(HtmlReport, OneSeriesPerCurveWithItsFinitePoints) {
  const std::string html = render_html_report(two_workers_three_epochs(), findings());
  EXPECT_EQ(series_points(chart_svg(html, "loss")),
            (std::map<std::string, int>{{"loss", 3}, {"val_loss", 2}}));
  EXPECT_EQ(series_points(chart_svg(html, "accuracy")),
            (std::map<std::string, int>{{"accuracy", 3}}));
  EXPECT_EQ(series_points(chart_svg(html, "learning_rate")),
            (std::map<std::string, int>{{"learning_rate", 3}}));
  EXPECT_EQ(series_points(chart_svg(html, "samples_per_s")),
            (std::map<std::string, int>{{"samples/s", 3}}));
  // A marker per finite point: 3 + 2 + 3 + 3 + 3.
  EXPECT_EQ(count(html, "<circle data-series="), 14);
  expect_clean_svg_numbers(html);
}

TEST(HtmlReport, MapsValuesToThePlotArea) {
  const std::string svg =
      chart_svg(render_html_report(two_workers_three_epochs(), findings()), "loss");
  const std::vector<double> plot = numbers(attribute(svg, "data-chart=", "data-plot"));
  ASSERT_EQ(plot.size(), 4u);
  const double top = plot[1], height = plot[3];
  // Losses span 0.45..0.9: steps of 0.1, the domain widened to 0.4..0.9.
  EXPECT_EQ(numbers(attribute(svg, "data-chart=", "data-y-domain")),
            (std::vector<double>{0.4, 0.9}));
  auto cy = [&](const char* series, int epoch) {
    const std::string marker =
        std::string("data-series=\"") + series + "\" data-epoch=\"" + std::to_string(epoch) + "\"";
    return std::atof(attribute(svg, marker, "cy").c_str());
  };
  auto cx = [&](const char* series, int epoch) {
    const std::string marker =
        std::string("data-series=\"") + series + "\" data-epoch=\"" + std::to_string(epoch) + "\"";
    return std::atof(attribute(svg, marker, "cx").c_str());
  };
  // The highest loss sits on the top edge; the others in proportion (SVG y grows downwards).
  EXPECT_NEAR(cy("loss", 1), top, 0.051);
  EXPECT_NEAR(cy("loss", 2), top + (0.9 - 0.6) / 0.5 * height, 0.051);
  EXPECT_NEAR(cy("loss", 3), top + (0.9 - 0.45) / 0.5 * height, 0.051);
  EXPECT_NEAR(cy("val_loss", 2), top + (0.9 - 0.7) / 0.5 * height, 0.051);
  // Epochs evenly spaced left to right, both series on the same x.
  EXPECT_LT(cx("loss", 1), cx("loss", 2));
  EXPECT_NEAR(cx("loss", 2) - cx("loss", 1), cx("loss", 3) - cx("loss", 2), 0.11);
  EXPECT_NEAR(cx("val_loss", 2), cx("loss", 2), 1e-9);
  // Throughput's axis starts at zero.
  const std::string throughput =
      chart_svg(render_html_report(two_workers_three_epochs(), {}), "samples_per_s");
  EXPECT_EQ(numbers(attribute(throughput, "data-chart=", "data-y-domain")).at(0), 0.0);
}

TEST(HtmlReport, OneStackedBarPerWorkerScaledByMilliseconds) {
  const std::string html = render_html_report(two_workers_three_epochs(), findings());
  const std::string bars = chart_svg(html, "step_phases");
  EXPECT_EQ(count(bars, "<g class=\"bar\" data-worker="), 2);
  auto width = [&](int worker, const char* phase) {
    const auto g = bars.find("data-worker=\"" + std::to_string(worker) + "\"");
    const std::string row = bars.substr(g, bars.find("</g>", g) - g);
    return std::atof(attribute(row, std::string("data-phase=\"") + phase + "\"", "width").c_str());
  };
  // Worker 1's forward (20 ms) is twice worker 0's (10 ms); backward equal; worker 1 input 3x.
  ASSERT_GT(width(0, "forward"), 0);
  EXPECT_NEAR(width(1, "forward") / width(0, "forward"), 2.0, 0.02);
  EXPECT_NEAR(width(1, "backward"), width(0, "backward"), 0.11);
  EXPECT_NEAR(width(1, "input") / width(0, "input"), 3.0, 0.1);
  // Phases with no time draw nothing.
  EXPECT_EQ(width(0, "copy"), 0);
  // Step totals and the all-reduce note: 8 ms in flight, 2 exposed -> 75% hidden.
  EXPECT_NE(bars.find(">38.00 ms<"), std::string::npos);
  EXPECT_NE(bars.find(">52.00 ms<"), std::string::npos);
  EXPECT_NE(html.find("8.00 ms per step in flight, <b>75% hidden behind backward</b>"),
            std::string::npos);
  // Input share over both workers: (2 + 6) / (38 + 52) = 8.9%, TF's "moderately input-bound".
  EXPECT_NE(html.find("8.9%</div><div class=\"note\">moderately input-bound"), std::string::npos);
}

TEST(HtmlReport, OneEpochIsAMarkerNotAnEmptyChart) {
  RunSummary run = two_workers_three_epochs();
  run.epochs.resize(1);
  const std::string html = render_html_report(run, {});
  const std::string svg = chart_svg(html, "loss");
  EXPECT_EQ(series_points(svg), (std::map<std::string, int>{{"loss", 1}, {"val_loss", 1}}));
  EXPECT_EQ(count(svg, "<circle "), 2);
  // A single value gets a range around it, not a zero-height axis.
  const std::vector<double> domain =
      numbers(attribute(chart_svg(html, "accuracy"), "data-chart=", "data-y-domain"));
  EXPECT_EQ(domain, (std::vector<double>{0.6, 0.8}));
  expect_clean_svg_numbers(html);
}

TEST(HtmlReport, MissingAndNonFiniteValuesNeverReachTheMarkup) {
  RunSummary run = two_workers_three_epochs();
  for (auto& e : run.epochs) {
    e.values = {{"loss", kNaN}, {"accuracy", std::numeric_limits<double>::infinity()}};
    e.samples_per_s = kNaN;
    e.workers[1] = train::PhaseTimes{}; // no steps timed
  }
  const std::string html = render_html_report(run, {});
  expect_clean_svg_numbers(html);
  EXPECT_EQ(series_points(chart_svg(html, "loss")), (std::map<std::string, int>{}));
  EXPECT_NE(chart_svg(html, "loss").find("no finite values recorded"), std::string::npos);
  EXPECT_NE(html.find("no steps timed"), std::string::npos);
  EXPECT_NE(html.find("The recipe doctor reported nothing"), std::string::npos);
  for (const char* bad : {">nan", ">inf", "nan%", "inf%", "\"nan", "\"inf"}) {
    EXPECT_EQ(html.find(bad), std::string::npos) << bad;
  }

  const std::string empty = render_html_report(RunSummary{}, {});
  EXPECT_NE(empty.find("No epochs were recorded."), std::string::npos);
  EXPECT_NE(empty.find("No step timings were recorded."), std::string::npos);
  EXPECT_EQ(empty.find("<svg class=\"chart"), std::string::npos);
}

TEST(HtmlReport, WritesTheSamePageToAFile) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/run.html";
  const RunSummary run = two_workers_three_epochs();
  write_html_report(path, run, findings());
  EXPECT_EQ(testing::read_file(path), render_html_report(run, findings()));
  EXPECT_EQ(testing::entries(dir.path()), std::vector<std::string>{"run.html"});
}

} // namespace
} // namespace flotilla::profile
