// A training process for the elastic exactness test: Model::fit on a deterministic pipeline,
// in an elastic group (FLOTILLA_RENDEZVOUS, under flotilla launch --elastic) or alone
// (--reference). Each row carries its sample id as a last feature, which the pipeline's map
// strips and records; a callback writes the ids of every committed step to this process's
// ledger (<out>/ledger-<pid>.txt: "epoch id id ..." per step), so the ledgers of every
// process, the killed one's included, count each sample's training. At the end each process
// writes its weights to <out>/weights-<slot>.safetensors and the val_loss of each epoch it
// finished (validation on 96 other rows after every epoch) to <out>/val-<slot>.txt.
// Flags: --out DIR; --epochs N; --sleep-ms MS (per step, so a restarted worker can rejoin
// mid-fit); --signal-slot S --signal-at K --signal-once FILE (slot S SIGKILLs itself before
// global step K, once; --signal STOP: SIGSTOPs itself instead); --fault S:WHERE:E (repeatable:
// slot S SIGKILLs itself once at epoch E's end (1-based), WHERE gather: after its last step, the
// others waiting in the epoch's gather; validation: in its validation, the others waiting in
// validation's reduce; callbacks: in the callbacks' epoch end, the others waiting in the stop
// vote; WHERE callbacks-stop: SIGSTOPs itself there instead); --backup-dir DIR (a BackupAndRestore
// there, every 4 updates); --weights FILE (ModelCheckpoint's weights there at every epoch's
// end); --csv FILE (a CSVLogger); --batchnorm (a BatchNorm1d after the first layer); --evaluate
// (after the fit and its files, evaluate() on the validation data, its loss to
// <out>/eval-<slot>.txt, then predict() on it, the outputs to <out>/predict-<slot>.safetensors;
// --fault S:validation:E kills slot S in the evaluation with E = epochs + 1, in the prediction with
// E = epochs + 2); --reference (one worker, no elastic group); --per-replica (the group keeps the
// per-replica batch, 8 rows of the 24, and scales the learning rate by each step's rows; the rate
// follows a warmup and cosine schedule (per_replica_schedule) instead of 0.1; every process also
// writes <out>/rows-<pid>.txt, "update rows" per step, its own rows of that update);
// --reference-rows FILE (no fit: a plain LibTorch loop over the same rows in the same order, taking
// as many rows per update as FILE's lines say, at the rate per_replica_schedule(rows trained before
// / 24) x rows / 24, weights to <out>/weights-0.safetensors); --all-die-at K (every slot SIGKILLs
// itself before its step K, once per slot: the whole group lost at once); --timeout-s N (the
// collectives' and joining's timeout, 60 s by default); --shares-every K (shares by speed,
// measured every K steps: FitOptions::balance_shares_every); --straggler-floor F; --row-us US
// (each forward sleeps US microseconds per row, a compute time the share balancer measures);
// --slow SLOT:US (slot SLOT's first process sleeps US per row instead; its restarts, --row-us).
// Prints "slot S pid P" once it has joined.
#include <signal.h>
#include <unistd.h>

#include <fstream>
#include <iomanip>
#include <iostream>
#include <thread>

#include "flotilla/checkpoint/model_checkpoint.h"
#include "flotilla/cluster/cluster_token.h"
#include "flotilla/cluster/resolvers.h"
#include "flotilla/collective/elastic.h"
#include "flotilla/error.h"
#include "flotilla/train/callback.h"
#include "flotilla/train/checkpoint_callbacks.h"
#include "flotilla/train/logging_callbacks.h"
#include "flotilla/train/model.h"
#include "support/signal_once.h"

using namespace flotilla;

namespace {

std::vector<std::int64_t> pending; // the ids of the batch pulled last (the map runs at the pull)
int row_sleep_us = 0;               // --row-us, --slow: the forward's sleep per row

// --fault: where this process kills itself, at most once per fault over all its restarts.
struct Faults {
  std::vector<std::string> armed; // "gather", "validation", "callbacks" at epoch_of[i]
  std::vector<int> epoch_of;
  int epoch = -1; // the epoch in progress, 0-based
  void at(const std::string& where) const {
    for (std::size_t i = 0; i < armed.size(); ++i) {
      if (epoch_of[i] != epoch + 1) continue;
      if (armed[i] == where) ::raise(SIGKILL);
      if (armed[i] == where + "-stop") ::raise(SIGSTOP);
    }
  }
};
Faults faults;

class Ledger : public train::Callback {
 public:
  Ledger(std::string path, std::string rows_path, int sleep_ms, int signal_at, int signal,
         int* step)
      : out_(path), sleep_ms_(sleep_ms), signal_at_(signal_at), signal_(signal), step_(step) {
    if (!rows_path.empty()) rows_.open(rows_path);
  }
  void on_epoch_begin(int epoch) override { faults.epoch = epoch; }
  void on_train_batch_begin(std::int64_t) override {
    if (*step_ == signal_at_) ::raise(signal_);
  }
  void on_train_batch_end(std::int64_t batch, const train::Logs&) override {
    out_ << model().current_epoch();
    for (auto id : pending) out_ << ' ' << id;
    out_ << std::endl; // flushed: a killed process's committed steps stay counted
    if (rows_.is_open()) rows_ << model().iterations() << ' ' << pending.size() << std::endl;
    ++*step_;
    std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms_));
    // After the sleep: the others have long completed this step and wait in the gather.
    if (batch + 1 == params().steps) faults.at("gather");
  }
  void on_epoch_end(int, train::EpochLogs&) override { faults.at("callbacks"); }

 private:
  std::ofstream out_, rows_;
  int sleep_ms_, signal_at_, signal_;
  int* step_;
};

// --per-replica's schedule: 10 updates' warmup from 0.02 to 0.1, then a cosine decay over 30.
train::CosineDecay per_replica_schedule() {
  return train::CosineDecay({0.02, 30, 0.1, 0.1, 10});
}

// --reference-rows: the model, the data and the optimizer of the fit below, trained by hand.
int reference_by_rows(const std::string& schedule_path, const std::string& out, int epochs,
                      const data::Dataset& dataset, torch::nn::Sequential net) {
  std::vector<std::int64_t> schedule;
  std::ifstream in(schedule_path);
  for (std::int64_t rows; in >> rows;) schedule.push_back(rows);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  const train::CosineDecay rate = per_replica_schedule();
  std::size_t update = 0;
  std::int64_t trained = 0; // rows
  for (int epoch = 0; epoch < epochs; ++epoch) {
    std::vector<torch::Tensor> xs, ys; // the epoch's rows in the order of its global batches
    data::Iterator pass = dataset.make_iterator();
    while (auto e = pass.next()) {
      xs.push_back((*e)[0]);
      ys.push_back((*e)[1]);
    }
    const torch::Tensor x = torch::cat(xs), y = torch::cat(ys);
    for (std::int64_t at = 0; at < x.size(0); ++update) {
      if (update >= schedule.size() || at + schedule[update] > x.size(0)) {
        std::cerr << "error: the schedule does not cover epoch " << epoch + 1 << std::endl;
        return 1;
      }
      const std::int64_t rows = schedule[update];
      sgd.zero_grad();
      const torch::Tensor loss = torch::nn::functional::cross_entropy(
          net->forward(x.narrow(0, at, rows)), y.narrow(0, at, rows),
          torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
      (loss / static_cast<double>(rows)).backward();
      for (auto& group : sgd.param_groups()) {
        group.options().set_lr(rate(trained / 24) * static_cast<double>(rows) / 24.0);
      }
      sgd.step();
      at += rows;
      trained += rows;
    }
  }
  if (update != schedule.size()) {
    std::cerr << "error: " << schedule.size() - update << " updates of the schedule left over"
              << std::endl;
    return 1;
  }
  checkpoint::save_safetensors(out + "/weights-0.safetensors", checkpoint::model_state(*net));
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  std::string out = ".", signal_once, backup_dir, reference_rows, weights, csv;
  int epochs = 4, sleep_ms = 0, signal_slot = -1, signal_at = -1, signal = SIGKILL, all_die_at = -1;
  bool reference = false, batchnorm = false, evaluate = false, per_replica = false;
  int timeout_s = 60, shares_every = 0;
  double straggler_floor = 0.1;
  std::string slow;
  std::vector<std::string> fault_flags;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--reference" || flag == "--batchnorm" || flag == "--evaluate" ||
        flag == "--per-replica") {
      (flag == "--reference"   ? reference
       : flag == "--batchnorm" ? batchnorm
       : flag == "--evaluate"  ? evaluate
                               : per_replica) = true;
      continue;
    }
    if (i + 1 >= argc) break;
    const std::string value = argv[++i];
    if (flag == "--out") out = value;
    if (flag == "--epochs") epochs = std::stoi(value);
    if (flag == "--sleep-ms") sleep_ms = std::stoi(value);
    if (flag == "--signal-slot") signal_slot = std::stoi(value);
    if (flag == "--signal-at") signal_at = std::stoi(value);
    if (flag == "--signal-once") signal_once = value;
    if (flag == "--backup-dir") backup_dir = value;
    if (flag == "--weights") weights = value;
    if (flag == "--csv") csv = value;
    if (flag == "--signal") signal = value == "STOP" ? SIGSTOP : SIGKILL;
    if (flag == "--fault") fault_flags.push_back(value);
    if (flag == "--reference-rows") reference_rows = value;
    if (flag == "--all-die-at") all_die_at = std::stoi(value);
    if (flag == "--timeout-s") timeout_s = std::stoi(value);
    if (flag == "--shares-every") shares_every = std::stoi(value);
    if (flag == "--straggler-floor") straggler_floor = std::stod(value);
    if (flag == "--row-us") row_sleep_us = std::stoi(value);
    if (flag == "--slow") slow = value;
  }
  try {
    at::set_num_threads(1);
    const auto env = cluster::Environment::from_process();
    collective::CommunicationOptions options;
    options.timeout = std::chrono::seconds(timeout_s);
    options.heartbeat_interval = std::chrono::milliseconds(200);
    options.heartbeat_timeout = std::chrono::seconds(2);
    if (!reference_rows.empty()) reference = true;
    strategy::ElasticOptions elastic;
    elastic.enabled = !reference;
    if (per_replica) elastic.batch = strategy::ElasticOptions::Batch::kPerReplica;
    options.cluster_token = cluster::cluster_token(env);
    const auto spec = reference ? cluster::single_worker() : cluster::resolve_cluster(env);
    strategy::MultiWorkerMirroredStrategy strategy(spec, options, 1, elastic);
    const int slot = reference ? 0 : strategy.elastic()->slot();
    std::cout << "slot " << slot << " pid " << ::getpid() << std::endl;
    signal_at = testing::armed_signal_step(signal_at, signal_slot, slot, signal_once);
    if (all_die_at >= 0) {
      signal_at = testing::armed_signal_step(all_die_at, -1, slot,
                                             out + "/all-die-" + std::to_string(slot));
    }
    if (!slow.empty()) { // SLOT:US, the slot's first process only
      const auto colon = slow.find(':');
      if (testing::armed_signal_step(0, std::stoi(slow.substr(0, colon)), slot,
                                     out + "/slow-once") == 0) {
        row_sleep_us = std::stoi(slow.substr(colon + 1));
      }
    }
    for (std::size_t i = 0; i < fault_flags.size(); ++i) {
      const std::string& f = fault_flags[i]; // SLOT:WHERE:EPOCH
      const auto a = f.find(':'), b = f.rfind(':');
      if (testing::armed_signal_step(0, std::stoi(f.substr(0, a)), slot,
                                     out + "/fault-" + std::to_string(i)) == 0) {
        faults.armed.push_back(f.substr(a + 1, b - a - 1));
        faults.epoch_of.push_back(std::stoi(f.substr(b + 1)));
      }
    }
    auto net = strategy.scope([batchnorm] {
      torch::manual_seed(7);
      torch::nn::Sequential layers(torch::nn::Linear(8, 16));
      if (batchnorm) layers->push_back(torch::nn::BatchNorm1d(16));
      layers->push_back(torch::nn::ReLU());
      layers->push_back(torch::nn::Linear(16, 3));
      // Last, so the layers' names stay those of the reference run's: --row-us's compute time.
      layers->push_back(torch::nn::Functional([](const torch::Tensor& x) {
        if (row_sleep_us > 0) {
          std::this_thread::sleep_for(std::chrono::microseconds(row_sleep_us * x.size(0)));
        }
        return x;
      }));
      return layers;
    });
    // 240 rows, 4 epochs of 10 global batches of 24; the order reshuffled every epoch.
    torch::manual_seed(11);
    const auto x = torch::randn({240, 8});
    const auto y = torch::randint(0, 3, {240});
    const auto ids = torch::arange(240, torch::kFloat32).unsqueeze(1);
    const auto dataset =
        data::Dataset::from_tensor_slices({torch::cat({x, ids}, 1), y})
            .shuffle(240, 5)
            .batch(24)
            .map([](data::Element e) {
              const auto id = e[0].select(1, 8).to(torch::kInt64).contiguous();
              pending.assign(id.data_ptr<std::int64_t>(), id.data_ptr<std::int64_t>() + id.numel());
              return data::Element{e[0].narrow(1, 0, 8).contiguous(), e[1]};
            });
    // Validation after every epoch: 96 other rows, 4 global batches.
    const auto vx = torch::randn({96, 8});
    const auto vy = torch::randint(0, 3, {96});
    if (!reference_rows.empty())
      return reference_by_rows(reference_rows, out, epochs, dataset, net);
    train::Model model(strategy, net);
    train::CompileOptions compile;
    compile.optimizer = train::OptimizerOptions::sgd(0.1, 0.9);
    if (per_replica) {
      compile.optimizer.schedule = std::make_shared<train::CosineDecay>(per_replica_schedule());
    }
    model.compile(compile);
    int step = 0;
    train::FitOptions fit;
    fit.validation_data =
        data::Dataset::from_tensor_slices({vx, vy}).batch(24).map([](data::Element e) {
          faults.at("validation");
          return e;
        });
    fit.epochs = epochs;
    fit.balance_shares_every = shares_every;
    fit.straggler_floor = straggler_floor;
    fit.verbose = train::Verbosity::kOneLinePerEpoch; // the chief's, whoever it is
    fit.callbacks.push_back(std::make_shared<Ledger>(
        out + "/ledger-" + std::to_string(::getpid()) + ".txt",
        per_replica ? out + "/rows-" + std::to_string(::getpid()) + ".txt" : std::string(),
        sleep_ms, signal_at, signal, &step));
    if (!csv.empty()) fit.callbacks.push_back(std::make_shared<train::CSVLogger>(csv));
    if (!weights.empty()) { // ModelCheckpoint's weights at every epoch's end, fenced
      train::ModelCheckpointOptions checkpoints;
      checkpoints.filepath = weights;
      checkpoints.save_weights_only = true;
      fit.callbacks.push_back(std::make_shared<train::ModelCheckpoint>(checkpoints));
    }
    if (!backup_dir.empty()) {
      train::BackupOptions backup;
      backup.backup_dir = backup_dir;
      backup.save_freq = 4;
      fit.callbacks.push_back(std::make_shared<train::BackupAndRestore>(backup));
    }
    const train::History history = model.fit(dataset, fit);
    std::ofstream val(out + "/val-" + std::to_string(slot) + ".txt");
    for (const auto& logs : history.epochs) {
      val << logs.epoch << ' ' << std::setprecision(9) << logs.values.get("val_loss").value_or(-1)
          << '\n';
    }
    checkpoint::save_safetensors(out + "/weights-" + std::to_string(slot) + ".safetensors",
                                 checkpoint::model_state(*net));
    std::cout << "slot " << slot << " finished at update " << model.iterations() << " with "
              << strategy.num_workers() << " workers" << std::endl;
    if (evaluate) {
      faults.epoch = epochs; // --fault S:validation:<epochs + 1> fires in here, not in the fit
      const train::EvalResult result = model.evaluate(*fit.validation_data);
      std::ofstream(out + "/eval-" + std::to_string(slot) + ".txt")
          << std::setprecision(9) << result.loss() << ' ' << result.samples << '\n';
      faults.epoch = epochs + 1;
      const torch::Tensor outputs = model.predict(*fit.validation_data);
      checkpoint::save_safetensors(out + "/predict-" + std::to_string(slot) + ".safetensors",
                                   {{"outputs", outputs}});
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return exit_code(e);
  }
}
