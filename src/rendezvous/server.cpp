#include "flotilla/rendezvous/server.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <thread>
#include <vector>

#include "rendezvous/kv_store.h"
#include "rendezvous/membership.h"
#include "rendezvous/sockets.h"
#include "rendezvous/wire.h"
#include "flotilla/error.h"
#include "flotilla/log.h"

namespace flotilla::collective::detail {

namespace {
using Clock = std::chrono::steady_clock;
constexpr std::size_t kMaxOutBytes = 64u << 20; // a client that stops reading is dropped
// Log lines of one kind (refusals, drops): at most kLogBurst per kLogWindow, the rest counted and
// summed up once the window is over, so a flood of strangers cannot flood the log.
constexpr int kLogBurst = 5;
constexpr auto kLogWindow = std::chrono::seconds(10);
// The loop wakes every 100 ms: a longer gap between two turns means the process was stopped.
constexpr auto kStall = std::chrono::seconds(1);
// The deadlines (tick()) are looked at no more often than this: each look passes over every
// connection and slot, and a turn of the loop can be one heartbeat of a thousand.
constexpr auto kTickEvery = std::chrono::milliseconds(10);
// epoll's tags for the two descriptors that are not connections (a connection's is its id).
constexpr std::uint64_t kWakeTag = ~std::uint64_t{0};
constexpr std::uint64_t kListenTag = kWakeTag - 1;
} // namespace

const std::string kGenerationKey = "flotilla/elastic/generation/";
const std::string kLatestKey = "flotilla/elastic/latest";
const std::string kFinishedKey = "flotilla/elastic/finished";

// Nothing a client sends can block the loop: a slow or silent client only holds its own
// connection, until its deadline.
struct RendezvousServer::Impl {
  struct Conn {
    int id = -1;
    int fd = -1;
    bool watched = false, watching_out = false; // registered with epoll; for EPOLLOUT too
    bool pending = false; // listed in Impl::pending
    std::string peer;
    std::string in, out;
    bool joined = false;
    bool close_after_flush = false;
    Clock::time_point join_deadline;
    Nonce nonce{};
    int rank = -1;
    std::uint8_t role = kRoleStore;
  };
  // A slot's connections (a process's heartbeat and its first store connection; Gloo may open
  // more): closing either means the process is gone.
  struct SlotConns {
    int heartbeat = -1;
    int store = -1;
  };

  explicit Impl(const RendezvousConfig& c)
      : config(c), log(c.external ? Logger() : Logger(c.rank, c.world_size)),
        members(c.world_size, c.elastic, [this](int slot) { return config.name(slot); }),
        slot_conns(static_cast<std::size_t>(c.world_size)) {}

  RendezvousConfig config;
  Logger log;
  int listen_fd = -1;
  int port = 0;
  int wake_read = -1, wake_write = -1;
  std::thread thread;
  std::atomic<bool> stopping{false};
  std::map<int, Conn> conns; // by id; ids are never reused, so the first is the oldest
  int next_id = 0;
  // The loop waits in epoll, which costs per ready connection (poll() over all of them cost a
  // pass over a thousand members' two connections for every heartbeat, 13% of a core at idle).
  int epoll_fd = -1;
  // Connections served this turn, or with output queued or a close decided: each is flushed
  // (and its interest in EPOLLOUT updated) at the end of the turn. Listed once (Conn::pending);
  // kept between turns, so a turn allocates nothing for it.
  std::vector<int> pending;
  struct LogLimit {
    Clock::time_point window_start{};
    int lines = 0;
    int suppressed = 0;
  };
  std::map<std::string, LogLimit> log_limits; // by kind
  KvStore kv{[this](const KvStore::Waiter& w, const std::vector<const Bytes*>& values) {
    answer_waiter(w, values);
  }};
  Membership members;
  std::vector<SlotConns> slot_conns;
  Clock::time_point last_tick = Clock::now();

  ~Impl() {
    for (auto& [id, c] : conns) ::close(c.fd);
    for (int fd : {listen_fd, wake_read, wake_write, epoll_fd}) {
      if (fd >= 0) ::close(fd);
    }
  }

  void bind_and_listen() {
    AddrInfo info;
    resolve(config.chief, info);
    std::string last_error = "no address";
    for (addrinfo* a = info.list; a; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      int one = 1;
      ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
      // The system's largest backlog, not 128: every worker opens two connections at once when
      // a job starts, and a full backlog turns a thousand workers' connects into retries.
      if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, SOMAXCONN) == 0) {
        sockaddr_storage bound{};
        socklen_t len = sizeof bound;
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
        port = bound.ss_family == AF_INET
                   ? ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port)
                   : ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port);
        listen_fd = fd;
        set_nonblocking(fd);
        return;
      }
      last_error = std::strerror(errno);
      const int error = errno;
      ::close(fd);
      if (error == EADDRNOTAVAIL) {
        last_error += " (the chief's TF_CONFIG address is not an address of this host)";
      }
    }
    throw CommError("the chief could not host the rendezvous at " + config.chief.to_string() +
                    ": " + last_error +
                    "; give the chief a free port on one of this host's addresses in TF_CONFIG");
  }

  void mark_pending(Conn& c) {
    if (c.pending) return;
    c.pending = true;
    pending.push_back(c.id);
  }

  void queue(Conn& c, const std::string& frame) {
    c.out += frame;
    mark_pending(c);
    if (c.out.size() > kMaxOutBytes) {
      warn_limited("dropped connections", "rendezvous: dropped the connection from " + c.peer +
                                              ": it does not read its answers");
      c.close_after_flush = true;
      c.out.clear();
    }
  }

  // Closes `c` once what is queued for it is sent.
  void close_after_flush(Conn& c) {
    c.close_after_flush = true;
    mark_pending(c);
  }

  // Registers `c` with epoll for input, and for output while some waits to be sent; false
  // when epoll refuses (the connection would never be served: the caller drops it).
  bool watch(Conn& c) {
    const bool out = !c.out.empty();
    if (c.watched && out == c.watching_out) return true;
    epoll_event e{};
    e.events = EPOLLIN | (out ? EPOLLOUT : 0u);
    e.data.u64 = static_cast<std::uint64_t>(c.id);
    if (::epoll_ctl(epoll_fd, c.watched ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, c.fd, &e) != 0) {
      warn_limited("dropped connections", "rendezvous: dropped the connection from " + c.peer +
                                              ": epoll refused it (" + std::strerror(errno) +
                                              ")");
      return false;
    }
    c.watched = true;
    c.watching_out = out;
    return true;
  }

  // A warning of `kind` ("refused joins"), within that kind's limit.
  void warn_limited(const std::string& kind, const std::string& line) {
    LogLimit& l = log_limits[kind];
    const auto now = Clock::now();
    if (now - l.window_start >= kLogWindow) {
      sum_up(kind, l);
      l.window_start = now;
      l.lines = 0;
    }
    if (l.lines++ < kLogBurst) {
      log.warn(line);
    } else {
      ++l.suppressed;
    }
  }
  void sum_up(const std::string& kind, LogLimit& l) {
    if (l.suppressed == 0) return;
    log.warn("rendezvous: " + std::to_string(l.suppressed) + " more " + kind + " within " +
             std::to_string(kLogWindow.count()) + " s, not logged one by one");
    l.suppressed = 0;
  }

  void refuse(Conn& c, const std::string& reason, bool retry = false) {
    warn_limited("refused joins",
                 "rendezvous: refused " + c.peer + (retry ? " for now: " : ": ") + reason);
    queue(c, Welcome::refusal(reason, retry).frame());
    close_after_flush(c);
  }

  void reply_status(Conn& c, Status s, const std::string& error = "") {
    WireWriter w;
    w.u8(s);
    if (s == kFailed) w.str(error.substr(0, kMaxReasonBytes));
    queue(c, w.frame());
  }

  // A GET's one value; a multiGet's count and values (kMaxValueBytes in all at most: more would
  // not fit the client's frame); a WAIT's kOk alone.
  void answer_waiter(const KvStore::Waiter& waiter, const std::vector<const Bytes*>& values) {
    auto it = conns.find(waiter.owner);
    if (it == conns.end()) return;
    if (!waiter.wants_values()) return reply_status(it->second, kOk);
    WireWriter w;
    w.u8(kOk);
    if (waiter.answer == KvStore::Waiter::Answer::kValues) {
      std::size_t total = 0;
      for (const Bytes* v : values) total += v->size();
      if (total > kMaxValueBytes) {
        return reply_status(it->second, kFailed,
                            "a multiGet of " + std::to_string(values.size()) + " keys holds " +
                                std::to_string(total) + " bytes, over the limit of " +
                                std::to_string(kMaxValueBytes) + " for one answer");
      }
      w.u32(static_cast<std::uint32_t>(values.size()));
    }
    for (const Bytes* v : values) w.bytes(*v);
    queue(it->second, w.frame());
  }

  void send_pong(Conn& c, bool closing, bool expelled = false) {
    Pong pong;
    pong.closing = closing;
    if (config.elastic) {
      pong.generation = members.generation();
      pong.intact_from = members.intact_from();
      pong.expelled = expelled;
      pong.waiting = members.waiting();
      if (members.last_departure().first >= 0) pong.failed.push_back(members.last_departure());
    } else {
      pong.failed = members.failures();
    }
    queue(c, pong.frame());
  }

  // What a membership transition changed: told to the operator; each generation formed is
  // recorded in the store. A departure also fails every wait for an older generation's keys
  // (its Gloo rendezvous can never complete) and erases the keys of the generations before the
  // previous one.
  void apply(const Membership::Changes& changes) {
    for (const auto& line : changes.info) log.info("rendezvous: " + line);
    for (const auto& g : changes.formed) record(g);
    for (const auto& line : changes.warnings) log.warn("rendezvous: " + line);
  }

  void record(const Membership::Generation& g) {
    const std::string number = std::to_string(g.number);
    log.info("rendezvous: generation " + number + " has " + std::to_string(g.slots.size()) +
             " of " + std::to_string(config.world_size) + " workers [" + g.slot_list() +
             "]: " + g.why);
    try {
      kv.set(kGenerationKey + number, bytes_of(g.record()));
      kv.set(kLatestKey, bytes_of(number));
    } catch (const KvStoreError& e) {
      log.error("rendezvous: could not record generation " + number + " (" + e.what() + ")");
    }
    if (g.departure) {
      std::vector<std::string> stale;
      for (std::uint64_t old = 0; old < g.number; ++old) {
        stale.push_back("flotilla/g" + std::to_string(old) + "/");
      }
      for (const auto& waiter : kv.cancel(stale)) {
        if (auto conn = conns.find(waiter.owner); conn != conns.end()) {
          reply_status(conn->second, kFailed, "generation " + number + " replaced it: " + g.why);
        }
      }
    }
    if (g.number >= 2) kv.erase_prefix("flotilla/g" + std::to_string(g.number - 2) + "/");
  }

  static Bytes bytes_of(const std::string& s) { return Bytes(s.begin(), s.end()); }

  // N for a key under "flotilla/g<N>/" (a generation's backends), nullopt otherwise.
  std::optional<std::uint64_t> generation_of(const std::string& key) const {
    if (!config.elastic || key.rfind("flotilla/g", 0) != 0) return std::nullopt;
    std::uint64_t g = 0;
    std::size_t i = 10;
    for (; i < key.size() && i < 30 && std::isdigit(static_cast<unsigned char>(key[i])); ++i) {
      g = g * 10 + static_cast<std::uint64_t>(key[i] - '0');
    }
    if (i == 10 || i >= key.size() || key[i] != '/') return std::nullopt;
    return g;
  }

  // Elastic: slot `r`'s process is gone (or expelled): its connections are closed, and the
  // membership frees the slot (see Membership::release).
  void release(int r, const std::string& what, bool expel) {
    // The membership first: an expelled process's last answer quotes why (last_departure).
    const auto changes = members.release(r, what, finished());
    for (auto& [id, c] : conns) {
      if (!c.joined || c.rank != r || c.close_after_flush) continue;
      if (c.role == kRoleHeartbeat && expel) send_pong(c, false, /*expelled=*/true);
      close_after_flush(c);
    }
    slot_conns[static_cast<std::size_t>(r)] = SlotConns{};
    apply(changes);
  }

  bool finished() const { return kv.contains({kFinishedKey}); }

  void handle_join(int id, Conn& c, const std::string& body) {
    const auto join = JoinRequest::parse(body);
    if (!join) {
      refuse(c, "it does not speak flotilla's rendezvous protocol (version 2)");
      return;
    }
    if (const std::string why = why_invalid(c, *join); !why.empty()) {
      refuse(c, why);
      return;
    }
    const int rank = join->rank;
    const bool heartbeat = join->role == kRoleHeartbeat;
    if (const std::string why = members.why_refused(rank, join->session, heartbeat); !why.empty()) {
      // Elastic: a slot held by another process frees once that one is gone or expelled.
      refuse(c, why, config.elastic && !heartbeat);
      return;
    }
    c.joined = true;
    c.rank = rank;
    c.role = join->role;
    std::optional<Mac> proof;
    if (config.token) proof = chief_mac(*config.token, c.nonce, join->client_nonce, rank);
    queue(c, Welcome::acceptance(proof).frame());
    auto& own = slot_conns[static_cast<std::size_t>(rank)];
    if (join->role == kRoleStore) {
      if (!members.slot(rank).claimed) own.store = id;
      if (join->flags & kJoinMember) {
        apply(members.resume(rank, join->session, c.peer, join->generation, join->members,
                             Clock::now()));
      }
      claim(c, *join);
    } else {
      members.start_heartbeat(rank, Clock::now());
      own.heartbeat = id;
    }
  }

  // Why a join is refused whatever the slots' state ("" when it is not). The token first: a
  // process without it learns nothing about the cluster.
  std::string why_invalid(const Conn& c, const JoinRequest& join) const {
    const int rank = join.rank;
    const int world = join.world;
    if (config.token && !equal_secret(join.mac, join_mac(*config.token, c.nonce, join))) {
      return "wrong or missing cluster token (claiming rank " + std::to_string(rank) +
             "); every task needs the same FLOTILLA_CLUSTER_TOKEN";
    }
    if (((join.flags & kJoinElastic) != 0) != config.elastic) {
      return config.elastic
                 ? "this rendezvous runs an elastic group and the task is not elastic; run every "
                   "task in elastic mode (ElasticOptions::enabled, --elastic), or start the "
                   "rendezvous with --fixed"
                 : "the task is elastic and this rendezvous is not; an elastic group needs its "
                   "rendezvous outside the workers (flotilla rendezvous, or flotilla launch "
                   "--elastic)";
    }
    if (world != config.world_size) {
      return "it expects " + std::to_string(world) + " training tasks, the chief " +
             std::to_string(config.world_size) +
             "; every task must be given the same cluster (TF_CONFIG)";
    }
    if (rank < 0 || rank >= world || (join.role != kRoleStore && join.role != kRoleHeartbeat)) {
      return "it claims rank " + std::to_string(rank) + " of " + std::to_string(world) +
             " with role " + std::to_string(join.role) + ", which does not exist";
    }
    if ((join.flags & kJoinMember) &&
        !std::binary_search(join.members.begin(), join.members.end(), rank)) {
      return "it claims rank " + std::to_string(rank) + " as a member of generation " +
             std::to_string(join.generation) + ", which does not list it";
    }
    return "";
  }

  // A store connection claims its rank's slot (again, for the same process).
  void claim(const Conn& c, const JoinRequest& join) {
    apply(members.claim(join.rank, join.session, c.peer));
    try {
      kv.set("flotilla/joined/" + std::to_string(join.rank), Bytes{'1'});
    } catch (const KvStoreError& e) {
      log.warn("rendezvous: could not record that " + config.name(join.rank) + " joined (" +
               e.what() + "); the others will wait for it until their timeout");
    }
  }

  std::vector<std::string> read_keys(WireReader& in) {
    const std::uint32_t n = in.u32();
    if (n > kMaxKeysPerRequest) {
      throw WireError(std::to_string(n) + " keys in one request, over the limit of " +
                      std::to_string(kMaxKeysPerRequest));
    }
    std::vector<std::string> keys;
    for (std::uint32_t i = 0; i < n; ++i) keys.push_back(in.str(kMaxKeyBytes));
    return keys;
  }

  // Decodes one request, lets the store decide it and queues the answer (a waiting GET or WAIT:
  // when the store wakes it, or at its deadline).
  void handle_store(int id, Conn& c, WireReader& in) {
    const std::uint8_t op = in.u8();
    try {
      if (op == kGet || op == kWait || op == kMultiGet) return handle_wait(id, c, in, op);
      WireWriter w;
      w.u8(kOk);
      answer(op, in, w, c.rank);
      queue(c, w.frame());
    } catch (const KvStoreError& e) {
      reply_status(c, kFailed, e.what());
    }
  }

  // The store's answer to a request that needs no waiting, after its kOk.
  void answer(std::uint8_t op, WireReader& in, WireWriter& w, int slot) {
    switch (op) {
    case kSet: {
      const std::string key = in.str(kMaxKeyBytes);
      Bytes value = in.bytes(kMaxValueBytes);
      read_report(slot, key, value);
      kv.set(key, std::move(value));
      return;
    }
    case kAdd: {
      const std::string key = in.str(kMaxKeyBytes);
      w.i64(kv.add(key, in.i64()));
      return;
    }
    case kCompareSet: {
      const std::string key = in.str(kMaxKeyBytes);
      Bytes expected = in.bytes(kMaxValueBytes);
      Bytes desired = in.bytes(kMaxValueBytes);
      w.bytes(kv.compare_set(key, std::move(expected), std::move(desired)));
      return;
    }
    case kCheck: w.u8(kv.contains(read_keys(in)) ? 1 : 0); return;
    case kDelete: w.u8(kv.erase(in.str(kMaxKeyBytes)) ? 1 : 0); return;
    case kAdvance: {
      const auto from = static_cast<std::uint64_t>(in.i64());
      if (!config.elastic) throw WireError("advance asked of a rendezvous that is not elastic");
      Membership::Changes changes;
      const auto generation = static_cast<std::int64_t>(members.advance(from, changes));
      apply(changes);
      w.i64(generation);
      return;
    }
    case kNumKeys: w.i64(static_cast<std::int64_t>(kv.num_keys())); return;
    default: throw WireError("unknown store operation " + std::to_string(op));
    }
  }

  // Elastic: a member's report, under its generation's prefix, of ranks that never reached the
  // collective it timed out in (kSilentPrefix: they hang outside the collectives while their
  // heartbeat runs, and are expelled like silent ones), or of those it could not reach after a
  // collective failed (kUnreachablePrefix: a partition, decided once all have reported).
  void read_report(int reporter, const std::string& key, const Bytes& value) {
    const auto g = generation_of(key);
    if (!g) return;
    const std::string what = key.substr(key.find('/', 10) + 1);
    const bool silent = what.rfind(kSilentPrefix, 0) == 0;
    if (!silent && what.rfind(kUnreachablePrefix, 0) != 0) return;
    const auto report = SilentReport::parse(std::string(value.begin(), value.end()));
    if (!report) return;
    if (!silent) {
      members.reported_unreachable(reporter, *g, report->ranks, Clock::now());
      expel_partitioned(Clock::now());
      return;
    }
    // Expelled once a ping it sent after this report says it has not started that collective
    // (handle_heartbeat): a member that came late is not a hung one.
    members.reported_silent(reporter, *g, report->sequence, report->ranks, report->description);
  }

  // The smaller side of a partition between the members, once decided (Membership::partitioned;
  // every member reported, or the heartbeat timeout passed since the first report).
  void expel_partitioned(Clock::time_point now) {
    const auto losers = members.partitioned(now, config.heartbeat_timeout);
    if (losers.empty()) return;
    std::vector<int> kept;
    for (int s = 0; s < members.world_size(); ++s) {
      if (members.slot(s).member && std::find(losers.begin(), losers.end(), s) == losers.end()) {
        kept.push_back(s);
      }
    }
    std::string names;
    for (std::size_t i = 0; i < kept.size(); ++i) {
      names += (i == 0 ? "" : i + 1 == kept.size() ? " and " : ", ") + config.name(kept[i]);
    }
    const std::string why = "could not be reached by the other members after a collective failed, "
                            "though all reach the rendezvous (a partition between the workers); " +
                            names + " go on";
    for (int s : losers) release(s, why, /*expel=*/true);
  }

  // A GET (one key), WAIT or multiGet (several): answered when the store wakes it, or at its
  // deadline.
  void handle_wait(int id, Conn& c, WireReader& in, std::uint8_t op) {
    KvStore::Waiter waiter;
    waiter.owner = id;
    using Answer = KvStore::Waiter::Answer;
    waiter.answer = op == kWait ? Answer::kPresence : op == kGet ? Answer::kValue : Answer::kValues;
    if (op == kGet) {
      waiter.keys.push_back(in.str(kMaxKeyBytes));
    } else {
      waiter.keys = read_keys(in);
    }
    waiter.deadline = Clock::now() + std::chrono::milliseconds(in.u32());
    for (const auto& key : waiter.keys) {
      // A wait for a generation that has lost a member since (it came late) can never end.
      const auto g = generation_of(key);
      if (g && *g < members.intact_from() && !kv.contains({key})) {
        reply_status(c, kFailed,
                     "generation " + std::to_string(*g) +
                         " lost a member: " + members.last_departure().second);
        return;
      }
    }
    kv.wait(std::move(waiter));
  }

  void handle_heartbeat(Conn& c, WireReader& in) {
    const std::uint8_t op = in.u8();
    if (op == kPing) {
      Membership::Progress progress;
      if (!in.done()) {
        progress.generation = static_cast<std::uint64_t>(in.i64());
        progress.reached = static_cast<std::uint64_t>(in.i64());
      }
      if (const auto held = members.heard_from(c.rank, Clock::now(), progress)) {
        release(c.rank,
                "made no progress: it never reached " + held->description + ", in which " +
                    config.name(held->reporter) +
                    " waited until its timeout (hung outside the collectives while its "
                    "heartbeat ran)",
                /*expel=*/true);
        return;
      }
      send_pong(c, false);
    } else if (op == kBye) {
      close_after_flush(c);
      if (config.elastic) {
        // A member that leaves takes its share with it: the others regroup as for a failure.
        if (members.slot(c.rank).claimed) release(c.rank, "left the group", /*expel=*/false);
        return;
      }
      members.leave(c.rank);
    } else {
      throw WireError("unknown heartbeat message " + std::to_string(op));
    }
  }

  void handle_frame(int id, Conn& c, const std::string& body) {
    if (!c.joined) {
      handle_join(id, c, body);
      return;
    }
    WireReader in(body);
    if (c.role == kRoleStore) {
      handle_store(id, c, in);
    } else {
      handle_heartbeat(c, in);
    }
  }

  // Consumes the complete messages in c.in; false: drop the connection.
  bool consume(int id, Conn& c) {
    while (c.in.size() >= 4 && !c.close_after_flush) {
      const std::uint32_t n = read_le32(c.in.data());
      const std::size_t limit =
          c.joined ? kMaxFrameBytes : JoinRequest::max_bytes(config.world_size);
      if (n > limit) {
        warn_limited("dropped connections",
                     "rendezvous: dropped the connection from " + c.peer + ": a message of " +
                         std::to_string(n) + " bytes, over the limit of " + std::to_string(limit));
        return false;
      }
      if (c.in.size() < 4 + n) break;
      const std::string body = c.in.substr(4, n);
      c.in.erase(0, 4 + n);
      try {
        handle_frame(id, c, body);
      } catch (const WireError& e) {
        warn_limited("dropped connections", "rendezvous: dropped the connection from " + c.peer +
                                                ": malformed message (" + e.what() + ")");
        return false;
      }
    }
    return true;
  }

  void drop(int id) {
    auto it = conns.find(id);
    if (it == conns.end()) return;
    Conn& c = it->second;
    const SlotConns own = c.joined ? slot_conns[static_cast<std::size_t>(c.rank)] : SlotConns{};
    if (config.elastic && c.joined && !c.close_after_flush && !stopping) {
      // Either connection of a process closing without a goodbye: it is gone.
      if (members.slot(c.rank).claimed && (own.store == id || own.heartbeat == id)) {
        release(c.rank, "lost its connection to the rendezvous (the process exited or was killed)",
                /*expel=*/false);
      }
    } else if (!config.elastic && c.joined && c.role == kRoleHeartbeat && own.heartbeat == id &&
               !stopping) {
      members.fail(c.rank, "lost its connection to the chief (the process exited or was killed)");
    }
    kv.forget(id);
    ::close(c.fd); // which takes it out of epoll (its id may stay in `pending`: skipped there)
    conns.erase(it);
  }

  void accept_all() {
    for (;;) {
      sockaddr_storage addr{};
      socklen_t len = sizeof addr;
      const int fd = ::accept4(listen_fd, reinterpret_cast<sockaddr*>(&addr), &len,
                               SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;
      // Each rank holds two connections; the rest of the room is for handshakes in flight. Once
      // it is full, the oldest connection that has not joined makes room (a real handshake takes
      // a round trip; a stranger's idle connections must not keep real workers out).
      if (conns.size() >= static_cast<std::size_t>(2 * config.world_size + 64) &&
          !drop_oldest_unjoined()) {
        warn_limited("refused connections", "rendezvous: refused a connection from " +
                                                peer_name(addr) +
                                                ": every connection held has joined");
        ::close(fd);
        continue;
      }
      set_nodelay(fd);
      Conn c;
      c.id = next_id;
      c.fd = fd;
      c.peer = peer_name(addr);
      c.join_deadline = Clock::now() + config.join_timeout;
      c.nonce = random_bytes<32>();
      c.out = Hello{config.token.has_value(), c.nonce}.frame();
      mark_pending(conns.emplace(next_id++, std::move(c)).first->second);
    }
  }

  bool drop_oldest_unjoined() {
    for (auto& [id, c] : conns) {
      if (c.joined || c.close_after_flush) continue;
      warn_limited("dropped connections", "rendezvous: dropped the connection from " + c.peer +
                                              " to make room: it had not joined, and was the "
                                              "oldest such");
      drop(id);
      return true;
    }
    return false;
  }

  // The deadlines: waits that timed out, joins not completed in time, silent heartbeats; the
  // log's counts of what it did not say one by one.
  void tick() {
    const auto now = Clock::now();
    if (const auto gap = now - last_tick; gap > kStall) {
      // Stopped (SIGSTOP, a paused VM) or starved: nobody could be heard meanwhile.
      members.paused(gap, now);
      log.warn("rendezvous: this process did not run for " +
               ms_text(std::chrono::duration_cast<std::chrono::milliseconds>(gap)) +
               " (stopped or starved); no worker's silence counts that time");
    }
    last_tick = now;
    for (auto& [kind, limit] : log_limits) {
      if (now - limit.window_start >= kLogWindow) sum_up(kind, limit);
    }
    for (const auto& waiter : kv.expire(now)) {
      if (auto conn = conns.find(waiter.owner); conn != conns.end()) {
        reply_status(conn->second, kTimedOut);
      }
    }
    std::vector<int> late;
    for (auto& [id, c] : conns) {
      if (!c.joined && !c.close_after_flush && now > c.join_deadline) late.push_back(id);
    }
    for (int id : late) {
      warn_limited("dropped connections", "rendezvous: dropped the connection from " +
                                              conns[id].peer + ": no valid join within " +
                                              ms_text(config.join_timeout));
      drop(id);
    }
    const std::string silent = "stopped sending heartbeats for " +
                               ms_text(config.heartbeat_timeout) +
                               " (stopped, hung, or cut off from the network)";
    if (config.elastic) expel_partitioned(now);
    for (int r : members.silent(now, config.heartbeat_timeout)) {
      if (config.elastic && !members.slot(r).claimed) {
        release(r,
                "did not come back within " + ms_text(config.heartbeat_timeout) +
                    " after the rendezvous restarted",
                /*expel=*/true);
      } else if (config.elastic) {
        release(r, silent, /*expel=*/true);
      } else {
        members.fail(r, silent);
      }
    }
  }

  void flush(Conn& c, bool& dead) {
    while (!c.out.empty()) {
      const ssize_t n = ::send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
      if (n > 0) {
        c.out.erase(0, static_cast<std::size_t>(n));
        continue;
      }
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n < 0 && errno == EINTR) continue;
      dead = true;
      return;
    }
    if (c.close_after_flush) dead = true;
  }

  void loop() {
    epoll_fd = ::epoll_create1(EPOLL_CLOEXEC);
    for (const auto& [fd, tag] : {std::pair{wake_read, kWakeTag}, std::pair{listen_fd, kListenTag}}) {
      epoll_event e{};
      e.events = EPOLLIN;
      e.data.u64 = tag;
      if (epoll_fd < 0 || ::epoll_ctl(epoll_fd, EPOLL_CTL_ADD, fd, &e) != 0) {
        log.error(std::string("rendezvous: cannot wait for connections (epoll: ") +
                  std::strerror(errno) + ")");
        return;
      }
    }
    std::vector<epoll_event> events(256);
    Clock::time_point last_deadlines{};
    while (!stopping) {
      const int ready = ::epoll_wait(epoll_fd, events.data(), static_cast<int>(events.size()), 100);
      if (ready < 0 && errno != EINTR) {
        log.error(std::string("rendezvous: epoll_wait failed: ") + std::strerror(errno));
        return;
      }
      std::vector<int> dead_ids;
      for (int k = 0; k < ready; ++k) {
        const std::uint64_t tag = events[static_cast<std::size_t>(k)].data.u64;
        if (tag == kWakeTag) continue; // stopping
        if (tag == kListenTag) {
          accept_all();
          continue;
        }
        const int id = static_cast<int>(tag);
        auto it = conns.find(id);
        if (it == conns.end()) continue;
        Conn& c = it->second;
        bool dead = false;
        if (events[static_cast<std::size_t>(k)].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
          char buf[65536];
          const ssize_t n = ::recv(c.fd, buf, sizeof buf, 0);
          if (n > 0) {
            c.in.append(buf, static_cast<std::size_t>(n));
            dead = !consume(id, c);
          } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
            dead = true;
          }
        }
        if (dead) {
          dead_ids.push_back(id);
        } else {
          mark_pending(c);
        }
      }
      for (int id : dead_ids) drop(id);
      if (const auto now = Clock::now(); now - last_deadlines >= kTickEvery) {
        last_deadlines = now;
        tick();
      }
      // What this turn queued (answers to this connection, a SET waking another's GET, a wait
      // past its deadline) goes out now; what the socket does not take waits for EPOLLOUT.
      // Dropping one can list others (its slot's connections close): by index, as it grows.
      for (std::size_t k = 0; k < pending.size(); ++k) {
        const int id = pending[k];
        auto it = conns.find(id);
        if (it == conns.end()) continue;
        it->second.pending = false;
        bool dead = false;
        flush(it->second, dead);
        if (dead || !watch(it->second)) drop(id);
      }
      pending.clear();
    }
    // Leaving: tell the heartbeats it is a goodbye, not a failure (best effort). Each
    // connection is half-closed after the message and drained briefly before it is closed: a
    // socket closed with unread input sends a reset, which could destroy the goodbye in flight.
    for (auto& [id, c] : conns) {
      if (c.joined && c.role == kRoleHeartbeat) {
        send_pong(c, /*closing=*/true);
        bool dead = false;
        flush(c, dead);
      }
      ::shutdown(c.fd, SHUT_WR);
    }
    const auto until = Clock::now() + std::chrono::milliseconds(300);
    std::set<int> open;
    for (auto& [id, c] : conns) open.insert(id);
    while (!open.empty() && Clock::now() < until) {
      std::vector<pollfd> fds;
      std::vector<int> which;
      for (int id : open) {
        fds.push_back({conns[id].fd, POLLIN, 0});
        which.push_back(id);
      }
      if (::poll(fds.data(), fds.size(), 50) <= 0) continue;
      for (std::size_t k = 0; k < fds.size(); ++k) {
        if (!fds[k].revents) continue;
        char buf[4096];
        if (::recv(fds[k].fd, buf, sizeof buf, 0) <= 0) open.erase(which[k]);
      }
    }
  }
};

RendezvousServer::RendezvousServer(const RendezvousConfig& config)
    : impl_(std::make_unique<Impl>(config)) {
  impl_->bind_and_listen();
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) {
    throw Error(std::string("cannot create a pipe: ") + std::strerror(errno));
  }
  impl_->wake_read = fds[0];
  impl_->wake_write = fds[1];
  impl_->thread = std::thread([impl = impl_.get()] { impl->loop(); });
}

RendezvousServer::~RendezvousServer() {
  impl_->stopping = true;
  const char byte = 1;
  [[maybe_unused]] auto n = ::write(impl_->wake_write, &byte, 1);
  if (impl_->thread.joinable()) impl_->thread.join();
}

int RendezvousServer::port() const {
  return impl_->port;
}

} // namespace flotilla::collective::detail
