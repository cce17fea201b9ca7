// The rendezvous replicated through etcd: leader election under a lease (see
// serve_rendezvous_replica in elastic.h). Only the elected replica listens, so a worker can never
// reach two that serve; the membership needs no copy in etcd, since a newly elected replica takes
// it up from the members as a restarted rendezvous does (Membership::resume).
#include <atomic>
#include <cmath>
#include <mutex>
#include <thread>

#include "rendezvous/etcd.h"
#include "flotilla/rendezvous/service.h"
#include "flotilla/error.h"

namespace flotilla::collective {
namespace {

using Clock = std::chrono::steady_clock;
using Say = std::function<void(const std::string&)>;

// Sleeps up to `d`, waking early when `stopping()`.
void pause(std::chrono::milliseconds d, const std::function<bool()>& stopping) {
  const auto until = Clock::now() + d;
  while (!stopping() && Clock::now() < until) {
    std::this_thread::sleep_for(
        std::min<Clock::duration>(std::chrono::milliseconds(50), until - Clock::now()));
  }
}

void revoke_quietly(detail::EtcdClient& client, std::int64_t lease) {
  try {
    client.revoke(lease);
  } catch (const Error&) {
  }
}

// Renews one lease on a thread of its own, so that a renewal stuck on an unreachable endpoint
// never delays the serving replica's decision to stop serving. A renewal counts only once the
// quorum confirms it: one answered by a member cut off with a minority never reached the leader
// whose clock expires the lease.
class LeaseRenewer {
 public:
  LeaseRenewer(detail::EtcdClient& client, const std::string& key, std::int64_t lease,
               Clock::time_point granted_at, std::chrono::milliseconds every, const Say& say)
      : client_(client), key_(key), lease_(lease), every_(every), say_(say),
        renewed_(granted_at.time_since_epoch().count()), thread_([this] { run(); }) {}
  ~LeaseRenewer() { stop(); }

  // Waits for a renewal still under way (up to a lease).
  void stop() {
    done_ = true;
    if (thread_.joinable()) thread_.join();
  }
  bool expired() const { return expired_; }
  Clock::duration since_renewed() const {
    return Clock::now() - Clock::time_point(Clock::duration(renewed_.load()));
  }
  // `say`, never at once with the renewer's own words.
  void say(const std::string& what) {
    std::lock_guard<std::mutex> lock(said_);
    say_(what);
  }

 private:
  void run() {
    while (!done_) {
      const auto asked = Clock::now();
      try {
        if (client_.keep_alive(lease_) == 0) {
          expired_ = true;
          return;
        }
        if (client_.holds(key_, lease_)) {
          renewed_ = asked.time_since_epoch().count();
          failing_ = false;
        } else {
          failed("renewed, but the quorum does not confirm it");
        }
      } catch (const Error& e) {
        failed(e.what()); // the serving loop decides when that is too long
      }
      while (!done_ && Clock::now() < asked + every_)
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  void failed(const std::string& why) {
    if (!failing_) say("could not renew the lease in etcd (" + why + "); trying again");
    failing_ = true;
  }

  detail::EtcdClient& client_;
  const std::string key_;
  const std::int64_t lease_;
  const std::chrono::milliseconds every_;
  const Say say_;
  std::mutex said_;
  bool failing_ = false; // the renewer thread's own
  std::atomic<Clock::rep> renewed_;
  std::atomic<bool> expired_{false}, done_{false};
  std::thread thread_; // last: starts once the rest is made
};

// Serves until `stopping()` or the lease is lost; why it stopped ("" when asked to).
std::string serve_while_leased(const LeaseRenewer& renewer, Clock::duration step_down_after,
                               const std::function<bool()>& stopping) {
  while (!stopping()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    const auto since = renewer.since_renewed();
    if (renewer.expired()) return "its lease expired in etcd";
    if (since > step_down_after) {
      return "it could not renew its lease in etcd for " +
             std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(since).count()) +
             " ms (cut off from etcd's quorum, or etcd is down)";
    }
  }
  return "";
}

} // namespace

void serve_rendezvous_replica(const RendezvousService::Options& options,
                              const cluster::EtcdRendezvous& etcd,
                              const std::function<bool()>& stopping, const Say& say) {
  // At least 5 s: longer than etcd's own leader election (1-2 s with its default timeouts), so
  // the serving replica renews its lease through another member when etcd's leader dies.
  const auto ttl_s = std::max<std::int64_t>(
      5, static_cast<std::int64_t>(std::ceil(options.heartbeat_timeout.count() / 1000.0)));
  const std::chrono::milliseconds ttl(ttl_s * 1000);
  const auto renew_every = ttl / 4;
  const std::string me = options.listen.to_string();
  const std::string key = etcd.key();
  detail::EtcdClient client(etcd, renew_every);
  std::string last_said;
  const auto say_once = [&](const std::string& what) {
    if (what != last_said) say(what);
    last_said = what;
  };

  while (!stopping()) {
    // Campaign: create the key under a fresh lease; whoever made it serves.
    std::int64_t lease = 0;
    const auto granted_at = Clock::now();
    try {
      lease = client.grant(ttl_s);
      if (!client.create(key, me, lease)) {
        revoke_quietly(client, lease);
        const auto serving = client.get(key);
        say_once("standing by: " + (serving ? *serving : std::string("another replica")) +
                 " serves job \"" + etcd.job + "\" (etcd key " + key + ")");
        pause(renew_every, stopping);
        continue;
      }
    } catch (const CommError& e) { // a ConfigError (etcd refused this client) goes up
      say_once(std::string("cannot campaign: ") + e.what() + "; trying again");
      pause(renew_every, stopping);
      continue;
    }

    std::unique_ptr<RendezvousService> service;
    try {
      service = std::make_unique<RendezvousService>(options);
    } catch (const Error& e) {
      say(std::string("elected, but cannot serve: ") + e.what() + "; giving the key up");
      revoke_quietly(client, lease);
      pause(ttl, stopping);
      continue;
    }
    say("serving job \"" + etcd.job + "\" at " + me + ", elected through etcd (key " + key +
        ", lease " + std::to_string(ttl_s) + " s)");
    last_said.clear();

    LeaseRenewer renewer(client, key, lease, granted_at, renew_every, say);
    const std::string why = serve_while_leased(renewer, ttl * 3 / 4, stopping);
    service.reset(); // first: nothing is served once another replica may be elected
    if (!why.empty()) renewer.say("stopped serving: " + why + "; campaigning again");
    renewer.stop();
    revoke_quietly(client, lease); // the next replica need not wait for the lease to expire
  }
}

} // namespace flotilla::collective
