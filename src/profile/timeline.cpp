#include "flotilla/profile/timeline.h"

#include <cmath>

#include "flotilla/error.h"

namespace flotilla::profile {

namespace {

// Trace-event times are microseconds.
double us(double seconds) {
  return std::round(seconds * 1e7) / 10.0;
}

nlohmann::json metadata(const char* what, int pid, int tid, const nlohmann::json& args) {
  nlohmann::json e = {{"ph", "M"}, {"name", what}, {"pid", pid}, {"args", args}};
  if (tid >= 0) e["tid"] = tid;
  return e;
}

} // namespace

nlohmann::json chrome_trace(const std::vector<std::vector<train::StepTrace>>& workers,
                            const std::vector<std::string>& names) {
  nlohmann::json events = nlohmann::json::array();
  for (std::size_t w = 0; w < workers.size(); ++w) {
    const int pid = static_cast<int>(w);
    const std::string name = w < names.size() ? names[w] : "worker " + std::to_string(w);
    events.push_back(metadata("process_name", pid, -1, {{"name", name}}));
    events.push_back(metadata("process_sort_index", pid, -1, {{"sort_index", pid}}));
    events.push_back(metadata("thread_name", pid, kStepTrack, {{"name", "step"}}));
    events.push_back(metadata("thread_sort_index", pid, kStepTrack, {{"sort_index", kStepTrack}}));
    for (int p = 0; p < train::kPhaseCount; ++p) {
      events.push_back(metadata("thread_name", pid, p + 1,
                                {{"name", train::phase_name(static_cast<train::Phase>(p))}}));
      events.push_back(metadata("thread_sort_index", pid, p + 1, {{"sort_index", p + 1}}));
    }
    events.push_back(
        metadata("thread_name", pid, kAllReduceTrack, {{"name", "all-reduce in flight"}}));
    events.push_back(
        metadata("thread_sort_index", pid, kAllReduceTrack, {{"sort_index", kAllReduceTrack}}));
    for (const auto& step : workers[w]) {
      const nlohmann::json args = {{"epoch", step.epoch + 1}, {"step", step.step}};
      if (!step.spans.empty()) {
        const auto& first = step.spans.front();
        const auto& last = step.spans.back();
        events.push_back({{"ph", "X"},
                          {"name", "step " + std::to_string(step.step)},
                          {"cat", "step"},
                          {"pid", pid},
                          {"tid", kStepTrack},
                          {"ts", us(first.begin)},
                          {"dur", us(last.begin + last.seconds - first.begin)},
                          {"args", args}});
      }
      for (const auto& span : step.spans) {
        events.push_back({{"ph", "X"},
                          {"name", train::phase_name(span.phase)},
                          {"cat", "phase"},
                          {"pid", pid},
                          {"tid", static_cast<int>(span.phase) + 1},
                          {"ts", us(span.begin)},
                          {"dur", us(span.seconds)},
                          {"args", args}});
      }
      for (std::size_t b = 0; b < step.all_reduces.size(); ++b) {
        const auto& [begin, end] = step.all_reduces[b];
        events.push_back({{"ph", "X"},
                          {"name", "bucket " + std::to_string(b)},
                          {"cat", "all-reduce"},
                          {"pid", pid},
                          {"tid", kAllReduceTrack},
                          {"ts", us(begin)},
                          {"dur", us(end - begin)},
                          {"args", args}});
      }
    }
  }
  return {{"traceEvents", events},
          {"displayTimeUnit", "ms"},
          {"otherData",
           {{"producer", "flotilla"},
            {"clock", "seconds since every worker left fit()'s first collective"}}}};
}

std::vector<double> pack_traces(const std::vector<train::StepTrace>& steps) {
  std::vector<double> out;
  out.push_back(static_cast<double>(steps.size()));
  for (const auto& s : steps) {
    out.push_back(s.epoch);
    out.push_back(static_cast<double>(s.step));
    out.push_back(static_cast<double>(s.spans.size()));
    for (const auto& span : s.spans) {
      out.push_back(static_cast<double>(span.phase));
      out.push_back(span.begin);
      out.push_back(span.seconds);
    }
    out.push_back(static_cast<double>(s.all_reduces.size()));
    for (const auto& [begin, end] : s.all_reduces) {
      out.push_back(begin);
      out.push_back(end);
    }
  }
  return out;
}

std::vector<train::StepTrace> unpack_traces(const std::vector<double>& packed) {
  std::size_t at = 0;
  auto next = [&]() {
    if (at >= packed.size()) {
      throw Error("a worker's packed step traces end early (" + std::to_string(packed.size()) +
                  " numbers); the workers run different flotilla versions?");
    }
    return packed[at++];
  };
  auto count = [&]() {
    const double n = next();
    if (!(n >= 0) || n > static_cast<double>(packed.size())) {
      throw Error("a worker's packed step traces hold a bad count (" + std::to_string(n) + ")");
    }
    return static_cast<std::size_t>(n);
  };
  std::vector<train::StepTrace> steps(count());
  for (auto& s : steps) {
    s.epoch = static_cast<int>(next());
    s.step = static_cast<std::int64_t>(next());
    s.spans.resize(count());
    for (auto& span : s.spans) {
      const auto phase = static_cast<int>(next());
      if (phase < 0 || phase >= train::kPhaseCount) {
        throw Error("a worker's packed step traces name phase " + std::to_string(phase));
      }
      span.phase = static_cast<train::Phase>(phase);
      span.begin = next();
      span.seconds = next();
    }
    s.all_reduces.resize(count());
    for (auto& [begin, end] : s.all_reduces) {
      begin = next();
      end = next();
    }
  }
  return steps;
}

} // namespace flotilla::profile
