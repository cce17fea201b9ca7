#include "flotilla/profile/doctor.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdarg>
#include <cstdio>

namespace flotilla::profile {

namespace {

using train::Phase;
using train::PhaseTimes;
using Status = Finding::Status;

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char* fmt, ...) {
  char buf[512];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, args);
  va_end(args);
  return buf;
}

// A share of step time as a percentage: one decimal below 10% where the difference between
// 1.2% and 1.8% matters, whole percents above.
std::string percent(double share) {
  const double p = share * 100;
  return p < 10 ? format("%.1f%%", p) : format("%.0f%%", p);
}

std::string bytes(std::int64_t n) {
  const double b = static_cast<double>(n);
  if (b >= 1024.0 * 1024 * 1024) return format("%.2f GiB", b / (1024.0 * 1024 * 1024));
  if (b >= 1024.0 * 1024) return format("%.1f MiB", b / (1024.0 * 1024));
  if (b >= 1024.0) return format("%.1f KiB", b / 1024.0);
  return format("%lld B", static_cast<long long>(n));
}

std::string num(double v) {
  return format("%g", v);
}
std::string num(std::int64_t v) {
  return std::to_string(v);
}

// Advice that names the policy to set as a Setting of its own; this says where it comes from.
constexpr const char* kFastestPolicy = "the policy train::fastest_policy picks for the device";

Setting policy(const char* name) {
  return {"train::set_global_policy", name};
}

bool on_cuda(const RecipeFacts& r) {
  return r.device.rfind("cuda", 0) == 0;
}
bool on_cpu(const RecipeFacts& r) {
  return r.device.empty() || r.device.rfind("cpu", 0) == 0;
}

// The share of step time of one phase (or a sum of phases) on the worker where it is largest:
// in a synchronous step the slowest worker sets everyone's pace.
double worst_share(const std::vector<PhaseTimes>& workers, std::initializer_list<Phase> phases) {
  double worst = 0;
  for (const auto& w : workers) {
    if (w.step_seconds <= 0) continue;
    double s = 0;
    for (Phase p : phases) s += w[p];
    worst = std::max(worst, s / w.step_seconds);
  }
  return worst;
}

bool has_steps(const std::vector<PhaseTimes>& workers) {
  return std::any_of(workers.begin(), workers.end(),
                     [](const PhaseTimes& w) { return w.step_seconds > 0 && w.steps > 0; });
}

// Forward + backward: the part of a step that lower precision and a compiled step speed up.
double compute_share(const std::vector<PhaseTimes>& workers) {
  return worst_share(workers, {Phase::kForward, Phase::kBackward});
}

Finding input_pipeline(const RunSummary& run, const std::vector<PhaseTimes>& workers) {
  Finding f;
  f.item = "input pipeline";
  if (!has_steps(workers)) {
    f.status = Status::kUnknown;
    f.evidence = "no step phases were recorded";
    f.recommendation = "record a profile of the run (ProfilerOptions::summary)";
    return f;
  }
  double worst = 0;
  std::size_t worst_rank = 0;
  for (std::size_t i = 0; i < workers.size(); ++i) {
    if (workers[i].input_share() > worst) {
      worst = workers[i].input_share();
      worst_rank = i;
    }
  }
  const train::InputBound bound = train::classify_input_bound(worst);
  f.evidence = percent(worst) + " of step time waiting for input (" + train::to_string(bound);
  if (workers.size() > 1) {
    f.evidence += worst_rank == 0 ? "; the chief is the worst worker"
                                  : "; worst is worker " + std::to_string(worst_rank) +
                                        ", the chief " + percent(workers[0].input_share());
  }
  f.evidence += ")";
  if (bound == train::InputBound::kNo) {
    f.status = Status::kGood;
    f.gain = worst;
    return f;
  }
  f.status = bound == train::InputBound::kHighly ? Status::kAct : Status::kConsider;
  // All of the wait is won back once the pipeline keeps ahead of the step.
  f.gain = worst;
  // A plan that spells out the chain (Dataset::plan(): "batch(...) -> map(parallel=...) ->
  // prefetch") says which of TF's remedies are missing; any other (or none) says nothing, so
  // then all of them are listed, for the user to check.
  const std::string& plan = run.recipe.input_pipeline;
  const bool chain_known = plan.find("map(") != std::string::npos ||
                           plan.find("batch(") != std::string::npos ||
                           plan.find("prefetch") != std::string::npos;
  std::vector<std::string> steps;
  if (!chain_known || plan.find("parallel=1)") != std::string::npos) {
    steps.push_back("parallel map (Dataset::map(fn, data::kAutotune))");
  }
  if (!chain_known || plan.find("prefetch") == std::string::npos) {
    steps.push_back("prefetch (Dataset::prefetch(data::kAutotune))");
  }
  if (!chain_known || plan.find("cache") == std::string::npos) {
    steps.push_back("cache the decoded data in memory (Dataset::cache())");
  }
  steps.push_back("more pipeline threads (data::Options::private_threadpool_size), or fewer "
                  "for the step (torch::set_num_threads)");
  steps.push_back("fewer or cheaper augmentation ops");
  if (!chain_known) f.recommendation = "where not done yet: ";
  f.recommendation += steps[0];
  for (std::size_t i = 1; i < steps.size(); ++i) f.recommendation += "; " + steps[i];
  return f;
}

Finding mixed_precision(const RecipeFacts& r, const std::vector<PhaseTimes>& workers) {
  Finding f;
  f.item = "mixed precision";
  const std::string device = r.device.empty() ? "cpu" : r.device;
  const std::string hw = std::string("bf16 ") + (r.hardware_bf16 ? "native" : "not native") +
                         ", fp16 " + (r.hardware_fp16 ? "fast" : "not fast");
  f.evidence = r.precision + " on " + device + " (" + hw + ")";
  // Reduced precision roughly halves the time of the matrix work on hardware made for it; on
  // hardware without it, bf16 is emulated and costs about as much again.
  const double half_compute = 0.5 * compute_share(workers);
  const bool is_float32 = r.precision == "float32";
  const bool is_fp16 = r.precision == "mixed_float16";
  const bool is_bf16 = r.precision == "mixed_bfloat16";
  if (!is_float32 && !is_fp16 && !is_bf16) {
    f.status = Status::kUnknown;
    f.evidence = "precision \"" + r.precision + "\" is not one flotilla knows";
    f.recommendation = kFastestPolicy;
    return f;
  }
  if (on_cuda(r)) {
    if (is_float32) {
      f.status = Status::kAct;
      f.gain = half_compute;
      f.settings = {policy(r.hardware_bf16 ? "mixed_bfloat16" : "mixed_float16")};
      f.recommendation = r.hardware_bf16
                             ? "tensor cores, no loss scaling needed (mixed_float16 works too)"
                             : "tensor cores; dynamic loss scaling is applied";
      f.evidence += ": float32 leaves the GPU's tensor cores idle";
    } else if (is_bf16 && !r.hardware_bf16) {
      f.status = Status::kAct;
      f.gain = half_compute;
      f.evidence += ": this GPU predates native bfloat16 (sm_80), so bfloat16 runs slowly";
      f.settings = {policy("mixed_float16")};
      f.recommendation =
          std::string("tensor cores; dynamic loss scaling is applied (") + kFastestPolicy + ")";
    } else if (is_fp16 && !r.loss_scaling) {
      f.status = Status::kConsider;
      f.evidence += ", without loss scaling: small float16 gradients underflow to zero";
      f.settings = {policy("mixed_bfloat16")};
      f.recommendation = std::string("needs no loss scale") +
                         (r.hardware_bf16 ? "" : " (on an sm_80+ GPU)") +
                         "; or keep the dynamic loss scale on (CompileOptions::loss_scale unset: "
                         "the default for mixed_float16)";
    } else {
      f.status = Status::kGood;
      f.evidence += ": reduced precision on hardware built for it";
    }
    return f;
  }
  if (!on_cpu(r)) {
    f.status = Status::kUnknown;
    f.evidence += ": not a device the doctor knows";
    f.recommendation = kFastestPolicy;
    return f;
  }
  if (is_float32) {
    if (r.hardware_bf16) {
      f.status = Status::kAct;
      f.gain = half_compute;
      f.evidence += ": this CPU computes bfloat16 natively (AVX512-BF16/AMX)";
      f.settings = {policy("mixed_bfloat16")};
      f.recommendation = kFastestPolicy;
    } else {
      f.status = Status::kGood;
      f.evidence += ": the right choice, since this CPU has no AVX512-BF16/AMX and bfloat16 "
                    "would be emulated, slower than float32";
    }
  } else if (is_bf16 && r.hardware_bf16) {
    f.status = Status::kGood;
    f.evidence += ": this CPU computes bfloat16 natively";
  } else {
    f.status = Status::kAct;
    f.gain = half_compute;
    f.evidence += is_fp16 ? ": a CPU has no fast float16 arithmetic"
                          : ": this CPU has no AVX512-BF16/AMX, so bfloat16 is emulated and "
                            "slower than float32";
    f.settings = {policy(r.hardware_bf16 ? "mixed_bfloat16" : "float32")};
    f.recommendation = kFastestPolicy;
  }
  return f;
}

Finding compiled_step(const RecipeFacts& r, const std::vector<PhaseTimes>& workers) {
  Finding f;
  f.item = "compiled step";
  f.evidence = std::string("jit_compile ") + (r.jit_compile ? "requested" : "off") + "; ";
  if (!r.compiled_step_available) {
    // Nothing to measure against, and nothing the user can switch on: say so, no verdict.
    f.status = Status::kUnknown;
    f.evidence += on_cuda(r) ? "no CUDA-graph step for this setup (it needs one GPU per worker "
                               "and no gradient accumulation): every step runs eagerly"
                             : "the CUDA-graph step is for CUDA replicas; on the CPU jit_compile "
                               "is the compile step, which rewrites the model for flotilla's "
                               "kernels (on unless jit_compile is false; the recipe's "
                               "kernel lines say what ran)";
    if (on_cuda(r)) f.settings = {{"CompileOptions::jit_compile", "true"}};
    f.recommendation = on_cuda(r) ? "with one GPU per worker (strategy::parse_devices(\"cuda:N\"), "
                                    "a worker per GPU), where the batch shapes are fixed"
                                  : "none available on the CPU";
    return f;
  }
  if (r.jit_compile) {
    f.status = Status::kGood;
    f.evidence += "the compiled step is in use";
    return f;
  }
  f.status = Status::kAct;
  f.evidence += "a compiled (CUDA-graph) step is available on this device but not used";
  // A CUDA graph removes the per-kernel launch cost; for small models that is a good part of
  // forward + backward. A conservative fifth of it.
  f.gain = 0.2 * compute_share(workers);
  f.settings = {{"CompileOptions::jit_compile", "true"}};
  f.recommendation = "the step's forward, backward and all-reduce replayed as a CUDA graph";
  return f;
}

Finding batch_size(const RunSummary& run, const std::vector<PhaseTimes>& workers) {
  const RecipeFacts& r = run.recipe;
  Finding f;
  f.item = "batch size";
  const std::string model = r.model.empty() ? "<model>" : r.model;
  f.evidence = num(r.batch_per_replica) + " per replica (global " + num(r.global_batch) + ")";
  const bool memory_known = r.peak_memory_bytes > 0 && r.memory_budget_bytes > 0;
  if (memory_known) {
    f.evidence += ", peak memory " + bytes(r.peak_memory_bytes) + " of a " +
                  bytes(r.memory_budget_bytes) + " budget";
  } else if (r.peak_memory_bytes > 0) {
    f.evidence += ", peak memory " + bytes(r.peak_memory_bytes);
  } else if (r.memory_budget_bytes > 0) {
    f.evidence += ", a " + bytes(r.memory_budget_bytes) + " budget";
  }
  // The phases that cost the same per step whatever the batch: a larger batch spreads them over
  // more examples.
  const double fixed = worst_share(
      workers, {Phase::kOptimizer, Phase::kMetrics, Phase::kCallbacks, Phase::kAllReduce});
  if (r.batch_per_replica <= 0) {
    f.status = Status::kUnknown;
    f.evidence = "the batch was not recorded";
    f.recommendation =
        "search the largest batch that fits " + model + " (profile::search_max_batch)";
    return f;
  }
  if (memory_known && r.peak_memory_bytes > r.memory_budget_bytes) {
    f.status = Status::kAct;
    f.evidence += ": over the budget";
    f.recommendation = "lower the batch per replica (RecipeFacts::batch_per_replica): "
                       "profile::search_max_batch finds the largest that fits " +
                       model;
    return f;
  }
  if (r.max_batch_per_replica <= 0) {
    if (memory_known && r.peak_memory_bytes * 2 < r.memory_budget_bytes) {
      f.status = Status::kConsider;
      f.evidence += ": less than half the budget used";
      f.gain = fixed * 0.5;
    } else {
      f.status = Status::kUnknown;
      f.evidence += "; the largest batch that fits was not searched";
    }
    f.recommendation = "search the largest batch that fits " + model +
                       " (profile::search_max_batch), then train at that batch per replica "
                       "(RecipeFacts::batch_per_replica) with the learning rate scaled linearly";
    return f;
  }
  const std::int64_t max = r.max_batch_per_replica;
  f.evidence += ", the largest that fits is " + num(max);
  if (r.batch_per_replica > max) {
    f.status = Status::kAct;
    f.evidence += ": above what fits";
    f.settings = {{"RecipeFacts::batch_per_replica", num(max)}};
    f.recommendation = "or less: the largest batch per replica that fits";
    return f;
  }
  const double used = static_cast<double>(r.batch_per_replica) / static_cast<double>(max);
  f.evidence += " (" + percent(used) + " of it)";
  if (used >= 0.5) {
    f.status = Status::kGood;
    return f;
  }
  f.status = Status::kAct;
  f.gain = fixed * (1 - used);
  const double factor = 1 / used;
  f.settings = {{"RecipeFacts::batch_per_replica", num(max)}};
  f.recommendation = "with the learning rate scaled linearly (train::linear_scaling: peak rate x " +
                     (factor < 10 ? format("%.2g", factor) : format("%.0f", factor)) +
                     ") and a warmup (CosineDecayOptions::warmup_steps)";
  const std::int64_t replicas =
      r.global_batch > 0 ? std::max<std::int64_t>(1, r.global_batch / r.batch_per_replica)
                         : std::max(1, r.workers) * std::max(1, r.replicas_per_worker);
  // Goyal et al. kept accuracy with linear scaling and warmup up to a global batch of 8k.
  if (max * replicas > 8192) {
    f.recommendation += "; a global batch past ~8k often costs accuracy even so: check the "
                        "validation loss, or stop at a smaller batch";
  }
  return f;
}

Finding learning_rate(const RunSummary& run) {
  const RecipeFacts& r = run.recipe;
  Finding f;
  f.item = "learning rate";
  if (r.peak_lr <= 0 || r.lr_scaling.empty()) {
    f.status = Status::kUnknown;
    f.evidence = "the learning rate and its scaling were not recorded";
    f.recommendation = "scale a base rate tuned for a base batch linearly with the global batch "
                       "(train::linear_scaling)";
    return f;
  }
  const bool base_known = r.base_lr > 0 && r.base_batch > 0 && r.global_batch > 0;
  const double expected =
      base_known ? r.base_lr * static_cast<double>(r.global_batch) / r.base_batch : 0;
  const bool linear_ok =
      r.lr_scaling == "linear" && base_known && std::abs(r.peak_lr - expected) <= 1e-6 * expected;
  f.evidence = "peak " + num(r.peak_lr);
  if (linear_ok) {
    f.evidence += " = " + num(r.base_lr) + " x " + num(r.global_batch) + " / " + num(r.base_batch) +
                  " (linear scaling)";
  } else {
    f.evidence += ", scaling " + r.lr_scaling;
  }
  if (!r.schedule.empty()) f.evidence += ", " + r.schedule + " schedule";
  f.evidence += ", " + num(r.warmup_steps) + " warmup step(s) of " + num(r.total_steps);
  if (r.lr_scaling == "linear" && base_known) {
    if (!linear_ok) {
      f.status = Status::kAct;
      f.evidence += ": linear scaling gives " + num(r.base_lr) + " x " + num(r.global_batch) +
                    " / " + num(r.base_batch) + " = " + num(expected) + ", not " + num(r.peak_lr);
      f.settings = {{"OptimizerOptions::learning_rate", num(expected)}};
      f.recommendation = "the peak rate linear scaling gives (train::linear_scaling)";
      return f;
    }
  } else if (r.lr_scaling == "none" && base_known && r.global_batch > r.base_batch) {
    f.status = Status::kConsider;
    f.evidence += ": the global batch " + num(r.global_batch) + " is " +
                  format("%.3g", static_cast<double>(r.global_batch) / r.base_batch) +
                  "x the base batch, the rate is not";
    f.settings = {{"OptimizerOptions::learning_rate",
                   num(r.base_lr * static_cast<double>(r.global_batch) / r.base_batch)}};
    f.recommendation =
        "the base rate scaled linearly with the global batch (train::linear_scaling)";
    return f;
  }
  // A large rate from the first update diverges (Goyal et al.'s gradual warmup): large means a
  // global batch well beyond what the base rate was tuned for.
  const bool large = base_known ? r.global_batch > r.base_batch * 4 : r.peak_lr >= 0.1;
  const std::int64_t first_epoch_steps = run.epochs.empty() ? 0 : run.epochs.front().steps;
  const bool several_epochs =
      run.epochs.size() > 1 || (first_epoch_steps > 0 && r.total_steps > first_epoch_steps);
  if (large && several_epochs && r.warmup_steps == 0) {
    f.status = Status::kAct;
    f.evidence += ": a large batch starts at the full rate";
    // An epoch of warmup: as many updates as the first epoch's steps (the run does not record
    // gradient accumulation, which would make it fewer).
    f.settings = {{"CosineDecayOptions::warmup_steps",
                   num(first_epoch_steps > 0 ? first_epoch_steps : r.total_steps)}};
    f.recommendation =
        r.schedule == "cosine"
            ? "a linear warmup to the peak over the first epoch, as the recipe does"
            : "a linear warmup over the first epoch, which comes with a cosine schedule "
              "(train::CosineDecay)";
    return f;
  }
  if (r.total_steps > 0 && r.warmup_steps * 2 > r.total_steps) {
    f.status = Status::kConsider;
    f.evidence += ": warmup takes over half of the run";
    f.recommendation = "fewer warmup steps (CosineDecayOptions::warmup_steps), or train longer";
    return f;
  }
  f.status = Status::kGood;
  if (!linear_ok) f.evidence += " (not checked against the batch)";
  return f;
}

Finding threads(const RecipeFacts& r, const std::vector<PhaseTimes>& workers) {
  Finding f;
  f.item = "threads per worker";
  if (r.threads_per_worker <= 0 || r.cores <= 0) {
    f.status = Status::kUnknown;
    f.evidence = "threads or cores were not recorded";
    f.recommendation = "this machine's cores shared among its workers (torch::set_num_threads)";
    return f;
  }
  const int local = std::max(1, r.local_workers);
  const int used = r.threads_per_worker * local;
  f.evidence = num(static_cast<std::int64_t>(r.threads_per_worker)) + " thread(s) x " +
               num(static_cast<std::int64_t>(local)) +
               " worker(s) on this machine = " + num(static_cast<std::int64_t>(used)) + " for " +
               num(static_cast<std::int64_t>(r.cores)) + " core(s)";
  const int fair = std::max(1, r.cores / local);
  if (used > r.cores) {
    f.status = Status::kAct;
    f.evidence += ": oversubscribed, threads wait for each other";
    // Time-sliced threads lose roughly the excess share of the compute.
    f.gain = compute_share(workers) * (1 - static_cast<double>(r.cores) / used);
    f.settings = {{"torch::set_num_threads", std::to_string(fair)}};
    f.recommendation = "this machine's cores shared among its workers";
  } else if (r.threads_per_worker < fair) {
    f.status = Status::kConsider;
    f.evidence += ": " + num(static_cast<std::int64_t>(r.cores - used)) + " core(s) idle";
    f.gain = compute_share(workers) * (1 - static_cast<double>(used) / r.cores) * 0.5;
    f.settings = {{"torch::set_num_threads", std::to_string(fair)}};
    f.recommendation = "this machine's cores shared among its workers, unless the idle cores are "
                       "kept for the input pipeline";
  } else {
    f.status = Status::kGood;
  }
  return f;
}

Finding communication(const RecipeFacts& r, const std::vector<PhaseTimes>& workers) {
  Finding f;
  f.item = "communication";
  // Replicas of one worker reduce in memory: only several workers put gradients on a wire.
  if (r.workers <= 1) {
    f.status = Status::kGood;
    f.evidence = "one worker: nothing crosses a network";
    return f;
  }
  if (!has_steps(workers)) {
    f.status = Status::kUnknown;
    f.evidence = "no step phases were recorded";
    f.recommendation = "record a profile of the run (ProfilerOptions::summary)";
    return f;
  }
  const double exposed = worst_share(workers, {Phase::kAllReduce});
  double hidden = 1;
  for (const auto& w : workers) hidden = std::min(hidden, w.hidden_share());
  f.evidence = "all-reduce wait " + percent(exposed) + " of step time, " + percent(hidden) +
               " hidden behind backward; overlap " + (r.overlap ? "on" : "off") + ", " +
               num(static_cast<std::int64_t>(r.buckets)) + " bucket(s) of up to " +
               bytes(r.bytes_per_pack) + ", compression " + r.compression;
  if (r.gradient_bytes > 0) f.evidence += ", " + bytes(r.gradient_bytes) + " per step";
  if (exposed < 0.05) {
    f.status = Status::kGood;
    f.gain = exposed;
    return f;
  }
  f.status = exposed >= 0.20 ? Status::kAct : Status::kConsider;
  std::vector<std::string> steps;
  if (!r.overlap) {
    f.settings.push_back({"CommunicationOptions::overlap", "true"});
    steps.push_back("overlap the all-reduces with backward");
    f.gain = exposed * 0.5;
  } else if (r.buckets <= 1 && r.gradient_bytes > 0) {
    // One bucket can only start when backward is over: smaller ones start during it.
    f.settings.push_back({"CommunicationOptions::bytes_per_pack",
                          num(std::max<std::int64_t>(r.gradient_bytes / 4, 1))});
    steps.push_back("smaller buckets, a quarter of the gradient, so all-reduces start during "
                    "backward (profile::best_bucket finds the best size for a link)");
    f.gain = exposed * 0.5;
  }
  if (r.compression == "none" || r.compression.empty()) {
    f.settings.push_back({"CommunicationOptions::compression", "bf16"});
    steps.push_back("half the bytes on the wire (fp16 works too)");
    f.gain = std::max(f.gain, exposed * 0.5);
  }
  steps.push_back("profile::predict on this run's profile says whether more workers still pay");
  f.recommendation = steps[0];
  for (std::size_t i = 1; i < steps.size(); ++i) f.recommendation += "; " + steps[i];
  return f;
}

int rank(Status s) {
  switch (s) {
  case Status::kAct:
    return 0;
  case Status::kConsider:
    return 1;
  case Status::kUnknown:
    return 2;
  case Status::kGood:
    return 3;
  }
  return 4;
}

} // namespace

const char* to_string(Finding::Status status) {
  switch (status) {
  case Status::kGood:
    return "ok";
  case Status::kConsider:
    return "consider";
  case Status::kAct:
    return "act";
  case Status::kUnknown:
    return "unknown";
  }
  return "?";
}

// Uneven workers: with equal (or fixed) shares, the workers' forward passes (wait-free, unlike
// backward, whose hooks wait in the shared-memory all-reduce) compared; each global batch divided
// by speed would bring every worker's compute to their harmonic mean.
Finding shares(const RecipeFacts& r, const std::vector<PhaseTimes>& workers) {
  Finding f;
  f.item = "shares by speed";
  if (r.workers < 2 || workers.size() < 2 || !has_steps(workers)) {
    f.status = r.workers < 2 ? Status::kGood : Status::kUnknown;
    f.evidence = r.workers < 2 ? "one worker" : "the workers' phases were not recorded";
    return f;
  }
  double slowest = 0, fastest = 0, inverse = 0;
  for (const PhaseTimes& w : workers) {
    const double forward = w[Phase::kForward];
    if (!(forward > 0)) {
      f.status = Status::kUnknown;
      f.evidence = "a worker's forward time was not recorded";
      return f;
    }
    slowest = std::max(slowest, forward);
    fastest = fastest > 0 ? std::min(fastest, forward) : forward;
    inverse += 1 / forward;
  }
  const double spread = slowest / fastest;
  f.evidence = "the workers' forward passes take up to " + format("%.2fx", spread) +
               " as long as the fastest's, on shares " + r.shares;
  if (r.device.rfind("cuda", 0) == 0) {
    // A forward pass on CUDA is timed at its kernels' launches, not their work.
    f.status = Status::kUnknown;
    f.evidence = "shares by speed are not measured on CUDA yet";
    return f;
  }
  if (r.shares == "auto") {
    f.status = Status::kGood;
    f.evidence += " (each global batch divided by the measured speeds; the log says each "
                  "division and its gain)";
    return f;
  }
  if (spread < 1.15) {
    f.status = Status::kGood;
    return f;
  }
  // Compute at the harmonic mean instead of the slowest's.
  const double balanced = static_cast<double>(workers.size()) / inverse;
  f.status = Status::kConsider;
  f.gain = compute_share(workers) * (1 - balanced / slowest);
  if (!r.shares_refused.empty()) {
    // Nothing to set: the fit cannot divide by speed, so only the slow worker can be fixed.
    f.recommendation = "find what slows the slow worker (shares by speed cannot divide this "
                       "fit's global batches: " +
                       r.shares_refused + ")";
    return f;
  }
  f.settings = {{"FitOptions::balance_shares_every", "true"}};
  f.recommendation = "each global batch divided by the workers' measured speeds, the update "
                     "unchanged; or find what slows the slow worker";
  return f;
}

// How much of the processor's matrix-product rate the training used: FLOPs per sample times
// samples per second per worker, over one worker's measured peak at the run's precision.
Finding compute(const RunSummary& run) {
  const RecipeFacts& r = run.recipe;
  Finding f;
  f.item = "compute";
  const double samples_per_s = run.epochs.empty() ? 0 : run.epochs.back().samples_per_s;
  if (r.train_flops_per_sample <= 0 || r.matmul_peak_gflops <= 0 || samples_per_s <= 0) {
    f.status = Status::kUnknown;
    f.evidence = r.train_flops_per_sample <= 0
                     ? "the model's FLOPs per sample were not counted "
                       "(RecipeFacts::train_flops_per_sample)"
                     : "this device's matrix-product peak was not measured";
    return f;
  }
  const double achieved = r.train_flops_per_sample * samples_per_s / std::max(r.workers, 1) / 1e9;
  const double share = achieved / r.matmul_peak_gflops;
  const char* precision = r.precision == "float32"         ? "float32"
                          : r.precision == "mixed_float16" ? "float16"
                                                           : "bf16";
  f.evidence = percent(share) + " of this " + (on_cuda(r) ? "GPU" : "CPU") + "'s " + precision +
               " matmul peak: " + format("%.1f of %.1f", achieved, r.matmul_peak_gflops) +
               " GFLOP/s per worker, " + format("%.3g", r.train_flops_per_sample / 1e6) +
               " MFLOP per sample";
  if (share >= 0.5) {
    f.status = Status::kGood;
    return f;
  }
  f.status = Status::kConsider;
  f.recommendation =
      "most of the step runs outside large matrix products (normalisations, activations, small "
      "layers, memory traffic); a larger batch per replica (RecipeFacts::batch_per_replica) "
      "gives the kernels larger matrices, and the items above say what else takes time";
  return f;
}

std::vector<Finding> diagnose(const RunSummary& run) {
  const std::vector<PhaseTimes> workers = run.steady_phases();
  std::vector<Finding> findings = {
      input_pipeline(run, workers),
      mixed_precision(run.recipe, workers),
      compiled_step(run.recipe, workers),
      batch_size(run, workers),
      learning_rate(run),
      threads(run.recipe, workers),
      communication(run.recipe, workers),
      shares(run.recipe, workers),
      compute(run),
  };
  // Stable: items of equal status and gain keep the recipe's order.
  std::stable_sort(findings.begin(), findings.end(), [](const Finding& a, const Finding& b) {
    if (rank(a.status) != rank(b.status)) return rank(a.status) < rank(b.status);
    return a.gain > b.gain;
  });
  return findings;
}

std::string to_string(const Setting& setting) {
  // The name before the last "::": a namespace (lowercase) holds a function, a type a field.
  const auto last = setting.option.rfind("::");
  const auto before =
      last == std::string::npos ? std::string::npos : setting.option.rfind("::", last - 1);
  const std::size_t scope = before == std::string::npos || last == 0 ? 0 : before + 2;
  const bool function = last == std::string::npos ||
                        std::islower(static_cast<unsigned char>(setting.option[scope])) != 0;
  return function ? setting.option + "(" + setting.value + ")"
                  : setting.option + " = " + setting.value;
}

std::string format_recommendation(const Finding& finding, const FindingFormat& format) {
  std::string out;
  for (const auto& s : finding.settings) {
    out += (out.empty() ? "" : ", ") + (format.setting ? format.setting(s) : to_string(s));
  }
  if (!finding.recommendation.empty()) {
    out += (out.empty() ? "" : ": ") +
           (format.text ? format.text(finding.recommendation) : finding.recommendation);
  }
  return out;
}

std::string format_findings(const std::vector<Finding>& findings, const FindingFormat& format) {
  std::string out = "Recipe doctor (most valuable first):\n";
  if (findings.empty()) return out + "  nothing to check\n";
  for (const auto& f : findings) {
    out += std::string("  [") + to_string(f.status) + "] " + f.item + ": " + f.evidence + "\n";
    const std::string recommendation = format_recommendation(f, format);
    if (!recommendation.empty()) {
      out += "        -> " + recommendation;
      if (f.gain >= 0.005 && f.status != Status::kGood) {
        out += " (up to ~" + percent(f.gain) + " of step time)";
      }
      out += "\n";
    }
  }
  return out;
}

} // namespace flotilla::profile
