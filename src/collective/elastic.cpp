#include "flotilla/collective/elastic.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "collective/group.h"
#include "flotilla/rendezvous/heartbeat.h"
#include "flotilla/rendezvous/probe.h"
#include "flotilla/rendezvous/config.h"
#include "flotilla/rendezvous/server.h"
#include "flotilla/rendezvous/store.h"
#include "flotilla/rendezvous/reports.h"
#include "flotilla/error.h"
#include "flotilla/log.h"

namespace flotilla::collective {

namespace {
using Clock = std::chrono::steady_clock;

std::string text(const std::vector<std::uint8_t>& bytes) {
  return {bytes.begin(), bytes.end()};
}

// A generation's record: "slot,slot,...\nwhy", and "\nafresh" when it starts the training over.
struct Record {
  std::vector<int> slots;
  std::string reason;
  bool afresh = false;
};

Record parse_record(const std::string& value, std::uint64_t generation) {
  Record record;
  const auto newline = value.find('\n');
  const std::string list = value.substr(0, newline);
  record.reason = newline == std::string::npos ? "" : value.substr(newline + 1);
  if (const auto mark = record.reason.find('\n'); mark != std::string::npos) {
    record.afresh = record.reason.substr(mark + 1) == "afresh";
    record.reason.resize(mark);
  }
  auto slots = detail::parse_int_list(list);
  if (!slots) {
    throw CommError("the rendezvous recorded generation " + std::to_string(generation) + " as \"" +
                    list + "\", which is not a list of slots");
  }
  record.slots = std::move(*slots);
  return record;
}

std::chrono::milliseconds left(Clock::time_point deadline) {
  return std::max(std::chrono::milliseconds(1),
                  std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
}
} // namespace

// ------------------------------------------------------------------------------------------

// One worker's membership through the rendezvous service: what RendezvousGroup holds.
struct MembershipState {
  cluster::ClusterSpec spec;
  CommunicationOptions options;
  detail::RendezvousConfig config;
  Logger log;
  c10::intrusive_ptr<detail::RendezvousStore> store;
  std::unique_ptr<detail::Heartbeat> heartbeat;
  std::unique_ptr<detail::ProbeResponder> probe; // null: this member cannot be probed
  detail::GroupFactory make_group;

  // The current generation. Written by the training thread; `mutex` guards what the
  // heartbeat's thread reads (the generation's number and health).
  std::mutex mutex;
  std::uint64_t generation = 0;
  std::shared_ptr<Health> health;
  std::string lost; // the rendezvous is gone or expelled this worker: nothing to regroup into
  std::optional<Communicator> communicator;
  std::vector<int> members;
  std::string reason;
  bool afresh = false; // the generation this worker joined starts the training over
  std::atomic<int> waiting{0};
  // The heartbeat lost the rendezvous, and an attempt to join it again since found it
  // unreachable (not merely the connections it closed when it expelled this worker); cleared by
  // any answer, and when an outage begins.
  std::atomic<bool> unreachable{false};
  Clock::time_point last_confirmed = Clock::now(); // confirm_membership's last call

  // A departure the rendezvous saw reaches a member within a heartbeat or two; none by then, the
  // members probe each other (report_unreachable).
  std::chrono::milliseconds probe_after() const { return 2 * options.heartbeat_interval; }
  static constexpr std::chrono::milliseconds kProbeWait{1500};
  std::chrono::milliseconds regroup_wait() const {
    return options.heartbeat_timeout + probe_after() + kProbeWait + std::chrono::seconds(2);
  }

  static std::string key_in(std::uint64_t g, const std::string& key) {
    return "flotilla/g" + std::to_string(g) + "/" + key;
  }

  // Where the others probe this member in generation g (best effort: without it, this member is
  // never judged unreachable).
  void publish_probe(std::uint64_t g, int rank) {
    if (!probe) return;
    try {
      const std::string& address = probe->address();
      store->set(key_in(g, detail::kProbePrefix + std::to_string(rank)),
                 std::vector<std::uint8_t>(address.begin(), address.end()));
    } catch (const std::exception& e) {
      log.warn("could not publish where this worker answers probes (" + std::string(e.what()) +
               ")");
    }
  }

  // A collective of generation g failed and no member left: asks every other member of it
  // directly whether it answers, and reports the ones that do not (maybe none) to the rendezvous,
  // which expels the smaller side of a partition (Membership::partitioned).
  void report_unreachable(std::uint64_t g) {
    const auto me = std::find(members.begin(), members.end(), config.rank);
    if (!probe || me == members.end()) return;
    const int rank = static_cast<int>(me - members.begin());
    try {
      std::vector<std::pair<int, std::string>> peers;
      for (int r = 0; r < static_cast<int>(members.size()); ++r) {
        const std::string key = key_in(g, detail::kProbePrefix + std::to_string(r));
        if (r != rank && store->check({key})) peers.emplace_back(r, text(store->get(key)));
      }
      const std::vector<int> lost = detail::unreachable(peers, config.token, kProbeWait);
      const std::string report = detail::SilentReport{0, lost, "a probe"}.text();
      store->set(key_in(g, detail::kUnreachablePrefix + std::to_string(rank)),
                 std::vector<std::uint8_t>(report.begin(), report.end()));
      if (!lost.empty()) {
        std::string names;
        for (int r : lost) names += (names.empty() ? "" : ", ") + config.name(members[r]);
        log.warn("generation " + std::to_string(g) + ": " + names +
                 " did not answer a probe; told the rendezvous (the smaller side of a partition "
                 "is expelled)");
      }
    } catch (const std::exception& e) {
      log.warn("could not probe the other members of generation " + std::to_string(g) + " (" +
               e.what() + ")");
    }
  }

  void on_pong(const detail::Pong& pong) {
    waiting = static_cast<int>(pong.waiting);
    unreachable = false;
    std::lock_guard<std::mutex> lock(mutex);
    if (health && generation < pong.intact_from) {
      const std::string why = pong.failed.empty() ? "a member left" : pong.failed.front().second;
      detail::fail_group(*health, why, /*changed=*/true);
    }
  }

  void on_failure(const std::string& why) {
    std::lock_guard<std::mutex> lock(mutex);
    lost = why;
    if (health) detail::fail_group(*health, why, /*changed=*/false);
    log.error(why);
  }

  std::string lost_text() {
    std::lock_guard<std::mutex> lock(mutex);
    return lost;
  }

  std::optional<std::uint64_t> latest() {
    if (!store->check({detail::kLatestKey})) return std::nullopt;
    return std::stoull(text(store->get(detail::kLatestKey)));
  }

  Record record(std::uint64_t g) {
    return parse_record(text(store->get(detail::kGenerationKey + std::to_string(g))), g);
  }

  // Blocks until generation `g` exists; TimeoutError at `deadline`.
  void wait_for(std::uint64_t g, Clock::time_point deadline) {
    store->wait({detail::kGenerationKey + std::to_string(g)}, left(deadline));
  }

  // This worker's rank in generation g; CommError when it is not a member (expelled).
  int rank_in(std::uint64_t g, const Record& record) const {
    const auto at = std::find(record.slots.begin(), record.slots.end(), config.rank);
    if (at == record.slots.end()) {
      throw CommError(config.name(config.rank) + " is not a member of generation " +
                      std::to_string(g) + " (" + record.reason +
                      "): it was expelled from the training group (start it again to rejoin)");
    }
    return static_cast<int>(at - record.slots.begin());
  }

  // ElasticGroup::confirm_membership.
  //
  // Checked after any gap longer than a heartbeat interval, not only one longer than the
  // heartbeat timeout: the rendezvous counts this worker's silence from its last ping, which can
  // precede the last commit by an interval or more, so a member can be expelled within a gap
  // shorter than the timeout (seen once under make test's load: the woken worker committed).
  void confirm_membership() {
    const auto now = Clock::now();
    if (now - std::exchange(last_confirmed, now) <= options.heartbeat_interval) return;
    // The rendezvous closed this worker's connections (as it does when it expels a member, after
    // a last heartbeat answer saying why) or is down. The heartbeat reads that answer, or joins
    // again (and the store with it: the newest generation then says), as soon as it runs. Only
    // when it found the rendezvous unreachable is it down, and training goes on (at once when
    // the heartbeat knows it already: slow steps in an outage do not wait here each time). An
    // outage alone is not enough: an expelled worker's broken connections look like one until
    // the heartbeat tries to join again.
    const auto until = now + std::max(options.heartbeat_timeout, 5 * options.heartbeat_interval);
    for (;;) {
      if (const auto newest = store->get_if_connected(detail::kLatestKey)) {
        const std::uint64_t g = std::stoull(text(*newest));
        if (g > generation) rank_in(g, record(g)); // throws when expelled
        return;
      }
      if (const std::string why = lost_text(); !why.empty()) throw CommError(why);
      if (unreachable || Clock::now() >= until) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

  // The current generation's collectives can no longer complete anywhere (detail::sever_group):
  // regroup() calls it once this worker gave the generation up, before the next one forms, so
  // that a member stopped inside one of its collectives cannot finish it, woken, against what
  // this worker abandoned (a generation that fails to connect leaves the severed one current).
  void sever() {
    if (communicator) detail::sever_group(*communicator);
  }

  // adopt() after a departure or at joining. A group that cannot connect lost another member
  // while it formed: false, and the next generation is the one to join. Not being a member, or
  // a refusal, throws.
  bool try_adopt(std::uint64_t g, const Record& record) {
    rank_in(g, record);
    try {
      adopt(g, record, /*abandon=*/true);
      return true;
    } catch (const ConfigError&) {
      throw;
    } catch (const std::exception& e) {
      log.warn("generation " + std::to_string(g) + " could not connect (" + e.what() +
               "); waiting for the next one");
      return false;
    }
  }

  // Connects generation g's group in place of the current one. After a departure the current
  // group is abandoned (its backends are left to their threads: a backend blocked on a dead
  // peer cannot be joined); after an admission every operation of it has completed, and it is
  // closed as usual.
  void adopt(std::uint64_t g, const Record& record, bool abandon) {
    const int rank = rank_in(g, record);
    const int size = static_cast<int>(record.slots.size());
    auto fresh = detail::new_health();
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (health && abandon) {
        detail::fail_group(*health, "generation " + std::to_string(g) + " replaced it", true);
      }
      health = fresh;
      generation = g;
    }
    std::vector<std::string> names;
    for (int slot : record.slots) {
      const std::string name = config.name(slot);
      names.push_back(name + " (rank " + std::to_string(names.size()) + " of generation " +
                      std::to_string(g) + ")");
    }
    {
      // What this process names to a restarted rendezvous from now on.
      std::lock_guard<std::mutex> lock(config.standing->mutex);
      config.standing->member = true;
      config.standing->generation = g;
      config.standing->slots = record.slots;
      config.standing->reached = detail::reached_of(fresh);
    }
    members = record.slots;
    last_confirmed = Clock::now();
    publish_probe(g, rank);
    communicator = make_group(
        rank, size, options,
        c10::make_intrusive<c10d::PrefixStore>("flotilla/g" + std::to_string(g), store),
        spec.local_host, std::move(names), fresh);
    reason = record.reason;
    log = Logger(rank, size, g);
    log.info("generation " + std::to_string(g) + ": rank " + std::to_string(rank) + " of " +
             std::to_string(size) + " (" + record.reason + ")");
  }
};

namespace {

// The real ElasticGroup: membership through the rendezvous service.
class RendezvousGroup final : public ElasticGroup {
 public:
  explicit RendezvousGroup(std::unique_ptr<MembershipState> impl) : impl_(std::move(impl)) {}
  ~RendezvousGroup() override;
  Communicator& communicator() override;
  std::uint64_t generation() const override;
  const std::vector<int>& members() const override;
  int slot() const override;
  const std::string& reason() const override;
  int waiting() const override;
  bool starts_afresh() const override;
  void training_finished() override;
  void regroup() override;
  bool admit() override;
  void confirm_membership() override { impl_->confirm_membership(); }

 private:
  std::unique_ptr<MembershipState> impl_;
};

} // namespace

RendezvousGroup::~RendezvousGroup() {
  if (!impl_) return;
  impl_->heartbeat.reset(); // the goodbye: the others regroup without this worker
  std::lock_guard<std::mutex> lock(impl_->mutex);
  if (impl_->health) detail::fail_group(*impl_->health, "this worker left", true);
}

std::unique_ptr<ElasticGroup> ElasticGroup::join(const cluster::ClusterSpec& spec,
                                                 const CommunicationOptions& options) {
  return detail::join_elastic(spec, options, detail::make_group);
}

std::unique_ptr<ElasticGroup> detail::join_elastic(const cluster::ClusterSpec& spec,
                                                   const CommunicationOptions& options,
                                                   GroupFactory make) {
  if (spec.is_evaluator()) {
    throw ConfigError("this task is the evaluator, which is not part of the training group");
  }
  if (!spec.external_rendezvous) {
    throw ConfigError(
        "an elastic group needs its rendezvous outside the workers, so that it outlives any of "
        "them: start `flotilla rendezvous --listen HOST:PORT --workers " +
        std::to_string(spec.world_size) +
        "` and set FLOTILLA_RENDEZVOUS=HOST:PORT on every task, or run under `flotilla launch "
        "--elastic`");
  }
  auto impl = std::make_unique<MembershipState>();
  impl->make_group = std::move(make);
  impl->spec = spec;
  impl->options = options;
  impl->config = detail::rendezvous_config(spec, options);
  auto& config = impl->config;
  config.elastic = true;
  config.standing = std::make_shared<detail::Standing>();
  impl->log = Logger(spec.rank, spec.world_size);
  impl->store = c10::make_intrusive<detail::RendezvousStore>(config);
  MembershipState* raw = impl.get();
  detail::ElasticHooks hooks;
  hooks.on_pong = [raw](const detail::Pong& pong) { raw->on_pong(pong); };
  hooks.on_outage = [raw] {
    raw->waiting = 0;
    raw->unreachable = false;
  };
  hooks.on_unreachable = [raw] { raw->unreachable = true; };
  hooks.rejoin_store = [store = impl->store](Clock::time_point deadline) {
    store->reconnect(deadline);
  };
  impl->heartbeat = std::make_unique<detail::Heartbeat>(
      config, [raw](const std::string& why) { raw->on_failure(why); }, std::move(hooks));
  try {
    impl->probe = std::make_unique<detail::ProbeResponder>(spec.local_host, config.token);
  } catch (const Error& e) {
    impl->log.warn(std::string(e.what()) +
                   "; if the workers are ever cut off from each other while all reach the "
                   "rendezvous, this one cannot be told apart from the others");
  }
  // The newest generation that lists this slot. Any record formed after the claim was accepted
  // is about this process: the server frees a slot before it lets another process claim it.
  const auto deadline = Clock::now() + options.timeout;
  std::uint64_t next = 0;
  if (const auto newest = impl->latest()) next = *newest;
  for (;;) {
    try {
      impl->wait_for(next, deadline);
    } catch (const TimeoutError&) {
      throw TimeoutError(config.name(spec.rank) + " was not admitted to the elastic group at " +
                         spec.rendezvous.to_string() + " within " +
                         detail::ms_text(options.timeout) +
                         " (generation 0 forms when every task has joined; later ones admit a "
                         "restarted worker at a step boundary); start every task, or raise "
                         "CommunicationOptions::timeout");
    }
    const std::uint64_t newest = impl->latest().value_or(next);
    const Record record = impl->record(newest);
    next = newest + 1;
    const bool member =
        std::find(record.slots.begin(), record.slots.end(), spec.rank) != record.slots.end();
    if (member && impl->try_adopt(newest, record)) {
      impl->afresh = record.afresh;
      break;
    }
  }
  return std::make_unique<RendezvousGroup>(std::move(impl));
}

Communicator& RendezvousGroup::communicator() {
  return *impl_->communicator;
}
std::uint64_t RendezvousGroup::generation() const {
  return impl_->generation;
}
const std::vector<int>& RendezvousGroup::members() const {
  return impl_->members;
}
int RendezvousGroup::slot() const {
  return impl_->config.rank;
}
const std::string& RendezvousGroup::reason() const {
  return impl_->reason;
}
int RendezvousGroup::waiting() const {
  return impl_->waiting;
}
bool RendezvousGroup::starts_afresh() const {
  return impl_->afresh;
}

void RendezvousGroup::training_finished() {
  // Best effort: a rendezvous that is down now learns nothing, and a worker restarted later
  // waits for its join timeout instead of hearing at once that there is nothing to join.
  if (!impl_->store->set_if_connected(detail::kFinishedKey, std::vector<std::uint8_t>{'1'})) {
    impl_->log.warn("could not tell the rendezvous that the training finished (it is not "
                    "reachable now)");
  }
}

void RendezvousGroup::regroup() {
  auto& impl = *impl_;
  // A collective of this generation failed: it is over for every member, so it is cut off now,
  // not when the next one has formed (a heartbeat timeout or more later).
  impl.sever();
  for (;;) {
    if (const std::string lost = impl.lost_text(); !lost.empty()) {
      throw CommError(lost + "; this worker cannot regroup");
    }
    const std::uint64_t current = impl.generation;
    const auto deadline = Clock::now() + impl.regroup_wait();
    try {
      try {
        impl.wait_for(current + 1, Clock::now() + impl.probe_after());
      } catch (const TimeoutError&) {
        impl.report_unreachable(current);
        impl.wait_for(current + 1, deadline);
      }
    } catch (const TimeoutError&) {
      if (const std::string lost = impl.lost_text(); !lost.empty()) {
        throw CommError(lost + "; this worker cannot regroup");
      }
      throw TimeoutError("a collective of generation " + std::to_string(current) +
                         " failed, but no member left the group within " +
                         detail::ms_text(impl.regroup_wait()) +
                         " (the rendezvous still counts every member alive): the failure was "
                         "not a departure; see the error before this one");
    }
    const std::uint64_t newest = impl.latest().value_or(current + 1);
    if (impl.try_adopt(newest, impl.record(newest))) return;
  }
}

bool RendezvousGroup::admit() {
  auto& impl = *impl_;
  const std::uint64_t current = impl.generation;
  const std::uint64_t newest = impl.store->advance(current);
  if (newest == current) return false;
  impl.adopt(newest, impl.record(newest), /*abandon=*/false);
  return true;
}

} // namespace flotilla::collective
