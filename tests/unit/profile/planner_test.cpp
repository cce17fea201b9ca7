// The scaling planner: the ring all-reduce formula, the overlap timeline (hidden, partly hidden,
// off), one worker, the best bucket size moving with the per-collective cost and the latency,
// reading a single-worker profile, and every parse error. Expected values are worked out by hand
// in the comments, not by calling the code under test.
#include <gtest/gtest.h>

#include <string>

#include "flotilla/error.h"
#include "flotilla/profile/planner.h"

namespace flotilla::profile {
namespace {

constexpr double kTol = 1e-12;

// Compute per step: 1 + 0 + 30 + 60 + 10 + 2 + 1 + 1 = 105 ms; backward 60 ms.
StepProfile sample_profile(std::int64_t gradient_bytes) {
  StepProfile p;
  p.input = 0.001;
  p.copy = 0;
  p.forward = 0.030;
  p.backward = 0.060;
  p.optimizer = 0.010;
  p.metrics = 0.002;
  p.callbacks = 0.001;
  p.other = 0.001;
  p.gradient_bytes = gradient_bytes;
  p.bytes_per_pack = gradient_bytes;
  p.batch_per_worker = 64;
  return p;
}

Link ten_gbit(double latency_s, double per_collective_s) {
  return Link{1.25e9, latency_s, per_collective_s}; // 10 Gbit/s = 1.25e9 bytes/s
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "(no ConfigError)";
}

TEST(Planner, RingAllReduceByHand) {
  // 100 MB over 4 workers at 10 Gbit/s, 20 us per hop, no per-collective cost:
  //   bandwidth: 2 * 3/4 * 1e8 B / 1.25e9 B/s = 1.5 * 0.08 s = 0.12 s
  //   latency:   2 * 3 hops * 20 us          = 120 us
  //   total 0.12012 s; with 100 us per collective, 0.12022 s.
  EXPECT_NEAR(all_reduce_seconds(100'000'000, 4, ten_gbit(20e-6, 0)), 0.12012, kTol);
  EXPECT_NEAR(all_reduce_seconds(100'000'000, 4, ten_gbit(20e-6, 100e-6)), 0.12022, kTol);
  // 2 workers: 2 * 1/2 * 1e8 / 1.25e9 = 0.08 s, + 2 * 1 * 20 us = 0.08004 s.
  EXPECT_NEAR(all_reduce_seconds(100'000'000, 2, ten_gbit(20e-6, 0)), 0.08004, kTol);
  // Nothing to do alone or with nothing to send: not even the per-collective cost.
  EXPECT_EQ(all_reduce_seconds(100'000'000, 1, ten_gbit(20e-6, 100e-6)), 0);
  EXPECT_EQ(all_reduce_seconds(0, 4, ten_gbit(20e-6, 100e-6)), 0);
}

TEST(Planner, SplitBucketsKeepsTheRemainderLast) {
  EXPECT_EQ(split_buckets(100, 30), (std::vector<std::int64_t>{30, 30, 30, 10}));
  EXPECT_EQ(split_buckets(90, 30), (std::vector<std::int64_t>{30, 30, 30}));
  EXPECT_EQ(split_buckets(10, 30), (std::vector<std::int64_t>{10}));
  EXPECT_TRUE(split_buckets(0, 30).empty());
}

TEST(Planner, BucketsFollowTheParametersAsTheGradientEngineFillsThem) {
  StepProfile p;
  // Backward order: a small bias, one big weight, a small bias, a mid weight.
  p.gradient_layout = {40, 4000, 40, 400};
  p.gradient_bytes = 4480;
  // At 1000 bytes: [40] closes before the big weight (40 + 4000 > 1000), the big weight is a
  // bucket on its own (never split), then 40 + 400 fit together.
  EXPECT_EQ(plan_buckets(p, 1000), (std::vector<std::int64_t>{40, 4000, 440}));
  EXPECT_EQ(plan_buckets(p, 100000), (std::vector<std::int64_t>{4480}));
  // On the wire with fp16 compression: half of each, the last bucket taking the rounding.
  p.gradient_bytes = 2240;
  EXPECT_EQ(plan_buckets(p, 1000), (std::vector<std::int64_t>{20, 2000, 220}));
  // No layout (an older profile): cut evenly.
  p.gradient_layout.clear();
  EXPECT_EQ(plan_buckets(p, 1000), (std::vector<std::int64_t>{1000, 1000, 240}));
  // The big weight's bucket is ready only when backward has produced it: at 4040 / 4480 of
  // backward, not at the even split's 2000 / 4480.
  p.gradient_layout = {40, 4000, 40, 400};
  p.gradient_bytes = 4480;
  p.backward = 1.0;
  Link link{4480.0, 0, 0}; // 1 s to send the whole gradient between 2 workers (2(n-1)/n = 1)
  const auto packed = predict(p, 2, link, 1000, true);
  // Buckets: 40 ready at 40/4480 s and sent by 80/4480; 4000 ready at 4040/4480, done at
  // 8040/4480; 440 ready at 1, done at 8480/4480. Exposed: 8480/4480 - 1.
  EXPECT_NEAR(packed.exposed_seconds, 8480.0 / 4480 - 1, 1e-9);
  // Parameters of two dtypes never share a bucket, as in the engine: the float16 pair is cut
  // from the float32 pair even where all four would fit.
  p.gradient_kinds = {"Float@cpu", "Float@cpu", "Half@cpu", "Half@cpu"};
  p.gradient_layout = {40, 40, 20, 20};
  p.gradient_bytes = 120;
  EXPECT_EQ(plan_buckets(p, 1000), (std::vector<std::int64_t>{80, 40}));
}

TEST(Planner, OverlapOffExposesAllCommunication) {
  // One 100 MB all-reduce after backward: exposed = 0.12012 s (above);
  // step = 0.105 + 0.12012 = 0.22512 s; efficiency 0.105 / 0.22512; 4 * 64 / 0.22512 samples/s.
  const auto p = sample_profile(100'000'000);
  const auto r = predict(p, 4, ten_gbit(20e-6, 0), 100'000'000, false);
  EXPECT_EQ(r.buckets, 1);
  EXPECT_NEAR(r.comm_seconds, 0.12012, kTol);
  EXPECT_NEAR(r.exposed_seconds, 0.12012, kTol);
  EXPECT_NEAR(r.step_seconds, 0.22512, kTol);
  EXPECT_NEAR(r.efficiency, 0.105 / 0.22512, kTol);
  EXPECT_NEAR(r.samples_per_s, 256 / 0.22512, 1e-9);
  // Off with 4 buckets of 25 MB: each 1.5 * 25e6 / 1.25e9 + 120 us = 0.03012 s, all after
  // backward: 4 * 0.03012 = 0.12048 s exposed (smaller buckets only add latency).
  const auto four = predict(p, 4, ten_gbit(20e-6, 0), 25'000'000, false);
  EXPECT_EQ(four.buckets, 4);
  EXPECT_NEAR(four.exposed_seconds, 0.12048, kTol);
  EXPECT_NEAR(four.comm_seconds, 0.12048, kTol);
}

TEST(Planner, OverlapPartlyHidden) {
  // 4 buckets of 25 MB, each 0.03012 s on the link; backward (60 ms) hands them over at 15, 30,
  // 45 and 60 ms. The link is the bottleneck: 15 -> 45.12, 45.12 -> 75.24, -> 105.36,
  // -> 135.48 ms. Exposed: 135.48 - 60 = 75.48 ms of the 120.48 ms; step 105 + 75.48 ms.
  const auto p = sample_profile(100'000'000);
  const auto r = predict(p, 4, ten_gbit(20e-6, 0), 25'000'000, true);
  EXPECT_EQ(r.buckets, 4);
  EXPECT_NEAR(r.comm_seconds, 0.12048, kTol);
  EXPECT_NEAR(r.exposed_seconds, 0.07548, kTol);
  EXPECT_NEAR(r.step_seconds, 0.18048, kTol);
  // The remainder bucket: 30, 30, 30, 10 MB, ready at 18, 36, 54, 60 ms; each 30 MB costs
  // 1.5 * 30e6 / 1.25e9 + 120 us = 36.12 ms, the 10 MB one 12.12 ms:
  // 18 -> 54.12 -> 90.24 -> 126.36 -> 138.48 ms; exposed 78.48 ms.
  const auto uneven = predict(p, 4, ten_gbit(20e-6, 0), 30'000'000, true);
  EXPECT_EQ(uneven.buckets, 4);
  EXPECT_NEAR(uneven.exposed_seconds, 0.07848, kTol);
}

TEST(Planner, OverlapHidesAllButTheLastBucket) {
  // 1 MB in 4 buckets of 250 kB, each 1.5 * 2.5e5 / 1.25e9 + 120 us = 0.42 ms, ready every
  // 15 ms: each is done long before the next is ready, so only the last one, handed over as
  // backward ends, is exposed: 0.42 ms of the 1.68 ms.
  const auto p = sample_profile(1'000'000);
  const auto r = predict(p, 4, ten_gbit(20e-6, 0), 250'000, true);
  EXPECT_NEAR(r.comm_seconds, 0.00168, kTol);
  EXPECT_NEAR(r.exposed_seconds, 0.00042, kTol);
  EXPECT_NEAR(r.step_seconds, 0.10542, kTol);
  // The same without overlap: all 1.68 ms exposed.
  EXPECT_NEAR(predict(p, 4, ten_gbit(20e-6, 0), 250'000, false).exposed_seconds, 0.00168, kTol);
}

TEST(Planner, OneWorkerIsTheMeasuredStep) {
  const auto p = sample_profile(100'000'000);
  const auto r = predict(p, 1, ten_gbit(20e-6, 100e-6), 25'000'000, true);
  EXPECT_EQ(r.comm_seconds, 0);
  EXPECT_EQ(r.exposed_seconds, 0);
  EXPECT_NEAR(r.step_seconds, 0.105, kTol);
  EXPECT_NEAR(r.efficiency, 1, kTol);
  EXPECT_NEAR(r.samples_per_s, 64 / 0.105, 1e-9);
}

// 64 MiB of gradients, backward 100 ms, 2 workers at 10 Gbit/s: the whole gradient takes
// G / B = 67108864 / 1.25e9 = 53.687 ms of bandwidth (2(n-1)/n = 1). With k buckets of G/k, each
// costing t = c + G/(kB) (c: per-collective plus 2 hops' latency), the link keeps up with
// backward while k*c + G/B <= 100 ms; then only the last bucket is exposed, t, which falls as k
// grows. Past that k the link falls behind: exposed = T/k + k*t - T.
StepProfile big_profile() {
  auto p = sample_profile(64 << 20);
  p.backward = 0.1;
  return p;
}

TEST(Planner, BestBucketGrowsWithPerCollectiveCost) {
  const auto p = big_profile();
  // c = 100 us: k*c <= 46.3 ms allows k <= 463, so k = 256 (256 KiB) keeps up and exposes
  // 0.1 + 53.687/256 = 0.30972 ms; k = 512 (128 KiB) falls behind: 0.1953 + 512 * 0.20486 - 100
  // = 5.08 ms; k = 128 (512 KiB) exposes 0.1 + 0.41943 = 0.51943 ms. Best: 256 KiB.
  const auto low = best_bucket(p, 2, ten_gbit(0, 100e-6), true);
  EXPECT_EQ(low.bucket_bytes, 256 << 10);
  EXPECT_EQ(low.buckets, 256);
  EXPECT_NEAR(low.exposed_seconds, 100e-6 + 67108864.0 / 1.25e9 / 256, 1e-12);
  // c = 1 ms: k <= 46.3, so k = 32 (2 MiB) exposes 1 + 1.6777 = 2.6777 ms; k = 64 (1 MiB) falls
  // behind: 1.5625 + 64 * 1.83886 - 100 = 19.25 ms; k = 16 (4 MiB): 1 + 3.3554 = 4.3554 ms.
  const auto high = best_bucket(p, 2, ten_gbit(0, 1e-3), true);
  EXPECT_EQ(high.bucket_bytes, 2 << 20);
  EXPECT_NEAR(high.exposed_seconds, 1e-3 + 67108864.0 / 1.25e9 / 32, 1e-12);
}

TEST(Planner, BestBucketGrowsWithLatency) {
  const auto p = big_profile();
  // No per-collective cost; 2 workers pay 2 hops: 50 us per hop is the c = 100 us case above,
  // 500 us per hop the c = 1 ms case.
  EXPECT_EQ(best_bucket(p, 2, ten_gbit(50e-6, 0), true).bucket_bytes, 256 << 10);
  EXPECT_EQ(best_bucket(p, 2, ten_gbit(500e-6, 0), true).bucket_bytes, 2 << 20);
}

TEST(Planner, BestBucketWithoutOverlapIsOneBucket) {
  // Every bucket waits for backward's end: more buckets only add fixed costs.
  const auto best = best_bucket(big_profile(), 8, ten_gbit(20e-6, 50e-6), false);
  EXPECT_EQ(best.bucket_bytes, 64 << 20);
  EXPECT_EQ(best.buckets, 1);
}

TEST(Planner, CandidateBuckets) {
  EXPECT_EQ(candidate_buckets(1 << 20),
            (std::vector<std::int64_t>{64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20}));
  EXPECT_EQ(candidate_buckets(300'000),
            (std::vector<std::int64_t>{64 << 10, 128 << 10, 256 << 10, 300'000}));
  EXPECT_EQ(candidate_buckets(1000), (std::vector<std::int64_t>{1000}));
}

TEST(Planner, PredictRejectsBadArguments) {
  const auto p = sample_profile(1000);
  EXPECT_THROW(predict(p, 0, ten_gbit(0, 0), 100, true), ConfigError);
  EXPECT_THROW(predict(p, 2, ten_gbit(0, 0), 0, true), ConfigError);
  EXPECT_THROW(predict(p, 2, Link{0, 0, 0}, 100, true), ConfigError);
}

TEST(Planner, ParseBandwidth) {
  EXPECT_DOUBLE_EQ(parse_bandwidth("25Gbit"), 3.125e9);
  EXPECT_DOUBLE_EQ(parse_bandwidth("100Mbit"), 12.5e6);
  EXPECT_DOUBLE_EQ(parse_bandwidth("800mbit"), 100e6); // tc's spelling
  EXPECT_DOUBLE_EQ(parse_bandwidth("956.5Mbit"), 956.5e6 / 8);
  EXPECT_DOUBLE_EQ(parse_bandwidth("10Gbps"), 1.25e9);
  EXPECT_DOUBLE_EQ(parse_bandwidth("1Gb/s"), 1.25e8);
  EXPECT_DOUBLE_EQ(parse_bandwidth("1.5GB/s"), 1.5e9);
  EXPECT_DOUBLE_EQ(parse_bandwidth("800MB/s"), 8e8);
  EXPECT_DOUBLE_EQ(parse_bandwidth("100MBps"), 1e8);
  EXPECT_DOUBLE_EQ(parse_bandwidth("1GiB/s"), 1073741824.0);
  EXPECT_DOUBLE_EQ(parse_bandwidth("2 Gbit"), 2.5e8);
}

TEST(Planner, ParseBandwidthErrorsNameTheValueAndTheForms) {
  for (const char* bad : {"25", "25Gb", "fast", "-1Gbit", "0Gbit", "25Xbit", "25Gbits/s", "",
                          "infGbit", "nanGbit", "0x10Gbit", "1e999Gbit", "25 Gbit/sec"}) {
    const auto message = message_of([&] { parse_bandwidth(bad, "--link"); });
    EXPECT_NE(message.find("--link \"" + std::string(bad) + "\""), std::string::npos) << message;
    EXPECT_NE(message.find("25Gbit"), std::string::npos) << message;
    EXPECT_NE(message.find("1.5GB/s"), std::string::npos) << message;
  }
}

TEST(Planner, ParseDuration) {
  EXPECT_DOUBLE_EQ(parse_duration("20us"), 20e-6);
  EXPECT_DOUBLE_EQ(parse_duration("20\xC2\xB5s"), 20e-6); // µs
  EXPECT_DOUBLE_EQ(parse_duration("1ms"), 1e-3);
  EXPECT_DOUBLE_EQ(parse_duration("1.5ms"), 1.5e-3);
  EXPECT_DOUBLE_EQ(parse_duration("0.5s"), 0.5);
  EXPECT_DOUBLE_EQ(parse_duration("500ns"), 500e-9);
  EXPECT_EQ(parse_duration("0"), 0);
}

TEST(Planner, ParseDurationErrors) {
  for (const char* bad : {"20", "-1ms", "20 minutes", "", "fast", "1h", "infms"}) {
    const auto message = message_of([&] { parse_duration(bad, "--latency"); });
    EXPECT_NE(message.find("--latency \"" + std::string(bad) + "\""), std::string::npos) << message;
    EXPECT_NE(message.find("20us"), std::string::npos) << message;
  }
}

// A single-worker run: 2 epochs, the second (steady) one 10 steps.
RunSummary single_worker_run() {
  RunSummary run;
  run.recipe.model = "mlp-wide";
  run.recipe.workers = 1;
  run.recipe.batch_per_replica = 64;
  run.recipe.global_batch = 64;
  run.recipe.gradient_bytes = 23'298'088;
  run.recipe.bytes_per_pack = 4 << 20;
  run.recipe.overlap = false;
  EpochSummary warm;
  warm.epoch = 1;
  warm.steps = 10;
  train::PhaseTimes slow;
  slow.steps = 10;
  slow[train::Phase::kForward] = 5; // start-up: must not count
  slow.step_seconds = 5;
  warm.workers = {slow};
  EpochSummary steady = warm;
  steady.epoch = 2;
  train::PhaseTimes p;
  p.steps = 10;
  p[train::Phase::kInput] = 0.01;
  p[train::Phase::kCopy] = 0.0;
  p[train::Phase::kForward] = 0.1;
  p[train::Phase::kBackward] = 0.2;
  p[train::Phase::kAllReduce] = 0.001;
  p[train::Phase::kOptimizer] = 0.05;
  p[train::Phase::kMetrics] = 0.02;
  p[train::Phase::kCallbacks] = 0.01;
  p.step_seconds = 0.4; // the named phases sum to 0.39 s: 1 ms per step elsewhere
  steady.workers = {p};
  run.epochs = {warm, steady};
  return run;
}

TEST(Planner, StepProfileFromARun) {
  const auto s = step_profile(single_worker_run(), "run.json");
  EXPECT_EQ(s.steps, 10);
  EXPECT_NEAR(s.input, 0.001, kTol);
  EXPECT_NEAR(s.forward, 0.01, kTol);
  EXPECT_NEAR(s.backward, 0.02, kTol);
  EXPECT_NEAR(s.optimizer, 0.005, kTol);
  EXPECT_NEAR(s.metrics, 0.002, kTol);
  EXPECT_NEAR(s.callbacks, 0.001, kTol);
  EXPECT_NEAR(s.other, 0.001, kTol);
  EXPECT_NEAR(s.compute_seconds(), 0.04, kTol); // the measured 0.4 s / 10 steps
  EXPECT_EQ(s.gradient_bytes, 23'298'088);
  EXPECT_EQ(s.bytes_per_pack, 4 << 20);
  EXPECT_FALSE(s.overlap);
  EXPECT_EQ(s.batch_per_worker, 64);
}

TEST(Planner, StepProfileRefusesAMultiWorkerRun) {
  auto run = single_worker_run();
  run.recipe.workers = 2;
  run.epochs.back().workers.push_back(run.epochs.back().workers[0]);
  const auto message = message_of([&] { step_profile(run, "run.json"); });
  EXPECT_NE(message.find("run.json was measured with 2 workers"), std::string::npos) << message;
  EXPECT_NE(message.find("Record one worker alone (no TF_CONFIG: a MirroredStrategy) training the "
                         "model mlp-wide at 64 per replica (RecipeFacts::batch_per_replica)"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("(ProfilerOptions::summary)"), std::string::npos) << message;
}

TEST(Planner, StepProfileNeedsGradientBytesAndSteps) {
  auto run = single_worker_run();
  run.recipe.gradient_bytes = 0;
  EXPECT_NE(message_of([&] { step_profile(run, "run.json"); }).find("gradient_bytes is 0"),
            std::string::npos);
  run = single_worker_run();
  run.epochs.back().workers[0].steps = 0;
  EXPECT_NE(message_of([&] { step_profile(run, "run.json"); }).find("0 measured steps"),
            std::string::npos);
  run.epochs.clear();
  EXPECT_NE(message_of([&] { step_profile(run, "run.json"); }).find("no epochs"),
            std::string::npos);
}

} // namespace
} // namespace flotilla::profile
