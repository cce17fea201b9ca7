// The recipe doctor: each item's verdict follows the run's numbers, and changes when they do.
#include "flotilla/profile/doctor.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <sstream>

namespace flotilla::profile {
namespace {

using train::Phase;
using Status = Finding::Status;

train::PhaseTimes phases(double input_share, double allreduce_share = 0, double comm_share = 0) {
  train::PhaseTimes p;
  p.steps = 100;
  p.step_seconds = 10;
  p[Phase::kInput] = 10 * input_share;
  p[Phase::kAllReduce] = 10 * allreduce_share;
  p.comm_seconds = 10 * comm_share;
  // The rest of the step: mostly forward and backward.
  const double rest = 10 - p[Phase::kInput] - p[Phase::kAllReduce];
  p[Phase::kForward] = rest * 0.3;
  p[Phase::kBackward] = rest * 0.5;
  p[Phase::kOptimizer] = rest * 0.1;
  p[Phase::kMetrics] = rest * 0.05;
  p[Phase::kCallbacks] = rest * 0.05;
  return p;
}

// A run where every recipe item is as it should be on this kind of CPU machine.
RunSummary healthy() {
  RunSummary run;
  RecipeFacts& r = run.recipe;
  r.model = "mlp";
  r.device = "cpu";
  r.batch_per_replica = 256;
  r.global_batch = 256;
  r.max_batch_per_replica = 384;
  r.memory_budget_bytes = 8LL << 30;
  r.peak_memory_bytes = 1LL << 30;
  r.precision = "float32";
  r.base_lr = 0.02;
  r.base_batch = 32;
  r.lr_scaling = "linear";
  r.peak_lr = 0.16; // 0.02 x 256 / 32
  r.schedule = "cosine";
  r.warmup_steps = 100;
  r.total_steps = 200;
  r.threads_per_worker = 2;
  r.cores = 2;
  r.local_workers = 1;
  r.buckets = 1;
  r.bytes_per_pack = 25 << 20;
  r.train_flops_per_sample = 50e6;
  r.matmul_peak_gflops = 70;
  for (int e = 1; e <= 2; ++e) {
    EpochSummary epoch;
    epoch.epoch = e;
    epoch.steps = 100;
    epoch.samples_per_s = 1000; // 50 of 70 GFLOP/s
    epoch.workers = {phases(0.01)};
    run.epochs.push_back(epoch);
  }
  return run;
}

void set_steady(RunSummary& run, std::vector<train::PhaseTimes> workers) {
  run.epochs.back().workers = std::move(workers);
}

Finding find(const std::vector<Finding>& findings, const std::string& item) {
  for (const auto& f : findings) {
    if (f.item == item) return f;
  }
  ADD_FAILURE() << "no finding for " << item;
  return {};
}

Finding item(const RunSummary& run, const std::string& name) {
  return find(diagnose(run), name);
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

bool has_setting(const Finding& f, const std::string& option, const std::string& value) {
  return std::find(f.settings.begin(), f.settings.end(), Setting{option, value}) !=
         f.settings.end();
}

// For failure messages: what the finding advises, in API terms.
std::string advice(const Finding& f) {
  return format_recommendation(f);
}

TEST(Doctor, OneFindingPerRecipeItemAllOkForAHealthyRun) {
  const auto findings = diagnose(healthy());
  std::vector<std::string> items;
  for (const auto& f : findings) items.push_back(f.item);
  std::sort(items.begin(), items.end());
  EXPECT_EQ(items, (std::vector<std::string>{"batch size", "communication", "compiled step",
                                             "compute", "input pipeline", "learning rate",
                                             "mixed precision", "shares by speed",
                                             "threads per worker"}));
  for (const auto& f : findings) {
    if (f.item == "compiled step") {
      EXPECT_EQ(f.status, Status::kUnknown); // nothing to compile with on the CPU
    } else {
      EXPECT_EQ(f.status, Status::kGood) << f.item << ": " << f.evidence;
    }
  }
}

TEST(Doctor, InputPipelineFollowsTheInputBoundShare) {
  RunSummary run = healthy();
  Finding f = item(run, "input pipeline");
  EXPECT_EQ(f.status, Status::kGood);
  EXPECT_TRUE(contains(f.evidence, "1.0% of step time waiting for input (not input-bound"))
      << f.evidence;

  set_steady(run, {phases(0.12)});
  f = item(run, "input pipeline");
  EXPECT_EQ(f.status, Status::kConsider);
  EXPECT_TRUE(contains(f.evidence, "12% of step time waiting for input (moderately input-bound"))
      << f.evidence;
  EXPECT_NEAR(f.gain, 0.12, 1e-9);

  set_steady(run, {phases(0.40)});
  const auto findings = diagnose(run);
  EXPECT_EQ(findings.front().item, "input pipeline");
  EXPECT_EQ(findings.front().status, Status::kAct);
  EXPECT_TRUE(contains(findings.front().evidence, "40% of step time waiting for input (highly"));
  // The plan does not show the chain: every remedy, to be checked.
  EXPECT_EQ(findings.front().recommendation.rfind("where not done yet: parallel map", 0), 0u)
      << findings.front().recommendation;
  EXPECT_TRUE(contains(findings.front().recommendation, "prefetch"));
  EXPECT_TRUE(contains(findings.front().recommendation, "cache"));
  EXPECT_NEAR(findings.front().gain, 0.40, 1e-9);
}

TEST(Doctor, InputPipelineTakesTheWorstWorkerAndTheRemediesItLacks) {
  RunSummary run = healthy();
  set_steady(run, {phases(0.02), phases(0.30)});
  Finding f = item(run, "input pipeline");
  EXPECT_EQ(f.status, Status::kAct);
  EXPECT_TRUE(contains(f.evidence, "30%")) << f.evidence;
  EXPECT_TRUE(contains(f.evidence, "worst is worker 1, the chief 2.0%")) << f.evidence;
  // A pipeline that already caches and prefetches is not told to.
  run.recipe.input_pipeline = "DATA: cache(memory) -> batch(256) -> map(parallel=-1) -> prefetch";
  f = item(run, "input pipeline");
  EXPECT_FALSE(contains(f.recommendation, "Dataset::cache()")) << f.recommendation;
  EXPECT_FALSE(contains(f.recommendation, "Dataset::prefetch(")) << f.recommendation;
  EXPECT_TRUE(contains(f.recommendation, "pipeline threads")) << f.recommendation;
  EXPECT_FALSE(contains(f.recommendation, "where not done yet")) << f.recommendation;
  run.recipe.input_pipeline = "DATA: batch(256) -> map(parallel=1)";
  f = item(run, "input pipeline");
  EXPECT_EQ(f.recommendation.rfind("parallel map", 0), 0u) << f.recommendation;
  EXPECT_TRUE(contains(f.recommendation, "parallel map")) << f.recommendation;
  EXPECT_TRUE(contains(f.recommendation, "cache the decoded data in memory (Dataset::cache())"))
      << f.recommendation;
  EXPECT_TRUE(f.settings.empty()) << advice(f); // remedies in the code, not options
}

TEST(Doctor, MixedPrecisionMatchesTheHardware) {
  RunSummary run = healthy();
  Finding f = item(run, "mixed precision");
  EXPECT_EQ(f.status, Status::kGood);
  EXPECT_TRUE(contains(f.evidence, "no AVX512-BF16/AMX")) << f.evidence;
  EXPECT_TRUE(f.recommendation.empty());
  EXPECT_TRUE(f.settings.empty());

  run.recipe.precision = "mixed_bfloat16"; // on the same CPU: emulated, slower
  f = item(run, "mixed precision");
  EXPECT_EQ(f.status, Status::kAct);
  EXPECT_EQ(f.settings, (std::vector<Setting>{{"train::set_global_policy", "float32"}}))
      << advice(f);
  EXPECT_TRUE(contains(f.recommendation, "train::fastest_policy")) << f.recommendation;
  EXPECT_NEAR(f.gain, 0.5 * 0.8 * 0.99, 1e-9); // half of forward + backward

  run.recipe.hardware_bf16 = true; // a CPU with AMX: now bf16 is right ...
  f = item(run, "mixed precision");
  EXPECT_EQ(f.status, Status::kGood);
  run.recipe.precision = "float32"; // ... and float32 is not
  f = item(run, "mixed precision");
  EXPECT_EQ(f.status, Status::kAct);
  EXPECT_TRUE(has_setting(f, "train::set_global_policy", "mixed_bfloat16")) << advice(f);

  run.recipe.device = "cuda:0 (NVIDIA H200)";
  run.recipe.hardware_fp16 = true;
  f = item(run, "mixed precision");
  EXPECT_EQ(f.status, Status::kAct);
  ASSERT_EQ(f.settings.size(), 1u) << advice(f);
  EXPECT_EQ(f.settings[0].option, "train::set_global_policy");
  EXPECT_EQ(f.settings[0].value.rfind("mixed_", 0), 0u) << advice(f);
  run.recipe.precision = "mixed_bfloat16";
  EXPECT_EQ(item(run, "mixed precision").status, Status::kGood);
  run.recipe.hardware_bf16 = false; // a GPU before sm_80 (V100, T4): bfloat16 is the wrong pick
  f = item(run, "mixed precision");
  EXPECT_EQ(f.status, Status::kAct);
  EXPECT_TRUE(contains(f.evidence, "predates native bfloat16")) << f.evidence;
  EXPECT_TRUE(has_setting(f, "train::set_global_policy", "mixed_float16")) << advice(f);
}

TEST(Doctor, CompiledStepSaysPlainlyThatTheCpuHasNone) {
  RunSummary run = healthy();
  run.recipe.jit_compile = true;
  Finding f = item(run, "compiled step");
  EXPECT_EQ(f.status, Status::kUnknown);
  EXPECT_TRUE(contains(f.evidence, "the CUDA-graph step is for CUDA replicas")) << f.evidence;
  EXPECT_TRUE(contains(f.evidence, "on the CPU jit_compile is the compile step")) << f.evidence;

  run.recipe.device = "cuda:0";
  run.recipe.compiled_step_available = true;
  EXPECT_EQ(item(run, "compiled step").status, Status::kGood);
  run.recipe.jit_compile = false;
  f = item(run, "compiled step");
  EXPECT_EQ(f.status, Status::kAct);
  EXPECT_TRUE(has_setting(f, "CompileOptions::jit_compile", "true")) << advice(f);
}

TEST(Doctor, BatchSizeAgainstTheLargestThatFits) {
  RunSummary run = healthy();
  Finding f = item(run, "batch size");
  EXPECT_EQ(f.status, Status::kGood); // 256 of 384
  EXPECT_TRUE(contains(f.evidence, "the largest that fits is 384 (67% of it)")) << f.evidence;

  run.recipe.max_batch_per_replica = 4096;
  f = item(run, "batch size");
  EXPECT_EQ(f.status, Status::kAct);
  EXPECT_TRUE(has_setting(f, "RecipeFacts::batch_per_replica", "4096")) << advice(f);
  EXPECT_TRUE(contains(f.recommendation, "with the learning rate scaled linearly"))
      << f.recommendation;
  EXPECT_TRUE(contains(f.recommendation, "x 16) and a warmup")) << f.recommendation;
  EXPECT_FALSE(contains(f.recommendation, "~8k")) << f.recommendation;
  EXPECT_GT(f.gain, 0);
  run.recipe.max_batch_per_replica = 16384; // past linear scaling's known range
  EXPECT_TRUE(contains(item(run, "batch size").recommendation, "global batch past ~8k"));
  run.recipe.max_batch_per_replica = 4096;

  run.recipe.batch_per_replica = 5000;
  f = item(run, "batch size");
  EXPECT_EQ(f.status, Status::kAct);
  EXPECT_TRUE(has_setting(f, "RecipeFacts::batch_per_replica", "4096")) << advice(f);
  EXPECT_EQ(f.recommendation.rfind("or less", 0), 0u) << f.recommendation;

  run.recipe.batch_per_replica = 256;
  run.recipe.max_batch_per_replica = 0; // not searched
  run.recipe.peak_memory_bytes = 6LL << 30;
  f = item(run, "batch size");
  EXPECT_EQ(f.status, Status::kUnknown);
  EXPECT_TRUE(contains(f.recommendation, "the largest batch that fits mlp "
                                         "(profile::search_max_batch)"))
      << f.recommendation;
  run.recipe.peak_memory_bytes = 1LL << 30; // an eighth of the budget
  EXPECT_EQ(item(run, "batch size").status, Status::kConsider);
  run.recipe.peak_memory_bytes = 9LL << 30; // over it
  f = item(run, "batch size");
  EXPECT_EQ(f.status, Status::kAct);
  EXPECT_TRUE(contains(f.evidence, "peak memory 9.00 GiB of a 8.00 GiB budget")) << f.evidence;
}

TEST(Doctor, LearningRateChecksLinearScalingAndWarmup) {
  RunSummary run = healthy();
  Finding f = item(run, "learning rate");
  EXPECT_EQ(f.status, Status::kGood);
  EXPECT_TRUE(contains(f.evidence, "0.16 = 0.02 x 256 / 32")) << f.evidence;

  run.recipe.peak_lr = 0.16 * (1 + 1e-9); // a float's rounding is not a mistake
  EXPECT_EQ(item(run, "learning rate").status, Status::kGood);

  run.recipe.peak_lr = 0.16 * (1 + 1e-4); // outside 1e-6: a rate not computed as claimed
  EXPECT_EQ(item(run, "learning rate").status, Status::kAct);

  run.recipe.peak_lr = 0.2;
  f = item(run, "learning rate");
  EXPECT_EQ(f.status, Status::kAct);
  EXPECT_TRUE(contains(f.evidence, "linear scaling gives 0.02 x 256 / 32 = 0.16, not 0.2"))
      << f.evidence;
  EXPECT_EQ(f.settings, (std::vector<Setting>{{"OptimizerOptions::learning_rate", "0.16"}}))
      << advice(f);

  run.recipe.peak_lr = 0.16;
  run.recipe.warmup_steps = 0; // a batch 8x the base one, two epochs, no warmup
  f = item(run, "learning rate");
  EXPECT_EQ(f.status, Status::kAct);
  // An epoch's worth: the first epoch's 100 steps.
  EXPECT_EQ(f.settings, (std::vector<Setting>{{"CosineDecayOptions::warmup_steps", "100"}}))
      << advice(f);
  EXPECT_TRUE(contains(f.recommendation, "over the first epoch")) << f.recommendation;
  RunSummary one_epoch = run; // the same, in a single epoch: flotilla train warms up only past one
  one_epoch.epochs.erase(one_epoch.epochs.begin());
  one_epoch.epochs.front().steps = one_epoch.recipe.total_steps;
  EXPECT_EQ(item(one_epoch, "learning rate").status, Status::kGood);

  run.recipe.global_batch = run.recipe.batch_per_replica = 64; // 2x the base: no warmup needed
  run.recipe.peak_lr = 0.04;
  EXPECT_EQ(item(run, "learning rate").status, Status::kGood);

  run.recipe.lr_scaling = "none";
  run.recipe.peak_lr = 0.02;
  f = item(run, "learning rate");
  EXPECT_EQ(f.status, Status::kConsider);
  EXPECT_EQ(f.settings, (std::vector<Setting>{{"OptimizerOptions::learning_rate", "0.04"}}))
      << advice(f);
  EXPECT_TRUE(contains(f.recommendation, "scaled linearly with the global batch "
                                         "(train::linear_scaling)"))
      << f.recommendation;
}

TEST(Doctor, ThreadsAgainstCores) {
  RunSummary run = healthy();
  EXPECT_EQ(item(run, "threads per worker").status, Status::kGood);
  run.recipe.local_workers = 2; // 2 threads x 2 workers on 2 cores
  Finding f = item(run, "threads per worker");
  EXPECT_EQ(f.status, Status::kAct);
  EXPECT_TRUE(contains(f.evidence, "2 thread(s) x 2 worker(s) on this machine = 4 for 2 core(s)"))
      << f.evidence;
  EXPECT_EQ(f.settings, (std::vector<Setting>{{"torch::set_num_threads", "1"}})) << advice(f);
  run.recipe.local_workers = 1;
  run.recipe.threads_per_worker = 3; // one more than the cores
  EXPECT_EQ(item(run, "threads per worker").status, Status::kAct);
  run.recipe.threads_per_worker = 2;
  run.recipe.cores = 8;
  f = item(run, "threads per worker");
  EXPECT_EQ(f.status, Status::kConsider);
  EXPECT_EQ(f.settings, (std::vector<Setting>{{"torch::set_num_threads", "8"}})) << advice(f);
  run.recipe.local_workers = 3; // 2 threads is already the fair share of 8 cores among 3
  EXPECT_EQ(item(run, "threads per worker").status, Status::kGood);
}

TEST(Doctor, CommunicationFollowsTheExposedShare) {
  RunSummary run = healthy();
  Finding f = item(run, "communication");
  EXPECT_EQ(f.status, Status::kGood);
  EXPECT_TRUE(contains(f.evidence, "nothing crosses a network")) << f.evidence;

  run.recipe.workers = 2;
  run.recipe.gradient_bytes = 1 << 20;
  set_steady(run, {phases(0.01, 0.02, 0.10), phases(0.01, 0.01, 0.10)});
  f = item(run, "communication");
  EXPECT_EQ(f.status, Status::kGood);
  EXPECT_TRUE(contains(f.evidence, "all-reduce wait 2.0% of step time, 80% hidden")) << f.evidence;

  set_steady(run, {phases(0.01, 0.10, 0.20), phases(0.01, 0.10, 0.20)});
  EXPECT_EQ(item(run, "communication").status, Status::kConsider);

  run.recipe.overlap = false;
  set_steady(run, {phases(0.01, 0.30, 0.30), phases(0.01, 0.30, 0.30)});
  f = item(run, "communication");
  EXPECT_EQ(f.status, Status::kAct);
  EXPECT_TRUE(contains(f.evidence, "0.0% hidden")) << f.evidence;
  EXPECT_EQ(f.settings, (std::vector<Setting>{{"CommunicationOptions::overlap", "true"},
                                              {"CommunicationOptions::compression", "bf16"}}))
      << advice(f);
  EXPECT_TRUE(contains(f.recommendation, "profile::predict")) << f.recommendation;

  run.recipe.overlap = true;
  run.recipe.compression = "bf16";
  f = item(run, "communication");
  EXPECT_TRUE(has_setting(f, "CommunicationOptions::bytes_per_pack", "262144")) << advice(f);
  for (const auto& s : f.settings) {
    EXPECT_NE(s.option, "CommunicationOptions::compression") << advice(f);
  }
}

// The training's FLOPs (per sample x samples/s per worker) over one worker's measured peak.
// Two workers on equal shares, one whose forward takes twice as long: each global batch divided
// by speed would bring both to the harmonic mean (4/3 of the fast one's), a third off the slow
// one's compute. With --shares auto the same spread is the division at work.
TEST(Doctor, SharesBySpeedWhereTheWorkersForwardPassesDiffer) {
  RunSummary run = healthy();
  run.recipe.workers = 2;
  train::PhaseTimes slow = phases(0.01);
  slow.step_seconds += slow[Phase::kForward]; // the slow worker's step, the others waiting
  slow[Phase::kForward] *= 2;
  set_steady(run, {phases(0.01), slow});
  Finding f = item(run, "shares by speed");
  EXPECT_EQ(f.status, Status::kConsider) << f.evidence;
  EXPECT_TRUE(contains(f.evidence, "up to 2.00x as long as the fastest's, on shares equal"))
      << f.evidence;
  EXPECT_TRUE(has_setting(f, "FitOptions::balance_shares_every", "true")) << advice(f);
  // A third of the forward's time, over forward and backward's share of the slow step.
  EXPECT_GT(f.gain, 0.2);
  EXPECT_LT(f.gain, 1.0 / 3);
  run.recipe.shares = "auto";
  f = item(run, "shares by speed");
  EXPECT_EQ(f.status, Status::kGood) << f.evidence;
  // On CUDA the forward times are the kernels' launches, and auto is refused: no advice.
  run.recipe.shares = "equal";
  run.recipe.device = "cuda:0 (NVIDIA H200)";
  f = item(run, "shares by speed");
  EXPECT_EQ(f.status, Status::kUnknown) << f.evidence;
  EXPECT_TRUE(f.settings.empty()) << advice(f);
  run.recipe.device = "cpu";
  // Where the fit cannot divide by speed (per-replica elastic batches, say), the spread is still
  // real, but the advice names the reason instead of a setting the fit would refuse.
  run.recipe.shares_refused = "--elastic-batch per-replica keeps every replica's batch";
  f = item(run, "shares by speed");
  EXPECT_EQ(f.status, Status::kConsider) << f.evidence;
  EXPECT_TRUE(f.settings.empty()) << advice(f);
  EXPECT_TRUE(contains(f.recommendation, "find what slows the slow worker")) << advice(f);
  EXPECT_TRUE(contains(f.recommendation, "--elastic-batch per-replica keeps")) << advice(f);
  run.recipe.shares_refused.clear();
  // Even workers: nothing to gain.
  run.recipe.shares = "equal";
  set_steady(run, {phases(0.01), phases(0.01)});
  EXPECT_EQ(item(run, "shares by speed").status, Status::kGood);
}

TEST(Doctor, ComputeIsTheShareOfTheMeasuredMatmulPeak) {
  RunSummary run = healthy();
  Finding f = item(run, "compute");
  EXPECT_EQ(f.status, Status::kGood) << f.evidence;
  EXPECT_EQ(f.evidence, "71% of this CPU's float32 matmul peak: 50.0 of 70.0 GFLOP/s per worker, "
                        "50 MFLOP per sample");
  // Two workers share the global samples/s: half each.
  run.recipe.workers = 2;
  run.recipe.precision = "mixed_bfloat16";
  run.recipe.matmul_peak_gflops = 200;
  f = item(run, "compute");
  EXPECT_EQ(f.status, Status::kConsider);
  EXPECT_EQ(f.evidence, "12% of this CPU's bf16 matmul peak: 25.0 of 200.0 GFLOP/s per worker, "
                        "50 MFLOP per sample");
  EXPECT_TRUE(contains(f.recommendation, "RecipeFacts::batch_per_replica")) << advice(f);
  EXPECT_EQ(f.gain, 0); // not a share of step time anyone can promise
  run.recipe.train_flops_per_sample = 0;
  f = item(run, "compute");
  EXPECT_EQ(f.status, Status::kUnknown);
  EXPECT_TRUE(contains(f.evidence, "RecipeFacts::train_flops_per_sample")) << f.evidence;
}

TEST(Doctor, MostValuableFirst) {
  RunSummary run = healthy();
  run.recipe.peak_lr = 0.5;             // act, no speed to gain
  set_steady(run, {phases(0.25)});      // act, a quarter of the step
  run.recipe.cores = 4;                 // consider
  run.recipe.max_batch_per_replica = 0; // unknown (not searched)
  run.recipe.peak_memory_bytes = 6LL << 30;
  const auto findings = diagnose(run);
  std::vector<std::string> order;
  for (const auto& f : findings) order.push_back(f.item);
  EXPECT_EQ(order, (std::vector<std::string>{"input pipeline", "learning rate",
                                             "threads per worker", "compiled step", "batch size",
                                             "mixed precision", "communication",
                                             "shares by speed", "compute"}));
  auto rank = [](Status s) {
    return s == Status::kAct ? 0 : s == Status::kConsider ? 1 : s == Status::kUnknown ? 2 : 3;
  };
  for (std::size_t i = 1; i < findings.size(); ++i) {
    const auto& a = findings[i - 1];
    const auto& b = findings[i];
    EXPECT_TRUE(rank(a.status) < rank(b.status) ||
                (rank(a.status) == rank(b.status) && a.gain >= b.gain))
        << a.item << " before " << b.item;
  }
}

TEST(Doctor, FormatFindingsIsAShortReport) {
  RunSummary run = healthy();
  set_steady(run, {phases(0.31)});
  const std::string text = format_findings(diagnose(run));
  std::istringstream lines(text);
  std::string line;
  std::vector<std::string> all;
  while (std::getline(lines, line)) all.push_back(line);
  ASSERT_GE(all.size(), 4u) << text;
  EXPECT_EQ(all[0], "Recipe doctor (most valuable first):");
  EXPECT_EQ(all[1], "  [act] input pipeline: 31% of step time waiting for input (highly "
                    "input-bound)");
  EXPECT_EQ(all[2], "        -> where not done yet: parallel map (Dataset::map(fn, "
                    "data::kAutotune)); prefetch (Dataset::prefetch(data::kAutotune)); cache the "
                    "decoded data in memory (Dataset::cache()); more pipeline threads "
                    "(data::Options::private_threadpool_size), or fewer for the step "
                    "(torch::set_num_threads); fewer or cheaper augmentation ops (up to ~31% of "
                    "step time)");
  // Every item once; "ok" items carry no recommendation line.
  for (const char* name : {"input pipeline", "mixed precision", "compiled step", "batch size",
                           "learning rate", "threads per worker", "communication",
                           "shares by speed", "compute"}) {
    EXPECT_EQ(std::count_if(all.begin(), all.end(),
                            [&](const std::string& l) {
                              return contains(l, std::string("] ") + name + ":");
                            }),
              1)
        << name;
  }
  const auto recommendation_lines =
      std::count_if(all.begin(), all.end(), [](const std::string& l) { return contains(l, "->"); });
  EXPECT_EQ(recommendation_lines, 2); // input pipeline and the CPU's missing compiled step
  EXPECT_EQ(all.size(), 1u + 9u + 2u);
  EXPECT_TRUE(contains(text, "  [ok] mixed precision: float32 on cpu")) << text;
  EXPECT_EQ(format_findings({}), "Recipe doctor (most valuable first):\n  nothing to check\n");
}

TEST(Doctor, SettingsShowInApiTermsOrAsTheCallersFormatSaysWhereItSaysSo) {
  EXPECT_EQ(to_string(Setting{"CompileOptions::jit_compile", "true"}),
            "CompileOptions::jit_compile = true");
  EXPECT_EQ(to_string(Setting{"data::Options::private_threadpool_size", "2"}),
            "data::Options::private_threadpool_size = 2");
  EXPECT_EQ(to_string(Setting{"train::set_global_policy", "mixed_bfloat16"}),
            "train::set_global_policy(mixed_bfloat16)");
  EXPECT_EQ(to_string(Setting{"torch::set_num_threads", "4"}), "torch::set_num_threads(4)");

  RunSummary run = healthy();
  run.recipe.local_workers = 2; // oversubscribed: one setting and a reason
  run.recipe.overlap = false;   // two settings and three steps
  run.recipe.workers = 2;
  run.recipe.gradient_bytes = 1 << 20;
  set_steady(run, {phases(0.01, 0.30, 0.30), phases(0.01, 0.30, 0.30)});
  const auto findings = diagnose(run);
  const std::string text = format_findings(findings);
  EXPECT_TRUE(contains(text, "        -> torch::set_num_threads(1): this machine's cores shared "
                             "among its workers (up to ~"))
      << text;
  EXPECT_TRUE(contains(text, "        -> CommunicationOptions::overlap = true, "
                             "CommunicationOptions::compression = bf16: overlap the all-reduces "
                             "with backward; half the bytes on the wire (fp16 works too); "
                             "profile::predict on this run's profile says whether more workers "
                             "still pay (up to ~"))
      << text;

  // A program's own rendering: each setting through one function, the words through another.
  FindingFormat flags;
  flags.setting = [](const Setting& s) { return "<" + s.option + "=" + s.value + ">"; };
  flags.text = [](const std::string& t) { return "[" + t + "]"; };
  const Finding threads = find(findings, "threads per worker");
  EXPECT_EQ(format_recommendation(threads, flags),
            "<torch::set_num_threads=1>: [this machine's cores shared among its workers]");
  EXPECT_EQ(format_recommendation(find(findings, "mixed precision"), flags), ""); // ok: nothing
  const std::string rendered = format_findings(findings, flags);
  EXPECT_TRUE(contains(rendered, "        -> <CommunicationOptions::overlap=true>, "
                                 "<CommunicationOptions::compression=bf16>: [overlap the "))
      << rendered;
  // No setting left in API terms on a recommendation line (evidence lines may say " = ").
  std::istringstream lines(rendered);
  for (std::string line; std::getline(lines, line);) {
    if (contains(line, "->")) EXPECT_FALSE(contains(line, " = ")) << line;
  }
}

} // namespace
} // namespace flotilla::profile
