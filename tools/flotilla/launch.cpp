// `flotilla launch --workers N -- CMD...`: starts N copies of CMD on this machine as one
// cluster on 127.0.0.1, each with its own TF_CONFIG (worker i of N; worker 0 is the chief),
// LOCAL_RANK/LOCAL_WORLD_SIZE and, unless already set, OMP_NUM_THREADS = cores ÷ N. Every output
// line is prefixed "[worker i]"; on a terminal, FLOTILLA_TERMINAL=1 lets the chief draw its bar. Ctrl-C/SIGTERM are forwarded. When a worker fails, the others
// are stopped (SIGTERM, then SIGKILL after a grace period) and launch exits with the failed
// worker's code (128 + signal for a worker killed by a signal).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <iostream>
#include <map>
#include <optional>

#include "flotilla/cluster/cluster_spec.h"
#include "flotilla/error.h"
#include "tools/flotilla/commands.h"

extern char** environ;

namespace flotilla::tools {
namespace {

using Clock = std::chrono::steady_clock;

struct LaunchArgs {
  int workers = 2;
  int port = 0;  // 0: free ports chosen by the kernel
  double grace_s = 10;
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

// Signals reach the poll loop through this pipe (the only safe thing a handler can do).
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
  pid_t pid = -1;
  bool running = false;
  int exit_code = 0;
  Fd out, err;  // read ends of the child's stdout and stderr
  std::string out_buffer, err_buffer;
};

void write_all(int fd, const std::string& text) {
  const char* p = text.data();
  std::size_t left = text.size();
  while (left > 0) {
    const ssize_t n = ::write(fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // our own output is gone; nothing sensible to do
    p += n;
    left -= static_cast<std::size_t>(n);
  }
}

// Emits the complete lines in `buffer` with the worker's prefix; `flush` emits the rest too.
// A carriage return ends a segment as a newline does, so a worker's progress bar, redrawn in
// place with '\r', stays in place here too.
void emit_lines(int index, std::string& buffer, int fd, bool flush) {
  const std::string prefix = "[worker " + std::to_string(index) + "] ";
  // flotilla's own log lines already say "[worker i/N]"; don't say it twice.
  auto tagged = [&](const std::string& text) {
    return text.rfind("[worker ", 0) == 0 ? text : prefix + text;
  };
  std::string out;
  std::size_t start = 0;
  for (std::size_t end; (end = buffer.find_first_of("\r\n", start)) != std::string::npos;
       start = end + 1) {
    const std::string segment = buffer.substr(start, end - start);
    if (buffer[end] == '\r' && segment.empty()) continue;  // "\r" before a redraw
    out += tagged(segment) + buffer[end];
  }
  buffer.erase(0, start);
  if (flush && !buffer.empty()) {
    out += tagged(buffer) + "\n";
    buffer.clear();
  }
  if (!out.empty()) write_all(fd, out);
}

std::vector<std::string> child_environment(int index, int workers, const std::string& tf_config,
                                           int threads, bool terminal) {
  std::map<std::string, std::string> vars;
  for (char** e = environ; *e; ++e) {
    const std::string entry = *e;
    const auto eq = entry.find('=');
    if (eq != std::string::npos) vars[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  // TF_CONFIG decides the cluster; stale torchrun variables would only confuse a reader.
  for (const char* stale : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) vars.erase(stale);
  vars["TF_CONFIG"] = tf_config;
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

// fork + exec rather than posix_spawn, for what only the child can do before exec: its own
// process group (signals come from us, not the terminal) and death with the launcher (no
// orphaned workers if the launcher is killed). Returns 0 or the exec's errno.
int spawn(std::vector<char*>& argv, std::vector<char*>& envp, int out_fd, int err_fd,
          pid_t* pid) {
  auto [status_read, status_write] = make_pipe();  // CLOEXEC: closes on a successful exec
  const pid_t parent = ::getpid();
  const pid_t child = ::fork();
  if (child < 0) return errno;
  if (child == 0) {
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) ::_exit(127);  // the launcher died before we got here
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    for (int sig : {SIGINT, SIGTERM, SIGCHLD, SIGHUP, SIGPIPE}) ::signal(sig, SIG_DFL);
    ::dup2(out_fd, STDOUT_FILENO);
    ::dup2(err_fd, STDERR_FILENO);
    ::execvpe(argv[0], argv.data(), envp.data());
    const int error = errno;
    [[maybe_unused]] auto n = ::write(status_write.get(), &error, sizeof error);
    ::_exit(127);
  }
  status_write.reset();
  int error = 0;
  const ssize_t n = ::read(status_read.get(), &error, sizeof error);
  if (n == sizeof error) {  // exec failed: reap the child now
    ::waitpid(child, nullptr, 0);
    return error;
  }
  *pid = child;
  return 0;
}

int run(const LaunchArgs& a) {
  if (a.command.empty()) {
    throw ConfigError("no command to launch; write it after --, e.g. flotilla launch --workers 2 "
                      "-- flotilla train");
  }
  if (a.port > 0 && a.port + a.workers - 1 > 65535) {
    throw ConfigError("--port " + std::to_string(a.port) + " leaves no room for " +
                      std::to_string(a.workers) + " consecutive ports; use a port up to " +
                      std::to_string(65536 - a.workers));
  }
  std::vector<int> ports;
  if (a.port > 0) {
    for (int i = 0; i < a.workers; ++i) ports.push_back(a.port + i);
  } else {
    ports = free_ports(a.workers);
  }
  cluster::ClusterSpec spec;
  for (int port : ports) spec.worker.push_back({"127.0.0.1", port});
  const int threads = std::max(1, available_cores() / a.workers);

  // `flotilla launch -- flotilla train` means this very program, on PATH or not.
  std::vector<std::string> argv_strings = a.command;
  if (argv_strings[0] == "flotilla") argv_strings[0] = self_executable();

  auto [signal_read, signal_write] = make_pipe();
  ::fcntl(signal_write.get(), F_SETFL, O_NONBLOCK);
  g_signal_pipe = signal_write.get();
  struct sigaction action {};
  action.sa_handler = on_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  for (int sig : {SIGINT, SIGTERM, SIGCHLD, SIGHUP}) ::sigaction(sig, &action, nullptr);
  ::signal(SIGPIPE, SIG_IGN);  // a closed stdout must not kill us and orphan the workers

  std::vector<Child> children(static_cast<std::size_t>(a.workers));
  std::optional<int> failed;  // index of the first worker that failed
  std::optional<Clock::time_point> kill_at;
  int signals_received = 0;

  auto stop_all = [&](int sig) {
    for (auto& c : children) {
      if (c.running) ::kill(-c.pid, sig);  // its whole process group
    }
  };

  for (int i = 0; i < a.workers; ++i) {
    Child& child = children[static_cast<std::size_t>(i)];
    child.index = i;
    spec.task = {cluster::TaskType::kWorker, i};
    const auto env_strings = child_environment(i, a.workers, cluster::to_tf_config(spec), threads,
                                              ::isatty(STDOUT_FILENO) != 0);
    std::vector<char*> argv, envp;
    for (const auto& s : argv_strings) argv.push_back(const_cast<char*>(s.c_str()));
    argv.push_back(nullptr);
    for (const auto& s : env_strings) envp.push_back(const_cast<char*>(s.c_str()));
    envp.push_back(nullptr);

    auto [out_read, out_write] = make_pipe();
    auto [err_read, err_write] = make_pipe();
    const int rc = spawn(argv, envp, out_write.get(), err_write.get(), &child.pid);
    if (rc != 0) {
      stop_all(SIGKILL);
      for (auto& c : children) {
        if (c.running) ::waitpid(c.pid, nullptr, 0);
      }
      throw ConfigError("cannot start \"" + a.command[0] + "\": " + std::strerror(rc) +
                        "; check the command after --");
    }
    child.running = true;
    child.out = std::move(out_read);
    child.err = std::move(err_read);
  }

  const auto reap = [&] {
    for (auto& c : children) {
      if (!c.running) continue;
      int status = 0;
      const pid_t r = ::waitpid(c.pid, &status, WNOHANG);
      if (r != c.pid) continue;
      c.running = false;
      c.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      if (c.exit_code != 0 && !failed && signals_received == 0) {
        failed = c.index;
        std::string how = WIFEXITED(status) ? "exited with code " + std::to_string(c.exit_code)
                                            : std::string("was killed by signal ") +
                                                  ::strsignal(WTERMSIG(status));
        write_all(STDERR_FILENO, "[launch] worker " + std::to_string(c.index) + " " + how +
                                     "; stopping the other workers\n");
        stop_all(SIGTERM);
        kill_at = Clock::now() + std::chrono::milliseconds(static_cast<int>(a.grace_s * 1000));
      }
    }
  };

  for (;;) {
    reap();
    const bool any_running =
        std::any_of(children.begin(), children.end(), [](const Child& c) { return c.running; });
    std::vector<pollfd> fds{{signal_read.get(), POLLIN, 0}};
    std::vector<std::pair<Child*, bool>> owners{{nullptr, false}};
    for (auto& c : children) {
      if (c.out.get() >= 0) fds.push_back({c.out.get(), POLLIN, 0}), owners.push_back({&c, true});
      if (c.err.get() >= 0) fds.push_back({c.err.get(), POLLIN, 0}), owners.push_back({&c, false});
    }
    // Done when every worker is gone and its output drained. A grandchild that keeps a pipe
    // open cannot hold us: once the workers are gone, reads get a short deadline.
    if (!any_running && fds.size() == 1) break;
    int wait_ms = any_running ? 1000 : 200;
    if (kill_at && any_running) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(*kill_at - Clock::now());
      if (left.count() <= 0) {
        stop_all(SIGKILL);
        kill_at.reset();
      } else {
        wait_ms = static_cast<int>(std::min<long long>(wait_ms, left.count()));
      }
    }
    const int ready = ::poll(fds.data(), fds.size(), wait_ms);
    if (ready < 0 && errno != EINTR) throw Error(std::string("poll: ") + std::strerror(errno));
    if (ready == 0 && !any_running) {  // workers gone, pipes quiet: stop waiting for them
      for (auto& c : children) {
        emit_lines(c.index, c.out_buffer, STDOUT_FILENO, true);
        emit_lines(c.index, c.err_buffer, STDERR_FILENO, true);
        c.out.reset();
        c.err.reset();
      }
      continue;
    }
    for (std::size_t k = 0; k < fds.size() && ready > 0; ++k) {
      if (!(fds[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      if (k == 0) {
        unsigned char sigs[64];
        const ssize_t n = ::read(signal_read.get(), sigs, sizeof sigs);
        for (ssize_t s = 0; s < n; ++s) {
          if (sigs[s] == SIGCHLD) continue;  // reaped at the top of the loop
          ++signals_received;
          // First Ctrl-C/SIGTERM: pass it on and let workers stop; a second one: kill.
          stop_all(signals_received == 1 ? sigs[s] : SIGKILL);
          if (signals_received == 1) {
            kill_at = Clock::now() + std::chrono::milliseconds(static_cast<int>(a.grace_s * 1000));
          }
        }
        continue;
      }
      auto [child, is_out] = owners[k];
      char buf[65536];
      const ssize_t n = ::read(fds[k].fd, buf, sizeof buf);
      std::string& buffer = is_out ? child->out_buffer : child->err_buffer;
      const int target = is_out ? STDOUT_FILENO : STDERR_FILENO;
      if (n > 0) {
        buffer.append(buf, static_cast<std::size_t>(n));
        emit_lines(child->index, buffer, target, false);
      } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
        emit_lines(child->index, buffer, target, true);
        (is_out ? child->out : child->err).reset();
      }
    }
  }
  for (int sig : {SIGINT, SIGTERM, SIGCHLD, SIGHUP}) ::signal(sig, SIG_DFL);
  g_signal_pipe = -1;

  if (failed) return children[static_cast<std::size_t>(*failed)].exit_code;
  for (const auto& c : children) {
    if (c.exit_code != 0) return c.exit_code;  // stopped by a forwarded signal
  }
  return kExitOk;
}

}  // namespace

Command add_launch(CLI::App& parent) {
  auto args = std::make_shared<LaunchArgs>();
  CLI::App* app = parent.add_subcommand(
      "launch", "Start N workers of a command on this machine (127.0.0.1), each with TF_CONFIG");
  app->add_option("--workers", args->workers, "Number of worker processes")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  app->add_option("--port", args->port,
                  "First port; worker i listens on port+i (0: free ports chosen by the kernel)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  app->add_option("--grace", args->grace_s,
                  "Seconds stopped workers get between SIGTERM and SIGKILL")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app->add_option("command", args->command, "The command each worker runs, after --")
      ->required();
  app->footer("Example: flotilla launch --workers 2 -- flotilla train --model cnn --epochs 1");
  return {app, [args] { return run(*args); }};
}

}  // namespace flotilla::tools
