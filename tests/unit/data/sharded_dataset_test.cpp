#include <gtest/gtest.h>

#include <set>

#include "flotilla/data/sharded_dataset.h"
#include "flotilla/error.h"

namespace flotilla::data {
namespace {

// Features are the example ids themselves, so a batch says which examples it holds.
ShardedDataset make(std::int64_t n, int workers, int index, ShardOptions options) {
  auto ids = torch::arange(n, torch::kInt64);
  return ShardedDataset(ids.to(torch::kFloat32), ids,
                        strategy::InputContext{workers, index, workers}, options);
}

std::vector<std::int64_t> ids_of(const Batch& b) {
  auto t = b.labels.contiguous();
  return std::vector<std::int64_t>(t.data_ptr<std::int64_t>(),
                                   t.data_ptr<std::int64_t>() + t.numel());
}

TEST(ShardedDataset, WorkersSeeDisjointSlicesWhoseUnionIsTheGlobalBatch) {
  const ShardOptions options{12, true, 7, true};
  auto single = make(100, 1, 0, options);
  std::vector<ShardedDataset> workers;
  for (int w = 0; w < 3; ++w)
    workers.push_back(make(100, 3, w, options));
  EXPECT_EQ(single.steps_per_epoch(), 8); // 100 / 12, remainder dropped
  std::set<std::int64_t> epoch_ids;
  for (std::int64_t step = 0; step < 8; ++step) {
    auto global = ids_of(single.batch(step));
    std::multiset<std::int64_t> from_workers;
    for (auto& w : workers) {
      const auto part = ids_of(w.batch(step));
      EXPECT_EQ(part.size(), 4u);
      from_workers.insert(part.begin(), part.end());
    }
    EXPECT_EQ(from_workers, std::multiset<std::int64_t>(global.begin(), global.end()));
    epoch_ids.insert(global.begin(), global.end());
  }
  EXPECT_EQ(epoch_ids.size(), 96u); // no example twice in an epoch
}

TEST(ShardedDataset, ShuffleIsSeededPerEpochAndTheSameOnEveryWorker) {
  const ShardOptions options{10, true, 3, true};
  auto a = make(50, 2, 0, options);
  auto b = make(50, 2, 0, options);
  EXPECT_EQ(ids_of(a.batch(0)), ids_of(b.batch(0)));
  const auto epoch0 = ids_of(a.batch(0));
  a.set_epoch(1);
  EXPECT_NE(ids_of(a.batch(0)), epoch0);
  a.set_epoch(0);
  EXPECT_EQ(ids_of(a.batch(0)), epoch0);
  auto other_seed = make(50, 2, 0, ShardOptions{10, true, 4, true});
  EXPECT_NE(ids_of(other_seed.batch(0)), epoch0);
}

TEST(ShardedDataset, KeepRemainderCoversEveryExampleOnce) {
  const ShardOptions options{8, false, 0, false};
  std::multiset<std::int64_t> seen;
  for (int w = 0; w < 2; ++w) {
    auto ds = make(21, 2, w, options);
    EXPECT_EQ(ds.steps_per_epoch(), 3);
    for (std::int64_t s = 0; s < ds.steps_per_epoch(); ++s) {
      const auto ids = ids_of(ds.batch(s));
      seen.insert(ids.begin(), ids.end());
    }
  }
  EXPECT_EQ(seen.size(), 21u);
  EXPECT_EQ(std::set<std::int64_t>(seen.begin(), seen.end()).size(), 21u);
}

TEST(ShardedDataset, TransformAppliesToFeatures) {
  auto ids = torch::arange(10, torch::kInt64);
  ShardedDataset ds(ids, ids, {}, ShardOptions{5, false, 0, true},
                    [](const torch::Tensor& x) { return x * 10; });
  EXPECT_EQ(ds.batch(1).features[0].item<std::int64_t>(), 50);
}

TEST(ShardedDataset, BadBatchesAreConfigErrors) {
  try {
    make(100, 3, 0, ShardOptions{10, true, 0, true});
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()),
              "global batch 10 does not split evenly across 3 replicas; use a multiple of 3");
  }
  try {
    make(5, 1, 0, ShardOptions{8, true, 0, true});
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()),
              "the dataset has 5 examples, fewer than one global batch of 8 with "
              "drop_remainder: lower the batch size");
  }
  auto ds = make(20, 1, 0, ShardOptions{4, true, 0, true});
  EXPECT_THROW(ds.batch(5), ConfigError);
}

} // namespace
} // namespace flotilla::data
