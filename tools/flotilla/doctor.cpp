// `flotilla doctor -- <train command>`: runs the command (`flotilla train ...`, or `flotilla
// launch ... -- flotilla train ...`) with `--profile-json <file> --no-doctor` given to its train
// part, then prints the recipe doctor's findings on what the run measured (profile::diagnose). With
// --max-batch it first runs `flotilla tune --max-batch` for the command's model, so the batch
// item can say how far the batch is from the largest that fits. `--profile FILE` diagnoses a run
// recorded earlier instead of running anything. The command's output passes through; when it
// fails, doctor exits with its code.
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>

#include "flotilla/error.h"
#include "flotilla/profile/doctor.h"
#include "flotilla/profile/run_summary.h"
#include "tools/flotilla/commands.h"
#include "tools/flotilla/flags.h"

extern char** environ;

namespace flotilla::tools {
namespace {
namespace fs = std::filesystem;

struct DoctorArgs {
  std::string profile;       // diagnose this recorded run instead of running a command
  bool max_batch = false;    // also search the largest batch that fits (flotilla tune)
  std::string memory_budget; // passed to the search
  std::vector<std::string> command;
};

std::string self_path() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) throw Error("cannot find this program's path (/proc/self/exe)");
  return std::string(buf, static_cast<std::size_t>(n));
}

bool is_flotilla(const std::string& arg) {
  return arg == "flotilla" || (arg.size() > 9 && arg.compare(arg.size() - 9, 9, "/flotilla") == 0);
}

// The index of the `train` subcommand in argv: the first "train" that follows the flotilla
// program itself (so a flag's value spelt "train" is not taken for it), else the first "train".
std::size_t find_train(const std::vector<std::string>& argv) {
  for (std::size_t i = 1; i < argv.size(); ++i) {
    if (argv[i] == "train" && is_flotilla(argv[i - 1])) return i;
  }
  for (std::size_t i = 0; i < argv.size(); ++i) {
    if (argv[i] == "train") return i;
  }
  std::string shown;
  for (const auto& a : argv) shown += (shown.empty() ? "" : " ") + a;
  throw ConfigError("the command \"" + shown +
                    "\" has no `train`; flotilla doctor diagnoses a "
                    "training run: flotilla doctor -- flotilla train --model cnn ...");
}

// The value of `flag` among argv[from..to) ("--flag v" or "--flag=v"); `fallback` if absent.
std::string flag_value(const std::vector<std::string>& argv, std::size_t from, std::size_t to,
                       const std::string& flag, const std::string& fallback) {
  for (std::size_t i = from; i < to && i < argv.size(); ++i) {
    if (argv[i] == flag && i + 1 < argv.size()) return argv[i + 1];
    if (argv[i].rfind(flag + "=", 0) == 0) return argv[i].substr(flag.size() + 1);
  }
  return fallback;
}

// The child being waited for: a SIGINT/SIGTERM/SIGHUP sent to the doctor alone (a scheduler, a
// kill) reaches it too, instead of leaving it running orphaned while the doctor exits.
std::atomic<pid_t> running_child{0};

void forward_signal(int sig) {
  const pid_t child = running_child.load();
  if (child > 0) ::kill(child, sig);
}

// Runs argv with this process's stdin, stdout and stderr; returns its exit code (128 + signal
// when a signal ended it).
int run_child(std::vector<std::string> argv, const std::string& out_file = "") {
  if (argv[0] == "flotilla") argv[0] = self_path();
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (!out_file.empty()) {
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, out_file.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0600);
  }
  pid_t pid = -1;
  const int rc = ::posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    throw ConfigError("cannot start \"" + argv[0] + "\": " + std::strerror(rc) +
                      "; check the command after --");
  }
  running_child = pid;
  struct sigaction forward {}, previous[3];
  forward.sa_handler = forward_signal;
  const int signals[3] = {SIGINT, SIGTERM, SIGHUP};
  for (int i = 0; i < 3; ++i) ::sigaction(signals[i], &forward, &previous[i]);
  int status = 0;
  int waited = 0;
  while ((waited = ::waitpid(pid, &status, 0)) < 0 && errno == EINTR) {
  }
  const int wait_errno = errno;
  for (int i = 0; i < 3; ++i) ::sigaction(signals[i], &previous[i], nullptr);
  running_child = 0;
  if (waited < 0) throw Error(std::string("waitpid: ") + std::strerror(wait_errno));
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// A temporary file's name, removed with everything written to it at scope exit.
class TempFile {
 public:
  explicit TempFile(const std::string& suffix) {
    std::string tmpl = (fs::temp_directory_path() / ("flotilla-doctor-XXXXXX" + suffix)).string();
    const int fd = ::mkstemps(tmpl.data(), static_cast<int>(suffix.size()));
    if (fd < 0)
      throw Error("cannot create a temporary file in " + fs::temp_directory_path().string());
    ::close(fd);
    path_ = tmpl;
  }
  ~TempFile() {
    std::error_code ignored;
    fs::remove(path_, ignored);
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

struct SearchOutcome {
  std::int64_t max_batch = 0;
  std::int64_t budget = 0;
};

// `flotilla tune --max-batch --json` for the command's model, precision and optimizer, in its
// own process: the measured peak is then the search's alone, not this process's history.
SearchOutcome search_max_batch(const DoctorArgs& a, std::size_t train_at) {
  const auto& c = a.command;
  // flotilla train runs on the CPU (the CUDA path is not built): search on the same device.
  std::vector<std::string> tune = {self_path(), "tune",   "--max-batch",
                                   "--json",    "--device", "cpu"};
  tune.insert(tune.end(), {"--model", flag_value(c, train_at, c.size(), "--model", "cnn")});
  for (const char* flag : {"--precision", "--optimizer", "--threads"}) {
    const std::string v = flag_value(c, train_at, c.size(), flag, "");
    if (!v.empty()) tune.insert(tune.end(), {flag, v});
  }
  // Workers started together by `flotilla launch` share this machine's memory.
  const std::string workers = flag_value(c, 0, train_at, "--workers", "");
  if (!workers.empty()) tune.insert(tune.end(), {"--workers-per-machine", workers});
  if (!a.memory_budget.empty()) tune.insert(tune.end(), {"--memory-budget", a.memory_budget});
  std::fprintf(stderr,
               "flotilla doctor: searching the largest batch that fits (flotilla tune "
               "--max-batch --model %s)\n",
               tune[5].c_str());
  const TempFile out(".json");
  const int code = run_child(tune, out.path());
  if (code != 0) {
    throw ConfigError("the batch search (flotilla tune --max-batch) failed with exit code " +
                      std::to_string(code) + "; run it alone to see why, or drop --max-batch");
  }
  std::ifstream in(out.path());
  nlohmann::json j;
  try {
    in >> j;
    return {j.at("max_batch_per_replica").get<std::int64_t>(),
            j.at("memory_budget_bytes").get<std::int64_t>()};
  } catch (const nlohmann::json::exception& e) {
    throw Error(std::string("flotilla tune --json printed something unexpected: ") + e.what());
  }
}

int run(const DoctorArgs& a) {
  if (!a.profile.empty() && !a.command.empty()) {
    throw ConfigError("give either --profile FILE (a recorded run) or a command after --, not "
                      "both");
  }
  profile::RunSummary summary;
  std::optional<SearchOutcome> search;
  if (!a.profile.empty()) {
    summary = profile::read_run_summary(a.profile);
    if (a.max_batch) {
      std::vector<std::string> model_only = {"flotilla", "train", "--model",
                                             summary.recipe.model.empty() ? "cnn"
                                                                          : summary.recipe.model};
      DoctorArgs for_model = a;
      for_model.command = model_only;
      search = search_max_batch(for_model, 1);
    }
  } else {
    if (a.command.empty()) {
      throw ConfigError("nothing to diagnose: give the training command after --, e.g. flotilla "
                        "doctor -- flotilla train --model cnn --epochs 1");
    }
    std::vector<std::string> argv = a.command;
    const std::size_t train_at = find_train(argv);
    if (a.max_batch) search = search_max_batch(a, train_at);
    // The user's own --profile-json is kept; otherwise a temporary one.
    std::optional<TempFile> temp;
    std::string path = flag_value(argv, train_at, argv.size(), "--profile-json", "");
    if (path.empty()) {
      temp.emplace(".json");
      path = temp->path();
      argv.insert(argv.begin() + static_cast<std::ptrdiff_t>(train_at) + 1,
                  {"--profile-json", path});
    }
    // The report is printed once, here, with what doctor adds (the batch search) in it.
    if (std::find(argv.begin() + static_cast<std::ptrdiff_t>(train_at), argv.end(),
                  "--no-doctor") == argv.end()) {
      argv.insert(argv.begin() + static_cast<std::ptrdiff_t>(train_at) + 1, "--no-doctor");
    }
    const int code = run_child(argv);
    if (code != 0) return code; // its stderr has already said why
    if (!fs::exists(path) || fs::file_size(path) == 0) {
      throw ConfigError("the command finished but wrote no run profile to " + path +
                        "; is its train part `flotilla train` of a version with --profile-json?");
    }
    summary = profile::read_run_summary(path);
  }
  if (search) {
    summary.recipe.max_batch_per_replica = search->max_batch;
    summary.recipe.memory_budget_bytes = search->budget;
  }
  // The doctor's warmup advice is an epoch of updates, counted as the first epoch's steps.
  const std::int64_t updates_per_epoch = summary.epochs.empty() ? 0 : summary.epochs.front().steps;
  std::cout << "\n"
            << profile::format_findings(profile::diagnose(summary),
                                        cli_findings_format(updates_per_epoch));
  std::cout.flush();
  return kExitOk;
}

} // namespace

Command add_doctor(CLI::App& parent) {
  auto args = std::make_shared<DoctorArgs>();
  CLI::App* app = parent.add_subcommand(
      "doctor", "Run a training command and check it against the performance recipe");
  app->add_flag("--max-batch", args->max_batch,
                "First search the largest batch per replica that fits (flotilla tune)");
  app->add_option("--memory-budget", args->memory_budget,
                  "With --max-batch: peak memory one worker may use, e.g. 8GiB");
  app->add_option("--profile", args->profile,
                  "Diagnose a run recorded with flotilla train --profile-json FILE instead");
  app->add_option("command", args->command, "The training command, after --");
  app->footer("Example: flotilla doctor -- flotilla train --model cnn --steps-per-epoch 100");
  return {app, [args] { return run(*args); }};
}

} // namespace flotilla::tools
