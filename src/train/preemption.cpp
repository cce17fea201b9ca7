#include "flotilla/train/preemption.h"

#include <signal.h>

#include <algorithm>
#include <mutex>

#include "train/preemption.h"

namespace flotilla::train {
namespace {

// Votes at least this often (in steps), however fast the steps: a request must not wait for a
// count of steps a run may never reach.
constexpr std::int64_t kMaxVoteEvery = 1000;

// Process-wide because a signal is: the SIGTERM handler can reach nothing else. Lock-free, so
// setting it from the handler is async-signal-safe.
std::atomic<bool> g_preemption_requested{false};
static_assert(std::atomic<bool>::is_always_lock_free);

extern "C" void on_sigterm(int) {
  g_preemption_requested.store(true);
}

std::mutex g_handler_mutex;
int g_handler_users = 0;
struct sigaction g_previous_sigterm {};

} // namespace

void request_preemption() noexcept {
  g_preemption_requested.store(true);
}

bool preemption_requested() noexcept {
  return g_preemption_requested.load();
}

namespace detail {

SigtermLatch::SigtermLatch() {
  std::lock_guard<std::mutex> lock(g_handler_mutex);
  if (g_handler_users++ > 0) return;
  struct sigaction action {};
  action.sa_handler = on_sigterm;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART; // a collective's socket calls carry on; the flag waits for them
  ::sigaction(SIGTERM, &action, &g_previous_sigterm);
}

SigtermLatch::~SigtermLatch() {
  std::lock_guard<std::mutex> lock(g_handler_mutex);
  if (--g_handler_users == 0) ::sigaction(SIGTERM, &g_previous_sigterm, nullptr);
}

void clear_preemption_request() noexcept {
  g_preemption_requested.store(false);
}

PreemptionVote::PreemptionVote(collective::Communicator* workers,
                               std::chrono::milliseconds interval,
                               const std::atomic<bool>& own_request)
    : workers_(workers), interval_(interval), own_request_(own_request) {}

PreemptionVote::~PreemptionVote() {
  // A fit that ended by an exception has a vote still in flight.
  if (pending_) {
    try {
      pending_->wait();
    } catch (const std::exception&) {
      // The fit failed already; its own error is the one that matters.
    }
  }
}

void PreemptionVote::start(std::int64_t steps_timed) {
  const bool mine = own_request_.load() || g_preemption_requested.load();
  // The chief proposes the steps until the next vote from its own step time; the others send
  // 0, so the largest value is the chief's.
  std::int64_t every = 0;
  const auto now = base::Clock::now();
  if (workers_->rank() == 0) {
    every = 1;
    if (interval_.count() > 0 && steps_timed > 0) {
      const double step_s = base::seconds_between(started_, now) / steps_timed;
      const double steps =
          std::chrono::duration<double>(interval_).count() / std::max(step_s, 1e-6);
      every = std::clamp<std::int64_t>(static_cast<std::int64_t>(steps), 1, kMaxVoteEvery);
    }
  }
  started_ = now;
  pending_.emplace(*workers_, mine, every);
}

bool PreemptionVote::read() {
  if (!pending_) return false;
  const collective::Agreement vote = pending_->wait();
  pending_.reset();
  every_ = std::max<std::int64_t>(1, vote.max);
  return vote.any;
}

bool PreemptionVote::at_step_boundary() {
  if (!workers_) return own_request_.load() || g_preemption_requested.load();
  // The last vote, read now: it had at least a whole step to complete behind the computation;
  // the next starts at once. Both happen every every_ steps (the same on every worker).
  if (!agreed_ && ++since_ >= every_) {
    since_ = 0;
    // The chief times the steps since the vote being read began, for its next proposal.
    const std::int64_t steps_timed = pending_ ? every_ : 0;
    agreed_ = read();
    if (!agreed_) start(steps_timed);
  }
  return agreed_;
}

bool PreemptionVote::finish() {
  if (!workers_) return own_request_.load() || g_preemption_requested.load();
  const bool late = read() || agreed_;
  agreed_ = false;
  return late;
}

} // namespace detail
} // namespace flotilla::train
