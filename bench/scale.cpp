// `make bench-scale`: the control plane at 64, 256 and 1024 members. A real `flotilla rendezvous`
// (its own process, an elastic group of N workers, a cluster token) serves N simulated members:
// threads of this process, and 1% of them (at least one) child processes, each speaking the real
// protocol through collective::detail::join_elastic (store connection, heartbeat, probe
// responder, generations, regroup). Only the data plane is stubbed: each generation's group is
// not connected, but the store traffic Gloo's TCP transport makes to connect one is replayed
// request by request (bench/scale_exchange.h; tests/multiworker/scale_exchange_test.cpp checks
// the replay against Gloo itself).
//
// Measures, printed as one JSON line:
//   join_s       from the members' start until every one has read generation 0's record;
//   formation_s  from the first member starting generation 0's exchange until the last is done;
//   exchange_*   the exchange's requests and bytes (keys and values) for generation 0, per
//                member and in all (counted in the threads: every member but the processes);
//   heal_s       from SIGKILL of the child processes until every survivor joined the generation
//                without them (each one's collective failure is the rendezvous's news of it,
//                as in Model::fit), with its exchange's requests and bytes, and the generations
//                formed on the way;
//   rendezvous_* the server's resident memory before any member came (LibTorch's libraries
//                are most of it) and its peak (VmHWM), its CPU seconds in each phase, and its
//                CPU share while N members only beat (idle_cpu_pct, over 5 s).
// Usage: bench_scale --members N [--exchange pairs|rank|batched] [--flotilla build/flotilla]
//                    [--heartbeat-timeout-s 10] [--timeout-s 900]
//   pairs: Gloo's default (a pair identifier per rank in every record, each key read alone);
//   rank: GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER=1; batched: that and GLOO_ENABLE_STORE_V2_API=1
//   (keys read 128 at a time). flotilla's own groups use `batched` (make_gloo_backend).
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "collective/group.h"
#include "flotilla/base/system.h"
#include "flotilla/collective/elastic.h"
#include "flotilla/error.h"
#include "scale_exchange.h"

extern char** environ;

using namespace flotilla;
using Clock = std::chrono::steady_clock;
using bench::GlooExchange;

namespace {

struct Args {
  int members = 64;
  GlooExchange exchange = GlooExchange::kBatched;
  std::string exchange_name = "batched";
  std::string flotilla = "build/flotilla";
  int heartbeat_timeout_s = 10;
  int timeout_s = 900;
  int port = 0;
  int member = -1; // a child process: this slot
};

const std::string kToken = "bench-scale-token-0123456789abcdef";

GlooExchange parse_exchange(const std::string& name) {
  if (name == "pairs") return GlooExchange::kPairIdentifiers;
  if (name == "rank") return GlooExchange::kRankAsSequence;
  if (name == "batched") return GlooExchange::kBatched;
  std::cerr << "bench_scale: --exchange is pairs, rank or batched; saw " << name << "\n";
  std::exit(2);
}

cluster::ClusterSpec spec_of(const Args& a, int slot) {
  cluster::ClusterSpec spec;
  for (int s = 0; s < a.members; ++s) spec.worker.push_back({"127.0.0.1", 20000 + s});
  spec.task = {cluster::TaskType::kWorker, slot};
  spec.world_size = a.members;
  spec.rank = slot;
  spec.rendezvous = {"127.0.0.1", a.port};
  spec.external_rendezvous = true;
  spec.local_host = "127.0.0.1";
  spec.source = "bench_scale";
  return spec;
}

collective::CommunicationOptions options_of(const Args& a) {
  collective::CommunicationOptions options;
  options.timeout = std::chrono::seconds(a.timeout_s);
  options.heartbeat_interval = std::chrono::seconds(1);
  options.heartbeat_timeout = std::chrono::seconds(a.heartbeat_timeout_s);
  options.cluster_token = kToken;
  options.shared_memory = false;
  return options;
}

// What each phase's exchanges asked and when they ran.
struct Phase {
  bench::StoreTally tally;
  std::mutex mutex;
  Clock::time_point first_start = Clock::time_point::max();
  Clock::time_point last_end = Clock::time_point::min();
  void started(Clock::time_point t) {
    std::lock_guard<std::mutex> lock(mutex);
    first_start = std::min(first_start, t);
  }
  void ended(Clock::time_point t) {
    std::lock_guard<std::mutex> lock(mutex);
    last_end = std::max(last_end, t);
  }
};

thread_local Phase* tl_phase = nullptr;
thread_local std::shared_ptr<collective::Health> tl_health;

// The stand-in for detail::make_group: the exchange Gloo would make, no connections.
collective::detail::GroupFactory stub_factory(GlooExchange exchange,
                                              std::chrono::milliseconds timeout) {
  return [exchange, timeout](int rank, int size, const collective::CommunicationOptions&,
                             c10::intrusive_ptr<c10d::Store> store, const std::string&,
                             std::vector<std::string>, std::shared_ptr<collective::Health> health) {
    tl_health = health;
    Phase* phase = tl_phase;
    if (phase) {
      phase->started(Clock::now());
      auto counted = c10::make_intrusive<bench::CountingStore>(store, phase->tally);
      bench::replay_gloo_exchange(counted, rank, size, exchange, timeout);
      phase->ended(Clock::now());
    } else {
      bench::replay_gloo_exchange(store, rank, size, exchange, timeout);
    }
    return collective::Communicator(std::shared_ptr<collective::Communicator::Impl>());
  };
}

// The rendezvous process's numbers from /proc.
struct ProcStats {
  double cpu_s = 0;
  std::uint64_t hwm_kb = 0, rss_kb = 0;
};

ProcStats proc_stats(pid_t pid) {
  ProcStats s;
  const std::string dir = "/proc/" + std::to_string(pid) + "/";
  std::ifstream stat(dir + "stat");
  std::string line;
  std::getline(stat, line);
  std::istringstream fields(line.substr(line.rfind(')') + 2));
  std::string field;
  unsigned long long utime = 0, stime = 0;
  for (int i = 3; fields >> field; ++i) {
    if (i == 14) utime = std::stoull(field);
    if (i == 15) {
      stime = std::stoull(field);
      break;
    }
  }
  s.cpu_s = static_cast<double>(utime + stime) / static_cast<double>(::sysconf(_SC_CLK_TCK));
  std::ifstream status(dir + "status");
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) s.hwm_kb = std::stoull(line.substr(6));
    if (line.rfind("VmRSS:", 0) == 0) s.rss_kb = std::stoull(line.substr(6));
  }
  return s;
}

// Whether something accepts connections at 127.0.0.1:port.
bool listening(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  ::close(fd);
  return ok;
}

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

pid_t spawn(const std::vector<std::string>& argv, bool quiet) {
  std::vector<char*> raw;
  for (const auto& s : argv) raw.push_back(const_cast<char*>(s.c_str()));
  raw.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (quiet) posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
  pid_t pid = 0;
  if (posix_spawn(&pid, raw[0], &actions, nullptr, raw.data(), environ) != 0) {
    std::cerr << "bench_scale: cannot start " << argv[0] << "\n";
    std::exit(1);
  }
  posix_spawn_file_actions_destroy(&actions);
  return pid;
}

// A child: one member, until it is killed.
int run_member(const Args& a) {
  auto group = collective::detail::join_elastic(
      spec_of(a, a.member), options_of(a),
      stub_factory(a.exchange, std::chrono::seconds(a.timeout_s)));
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

std::string fixed(double v, int digits) {
  char text[64];
  std::snprintf(text, sizeof text, "%.*f", digits, v);
  return text;
}

} // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--members") a.members = std::stoi(value);
    else if (flag == "--exchange") a.exchange = parse_exchange(a.exchange_name = value);
    else if (flag == "--flotilla") a.flotilla = value;
    else if (flag == "--heartbeat-timeout-s") a.heartbeat_timeout_s = std::stoi(value);
    else if (flag == "--timeout-s") a.timeout_s = std::stoi(value);
    else if (flag == "--port") a.port = std::stoi(value);
    else if (flag == "--member") a.member = std::stoi(value);
    else {
      std::cerr << "bench_scale: unknown flag " << flag << "\n";
      return 2;
    }
  }
  base::raise_open_file_limit();
  if (a.member >= 0) return run_member(a);
  if (a.members < 2) {
    std::cerr << "bench_scale: --members must be at least 2\n";
    return 2;
  }

  // The rendezvous, and the members to kill (processes), before any thread starts.
  a.port = free_port();
  ::setenv("FLOTILLA_CLUSTER_TOKEN", kToken.c_str(), 1);
  const pid_t server = spawn({a.flotilla, "rendezvous", "--listen",
                              "127.0.0.1:" + std::to_string(a.port), "--workers",
                              std::to_string(a.members), "--heartbeat-timeout",
                              std::to_string(a.heartbeat_timeout_s)},
                             /*quiet=*/true);
  for (int i = 0; !listening(a.port); ++i) {
    if (i == 300) {
      std::cerr << "bench_scale: the rendezvous did not listen within 30 s\n";
      ::kill(server, SIGKILL);
      return 1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const ProcStats empty = proc_stats(server);
  const int killed = std::max(1, a.members / 100);
  std::vector<pid_t> children;
  const auto start = Clock::now();
  for (int k = 0; k < killed; ++k) {
    // The highest slots: the chief (slot 0) stays, as in most failures.
    const int slot = a.members - 1 - k;
    children.push_back(spawn({"/proc/self/exe", "--member", std::to_string(slot), "--members",
                              std::to_string(a.members), "--exchange", a.exchange_name, "--port",
                              std::to_string(a.port), "--heartbeat-timeout-s",
                              std::to_string(a.heartbeat_timeout_s), "--timeout-s",
                              std::to_string(a.timeout_s)},
                             /*quiet=*/true));
  }

  Phase formation, heal;
  std::mutex mutex;
  std::condition_variable cv;
  int formed = 0, healed = 0, failed = 0;
  bool go_heal = false;
  std::vector<std::string> errors;
  std::atomic<std::uint64_t> final_generation{0};
  const int threads = a.members - killed;
  std::vector<std::thread> members;
  std::vector<std::unique_ptr<collective::ElasticGroup>> groups(threads);
  for (int slot = 0; slot < threads; ++slot) {
    members.emplace_back([&, slot] {
      try {
        tl_phase = &formation;
        auto group = collective::detail::join_elastic(
            spec_of(a, slot), options_of(a),
            stub_factory(a.exchange, std::chrono::seconds(a.timeout_s)));
        {
          std::unique_lock<std::mutex> lock(mutex);
          ++formed;
          cv.notify_all();
          cv.wait(lock, [&] { return go_heal; });
        }
        tl_phase = &heal;
        // As a training loop: its collective fails when the rendezvous says a member left, and
        // it regroups, until it is in the generation of every survivor.
        do {
          if (!collective::detail::wait_until_failed(*tl_health,
                                                     std::chrono::seconds(a.timeout_s))) {
            throw TimeoutError("no generation change within --timeout-s");
          }
          group->regroup();
        } while (static_cast<int>(group->members().size()) != threads);
        final_generation = group->generation();
        groups[slot] = std::move(group);
        std::lock_guard<std::mutex> lock(mutex);
        ++healed;
        cv.notify_all();
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mutex);
        ++failed;
        if (errors.size() < 5) errors.push_back("slot " + std::to_string(slot) + ": " + e.what());
        cv.notify_all();
      }
    });
  }
  const auto wait_for = [&](int& count, int target) {
    std::unique_lock<std::mutex> lock(mutex);
    cv.wait(lock, [&] { return count + failed >= target; });
    if (failed > 0) {
      for (const auto& e : errors) std::cerr << "bench_scale: " << e << "\n";
      ::kill(server, SIGKILL);
      for (pid_t c : children) ::kill(c, SIGKILL);
      std::_Exit(1);
    }
  };
  wait_for(formed, threads);
  const auto formed_at = Clock::now();
  const ProcStats after_formation = proc_stats(server);
  const auto formation_requests = formation.tally.requests.load();
  const auto formation_bytes = formation.tally.bytes.load();

  // N members beating and nothing else.
  std::this_thread::sleep_for(std::chrono::seconds(1));
  const ProcStats idle_from = proc_stats(server);
  std::this_thread::sleep_for(std::chrono::seconds(5));
  const ProcStats idle_to = proc_stats(server);

  {
    std::lock_guard<std::mutex> lock(mutex);
    go_heal = true;
  }
  cv.notify_all();
  const auto kill_at = Clock::now();
  for (pid_t c : children) ::kill(c, SIGKILL);
  wait_for(healed, threads);
  const auto healed_at = Clock::now();
  const ProcStats after_heal = proc_stats(server);

  const double join_s = base::seconds_between(start, formation.first_start);
  std::cout << "{\"bench\":\"scale\",\"members\":" << a.members << ",\"exchange\":\""
            << a.exchange_name << "\",\"processes\":" << killed << ",\"threads\":" << threads
            << ",\"join_s\":" << fixed(join_s, 3) << ",\"formation_s\":"
            << fixed(base::seconds_between(formation.first_start, formation.last_end), 3)
            << ",\"formed_s\":" << fixed(base::seconds_between(start, formed_at), 3)
            << ",\"exchange_requests_per_member\":" << formation_requests / threads
            << ",\"exchange_kb_per_member\":" << fixed(formation_bytes / 1e3 / threads, 1)
            << ",\"exchange_requests\":" << formation_requests
            << ",\"exchange_mb\":" << fixed(formation_bytes / 1e6, 1) << ",\"killed\":" << killed
            << ",\"heal_s\":" << fixed(base::seconds_between(kill_at, healed_at), 3)
            << ",\"heal_generation\":" << final_generation.load()
            << ",\"heal_exchange_requests\":" << heal.tally.requests.load()
            << ",\"heal_exchange_mb\":" << fixed(heal.tally.bytes.load() / 1e6, 1)
            << ",\"rendezvous_rss_mb_empty\":" << fixed(empty.rss_kb / 1024.0, 1)
            << ",\"rendezvous_hwm_mb\":" << fixed(after_heal.hwm_kb / 1024.0, 1)
            << ",\"rendezvous_cpu_s_formation\":" << fixed(after_formation.cpu_s - empty.cpu_s, 2)
            << ",\"rendezvous_cpu_s_heal\":" << fixed(after_heal.cpu_s - idle_to.cpu_s, 2)
            << ",\"idle_cpu_pct\":" << fixed(100.0 * (idle_to.cpu_s - idle_from.cpu_s) / 5.0, 1)
            << ",\"heartbeat_interval_s\":1,\"heartbeat_timeout_s\":" << a.heartbeat_timeout_s
            << "}" << std::endl;
  // Leaving 1000 groups one by one would make the rendezvous form a generation for each.
  ::kill(server, SIGKILL);
  ::waitpid(server, nullptr, 0);
  for (pid_t c : children) ::waitpid(c, nullptr, 0);
  std::_Exit(0);
}
