// The rendezvous replicated through etcd: leader election under a lease (see
// serve_rendezvous_replica in elastic.h). Only the elected replica listens, so a worker can never
// reach two that serve; the membership needs no copy in etcd, since a newly elected replica takes
// it up from the members as a restarted rendezvous does (Membership::resume).
#include <atomic>
#include <cmath>
#include <mutex>
#include <thread>

#include "collective/etcd.h"
#include "flotilla/collective/elastic.h"
#include "flotilla/error.h"

namespace flotilla::collective {
namespace {

using Clock = std::chrono::steady_clock;

// Sleeps up to `d`, waking early when `stopping()`.
void pause(std::chrono::milliseconds d, const std::function<bool()>& stopping) {
  const auto until = Clock::now() + d;
  while (!stopping() && Clock::now() < until) {
    std::this_thread::sleep_for(
        std::min<Clock::duration>(std::chrono::milliseconds(50), until - Clock::now()));
  }
}

} // namespace

void serve_rendezvous_replica(const RendezvousService::Options& options,
                              const cluster::EtcdRendezvous& etcd,
                              const std::function<bool()>& stopping,
                              const std::function<void(const std::string&)>& say) {
  // At least 5 s: longer than etcd's own leader election (1-2 s with its default timeouts), so
  // the serving replica renews its lease through another member when etcd's leader dies.
  const auto ttl_s = std::max<std::int64_t>(
      5, static_cast<std::int64_t>(std::ceil(options.heartbeat_timeout.count() / 1000.0)));
  const std::chrono::milliseconds ttl(ttl_s * 1000);
  const auto renew_every = ttl / 4;
  const auto step_down_after = ttl * 3 / 4;
  const std::string me = options.listen.to_string();
  const std::string key = etcd.key();
  detail::EtcdClient client(etcd.endpoints, renew_every);
  std::string last_said;
  const auto say_once = [&](const std::string& what) {
    if (what != last_said) say(what);
    last_said = what;
  };

  while (!stopping()) {
    std::int64_t lease = 0;
    const auto granted_at = Clock::now();
    try {
      lease = client.grant(ttl_s);
      if (!client.create(key, me, lease)) {
        client.revoke(lease);
        const auto serving = client.get(key);
        say_once("standing by: " + (serving ? *serving : std::string("another replica")) +
                 " serves job \"" + etcd.job + "\" (etcd key " + key + ")");
        pause(renew_every, stopping);
        continue;
      }
    } catch (const Error& e) {
      say_once(std::string("cannot campaign: ") + e.what() + "; trying again");
      pause(renew_every, stopping);
      continue;
    }

    std::unique_ptr<RendezvousService> service;
    try {
      service = std::make_unique<RendezvousService>(options);
    } catch (const Error& e) {
      say(std::string("elected, but cannot serve: ") + e.what() + "; giving the key up");
      try {
        client.revoke(lease);
      } catch (const Error&) {
      }
      pause(ttl, stopping);
      continue;
    }
    say("serving job \"" + etcd.job + "\" at " + me + ", elected through etcd (key " + key +
        ", lease " + std::to_string(ttl_s) + " s)");
    last_said.clear();

    // Renewals on a thread of their own, so that a renewal stuck on an unreachable endpoint never
    // delays the decision to stop serving.
    std::atomic<Clock::rep> renewed{granted_at.time_since_epoch().count()};
    std::atomic<bool> expired{false}, done{false};
    std::mutex said;
    std::thread renewer([&] {
      bool failing = false;
      const auto failed = [&](const std::string& why) {
        std::lock_guard<std::mutex> lock(said);
        if (!failing) say("could not renew the lease in etcd (" + why + "); trying again");
        failing = true;
      };
      while (!done) {
        const auto asked = Clock::now();
        try {
          if (client.keep_alive(lease) == 0) {
            expired = true;
            return;
          }
          // Counted only once the quorum confirms it: a renewal answered by a member cut off
          // with a minority never reached the leader whose clock expires the lease.
          if (client.holds(key, lease)) {
            renewed = asked.time_since_epoch().count();
            failing = false;
          } else {
            failed("renewed, but the quorum does not confirm it");
          }
        } catch (const Error& e) {
          failed(e.what()); // the serving loop decides when that is too long
        }
        const auto next = asked + renew_every;
        while (!done && Clock::now() < next)
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    });
    std::string why;
    while (why.empty() && !stopping()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      const auto since = Clock::now() - Clock::time_point(Clock::duration(renewed.load()));
      if (expired) {
        why = "its lease expired in etcd";
      } else if (since > step_down_after) {
        why = "it could not renew its lease in etcd for " +
              std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(since).count()) +
              " ms (cut off from etcd's quorum, or etcd is down)";
      }
    }
    service.reset(); // first: nothing is served once another replica may be elected
    done = true;
    {
      std::lock_guard<std::mutex> lock(said);
      if (!why.empty()) say("stopped serving: " + why + "; campaigning again");
    }
    renewer.join(); // may finish a renewal still under way (up to a lease)
    try {
      client.revoke(lease); // the next replica need not wait for the lease to expire
    } catch (const Error&) {
    }
  }
}

} // namespace flotilla::collective
