// `flotilla plan`: predicts from one measured single-worker run how the step time, samples/s and
// scaling efficiency change with the number of workers on a given network, and which gradient
// bucket size (--bytes-per-pack) is best. The model is profile/planner.h's; measure first with
//   flotilla train --model mlp-wide --epochs 2 --profile-json run.json
//   flotilla plan --profile run.json --workers 1,2,4,8 --link 25Gbit --latency 20us
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include "flotilla/error.h"
#include "flotilla/profile/planner.h"
#include "tools/flotilla/commands.h"
#include "tools/flotilla/flags.h"

namespace flotilla::tools {
namespace {

struct PlanArgs {
  std::string profile;
  std::vector<int> workers = {1, 2, 4, 8, 16, 32, 64, 128, 256};
  std::string link;
  std::string latency = "20us";
  // The cost of one collective that no bandwidth or latency of the network explains (issuing
  // it, the backend's thread hand-offs): an assumption for a server-class host. Measure yours:
  // the 4 KiB line of `make bench-allreduce` is about this plus loopback's latency; on the
  // 2-core VM of docs/benchmarks.md it is 1.4 ms (2 processes) to 2.7 ms (3).
  double per_collective_us = 75;
  std::int64_t bytes_per_pack = 0; // 0: the profile's
  std::string overlap = "profile";
  bool json = false;
};

// "4 MiB", "256 KiB", "23.3 MB", "512 B": exact binary sizes as such, the rest in decimal MB.
std::string format_bytes(std::int64_t bytes) {
  constexpr std::int64_t kKiB = 1024, kMiB = 1024 * 1024, kGiB = kMiB * 1024;
  if (bytes >= kGiB && bytes % kGiB == 0) return std::to_string(bytes / kGiB) + " GiB";
  if (bytes >= kMiB && bytes % kMiB == 0) return std::to_string(bytes / kMiB) + " MiB";
  if (bytes >= kKiB && bytes % kKiB == 0 && bytes < kMiB) {
    return std::to_string(bytes / kKiB) + " KiB";
  }
  if (bytes < 10000) return std::to_string(bytes) + " B";
  char text[32];
  std::snprintf(text, sizeof text, "%.1f MB", static_cast<double>(bytes) / 1e6);
  return text;
}

std::string format_rate(double bytes_per_s) {
  char text[64];
  const double bits = bytes_per_s * 8;
  if (bits >= 1e9) {
    std::snprintf(text, sizeof text, "%.3g Gbit/s", bits / 1e9);
  } else {
    std::snprintf(text, sizeof text, "%.4g Mbit/s", bits / 1e6);
  }
  return text;
}

double rounded(double value, int digits) {
  const double scale = std::pow(10.0, digits);
  return std::round(value * scale) / scale;
}

int run(const PlanArgs& a) {
  if (a.per_collective_us < 0) {
    throw ConfigError("--per-collective-us " + std::to_string(a.per_collective_us) +
                      " is negative; give the fixed cost of one all-reduce in microseconds");
  }
  if (a.bytes_per_pack < 0) {
    throw ConfigError("--bytes-per-pack " + std::to_string(a.bytes_per_pack) +
                      " is negative; give a bucket size in bytes (0: the profile's)");
  }
  const auto run_summary = profile::read_run_summary(a.profile);
  const auto step = profile::step_profile(run_summary, a.profile);
  profile::Link link;
  link.bytes_per_s = profile::parse_bandwidth(a.link, "--link");
  link.latency_s = profile::parse_duration(a.latency, "--latency");
  link.per_collective_s = a.per_collective_us * 1e-6;
  const std::int64_t bucket = a.bytes_per_pack > 0 ? a.bytes_per_pack : step.bytes_per_pack;
  const bool overlap = a.overlap == "profile" ? step.overlap : a.overlap == "on";

  std::vector<profile::Prediction> rows, best;
  for (int n : a.workers) {
    rows.push_back(profile::predict(step, n, link, bucket, overlap));
    best.push_back(profile::best_bucket(step, n, link, overlap));
  }

  if (a.json) {
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const auto& r = rows[i];
      nlohmann::ordered_json line = {
          {"workers", r.workers},
          {"bytes_per_pack", r.bucket_bytes},
          {"buckets", r.buckets},
          {"overlap", overlap},
          {"step_ms", rounded(r.step_seconds * 1e3, 3)},
          {"comm_ms", rounded(r.comm_seconds * 1e3, 3)},
          {"exposed_ms", rounded(r.exposed_seconds * 1e3, 3)},
          {"efficiency", rounded(r.efficiency, 4)},
          {"samples_per_s", rounded(r.samples_per_s, 1)},
          {"best_bytes_per_pack", best[i].bucket_bytes},
          {"best_step_ms", rounded(best[i].step_seconds * 1e3, 3)},
      };
      std::cout << line.dump() << "\n";
    }
    return 0;
  }

  const auto& model = run_summary.recipe.model;
  std::printf("measured (1 worker%s%s): %.2f ms/step = input %.2f + copy %.2f + forward %.2f + "
              "backward %.2f + optimizer %.2f + metrics %.2f + callbacks %.2f + other %.2f; "
              "batch %lld; %s of gradients\n",
              model.empty() ? "" : ", ", model.c_str(), step.compute_seconds() * 1e3,
              step.input * 1e3, step.copy * 1e3, step.forward * 1e3, step.backward * 1e3,
              step.optimizer * 1e3, step.metrics * 1e3, step.callbacks * 1e3, step.other * 1e3,
              static_cast<long long>(step.batch_per_worker),
              format_bytes(step.gradient_bytes).c_str());
  std::printf("network: %s per link, %s per hop, %g us per all-reduce (ring); buckets of %s "
              "(%d), overlap %s\n\n",
              format_rate(link.bytes_per_s).c_str(), a.latency.c_str(), a.per_collective_us,
              format_bytes(bucket).c_str(),
              static_cast<int>(profile::plan_buckets(step, bucket).size()), overlap ? "on" : "off");
  std::printf("%7s %9s %9s %10s %11s %11s   %-11s %9s\n", "workers", "step ms", "comm ms",
              "exposed ms", "efficiency", "samples/s", "best bucket", "its step");
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const auto& r = rows[i];
    std::printf("%7d %9.2f %9.2f %10.2f %9.1f %% %11.0f   %-11s %9.2f\n", r.workers,
                r.step_seconds * 1e3, r.comm_seconds * 1e3, r.exposed_seconds * 1e3,
                r.efficiency * 100, r.samples_per_s, format_bytes(best[i].bucket_bytes).c_str(),
                best[i].step_seconds * 1e3);
  }
  if (!rows.empty()) {
    // The largest worker count decides: that is where communication costs the most.
    std::size_t largest = 0;
    for (std::size_t i = 1; i < rows.size(); ++i) {
      if (rows[i].workers > rows[largest].workers) largest = i;
    }
    const auto& b = best[largest];
    const auto& r = rows[largest];
    std::printf("\nbest bucket size at %d workers: --bytes-per-pack %lld (%s, %d buckets): "
                "%.2f ms/step against %.2f ms with %s\n",
                b.workers, static_cast<long long>(b.bucket_bytes),
                format_bytes(b.bucket_bytes).c_str(), b.buckets, b.step_seconds * 1e3,
                r.step_seconds * 1e3, format_bytes(r.bucket_bytes).c_str());
  }
  return 0;
}

} // namespace

Command add_plan(CLI::App& parent) {
  auto args = std::make_shared<PlanArgs>();
  CLI::App* app = parent.add_subcommand(
      "plan", "Predict step time, samples/s and scaling efficiency at other worker counts, and "
              "the best gradient bucket size, from a single-worker --profile-json run");
  app->add_option("--profile", args->profile,
                  "A single-worker run's profile (flotilla train ... --profile-json FILE)")
      ->required();
  app->add_option("--workers", args->workers, "Worker counts to predict, comma-separated")
      ->delimiter(',')
      ->check(positive_number(65536))
      ->capture_default_str();
  app->add_option("--link", args->link,
                  "Bandwidth a connection achieves between two workers: 25Gbit, 100Mbit, "
                  "1.5GB/s, ...")
      ->required();
  app->add_option("--latency", args->latency, "One-way latency of one hop: 20us, 1ms, ...")
      ->capture_default_str();
  app->add_option("--per-collective-us", args->per_collective_us,
                  "Fixed cost of one all-reduce in microseconds, whatever its size (about the "
                  "4 KiB all-reduce time of bench/allreduce.sh)")
      ->capture_default_str();
  app->add_option("--bytes-per-pack", args->bytes_per_pack,
                  "Gradient bucket size to predict with (0: the profile's)")
      ->capture_default_str();
  app->add_option("--overlap", args->overlap,
                  "All-reduce overlapped with backward: as in the profile, on or off")
      ->check(CLI::IsMember({"profile", "on", "off"}))
      ->capture_default_str();
  app->add_flag("--json", args->json, "One JSON line per worker count instead of the table");
  app->footer("Measure first, on one worker:\n"
              "  flotilla train --model mlp-wide --epochs 2 --profile-json run.json\n"
              "  flotilla plan --profile run.json --workers 1,2,4,8 --link 25Gbit --latency 20us");
  return {app, [args] { return run(*args); }};
}

} // namespace flotilla::tools
