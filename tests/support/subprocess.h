// Test support: start real processes (the CLI, worker helpers) with extra environment, collect
// their output and exit code, never wait forever.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace flotilla::testing {

// A process's output, line by line (no newlines).
inline std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// How often `what` occurs in `text` (overlapping occurrences count).
inline std::size_t count_of(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

struct ProcessResult {
  int exit_code = -1; // 128 + signal when killed; -1 when it outlived the timeout (killed)
  std::string out;
  std::string err;
};

inline std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A child process with its stdout/stderr in temporary files.
class Process {
 public:
  Process(const std::vector<std::string>& argv,
          const std::map<std::string, std::string>& env = {}) {
    static int counter = 0;
    const std::string base =
        "/tmp/flotilla-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
    out_path_ = base + ".out";
    err_path_ = base + ".err";
    std::map<std::string, std::string> vars;
    for (char** e = environ; *e; ++e) {
      std::string entry = *e;
      const auto eq = entry.find('=');
      if (eq != std::string::npos) vars[entry.substr(0, eq)] = entry.substr(eq + 1);
    }
    for (const auto& [k, v] : env) {
      if (v.empty()) {
        vars.erase(k);
      } else {
        vars[k] = v;
      }
    }
    std::vector<std::string> env_strings;
    for (const auto& [k, v] : vars) env_strings.push_back(k + "=" + v);
    std::vector<char*> args, envp;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    for (const auto& e : env_strings) envp.push_back(const_cast<char*>(e.c_str()));
    envp.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, out_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                     0644);
    posix_spawn_file_actions_addopen(&actions, 2, err_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                     0644);
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    posix_spawnattr_setpgroup(&attr, 0);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
    const int rc = posix_spawnp(&pid_, args[0], &actions, &attr, args.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    posix_spawnattr_destroy(&attr);
    if (rc != 0) throw std::runtime_error("cannot start " + argv[0]);
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;
  ~Process() {
    if (pid_ > 0) {
      ::kill(-pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    ::unlink(out_path_.c_str());
    ::unlink(err_path_.c_str());
  }

  pid_t pid() const { return pid_; }
  void signal(int sig) { ::kill(pid_, sig); }
  // What it has written to stdout (stderr) so far, while it runs.
  std::string output_so_far() const { return read_file(out_path_); }
  std::string errors_so_far() const { return read_file(err_path_); }
  // Waits (bounded) until it has written `text` to stdout (stderr); false at the limit.
  bool wait_for_output(const std::string& text,
                       std::chrono::seconds limit = std::chrono::seconds(60)) const {
    return wait_for(out_path_, text, limit);
  }
  bool wait_for_errors(const std::string& text,
                       std::chrono::seconds limit = std::chrono::seconds(60)) const {
    return wait_for(err_path_, text, limit);
  }

  // Waits up to `timeout`; on expiry kills the whole process group and reports exit_code -1.
  ProcessResult wait(std::chrono::seconds timeout = std::chrono::seconds(300)) {
    ProcessResult result;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    int status = 0;
    for (;;) {
      const pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        break;
      }
      if (std::chrono::steady_clock::now() > deadline) {
        ::kill(-pid_, SIGKILL);
        ::waitpid(pid_, nullptr, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    pid_ = -1;
    result.out = read_file(out_path_);
    result.err = read_file(err_path_);
    return result;
  }

 private:
  static bool wait_for(const std::string& path, const std::string& text,
                       std::chrono::seconds limit) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < deadline) {
      if (read_file(path).find(text) != std::string::npos) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }
  pid_t pid_ = -1;
  std::string out_path_, err_path_;
};

inline ProcessResult run_process(const std::vector<std::string>& argv,
                                 const std::map<std::string, std::string>& env = {},
                                 std::chrono::seconds timeout = std::chrono::seconds(300)) {
  Process p(argv, env);
  return p.wait(timeout);
}

// Free TCP ports on 127.0.0.1, held together while chosen so none repeats.
inline std::vector<int> free_ports(int count) {
  std::vector<int> fds, ports;
  for (int i = 0; i < count; ++i) {
    const int s = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof addr;
    ::bind(s, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
    ::getsockname(s, reinterpret_cast<sockaddr*>(&addr), &len);
    ports.push_back(ntohs(addr.sin_port));
    fds.push_back(s);
  }
  for (int fd : fds) ::close(fd);
  return ports;
}

// A fresh empty directory under /tmp, removed with everything in it at scope exit.
// Every entry of `dir`, hidden ones included, sorted.
inline std::vector<std::string> entries(const std::filesystem::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    out.push_back(e.path().filename().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/flotilla-test-XXXXXX";
    path_ = ::mkdtemp(tmpl);
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

inline bool fashion_mnist_present() {
  return ::access("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz", R_OK) == 0;
}

// The first `train` training and `test` test images of Fashion-MNIST, with their labels, as
// uncompressed IDX files in `dir` (for --data-dir): for a test whose cost would otherwise be the
// final evaluation of 10000 test images. True when python3 wrote them.
inline bool write_fashion_mnist_subset(const std::string& dir, int train, int test) {
  const std::string script =
      "import gzip, struct, sys\n"
      "src, dst, n = '/usr/share/datasets/fashion-mnist', sys.argv[1], {'train': int(sys.argv[2]), "
      "'t10k': int(sys.argv[3])}\n"
      "for split, count in n.items():\n"
      "  for kind, dims in (('images-idx3', 3), ('labels-idx1', 1)):\n"
      "    data = gzip.open(f'{src}/{split}-{kind}-ubyte.gz').read()\n"
      "    shape = list(struct.unpack(f'>{dims}I', data[4:4 + 4 * dims]))\n"
      "    item = 1\n"
      "    for d in shape[1:]: item *= d\n"
      "    body = data[4 + 4 * dims:4 + 4 * dims + count * item]\n"
      "    shape[0] = count\n"
      "    open(f'{dst}/{split}-{kind}-ubyte', 'wb').write(data[:4] + struct.pack(f'>{dims}I', "
      "*shape) + body)\n";
  return run_process({"python3", "-c", script, dir, std::to_string(train), std::to_string(test)})
             .exit_code == 0;
}

} // namespace flotilla::testing
