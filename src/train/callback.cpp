#include "flotilla/train/callback.h"

#include <unistd.h>

#include <algorithm>

#include "flotilla/error.h"
#include "flotilla/train/progress.h"

namespace flotilla::train {

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

CallbackList::CallbackList(std::vector<std::shared_ptr<Callback>> callbacks, Verbosity verbose)
    : callbacks_(std::move(callbacks)), verbose_(resolve_verbosity(verbose)) {
  for (const auto& c : callbacks_) {
    if (!c) throw ConfigError("a null callback was passed to fit()");
  }
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
