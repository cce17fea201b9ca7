#include "train/share_balancer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>

#include "flotilla/error.h"

namespace flotilla::train::detail {
namespace {

// How much of a new report the smoothed speeds take (an exponential moving average).
constexpr double kSmoothing = 0.3;
// A division is applied only when it moves some worker by more than this share of the global
// batch (and at least one row).
constexpr double kThreshold = 0.03;

} // namespace

std::vector<std::int64_t> rows_by_speed(const std::vector<double>& speeds, std::int64_t global) {
  const auto n = static_cast<std::int64_t>(speeds.size());
  std::vector<std::int64_t> rows(speeds.size(), 1);
  if (n == 0 || global < n) return rows;
  const double total = std::accumulate(speeds.begin(), speeds.end(), 0.0);
  // Each worker's first row is given; the rest divide in proportion.
  const std::int64_t rest = global - n;
  std::vector<std::pair<double, std::size_t>> remainders;
  std::int64_t given = 0;
  for (std::size_t w = 0; w < speeds.size(); ++w) {
    const double exact = total > 0 ? rest * speeds[w] / total : static_cast<double>(rest) / n;
    const auto whole = static_cast<std::int64_t>(std::floor(exact));
    rows[w] += whole;
    given += whole;
    remainders.emplace_back(exact - static_cast<double>(whole), w);
  }
  // Ties go to the lower index: the same on every worker.
  std::stable_sort(remainders.begin(), remainders.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  for (std::int64_t k = 0; k < rest - given; ++k)
    ++rows[remainders[static_cast<std::size_t>(k)].second];
  return rows;
}

ShareBalancer::ShareBalancer(strategy::Strategy& strategy, StepTimer& timer, std::int64_t interval)
    : strategy_(strategy), timer_(timer), interval_(interval) {
  if (interval_ < 1) {
    throw ConfigError("shares by speed are measured every N steps, N at least 1; saw " +
                      std::to_string(interval_));
  }
  if (strategy_.elastic()) {
    throw ConfigError("shares by speed (--shares auto) are not yet made for an elastic group, "
                      "whose members change; leave --shares at equal, or train without --elastic");
  }
}

void ShareBalancer::begin_fit(const data::DistributedDataset& train) {
  train_ = &train;
  steps_ = 0;
  compute_at_last_ = compute_ = 0;
  waited_at_last_ = strategy_.communicator().shared_memory_waited_seconds();
  rows_ = 0;
  speeds_.clear();
}

void ShareBalancer::end_fit() {
  train_ = nullptr;
  current_.reset();
}

void ShareBalancer::after_step(EpochIterator& input, std::int64_t step_in_epoch, std::int64_t rows,
                               std::int64_t global) {
  const PhaseTimes& epoch = timer_.epoch;
  // Forward and backward, less what backward's shared-memory all-reduces waited for the other
  // workers (they run in its hooks on this thread); the backends' waits are in kAllReduce.
  const double compute = epoch[Phase::kForward] + epoch[Phase::kBackward];
  if (compute < compute_at_last_) compute_at_last_ = 0; // a new epoch's sums
  const double waited = strategy_.communicator().shared_memory_waited_seconds();
  compute_ += std::max(0.0, compute - compute_at_last_ - (waited - waited_at_last_));
  compute_at_last_ = compute;
  waited_at_last_ = waited;
  rows_ += rows;
  ++steps_;
  // The first interval warms up (allocations, kernel choices): not measured.
  if (steps_ == interval_) {
    compute_ = 0;
    rows_ = 0;
  }
  if (steps_ % interval_ != 0 || steps_ == interval_) return;
  const int workers = strategy_.num_workers();
  const int me = strategy_.worker_index();
  // Every worker's seconds per row; 0 where one trained no row.
  torch::Tensor report = torch::zeros({workers}, torch::kFloat64);
  report[me] = rows_ > 0 ? compute_ / static_cast<double>(rows_) : 0.0;
  strategy_.communicator().all_reduce(report, collective::ReduceOp::kSum).wait();
  compute_ = 0;
  rows_ = 0;
  const auto* per_row = report.data_ptr<double>();
  std::vector<double> speeds(static_cast<std::size_t>(workers));
  for (int w = 0; w < workers; ++w) {
    if (!(per_row[w] > 0)) return; // a worker without a measurement: no decision this time
    speeds[static_cast<std::size_t>(w)] = 1.0 / per_row[w];
  }
  if (speeds_.empty()) {
    speeds_ = speeds;
  } else {
    for (std::size_t w = 0; w < speeds.size(); ++w) {
      speeds_[w] = (1 - kSmoothing) * speeds_[w] + kSmoothing * speeds[w];
    }
  }
  const std::vector<std::int64_t> target = rows_by_speed(speeds_, global);
  const cluster::InputContext now = strategy_.input_context();
  std::int64_t moved = 0;
  for (int w = 0; w < workers; ++w) {
    moved = std::max(moved,
                     std::abs(target[static_cast<std::size_t>(w)] - now.part_of(w).rows(global)));
  }
  std::string decision;
  char buf[64];
  for (int w = 0; w < workers; ++w) {
    decision += (w ? "," : "") + std::to_string(target[static_cast<std::size_t>(w)]);
  }
  decision += " of " + std::to_string(global) + " (ms per row";
  for (int w = 0; w < workers; ++w) {
    std::snprintf(buf, sizeof buf, "%s %.3g", w ? "," : "", 1e3 * per_row[w]);
    decision += buf;
  }
  decision += ")";
  const double threshold = std::max(1.0, kThreshold * static_cast<double>(global));
  if (static_cast<double>(moved) < threshold) return;
  const auto position = input.position(step_in_epoch);
  if (!position || !train_) return; // the same on every worker
  strategy_.set_shares(target);
  current_ =
      std::make_unique<data::DistributedDataset>(train_->redistribute(strategy_.input_context()));
  input.rebind(*current_, *position);
  if (strategy_.is_chief()) {
    strategy_.log().info("shares: now " + decision + ", from the epoch's step " +
                         std::to_string(step_in_epoch));
  }
}

} // namespace flotilla::train::detail
