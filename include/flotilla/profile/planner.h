// The scaling planner: from one measured single-worker run, predicts the step time, samples/s
// and scaling efficiency at other worker counts on a given network, and the gradient bucket size
// (bytes_per_pack) that makes the step shortest. The seeds' rule is to optimise one machine, then
// add workers; this answers "how many, on what network, with which buckets" before renting them.
//
// The model (tests/unit/profile/planner_test.cpp checks it against hand-computed cases; its
// validation against real runs over tc-limited links is in docs/benchmarks.md, bench/plan.sh):
//  - compute does not change with the worker count (weak scaling: the per-worker batch is fixed,
//    every worker on its own machine), so every phase of the measured step is kept as it is;
//  - the gradient is packed into buckets as the gradient engine packs it: parameters in the
//    order backward produces them (RecipeFacts::gradient_layout), a bucket closing before a
//    parameter that would take it past bytes_per_pack, so one huge weight is one huge bucket
//    (a profile without the layout: cut evenly, the last bucket holding the remainder); each
//    bucket's bytes on the wire are its share of gradient_bytes (compression, used-flags);
//    backward produces bytes at a steady rate over its time;
//  - the link carries one bucket at a time (a bucket starts when it is ready and the previous one
//    is done), and one all-reduce of b bytes over n workers costs a ring's
//      per_collective + 2(n-1) * latency + 2(n-1)/n * b / bytes_per_s
//    (reduce-scatter then all-gather: 2(n-1) steps, each moving b/n bytes over every link at once
//    and each paying one hop's latency; per_collective is the fixed cost of one collective —
//    issuing it, the backend's bookkeeping, the waits between the two halves — which is what
//    makes many tiny buckets lose to a few large ones);
//  - the communication that ends after backward ends is exposed and adds to the step; without
//    overlap every bucket starts after backward, so all of it is exposed. One worker: none.
// What it does not model: layers whose backward time is not in proportion to their gradient
// bytes (a convolution computes far more per byte of weight than a linear layer), backward
// slowed by communication threads, stragglers,
// hierarchical or tree all-reduce, congestion. Torch-free: it reads a RunSummary.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flotilla/profile/run_summary.h"

namespace flotilla::profile {

// The library's default bucket size (collective::CommunicationOptions::bytes_per_pack), used
// when a profile does not say which it ran with.
inline constexpr std::int64_t kDefaultBytesPerPack = 25 * 1024 * 1024;
// The smallest bucket best_bucket() tries.
inline constexpr std::int64_t kSmallestCandidateBucket = 64 * 1024;

// Bytes per second from a rate with its unit: bits ("25Gbit", "100mbit", "10Gbps", "1Gb/s") or
// bytes ("1.5GB/s", "800MB/s", "1GiB/s", "100MBps"); k/M/G/T are powers of 1000, Ki/Mi/Gi/Ti of
// 1024. ConfigError naming `what`, the value and the accepted forms otherwise (also for 0,
// negative or no unit).
double parse_bandwidth(const std::string& text, const std::string& what = "bandwidth");
// Seconds from "20us" ("µs" too), "1ms", "0.5s", "500ns"; "0" alone is allowed. ConfigError
// naming `what`, the value and the accepted forms otherwise (also for negative values).
double parse_duration(const std::string& text, const std::string& what = "duration");

// The network the workers would share: one link per worker, full duplex.
struct Link {
  double bytes_per_s = 0;      // what a connection achieves (goodput), not the line rate
  double latency_s = 0;        // one hop, one way
  double per_collective_s = 0; // fixed cost of one all-reduce, however small
};

// One step of the single-worker run, per step (phase seconds / steps).
struct StepProfile {
  double input = 0;
  double copy = 0;
  double forward = 0;
  double backward = 0;
  double optimizer = 0;
  double metrics = 0;
  double callbacks = 0;
  // The step's wall-clock time outside those phases (clock reads between them, the one-worker
  // gradient wait): kept in every prediction, so step(1) is the measured step.
  double other = 0;
  std::int64_t gradient_bytes = 0;
  // Each parameter's gradient bytes in backward order (empty: unknown, buckets cut evenly), and
  // its kind (dtype@device; empty: all one kind).
  std::vector<std::int64_t> gradient_layout;
  std::vector<std::string> gradient_kinds;
  std::int64_t bytes_per_pack = kDefaultBytesPerPack;
  bool overlap = true;
  std::int64_t batch_per_worker = 0;
  std::int64_t steps = 0; // measured steps the averages come from

  // Everything but cross-worker communication: the step at one worker.
  double compute_seconds() const;
};

// The steady-state profile of a single-worker run. ConfigError (naming `where`) when the run had
// more than one worker (the planner needs one worker's compute alone; the message shows the
// command that makes one), no gradient_bytes, no epochs or zero steps.
StepProfile step_profile(const RunSummary& run, const std::string& where);

// One ring all-reduce of `bytes` over `workers` (the formula above); 0 for one worker or no bytes.
double all_reduce_seconds(std::int64_t bytes, int workers, const Link& link);

// The buckets the planner assumes, in the order backward fills them: bucket_bytes each, the last
// holding the remainder. Empty for no gradient.
std::vector<std::int64_t> split_buckets(std::int64_t gradient_bytes, std::int64_t bucket_bytes);
// The buckets of `profile`'s gradient at `bucket_bytes`, in bytes on the wire: its
// gradient_layout packed by the gradient engine's own rule (strategy::assign_buckets: a bucket
// holds one kind and never splits a parameter), else split_buckets() of its gradient_bytes.
std::vector<std::int64_t> plan_buckets(const StepProfile& profile, std::int64_t bucket_bytes);

struct Prediction {
  int workers = 1;
  std::int64_t bucket_bytes = 0;
  int buckets = 0;
  double step_seconds = 0;    // compute + exposed
  double comm_seconds = 0;    // sum of every bucket's all-reduce time (hidden and exposed)
  double exposed_seconds = 0; // communication that ends after backward
  double efficiency = 1;      // step at one worker / step at `workers`
  double samples_per_s = 0;   // workers * batch_per_worker / step_seconds
};

// The step at `workers` with gradients packed in buckets of `bucket_bytes`. ConfigError for
// workers < 1, bucket_bytes < 1 or a link without bandwidth.
Prediction predict(const StepProfile& profile, int workers, const Link& link,
                   std::int64_t bucket_bytes, bool overlap);

// Bucket sizes worth trying: powers of two from kSmallestCandidateBucket below the gradient's
// size, then the whole gradient (one bucket). Just the whole gradient when it is smaller.
std::vector<std::int64_t> candidate_buckets(std::int64_t gradient_bytes);

// The candidate bucket size with the shortest predicted step at `workers`; of equal steps (within
// 1e-9 relative), the larger bucket (fewer collectives to go wrong).
Prediction best_bucket(const StepProfile& profile, int workers, const Link& link, bool overlap);

} // namespace flotilla::profile
