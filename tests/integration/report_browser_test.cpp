// The HTML report as a browser sees it: headless Chromium loads a report rendered from a run
// summary that went through its JSON form (as `flotilla train --profile-json` writes it), and the
// test checks that the page loads without console errors, that the DOM after load has every
// chart's data, and that a 1280-wide screenshot was drawn. The screenshot is kept in the build
// folder (tests/report_screenshot.png) for a person to look at. Skipped without Chromium.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "flotilla/profile/report.h"
#include "support/paths.h"
#include "support/subprocess.h"

namespace flotilla::profile {
namespace {

std::string find_chromium() {
  for (const char* candidate :
       {"/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome"}) {
    if (::access(candidate, X_OK) == 0) return candidate;
  }
  return "";
}

// A plausible 2-worker, 12-epoch run: decaying loss, rising accuracy, warmup then cosine
// learning rate, and worker 1 a little slower on input.
RunSummary realistic_run() {
  RunSummary run;
  run.command = "flotilla train --model cnn --epochs 12 --batch 128 --precision "
                "mixed_bfloat16 --tag \"a<b & c>d\" --report run.html";
  run.started = "2025-01-14T09:30:00Z";
  RecipeFacts& f = run.recipe;
  f.model = "cnn <fashion-mnist>";
  f.device = "cpu";
  f.workers = 2;
  f.replicas_per_worker = 1;
  f.batch_per_replica = 128;
  f.global_batch = 256;
  f.precision = "mixed_bfloat16";
  f.optimizer = "SGD(momentum=0.9)";
  f.base_lr = 0.1;
  f.base_batch = 256;
  f.lr_scaling = "linear";
  f.peak_lr = 0.1;
  f.schedule = "cosine";
  f.warmup_steps = 200;
  f.total_steps = 2808;
  f.threads_per_worker = 1;
  f.cores = 2;
  f.local_workers = 2;
  f.parameters = 421642;
  f.gradient_bytes = 1686568;
  f.bytes_per_pack = 4 << 20;
  f.buckets = 1;
  f.peak_memory_bytes = 612LL << 20;
  f.input_pipeline = "shard(2) -> shuffle(10000) -> batch(128) -> prefetch(autotune)";
  const int epochs = 12;
  for (int e = 1; e <= epochs; ++e) {
    EpochSummary s;
    s.epoch = e;
    s.steps = 234;
    s.seconds = 11.2 - (e == 1 ? -1.4 : 0.05 * e);
    s.samples_per_s = 234.0 * 256 / s.seconds;
    const double t = static_cast<double>(e - 1) / (epochs - 1);
    const double loss = 0.32 + 0.55 * std::exp(-3.2 * t);
    s.values = {{"loss", loss},
                {"accuracy", 0.93 - 0.14 * std::exp(-3.0 * t)},
                {"learning_rate", e == 1 ? 0.05 : 0.1 * 0.5 * (1 + std::cos(M_PI * t))},
                {"val_loss", loss + 0.03 + 0.01 * t},
                {"val_accuracy", 0.915 - 0.13 * std::exp(-2.8 * t)}};
    for (int w = 0; w < 2; ++w) {
      train::PhaseTimes p;
      p.steps = s.steps;
      const double n = static_cast<double>(s.steps);
      p[train::Phase::kInput] = n * (w == 0 ? 0.0011 : 0.0034);
      p[train::Phase::kCopy] = n * 0.0002;
      p[train::Phase::kForward] = n * 0.0121;
      p[train::Phase::kBackward] = n * 0.0236;
      p[train::Phase::kAllReduce] = n * (w == 0 ? 0.0031 : 0.0008);
      p[train::Phase::kOptimizer] = n * 0.0042;
      p[train::Phase::kMetrics] = n * 0.0009;
      p[train::Phase::kCallbacks] = n * 0.0003;
      p.step_seconds = p.sum() * 1.004;
      p.comm_seconds = n * 0.0118;
      s.workers.push_back(p);
    }
    run.epochs.push_back(s);
  }
  return run;
}

std::vector<Finding> realistic_findings() {
  return {
      {"mixed precision", Finding::Status::kAct,
       "float32 on a CPU with native bfloat16 (AMX): forward+backward are 71% of the step",
       "--precision mixed_bfloat16", 0.31},
      {"input pipeline", Finding::Status::kConsider,
       "worker 1 waits 6.5% of its step for input (moderately input-bound)",
       "add .prefetch(kAutotune) and map(..., kAutotune) before batch", 0.06},
      {"compiled step", Finding::Status::kUnknown, "no compiled step on this device (CPU)", "", 0},
      {"batch size", Finding::Status::kGood, "128 per replica; the largest that fits is 160 (< 2x)",
       "", 0},
      {"threads", Finding::Status::kGood, "1 thread per worker, 2 workers on 2 cores", "", 0},
  };
}

struct Browser {
  std::string path;
  std::string profile_dir;
  testing::ProcessResult run(const std::vector<std::string>& extra, const std::string& url) {
    std::vector<std::string> argv = {path,
                                     "--headless",
                                     "--no-sandbox",
                                     "--disable-gpu",
                                     "--no-first-run",
                                     "--disable-background-networking",
                                     "--disable-extensions",
                                     "--hide-scrollbars",
                                     "--user-data-dir=" + profile_dir,
                                     "--enable-logging=stderr",
                                     "--v=0",
                                     "--window-size=1280,2300",
                                     "--virtual-time-budget=2000"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    argv.push_back(url);
    return testing::run_process(argv, {}, std::chrono::seconds(60));
  }
};

// Chromium logs each console message on stderr as "...:CONSOLE:<line>] "text", source: ...";
// a page without scripts has none unless something (an SVG attribute, a parse) went wrong.
std::vector<std::string> console_lines(const std::string& stderr_text) {
  std::vector<std::string> out;
  std::istringstream in(stderr_text);
  for (std::string line; std::getline(in, line);) {
    if (line.find(":CONSOLE") != std::string::npos || line.find("Uncaught") != std::string::npos) {
      out.push_back(line);
    }
  }
  return out;
}

// The <svg> element whose data-chart is `chart`, as text; empty if none.
std::string chart_svg(const std::string& dom, const std::string& chart) {
  const auto at = dom.find("data-chart=\"" + chart + "\"");
  if (at == std::string::npos) return "";
  const auto begin = dom.rfind("<svg", at);
  const auto end = dom.find("</svg>", at);
  if (begin == std::string::npos || end == std::string::npos) return "";
  return dom.substr(begin, end - begin);
}

// Every data-points="N" in `svg`, in order.
std::vector<int> data_points(const std::string& svg) {
  std::vector<int> out;
  const std::string key = "data-points=\"";
  for (auto at = svg.find(key); at != std::string::npos; at = svg.find(key, at + 1)) {
    out.push_back(std::atoi(svg.c_str() + at + key.size()));
  }
  return out;
}

std::string read_binary(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::uint32_t big_endian32(const std::string& bytes, std::size_t at) {
  std::uint32_t v = 0;
  for (std::size_t i = 0; i < 4; ++i) v = (v << 8) | static_cast<unsigned char>(bytes[at + i]);
  return v;
}

class ReportBrowser : public ::testing::Test {
 protected:
  void SetUp() override {
    browser_.path = find_chromium();
    if (browser_.path.empty()) {
      GTEST_SKIP() << "Chromium is not installed (/usr/bin/chromium); scripts/bootstrap "
                      "installs it";
    }
    browser_.profile_dir = dir_.path() + "/profile";
  }
  testing::TempDir dir_;
  Browser browser_;
};

// The detector below must be able to fail: a page with a NaN coordinate and a script error
// makes Chromium log console lines.
TEST_F(ReportBrowser, ConsoleCheckSeesSvgErrors) {
  const std::string bad = dir_.path() + "/bad.html";
  std::ofstream(bad) << "<!DOCTYPE html><html><body><svg width=\"100\" height=\"50\">"
                        "<path d=\"M nan 1 L 2 3\" stroke=\"red\"/></svg></body></html>";
  const auto result = browser_.run({"--dump-dom"}, "file://" + bad);
  ASSERT_EQ(result.exit_code, 0) << result.err;
  EXPECT_FALSE(console_lines(result.err).empty())
      << "Chromium logged no console line for an SVG path with \"nan\"; the check below would "
         "miss real errors. stderr:\n"
      << result.err;
}

TEST_F(ReportBrowser, LoadsCleanlyWithDataAndDrawsAScreenshot) {
  // Through the JSON form, as `flotilla train --profile-json` writes and `--report` reads it.
  const RunSummary run = run_summary_from_json(to_json(realistic_run()), "report_browser_test");
  const std::string out_dir = testing::test_bin_dir();
  const std::string html = out_dir + "/report_browser.html";
  const std::string png = out_dir + "/report_screenshot.png";
  std::remove(png.c_str());
  write_html_report(html, run, realistic_findings());

  // (a), (b): loads, no console errors; (c): the DOM after load carries the data.
  const auto dom = browser_.run({"--dump-dom"}, "file://" + html);
  ASSERT_EQ(dom.exit_code, 0) << dom.err;
  const auto console = console_lines(dom.err);
  EXPECT_TRUE(console.empty()) << "console message: " << console.front();
  for (const char* chart : {"loss", "accuracy", "learning_rate", "samples_per_s"}) {
    const std::string svg = chart_svg(dom.out, chart);
    ASSERT_FALSE(svg.empty()) << "no chart " << chart << " in the DOM";
    const std::vector<int> points = data_points(svg);
    const bool with_val = std::string(chart) == "loss" || std::string(chart) == "accuracy";
    EXPECT_EQ(points, std::vector<int>(with_val ? 2 : 1, 12)) << chart;
  }
  for (const char* worker : {"data-worker=\"0\"", "data-worker=\"1\""}) {
    EXPECT_NE(dom.out.find(worker), std::string::npos) << worker;
  }
  EXPECT_NE(dom.out.find("a&lt;b &amp; c&gt;d"), std::string::npos) << "escaped command";

  // (d): a real PNG, 1280 wide, with content.
  const auto shot = browser_.run({"--screenshot=" + png}, "file://" + html);
  ASSERT_EQ(shot.exit_code, 0) << shot.err;
  const std::string bytes = read_binary(png);
  ASSERT_GE(bytes.size(), 24u) << "no screenshot at " << png;
  EXPECT_EQ(bytes.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  EXPECT_EQ(bytes.substr(12, 4), "IHDR");
  EXPECT_EQ(big_endian32(bytes, 16), 1280u);
  EXPECT_EQ(big_endian32(bytes, 20), 2300u);
  // A blank 1280x2300 page compresses to a few KB; charts and text make it far larger.
  EXPECT_GT(bytes.size(), 60u * 1024) << "the screenshot looks blank";
  std::cout << "report screenshot: " << png << "\nreport page: " << html << "\n";
}

} // namespace
} // namespace flotilla::profile
