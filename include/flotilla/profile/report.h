// The training report as one self-contained HTML page (`flotilla train --report run.html`): the
// run's setup and key figures, per-epoch curves (loss, metrics, learning rate, samples/s), each
// worker's step-time breakdown by phase, and the recipe doctor's checklist. Everything is inline
// (CSS and SVG drawn here), so the file opens offline, mails as one attachment and prints.
// Torch-free: it reads a RunSummary and the doctor's findings.
//
// The SVG carries data attributes for tests and tools: each chart's <svg> has data-chart (the
// metric, "samples_per_s" for throughput), data-plot ("left top width height" of the plot area)
// and data-y-domain ("low high" of its y axis); each series is a <path> with data-series and
// data-points (finite points drawn); each worker's bar is a <g> with data-worker (its rank).
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "flotilla/profile/doctor.h"
#include "flotilla/profile/run_summary.h"

namespace flotilla::profile {

// The whole page. Missing or non-finite values are left out (a chart with nothing finite says
// so), never written as "nan" into the markup. The findings' settings and recommendations are
// shown as `format` shows them (format_recommendation): in API terms by default, as its flags
// for a program that passes its own (the CLI does).
std::string render_html_report(const RunSummary& run, const std::vector<Finding>& findings,
                               const FindingFormat& format = {});

// render_html_report() written whole-or-nothing (temporary file, then rename).
void write_html_report(const std::filesystem::path& path, const RunSummary& run,
                       const std::vector<Finding>& findings, const FindingFormat& format = {});

} // namespace flotilla::profile
