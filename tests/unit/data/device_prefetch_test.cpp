// prefetch_to_device on the CPU (the CUDA path is in tests/gpu/device_prefetch_cuda_test.cpp):
// the same elements in the same order as without it, exact resume, distribution through it,
// errors passed on, and its configuration checked.
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "flotilla/data/distribute.h"
#include "flotilla/error.h"

namespace flotilla::data {
namespace {

const torch::Device kCpu(torch::kCPU);

// Component `c` of every element left in `it`, flattened, in order.
std::vector<std::int64_t> drain(Iterator& it, std::size_t c = 0) {
  std::vector<std::int64_t> out;
  while (auto e = it.next()) {
    const auto flat = (*e)[c].reshape({-1}).contiguous();
    out.insert(out.end(), flat.data_ptr<std::int64_t>(),
               flat.data_ptr<std::int64_t>() + flat.numel());
  }
  return out;
}

std::vector<std::int64_t> values(const Dataset& ds, std::size_t c = 0) {
  auto it = ds.make_iterator();
  return drain(it, c);
}

// The elements stage `name` has produced so far (Iterator::stats).
std::int64_t produced_by(const Iterator& it, const std::string& name) {
  for (const auto& s : it.stats()) {
    if (s.name == name) return s.elements;
  }
  return -1;
}

TEST(PrefetchToDevice, CpuElementsPassEqualAndInOrder) {
  auto x = torch::arange(100, torch::kInt64) * 3;
  auto y = torch::arange(100, torch::kFloat64) / 4;
  const auto ds = Dataset::from_tensor_slices({x, y}).batch(7).prefetch_to_device(kCpu, 3);
  EXPECT_EQ(ds.cardinality(), 15);
  std::vector<std::int64_t> expected;
  for (std::int64_t i = 0; i < 100; ++i) expected.push_back(3 * i);
  EXPECT_EQ(values(ds), expected);
  std::int64_t row = 0;
  for (const Element& e : ds.make_iterator()) {
    ASSERT_EQ(e.size(), 2u);
    EXPECT_TRUE(e[1].device().is_cpu());
    EXPECT_TRUE(torch::equal(e[1], torch::arange(row, row + e[1].size(0), torch::kFloat64) / 4));
    row += e[1].size(0);
  }
  EXPECT_EQ(row, 100);
}

TEST(PrefetchToDevice, NamesItselfInThePlanAndTheStats) {
  const auto ds = Dataset::range(10).batch(2).prefetch_to_device(kCpu, 2);
  // The fingerprint (checked on resume) names the stage but not the device or buffer.
  const std::string fp = ds.fingerprint();
  EXPECT_EQ(fp.rfind("prefetch_to_device<-[batch", 0), 0u) << fp;
  auto it = ds.make_iterator();
  ASSERT_TRUE(it.next());
  const auto stats = it.stats();
  ASSERT_FALSE(stats.empty());
  EXPECT_EQ(stats.back().name, "PrefetchToDevice");
  EXPECT_EQ(stats.back().buffer_size, 2);
  EXPECT_EQ(stats.back().elements, 1);
}

TEST(PrefetchToDevice, ASavedPassResumesOnExactlyTheNextElement) {
  const auto ds = Dataset::range(60).shuffle(60, 7).batch(4).prefetch_to_device(kCpu, 3);
  auto it = ds.make_iterator();
  std::vector<std::int64_t> head;
  for (int i = 0; i < 5; ++i) {
    auto e = it.next();
    ASSERT_TRUE(e);
    for (std::int64_t k = 0; k < 4; ++k) head.push_back((*e)[0][k].item<std::int64_t>());
  }
  // Let the stage's thread read ahead, so the batches below are past what the consumer has.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (produced_by(it, "Batch") < 8 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_EQ(produced_by(it, "Batch"), 8); // 5 handed out + 3 buffered
  const IteratorState state = it.save();
  EXPECT_EQ(state.produced, 5);
  EXPECT_EQ(state.fingerprint, ds.fingerprint());
  const auto rest = drain(it);
  ASSERT_EQ(rest.size(), 40u);

  auto resumed = ds.make_iterator(state);
  EXPECT_EQ(drain(resumed), rest);
  // The same pass: the head and the rest are a permutation of 0..59 (not the start of a new one).
  std::vector<std::int64_t> all = head;
  all.insert(all.end(), rest.begin(), rest.end());
  std::sort(all.begin(), all.end());
  for (std::int64_t i = 0; i < 60; ++i) EXPECT_EQ(all[static_cast<std::size_t>(i)], i);

  // A state of the pipeline without the stage belongs to another pipeline.
  const auto without = Dataset::range(60).shuffle(60, 7).batch(4);
  EXPECT_THROW(without.make_iterator(state), ConfigError);
}

TEST(PrefetchToDevice, AnUpstreamErrorReachesTheConsumerAndTheElementsAfterItStillCome) {
  auto boom = [](Element e) {
    if (e[0].item<std::int64_t>() == 3) throw std::runtime_error("bad pixel");
    return e;
  };
  auto it = Dataset::range(8).map(boom).prefetch_to_device(kCpu, 2).make_iterator();
  std::vector<std::int64_t> got;
  for (int i = 0; i < 3; ++i) {
    auto e = it.next();
    ASSERT_TRUE(e);
    got.push_back((*e)[0].item<std::int64_t>());
  }
  try {
    it.next();
    FAIL() << "the map's error did not arrive";
  } catch (const DataError& e) {
    EXPECT_EQ(std::string(e.what()), "map function failed on element 3 of this pass: bad pixel");
  }
  while (auto e = it.next()) got.push_back((*e)[0].item<std::int64_t>());
  EXPECT_EQ(got, (std::vector<std::int64_t>{0, 1, 2, 4, 5, 6, 7}));
  EXPECT_FALSE(it.next()); // ended stays ended
}

TEST(PrefetchToDevice, RefusesABadBufferSize) {
  for (std::int64_t size : {std::int64_t{0}, std::int64_t{-1}, std::int64_t{-7}}) {
    try {
      Dataset::range(4).prefetch_to_device(kCpu, size);
      FAIL() << size;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("saw " + std::to_string(size)), std::string::npos)
          << e.what();
    }
  }
}

TEST(PrefetchToDevice, RefusesACudaDeviceThisProcessDoesNotSee) {
  // No machine has 100 GPUs, so this holds with or without CUDA.
  try {
    Dataset::range(4).prefetch_to_device(torch::Device(torch::kCUDA, 99));
    FAIL() << "cuda:99 was accepted";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("cuda:99"), std::string::npos) << what;
    EXPECT_NE(what.find(std::to_string(torch::cuda::device_count()) + " CUDA device"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("kCPU"), std::string::npos) << what;
  }
  if (!torch::cuda::is_available()) {
    try {
      Dataset::range(4).prefetch_to_device(torch::Device(torch::kCUDA, 0));
      FAIL() << "cuda:0 was accepted without a visible CUDA device";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("asked for cuda:0 but this process sees 0 CUDA"),
                std::string::npos)
          << e.what();
    }
  }
}

} // namespace
} // namespace flotilla::data
