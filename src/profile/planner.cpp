#include "flotilla/profile/planner.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>

#include "flotilla/error.h"
#include "flotilla/strategy/bucket_assignment.h"

namespace flotilla::profile {

namespace {

constexpr const char* kBandwidthForms =
    "a number and a unit: 25Gbit, 100Mbit, 10Gbps, 1Gb/s (bits) or 1.5GB/s, 800MB/s, 1GiB/s "
    "(bytes)";
constexpr const char* kDurationForms = "a number and a unit: 500ns, 20us, 1.5ms, 0.01s (or 0)";

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The leading decimal number of `text` and what follows it (spaces skipped). False when there is
// no number or it is not finite (strtod also reads "inf", "nan" and hexadecimal).
bool split_number(const std::string& text, double& value, std::string& unit) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0]))) return false;
  if (lower(text).find('x') != std::string::npos) return false;
  const char* begin = text.c_str();
  char* end = nullptr;
  errno = 0;
  value = std::strtod(begin, &end);
  if (end == begin || errno == ERANGE || !std::isfinite(value)) return false;
  unit = text.substr(static_cast<std::size_t>(end - begin));
  const auto first = unit.find_first_not_of(' ');
  unit = first == std::string::npos ? "" : unit.substr(first);
  return true;
}

// 1000^i for "", k, m, g, t; 1024^i for ki, mi, gi, ti (lowercase); 0 when unknown.
double prefix_multiplier(const std::string& prefix) {
  static const char* const kSi[] = {"", "k", "m", "g", "t"};
  static const char* const kBinary[] = {"", "ki", "mi", "gi", "ti"};
  for (int i = 0; i < 5; ++i) {
    if (prefix == kSi[i]) return std::pow(1000.0, i);
    if (i > 0 && prefix == kBinary[i]) return std::pow(1024.0, i);
  }
  return 0;
}

} // namespace

double parse_bandwidth(const std::string& text, const std::string& what) {
  const auto bad = [&](const std::string& why) {
    return ConfigError(what + " \"" + text + "\" " + why + "; use " + kBandwidthForms);
  };
  double value = 0;
  std::string unit;
  if (!split_number(text, value, unit)) throw bad("is not a bandwidth");
  if (unit.empty()) throw bad("has no unit (bits or bytes per second?)");
  // "/s" and "ps" only say "per second"; what is left names bits or bytes. A lone "b" is bits
  // only with "ps" or "/s" after it (Gbps, Gb/s), as network gear writes it; tc's "gbit" and
  // "mbit" spell it out. "B" is bytes.
  bool per_second = false;
  if (ends_with(unit, "/s")) {
    unit.resize(unit.size() - 2);
    per_second = true;
  } else if (ends_with(lower(unit), "ps")) {
    unit.resize(unit.size() - 2);
    per_second = true;
  }
  double bits_per_unit = 0;
  std::string prefix;
  if (ends_with(lower(unit), "bit")) {
    bits_per_unit = 1;
    prefix = unit.substr(0, unit.size() - 3);
  } else if (!unit.empty() && unit.back() == 'B') {
    bits_per_unit = 8;
    prefix = unit.substr(0, unit.size() - 1);
  } else if (per_second && !unit.empty() && unit.back() == 'b') {
    bits_per_unit = 1;
    prefix = unit.substr(0, unit.size() - 1);
  } else {
    throw bad("has an unknown unit");
  }
  const double multiplier = prefix_multiplier(lower(prefix));
  if (multiplier == 0) throw bad("has an unknown unit prefix \"" + prefix + "\"");
  if (!(value > 0)) throw bad("is not positive");
  return value * multiplier * bits_per_unit / 8;
}

double parse_duration(const std::string& text, const std::string& what) {
  const auto bad = [&](const std::string& why) {
    return ConfigError(what + " \"" + text + "\" " + why + "; use " + kDurationForms);
  };
  double value = 0;
  std::string unit;
  if (!split_number(text, value, unit)) throw bad("is not a duration");
  if (value < 0) throw bad("is negative");
  if (unit.empty()) {
    if (value == 0) return 0;
    throw bad("has no unit");
  }
  if (unit == "ns") return value * 1e-9;
  if (unit == "us" || unit == "\xC2\xB5s" || unit == "\xCE\xBCs") return value * 1e-6; // µs, μs
  if (unit == "ms") return value * 1e-3;
  if (unit == "s") return value;
  throw bad("has an unknown unit");
}

double StepProfile::compute_seconds() const {
  return input + copy + forward + backward + optimizer + metrics + callbacks + other;
}

StepProfile step_profile(const RunSummary& run, const std::string& where) {
  const auto& r = run.recipe;
  const auto phases = run.steady_phases();
  const int workers = std::max<int>(r.workers, static_cast<int>(phases.size()));
  if (workers > 1) {
    throw ConfigError(
        where + " was measured with " + std::to_string(workers) +
        " workers; the planner needs one worker's step alone (its compute without anyone "
        "else's communication). Record one worker alone (no TF_CONFIG: a MirroredStrategy) "
        "training " +
        (r.model.empty() ? std::string("the same model") : "the model " + r.model) +
        (r.batch_per_replica > 0 ? " at " + std::to_string(r.batch_per_replica) +
                                       " per replica (RecipeFacts::batch_per_replica)"
                                 : std::string()) +
        " for 2 epochs (FitOptions::epochs), with its profile written (ProfilerOptions::summary)");
  }
  if (phases.empty() || phases[0].steps <= 0) {
    throw ConfigError(where +
                      (run.epochs.empty() ? std::string(" has no epochs")
                                          : std::string(" has 0 measured steps")) +
                      "; the planner needs a profile of at least one step: train an epoch or "
                      "more with its profile written (ProfilerOptions::summary)");
  }
  if (r.gradient_bytes <= 0) {
    throw ConfigError(where + ": recipe.gradient_bytes is " + std::to_string(r.gradient_bytes) +
                      "; the planner needs the bytes one step all-reduces. Write the file again "
                      "with this version (ProfilerOptions::summary)");
  }
  const auto& p = phases[0];
  const double steps = static_cast<double>(p.steps);
  StepProfile s;
  s.steps = p.steps;
  s.input = p[train::Phase::kInput] / steps;
  s.copy = p[train::Phase::kCopy] / steps;
  s.forward = p[train::Phase::kForward] / steps;
  s.backward = p[train::Phase::kBackward] / steps;
  s.optimizer = p[train::Phase::kOptimizer] / steps;
  s.metrics = p[train::Phase::kMetrics] / steps;
  s.callbacks = p[train::Phase::kCallbacks] / steps;
  // One worker's all-reduce phase is the local finish() alone: compute, like the clock reads.
  const double named =
      s.input + s.copy + s.forward + s.backward + s.optimizer + s.metrics + s.callbacks;
  s.other = std::max(p[train::Phase::kAllReduce] / steps, p.step_seconds / steps - named);
  s.other = std::max(0.0, s.other);
  s.gradient_bytes = r.gradient_bytes;
  s.gradient_layout = r.gradient_layout;
  s.gradient_kinds = r.gradient_kinds;
  if (r.bytes_per_pack > 0) s.bytes_per_pack = r.bytes_per_pack;
  s.overlap = r.overlap;
  // One worker: its global batch is its own (all its replicas together).
  s.batch_per_worker = r.global_batch > 0
                           ? r.global_batch
                           : r.batch_per_replica * std::max(1, r.replicas_per_worker);
  return s;
}

double all_reduce_seconds(std::int64_t bytes, int workers, const Link& link) {
  if (workers <= 1 || bytes <= 0) return 0;
  const double n = workers;
  return link.per_collective_s + 2 * (n - 1) * link.latency_s +
         2 * (n - 1) / n * static_cast<double>(bytes) / link.bytes_per_s;
}

std::vector<std::int64_t> split_buckets(std::int64_t gradient_bytes, std::int64_t bucket_bytes) {
  std::vector<std::int64_t> out;
  if (gradient_bytes <= 0) return out;
  for (std::int64_t left = gradient_bytes; left > 0; left -= bucket_bytes) {
    out.push_back(std::min(left, bucket_bytes));
  }
  return out;
}

std::vector<std::int64_t> plan_buckets(const StepProfile& profile, std::int64_t bucket_bytes) {
  std::int64_t layout_total = 0;
  for (const auto bytes : profile.gradient_layout) layout_total += bytes;
  if (layout_total <= 0) return split_buckets(profile.gradient_bytes, bucket_bytes);
  // The engine's own rule.
  std::vector<strategy::GradientSlot> slots;
  for (std::size_t k = 0; k < profile.gradient_layout.size(); ++k) {
    slots.push_back({profile.gradient_layout[k], k < profile.gradient_kinds.size()
                                                     ? profile.gradient_kinds[k]
                                                     : std::string()});
  }
  std::vector<std::int64_t> native;
  for (const auto& members : strategy::assign_buckets(slots, bucket_bytes)) {
    std::int64_t bytes = 0;
    for (const std::size_t k : members) bytes += profile.gradient_layout[k];
    native.push_back(bytes);
  }
  // On the wire: each bucket's share of what a step sends (compressed, with its used-flags).
  std::vector<std::int64_t> out;
  std::int64_t assigned = 0;
  for (std::size_t b = 0; b < native.size(); ++b) {
    const std::int64_t wire =
        b + 1 == native.size()
            ? profile.gradient_bytes - assigned
            : static_cast<std::int64_t>(static_cast<double>(profile.gradient_bytes) *
                                        static_cast<double>(native[b]) /
                                        static_cast<double>(layout_total));
    out.push_back(wire);
    assigned += wire;
  }
  return out;
}

Prediction predict(const StepProfile& profile, int workers, const Link& link,
                   std::int64_t bucket_bytes, bool overlap) {
  if (workers < 1) {
    throw ConfigError("worker count " + std::to_string(workers) +
                      " is not positive; give 1 or more");
  }
  if (bucket_bytes < 1) {
    throw ConfigError("bucket size " + std::to_string(bucket_bytes) +
                      " bytes is not positive; give bytes_per_pack >= 1");
  }
  if (!(link.bytes_per_s > 0) || link.latency_s < 0 || link.per_collective_s < 0) {
    throw ConfigError("the link needs a positive bandwidth and non-negative latency and "
                      "per-collective cost");
  }
  Prediction out;
  out.workers = workers;
  out.bucket_bytes = bucket_bytes;
  const auto buckets = plan_buckets(profile, bucket_bytes);
  out.buckets = static_cast<int>(buckets.size());
  if (workers > 1) {
    // Time 0 is backward's start. A bucket is ready when backward has produced every byte up to
    // its end (gradients appear at a steady rate); without overlap, when backward ends.
    const double total = static_cast<double>(profile.gradient_bytes);
    double produced = 0;
    double link_free = 0;
    for (const auto bytes : buckets) {
      produced += static_cast<double>(bytes);
      const double ready = overlap ? profile.backward * produced / total : profile.backward;
      const double cost = all_reduce_seconds(bytes, workers, link);
      link_free = std::max(ready, link_free) + cost;
      out.comm_seconds += cost;
    }
    out.exposed_seconds = std::max(0.0, link_free - profile.backward);
  }
  const double alone = profile.compute_seconds();
  out.step_seconds = alone + out.exposed_seconds;
  out.efficiency = out.step_seconds > 0 ? alone / out.step_seconds : 1;
  out.samples_per_s =
      out.step_seconds > 0
          ? workers * static_cast<double>(profile.batch_per_worker) / out.step_seconds
          : 0;
  return out;
}

std::vector<std::int64_t> candidate_buckets(std::int64_t gradient_bytes) {
  std::vector<std::int64_t> out;
  for (std::int64_t b = kSmallestCandidateBucket; b < gradient_bytes; b *= 2) out.push_back(b);
  out.push_back(std::max<std::int64_t>(gradient_bytes, 1));
  return out;
}

Prediction best_bucket(const StepProfile& profile, int workers, const Link& link, bool overlap) {
  const auto candidates = candidate_buckets(profile.gradient_bytes);
  Prediction best;
  bool first = true;
  // Largest first, so a smaller bucket must be strictly (not just rounding-) better to win.
  for (auto it = candidates.rbegin(); it != candidates.rend(); ++it) {
    const auto p = predict(profile, workers, link, *it, overlap);
    if (first || p.step_seconds < best.step_seconds * (1 - 1e-9)) best = p;
    first = false;
  }
  return best;
}

} // namespace flotilla::profile
