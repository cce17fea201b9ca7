// Private: fit's side of preemption (see flotilla/train/preemption.h): the SIGTERM latch and the
// workers' vote at step boundaries.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>

#include "flotilla/base/system.h"
#include "flotilla/collective/agreement.h"

namespace flotilla::train::detail {

// While alive, SIGTERM sets the process-wide preemption request instead of ending the process.
// Fits in one process (ranks as threads, a user's own threads) share the one disposition: the
// first latch installs the handler, the last puts back what was there before.
class SigtermLatch {
 public:
  SigtermLatch();
  ~SigtermLatch();
  SigtermLatch(const SigtermLatch&) = delete;
  SigtermLatch& operator=(const SigtermLatch&) = delete;
};

// The request was acted on: a new fit in this process starts clean.
void clear_preemption_request() noexcept;

// The workers' vote on preemption requests: a tiny agreement (this worker's request, and the
// chief's proposal of how many steps until the next vote) started at one step boundary and read
// at a later one, so it never waits on the step's critical path. The chief spaces the votes
// about `interval` apart in time, from its own step time, as a whole number of steps it sends
// with each vote, so every worker votes at the same steps. 0: a vote every step.
// Without `workers` (an elastic group, whose membership changes mid-fit) there is no vote: the
// worker that got the request acts on it alone at its next step boundary, leaving the group.
class PreemptionVote {
 public:
  PreemptionVote(collective::Communicator* workers, std::chrono::milliseconds interval,
                 const std::atomic<bool>& own_request);
  ~PreemptionVote(); // waits for a vote still in flight
  PreemptionVote(const PreemptionVote&) = delete;
  PreemptionVote& operator=(const PreemptionVote&) = delete;

  // At every step boundary, the same on every worker: reads the vote due here and starts the
  // next. True from the boundary where every worker has learnt of a request on.
  bool at_step_boundary();
  // At the fit's end: whether a request came too late to act on (a vote in flight is read).
  bool finish();

 private:
  void start(std::int64_t steps_timed);
  bool read();

  collective::Communicator* workers_;
  std::chrono::milliseconds interval_;
  const std::atomic<bool>& own_request_;
  bool agreed_ = false;
  std::int64_t every_ = 1; // steps between votes, as the last vote decided
  std::int64_t since_ = 0;
  base::Clock::time_point started_;
  std::optional<collective::PendingAgreement> pending_;
};

} // namespace flotilla::train::detail
