// Uneven input (FILE shards of different lengths, per-worker pipelines): every batch of every
// worker is trained on once, as tf.distribute's get-next-as-optional does; predict() across
// workers; LearningRateScheduler.
#include <gtest/gtest.h>

#include <torch/nn.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <mutex>
#include <thread>

#include "flotilla/data/csv.h"
#include "flotilla/data/tfrecord.h"
#include "flotilla/error.h"
#include "flotilla/strategy/strategy.h"
#include "flotilla/train/callbacks.h"
#include "flotilla/train/model.h"
#include "support/compare.h"
#include "support/ranks.h"
#include "support/subprocess.h"

namespace flotilla {
namespace {

using testing::max_relative_difference;
using testing::run_ranks;
using testing::thread_cluster;

std::mutex build_mutex; // ranks are threads sharing torch's generator

torch::nn::Sequential small_net() {
  std::lock_guard<std::mutex> lock(build_mutex);
  torch::manual_seed(21);
  auto m =
      torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 3));
  m->to(torch::kFloat64); // the comparisons test the algorithm, not float32 rounding
  return m;
}

// Rows of 4 features and a label in 0..2; the features float32 values (as the CSV reader
// parses them), held in float64.
data::Element rows(std::int64_t n, std::uint64_t seed) {
  std::lock_guard<std::mutex> lock(build_mutex);
  torch::manual_seed(seed);
  return {torch::randn({n, 4}).to(torch::kFloat64), torch::randint(0, 3, {n}, torch::kLong)};
}

data::Element slice(const data::Element& e, std::int64_t begin, std::int64_t end) {
  return {e[0].slice(0, begin, end), e[1].slice(0, begin, end)};
}

data::Element cat(const data::Element& a, const data::Element& b) {
  return {torch::cat({a[0], b[0]}), torch::cat({a[1], b[1]})};
}

struct Result {
  std::vector<torch::Tensor> parameters;
  double samples = 0; // trained on in the epoch, globally
  double loss = 0;
};

Result fit_once(strategy::Strategy& s, const data::DistributedDataset& input) {
  auto net = s.scope(small_net);
  train::Model model(s, net);
  train::CompileOptions compile;
  compile.optimizer.learning_rate = 0.1;
  model.compile(compile);
  train::FitOptions fit;
  fit.verbose = train::Verbosity::kSilent;
  const auto history = model.fit(input, fit);
  Result r;
  for (const auto& p : net->parameters()) r.parameters.push_back(p.detach().clone());
  const auto& epoch = history.epochs.at(0);
  r.samples = epoch.samples_per_s * epoch.seconds;
  r.loss = epoch.values.at("loss");
  return r;
}

// Worker 0 has 40 rows (5 batches of 8), worker 1 has 24 (3 batches): one worker stepping on
// the union of each step's batches is the reference — steps 1-3 on 16 rows, 4-5 on 8.
TEST(UnevenInput, EveryBatchOfEveryWorkerIsTrainedOnOnce) {
  const data::Element first = rows(40, 1), second = rows(24, 2);
  data::Element joined = cat(slice(first, 0, 8), slice(second, 0, 8));
  for (int k = 1; k < 3; ++k) {
    joined = cat(joined, cat(slice(first, 8 * k, 8 * k + 8), slice(second, 8 * k, 8 * k + 8)));
  }
  Result single;
  run_ranks(1, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 1), comm);
    const auto input = data::Dataset::from_tensor_slices(joined).batch(16).concatenate(
        data::Dataset::from_tensor_slices(slice(first, 24, 40)).batch(8));
    single = fit_once(s, data::distribute_dataset(input, s.input_context()));
  });
  ASSERT_DOUBLE_EQ(std::round(single.samples), 64);

  // FILE shards of different lengths: CSV files, one per worker.
  testing::TempDir dir;
  for (int w = 0; w < 2; ++w) {
    const data::Element& e = w == 0 ? first : second;
    std::ofstream out(dir.path() + "/shard-" + std::to_string(w) + ".csv");
    out.precision(17);
    for (std::int64_t i = 0; i < e[0].size(0); ++i) {
      for (std::int64_t j = 0; j < 4; ++j) out << e[0][i][j].item<double>() << ",";
      out << e[1][i].item<std::int64_t>() << "\n";
    }
  }
  data::CsvOptions csv;
  csv.column_types = {4, data::ColumnType::kFloat};
  csv.column_types.push_back(data::ColumnType::kInt64);
  csv.header = false;
  csv.label_column = 4;
  const auto files =
      data::Dataset::list_files(dir.path() + "/shard-*.csv", false)
          .interleave(
              [csv](const data::Element& f) {
                return data::csv_dataset({data::to_string(f[0])}, csv).map([](data::Element e) {
                  return data::Element{e[0].to(torch::kFloat64), e[1]};
                });
              },
              1)
          .batch(16);
  std::vector<Result> sharded(2), pipelines(2);
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 2), comm);
    const auto input = data::distribute_dataset(files, s.input_context());
    EXPECT_EQ(input.sharding(), "FILE");
    sharded[rank] = fit_once(s, input);
  });
  // Per-worker pipelines (distribute_datasets_from_function) of different lengths.
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 2), comm);
    pipelines[rank] = fit_once(s, data::distribute_datasets_from_function(
                                      [&](const strategy::InputContext& c) {
                                        return data::Dataset::from_tensor_slices(
                                                   c.input_pipeline_id == 0 ? first : second)
                                            .batch(c.get_per_replica_batch_size(16));
                                      },
                                      s.input_context()));
  });
  for (const auto* run : {&sharded, &pipelines}) {
    const Result& r = (*run)[0];
    EXPECT_DOUBLE_EQ(std::round(r.samples), 64); // none lost, none twice
    EXPECT_NEAR(r.loss, single.loss, 1e-12);
    EXPECT_LT(max_relative_difference(r.parameters, single.parameters), 1e-12);
    EXPECT_LT(max_relative_difference((*run)[1].parameters, r.parameters), 1e-15);
  }
}

// Workers holding different shares of each global batch (an elastic group's uneven split: 32
// rows over 3 workers is 10/11/11, the short last batch of 10 is 3/3/4): each worker's gradient
// counts in proportion to its rows, so the step is the one-worker step on the whole batch.
TEST(UnevenInput, WorkersWithDifferentSharesOfEachGlobalBatchTrainAsOne) {
  const data::Element all = rows(106, 3);
  const auto input = [&] { return data::Dataset::from_tensor_slices(all).batch(32); };
  Result single;
  run_ranks(1, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 1), comm);
    single = fit_once(s, data::distribute_dataset(input(), s.input_context()));
  });
  std::vector<Result> split(3);
  run_ranks(3, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 3), comm);
    auto context = s.input_context();
    context.uneven_split = true;
    split[rank] = fit_once(s, data::distribute_dataset(input(), context));
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_DOUBLE_EQ(std::round(split[r].samples), 106) << r;
    EXPECT_NEAR(split[r].loss, single.loss, 1e-12) << r;
    EXPECT_LT(max_relative_difference(split[r].parameters, single.parameters), 1e-12) << r;
  }
}

// Shares by speed, measured (FitOptions::balance_shares_every): worker 1's forward sleeps 0.3 ms
// a row, so it is many times slower than worker 0. Within the first measured interval (steps
// 6-10 of 40, every 5 steps) its share of each global batch of 24 shrinks to a few rows, and
// stays there; every row is still trained on exactly once per epoch (the ids each forward saw),
// and both workers end with the same weights.
thread_local bool slow_forward = false;
thread_local std::vector<std::int64_t>* seen_ids = nullptr;
struct IdNetImpl : torch::nn::Module {
  torch::nn::Linear fc{nullptr};
  IdNetImpl() { fc = register_module("fc", torch::nn::Linear(4, 3)); }
  torch::Tensor forward(const torch::Tensor& x) {
    // Column 4 is the row's id, not a feature.
    const torch::Tensor ids = x.select(1, 4).to(torch::kInt64).contiguous();
    if (seen_ids) {
      seen_ids->insert(seen_ids->end(), ids.data_ptr<std::int64_t>(),
                       ids.data_ptr<std::int64_t>() + ids.numel());
    }
    if (slow_forward) std::this_thread::sleep_for(std::chrono::microseconds(300 * x.size(0)));
    return fc(x.narrow(1, 0, 4));
  }
};
TORCH_MODULE(IdNet);

// Rank `rank` of 2 (worker 1 slow in its forward) fits an IdNet on 240 rows with their ids, in
// global batches of 24 (shuffled when `shuffle`), recording the ids its forward saw in `seen`.
IdNet fit_id_net(strategy::Strategy& s, int rank, train::FitOptions fit, bool shuffle,
                 std::vector<std::int64_t>& seen) {
  const data::Element data = rows(240, 3);
  const torch::Tensor ids = torch::arange(240, torch::kFloat64).unsqueeze(1);
  slow_forward = rank == 1;
  seen_ids = &seen;
  auto net = s.scope([] {
    std::lock_guard<std::mutex> lock(build_mutex);
    torch::manual_seed(21);
    IdNet m;
    m->to(torch::kFloat64);
    return m;
  });
  train::Model model(s, net);
  model.compile({});
  fit.verbose = train::Verbosity::kSilent;
  data::Dataset input = data::Dataset::from_tensor_slices({torch::cat({data[0], ids}, 1), data[1]});
  if (shuffle) input = input.shuffle(240, 7);
  model.fit(input.batch(24), fit);
  seen_ids = nullptr;
  return net;
}

TEST(SharesBySpeed, ASlowWorkersShareShrinksAndEveryRowIsTrainedOnOncePerEpoch) {
  constexpr int kEpochs = 4;
  std::vector<std::vector<std::int64_t>> shares(2);
  std::vector<std::vector<std::int64_t>> seen(2);
  std::vector<std::vector<torch::Tensor>> weights(2);
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 2), comm);
    train::FitOptions fit;
    fit.epochs = kEpochs;
    fit.balance_shares_every = 5;
    const IdNet net = fit_id_net(s, rank, fit, true, seen[static_cast<std::size_t>(rank)]);
    shares[static_cast<std::size_t>(rank)] = s.shares();
    for (const auto& p : net->parameters()) {
      weights[static_cast<std::size_t>(rank)].push_back(p.detach().clone());
    }
  });
  ASSERT_EQ(shares[0].size(), 2u);
  EXPECT_EQ(shares[0], shares[1]);
  EXPECT_EQ(shares[0][0] + shares[0][1], 24); // rows of each global batch
  EXPECT_LE(shares[0][1], 4) << "worker 1's rows";
  // Worker 1 saw fewer rows than worker 0, and together they saw every row once per epoch.
  EXPECT_LT(seen[1].size(), seen[0].size() / 2);
  std::vector<std::int64_t> all = seen[0];
  all.insert(all.end(), seen[1].begin(), seen[1].end());
  std::sort(all.begin(), all.end());
  ASSERT_EQ(all.size(), 240u * kEpochs);
  for (std::size_t i = 0; i < all.size(); ++i) {
    EXPECT_EQ(all[i], static_cast<std::int64_t>(i / kEpochs)) << i;
    if (all[i] != static_cast<std::int64_t>(i / kEpochs)) break;
  }
  for (std::size_t i = 0; i < weights[0].size(); ++i) {
    EXPECT_TRUE(torch::equal(weights[0][i], weights[1][i])) << "parameter " << i;
  }
}

// Advice only (FitOptions::advise_shares_every, `flotilla train`'s default with equal shares):
// the same measurement, worker 1 as slow as above, changes nothing (each worker trains on 12 rows
// of every global batch of 24), and the chief says once what --shares auto would gain.
TEST(SharesBySpeed, AdviceMeasuresAndSaysWhatAutoWouldGainButChangesNothing) {
  std::vector<std::vector<std::int64_t>> shares(2);
  std::vector<std::vector<std::int64_t>> seen(2);
  ::testing::internal::CaptureStderr();
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 2), comm);
    train::FitOptions fit;
    fit.epochs = 2;
    fit.advise_shares_every = 5;
    fit_id_net(s, rank, fit, false, seen[static_cast<std::size_t>(rank)]);
    shares[static_cast<std::size_t>(rank)] = s.shares();
  });
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(shares[0].empty() && shares[1].empty());
  EXPECT_EQ(seen[0].size(), 240u);
  EXPECT_EQ(seen[1].size(), 240u);
  const std::string said = "shares by speed (FitOptions::balance_shares_every) would divide each "
                           "global batch ";
  const auto at = log.find(said);
  ASSERT_NE(at, std::string::npos) << log;
  EXPECT_EQ(log.find(said, at + 1), std::string::npos) << "said once\n" << log;
  EXPECT_NE(log.find("[worker 0/2] shares: the workers' compute per row differs"),
            std::string::npos)
      << log;
}

// Where shares by speed cannot divide the global batches (here an input whose auto-sharding is
// OFF: every worker reads all of it), fit() refuses them at its start with the reason, and the
// advice (which would measure for nothing there) is not refused; on DATA sharding the reason is
// empty.
TEST(SharesBySpeed, AnInputNotShardedByDataIsRefusedWithTheReason) {
  std::vector<std::string> reasons(2), refusals(2);
  std::vector<std::string> data_reasons(2, "unset");
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 2), comm);
    const data::Dataset batches = data::Dataset::from_tensor_slices(rows(48, 5)).batch(8);
    data::Options off;
    off.distribute.auto_shard_policy = data::AutoShardPolicy::kOff;
    const auto unsharded = data::distribute_dataset(batches.with_options(off), s.input_context());
    reasons[rank] = train::why_no_shares_by_speed(s, unsharded);
    data_reasons[rank] =
        train::why_no_shares_by_speed(s, data::distribute_dataset(batches, s.input_context()));
    auto net = s.scope(small_net);
    train::Model model(s, net);
    model.compile({});
    train::FitOptions fit;
    fit.verbose = train::Verbosity::kSilent;
    fit.balance_shares_every = 2;
    try {
      model.fit(unsharded, fit);
    } catch (const ConfigError& e) {
      refusals[rank] = e.what();
    }
    // Advice only: not refused (it stays silent there).
    fit.balance_shares_every = 0;
    fit.advise_shares_every = 1;
    EXPECT_NO_THROW(model.fit(unsharded, fit));
  });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(reasons[rank].find("needs the input sharded by DATA, and this one is sharded OFF"),
              std::string::npos)
        << reasons[rank];
    EXPECT_EQ(refusals[rank], "shares by speed (FitOptions::balance_shares_every) cannot divide "
                              "this fit's global batches: " +
                                  reasons[rank] + "; leave the shares equal");
    EXPECT_EQ(data_reasons[rank], "");
  }
}

TEST(Predict, AcrossWorkersEveryWorkerGetsEveryOutputInTheDatasetsOrder) {
  const data::Element e = rows(37, 3); // batches of 10: the last, 7, splits 4 + 3
  const auto ds = data::Dataset::from_tensor_slices(e).batch(10);
  torch::Tensor single;
  run_ranks(1, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 1), comm);
    train::Model model(s, s.scope(small_net));
    model.compile({});
    single = model.predict(ds);
  });
  ASSERT_EQ(single.sizes(), (std::vector<std::int64_t>{37, 3}));
  std::vector<torch::Tensor> pair(2), uneven(2);
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 2), comm);
    train::Model model(s, s.scope(small_net));
    model.compile({});
    pair[rank] = model.predict(ds);
    // Per-worker pipelines: worker 0 rows 0-19, worker 1 rows 20-29, batches of 5.
    uneven[rank] = model.predict(data::distribute_datasets_from_function(
        [&](const strategy::InputContext& c) {
          return data::Dataset::from_tensor_slices(c.input_pipeline_id == 0 ? slice(e, 0, 20)
                                                                            : slice(e, 20, 30))
              .batch(5);
        },
        s.input_context()));
  });
  for (int w = 0; w < 2; ++w) {
    EXPECT_TRUE(torch::allclose(pair[w], single, 1e-12, 1e-12)) << "worker " << w;
  }
  // Batch by batch, each batch in worker order: w0 0-4, w1 20-24, w0 5-9, w1 25-29, w0 10-19.
  const auto expected =
      torch::cat({single.slice(0, 0, 5), single.slice(0, 20, 25), single.slice(0, 5, 10),
                  single.slice(0, 25, 30), single.slice(0, 10, 20)});
  for (int w = 0; w < 2; ++w) {
    EXPECT_TRUE(torch::allclose(uneven[w], expected, 1e-12, 1e-12)) << "worker " << w;
  }
}

TEST(LearningRateScheduler, EachEpochTrainsAtTheScheduledRate) {
  const data::Element e = rows(64, 4);
  const auto ds = data::Dataset::from_tensor_slices(e).batch(16);
  std::vector<std::vector<torch::Tensor>> scheduled(2), by_hand(2), constant(2);
  std::vector<std::vector<double>> rates(2);
  run_ranks(2, [&](int rank, collective::Communicator& comm) {
    strategy::Strategy s(thread_cluster(rank, 2), comm);
    auto parameters = [](const torch::nn::Sequential& net) {
      std::vector<torch::Tensor> out;
      for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
      return out;
    };
    // One epoch per fit, the rate set by hand before each (divisor 4, or 1: constant).
    auto by_hand_with = [&](double divisor) {
      auto net = s.scope(small_net);
      train::Model model(s, net);
      train::CompileOptions compile;
      compile.optimizer.learning_rate = 0.1;
      model.compile(compile);
      for (int epoch = 0; epoch < 3; ++epoch) {
        if (epoch > 0) model.set_learning_rate(model.learning_rate() / divisor);
        train::FitOptions fit;
        fit.epochs = epoch + 1;
        fit.initial_epoch = epoch;
        fit.verbose = train::Verbosity::kSilent;
        model.fit(ds, fit);
      }
      return parameters(net);
    };
    auto net = s.scope(small_net);
    train::Model model(s, net);
    train::CompileOptions compile;
    compile.optimizer.learning_rate = 0.2; // replaced by the schedule at the first epoch
    model.compile(compile);
    train::FitOptions fit;
    fit.epochs = 3;
    fit.verbose = train::Verbosity::kSilent;
    fit.callbacks = {std::make_shared<train::LearningRateScheduler>(
        [](int epoch, double rate) { return epoch == 0 ? 0.1 : rate / 4; })};
    rates[rank] = model.fit(ds, fit)["learning_rate"];
    scheduled[rank] = parameters(net);
    by_hand[rank] = by_hand_with(4);
    constant[rank] = by_hand_with(1);
  });
  EXPECT_EQ(rates[0], (std::vector<double>{0.1, 0.025, 0.00625}));
  EXPECT_EQ(rates[1], rates[0]);
  for (int w = 0; w < 2; ++w) {
    ASSERT_EQ(scheduled[w].size(), by_hand[w].size());
    for (std::size_t k = 0; k < scheduled[w].size(); ++k) {
      EXPECT_TRUE(torch::equal(scheduled[w][k], by_hand[w][k])) << "worker " << w << " " << k;
    }
  }
  // Control: the rates mattered.
  EXPECT_GT(max_relative_difference(scheduled[0], constant[0]), 1e-3);
}

} // namespace
} // namespace flotilla
