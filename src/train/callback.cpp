#include "flotilla/train/callback.h"

#include <unistd.h>

#include <algorithm>

#include "flotilla/error.h"
#include "flotilla/train/progress.h"

namespace flotilla::train {
namespace fs = std::filesystem;

Model& Callback::model() const {
  if (!model_) throw ConfigError("a callback was used outside Model::fit()");
  return *model_;
}

bool Callback::is_chief() const {
  return model().strategy().is_chief();
}

Verbosity resolve_verbosity(Verbosity verbose, std::FILE* out) {
  if (verbose != Verbosity::kAuto) return verbose;
  return ::isatty(fileno(out)) ? Verbosity::kProgressBar : Verbosity::kOneLinePerEpoch;
}

namespace {

// The path as the file system will resolve it: absolute, links in its existing part followed.
fs::path resolved(const fs::path& path) {
  std::error_code ec;
  fs::path out = fs::weakly_canonical(fs::absolute(path), ec);
  if (ec) out = fs::absolute(path).lexically_normal();
  if (!out.has_filename()) out = out.parent_path(); // "dir/" -> "dir"
  return out;
}

bool inside(const fs::path& inner, const fs::path& outer) {
  auto o = outer.begin(), i = inner.begin();
  for (; o != outer.end(); ++o, ++i) {
    if (i == inner.end() || *i != *o) return false;
  }
  return true;
}

// A callback that deletes its files from its directory when the fit ends must not share it:
// the other's files would be in the way of its "nothing here but mine" check, or inside it.
void check_directories(const std::vector<CallbackNeeds::Directory>& directories) {
  for (std::size_t a = 0; a < directories.size(); ++a) {
    for (std::size_t b = 0; b < directories.size(); ++b) {
      const auto& mine = directories[a];
      const auto& other = directories[b];
      if (a == b || !mine.exclusive) continue;
      const fs::path m = resolved(mine.path), o = resolved(other.path);
      if (!inside(m, o) && !inside(o, m)) continue;
      throw ConfigError(
          mine.owner + " " + mine.path.string() + " and " + other.owner + " " +
          other.path.string() +
          (m == o ? " are the same directory"
                  : (inside(o, m) ? " overlap: the second is inside the first"
                                  : " overlap: the first is inside the second")) +
          "; the first holds only the files it writes, and deletes them when the fit ends, so "
          "give it a directory of its own, neither inside the other nor containing it");
    }
  }
}

} // namespace

CallbackList::CallbackList(std::vector<std::shared_ptr<Callback>> callbacks, Verbosity verbose)
    : callbacks_(std::move(callbacks)), verbose_(resolve_verbosity(verbose)) {
  for (const auto& c : callbacks_) {
    if (!c) throw ConfigError("a null callback was passed to fit()");
  }
  check_directories(needs().directories);
  if (verbose_ != Verbosity::kSilent && !needs().shows_progress) {
    callbacks_.insert(callbacks_.begin(), std::make_shared<ProgressBar>(verbose_));
  }
}

CallbackNeeds CallbackList::needs() const {
  CallbackNeeds all;
  for (const auto& c : callbacks_) {
    const CallbackNeeds n = c->needs();
    all.finite_check = all.finite_check || n.finite_check;
    all.shows_progress = all.shows_progress || n.shows_progress;
    all.directories.insert(all.directories.end(), n.directories.begin(), n.directories.end());
    if (n.preemption_check) {
      all.preemption_check =
          std::min(all.preemption_check.value_or(*n.preemption_check), *n.preemption_check);
    }
  }
  return all;
}

void CallbackList::set_model(Model* model, const TrainParams& params) {
  for (auto& c : callbacks_) {
    c->set_model(model);
    c->set_params(params);
  }
}

void CallbackList::on_train_begin() {
  for (auto& c : callbacks_) c->on_train_begin();
}
void CallbackList::on_train_end() {
  for (auto& c : callbacks_) c->on_train_end();
}
void CallbackList::on_epoch_begin(int epoch) {
  for (auto& c : callbacks_) c->on_epoch_begin(epoch);
}
void CallbackList::on_epoch_end(int epoch, EpochLogs& logs) {
  for (auto& c : callbacks_) c->on_epoch_end(epoch, logs);
}
void CallbackList::on_train_batch_begin(std::int64_t batch) {
  for (auto& c : callbacks_) c->on_train_batch_begin(batch);
}
void CallbackList::on_train_batch_end(std::int64_t batch, const Logs& logs) {
  for (auto& c : callbacks_) c->on_train_batch_end(batch, logs);
}

std::string CallbackList::on_preemption() {
  std::string where;
  for (auto& c : callbacks_) {
    const std::string saved = c->on_preemption();
    if (!saved.empty()) where += (where.empty() ? "" : " and ") + saved;
  }
  return where;
}

} // namespace flotilla::train
