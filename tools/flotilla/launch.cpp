// `flotilla launch --workers N -- CMD...`: starts N copies of CMD on this machine as one
// cluster on 127.0.0.1, each with its own TF_CONFIG (worker i of N; worker 0 is the chief),
// LOCAL_RANK/LOCAL_WORLD_SIZE and, unless already set, OMP_NUM_THREADS = cores ÷ N. Every output
// line is prefixed "[worker i]"; on a terminal, FLOTILLA_TERMINAL=1 lets the chief draw its bar.
// Ctrl-C/SIGTERM are forwarded (a second one kills). When a worker fails, the others are stopped
// (SIGTERM, then SIGKILL after a grace period) and launch exits with the failed worker's code
// (128 + signal for a worker killed by a signal; 128 + signal too when launch itself was
// signalled and the workers then exited cleanly). Unless FLOTILLA_CLUSTER_TOKEN(_FILE) is set,
// each run gets a random cluster token in its workers' environment, so no other local process
// can join the rendezvous.
//
// Recovery. With --max-restarts N, a failure (a nonzero exit or a signal) stops the others as
// above and then starts the whole cluster again (every worker, and the evaluator), on fresh free
// ports since the old ones may linger in TIME_WAIT, up to N times; a command with
// `flotilla train --backup-dir` resumes from its last backup. Preemption: a worker that exits
// with 75 (kExitPreempted: SIGTERM reached one worker, and every worker saved a backup at the
// same step) restarts the cluster without using up --max-restarts (at most 100 times in a row).
// A signal to launch itself never restarts anything: it is forwarded, and when the workers then
// exit with 75 (they saved), launch exits with 75 too, so that an outer scheduler restarts it.
//
// Elastic (--elastic, for programs that join through collective::ElasticGroup): launch hosts
// the rendezvous itself (FLOTILLA_RENDEZVOUS in every worker's environment), so it outlives any
// worker. A failed worker is started again alone, with its own TF_CONFIG, while restarts remain
// (--max-restarts counts these); the others never stop, and admit it when it is back. Below
// --min-workers, with nothing to restart, the rest are stopped with SIGTERM; when they all
// leave with 75 (with a backup, the chief saved it), launch exits 75 too. The job succeeded
// when the group finished training (a worker exited 0): a worker lost on the way is reported
// in launch's lines, not in its exit code.
//
// --log-dir DIR (torchrun's --log-dir with --tee): each task's output, stdout and stderr as they
// come, is also appended to DIR/worker-<i>.log (DIR/evaluator.log), one file per task across
// every restart, each start and exit marked in it. Files are appended to, never truncated, and a
// name that is a link is refused.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <iostream>
#include <map>
#include <optional>

#include "flotilla/base/hashes.h"
#include "flotilla/base/system.h"
#include "flotilla/cluster/cluster_spec.h"
#include "flotilla/cluster/cluster_token.h"
#include "flotilla/cluster/environment.h"
#include "flotilla/collective/elastic.h"
#include "flotilla/error.h"
#include "tools/flotilla/commands.h"
#include "tools/flotilla/flags.h"

extern char** environ;

namespace flotilla::tools {
namespace {

using Clock = std::chrono::steady_clock;

// Preemption restarts are free, but a job preempted this many times in a row is not making
// progress through restarts alone (or something keeps sending SIGTERM): stop and say so.
constexpr int kMaxPreemptionRestarts = 100;

struct LaunchArgs {
  int workers = 2;
  int port = 0; // 0: free ports chosen by the kernel
  double grace_s = 10;
  bool evaluator = false; // also start TF_CONFIG's evaluator task (a sidecar, not in training)
  int max_restarts = 0;   // cluster restarts after failures (preemptions do not count)
  // Elastic: launch hosts the rendezvous and restarts only a failed worker (up to
  // max_restarts restarts in all) while the others go on; below min_workers it stops them.
  bool elastic = false;
  int min_workers = 1;
  double heartbeat_timeout_s = 10;
  std::string log_dir;
  std::vector<std::string> command;
};

// A file descriptor that closes itself.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    reset();
    fd_ = std::exchange(other.fd_, -1);
    return *this;
  }
  ~Fd() { reset(); }
  int get() const { return fd_; }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

std::pair<Fd, Fd> make_pipe() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    throw Error(std::string("cannot create a pipe: ") + std::strerror(errno));
  }
  return {Fd(fds[0]), Fd(fds[1])};
}

// The write end of SignalPipe's pipe: writing to it is the only safe thing a handler can do.
int g_signal_pipe = -1;
extern "C" void on_signal(int sig) {
  const int saved = errno;
  const unsigned char byte = static_cast<unsigned char>(sig);
  [[maybe_unused]] auto n = ::write(g_signal_pipe, &byte, 1);
  errno = saved;
}

// Ports the kernel says are free on 127.0.0.1; all held until all are chosen, so none repeats.
std::vector<int> free_ports(int count) {
  std::vector<Fd> sockets;
  std::vector<int> ports;
  for (int i = 0; i < count; ++i) {
    Fd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof addr;
    if (s.get() < 0 || ::bind(s.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
        ::getsockname(s.get(), reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      throw Error(std::string("cannot find a free port on 127.0.0.1: ") + std::strerror(errno) +
                  "; pass --port");
    }
    ports.push_back(ntohs(addr.sin_port));
    sockets.push_back(std::move(s));
  }
  return ports;
}

std::string self_executable() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) throw Error("cannot find this program's path (/proc/self/exe)");
  return std::string(buf, static_cast<std::size_t>(n));
}

struct Child {
  int index = 0;
  std::string name;                   // "worker 2", "evaluator"
  std::vector<std::string> argv, env; // to start it again (elastic)
  pid_t pid = -1;
  bool running = false;
  int exit_code = 0;
  Fd out, err; // read ends of the child's stdout and stderr
  std::string out_buffer, err_buffer;
  int log = -1; // --log-dir: its file (owned by run(), kept across restarts)
};

// "2026-12-04 07:12:03 UTC", for the marks in --log-dir's files.
std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%d %H:%M:%S UTC", std::gmtime(&t));
  return text;
}

// --log-dir: one file per task, appended to (created if absent, never through a link).
std::vector<Fd> open_logs(const std::string& dir, int workers, bool evaluator) {
  std::vector<Fd> logs;
  if (dir.empty()) return logs;
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (!std::filesystem::is_directory(dir)) {
    throw ConfigError("--log-dir " + dir + " is not a directory and cannot be made one" +
                      (error ? " (" + error.message() + ")" : std::string()) +
                      "; give a directory this user may write to");
  }
  for (int i = 0; i < workers + (evaluator ? 1 : 0); ++i) {
    const std::string path =
        dir + "/" + (i < workers ? "worker-" + std::to_string(i) : std::string("evaluator")) +
        ".log";
    const int fd =
        ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0) {
      throw ConfigError("--log-dir: cannot open " + path + " to append to it (" +
                        std::strerror(errno) + (errno == ELOOP ? ": it is a link" : "") +
                        "); give a directory this user may write to");
    }
    logs.emplace_back(fd);
  }
  return logs;
}

void write_all(int fd, const std::string& text) {
  const char* p = text.data();
  std::size_t left = text.size();
  while (left > 0) {
    const ssize_t n = ::write(fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return; // our own output is gone; nothing sensible to do
    p += n;
    left -= static_cast<std::size_t>(n);
  }
}

// Emits the complete lines in `buffer` with the worker's prefix; `flush` emits the rest too.
// A carriage return ends a segment as a newline does, so a worker's progress bar, redrawn in
// place with '\r', stays in place here too.
void emit_lines(const std::string& name, std::string& buffer, int fd, bool flush) {
  const std::string prefix = "[" + name + "] ";
  // flotilla's own log lines already say "[worker i/N]"; don't say it twice.
  auto tagged = [&](const std::string& text) {
    return text.rfind("[worker ", 0) == 0 || text.rfind("[evaluator", 0) == 0 ? text
                                                                              : prefix + text;
  };
  std::string out;
  std::size_t start = 0;
  for (std::size_t end; (end = buffer.find_first_of("\r\n", start)) != std::string::npos;) {
    const std::string segment = buffer.substr(start, end - start);
    if (buffer[end] == '\r' && end + 1 == buffer.size() && !flush) break; // "\r\n" split?
    if (buffer[end] == '\r' && buffer[end + 1] == '\n') {                 // a DOS newline
      out += tagged(segment) + "\n";
      start = end + 2;
      continue;
    }
    if (buffer[end] == '\n' || !segment.empty()) out += tagged(segment) + buffer[end];
    start = end + 1; // an empty segment before '\r' is the start of a redraw
  }
  buffer.erase(0, start);
  if (flush && !buffer.empty()) {
    out += tagged(buffer) + "\n";
    buffer.clear();
  }
  if (!out.empty()) write_all(fd, out);
}

// 32 random bytes in hex: a run's cluster token when the user set none.
std::string random_token() {
  unsigned char bytes[32];
  Fd urandom(::open("/dev/urandom", O_RDONLY | O_CLOEXEC));
  if (urandom.get() < 0 || ::read(urandom.get(), bytes, sizeof bytes) != sizeof bytes) {
    throw Error("cannot read /dev/urandom for the cluster token; set FLOTILLA_CLUSTER_TOKEN");
  }
  return base::to_hex(bytes, sizeof bytes);
}

std::vector<std::string> child_environment(int index, int workers, const std::string& tf_config,
                                           int threads, bool terminal, const std::string& token,
                                           const std::string& rendezvous = "") {
  std::map<std::string, std::string> vars;
  for (char** e = environ; *e; ++e) {
    const std::string entry = *e;
    const auto eq = entry.find('=');
    if (eq != std::string::npos) vars[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  // Any local user can reach a port on 127.0.0.1: unless the user brought a token, the run gets
  // its own, so only the processes launch started can join (it travels in the environment,
  // which only their owner can read, never in argv).
  const auto set = [&](const char* name) { return vars.count(name) && !vars[name].empty(); };
  if (!set("FLOTILLA_CLUSTER_TOKEN") && !set("FLOTILLA_CLUSTER_TOKEN_FILE")) {
    vars["FLOTILLA_CLUSTER_TOKEN"] = token;
    vars["FLOTILLA_CLUSTER_TOKEN_RUN_ONLY"] = "1"; // not a key for backups: the next run's differs
  } else {
    vars.erase("FLOTILLA_CLUSTER_TOKEN_RUN_ONLY");
  }
  // TF_CONFIG decides the cluster; stale torchrun variables would only confuse a reader.
  for (const char* stale : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) vars.erase(stale);
  vars["TF_CONFIG"] = tf_config;
  if (rendezvous.empty()) {
    vars.erase("FLOTILLA_RENDEZVOUS");
  } else {
    vars["FLOTILLA_RENDEZVOUS"] = rendezvous;
  }
  vars["LOCAL_RANK"] = std::to_string(index);
  vars["LOCAL_WORLD_SIZE"] = std::to_string(workers);
  if (terminal) {
    vars["FLOTILLA_TERMINAL"] = "1";
  } else {
    vars.erase("FLOTILLA_TERMINAL");
  }
  // OpenMP sizes its pool when the library loads, before main(): only the environment can
  // size it. Workers on one machine share its cores instead of each taking all of them.
  if (!vars.count("OMP_NUM_THREADS")) vars["OMP_NUM_THREADS"] = std::to_string(threads);
  if (!vars.count("MKL_NUM_THREADS")) vars["MKL_NUM_THREADS"] = vars["OMP_NUM_THREADS"];
  std::vector<std::string> out;
  for (const auto& [k, v] : vars) out.push_back(k + "=" + v);
  return out;
}

// Signals reach the poll loop through a pipe. Installs the handlers for its lifetime and puts
// the previous ones back, whichever way run() leaves.
class SignalPipe {
 public:
  static constexpr int kForwarded[] = {SIGINT, SIGTERM, SIGHUP};

  SignalPipe() {
    auto [read_end, write_end] = make_pipe();
    read_ = std::move(read_end);
    write_ = std::move(write_end);
    ::fcntl(write_.get(), F_SETFL, O_NONBLOCK);
    g_signal_pipe = write_.get();
    struct sigaction action {};
    action.sa_handler = on_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGCHLD}) ::sigaction(sig, &action, &saved_[sig]);
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    ::sigaction(SIGPIPE, &ignore, &saved_[SIGPIPE]); // a closed stdout must not kill us
  }
  ~SignalPipe() {
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGPIPE})
      ::sigaction(sig, &saved_[sig], nullptr);
    g_signal_pipe = -1;
  }
  int fd() const { return read_.get(); }
  // A signal (not SIGCHLD) that arrived while nothing was supervising, or 0; never blocks.
  int pending() {
    int first = 0;
    unsigned char sigs[64];
    for (;;) {
      pollfd p{read_.get(), POLLIN, 0};
      if (::poll(&p, 1, 0) <= 0) return first;
      const ssize_t n = ::read(read_.get(), sigs, sizeof sigs);
      if (n <= 0) return first;
      for (ssize_t i = 0; i < n; ++i) {
        if (sigs[i] != SIGCHLD && first == 0) first = sigs[i];
      }
    }
  }

 private:
  Fd read_, write_;
  struct sigaction saved_[NSIG] {};
};

// fork + exec rather than posix_spawn, for what only the child can do before exec: its own
// process group (signals come from us, not the terminal), death with the launcher (no orphaned
// workers if the launcher is killed), and stdin from /dev/null (a worker in a background group
// that read the terminal would stop, and its peers would wait for it). Returns the child's pid;
// throws for a failed fork or exec.
pid_t spawn(const std::vector<std::string>& args, const std::vector<std::string>& env, int out_fd,
            int err_fd) {
  std::vector<char*> argv, envp;
  for (const auto& s : args) argv.push_back(const_cast<char*>(s.c_str()));
  argv.push_back(nullptr);
  for (const auto& s : env) envp.push_back(const_cast<char*>(s.c_str()));
  envp.push_back(nullptr);
  auto [status_read, status_write] = make_pipe(); // CLOEXEC: closes on a successful exec
  const pid_t parent = ::getpid();
  // No handler of ours may run in the child between fork and exec.
  sigset_t all, previous;
  sigfillset(&all);
  ::sigprocmask(SIG_SETMASK, &all, &previous);
  const pid_t child = ::fork();
  if (child == 0) {
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) ::_exit(127); // the launcher died before we got here
    for (int sig = 1; sig < NSIG; ++sig) ::signal(sig, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    const int null_fd = ::open("/dev/null", O_RDONLY);
    if (null_fd >= 0) ::dup2(null_fd, STDIN_FILENO);
    ::dup2(out_fd, STDOUT_FILENO);
    ::dup2(err_fd, STDERR_FILENO);
    ::execvpe(argv[0], argv.data(), envp.data());
    const int error = errno;
    [[maybe_unused]] auto n = ::write(status_write.get(), &error, sizeof error);
    ::_exit(127);
  }
  const int fork_error = errno;
  ::sigprocmask(SIG_SETMASK, &previous, nullptr);
  if (child < 0) {
    throw Error(std::string("cannot fork a worker process: ") + std::strerror(fork_error) +
                "; the machine is out of processes or memory");
  }
  status_write.reset();
  int error = 0;
  if (::read(status_read.get(), &error, sizeof error) == sizeof error) {
    ::waitpid(child, nullptr, 0);
    throw ConfigError("cannot start \"" + args[0] + "\": " + std::strerror(error) +
                      "; check the command after --");
  }
  return child;
}

std::string describe_exit(int status) {
  return WIFEXITED(status) ? "exited with code " + std::to_string(WEXITSTATUS(status))
                           : std::string("was killed by signal ") + ::strsignal(WTERMSIG(status));
}

// How one run of the cluster ended, and whether to start it again.
struct Outcome {
  int exit_code = kExitOk;
  bool restart = false;
  bool preempted = false; // the restart is a preemption's (free)
};

// Restarts so far, across the runs of one launch.
struct RestartCount {
  int failures = 0;
  int preemptions = 0;
};

// The running workers of one run of the cluster; whatever happens to run(), none outlives
// this object.
class Launcher {
 public:
  Launcher(const LaunchArgs& args, SignalPipe& signals, RestartCount count,
           const std::vector<Fd>& logs)
      : args_(args), children_(args.workers + (args.evaluator ? 1 : 0)), signals_(signals),
        count_(count) {
    for (std::size_t i = 0; i < logs.size() && i < children_.size(); ++i) {
      children_[i].log = logs[i].get();
    }
  }
  ~Launcher() {
    stop_all(SIGKILL);
    for (auto& c : children_) {
      if (c.running) ::waitpid(c.pid, nullptr, 0);
    }
  }

  void start(int index, const std::vector<std::string>& argv, const std::vector<std::string>& env) {
    Child& child = children_[static_cast<std::size_t>(index)];
    child.index = index;
    child.name = index < args_.workers ? "worker " + std::to_string(index) : "evaluator";
    child.argv = argv;
    child.env = env;
    if (child.out.get() >= 0 || child.err.get() >= 0) drain(child); // a restart's predecessor
    auto [out_read, out_write] = make_pipe();
    auto [err_read, err_write] = make_pipe();
    child.pid = spawn(argv, env, out_write.get(), err_write.get());
    child.running = true;
    if (child.log >= 0) {
      write_all(child.log, "=== flotilla launch: " + child.name + " started (pid " +
                               std::to_string(child.pid) + ") at " + utc_now() + " ===\n");
    }
    child.out = std::move(out_read);
    child.err = std::move(err_read);
  }

  // Relays output, forwards signals and stops everyone at the first failure; returns the exit
  // code launch should end with, or that the cluster is to be started again.
  Outcome supervise();

 private:
  void stop_all(int sig) {
    for (auto& c : children_) {
      if (c.running) ::kill(-c.pid, sig); // its whole process group
    }
  }
  void stop_later() {
    kill_at_ =
        Clock::now() + std::chrono::milliseconds(static_cast<std::int64_t>(args_.grace_s * 1000));
  }
  void reap();
  void reap_elastic();
  // What an ended child left in its pipes, relayed before the pipes are replaced.
  void drain(Child& child) {
    for (bool is_out : {true, false}) {
      Fd& fd = is_out ? child.out : child.err;
      while (fd.get() >= 0) {
        pollfd p{fd.get(), POLLIN, 0};
        if (::poll(&p, 1, 100) <= 0) break;
        relay(child, is_out, fd.get());
      }
      emit_lines(child.name, is_out ? child.out_buffer : child.err_buffer,
                 is_out ? STDOUT_FILENO : STDERR_FILENO, true);
    }
  }
  void on_signals(int fd);
  void relay(Child& child, bool is_out, int fd);
  // Sends what a deadline (term_at_, kill_at_) has come for; how long poll may wait.
  std::int64_t act_on_deadlines(bool any_running);
  // After the last worker: the exit code, and whether to start the cluster again.
  Outcome outcome() const;
  // Its output is drained after its exit is seen: the line may precede its last output.
  static void log_exit(const Child& c) {
    if (c.log < 0) return;
    write_all(c.log, "=== flotilla launch: " + c.name + " (pid " + std::to_string(c.pid) +
                         ") exited with code " + std::to_string(c.exit_code) + " at " + utc_now() +
                         " ===\n");
  }

  const LaunchArgs& args_;
  std::vector<Child> children_;
  SignalPipe& signals_;
  RestartCount count_;
  bool restart_ = false;        // decided at the failure, announced in its line
  bool group_finished_ = false; // elastic: a worker exited 0, so the training is done
  bool preempted_ = false;
  std::optional<int> failed_;          // index of the worker whose failure stopped the others
  std::vector<int> stopped_below_min_; // elastic: the workers stopped for --min-workers
  std::optional<int> forwarded_;       // the first signal we passed on
  bool killed_ = false;                // a second signal: no more grace
  std::optional<Clock::time_point> kill_at_;
  std::optional<Clock::time_point> term_at_; // a victim failed first: when to stop the rest
  static constexpr std::chrono::seconds kCulpritWindow{2};
};

// Elastic: the others go on without a failed worker (the rendezvous, hosted here, drops it),
// and it is started again, alone, while restarts remain; it rejoins from a live peer.
void Launcher::reap_elastic() {
  // Every exit first, then the decisions: a worker that finished finished the group's training
  // (the members end together), so a worker failing at the same time or after (one stopped
  // until the others were done, then told it was expelled) is not replaced, whatever its place
  // in the list: its restart would find no member to admit it.
  std::vector<std::pair<Child*, int>> ended;
  for (auto& c : children_) {
    if (!c.running) continue;
    int status = 0;
    if (::waitpid(c.pid, &status, WNOHANG) != c.pid) continue;
    c.running = false;
    c.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    log_exit(c);
    if (c.exit_code == 0 && c.index < args_.workers) group_finished_ = true;
    ended.emplace_back(&c, status);
  }
  for (auto& [child, status] : ended) {
    Child& c = *child;
    // Once stopped below --min-workers, the rest's exits are how they took it (supervise's end).
    if (c.exit_code == 0 || forwarded_ || c.index >= args_.workers || !stopped_below_min_.empty()) {
      continue;
    }
    std::string line = "[launch] " + c.name + " " + describe_exit(status);
    if (group_finished_) {
      write_all(STDERR_FILENO, line + "; not restarting it: the group has finished its "
                                      "training (a worker exited 0)\n");
      continue;
    }
    // Bad input fails again however often it starts; a worker that saved for a preemption is
    // asked to stop, not to be replaced.
    const bool again = c.exit_code != kExitBadInput && c.exit_code != kExitPreempted;
    if (again && count_.failures < args_.max_restarts) {
      ++count_.failures;
      write_all(STDERR_FILENO, line + "; restarting it alone (restart " +
                                   std::to_string(count_.failures) + " of " +
                                   std::to_string(args_.max_restarts) +
                                   "); the others go on and admit it when it is back\n");
      start(c.index, c.argv, c.env);
      continue;
    }
    line += !again ? "; not restarting it"
            : args_.max_restarts == 0
                ? "; not restarting it (--max-restarts 0)"
                : "; no restarts left (--max-restarts " + std::to_string(args_.max_restarts) + ")";
    if (!failed_) failed_ = c.index;
    const int running =
        static_cast<int>(std::count_if(children_.begin(), children_.begin() + args_.workers,
                                       [](const Child& w) { return w.running; }));
    if (running > 0 && running < args_.min_workers) {
      line += "; " + std::to_string(running) + " workers left, fewer than --min-workers " +
              std::to_string(args_.min_workers) + ": stopping them (SIGTERM)";
      for (const auto& w : children_) {
        if (w.running && w.index < args_.workers) stopped_below_min_.push_back(w.index);
      }
      stop_all(SIGTERM);
      stop_later();
    } else if (running > 0) {
      line += "; the other " + std::to_string(running) + " go on without it";
    }
    write_all(STDERR_FILENO, line + "\n");
  }
}

void Launcher::reap() {
  if (args_.elastic) return reap_elastic();
  // Several workers can end in one pass (a victim and its culprit); the culprit is the one
  // whose code is not the collective failure it caused in the others.
  std::optional<int> culprit;
  int culprit_status = 0;
  for (auto& c : children_) {
    if (!c.running) continue;
    int status = 0;
    if (::waitpid(c.pid, &status, WNOHANG) != c.pid) continue;
    c.running = false;
    c.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    log_exit(c);
    if (c.exit_code == 0 || forwarded_) continue;
    if (failed_) {
      // The first to end was a victim (its collective failed: exit 3) and the worker whose own
      // failure caused it (bad input, an unexpected error, a crash) ends right after: the job's
      // exit code is the cause's, not the race's winner's. Not the evaluator's, and not what
      // our own stop may cause (a SIGTERM or SIGKILL, a backup failing on a broken group: 4).
      const bool crashed =
          WIFSIGNALED(status) && WTERMSIG(status) != SIGTERM && WTERMSIG(status) != SIGKILL;
      const bool own = c.exit_code == kExitFailure || c.exit_code == kExitBadInput || crashed;
      if (c.index < args_.workers &&
          children_[static_cast<std::size_t>(*failed_)].exit_code == kExitComm && own) {
        failed_ = c.index;
        write_all(STDERR_FILENO, "[launch] " + c.name + " " + describe_exit(status) +
                                     ": the failure behind the others'\n");
      }
      continue;
    }
    if (!culprit || (children_[*culprit].exit_code == kExitComm && c.exit_code != kExitComm)) {
      culprit = c.index;
      culprit_status = status;
    }
  }
  if (!culprit) return;
  failed_ = culprit;
  const Child& failed = children_[static_cast<std::size_t>(*culprit)];
  std::string line = "[launch] " + failed.name + " " + describe_exit(culprit_status);
  if (failed.exit_code == kExitPreempted && failed.index < args_.workers) {
    preempted_ = true;
    restart_ = count_.preemptions < kMaxPreemptionRestarts;
    line += " (preempted: every worker saved a backup at the same step)";
    line += restart_ ? "; restarting the cluster (preemption restart " +
                           std::to_string(count_.preemptions + 1) +
                           "; preemptions do not count against --max-restarts)"
                     : "; not restarting: " + std::to_string(kMaxPreemptionRestarts) +
                           " preemption restarts already. Find what keeps sending SIGTERM, "
                           "then run the same command again to resume";
    write_all(STDERR_FILENO, line + "\n");
    // The workers agreed to stop and are exiting by themselves: a SIGTERM now could cut short
    // one still finishing its part of the backup. Only the evaluator, outside that agreement,
    // is told; the grace period bounds the rest.
    for (auto& c : children_) {
      if (c.running && c.index >= args_.workers) ::kill(-c.pid, SIGTERM);
    }
    stop_later();
    return;
  }
  line += "; stopping the other workers";
  restart_ = count_.failures < args_.max_restarts;
  if (restart_) {
    line += "; restarting the cluster (restart " + std::to_string(count_.failures + 1) + " of " +
            std::to_string(args_.max_restarts) + ")";
  } else if (args_.max_restarts > 0) {
    line += "; no restarts left (--max-restarts " + std::to_string(args_.max_restarts) + ")";
  }
  write_all(STDERR_FILENO, line + "\n");
  if (failed.exit_code == kExitComm) {
    // A victim (a collective failed under it): the worker that caused it usually ends by itself
    // a moment later, with its own error line and exit code, which are the job's. Stopping
    // everyone at once would cut that short.
    term_at_ = Clock::now() + kCulpritWindow;
    return;
  }
  stop_all(SIGTERM);
  stop_later();
}

void Launcher::on_signals(int fd) {
  unsigned char sigs[64];
  const ssize_t n = ::read(fd, sigs, sizeof sigs);
  for (ssize_t i = 0; i < n; ++i) {
    if (sigs[i] == SIGCHLD) continue; // reaped at the top of the loop
    if (!forwarded_) {
      // First Ctrl-C/SIGTERM: pass it on and give the workers the grace period to stop.
      forwarded_ = sigs[i];
      term_at_.reset();
      stop_all(sigs[i]);
      stop_later();
    } else if (!killed_) {
      killed_ = true; // a second one: stop now
      stop_all(SIGKILL);
    }
  }
}

void Launcher::relay(Child& child, bool is_out, int fd) {
  char buf[65536];
  const ssize_t n = ::read(fd, buf, sizeof buf);
  std::string& buffer = is_out ? child.out_buffer : child.err_buffer;
  const int target = is_out ? STDOUT_FILENO : STDERR_FILENO;
  if (n > 0) {
    if (child.log >= 0) write_all(child.log, std::string(buf, static_cast<std::size_t>(n)));
    buffer.append(buf, static_cast<std::size_t>(n));
    emit_lines(child.name, buffer, target, false);
  } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
    emit_lines(child.name, buffer, target, true);
    (is_out ? child.out : child.err).reset();
  }
}

std::int64_t Launcher::act_on_deadlines(bool any_running) {
  std::int64_t wait_ms = any_running ? 1000 : 200;
  if (!any_running) return wait_ms;
  const auto due = [&](std::optional<Clock::time_point>& at, auto act) {
    if (!at) return;
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(*at - Clock::now()).count();
    if (left <= 0) {
      at.reset();
      act();
    } else {
      wait_ms = std::min<std::int64_t>(wait_ms, left);
    }
  };
  due(term_at_, [&] {
    stop_all(SIGTERM);
    stop_later();
  });
  due(kill_at_, [&] { stop_all(SIGKILL); });
  return wait_ms;
}

Outcome Launcher::supervise() {
  for (;;) {
    reap();
    const bool any_running =
        std::any_of(children_.begin(), children_.end(), [](const Child& c) { return c.running; });
    std::vector<pollfd> fds{{signals_.fd(), POLLIN, 0}};
    std::vector<std::pair<Child*, bool>> owners{{nullptr, false}};
    for (auto& c : children_) {
      if (c.out.get() >= 0) fds.push_back({c.out.get(), POLLIN, 0}), owners.push_back({&c, true});
      if (c.err.get() >= 0) fds.push_back({c.err.get(), POLLIN, 0}), owners.push_back({&c, false});
    }
    // Done when every worker is gone and its output drained. A grandchild that keeps a pipe
    // open cannot hold us: once the workers are gone, reads get a short deadline.
    if (!any_running && fds.size() == 1) break;
    const std::int64_t wait_ms = act_on_deadlines(any_running);
    const int ready = ::poll(fds.data(), fds.size(), static_cast<int>(wait_ms));
    if (ready < 0 && errno != EINTR) throw Error(std::string("poll: ") + std::strerror(errno));
    if (ready == 0 && !any_running) { // workers gone, pipes quiet: stop waiting for them
      for (auto& c : children_) {
        emit_lines(c.name, c.out_buffer, STDOUT_FILENO, true);
        emit_lines(c.name, c.err_buffer, STDERR_FILENO, true);
        c.out.reset();
        c.err.reset();
      }
      continue;
    }
    for (std::size_t k = 0; k < fds.size() && ready > 0; ++k) {
      if (!(fds[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      if (k == 0) {
        on_signals(fds[k].fd);
      } else {
        relay(*owners[k].first, owners[k].second, fds[k].fd);
      }
    }
  }
  return outcome();
}

Outcome Launcher::outcome() const {
  if (args_.elastic && !forwarded_) {
    // The group finished training when any worker finished it (the members end together); a
    // worker lost on the way, or restarted too late to rejoin, is in launch's lines above.
    for (const auto& c : children_) {
      if (c.index < args_.workers && c.exit_code == 0) return {kExitOk};
    }
  }
  if (!stopped_below_min_.empty() && !forwarded_) {
    // Stopped below --min-workers: when they all left with 75 (the chief saved the backup
    // first), the job is to be started again from it, as after a preemption.
    const bool saved =
        std::all_of(stopped_below_min_.begin(), stopped_below_min_.end(), [&](int i) {
          return children_[static_cast<std::size_t>(i)].exit_code == kExitPreempted;
        });
    if (saved) {
      write_all(STDERR_FILENO, "[launch] the workers stopped below --min-workers saved and left "
                               "(exit 75): start the job again to resume from its backup\n");
      return {kExitPreempted};
    }
  }
  if (failed_) {
    // A signal to launch itself during the failure's grace period cancels the restart.
    const bool restart = restart_ && !forwarded_;
    if (restart_ && forwarded_) {
      write_all(STDERR_FILENO, "[launch] signalled while stopping the workers; not restarting\n");
    }
    return {children_[static_cast<std::size_t>(*failed_)].exit_code, restart,
            preempted_ && restart};
  }
  if (forwarded_) {
    // Workers that saved a backup for the forwarded SIGTERM (and any that finished) make a
    // job to be started again, not a failure; the evaluator, killed by it, has no say.
    bool saved = false, clean = true;
    for (const auto& c : children_) {
      if (c.index >= args_.workers) continue;
      saved = saved || c.exit_code == kExitPreempted;
      clean = clean && (c.exit_code == kExitPreempted || c.exit_code == 0);
    }
    if (saved && clean) return {kExitPreempted};
  }
  for (const auto& c : children_) {
    if (c.exit_code != 0) return {c.exit_code}; // how the workers ended after a forwarded signal
  }
  // Stopped by a signal, even if every worker then exited cleanly: not a success to a scheduler.
  return {forwarded_ ? 128 + *forwarded_ : kExitOk};
}

// Elastic: the rendezvous lives in launch, outside the workers, so it outlives any of them (and
// the workers die with launch anyway). It asks for the token the workers are given.
std::unique_ptr<collective::RendezvousService> elastic_rendezvous(const LaunchArgs& a,
                                                                  const std::string& token) {
  collective::RendezvousService::Options options;
  options.listen = {"127.0.0.1", 0};
  options.workers = a.workers;
  options.heartbeat_timeout = seconds_flag(a.heartbeat_timeout_s, "--heartbeat-timeout");
  options.cluster_token = cluster::cluster_token(cluster::Environment::from_process());
  if (!options.cluster_token) options.cluster_token = token;
  return std::make_unique<collective::RendezvousService>(options);
}

int run(const LaunchArgs& a) {
  if (a.command.empty()) {
    throw ConfigError("no command to launch; write it after --, e.g. flotilla launch --workers 2 "
                      "-- flotilla train");
  }
  if (a.elastic && a.min_workers > a.workers) {
    throw ConfigError("--min-workers " + std::to_string(a.min_workers) +
                      " is more than --workers " + std::to_string(a.workers));
  }
  seconds_flag(a.grace_s, "--grace"); // checked before anything starts
  seconds_flag(a.heartbeat_timeout_s, "--heartbeat-timeout");
  if (a.port > 0 && a.port + a.workers - 1 > 65535) {
    throw ConfigError("--port " + std::to_string(a.port) + " leaves no room for " +
                      std::to_string(a.workers) + " consecutive ports; use a port up to " +
                      std::to_string(65536 - a.workers));
  }
  const int tasks = a.workers + (a.evaluator ? 1 : 0);
  const int threads = std::max(1, base::available_cores() / a.workers);
  const bool terminal = ::isatty(STDOUT_FILENO) != 0;

  // `flotilla launch -- flotilla train` means this very program, on PATH or not.
  std::vector<std::string> argv = a.command;
  if (argv[0] == "flotilla") argv[0] = self_executable();

  // One for all runs: a signal between two runs is still seen, and never meets the default
  // disposition (which would end launch without stopping anyone).
  SignalPipe signals;
  RestartCount count;
  const std::vector<Fd> logs = open_logs(a.log_dir, a.workers, a.evaluator);
  for (;;) {
    // Fresh ports for every run: the last run's may still be in TIME_WAIT. --port is the
    // user's choice, kept.
    std::vector<int> ports = a.port > 0 ? std::vector<int>() : free_ports(tasks);
    for (int i = 0; a.port > 0 && i < tasks; ++i) ports.push_back(a.port + i);
    cluster::ClusterSpec spec;
    for (int i = 0; i < a.workers; ++i) spec.worker.push_back({"127.0.0.1", ports[i]});
    if (a.evaluator) spec.evaluator.push_back({"127.0.0.1", ports.back()});

    const std::string token = random_token();
    const auto service = a.elastic ? elastic_rendezvous(a, token) : nullptr;
    const std::string rendezvous = service ? service->address() : "";
    Outcome outcome;
    {
      Launcher launcher(a, signals, count, logs);
      for (int i = 0; i < a.workers; ++i) {
        spec.task = {cluster::TaskType::kWorker, i};
        launcher.start(i, argv,
                       child_environment(i, a.workers, cluster::to_tf_config(spec), threads,
                                         terminal, token, rendezvous));
      }
      if (a.evaluator) {
        // TF's sidecar: it trains nothing, so it shares the machine with the workers' threads.
        spec.task = {cluster::TaskType::kEvaluator, 0};
        launcher.start(
            a.workers, argv,
            child_environment(a.workers, a.workers, cluster::to_tf_config(spec), 1, false, token));
      }
      outcome = launcher.supervise();
    }
    if (!outcome.restart) return outcome.exit_code;
    if (const int sig = signals.pending()) {
      write_all(STDERR_FILENO, std::string("[launch] received signal ") + ::strsignal(sig) +
                                   " between runs; not restarting\n");
      return outcome.preempted ? kExitPreempted : 128 + sig;
    }
    ++(outcome.preempted ? count.preemptions : count.failures);
  }
}

} // namespace

Command add_launch(CLI::App& parent) {
  auto args = std::make_shared<LaunchArgs>();
  CLI::App* app = parent.add_subcommand(
      "launch", "Start N workers of a command on this machine (127.0.0.1), each with TF_CONFIG");
  app->add_option("--workers", args->workers, "Number of worker processes")
      ->check(number_in(1, 256))
      ->capture_default_str();
  app->add_option("--port", args->port,
                  "First port; worker i listens on port+i (0: free ports chosen by the kernel)")
      ->check(number_in(0, 65535))
      ->capture_default_str();
  app->add_option("--grace", args->grace_s,
                  "Seconds stopped workers get between SIGTERM and SIGKILL")
      ->check(number_in(0.0, 3600.0))
      ->capture_default_str();
  app->add_option("--max-restarts", args->max_restarts,
                  "Restart the whole cluster (fresh ports) up to N times after a worker fails; "
                  "with flotilla train --backup-dir the workers resume from the last backup. A "
                  "preempted worker (exit 75: it saved) restarts it without counting")
      ->check(number_in(0, 1000000))
      ->capture_default_str();
  app->add_flag("--elastic", args->elastic,
                "Host the rendezvous here (FLOTILLA_RENDEZVOUS) for an elastic group: a failed "
                "worker is restarted alone (--max-restarts counts these) while the others go on "
                "and admit it when it is back");
  app->add_option("--min-workers", args->min_workers,
                  "With --elastic: when fewer workers than this are left and none can be "
                  "restarted, stop the rest (SIGTERM: with --backup-dir they save and exit 75, "
                  "and so does launch)")
      ->check(number_in(1, 256))
      ->capture_default_str();
  app->add_option("--heartbeat-timeout", args->heartbeat_timeout_s,
                  "With --elastic: seconds of silence after which the rendezvous drops a worker")
      ->check(number_in(0.1, 3600.0))
      ->capture_default_str();
  app->add_flag("--evaluator", args->evaluator,
                "Also start an evaluator task (TF_CONFIG type \"evaluator\"): it evaluates each "
                "new checkpoint the chief writes (flotilla train --checkpoint-dir)");
  app->add_option("--log-dir", args->log_dir,
                  "Also append each task's output to DIR/worker-<i>.log (and evaluator.log), "
                  "across restarts");
  app->add_option("command", args->command, "The command each worker runs, after --")->required();
  app->footer("Example: flotilla launch --workers 2 -- flotilla train --model cnn --epochs 1");
  return {app, [args] { return run(*args); }};
}

} // namespace flotilla::tools
