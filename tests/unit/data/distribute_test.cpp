#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <set>

#include "flotilla/data/distribute.h"
#include "flotilla/data/image.h"
#include "flotilla/error.h"

namespace flotilla::data {
namespace {

cluster::InputContext worker(int index, int workers) {
  return cluster::InputContext{workers, index, workers};
}

// Every replica batch of a worker's pass: its ids (component 0) and recorded global sizes.
struct Pass {
  std::vector<std::vector<std::int64_t>> ids;
  std::vector<std::int64_t> global_sizes;
};

Pass run(const DistributedDataset& ds) {
  Pass out;
  auto it = ds.make_iterator();
  while (auto b = it.next()) {
    const auto t = b->element[0].reshape({-1}).contiguous();
    out.ids.emplace_back(t.data_ptr<std::int64_t>(), t.data_ptr<std::int64_t>() + t.numel());
    out.global_sizes.push_back(b->global_batch_size);
  }
  return out;
}

Dataset ids(std::int64_t n) {
  return Dataset::from_tensor_slices({torch::arange(n, torch::kInt64)});
}

TEST(Distribute, APipelineEndingInPrefetchToDeviceDistributesAsOneWithout) {
  // drop_remainder false: a short last global batch (100 = 4 × 24 + 4) is split and its size
  // recorded through the stage too.
  auto make = [](bool to_device) {
    auto ds = Dataset::from_tensor_slices({torch::arange(100, torch::kInt64)})
                  .shuffle(100, 5)
                  .batch(24)
                  .map([](Element e) { return e; }, 2);
    return to_device ? ds.prefetch_to_device(torch::Device(torch::kCPU), 2) : ds;
  };
  std::vector<std::int64_t> seen;
  for (int w = 0; w < 2; ++w) {
    const auto with = distribute_dataset(make(true), worker(w, 2));
    const auto without = distribute_dataset(make(false), worker(w, 2));
    // The batch below the stage was rewritten, not the whole pipeline split at the end.
    EXPECT_NE(with.plan().find("batch(24) rewritten"), std::string::npos) << with.plan();
    // The stage stays last; its fingerprint leaves the device out (each worker prefetches to its
    // own GPU, and must resume from the chief's saved position).
    EXPECT_EQ(with.per_worker().fingerprint().rfind("prefetch_to_device<-[map", 0), 0u)
        << with.per_worker().fingerprint();
    const Pass a = run(with);
    const Pass b = run(without);
    EXPECT_EQ(a.ids, b.ids) << "worker " << w;
    EXPECT_EQ(a.global_sizes, b.global_sizes) << "worker " << w;
    ASSERT_EQ(a.ids.size(), 5u);
    EXPECT_EQ(a.ids[0].size(), 12u);
    EXPECT_EQ(a.ids[4].size(), 2u);
    EXPECT_EQ(a.global_sizes, (std::vector<std::int64_t>{24, 24, 24, 24, 4}));
    for (const auto& ids : a.ids) seen.insert(seen.end(), ids.begin(), ids.end());
  }
  // The two workers' slices partition the data.
  std::sort(seen.begin(), seen.end());
  ASSERT_EQ(seen.size(), 100u);
  for (std::int64_t i = 0; i < 100; ++i) EXPECT_EQ(seen[static_cast<std::size_t>(i)], i);
}

TEST(Distribute, EachWorkerGetsItsSliceOfEveryGlobalBatchAndPreprocessesOnlyThat) {
  std::atomic<std::int64_t> mapped{0};
  // Each worker process builds its own pipeline, so each starts at pass 0.
  auto make = [&] {
    return ids(100)
        .shuffle(100, 3)
        .batch(20, true)
        .map(
            [&](Element e) {
              mapped += e[0].size(0);
              return e;
            },
            kAutotune)
        .prefetch(2);
  };
  const auto single = run(distribute_dataset(make(), worker(0, 1)));
  ASSERT_EQ(single.ids.size(), 5u);
  mapped = 0;
  std::vector<Pass> passes;
  for (int w = 0; w < 2; ++w) {
    const auto ds = distribute_dataset(make(), worker(w, 2));
    EXPECT_NE(ds.plan().find("batch(20) rewritten"), std::string::npos) << ds.plan();
    EXPECT_EQ(ds.cardinality(), 5);
    passes.push_back(run(ds));
  }
  EXPECT_EQ(mapped.load(), 100); // not 200: the map ran on slices
  for (std::size_t step = 0; step < 5; ++step) {
    std::vector<std::int64_t> joined = passes[0].ids[step];
    joined.insert(joined.end(), passes[1].ids[step].begin(), passes[1].ids[step].end());
    EXPECT_EQ(joined, single.ids[step]) << "step " << step; // worker 0 first, in order
    EXPECT_EQ(passes[0].global_sizes[step], 20);
  }
}

// Shares by speed (InputContext::shares 2,1,1): of each global batch of 20, worker 0 keeps rows
// 0-9, worker 1 rows 10-14 and worker 2 rows 15-19, in order, on the gathered path, the element
// path and the fallback split alike; a short last batch (100 = 4 x 24 + 4) divides 2:1:1 too
// (rows 0-1, 2, 3), and every sample is kept by exactly one worker. FILE and OFF sharding,
// per-function datasets and a weight per worker missing are refused.
TEST(Distribute, SharesBySpeedDivideEachGlobalBatchByWeightAndKeepEverySampleOnce) {
  const auto context = [](int w) {
    cluster::InputContext c = worker(w, 3);
    c.shares = {2, 1, 1};
    return c;
  };
  const auto single = run(distribute_dataset(ids(100).shuffle(100, 3).batch(24), worker(0, 1)));
  for (const auto& make : std::vector<std::function<Dataset()>>{
           [] { return ids(100).shuffle(100, 3).batch(24); }, // gathered
           [] { return ids(100).shuffle(100, 3).map([](Element e) { return e; }).batch(24); },
           [] { // no batch to rewrite: split at the end
             return ids(100).shuffle(100, 3).batch(24).filter([](const Element&) { return true; });
           }}) {
    std::vector<Pass> passes;
    for (int w = 0; w < 3; ++w) passes.push_back(run(distribute_dataset(make(), context(w))));
    std::vector<std::int64_t> seen;
    for (std::size_t step = 0; step < passes[0].ids.size(); ++step) {
      const std::size_t rows = step < 4 ? 24 : 4;
      EXPECT_EQ(passes[0].ids[step].size(), rows / 2) << step;
      EXPECT_EQ(passes[1].ids[step].size(), rows / 4) << step;
      EXPECT_EQ(passes[2].ids[step].size(), rows / 4) << step;
      std::vector<std::int64_t> joined;
      for (const Pass& p : passes) {
        joined.insert(joined.end(), p.ids[step].begin(), p.ids[step].end());
        EXPECT_EQ(p.global_sizes[step], static_cast<std::int64_t>(rows));
      }
      if (step < single.ids.size()) EXPECT_EQ(joined, single.ids[step]) << "step " << step;
      seen.insert(seen.end(), joined.begin(), joined.end());
    }
    std::sort(seen.begin(), seen.end());
    ASSERT_EQ(seen.size(), 100u);
    for (std::int64_t i = 0; i < 100; ++i) EXPECT_EQ(seen[static_cast<std::size_t>(i)], i);
  }
  EXPECT_NE(distribute_dataset(ids(100).batch(24), context(1))
                .plan()
                .find("rows 12 to 17 of each global batch (shares 2,1,1)"),
            std::string::npos);
  const auto refused = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  Options off;
  off.distribute.auto_shard_policy = AutoShardPolicy::kOff;
  EXPECT_NE(refused([&] {
              distribute_dataset(ids(100).batch(24).with_options(off), context(0));
            }).find("shares by speed split every global batch"),
            std::string::npos);
  EXPECT_NE(refused([&] {
              distribute_datasets_from_function([](const cluster::InputContext&) { return ids(4); },
                                                context(0));
            }).find("shares by speed"),
            std::string::npos);
  cluster::InputContext two = context(0);
  two.shares = {2, 1};
  EXPECT_NE(refused([&] {
              distribute_dataset(ids(100).batch(24), two);
            }).find("InputContext::shares has 2 weights for 3 workers"),
            std::string::npos);
}

// Slices -> shuffle -> repeat -> batch is gathered by row number on each worker (no tensor per
// element); the batches must be exactly those the element-by-element path makes, across pass
// boundaries, with the short last batch, and in a label column of another dtype.
TEST(Distribute, GatheredRowsEqualTheElementPathAcrossRepeatsAndAShortLastBatch) {
  auto make = [] {
    return Dataset::from_tensor_slices(
               {torch::arange(30, torch::kInt64), torch::arange(30, torch::kFloat32) * 0.5})
        .shuffle(10, 4)
        .repeat(3)
        .batch(8, /*drop_remainder=*/false);
  };
  std::vector<Element> single;
  {
    auto it = make().make_iterator(); // one process, no rewrite: element by element
    while (auto e = it.next()) single.push_back(*e);
  }
  ASSERT_EQ(single.size(), 12u); // 90 elements: 11 batches of 8 and one of 2
  std::vector<std::vector<Element>> workers(2);
  for (int w = 0; w < 2; ++w) {
    auto it = distribute_dataset(make(), worker(w, 2)).make_iterator();
    while (auto b = it.next()) workers[w].push_back(b->element);
    bool gathered = false;
    for (const auto& stage : it.stats()) gathered |= stage.name == "RebatchShard(gathered)";
    EXPECT_TRUE(gathered) << "the rows path was not taken, so nothing was compared";
  }
  ASSERT_EQ(workers[0].size(), single.size());
  ASSERT_EQ(workers[1].size(), single.size());
  for (std::size_t i = 0; i < single.size(); ++i) {
    for (std::size_t c = 0; c < 2; ++c) {
      const auto joined = torch::cat({workers[0][i][c], workers[1][i][c]});
      EXPECT_TRUE(torch::equal(joined, single[i][c])) << "batch " << i << " component " << c;
      EXPECT_EQ(workers[0][i][c].scalar_type(), single[i][c].scalar_type());
    }
  }
  EXPECT_EQ(workers[0].back()[0].size(0), 1); // the short last batch of 2, one each
}

TEST(Distribute, AShortLastBatchIsSplitAsEvenlyAsPossibleAndItsSizeRecorded) {
  auto pipeline = ids(43).batch(20); // 20, 20, 3
  std::vector<Pass> passes;
  for (int w = 0; w < 4; ++w) passes.push_back(run(distribute_dataset(pipeline, worker(w, 4))));
  std::vector<std::int64_t> last;
  for (int w = 0; w < 4; ++w) {
    ASSERT_EQ(passes[w].ids.size(), 3u) << "every worker runs every step";
    EXPECT_EQ(passes[w].ids[0].size(), 5u);
    EXPECT_EQ(passes[w].global_sizes, (std::vector<std::int64_t>{20, 20, 3}));
    last.insert(last.end(), passes[w].ids[2].begin(), passes[w].ids[2].end());
  }
  EXPECT_EQ(passes[0].ids[2].size(), 0u); // 3 elements over 4 replicas: one is empty
  EXPECT_EQ(last, (std::vector<std::int64_t>{40, 41, 42}));
}

TEST(Distribute, WithoutARewritableBatchEveryWorkerSplitsAtTheEnd) {
  // A filter after the batch changes which batch is which: no rewrite, split at the end.
  auto pipeline = ids(40).batch(10).filter([](const Element&) { return true; });
  std::set<std::int64_t> seen;
  for (int w = 0; w < 2; ++w) {
    const auto ds = distribute_dataset(pipeline, worker(w, 2));
    EXPECT_NE(ds.plan().find("no batch found to rewrite"), std::string::npos) << ds.plan();
    const auto pass = run(ds);
    ASSERT_EQ(pass.ids.size(), 4u);
    for (const auto& b : pass.ids) {
      EXPECT_EQ(b.size(), 5u);
      seen.insert(b.begin(), b.end());
    }
    EXPECT_EQ(pass.global_sizes.front(), 10);
  }
  EXPECT_EQ(seen.size(), 40u);
}

TEST(Distribute, OffGivesEveryWorkerEveryElementInPerReplicaBatches) {
  Options options;
  options.distribute.auto_shard_policy = AutoShardPolicy::kOff;
  auto pipeline = ids(40).batch(10).with_options(options);
  for (int w = 0; w < 2; ++w) {
    const auto pass = run(distribute_dataset(pipeline, worker(w, 2)));
    ASSERT_EQ(pass.ids.size(), 8u);
    EXPECT_EQ(pass.ids[1], (std::vector<std::int64_t>{5, 6, 7, 8, 9}));
  }
}

TEST(Distribute, AGlobalBatchThatDoesNotSplitIsRefused) {
  try {
    distribute_dataset(ids(40).batch(10), worker(0, 3));
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()),
              "global batch 10 does not split evenly across 3 replicas; use a multiple of 3");
  }
}

// Elastic: 4 workers train 3 global batches; one leaves, and the 3 left resume the same pass at
// the position the 4 had committed, splitting each global batch of 32 unevenly (10/11/11).
TEST(Distribute, AResplitAtACommittedPositionCoversEverySampleOnce) {
  // One pipeline per "process": each distribution of one Dataset object is a new pass.
  auto make = [] { return ids(300).shuffle(300, 3).batch(32).map([](Element e) { return e; }, 2); };
  auto elastic = [](int index, int workers) {
    auto context = worker(index, workers);
    context.uneven_split = true;
    return context;
  };
  std::vector<std::int64_t> seen;
  IteratorState committed;
  for (int w = 0; w < 4; ++w) {
    auto it = distribute_dataset(make(), elastic(w, 4)).make_iterator();
    for (int step = 0; step < 3; ++step) {
      const auto b = it.next();
      ASSERT_TRUE(b);
      EXPECT_EQ(b->global_batch_size, 32);
      const auto t = b->element[0].contiguous();
      seen.insert(seen.end(), t.data_ptr<std::int64_t>(), t.data_ptr<std::int64_t>() + t.numel());
    }
    if (w == 0) committed = it.save();
    it.next(); // step 4 was pulled on every worker, then a worker died: not committed
  }
  std::vector<std::int64_t> sizes;
  for (int w = 0; w < 3; ++w) {
    const auto ds = distribute_dataset(make(), elastic(w, 3));
    if (w == 2) {
      EXPECT_NE(ds.plan().find("worker 2 of 3 stacks only its rows 21 to 31 of each global "
                               "batch (an uneven split"),
                std::string::npos)
          << ds.plan();
    }
    auto it = ds.make_iterator(committed);
    while (auto b = it.next()) {
      const auto t = b->element[0].contiguous();
      if (w == 0) sizes.push_back(b->global_batch_size);
      if (b->global_batch_size == 32) EXPECT_EQ(t.numel(), w == 0 ? 10 : 11);
      seen.insert(seen.end(), t.data_ptr<std::int64_t>(), t.data_ptr<std::int64_t>() + t.numel());
    }
  }
  // The remaining 6 global batches of 32 and the short last one of 12.
  EXPECT_EQ(sizes, (std::vector<std::int64_t>{32, 32, 32, 32, 32, 32, 12}));
  std::sort(seen.begin(), seen.end());
  std::string dupes;
  for (std::size_t i = 1; i < seen.size(); ++i) {
    if (seen[i] == seen[i - 1]) dupes += std::to_string(seen[i]) + " ";
  }
  EXPECT_EQ(dupes, "") << "repeated samples";
  ASSERT_EQ(seen.size(), 300u) << "a sample lost or repeated";
  for (std::int64_t i = 0; i < 300; ++i) EXPECT_EQ(seen[static_cast<std::size_t>(i)], i);
  // What cannot move mid-epoch is refused by name.
  EXPECT_THROW(distribute_datasets_from_function(
                   [](const cluster::InputContext&) { return ids(8).batch(4); }, elastic(0, 2)),
               ConfigError);
}

// Elastic, keeping the per-replica batch: batch(24) of a 3-worker cluster is a stream of slices
// of 8 rows. Two workers take 16 rows per step; the pass's last step has what is left (12: the
// first worker 8, the second 4). With drop_remainder the rows the full cluster would drop (the
// last 12 of 60) are dropped too. The full cluster would take 3 steps (2 with the drop). Row
// mode (ids) and element mode (a map before the batch).
TEST(Distribute, KeepingThePerReplicaBatchDealsSlicesOfTheFullClusters) {
  const auto keep = [](int index, int workers) {
    auto context = worker(index, workers);
    context.uneven_split = true;
    context.full_replicas = 3;
    return context;
  };
  for (const bool rows : {true, false}) {
    for (const bool drop : {false, true}) {
      Dataset source = ids(60);
      if (!rows) source = source.map([](Element e) { return e; });
      const Dataset pipeline = source.batch(24, drop);
      std::vector<std::int64_t> seen, sizes, mine;
      for (int w = 0; w < 2; ++w) {
        const auto ds = distribute_dataset(pipeline, keep(w, 2));
        EXPECT_EQ(ds.slice_rows(), 8);
        EXPECT_EQ(ds.global_rows(), 24);
        EXPECT_EQ(ds.cardinality(), drop ? 3 : 4);
        // The full cluster's steps, whatever the membership: fit's known steps, the fewest.
        EXPECT_EQ(ds.full_cluster_steps(), drop ? 2 : 3);
        auto it = ds.make_iterator();
        while (auto b = it.next()) {
          const auto t = b->element[0].contiguous();
          seen.insert(seen.end(), t.data_ptr<std::int64_t>(),
                      t.data_ptr<std::int64_t>() + t.numel());
          if (w == 0) sizes.push_back(b->global_batch_size);
          if (w == 1) mine.push_back(t.numel());
        }
      }
      const std::string what = std::string(rows ? "rows" : "elements") + (drop ? ", drop" : "");
      if (drop) {
        EXPECT_EQ(sizes, (std::vector<std::int64_t>{16, 16, 16})) << what;
      } else {
        EXPECT_EQ(sizes, (std::vector<std::int64_t>{16, 16, 16, 12})) << what;
        EXPECT_EQ(mine, (std::vector<std::int64_t>{8, 8, 8, 4})) << what;
      }
      std::sort(seen.begin(), seen.end());
      ASSERT_EQ(seen.size(), drop ? 48u : 60u) << what;
      for (std::size_t i = 0; i < seen.size(); ++i) EXPECT_EQ(seen[i], std::int64_t(i)) << what;
    }
  }
  EXPECT_THROW(distribute_dataset(ids(60).batch(20), keep(0, 2)), ConfigError); // 20 % 3
}

// A pass saved in rows by 3 workers after 2 steps (48 rows) resumes on 2 workers at row 48, and
// one saved in global batches resumes there in rows too; a position between global batches
// cannot resume with the global batch kept, and says why.
TEST(Distribute, APerReplicaPassResumesAtARowOnOtherMembers) {
  const auto context = [](int index, int workers, int full) {
    auto c = worker(index, workers);
    c.uneven_split = true;
    c.full_replicas = full;
    return c;
  };
  const Dataset pipeline = ids(96).shuffle(96, 4).batch(24);
  auto first = distribute_dataset(pipeline, context(0, 3, 3)).make_iterator();
  std::vector<std::int64_t> order; // the rows of the first two steps, workers 0..2
  first.next();
  first.next();
  const IteratorState at48 = first.save();
  EXPECT_TRUE(at48.in_rows);
  EXPECT_EQ(at48.produced, 48);
  // The whole pass's order, for reference: one worker of a 1-worker cluster takes it all.
  auto whole = distribute_dataset(pipeline, context(0, 1, 1))
                   .make_iterator(IteratorState{at48.iteration, 0, at48.fingerprint, true});
  while (auto b = whole.next()) {
    const auto t = b->element[0].contiguous();
    order.insert(order.end(), t.data_ptr<std::int64_t>(), t.data_ptr<std::int64_t>() + t.numel());
  }
  ASSERT_EQ(order.size(), 96u);
  auto second = distribute_dataset(pipeline, context(1, 2, 3)).make_iterator(at48);
  auto b = second.next();
  ASSERT_TRUE(b);
  EXPECT_EQ(b->global_batch_size, 16);
  const auto t = b->element[0].contiguous();
  EXPECT_EQ(std::vector<std::int64_t>(t.data_ptr<std::int64_t>(), t.data_ptr<std::int64_t>() + 8),
            std::vector<std::int64_t>(order.begin() + 56, order.begin() + 64));
  IteratorState at64 = second.save();
  EXPECT_EQ(at64.produced, 64);
  EXPECT_EQ(second.save(/*before_last=*/true).produced, 48);
  // In global batches: 2 of 24 are row 48.
  auto converted = distribute_dataset(pipeline, context(0, 2, 3))
                       .make_iterator(IteratorState{at48.iteration, 2, at48.fingerprint, false});
  const auto c = converted.next()->element[0].contiguous();
  EXPECT_EQ(c[0].item<std::int64_t>(), order[48]);
  // Row 48 is global batch 2 with the global batch kept; row 64 is not a global batch's start.
  auto plain = worker(0, 2);
  plain.uneven_split = true;
  auto resumed = distribute_dataset(pipeline, plain).make_iterator(at48);
  EXPECT_EQ(resumed.next()->element[0].contiguous()[0].item<std::int64_t>(), order[48]);
  // Also where the global batch does not split evenly (24 over 5 workers: 4 or 5 rows each).
  auto uneven = worker(0, 5);
  uneven.uneven_split = true;
  auto five = distribute_dataset(pipeline, uneven).make_iterator(at48);
  EXPECT_EQ(five.next()->element[0].contiguous()[0].item<std::int64_t>(), order[48]);
  try {
    distribute_dataset(pipeline, plain).make_iterator(at64);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("64 rows into the pass"), std::string::npos) << e.what();
  }
}

TEST(Distribute, ADistributedPassResumesOnTheNextBatch) {
  auto pipeline = ids(200).shuffle(50, 1).batch(8, true).map([](Element e) { return e; }, 2);
  const auto ds = distribute_dataset(pipeline, worker(1, 2));
  auto it = ds.make_iterator();
  for (int i = 0; i < 7; ++i) it.next();
  const auto state = it.save();
  std::vector<std::vector<std::int64_t>> rest;
  while (auto b = it.next()) {
    auto t = b->element[0].contiguous();
    rest.emplace_back(t.data_ptr<std::int64_t>(), t.data_ptr<std::int64_t>() + t.numel());
  }
  auto resumed = distribute_dataset(pipeline, worker(1, 2)).make_iterator(state);
  std::vector<std::vector<std::int64_t>> again;
  while (auto b = resumed.next()) {
    auto t = b->element[0].contiguous();
    again.emplace_back(t.data_ptr<std::int64_t>(), t.data_ptr<std::int64_t>() + t.numel());
    EXPECT_EQ(b->global_batch_size, 8);
  }
  EXPECT_EQ(again, rest);
  EXPECT_EQ(rest.size(), 25u - 7u);
}

TEST(Distribute, AStateSavedOnTheChiefResumesOnAnyWorker) {
  auto make = [] { return ids(200).shuffle(50, 1).batch(8, true); }; // one per "process"
  auto chief = distribute_dataset(make(), worker(0, 2)).make_iterator();
  for (int i = 0; i < 7; ++i) chief.next();
  const auto state = chief.save();
  auto uninterrupted = distribute_dataset(make(), worker(1, 2)).make_iterator();
  for (int i = 0; i < 7; ++i) uninterrupted.next();
  auto resumed = distribute_dataset(make(), worker(1, 2)).make_iterator(state);
  for (int i = 0; i < 5; ++i) {
    EXPECT_TRUE(torch::equal(resumed.next()->element[0], uninterrupted.next()->element[0])) << i;
  }
}

TEST(Distribute, EachDistributionOfADatasetIsANewPass) {
  // fit() distributes its dataset on every call: the shuffle must still move on.
  auto pipeline = ids(64).shuffle(64, 2).batch(8, true);
  const auto first = run(distribute_dataset(pipeline, worker(0, 2)));
  const auto second = run(distribute_dataset(pipeline, worker(0, 2)));
  EXPECT_NE(first.ids, second.ids);
}

TEST(Distribute, DataShardingRefusesPipelinesThatDifferAcrossWorkers) {
  try {
    distribute_dataset(ids(40).shuffle(10).batch(4), worker(0, 2));
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()),
              "distribute_dataset: with DATA sharding every worker must build the same global "
              "batches, but a shuffle without a seed draws a new order in every process; give it "
              "one (or shard it yourself with distribute_datasets_from_function)");
  }
}

TEST(Distribute, SlicesKeyedByPositionAugmentLikeTheWholeBatch) {
  // enumerate's positions key each image's draws: the same image gets the same flip and crop
  // whichever worker's slice it lands in.
  auto images = torch::randint(0, 256, {16, 1, 6, 6}, torch::kUInt8);
  auto pipeline = Dataset::from_tensor_slices({images}).enumerate().batch(16);
  auto augment = [](const Element& e) {
    return image::random_crop_with_padding(image::random_flip_left_right(e[1], 5, e[0]), 2, 6,
                                           e[0]);
  };
  const auto whole =
      augment(distribute_dataset(pipeline, worker(0, 1)).make_iterator().next()->element);
  std::vector<torch::Tensor> parts;
  for (int w = 0; w < 4; ++w) {
    parts.push_back(
        augment(distribute_dataset(pipeline, worker(w, 4)).make_iterator().next()->element));
  }
  EXPECT_TRUE(torch::equal(torch::cat(parts), whole));
}

TEST(Distribute, FromAFunctionTheWorkerBuildsItsOwnPipeline) {
  const auto ds = distribute_datasets_from_function(
      [](const cluster::InputContext& ctx) {
        return ids(40)
            .shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
            .batch(ctx.get_per_replica_batch_size(8));
      },
      worker(1, 2));
  const auto pass = run(ds);
  ASSERT_EQ(pass.ids.size(), 5u);
  EXPECT_EQ(pass.ids[0], (std::vector<std::int64_t>{1, 3, 5, 7}));
  EXPECT_EQ(pass.global_sizes[0], 8); // per-replica size x replicas
}

} // namespace
} // namespace flotilla::data
