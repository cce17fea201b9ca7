#include "flotilla/rendezvous/heartbeat.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <thread>

#include "rendezvous/connection.h"
#include "rendezvous/wire.h"
#include "flotilla/error.h"
#include "flotilla/log.h"

namespace flotilla::collective::detail {

namespace {
using Clock = std::chrono::steady_clock;

std::chrono::milliseconds since(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t);
}
} // namespace

struct Heartbeat::Impl {
  RendezvousConfig config;
  std::function<void(const std::string&)> on_failure;
  ElasticHooks elastic;
  std::unique_ptr<Connection> connection;
  std::mutex mutex;
  std::condition_variable cv;
  bool stopping = false;
  std::thread thread;
  Logger log;
  // Elastic: since when the rendezvous has not answered; nullopt while it does.
  std::optional<Clock::time_point> outage;

  bool is_elastic() const { return config.elastic && config.standing; }

  void report(const std::string& what) {
    if (!stopping) on_failure(what);
  }

  // Waits one interval; false when stopping.
  bool pause() {
    std::unique_lock<std::mutex> lock(mutex);
    cv.wait_for(lock, config.heartbeat_interval, [&] { return stopping; });
    return !stopping;
  }

  // Elastic: the rendezvous is unreachable since `from` (or `outage` began earlier). Training
  // goes on; nothing is admitted until it is back.
  void lost_rendezvous(Clock::time_point from, const std::string& why) {
    if (outage) return;
    outage = from;
    if (elastic.on_outage) elastic.on_outage();
    log.warn(why + "; training goes on, and admissions and regroups wait for it (up to " +
             ms_text(config.timeout) + ")");
  }

  // Elastic: one attempt of about a heartbeat interval to join a restarted rendezvous, store
  // connection first; false when it is not back yet.
  bool try_rejoin() {
    const auto attempt =
        Clock::now() + std::max(config.heartbeat_interval, std::chrono::milliseconds(500));
    try {
      if (elastic.rejoin_store) elastic.rejoin_store(attempt);
      connection = Connection::join(config, kRoleHeartbeat, attempt);
    } catch (const TimeoutError&) {
      if (elastic.on_unreachable) elastic.on_unreachable();
      return false;
    } catch (const ConnectionLost&) {
      if (elastic.on_unreachable) elastic.on_unreachable();
      return false;
    }
    std::string generation;
    {
      std::lock_guard<std::mutex> lock(config.standing->mutex);
      if (config.standing->member) {
        generation = " as a member of generation " + std::to_string(config.standing->generation);
      }
    }
    log.info(config.server_name() + " answers again after " + ms_text(since(*outage)) + "; " +
             config.name(config.rank) + " joined it again" + generation);
    outage.reset();
    return true;
  }

  // Elastic: this member's generation and the newest collective it has started in it (what
  // a ping says); zeros otherwise.
  std::pair<std::uint64_t, std::uint64_t> progress() const {
    if (!is_elastic()) return {0, 0};
    std::lock_guard<std::mutex> lock(config.standing->mutex);
    const auto& reached = config.standing->reached;
    return {config.standing->generation, reached ? reached->load(std::memory_order_relaxed) : 0};
  }

  void run() {
    auto last_answer = Clock::now();
    bool awaiting = false; // a ping sent whose answer has not been read
    for (;;) {
      if (!pause()) return;
      if (outage && since(*outage) > config.timeout) {
        return report(config.server_name() + " has been unreachable for " +
                      ms_text(since(*outage)) +
                      " (CommunicationOptions::timeout): this worker cannot rejoin it");
      }
      try {
        if (!connection) {
          if (!try_rejoin()) continue;
          awaiting = false;
          last_answer = Clock::now();
        }
        if (!awaiting) {
          WireWriter w;
          w.u8(kPing);
          const auto [generation, reached] = progress();
          w.i64(static_cast<std::int64_t>(generation));
          w.i64(static_cast<std::int64_t>(reached));
          connection->send(w.frame(), Clock::now() + config.heartbeat_timeout);
          awaiting = true;
        }
        // After this process was itself stopped (SIGSTOP, a VM pause), the deadline has passed
        // already: read what the server said meanwhile before blaming it.
        const auto deadline = std::max(last_answer + config.heartbeat_timeout,
                                       Clock::now() + config.heartbeat_interval);
        const std::string body = connection->receive(deadline);
        awaiting = false;
        last_answer = Clock::now();
        if (outage) {
          log.info(config.server_name() + " answers again after " + ms_text(since(*outage)));
          outage.reset();
        }
        const Pong pong = Pong::parse(body, config.world_size);
        if (is_elastic()) {
          if (elastic.on_pong) elastic.on_pong(pong);
          if (pong.expelled) {
            return report((pong.failed.empty() ? config.name(config.rank) + " was dropped"
                                               : pong.failed.front().second) +
                          "; it was expelled from the training group (start it again to rejoin)");
          }
          if (pong.closing) {
            connection.reset();
            lost_rendezvous(Clock::now(), config.server_name() + " shut down");
          }
          continue;
        }
        std::string failed;
        for (const auto& [rank, reason] : pong.failed) {
          if (rank != config.rank) failed += (failed.empty() ? "" : "; ") + reason;
        }
        if (!failed.empty()) return report(failed);
        if (pong.closing) return; // the chief is leaving normally: nothing more to watch
      } catch (const TimeoutError&) {
        const std::string silent = config.server_name() + " stopped answering heartbeats for " +
                                   ms_text(config.heartbeat_timeout) +
                                   " (stopped, hung, or cut off from the network)";
        if (!is_elastic()) return report(silent);
        // Frozen or cut off: its answer may still come on this connection.
        lost_rendezvous(last_answer, silent);
      } catch (const ConfigError& e) {
        return report(e.what()); // a restarted rendezvous refused this process
      } catch (const std::exception& e) {
        if (!is_elastic()) return report(config.server_name() + " is gone (" + e.what() + ")");
        connection.reset();
        lost_rendezvous(Clock::now(), e.what());
      }
    }
  }
};

Heartbeat::Heartbeat(const RendezvousConfig& config,
                     std::function<void(const std::string&)> on_failure, ElasticHooks elastic)
    : impl_(std::make_unique<Impl>()) {
  impl_->config = config;
  impl_->on_failure = std::move(on_failure);
  impl_->elastic = std::move(elastic);
  impl_->log = Logger(config.rank, config.world_size);
  // Made right after the rendezvous, so the chief was alive a moment ago: an answer later than
  // the heartbeat's own limit means it is not any more.
  impl_->connection = Connection::join(
      config, kRoleHeartbeat, Clock::now() + std::min(config.timeout, config.heartbeat_timeout));
  impl_->thread = std::thread([impl = impl_.get()] { impl->run(); });
}

Heartbeat::~Heartbeat() {
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->stopping = true;
  }
  impl_->cv.notify_all();
  impl_->thread.join();
  if (!impl_->connection) return;
  try {
    WireWriter w;
    w.u8(kBye);
    impl_->connection->send(w.frame(), Clock::now() + std::chrono::seconds(1));
  } catch (const std::exception&) {
    // The chief is gone already: nobody to say goodbye to.
  }
}

} // namespace flotilla::collective::detail
