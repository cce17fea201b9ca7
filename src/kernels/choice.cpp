#include "flotilla/kernels/choice.h"

#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <torch/torch.h>
#include <torch/version.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <sstream>

#include "flotilla/base/atomic_file.h"
#include "flotilla/base/hashes.h"
#include "flotilla/base/system.h"
#include "flotilla/error.h"
#include "flotilla/log.h"
#include "kernels/measure.h"

namespace flotilla::kernels {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kFormat = "flotilla kernel choices";
constexpr int kVersion = 1;
// Timing rounds after one warm-up run of each: at least kMinRounds, up to kMaxRounds while the
// two are within kClose of each other, and no more once a key has taken kBudget seconds. One
// round is enough where it and the warm-up both find one candidate more than kDecisive times as
// fast as the other (ATen's emulated bfloat16 convolutions against flotilla's, 2-12x apart, took
// most of resnet18's first-run cost: 10.8 s with three rounds at 15 shapes).
constexpr int kMinRounds = 3;
constexpr double kDecisive = 2.0;
constexpr int kMaxRounds = 7;
constexpr double kClose = 0.05;
constexpr double kBudget = 1.5;

struct State {
  std::mutex mutex;
  Mode mode = Mode::kMeasure;
  std::optional<fs::path> directory; // set_cache_directory's; nullopt: the environment's
  std::vector<Decision> decisions;
  std::map<std::string, std::size_t> index; // "op key" -> decisions[i]
  double seconds_measuring = 0;
  bool cache_refused = false; // the file is not ours, or cannot be written: memory only
};

State& state() {
  static State s;
  return s;
}

// The first processor's "model name" and "flags" lines of /proc/cpuinfo ("" where absent).
std::pair<std::string, std::string> cpu_identity() {
  static const std::pair<std::string, std::string> identity = [] {
    std::ifstream in("/proc/cpuinfo");
    std::string line, model, flags;
    while (std::getline(in, line) && (model.empty() || flags.empty())) {
      const auto colon = line.find(':');
      if (colon == std::string::npos) continue;
      std::string name = line.substr(0, colon);
      name.erase(name.find_last_not_of(" \t") + 1);
      std::string value = line.substr(colon + 1);
      value.erase(0, value.find_first_not_of(' '));
      if (name == "model name" && model.empty()) model = value;
      if (name == "flags" && flags.empty()) flags = value;
    }
    return std::make_pair(model, flags);
  }();
  return identity;
}

// This build: flotilla's and LibTorch's versions, and the running program's size and time of
// modification (a rebuilt kernel is a new program, whose speed may differ).
std::string build_identity() {
  static const std::string identity = [] {
    std::ostringstream out;
    out << "flotilla " << FLOTILLA_VERSION << ", LibTorch " << TORCH_VERSION;
    struct stat st {};
    if (::stat("/proc/self/exe", &st) == 0) {
      out << ", program of " << st.st_size << " bytes modified at " << st.st_mtim.tv_sec << "."
          << st.st_mtim.tv_nsec;
    }
    return out.str();
  }();
  return identity;
}

fs::path default_directory() {
  // The one place flotilla's kernels read the environment for the cache.
  if (const char* dir = std::getenv("FLOTILLA_CACHE_DIR"); dir && *dir) return dir;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg) {
    return fs::path(xdg) / "flotilla";
  }
  if (const char* home = std::getenv("HOME"); home && *home) {
    return fs::path(home) / ".cache" / "flotilla";
  }
  return {};
}

fs::path directory_locked(const State& s) {
  const fs::path base = s.directory ? *s.directory : default_directory();
  return base.empty() ? base : base / "kernels";
}

fs::path file_locked(const State& s) {
  const fs::path dir = directory_locked(s);
  if (dir.empty()) return {};
  const auto [model, flags] = cpu_identity();
  const std::string id = model + "\n" + flags + "\n" + build_identity();
  return dir / (base::sha256_hex(id.data(), id.size()).substr(0, 16) + ".json");
}

// flock on a file beside the cache: the workers of one host take turns measuring. Held while one
// measures, so the others find its choice in the file when they get the lock.
class FileLock {
 public:
  explicit FileLock(const fs::path& path) {
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ >= 0 && ::flock(fd_, LOCK_EX) != 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }
  ~FileLock() {
    if (fd_ >= 0) ::close(fd_); // releases the lock
  }
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;
  bool held() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

void refuse_cache(State& s, const std::string& why) {
  if (s.cache_refused) return;
  s.cache_refused = true;
  Logger().warn("kernel choices: " + why + "; this process measures again and keeps its choices "
                "in memory");
}

// The file's choices, or nullopt (and the cache refused, with a warning) where it is not a
// choices file of this CPU and build: damaged, another program's, edited. An absent file is an
// empty one.
std::optional<json> read_choices(State& s, const fs::path& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return json::object();
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  const std::string shown = path.string();
  json doc = json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  const auto [model, flags] = cpu_identity();
  std::string why;
  if (doc.is_discarded() || !doc.is_object()) {
    why = "is not JSON";
  } else if (doc.value("format", "") != kFormat || doc.value("version", 0) != kVersion) {
    why = "is not a flotilla kernel-choice file of version " + std::to_string(kVersion);
  } else if (doc.value("cpu", "") != model || doc.value("flags", "") != flags ||
             doc.value("build", "") != build_identity()) {
    why = "was written for another CPU or build";
  } else if (!doc.contains("choices") || !doc["choices"].is_object()) {
    why = "has no \"choices\" object";
  } else {
    for (const auto& [key, c] : doc["choices"].items()) {
      const bool ok = c.is_object() && c.contains("kernel") && c["kernel"].is_string() &&
                      (c["kernel"] == "flotilla" || c["kernel"] == "aten") &&
                      c.contains("flotilla_ms") && c["flotilla_ms"].is_number() &&
                      c.contains("aten_ms") && c["aten_ms"].is_number() &&
                      std::isfinite(c["flotilla_ms"].get<double>()) &&
                      std::isfinite(c["aten_ms"].get<double>()) &&
                      c["flotilla_ms"].get<double>() > 0 && c["aten_ms"].get<double>() > 0;
      if (!ok) {
        why = "holds a choice that is not one flotilla writes (\"" + key + "\")";
        break;
      }
    }
  }
  if (!why.empty()) {
    refuse_cache(s, shown + " " + why + ", so it is ignored and left as it is (delete it to let "
                        "flotilla write a fresh one)");
    return std::nullopt;
  }
  return doc["choices"];
}

void write_choices(State& s, const fs::path& path, const json& choices) {
  const auto [model, flags] = cpu_identity();
  json doc = {{"format", kFormat}, {"version", kVersion}, {"cpu", model},
              {"flags", flags},   {"build", build_identity()}, {"choices", choices}};
  try {
    base::write_file_atomic(path, doc.dump(1) + "\n");
  } catch (const std::exception& e) {
    refuse_cache(s, std::string("cannot write ") + path.string() + " (" + e.what() + ")");
  }
}

double run_ms(const std::function<void()>& f) {
  const auto start = base::Clock::now();
  f();
  return base::seconds_since(start) * 1e3;
}

// The faster of several runs of each, alternating which goes first.
std::pair<double, double> time_both(const detail::Candidates& c) {
  const auto start = base::Clock::now();
  // Warm: allocations, oneDNN's primitives, caches.
  const double warm_ours = run_ms(c.flotilla), warm_theirs = run_ms(c.aten);
  const auto decisive = [](double a, double b) { return a > kDecisive * b || b > kDecisive * a; };
  double ours = std::numeric_limits<double>::infinity(), theirs = ours;
  for (int round = 0; round < kMaxRounds; ++round) {
    if (round % 2 == 0) {
      ours = std::min(ours, run_ms(c.flotilla));
      theirs = std::min(theirs, run_ms(c.aten));
    } else {
      theirs = std::min(theirs, run_ms(c.aten));
      ours = std::min(ours, run_ms(c.flotilla));
    }
    if (round == 0 && decisive(ours, theirs) && decisive(warm_ours, warm_theirs) &&
        (ours < theirs) == (warm_ours < warm_theirs)) {
      break;
    }
    const bool clear = std::abs(ours - theirs) > kClose * std::min(ours, theirs);
    if (round + 1 >= kMinRounds && (clear || base::seconds_since(start) > kBudget)) break;
  }
  return {ours, theirs};
}

// Nothing a measurement does reaches the training around it: no profiler or FLOP counter sees
// its operations, autocast's cache keeps none of its casts.
struct Quiet {
  at::DisableRecordFunctionGuard no_record;
  bool cache = at::autocast::is_autocast_cache_enabled();
  Quiet() { at::autocast::set_autocast_cache_enabled(false); }
  ~Quiet() { at::autocast::set_autocast_cache_enabled(cache); }
};

thread_local bool t_measuring = false;

const Decision& record(State& s, Decision d) {
  const std::string id = d.op + " " + d.key;
  s.index[id] = s.decisions.size();
  s.decisions.push_back(std::move(d));
  return s.decisions.back();
}

} // namespace

Mode parse_mode(const std::string& text) {
  if (text == "measure") return Mode::kMeasure;
  if (text == "fixed") return Mode::kFixed;
  if (text == "none") return Mode::kNone;
  throw ConfigError("kernels \"" + text + "\" is not a choice; use measure (time flotilla's "
                    "kernels against ATen's on this CPU, keep the faster), fixed (flotilla's "
                    "wherever they apply) or none (ATen's everywhere)");
}

std::string to_string(Mode mode) {
  switch (mode) {
    case Mode::kMeasure: return "measure";
    case Mode::kFixed: return "fixed";
    case Mode::kNone: return "none";
  }
  return "?";
}

void set_mode(Mode mode) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.mode = mode;
}

Mode mode() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.mode;
}

void set_cache_directory(std::optional<fs::path> directory) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.directory = std::move(directory);
  s.cache_refused = false;
}

fs::path cache_directory() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return directory_locked(s);
}

fs::path cache_file() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return file_locked(s);
}

std::vector<Decision> decisions() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.decisions;
}

double seconds_measuring() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.seconds_measuring;
}

std::vector<std::string> summary_lines() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  static const std::vector<std::pair<std::string, std::string>> kNames = {
      {"conv3x3", "3x3 convolutions (Winograd's)"},
      {"conv_float32", "other convolutions (bfloat16 in float32 arithmetic)"},
      {"batch_norm_relu", "BatchNorm+ReLU"},
      {"batch_norm_add_relu", "BatchNorm+add+ReLU"},
      {"conv_max_pool2_relu", "first layer (conv+ReLU+max-pool)"},
      {"max_pool2_relu", "ReLU+max-pool"},
      {"dropout", "dropout (hashed masks)"},
      {"gelu_dropout", "GELU+dropout"},
      {"gelu", "GELU"},
      {"attention", "attention"}};
  const auto ratios = [](std::vector<double> r) {
    std::sort(r.begin(), r.end());
    std::ostringstream out;
    out.precision(3);
    if (r.empty()) return std::string();
    out << r.front();
    if (r.back() > r.front()) out << "-" << r.back();
    return out.str() + "x";
  };
  std::vector<std::string> lines;
  int cached = 0, timed = 0;
  for (const Decision& d : s.decisions) (d.from_cache ? cached : timed) += d.flotilla_ms > 0;
  const fs::path file = s.cache_refused ? fs::path() : file_locked(s);
  std::ostringstream head;
  head.precision(2);
  head << "kernels: " << to_string(s.mode) << " (--kernels " << to_string(s.mode) << ")";
  if (s.mode == Mode::kMeasure) {
    head << ": " << s.decisions.size() << " shape(s), " << cached << " read from "
         << (file.empty() ? std::string("no cache") : file.string()) << ", " << timed
         << " timed in " << std::fixed << s.seconds_measuring << " s";
  }
  lines.push_back(head.str());
  for (const auto& [op, name] : kNames) {
    int ours = 0, theirs = 0;
    std::vector<double> won, lost;
    for (const Decision& d : s.decisions) {
      if (d.op != op) continue;
      (d.flotilla ? ours : theirs) += 1;
      if (d.flotilla_ms > 0) (d.flotilla ? won : lost).push_back(d.ratio());
    }
    if (ours + theirs == 0) continue;
    std::string line = name + ": flotilla's at " + std::to_string(ours) + " of " +
                       std::to_string(ours + theirs) + " shape(s)";
    if (!won.empty()) line += ", " + ratios(won) + " ATen's speed";
    if (theirs > 0) line += "; ATen's at " + std::to_string(theirs);
    if (!lost.empty()) line += ", where flotilla's ran at " + ratios(lost) + " of its speed";
    lines.push_back(line);
  }
  return lines;
}

void reset_decisions() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.decisions.clear();
  s.index.clear();
  s.seconds_measuring = 0;
}

namespace detail {

std::string shape_text(const std::vector<std::int64_t>& sizes) {
  std::string text;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    text += (i ? "x" : "") + std::to_string(sizes[i]);
  }
  return text;
}

bool use_flotilla(const char* op, const std::string& shape, bool training,
                  const std::function<Candidates()>& make) {
  if (t_measuring) {
    throw Error(std::string("flotilla bug: ") + op + "'s candidates asked for a choice while "
                "being measured; a candidate must run a kernel directly");
  }
  State& s = state();
  // Held while measuring: the replicas (threads) of this process wait for the one that measures.
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.mode == Mode::kNone) return false;
  const std::string key =
      shape + (training ? " train" : " infer") + " t" + std::to_string(at::get_num_threads());
  if (const auto it = s.index.find(std::string(op) + " " + key); it != s.index.end()) {
    return s.decisions[it->second].flotilla;
  }
  Decision d{op, key};
  if (s.mode == Mode::kFixed) {
    d.flotilla = true;
    return record(s, d).flotilla;
  }
  const std::string id = std::string(op) + " " + key;
  const fs::path path = s.cache_refused ? fs::path() : file_locked(s);
  std::optional<FileLock> file_lock;
  std::optional<json> cached;
  if (!path.empty()) {
    std::error_code ec;
    fs::create_directories(path.parent_path(), ec);
    file_lock.emplace(fs::path(path).replace_extension(".lock"));
    if (!file_lock->held()) {
      refuse_cache(s, "cannot lock " + path.parent_path().string() +
                          " (not writable: give FLOTILLA_CACHE_DIR another directory)");
    } else {
      cached = read_choices(s, path);
    }
  }
  if (cached && cached->contains(id)) {
    const json& c = (*cached)[id];
    d.flotilla = c["kernel"] == "flotilla";
    d.flotilla_ms = c["flotilla_ms"].get<double>();
    d.aten_ms = c["aten_ms"].get<double>();
    d.from_cache = true;
    return record(s, d).flotilla;
  }
  const auto start = base::Clock::now();
  {
    t_measuring = true;
    struct Reset {
      ~Reset() { t_measuring = false; }
    } reset;
    Quiet quiet;
    torch::AutoGradMode grad(training);
    const Candidates candidates = make();
    std::tie(d.flotilla_ms, d.aten_ms) = time_both(candidates);
  }
  s.seconds_measuring += base::seconds_since(start);
  d.flotilla = d.flotilla_ms < d.aten_ms;
  if (cached && !s.cache_refused) {
    (*cached)[id] = {{"kernel", d.flotilla ? "flotilla" : "aten"},
                     {"flotilla_ms", d.flotilla_ms},
                     {"aten_ms", d.aten_ms}};
    write_choices(s, path, *cached);
  }
  return record(s, d).flotilla;
}

} // namespace detail
} // namespace flotilla::kernels
