#include "collective/heartbeat.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "collective/connection.h"
#include "collective/wire.h"
#include "flotilla/error.h"

namespace flotilla::collective::detail {

namespace {
using Clock = std::chrono::steady_clock;
} // namespace

struct Heartbeat::Impl {
  RendezvousConfig config;
  std::function<void(const std::string&)> on_failure;
  std::function<void(const Pong&)> on_pong;
  std::unique_ptr<Connection> connection;
  std::mutex mutex;
  std::condition_variable cv;
  bool stopping = false;
  std::thread thread;

  void report(const std::string& what) {
    if (!stopping) on_failure(what);
  }

  void run() {
    auto last_answer = Clock::now();
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex);
        cv.wait_for(lock, config.heartbeat_interval, [&] { return stopping; });
        if (stopping) return;
      }
      try {
        WireWriter w;
        w.u8(kPing);
        // After this process was itself stopped (SIGSTOP, a VM pause), the deadline has passed
        // already: read what the server said meanwhile before blaming it.
        const auto deadline = std::max(last_answer + config.heartbeat_timeout,
                                       Clock::now() + config.heartbeat_interval);
        connection->send(w.frame(), deadline);
        const std::string body = connection->receive(deadline);
        last_answer = Clock::now();
        const Pong pong = Pong::parse(body, config.world_size);
        if (config.elastic) {
          if (on_pong) on_pong(pong);
          if (pong.expelled) {
            return report((pong.failed.empty() ? config.name(config.rank) + " was dropped"
                                               : pong.failed.front().second) +
                          "; it was expelled from the training group (start it again to rejoin)");
          }
          if (pong.closing) return report(config.server_name() + " shut down");
          continue;
        }
        std::string failed;
        for (const auto& [rank, reason] : pong.failed) {
          if (rank != config.rank) failed += (failed.empty() ? "" : "; ") + reason;
        }
        if (!failed.empty()) return report(failed);
        if (pong.closing) return; // the chief is leaving normally: nothing more to watch
      } catch (const TimeoutError&) {
        return report(config.server_name() +
                      " stopped answering "
                      "heartbeats for " +
                      ms_text(config.heartbeat_timeout) +
                      " (stopped, hung, or cut off from the network)");
      } catch (const std::exception& e) {
        return report(config.server_name() + " is gone (" + e.what() + ")");
      }
    }
  }
};

Heartbeat::Heartbeat(const RendezvousConfig& config,
                     std::function<void(const std::string&)> on_failure,
                     std::function<void(const Pong&)> on_pong)
    : impl_(std::make_unique<Impl>()) {
  impl_->config = config;
  impl_->on_failure = std::move(on_failure);
  impl_->on_pong = std::move(on_pong);
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
  try {
    WireWriter w;
    w.u8(kBye);
    impl_->connection->send(w.frame(), Clock::now() + std::chrono::seconds(1));
  } catch (const std::exception&) {
    // The chief is gone already: nobody to say goodbye to.
  }
}

} // namespace flotilla::collective::detail
