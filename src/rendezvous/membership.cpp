#include "rendezvous/membership.h"

#include <algorithm>

namespace flotilla::collective::detail {

std::string Membership::Generation::slot_list() const {
  return int_list(slots);
}

std::string Membership::Generation::record() const {
  return slot_list() + "\n" + why + (afresh ? "\nafresh" : "");
}

Membership::Membership(int world_size, bool elastic, std::function<std::string(int)> name)
    : slots_(static_cast<std::size_t>(world_size)), elastic_(elastic), name_(std::move(name)) {}

std::string Membership::why_refused(int s, const Session& session, bool heartbeat) const {
  const Slot& state = slot(s);
  const bool same_process = state.claimed && equal_secret(state.session, session);
  if (state.claimed && !same_process) {
    return name_(s) + " is already taken by the process at " + state.peer +
           "; two tasks were given the same task type and index";
  }
  if (heartbeat && (!same_process || state.heartbeating)) {
    return "a heartbeat for " + name_(s) + " from a process that has not joined";
  }
  return "";
}

Membership::Changes Membership::claim(int s, const Session& session, const std::string& peer) {
  Changes changes;
  // Another process in the slot of a member expected back after a restart: that member is gone.
  if (elastic_ && !at(s).claimed && at(s).member) {
    changes = release(s,
                      "did not come back after the rendezvous restarted (a new process "
                      "claimed its slot)",
                      false);
  }
  Slot& state = at(s);
  const bool first = !state.claimed;
  state.claimed = true;
  state.session = session;
  state.peer = peer;
  if (!elastic_ || !first) return changes;
  if (!formed_ || lost_) {
    if (lost_) {
      changes.info.push_back(name_(s) + " (" + peer + ") joined to start the lost training afresh");
    }
    form_afresh_when_all_claimed(changes);
  } else if (slots_where([](const Slot& x) { return x.member; }).empty()) {
    // Nobody is left to admit it at a step boundary (the group finished): a generation of the
    // workers waiting, at once, so each learns there is no training state to join instead of
    // waiting out its timeout.
    form(changes, slots_where([](const Slot& x) { return x.claimed; }),
         "no member left to admit " + name_(s), /*departure=*/false);
  } else {
    changes.info.push_back(name_(s) + " (" + peer + ") is waiting to be admitted at the next step");
  }
  return changes;
}

Membership::Changes Membership::resume(int s, const Session& session, const std::string& peer,
                                       std::uint64_t g, const std::vector<int>& slots,
                                       Clock::time_point now) {
  Changes changes;
  Slot& state = at(s);
  state.claimed = true;
  state.session = session;
  state.peer = peer;
  state.resumed = true;
  if (!formed_ || g > generation_) {
    formed_ = true;
    lost_ = false;
    generation_ = g;
    intact_from_ = g;
    for (auto& x : slots_) x.member = false;
    for (int m : slots) {
      at(m).member = true;
      if (!at(m).claimed) at(m).last_seen = now;
    }
    Generation resumed{g, slots,
                       "taken up after the rendezvous restarted (" + name_(s) + ", " + peer +
                           ", was a member)"};
    resumed.resumed = true;
    changes.formed.push_back(resumed);
  } else if (!state.member) {
    changes.info.push_back(name_(s) + " (" + peer + ") came back from generation " +
                           std::to_string(g) + ", which generation " + std::to_string(generation_) +
                           " replaced without it: it is not admitted, and exits when it regroups");
  }
  return changes;
}

void Membership::start_heartbeat(int s, Clock::time_point now) {
  at(s).heartbeating = true;
  at(s).last_seen = now;
}

Membership::Changes Membership::release(int s, const std::string& what, bool finished) {
  Changes changes;
  const std::string why = name_(s) + " " + what;
  const bool was_member = at(s).member;
  if (was_member) last_departure_ = {s, why};
  at(s) = Slot{};
  if (!was_member) {
    changes.info.push_back(why + " before it was admitted");
    return changes;
  }
  auto next = slots_where([](const Slot& x) { return x.member; });
  // None left: after a finished training the workers waiting learn there is nothing to join;
  // otherwise the group is lost, and they wait for the others to start afresh.
  const bool none_left = next.empty();
  if (none_left && finished) next = slots_where([](const Slot& x) { return x.claimed; });
  form(changes, next, why, /*departure=*/true);
  if (none_left && !finished) {
    lost_ = true;
    changes.warnings.push_back(
        "every member left before the training finished; the next generation forms when all " +
        std::to_string(world_size()) +
        " workers have joined again, and starts the training afresh (from its backup, if it "
        "keeps one)");
    form_afresh_when_all_claimed(changes);
  }
  return changes;
}

std::uint64_t Membership::advance(std::uint64_t from, Changes& changes) {
  if (formed_ && from == generation_) {
    const auto waiting = slots_where([](const Slot& x) { return waits(x); });
    if (!waiting.empty()) {
      std::string names;
      for (int slot : waiting) names += (names.empty() ? "" : ", ") + name_(slot);
      form(changes, slots_where([](const Slot& x) { return x.member || waits(x); }),
           "admitted " + names, /*departure=*/false);
    }
  }
  return generation_;
}

std::optional<std::vector<int>> Membership::slots_reported(int reporter, std::uint64_t g,
                                                           const std::vector<int>& ranks) const {
  if (!formed_ || g != generation_ || !slot(reporter).member) return std::nullopt;
  const auto members = slots_where([](const Slot& x) { return x.member; });
  std::vector<int> out;
  for (int r : ranks) {
    if (r < 0 || r >= static_cast<int>(members.size())) continue;
    const int s = members[static_cast<std::size_t>(r)];
    if (s != reporter && std::find(out.begin(), out.end(), s) == out.end()) out.push_back(s);
  }
  return out;
}

std::vector<int> Membership::reported_silent(int reporter, std::uint64_t g, std::uint64_t sequence,
                                             const std::vector<int>& ranks,
                                             const std::string& description) {
  std::vector<int> held;
  for (int s : slots_reported(reporter, g, ranks).value_or(std::vector<int>{})) {
    Slot& x = at(s);
    if (x.said.generation == g && x.said.reached >= sequence) continue; // it is in it
    if (!x.held) x.held = HeldReport{reporter, g, sequence, description};
    held.push_back(s);
  }
  return held;
}

std::optional<Membership::HeldReport> Membership::heard_from(int s, Clock::time_point now,
                                                             Progress progress) {
  Slot& x = at(s);
  x.last_seen = now;
  x.said = progress;
  if (!x.held) return std::nullopt;
  const HeldReport& r = *x.held;
  if (r.generation != generation_ || !x.member ||
      (progress.generation == r.generation && progress.reached >= r.sequence)) {
    x.held.reset();
    return std::nullopt;
  }
  if (++x.held->pings < 2) return std::nullopt;
  HeldReport out = std::move(*x.held);
  x.held.reset();
  return out;
}

void Membership::reported_unreachable(int reporter, std::uint64_t g, const std::vector<int>& ranks,
                                      Clock::time_point now) {
  auto slots = slots_reported(reporter, g, ranks);
  if (!slots || partition_decided_) return;
  for (const auto& report : unreachable_) {
    if (report.first == reporter) return; // its first report stands
  }
  if (unreachable_.empty()) first_report_ = now;
  unreachable_.emplace_back(reporter, std::move(*slots));
}

namespace {

// The largest set of `n` nodes with no edge inside (adjacency as bit masks); of sets equally large,
// the one holding the lowest node that differs. Exact up to 16 nodes; beyond, the node with the
// most edges (the highest of equals) leaves until no edge is left.
std::uint64_t largest_reaching_set(const std::vector<std::uint64_t>& adjacent) {
  const int n = static_cast<int>(adjacent.size());
  const auto independent = [&](std::uint64_t set) {
    for (int i = 0; i < n; ++i) {
      if ((set >> i & 1) && (adjacent[static_cast<std::size_t>(i)] & set)) return false;
    }
    return true;
  };
  const auto better = [](std::uint64_t a, std::uint64_t b) {
    const int ca = __builtin_popcountll(a), cb = __builtin_popcountll(b);
    if (ca != cb) return ca > cb;
    const std::uint64_t differ = a ^ b;
    return differ != 0 && (a & differ & (~differ + 1)) != 0;
  };
  if (n <= 16) {
    std::uint64_t best = 0;
    for (std::uint64_t set = 1; set < (std::uint64_t{1} << n); ++set) {
      if (better(set, best) && independent(set)) best = set;
    }
    return best;
  }
  std::uint64_t set = n >= 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << n) - 1;
  while (!independent(set)) {
    int worst = -1, most = -1;
    for (int i = 0; i < n; ++i) {
      if (!(set >> i & 1)) continue;
      const int edges = __builtin_popcountll(adjacent[static_cast<std::size_t>(i)] & set);
      if (edges >= most) most = edges, worst = i;
    }
    set &= ~(std::uint64_t{1} << worst);
  }
  return set;
}

} // namespace

std::vector<int> Membership::partitioned(Clock::time_point now, Clock::duration window) {
  if (unreachable_.empty() || partition_decided_) return {};
  const auto members = slots_where([](const Slot& x) { return x.member; });
  if (unreachable_.size() < members.size() && now - first_report_ < window) return {};
  partition_decided_ = true;
  if (members.size() > 64) return {}; // masks of 64 bits: a group this large is not judged
  const auto index = [&](int s) {
    return static_cast<int>(std::find(members.begin(), members.end(), s) - members.begin());
  };
  std::vector<std::uint64_t> adjacent(members.size(), 0);
  bool any = false;
  for (const auto& [reporter, slots] : unreachable_) {
    const int a = index(reporter);
    for (int s : slots) {
      const int b = index(s);
      if (a == b || b >= static_cast<int>(members.size())) continue;
      adjacent[static_cast<std::size_t>(a)] |= std::uint64_t{1} << b;
      adjacent[static_cast<std::size_t>(b)] |= std::uint64_t{1} << a;
      any = true;
    }
  }
  if (!any) return {};
  const std::uint64_t keep = largest_reaching_set(adjacent);
  std::vector<int> out;
  for (std::size_t i = 0; i < members.size(); ++i) {
    if (!(keep >> i & 1)) out.push_back(members[i]);
  }
  return out;
}

void Membership::fail(int s, const std::string& what) {
  Slot& state = at(s);
  if (!state.failure.empty() || state.left) return;
  state.failure = name_(s) + " " + what;
}

std::vector<int> Membership::silent(Clock::time_point now, Clock::duration timeout) const {
  return slots_where([&](const Slot& x) {
    const bool watched =
        (x.heartbeating && !x.left && x.failure.empty()) || (x.member && !x.claimed);
    return watched && now - x.last_seen > timeout;
  });
}

void Membership::paused(Clock::duration gap, Clock::time_point now) {
  for (auto& x : slots_) x.last_seen = std::min(now, x.last_seen + gap);
}

int Membership::waiting() const {
  return static_cast<int>(slots_where([](const Slot& x) { return waits(x); }).size());
}

std::vector<std::pair<int, std::string>> Membership::failures() const {
  std::vector<std::pair<int, std::string>> out;
  for (int s : slots_where([](const Slot& x) { return !x.failure.empty(); })) {
    out.emplace_back(s, slot(s).failure);
  }
  return out;
}

std::vector<int> Membership::slots_where(const std::function<bool(const Slot&)>& pick) const {
  std::vector<int> out;
  for (std::size_t s = 0; s < slots_.size(); ++s) {
    if (pick(slots_[s])) out.push_back(static_cast<int>(s));
  }
  return out;
}

void Membership::form(Changes& changes, const std::vector<int>& slots, const std::string& why,
                      bool departure, bool afresh) {
  generation_ = formed_ ? generation_ + 1 : 0;
  formed_ = true;
  if (departure) intact_from_ = generation_;
  for (auto& state : slots_) state.member = false;
  for (int slot : slots) at(slot).member = true;
  unreachable_.clear();
  partition_decided_ = false;
  changes.formed.push_back({generation_, slots, why, departure, afresh});
}

// Generation 0, or the first after the whole group was lost: once every slot is claimed, a
// generation that starts the training afresh.
void Membership::form_afresh_when_all_claimed(Changes& changes) {
  const auto claimed = slots_where([](const Slot& x) { return x.claimed; });
  if (static_cast<int>(claimed.size()) < world_size()) return;
  const std::string all = "all " + std::to_string(world_size()) + " workers joined";
  form(changes, claimed,
       formed_ ? all + " again after the group was lost: the training starts afresh" : all,
       /*departure=*/false, /*afresh=*/true);
  lost_ = false;
}

} // namespace flotilla::collective::detail
