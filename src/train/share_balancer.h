// Private: shares by speed, measured (FitOptions::balance_shares_every). Every `interval` steps
// each worker reports its compute time per row since the last report: forward and backward as
// the step timer charged them, less the time backward's shared-memory all-reduces (run in its
// hooks) waited for the others (the input wait and the backends' all-reduce waits are phases of
// their own). The workers all-reduce the reports, and every worker computes the same new
// division of the global batch: rows in proportion to the smoothed speeds, in whole rows, each
// worker at least one (the speeds follow a report at once where it moved by more than a quarter:
// a change of pace). A division is applied only when it makes a step's compute (the slowest
// worker's rows over its speed) faster by more than a threshold, so noise does not make the
// shares oscillate. An applied one sets the strategy's shares, and the epoch's pass goes on at
// the same position on the input distributed anew, so no row is lost or repeated.
// An elastic group's new generation starts the measurement over (the strategy is back at equal
// shares). A worker far below the others (FitOptions::straggler_floor) leaves an elastic group.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "flotilla/data/distribute.h"
#include "flotilla/strategy/strategy.h"
#include "train/epoch_iterator.h"
#include "train/step_timer.h"

namespace flotilla::train::detail {

class ShareBalancer {
 public:
  // `apply` false: measures and advises only (FitOptions::advise_shares_every).
  ShareBalancer(strategy::Strategy& strategy, StepTimer& timer, std::int64_t interval,
                double straggler_floor, bool apply = true);

  void begin_fit(const data::DistributedDataset& train);
  void end_fit();
  // After each step, on every worker at the same step: `rows` this worker trained on in it, of
  // a global batch of `global`. Every interval steps a collective; may rebind `input`. Throws
  // Straggler on a straggler of an elastic group (the others go on, and meet its departure).
  void after_step(EpochIterator& input, std::int64_t step_in_epoch, std::int64_t rows,
                  std::int64_t step_global);

 private:
  strategy::Strategy& strategy_;
  StepTimer& timer_;
  std::int64_t interval_;
  double floor_;
  bool apply_;
  bool advised_ = false; // advise mode: said (or nothing to say here); no more measuring
  const data::DistributedDataset* train_ = nullptr;
  std::unique_ptr<data::DistributedDataset> current_; // the input as divided now
  std::int64_t steps_ = 0;                            // since the fit began
  double compute_at_last_ = 0; // forward + backward seconds of the epoch at the last step
  double compute_ = 0;         // since the last report
  double waited_at_last_ = 0;  // the shared-memory all-reduces' waits at the last step
  std::int64_t rows_ = 0;      // since the last report
  std::vector<double> speeds_; // smoothed rows per second, per worker
  std::vector<int> below_;     // reports in a row each worker's speed was below the floor
  std::uint64_t generation_ = 0; // the elastic generation measured
  bool warned_ = false;          // of a straggler outside elastic mode

  void start_measuring();
  // Whether a straggler leaves the elastic group (this worker throws Straggler if it is it).
  bool check_stragglers(const std::vector<std::int64_t>& target, std::int64_t global);
};

// Shares that divide as `rows` do: the rows themselves, or scaled into Strategy::set_shares'
// bound (cluster::kMaxShareWeight) where a global batch has more rows than it.
std::vector<std::int64_t> weights_of(const std::vector<std::int64_t>& rows);

// A step's compute time with `rows` per worker at `speeds` (rows per second): the slowest's.
double step_compute_seconds(const std::vector<std::int64_t>& rows,
                            const std::vector<double>& speeds);

// The division of `global` rows in proportion to `speeds` (largest remainders), each worker at
// least one row; rows sum to `global`.
std::vector<std::int64_t> rows_by_speed(const std::vector<double>& speeds, std::int64_t global);

} // namespace flotilla::train::detail
