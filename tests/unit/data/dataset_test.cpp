#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <thread>

#include "flotilla/data/dataset.h"
#include "flotilla/error.h"
#include "support/subprocess.h"

namespace flotilla::data {
namespace {

// The int64 scalars of component `c` of every element, in order.
std::vector<std::int64_t> values(const Dataset& ds, std::size_t c = 0) {
  std::vector<std::int64_t> out;
  for (const Element& e : ds.make_iterator()) {
    const auto flat = e[c].reshape({-1}).contiguous();
    out.insert(out.end(), flat.data_ptr<std::int64_t>(),
               flat.data_ptr<std::int64_t>() + flat.numel());
  }
  return out;
}

std::vector<std::int64_t> iota(std::int64_t a, std::int64_t b) {
  std::vector<std::int64_t> v;
  for (auto i = a; i < b; ++i) v.push_back(i);
  return v;
}

Element plus(Element e, std::int64_t k) {
  e[0] = e[0] + k;
  return e;
}

TEST(Dataset, SlicesBatchAndCardinality) {
  auto x = torch::arange(10, torch::kInt64);
  auto y = torch::arange(10, torch::kInt64) * 10;
  auto ds = Dataset::from_tensor_slices({x, y}).batch(4);
  EXPECT_EQ(ds.cardinality(), 3);
  auto it = ds.make_iterator();
  auto first = it.next();
  ASSERT_TRUE(first);
  EXPECT_TRUE(torch::equal((*first)[0], torch::arange(4, torch::kInt64)));
  EXPECT_TRUE(torch::equal((*first)[1], torch::arange(4, torch::kInt64) * 10));
  it.next();
  auto last = it.next();
  ASSERT_TRUE(last);
  EXPECT_EQ((*last)[0].size(0), 2); // the remainder
  EXPECT_FALSE(it.next());
  EXPECT_EQ(Dataset::from_tensor_slices({x}).batch(4, /*drop_remainder=*/true).cardinality(), 2);
  EXPECT_EQ(values(Dataset::from_tensor_slices({x}).batch(4, true)), iota(0, 8));
}

TEST(Dataset, RangeTakeSkipRepeatEnumerateZipConcatenateFilter) {
  EXPECT_EQ(values(Dataset::range(5)), iota(0, 5));
  EXPECT_EQ(values(Dataset::range(10, 0, -3)), (std::vector<std::int64_t>{10, 7, 4, 1}));
  EXPECT_EQ(Dataset::range(10, 0, -3).cardinality(), 4);
  EXPECT_EQ(values(Dataset::range(10).skip(3).take(4)), iota(3, 7));
  EXPECT_EQ(values(Dataset::range(3).repeat(3)),
            (std::vector<std::int64_t>{0, 1, 2, 0, 1, 2, 0, 1, 2}));
  EXPECT_EQ(Dataset::range(3).repeat(3).cardinality(), 9);
  EXPECT_EQ(Dataset::range(3).repeat().cardinality(), kInfiniteCardinality);
  EXPECT_EQ(values(Dataset::range(3).repeat().take(7)).size(), 7u);
  EXPECT_EQ(values(Dataset::range(0).repeat()).size(), 0u); // an empty repeat ends
  EXPECT_EQ(values(Dataset::range(10, 13).enumerate(), 0), iota(0, 3));
  EXPECT_EQ(values(Dataset::range(10, 13).enumerate(), 1), iota(10, 13));
  auto zipped = Dataset::zip({Dataset::range(5), Dataset::range(100, 103)});
  EXPECT_EQ(zipped.cardinality(), 3);
  EXPECT_EQ(values(zipped, 1), iota(100, 103));
  EXPECT_EQ(values(Dataset::range(2).concatenate(Dataset::range(5, 7))),
            (std::vector<std::int64_t>{0, 1, 5, 6}));
  auto even = Dataset::range(10).filter(
      [](const Element& e) { return e[0].item<std::int64_t>() % 2 == 0; });
  EXPECT_EQ(values(even), (std::vector<std::int64_t>{0, 2, 4, 6, 8}));
  EXPECT_EQ(even.cardinality(), kUnknownCardinality);
}

TEST(Dataset, ShardsAreDisjointAndCoverTheSet) {
  std::multiset<std::int64_t> all;
  for (int i = 0; i < 3; ++i) {
    auto shard = Dataset::range(20).shard(3, i);
    const auto v = values(shard);
    EXPECT_EQ(static_cast<std::int64_t>(v.size()), shard.cardinality());
    for (auto x : v) EXPECT_EQ(x % 3, i);
    all.insert(v.begin(), v.end());
  }
  const auto expected = iota(0, 20);
  EXPECT_EQ(all, std::multiset<std::int64_t>(expected.begin(), expected.end()));
  EXPECT_THROW(Dataset::range(5).shard(2, 2), ConfigError);
}

TEST(Dataset, ParallelMapKeepsOrderAndEqualsTheSequentialMap) {
  auto fn = [](Element e) {
    std::this_thread::sleep_for(std::chrono::microseconds(50 * (e[0].item<std::int64_t>() % 7)));
    return plus(std::move(e), 1000);
  };
  const auto sequential = values(Dataset::range(200).map(fn));
  EXPECT_EQ(sequential, iota(1000, 1200));
  EXPECT_EQ(values(Dataset::range(200).map(fn, 4)), sequential);
  EXPECT_EQ(values(Dataset::range(200).map(fn, kAutotune)), sequential);
  auto loose = values(Dataset::range(200).map(fn, 4, /*deterministic=*/false));
  std::sort(loose.begin(), loose.end());
  EXPECT_EQ(loose, sequential); // same elements, any order
}

TEST(Dataset, ParallelBatchAndPrefetchChangeNothingButSpeed) {
  auto base = Dataset::range(103).map([](Element e) { return plus(std::move(e), 1); });
  const auto plain = values(base.batch(10));
  EXPECT_EQ(values(base.batch(10, false, 3)), plain);
  EXPECT_EQ(values(base.batch(10, false, kAutotune).prefetch(kAutotune)), plain);
  EXPECT_EQ(values(base.map([](Element e) { return e; }, 3).prefetch(2)), iota(1, 104));
  EXPECT_EQ(values(base.batch(10, true, 3)).size(), 100u);
}

TEST(Dataset, SeededShuffleIsReproduciblePerIterationAndAPermutation) {
  auto ds = Dataset::range(100).shuffle(30, 7);
  const auto pass0 = values(ds);
  const auto pass1 = values(ds); // the next iteration of the same dataset: a new order
  EXPECT_NE(pass0, iota(0, 100));
  EXPECT_NE(pass0, pass1);
  EXPECT_EQ(std::set<std::int64_t>(pass0.begin(), pass0.end()).size(), 100u);
  auto again = Dataset::range(100).shuffle(30, 7); // a rebuilt pipeline, same seed
  EXPECT_EQ(values(again), pass0);
  EXPECT_EQ(values(again), pass1);
  auto fixed = Dataset::range(100).shuffle(30, 7, /*reshuffle_each_iteration=*/false);
  EXPECT_EQ(values(fixed), values(fixed));
  EXPECT_NE(values(Dataset::range(100).shuffle(30, 8)), pass0);
  EXPECT_EQ(values(Dataset::range(100).shuffle(1, 7)), iota(0, 100));
  // Shuffle then repeat: each repetition is reshuffled.
  const auto twice = values(Dataset::range(50).shuffle(50, 3).repeat(2));
  EXPECT_NE(std::vector<std::int64_t>(twice.begin(), twice.begin() + 50),
            std::vector<std::int64_t>(twice.begin() + 50, twice.end()));
}

TEST(Dataset, MemoryCacheReplaysWithoutRunningTheInputAgain) {
  std::atomic<int> calls{0};
  auto ds = Dataset::range(20)
                .map([&](Element e) {
                  ++calls;
                  return plus(std::move(e), 1);
                })
                .cache();
  EXPECT_EQ(values(ds), iota(1, 21));
  EXPECT_EQ(calls.load(), 20);
  EXPECT_EQ(values(ds), iota(1, 21));
  EXPECT_EQ(calls.load(), 20); // served from memory
  // A pass that stops early leaves no partial cache.
  std::atomic<int> calls2{0};
  auto partial = Dataset::range(10)
                     .map([&](Element e) {
                       ++calls2;
                       return e;
                     })
                     .cache();
  EXPECT_EQ(values(partial.take(3)).size(), 3u);
  EXPECT_EQ(values(partial), iota(0, 10));
  EXPECT_EQ(values(partial), iota(0, 10));
  EXPECT_EQ(calls2.load(), 3 + 10);
}

TEST(Dataset, FileCacheSurvivesARestartAndIsRebuiltWhenItsSourceChanges) {
  testing::TempDir dir;
  const std::string file = dir.path() + "/train";
  std::atomic<int> calls{0};
  auto build = [&](std::int64_t n) {
    return Dataset::from_tensor_slices({torch::arange(n, torch::kInt64)})
        .map([&](Element e) {
          ++calls;
          return plus(std::move(e), 5);
        })
        .cache(file);
  };
  {
    auto ds = build(30);
    auto it = ds.make_iterator();
    it.next(); // a pass that stops early writes nothing
  }
  EXPECT_FALSE(std::filesystem::exists(file + ".flotilla-cache"));
  EXPECT_EQ(values(build(30)), iota(5, 35));
  EXPECT_TRUE(std::filesystem::exists(file + ".flotilla-cache"));
  calls = 0;
  EXPECT_EQ(values(build(30)), iota(5, 35)); // "after a restart": a new pipeline object
  EXPECT_EQ(calls.load(), 0);
  EXPECT_EQ(values(build(31)), iota(5, 36)); // different data: rebuilt
  EXPECT_EQ(calls.load(), 31);
  // Nothing half-written is ever left under the cache's name.
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    EXPECT_EQ(e.path().filename().string(), "train.flotilla-cache");
  }
}

// A cache file is read back from a directory others may write (or a disk that damaged it): its
// headers are checked before anything is allocated from them. Before, a dimension of 2^62 went
// straight to torch::empty (a c10::Error from the allocator, not a DataError), a negative one or
// an unknown dtype code likewise, and a claimed length was read into a buffer of that size.
TEST(Dataset, ACorruptCacheFileIsADataErrorBeforeAnythingIsAllocatedFromIt) {
  testing::TempDir dir;
  const std::string file = dir.path() + "/rows";
  const auto build = [&] {
    return Dataset::from_tensor_slices({torch::arange(12, torch::kInt64).reshape({6, 2})})
        .cache(file);
  };
  ASSERT_EQ(values(build()), iota(0, 12)); // writes the cache file
  const std::string path = file + ".flotilla-cache";
  std::string good;
  {
    std::ifstream in(path, std::ios::binary);
    good.assign(std::istreambuf_iterator<char>(in), {});
  }
  // magic (17 bytes), u64 fingerprint length, the fingerprint, then the first element: u32
  // arity, i8 dtype, u8 ndim, i64 dims, u64 bytes.
  std::uint64_t fingerprint = 0;
  std::memcpy(&fingerprint, good.data() + 17, 8);
  const std::size_t dtype_at = 17 + 8 + fingerprint + 4;
  const std::size_t dim_at = dtype_at + 2;
  const auto patched = [&](std::size_t at, const void* value, std::size_t n) {
    std::string bad = good;
    std::memcpy(bad.data() + at, value, n);
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bad;
    try {
      values(build());
    } catch (const DataError& e) {
      return std::string(e.what());
    } catch (const std::exception& e) {
      return std::string("not a DataError: ") + e.what();
    }
    return std::string("read without an error");
  };
  const std::string corrupt = "cache file " + path + " is corrupt (";
  const std::int64_t huge = std::int64_t{1} << 62, negative = -3, past_end = 1 << 20;
  EXPECT_EQ(patched(dim_at, &huge, 8), corrupt + "a dimension of " + std::to_string(huge) +
                                           "); delete it to rebuild it");
  EXPECT_EQ(patched(dim_at, &negative, 8), corrupt + "a dimension of -3); delete it to rebuild it");
  const std::int8_t dtype = 99;
  EXPECT_EQ(patched(dtype_at, &dtype, 1), corrupt + "dtype code 99); delete it to rebuild it");
  const std::uint8_t ndim = 200;
  EXPECT_EQ(patched(dtype_at + 1, &ndim, 1), corrupt + "200 dimensions); delete it to rebuild it");
  // A shape and byte count that agree, but claim more than the file holds.
  std::string header(16, '\0');
  const std::uint64_t bytes = std::uint64_t{past_end} * 8;
  std::memcpy(header.data(), &past_end, 8);
  std::memcpy(header.data() + 8, &bytes, 8);
  EXPECT_EQ(patched(dim_at, header.data(), 16),
            corrupt + "a dimension of " + std::to_string(past_end) + "); delete it to rebuild it");
  // The file as written still reads.
  std::ofstream(path, std::ios::binary | std::ios::trunc) << good;
  EXPECT_EQ(values(build()), iota(0, 12));
}

TEST(Dataset, AnExceptionInAMapFunctionReachesTheConsumerWithTheElementIndex) {
  auto boom = [](Element e) {
    if (e[0].item<std::int64_t>() == 5) throw std::runtime_error("bad pixel");
    return e;
  };
  for (std::int64_t parallel : {std::int64_t{1}, std::int64_t{3}}) {
    auto it = Dataset::range(10).map(boom, parallel).prefetch(2).make_iterator();
    for (int i = 0; i < 5; ++i) ASSERT_TRUE(it.next()) << i; // the elements before it arrive
    try {
      it.next();
      FAIL() << "parallel " << parallel;
    } catch (const DataError& e) {
      EXPECT_EQ(std::string(e.what()), "map function failed on element 5 of this pass: bad pixel");
    }
  }
}

TEST(Dataset, CachesBeforeABatchWithARemainderReplayWhole) {
  testing::TempDir dir;
  for (const std::string file : {std::string(), dir.path() + "/c"}) {
    auto ds = Dataset::range(10).cache(file).batch(4); // 4, 4, 2: the batch asks past the end
    EXPECT_EQ(values(ds), iota(0, 10)) << file;
    EXPECT_EQ(values(ds), iota(0, 10)) << file; // replayed, whole, without an error at its end
    EXPECT_EQ(values(ds.repeat(3)).size(), 30u) << file;
  }
}

TEST(Dataset, ElementsAfterAFailedOneStillCome) {
  auto boom = [](Element e) {
    if (e[0].item<std::int64_t>() == 5) throw std::runtime_error("bad pixel");
    return e;
  };
  for (std::int64_t parallel : {std::int64_t{1}, std::int64_t{3}}) {
    auto it = Dataset::range(40).map(boom, parallel).prefetch(2).make_iterator();
    std::vector<std::int64_t> got;
    int errors = 0;
    for (;;) {
      try {
        auto e = it.next();
        if (!e) break;
        got.push_back((*e)[0].item<std::int64_t>());
      } catch (const DataError&) {
        ++errors;
      }
    }
    auto expected = iota(0, 40);
    expected.erase(expected.begin() + 5);
    EXPECT_EQ(got, expected) << "parallel " << parallel;
    EXPECT_EQ(errors, 1);
  }
}

TEST(Dataset, ZipWithAnUnknownLengthIsUnknown) {
  auto unknown = Dataset::range(10).filter([](const Element&) { return true; });
  EXPECT_EQ(Dataset::zip({Dataset::range(5), unknown}).cardinality(), kUnknownCardinality);
  EXPECT_EQ(Dataset::zip({Dataset::range(5), Dataset::range(3)}).cardinality(), 3);
  EXPECT_EQ(Dataset::zip({Dataset::range(5), Dataset::random(1)}).cardinality(), 5);
}

// This process's threads, as the kernel lists them.
std::size_t thread_count() {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

// Each iterator goes with work in flight (its pool mapping ahead, a prefetch waiting): once it
// is destroyed, none of its threads is left and none of them calls its function again.
TEST(Dataset, DestroyingAnIteratorMidStreamStopsEveryThread) {
  const auto pipeline = [](std::shared_ptr<std::atomic<int>> calls) {
    return Dataset::range(1000000)
        .repeat()
        .map([calls](Element e) { ++*calls; return plus(std::move(e), 1); }, kAutotune)
        .batch(8, false, 2)
        .prefetch(kAutotune);
  };
  { // LibTorch's own threads, made once on first use, before the count
    auto it = pipeline(std::make_shared<std::atomic<int>>(0)).make_iterator();
    it.next();
  }
  const auto settled = [](std::size_t want) { // a joined thread leaves /proc just after
    for (int i = 0; i < 500 && thread_count() != want; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return thread_count();
  };
  const std::size_t before = settled(thread_count());
  std::vector<std::pair<std::shared_ptr<std::atomic<int>>, int>> ended; // counter, at its end
  for (int round = 0; round < 20; ++round) {
    auto calls = std::make_shared<std::atomic<int>>(0);
    {
      auto it = pipeline(calls).make_iterator();
      for (int i = 0; i < round; ++i) it.next();
      if (round > 0) EXPECT_GT(thread_count(), before) << "round " << round;
    }
    ended.emplace_back(calls, calls->load());
    EXPECT_EQ(settled(before), before) << "round " << round;
  }
  for (std::size_t round = 0; round < ended.size(); ++round) { // the later rounds took a while
    EXPECT_EQ(ended[round].first->load(), ended[round].second) << "round " << round;
  }
}

TEST(Dataset, SavedIteratorResumesOnExactlyTheNextElement) {
  auto build = [] {
    return Dataset::range(1000)
        .shuffle(100, 11)
        .batch(7, true)
        .map([](Element e) { return plus(std::move(e), 1); }, kAutotune)
        .prefetch(kAutotune);
  };
  auto ds = build();
  auto first = ds.make_iterator(); // iteration 0
  for (int i = 0; i < 3; ++i) first.next();
  auto it = ds.make_iterator(); // iteration 1: another order
  for (int i = 0; i < 40; ++i) it.next();
  const IteratorState state = it.save();
  EXPECT_EQ(state.iteration, 1);
  EXPECT_EQ(state.produced, 40);
  std::vector<std::int64_t> rest;
  while (auto e = it.next()) rest.push_back((*e)[0][0].item<std::int64_t>());
  auto resumed = build().make_iterator(state); // a new process would rebuild the pipeline
  std::vector<std::int64_t> again;
  while (auto e = resumed.next()) again.push_back((*e)[0][0].item<std::int64_t>());
  EXPECT_EQ(again, rest);
  EXPECT_EQ(rest.size(), 1000u / 7 - 40);
}

// A resume deep into a repeated stream steps over the passes before its own without running
// them (a pass's order depends only on its number), and still lands on exactly the next
// element: counted and endless repeats, each pass reshuffled, positions on and between pass
// boundaries. The map inside counts what it ran: the passes stepped over never ran it.
TEST(Dataset, AResumeStepsOverWholeRepeatedPassesWithoutRunningThem) {
  auto calls = std::make_shared<std::atomic<int>>(0);
  auto build = [&](std::int64_t count) {
    return Dataset::range(10)
        .map([calls](Element e) {
          ++*calls;
          return e;
        })
        .shuffle(4, 5)
        .repeat(count)
        .batch(3);
  };
  for (const std::int64_t count : {std::int64_t{4}, std::int64_t{-1}}) {
    std::vector<std::int64_t> all;
    auto whole = build(count).make_iterator();
    for (int i = 0; i < 20; ++i) {
      auto e = whole.next();
      if (!e) break;
      const auto t = (*e)[0].contiguous();
      all.insert(all.end(), t.data_ptr<std::int64_t>(), t.data_ptr<std::int64_t>() + t.numel());
    }
    ASSERT_EQ(all.size(), count < 0 ? 60u : 40u);
    const IteratorState start = build(count).make_iterator().save();
    for (const std::int64_t produced : {3, 7, 10, 11, 12, 14}) {
      *calls = 0;
      auto resumed =
          build(count).make_iterator(IteratorState{start.iteration, produced, start.fingerprint});
      auto e = resumed.next();
      const std::string what =
          "count " + std::to_string(count) + ", batch " + std::to_string(produced);
      if (count > 0 && produced * 3 >= 40) {
        EXPECT_FALSE(e) << what;
        continue;
      }
      ASSERT_TRUE(e) << what;
      const auto t = (*e)[0].contiguous();
      const std::vector<std::int64_t> got(t.data_ptr<std::int64_t>(),
                                          t.data_ptr<std::int64_t>() + t.numel());
      const auto at = all.begin() + produced * 3;
      EXPECT_EQ(got, std::vector<std::int64_t>(at, std::min(at + 3, all.end()))) << what;
      // Rows skipped within the resumed pass, and the pass's buffer: never a whole earlier pass.
      EXPECT_LT(*calls, 10 + 4 + 3) << what;
      EXPECT_LT(*calls - (produced * 3) % 10, 10) << what;
    }
  }
}

TEST(Dataset, OnlyReplayablePipelinesCanBeSaved) {
  auto it = Dataset::range(10).shuffle(5).make_iterator();
  try {
    it.save();
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()),
              "this iterator cannot be saved to resume exactly: a shuffle without a seed draws a "
              "new order in every process; give it one");
  }
  auto state = Dataset::range(10).make_iterator().save();
  EXPECT_THROW(Dataset::range(11).make_iterator(state), ConfigError); // another pipeline
}

TEST(Dataset, AutotuneRaisesTheParallelismOfASlowMap) {
  auto ds = Dataset::range(100000).map(
      [](Element e) {
        std::this_thread::sleep_for(std::chrono::milliseconds(4)); // far slower than the consumer
        return e;
      },
      kAutotune);
  Options options;
  options.private_threadpool_size = 8;
  auto it = ds.with_options(options).make_iterator();
  const auto start_parallelism = it.stats().back().parallelism;
  for (int i = 0; i < 400; ++i) it.next();
  const auto stats = it.stats();
  ASSERT_EQ(stats.size(), 2u);
  EXPECT_EQ(stats[0].name, "Range");
  EXPECT_EQ(stats[1].name, "ParallelMap");
  EXPECT_TRUE(stats[1].autotuned);
  EXPECT_EQ(stats[1].elements, 400);
  EXPECT_GT(stats[1].parallelism, start_parallelism);
  EXPECT_LE(stats[1].parallelism, 8);
  EXPECT_GT(stats[1].consumer_wait_share, 0.5); // the consumer mostly waited: why it grew
}

TEST(Dataset, BatchingMismatchedShapesNamesTheElement) {
  auto ds = Dataset::range(4).map(
      [](Element e) { return Element{torch::zeros({e[0].item<std::int64_t>() == 2 ? 3 : 2})}; });
  try {
    values(ds.batch(4));
    FAIL();
  } catch (const DataError& e) {
    EXPECT_EQ(std::string(e.what()),
              "batch 0: component 0 of element 2 has shape [3], the first element's has [2]; "
              "batching needs equal shapes: resize or pad them in a map first");
  }
}

} // namespace
} // namespace flotilla::data
