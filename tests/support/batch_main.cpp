// The test suites' main(): GoogleTest's, plus the batched run that keeps `make test` from paying
// LibTorch's start-up (~0.4 s) once per test. CTest still has one entry per test, but instead of
// starting the suite once per test it starts it once (the `<suite>_run` fixture):
//
//   <suite> --flotilla-batch=<results>   supervises: runs every test in one child process (this
//                                        program again), which appends to <results>, as each
//                                        test starts and ends, "START <name>" and "END <name>
//                                        <PASSED|FAILED|SKIPPED|CRASHED|TIMEOUT> <ms>" with its
//                                        failure messages after it, each line flushed. A child
//                                        that dies or overruns the per-test timeout is ended,
//                                        its test recorded as CRASHED or TIMEOUT, and a new
//                                        child runs the tests not yet done.
//   tests/support/batch_report.sh        each test's CTest entry: prints its block and exits
//                                        with its status (see there).
//   --flotilla-shard=I/N                 with --flotilla-batch: run only every Nth test of the
//                                        suite's list, from the Ith (0-based), so that N runs
//                                        of the suite, each with results of its own, can share
//                                        the machine: most of these tests wait (on timeouts,
//                                        on processes they start) more than they compute.
//
// Without --flotilla-batch it is gtest_main, so the suites run directly as before
// (`unit_tests --gtest_filter=...`) and gtest_discover_tests lists them.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace {

constexpr const char* kResultsVariable = "FLOTILLA_TEST_RESULTS";

// In the child: one block per test in the results file.
class ResultsListener : public ::testing::EmptyTestEventListener {
 public:
  explicit ResultsListener(const char* path) : out_(std::fopen(path, "a")) {
    if (!out_) {
      std::fprintf(stderr, "cannot append to %s (%s)\n", path, std::strerror(errno));
      std::exit(2);
    }
  }
  void OnTestStart(const ::testing::TestInfo& test) override {
    std::fprintf(out_, "START %s\n", name(test).c_str());
    std::fflush(out_);
  }
  void OnTestPartResult(const ::testing::TestPartResult& part) override {
    if (part.type() == ::testing::TestPartResult::kSuccess) return;
    std::string text = part.file_name() ? std::string(part.file_name()) + ":" +
                                              std::to_string(part.line_number()) + ": "
                                        : std::string();
    text += part.type() == ::testing::TestPartResult::kSkip ? "Skipped\n" : "Failure\n";
    text += part.message();
    std::istringstream lines(text);
    for (std::string line; std::getline(lines, line);) std::fprintf(out_, "| %s\n", line.c_str());
    std::fflush(out_);
  }
  void OnTestEnd(const ::testing::TestInfo& test) override {
    const auto* result = test.result();
    const char* status = result->Skipped() ? "SKIPPED" : result->Passed() ? "PASSED" : "FAILED";
    std::fprintf(out_, "END %s %s %lld\n", name(test).c_str(), status,
                 static_cast<long long>(result->elapsed_time()));
    std::fflush(out_);
  }

 private:
  static std::string name(const ::testing::TestInfo& test) {
    return std::string(test.test_suite_name()) + "." + test.name();
  }
  std::FILE* out_;
};

// The tests started and ended so far: (the one running, if any; the ended ones).
void scan(const std::string& path, std::string& running, std::set<std::string>& ended) {
  std::ifstream in(path);
  running.clear();
  ended.clear();
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("START ", 0) == 0) {
      running = line.substr(6);
    } else if (line.rfind("END ", 0) == 0) {
      const std::string rest = line.substr(4);
      const std::string name = rest.substr(0, rest.find(' '));
      ended.insert(name);
      if (name == running) running.clear();
    }
  }
}

// The tests of shard `index` of `count`: every count-th test of the suite's list (the order
// --gtest_list_tests prints), from `index`. Read in this process, which registered them all.
std::vector<std::string> shard_tests(int index, int count) {
  int argc = 1;
  char name[] = "batch";
  char* argv[] = {name, nullptr};
  ::testing::InitGoogleTest(&argc, argv); // registers the parameterised tests too
  const auto* unit = ::testing::UnitTest::GetInstance();
  std::vector<std::string> mine;
  int position = 0;
  for (int s = 0; s < unit->total_test_suite_count(); ++s) {
    const auto* suite = unit->GetTestSuite(s);
    for (int t = 0; t < suite->total_test_count(); ++t, ++position) {
      if (position % count == index) {
        mine.push_back(std::string(suite->name()) + "." + suite->GetTestInfo(t)->name());
      }
    }
  }
  return mine;
}

void append(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::app) << text;
}

// The supervisor: children run the tests until every one that started has ended.
// `shard`: the tests to run (null: all).
int supervise(const char* self, const std::string& results, double timeout_s,
              const std::vector<std::string>& pass_through, const std::vector<std::string>* shard) {
  const std::string log = results + ".log";
  std::remove(results.c_str());
  std::remove(log.c_str());
  const std::string variable = std::string(kResultsVariable) + "=" + results;
  std::vector<char*> env;
  for (char** e = environ; *e; ++e) {
    if (std::strncmp(*e, kResultsVariable, std::strlen(kResultsVariable)) != 0) env.push_back(*e);
  }
  env.push_back(const_cast<char*>(variable.c_str()));
  env.push_back(nullptr);
  std::set<std::string> ended;
  std::string running;
  for (int child_number = 1;; ++child_number) {
    std::vector<std::string> args = {self};
    args.insert(args.end(), pass_through.begin(), pass_through.end());
    if (shard) { // this shard's tests not yet done
      std::string filter = "--gtest_filter=";
      for (const auto& name : *shard) {
        if (!ended.count(name)) filter += name + ":";
      }
      if (filter.back() != ':') return 0; // none left (the last child ended between tests)
      filter.pop_back();
      args.push_back(filter);
    } else if (!ended.empty()) { // the next child skips what is done
      std::string filter = "--gtest_filter=-";
      for (const auto& name : ended) filter += name + ":";
      filter.pop_back();
      args.push_back(filter);
    }
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    // The children's output goes to <results>.log, which a failing test's report points to.
    posix_spawn_file_actions_t output;
    posix_spawn_file_actions_init(&output);
    posix_spawn_file_actions_addopen(&output, STDOUT_FILENO, log.c_str(),
                                     O_WRONLY | O_CREAT | O_APPEND, 0644);
    posix_spawn_file_actions_adddup2(&output, STDOUT_FILENO, STDERR_FILENO);
    // In a process group of its own, so that a timeout ends the processes its test started too.
    posix_spawnattr_t attributes;
    posix_spawnattr_init(&attributes);
    posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETPGROUP);
    posix_spawnattr_setpgroup(&attributes, 0);
    pid_t pid = 0;
    const int spawned = posix_spawn(&pid, self, &output, &attributes, argv.data(), env.data());
    posix_spawn_file_actions_destroy(&output);
    posix_spawnattr_destroy(&attributes);
    if (spawned != 0) {
      std::fprintf(stderr, "batch: cannot start %s (%s)\n", self, std::strerror(errno));
      return 2;
    }
    std::string current;
    auto since = std::chrono::steady_clock::now();
    int status = 0;
    bool timed_out = false;
    while (waitpid(pid, &status, WNOHANG) == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      scan(results, running, ended);
      if (running != current) {
        current = running;
        since = std::chrono::steady_clock::now();
      }
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
      if (!current.empty() && seconds > timeout_s) {
        timed_out = true;
        ::kill(-pid, SIGKILL);
        waitpid(pid, &status, 0);
        break;
      }
    }
    scan(results, running, ended);
    const bool clean =
        !timed_out && WIFEXITED(status) && (WEXITSTATUS(status) == 0 || WEXITSTATUS(status) == 1);
    if (clean || running.empty()) {
      if (!clean) { // not any test's failure, but a failure: the whole run fails
        std::fprintf(stderr, "batch: child %d of %s ended between tests (wait status %d); see %s\n",
                     child_number, self, status, log.c_str());
        return 1;
      }
      return 0;
    }
    // The child died in `running` (or overran the timeout): record it, go on with the rest.
    std::ostringstream block;
    block << "| "
          << (timed_out ? "the test ran past the " + std::to_string(static_cast<int>(timeout_s)) +
                              " s per-test timeout and was stopped"
              : WIFSIGNALED(status)
                  ? "the test process died of signal " + std::to_string(WTERMSIG(status)) + " (" +
                        strsignal(WTERMSIG(status)) + ") during this test"
                  : "the test process exited with status " + std::to_string(WEXITSTATUS(status)) +
                        " during this test")
          << "; the suite's output is in " << log << "\n"
          << "END " << running << (timed_out ? " TIMEOUT " : " CRASHED ") << "0\n";
    append(results, block.str());
    ended.insert(running);
  }
}

} // namespace

int main(int argc, char** argv) {
  // Every test, and every program a test starts, keeps flotilla's measured kernel choices
  // (flotilla/kernels/choice.h) in one directory of the build: they share them, so two runs a
  // test compares run the same kernels, and no test writes to the user's ~/.cache.
  {
    char exe[4096];
    const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
      std::string dir(exe, static_cast<std::size_t>(n));
      dir = dir.substr(0, dir.rfind('/')) + "/kernel-cache";
      ::setenv("FLOTILLA_CACHE_DIR", dir.c_str(), /*overwrite=*/0);
    }
  }
  const std::string batch_flag = "--flotilla-batch=";
  const std::string timeout_flag = "--flotilla-test-timeout=";
  const std::string shard_flag = "--flotilla-shard=";
  std::string results;
  double timeout_s = 600;
  int shard_index = 0, shard_count = 0;
  std::vector<std::string> pass_through;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind(batch_flag, 0) == 0) {
      results = a.substr(batch_flag.size());
    } else if (a.rfind(timeout_flag, 0) == 0) {
      timeout_s = std::stod(a.substr(timeout_flag.size()));
    } else if (a.rfind(shard_flag, 0) == 0) {
      if (std::sscanf(a.c_str() + shard_flag.size(), "%d/%d", &shard_index, &shard_count) != 2 ||
          shard_index < 0 || shard_index >= shard_count) {
        std::fprintf(stderr, "batch: %s: expected --flotilla-shard=I/N with 0 <= I < N\n",
                     a.c_str());
        return 2;
      }
    } else {
      pass_through.push_back(a);
    }
  }
  if (!results.empty()) {
    if (shard_count == 0) {
      return supervise("/proc/self/exe", results, timeout_s, pass_through, nullptr);
    }
    const auto shard = shard_tests(shard_index, shard_count);
    return supervise("/proc/self/exe", results, timeout_s, pass_through, &shard);
  }
  ::testing::InitGoogleTest(&argc, argv);
  if (const char* path = std::getenv(kResultsVariable)) {
    ::testing::UnitTest::GetInstance()->listeners().Append(new ResultsListener(path));
  }
  return RUN_ALL_TESTS();
}
