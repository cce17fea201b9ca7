#include "train/share_balancer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <utility>

#include "flotilla/collective/elastic.h"
#include "flotilla/error.h"
#include "flotilla/train/model.h"

namespace flotilla::train {
namespace detail {
namespace {

// How much of a new report the smoothed speeds take (an exponential moving average)...
constexpr double kSmoothing = 0.3;
// ...unless it moved a worker's speed by more than this: a change of pace (a quota, a neighbour,
// a throttled host), which the shares follow at once instead of over several reports.
constexpr double kJump = 0.25;
// A division is applied only when it makes a step's compute faster by more than this fraction.
constexpr double kMinGain = 0.05;
// Advice (FitOptions::advise_shares_every) where dividing by speed gains at least this.
constexpr double kAdviseGain = 1.10;
// Reports in a row a worker must be below the floor to be called a straggler (one slow
// interval, a page-in or a neighbour's burst, is not enough).
constexpr int kStragglerReports = 2;

std::string rows_text(const std::vector<std::int64_t>& rows) {
  std::string text;
  for (std::size_t w = 0; w < rows.size(); ++w) text += (w ? "," : "") + std::to_string(rows[w]);
  return text;
}

// "0.267, 0.488": each worker's milliseconds per row.
std::string per_row_text(const double* per_row, std::size_t workers) {
  std::string text;
  char buf[32];
  for (std::size_t w = 0; w < workers; ++w) {
    std::snprintf(buf, sizeof buf, "%s%.3g", w ? ", " : "", 1e3 * per_row[w]);
    text += buf;
  }
  return text;
}

// Each worker's rows of a global batch of `global` under `context`'s division.
std::vector<std::int64_t> rows_of(const cluster::InputContext& context, std::int64_t global) {
  std::vector<std::int64_t> rows(static_cast<std::size_t>(context.num_input_pipelines));
  for (int w = 0; w < context.num_input_pipelines; ++w) {
    rows[static_cast<std::size_t>(w)] = context.part_of(w).rows(global);
  }
  return rows;
}

} // namespace

} // namespace detail

std::string why_no_shares_by_speed(const strategy::Strategy& strategy,
                                   const data::DistributedDataset& train) {
  if (strategy.input_context().full_replicas > 0) {
    return "an elastic group keeping the per-replica batch (ElasticOptions::batch per-replica) "
           "has no constant global batch to divide";
  }
  const std::string sharding = train.sharding();
  if (sharding != "DATA" && sharding != "one replica") {
    // A FILE split (AUTO picks it where the source reads a file per worker or more) cannot move
    // rows between workers mid-epoch.
    return "moving rows of each global batch between workers needs the input sharded by DATA, "
           "and this one is sharded " +
           sharding +
           " (AUTO picks FILE where the source reads a file per worker or more; set "
           "options.distribute.auto_shard_policy to DATA)";
  }
  if (strategy.devices().front().is_cuda()) {
    // The step timer's marks do not wait for the GPU (only a traced step does), so forward and
    // backward there are the kernels' launches, not their work: a speed from them is noise.
    return "on CUDA the speeds would be timed on the host's clock, which sees the kernels' "
           "launches, not the GPU's work; measuring on the GPU is not built yet (fixed weights, "
           "Strategy::set_shares, work)";
  }
  return "";
}

namespace detail {

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

double step_compute_seconds(const std::vector<std::int64_t>& rows,
                            const std::vector<double>& speeds) {
  double slowest = 0;
  for (std::size_t w = 0; w < rows.size() && w < speeds.size(); ++w) {
    if (speeds[w] > 0) slowest = std::max(slowest, static_cast<double>(rows[w]) / speeds[w]);
  }
  return slowest;
}

ShareBalancer::ShareBalancer(strategy::Strategy& strategy, StepTimer& timer, std::int64_t interval,
                             double straggler_floor, bool apply)
    : strategy_(strategy), timer_(timer), interval_(interval), floor_(straggler_floor),
      apply_(apply) {
  if (interval_ < 1) {
    throw ConfigError("shares by speed are measured every N steps, N at least 1; saw " +
                      std::to_string(interval_));
  }
  if (!(floor_ >= 0 && floor_ < 1)) {
    throw ConfigError("straggler_floor is a fraction of the median worker's speed, from 0 (never "
                      "a straggler) to below 1; saw " +
                      std::to_string(floor_));
  }
}

void ShareBalancer::begin_fit(const data::DistributedDataset& train) {
  const std::string why = why_no_shares_by_speed(strategy_, train);
  if (apply_ && !why.empty()) {
    throw ConfigError("shares by speed (FitOptions::balance_shares_every) cannot divide this "
                      "fit's global batches: " +
                      why + "; leave the shares equal");
  }
  advised_ = !why.empty(); // advice only where auto could follow it
  train_ = &train;
  start_measuring();
}

void ShareBalancer::start_measuring() {
  steps_ = 0;
  compute_at_last_ = compute_ = 0;
  waited_at_last_ = strategy_.communicator().shared_memory_waited_seconds();
  rows_ = 0;
  speeds_.clear();
  below_.clear();
  generation_ = strategy_.elastic() ? strategy_.elastic()->generation() : 0;
}

void ShareBalancer::end_fit() {
  train_ = nullptr;
  current_.reset();
}

std::vector<std::int64_t> weights_of(const std::vector<std::int64_t>& rows) {
  const std::int64_t most = *std::max_element(rows.begin(), rows.end());
  if (most <= cluster::kMaxShareWeight) return rows;
  std::vector<std::int64_t> weights(rows.size());
  const double scale = static_cast<double>(cluster::kMaxShareWeight) / static_cast<double>(most);
  for (std::size_t w = 0; w < rows.size(); ++w) {
    weights[w] = std::max<std::int64_t>(1, std::llround(static_cast<double>(rows[w]) * scale));
  }
  return weights;
}

void ShareBalancer::after_step(EpochIterator& input, std::int64_t step_in_epoch, std::int64_t rows,
                               std::int64_t step_global) {
  if (!apply_ && advised_) return; // advice is given once (or not at all here): no collective
  // A new generation: other members, another communicator, equal shares again (the strategy's).
  // Every member sees it at the same step (a heal or an admission lies between two steps), so
  // all count their intervals from it alike.
  if (strategy_.elastic() && strategy_.elastic()->generation() != generation_) start_measuring();
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
      const bool jump = std::abs(speeds[w] - speeds_[w]) > kJump * speeds_[w];
      speeds_[w] = jump ? speeds[w] : (1 - kSmoothing) * speeds_[w] + kSmoothing * speeds[w];
    }
  }
  // Divided at the user's global batch, not at an epoch's short last one.
  const std::int64_t global = std::max(step_global, train_ ? train_->global_rows() : 0);
  const std::vector<std::int64_t> target = rows_by_speed(speeds_, global);
  const std::vector<std::int64_t> current = rows_of(strategy_.input_context(), global);
  const double before = step_compute_seconds(current, speeds_);
  const double after = step_compute_seconds(target, speeds_);
  if (!apply_) {
    // Decided from the all-reduced reports, so every worker stops measuring at the same step.
    if (!(before >= kAdviseGain * after)) return;
    advised_ = true;
    if (strategy_.is_chief()) {
      char gain[32];
      std::snprintf(gain, sizeof gain, "%.2fx", before / after);
      strategy_.log().info("shares: the workers' compute per row differs (ms per row " +
                           per_row_text(per_row, target.size()) +
                           "): shares by speed (FitOptions::balance_shares_every) would divide "
                           "each global batch " +
                           rows_text(target) + " of " + std::to_string(global) +
                           " and make a step's compute " + gain + " as fast");
    }
    return;
  }
  // A straggler of an elastic group leaves (it throws); the others keep their shares until the
  // group without it forms.
  if (check_stragglers(target, global)) return;
  if (!(after < (1 - kMinGain) * before)) return;
  const auto position = input.position(step_in_epoch);
  if (!position || !train_) return; // the same on every worker
  strategy_.set_shares(weights_of(target));
  current_ =
      std::make_unique<data::DistributedDataset>(train_->redistribute(strategy_.input_context()));
  input.rebind(*current_, *position);
  if (!strategy_.is_chief()) return;
  cluster::InputContext equal_context = strategy_.input_context();
  equal_context.shares.clear();
  const std::vector<std::int64_t> equal = rows_of(equal_context, global);
  char buf[160];
  std::snprintf(buf, sizeof buf, "), from the epoch's step %lld: a step's compute %.2fx as fast",
                static_cast<long long>(step_in_epoch), before / after);
  std::string text = "shares: now " + rows_text(target) + " of " + std::to_string(global) +
                     " rows (ms per row " + per_row_text(per_row, target.size()) + buf;
  if (current != equal) {
    std::snprintf(buf, sizeof buf, ", %.2fx as with equal shares",
                  step_compute_seconds(equal, speeds_) / after);
    text += " as with " + rows_text(current) + buf;
  } else {
    text += " as with equal shares";
  }
  strategy_.log().info(text + ", as measured");
}

bool ShareBalancer::check_stragglers(const std::vector<std::int64_t>& target, std::int64_t global) {
  if (floor_ <= 0 || speeds_.size() < 2) return false;
  std::vector<double> sorted = speeds_;
  std::sort(sorted.begin(), sorted.end());
  const std::size_t n = sorted.size();
  const double median = n % 2 ? sorted[n / 2] : (sorted[n / 2 - 1] + sorted[n / 2]) / 2;
  below_.resize(n, 0);
  int straggler = -1;
  for (std::size_t w = 0; w < n; ++w) {
    below_[w] = speeds_[w] < floor_ * median ? below_[w] + 1 : 0;
    if (below_[w] >= kStragglerReports && straggler < 0) straggler = static_cast<int>(w);
  }
  if (straggler < 0) return false;
  const auto s = static_cast<std::size_t>(straggler);
  char buf[320];
  std::snprintf(buf, sizeof buf,
                "worker %d (rank %d of this group) is a straggler: it computes %.4g rows/s, "
                "below %.3g of the median worker's %.4g rows/s at %d reports in a row (its share "
                "would be %lld of %lld rows)",
                strategy_.elastic() ? strategy_.elastic()->members()[s] : straggler, straggler,
                speeds_[s], floor_, median, kStragglerReports, static_cast<long long>(target[s]),
                static_cast<long long>(global));
  if (strategy_.elastic()) {
    if (strategy_.worker_index() == straggler) {
      throw Straggler(std::string(buf) +
                      "; it leaves the group, which goes on without it. Find what slows this "
                      "host (flotilla doctor, a CPU quota, a busy neighbour); restarted, it "
                      "rejoins and is measured again");
    }
    if (strategy_.is_chief()) {
      strategy_.log().warn(std::string(buf) + "; it leaves the group, which goes on without it");
    }
    return true;
  }
  if (strategy_.is_chief() && !std::exchange(warned_, true)) {
    strategy_.log().warn(std::string(buf) +
                         "; it keeps its small share (an elastic group, --elastic, would go on "
                         "without it). Find what slows that host");
  }
  return false;
}

} // namespace detail
} // namespace flotilla::train
