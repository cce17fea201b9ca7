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
#include "profile/report_figures.h"

namespace flotilla::profile {

namespace {

using train::Phase;
using train::PhaseTimes;
// The figures and the text helpers (report_figures.h).
using detail::bytes_text;
using detail::count_text;
using detail::curve_charts;
using detail::escape;
using detail::fixed;
using detail::grouped;
using detail::ms_per_step;
using detail::other_ms;
using detail::percent;
using detail::phase_legend;
using detail::phase_table;
using detail::render_bars;
using detail::render_chart;
using detail::value_text;

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
