// The largest-batch search: exact on a synthetic threshold, never above it, bounded, clear when
// nothing fits; and on a real CPU step, a smaller memory budget gives a smaller batch.
#include "flotilla/profile/batch_search.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "flotilla/error.h"
#include "models/zoo.h"

namespace flotilla::profile {
namespace {

// Fits iff batch <= threshold; the peak grows with the batch so the reported one can be checked.
FitsFn up_to(std::int64_t threshold) {
  return [threshold](std::int64_t batch) {
    return FitResult{batch <= threshold, 1000 + 10 * batch, batch <= threshold ? "" : "too big"};
  };
}

BatchSearchOptions resolution(std::int64_t r) {
  BatchSearchOptions o;
  o.resolution = r;
  return o;
}

TEST(BatchSearch, FindsTheThresholdExactly) {
  auto r = search_max_batch(up_to(1000), resolution(1));
  EXPECT_EQ(r.batch, 1000);
  EXPECT_EQ(r.first_failure, 1001);
  EXPECT_EQ(r.peak_bytes, 1000 + 10 * 1000);
  EXPECT_FALSE(r.capped);
  EXPECT_FALSE(r.out_of_probes);
  r = search_max_batch(up_to(1000), resolution(8)); // 1000 is a multiple of 8
  EXPECT_EQ(r.batch, 1000);
  EXPECT_EQ(r.first_failure, 1008);
  r = search_max_batch(up_to(1003), resolution(8)); // rounded down to a multiple of 8
  EXPECT_EQ(r.batch, 1000);
  r = search_max_batch(up_to(1003), resolution(1));
  EXPECT_EQ(r.batch, 1003);
}

TEST(BatchSearch, DoublesThenBisects) {
  const auto r = search_max_batch(up_to(1000), resolution(8));
  std::vector<std::int64_t> tried;
  for (const auto& p : r.probes) tried.push_back(p.batch);
  EXPECT_EQ(tried, (std::vector<std::int64_t>{32, 64, 128, 256, 512, 1024, 768, 896, 960, 992, 1008,
                                              1000}));
}

TEST(BatchSearch, NeverAboveTheThresholdAndWithinOneResolutionOfIt) {
  for (std::int64_t res : {1, 8, 32}) {
    for (std::int64_t t : {1, 2, 7, 8, 9, 31, 33, 100, 777, 1024, 4095, 5000, 65535}) {
      const auto r = search_max_batch(up_to(t), resolution(res));
      EXPECT_LE(r.batch, t) << "threshold " << t << " resolution " << res;
      // Below the first probe (32) the search halves, so there the answer is a power of two.
      const std::int64_t slack = t < 32 ? std::max<std::int64_t>(res, t / 2 + 1) : res;
      EXPECT_GT(r.batch, t - slack) << "threshold " << t << " resolution " << res;
      EXPECT_LE(static_cast<int>(r.probes.size()), 32);
      for (const auto& p : r.probes) EXPECT_EQ(p.result.fits, p.batch <= t);
    }
  }
}

TEST(BatchSearch, NeverReturnsABatchThatDidNotFit) {
  // Not monotonic (a noisy measurement): 768 fails although 1000 fits.
  const FitsFn noisy = [](std::int64_t b) { return FitResult{b <= 1000 && b != 768, b, ""}; };
  const auto r = search_max_batch(noisy, resolution(8));
  std::set<std::int64_t> fitted;
  for (const auto& p : r.probes) {
    if (p.result.fits) fitted.insert(p.batch);
  }
  EXPECT_EQ(fitted.count(r.batch), 1u) << r.batch;
  EXPECT_LT(r.batch, 768); // the bracket closed at the failure it saw
}

TEST(BatchSearch, EverythingFitsUpToTheCap) {
  BatchSearchOptions o;
  o.max_batch = 5000;
  const auto r = search_max_batch(up_to(1 << 30), o);
  EXPECT_EQ(r.batch, 5000);
  EXPECT_TRUE(r.capped);
  EXPECT_EQ(r.first_failure, 0);
  EXPECT_EQ(r.probes.back().batch, 5000);
  EXPECT_EQ(r.probes.size(), 9u); // 32 ... 4096, then the cap
}

TEST(BatchSearch, NothingFitsIsAClearError) {
  const FitsFn never = [](std::int64_t b) { return FitResult{false, 100 * b, "out of memory"}; };
  try {
    search_max_batch(never);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("no batch fits"), std::string::npos) << what;
    EXPECT_NE(what.find("smallest tried: batch 1 (peak 100 B): out of memory"), std::string::npos)
        << what;
  }
}

TEST(BatchSearch, TheStartNotFittingHalvesDown) {
  const auto r = search_max_batch(up_to(5), resolution(8));
  EXPECT_EQ(r.batch, 4); // 32, 16, 8 fail; 4 fits; no multiple of 8 lies between 4 and 8
  EXPECT_EQ(r.first_failure, 8);
  EXPECT_EQ(search_max_batch(up_to(5), resolution(1)).batch, 5);
}

TEST(BatchSearch, BoundedProbes) {
  BatchSearchOptions o;
  o.max_probes = 3;
  int calls = 0;
  const auto r = search_max_batch(
      [&](std::int64_t b) {
        ++calls;
        return FitResult{b <= 1000, b, ""};
      },
      o);
  EXPECT_EQ(calls, 3);
  EXPECT_TRUE(r.out_of_probes);
  EXPECT_EQ(r.batch, 128); // 32, 64, 128: the last seen to fit
  o.max_probes = 0;
  EXPECT_THROW(search_max_batch(up_to(10), o), ConfigError);
}

TEST(BatchSearch, ParseBytes) {
  EXPECT_EQ(parse_bytes("8GiB", "--memory-budget"), 8LL << 30);
  EXPECT_EQ(parse_bytes("8G", "--memory-budget"), 8LL << 30);
  EXPECT_EQ(parse_bytes("512MiB", "--memory-budget"), 512LL << 20);
  EXPECT_EQ(parse_bytes("300mb", "--memory-budget"), 300LL << 20);
  EXPECT_EQ(parse_bytes("1.5 G", "--memory-budget"), 3LL << 29);
  EXPECT_EQ(parse_bytes("123456", "--memory-budget"), 123456);
  EXPECT_EQ(parse_bytes("2TiB", "--memory-budget"), 2LL << 40);
  for (const char* bad : {"", "abc", "8XB", "8GiBs", "0", "-1G"}) {
    try {
      parse_bytes(bad, "--memory-budget");
      ADD_FAILURE() << bad;
    } catch (const ConfigError& e) {
      EXPECT_EQ(std::string(e.what()).rfind(std::string("--memory-budget \"") + bad + "\"", 0), 0u)
          << e.what();
    }
  }
  EXPECT_EQ(format_bytes(3LL << 29), "1.50 GiB");
  EXPECT_EQ(format_bytes(320LL << 20), "320.0 MiB");
  EXPECT_EQ(format_bytes(100), "100 B");
}

TEST(BatchSearch, DefaultBudgetIsAvailableMemorySharedByTheWorkers) {
  const std::int64_t one = default_memory_budget(1, 1.0);
  EXPECT_GT(one, 64LL << 20); // a machine that runs these tests has that much free
  const std::int64_t four = default_memory_budget(4, 0.8);
  // MemAvailable moves between the two reads; allow it 10%.
  EXPECT_NEAR(static_cast<double>(four), one / 4.0 * 0.8, one / 4.0 * 0.8 * 0.1);
}

TEST(BatchSearch, StepProbeRejectsBadSettings) {
  StepProbeOptions o;
  o.memory_budget_bytes = 1LL << 30;
  EXPECT_THROW(step_probe(o), ConfigError); // no model
  o.model = [] { return probe_model(models::make_model("resnet")); };
  EXPECT_THROW(step_probe(o), ConfigError);
  o.model = [] { return probe_model(models::make_model("mlp")); };
  o.precision = "float8";
  EXPECT_THROW(step_probe(o), ConfigError);
  o.precision = "float32";
  o.device = "tpu";
  EXPECT_THROW(step_probe(o), ConfigError);
  o.device = "cpu";
  o.memory_budget_bytes = 0;
  EXPECT_THROW(step_probe(o), ConfigError);
}

// A real training step of the mlp: its measured peak grows with the batch, so a budget between
// the peaks of two batches separates them, and a smaller budget finds a smaller batch.
TEST(BatchSearch, ASmallerBudgetGivesASmallerBatchForTheMlp) {
  StepProbeOptions o;
  o.model = [] { return probe_model(models::make_model("mlp")); };
  o.memory_budget_bytes = 1LL << 50; // measure only
  const FitsFn measure = step_probe(o);
  measure(64); // first-step initialisation (thread pools, kernels) is not the step's memory
  const std::int64_t small_peak = measure(64).peak_bytes;
  const std::int64_t large_peak = measure(4096).peak_bytes;
  // 4096 x 784 floats of input alone are 12.25 MiB, and activations and gradients add more.
  ASSERT_GT(large_peak - small_peak, 12LL << 20) << small_peak << " vs " << large_peak;
  // The peak is the whole process's, so it includes LibTorch itself.
  EXPECT_GT(small_peak, resident_bytes() / 2);

  const std::int64_t delta = large_peak - small_peak;
  BatchSearchOptions search;
  search.max_batch = 8192;
  o.memory_budget_bytes = small_peak + delta / 4;
  const auto tight = search_max_batch(step_probe(o), search);
  o.memory_budget_bytes = large_peak + delta;
  const auto roomy = search_max_batch(step_probe(o), search);

  EXPECT_LT(tight.batch, roomy.batch);
  EXPECT_GE(tight.batch, 64);
  EXPECT_LT(tight.batch, 4096);
  EXPECT_GE(roomy.batch, 4096);
  EXPECT_EQ(tight.batch % 8, 0);
  EXPECT_LE(tight.peak_bytes, small_peak + delta / 4);
  EXPECT_LE(roomy.peak_bytes, large_peak + delta);
  EXPECT_GT(tight.first_failure, tight.batch);
  for (const auto& p : tight.probes) {
    EXPECT_EQ(p.result.fits, p.result.peak_bytes <= small_peak + delta / 4) << p.batch;
  }
}

} // namespace
} // namespace flotilla::profile
