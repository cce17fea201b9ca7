#include "flotilla/profile/profiler.h"

#include "flotilla/base/atomic_file.h"
#include "flotilla/base/system.h"
#include "flotilla/collective/agreement.h"
#include "flotilla/error.h"
#include "flotilla/profile/batch_search.h"
#include "flotilla/profile/compute.h"
#include "flotilla/profile/doctor.h"
#include "flotilla/profile/report.h"
#include "flotilla/profile/timeline.h"

namespace flotilla::profile {

RecipeFacts observe_recipe(train::Model& model, RecipeFacts f) {
  auto& strategy = model.strategy();
  const auto& compiled = model.compile_options();
  const auto params = model.module().parameters();
  const bool cuda = !params.empty() && params.front().is_cuda();
  if (cuda) f.device = params.front().device().str();
  f.workers = strategy.num_workers();
  f.replicas_per_worker = strategy.replicas_per_worker();
  f.precision = train::to_string(model.policy());
  f.loss_scaling =
      compiled.loss_scale.has_value() || model.policy() == train::Policy::kMixedFloat16;
  // CUDA: float16 tensor cores on every GPU flotilla targets, bfloat16 from sm_80 on.
  f.hardware_bf16 = cuda ? train::cuda_has_native_bf16(params.front().device().index())
                         : train::cpu_has_native_bf16();
  f.hardware_fp16 = cuda;
  f.jit_compile = compiled.jit_compile.value_or(false);
  f.compiled_step_available =
      train::why_no_captured_step(strategy, compiled.gradient_accumulation_steps).empty();
  if (f.optimizer.empty()) f.optimizer = compiled.optimizer.describe();
  if (f.peak_lr == 0 && !compiled.optimizer.schedule) f.peak_lr = compiled.optimizer.learning_rate;
  if (f.schedule.empty()) {
    f.schedule = compiled.optimizer.schedule ? compiled.optimizer.schedule->describe() : "constant";
  }
  if (f.threads_per_worker == 0) f.threads_per_worker = torch::get_num_threads();
  if (f.cores == 0) f.cores = base::available_cores();
  f.parameters = 0;
  f.gradient_layout.clear();
  f.gradient_kinds.clear();
  for (auto p = params.rbegin(); p != params.rend(); ++p) {
    if (!p->requires_grad()) continue;
    f.parameters += p->numel();
    f.gradient_layout.push_back(p->numel() * static_cast<std::int64_t>(p->element_size()));
    f.gradient_kinds.push_back(strategy::gradient_kind(*p));
  }
  const auto& reducer = model.gradient_reducer();
  const auto& comm = strategy.communicator().options();
  f.bytes_per_pack = comm.bytes_per_pack;
  f.overlap = comm.overlap;
  f.compression = std::string(collective::to_string(comm.compression));
  f.buckets = static_cast<int>(reducer.buckets().size());
  const auto stats = reducer.stats();
  if (stats.syncs > 0 && stats.wire_bytes > 0) {
    f.gradient_bytes = stats.wire_bytes / stats.syncs;
  } else { // one worker sends nothing: what it would send
    std::int64_t bytes = 0;
    const std::int64_t wire = comm.compression == collective::Compression::kNone ? 0 : 2;
    for (const auto& b : reducer.buckets()) {
      const std::int64_t elements = b.numel + static_cast<std::int64_t>(b.params.size());
      bytes += elements * (wire > 0 ? wire : static_cast<std::int64_t>(c10::elementSize(b.dtype)));
    }
    f.gradient_bytes = bytes;
  }
  if (f.matmul_peak_gflops == 0 && !cuda) { // ~0.2 s, after the training
    const train::Policy policy = model.policy();
    f.matmul_peak_gflops =
        matmul_peak_gflops(policy == train::Policy::kFloat32        ? torch::kFloat32
                           : policy == train::Policy::kMixedFloat16 ? torch::kHalf
                                                                    : torch::kBFloat16);
  }
  try {
    f.peak_memory_bytes = resident_peak_bytes();
  } catch (const ConfigError&) { // no /proc: unknown
    f.peak_memory_bytes = 0;
  }
  return f;
}

Profiler::Profiler(ProfilerOptions options) : options_(std::move(options)) {}

void Profiler::on_train_begin() {
  summary_ = RunSummary{};
  summary_.command = options_.command;
  summary_.started = base::utc_now();
  // The timeline's gather is a collective: every worker must take part, or none.
  const bool mine = !options_.trace.empty();
  // A worker rejoining an elastic group mid-fit cannot ask (its peers are training): it was
  // started with the same options as they were.
  const collective::Agreement tracing =
      model().strategy().joining() ? collective::Agreement{mine, mine}
                                   : collective::agree(model().strategy().communicator(), mine);
  if (tracing.all != tracing.any) {
    throw ConfigError("the Profiler's trace path is set on some workers and not on others; give "
                      "every worker a ProfilerOptions::trace, or none: the timeline is gathered "
                      "from all of them");
  }
  model().set_step_tracing(mine, options_.max_traced_steps);
}

void Profiler::on_epoch_end(int epoch, train::EpochLogs& logs) {
  EpochSummary e;
  e.epoch = logs.epoch;
  e.steps = logs.steps;
  e.seconds = logs.seconds;
  e.samples_per_s = logs.samples_per_s;
  e.values = logs.values.items();
  e.workers = logs.worker_phases;
  summary_.epochs.push_back(std::move(e));
}

void Profiler::write_timeline() {
  auto& strategy = model().strategy();
  const auto all = collective::all_gather_uneven(
      strategy.communicator(),
      torch::tensor(pack_traces(model().take_step_traces()), torch::kFloat64));
  model().set_step_tracing(false);
  if (!is_chief()) return;
  std::vector<std::vector<train::StepTrace>> workers;
  std::vector<std::string> names;
  const auto addresses = strategy.cluster().training_addresses();
  for (std::size_t r = 0; r < all.size(); ++r) {
    const double* packed = all[r].data_ptr<double>();
    workers.push_back(unpack_traces(std::vector<double>(packed, packed + all[r].numel())));
    std::string name = r == 0 ? "worker 0 (chief)" : "worker " + std::to_string(r);
    if (r < addresses.size()) name += " " + addresses[r].to_string();
    names.push_back(name);
  }
  try {
    base::write_file_atomic(options_.trace, chrome_trace(workers, names).dump() + "\n");
  } catch (const std::exception& e) { // auxiliary: see on_train_end
    strategy.log().warn("could not write the timeline " + options_.trace.string() + ": " +
                        e.what());
  }
}

void Profiler::on_train_end() {
  if (!options_.trace.empty()) write_timeline(); // a collective: every worker takes part
  if (!is_chief()) return;
  RecipeFacts known = options_.recipe;
  if (known.global_batch == 0 && !summary_.epochs.empty()) {
    // The batch as trained: samples per step (drop_remainder batches are all full).
    const auto& e = summary_.epochs.front();
    if (e.steps > 0) {
      known.global_batch = static_cast<std::int64_t>(
          e.samples_per_s * e.seconds / static_cast<double>(e.steps) + 0.5);
    }
  }
  const int replicas = model().strategy().num_replicas_in_sync();
  if (known.batch_per_replica == 0 && known.global_batch > 0) {
    known.batch_per_replica = known.global_batch / replicas;
  }
  summary_.recipe = observe_recipe(model(), known);
  // The outputs are auxiliary: a bad path costs them, not the end of the run (the other
  // workers go on to their next collective; an exception here would strand them).
  auto write = [&](const char* what, const std::filesystem::path& path, const auto& fn) {
    if (path.empty()) return;
    try {
      fn();
    } catch (const std::exception& e) {
      model().strategy().log().warn(std::string("could not write the ") + what + " " +
                                    path.string() + ": " + e.what());
    }
  };
  write("run profile", options_.summary, [&] { write_run_summary(options_.summary, summary_); });
  const auto findings = diagnose(summary_);
  write("report", options_.report,
        [&] { write_html_report(options_.report, summary_, findings, options_.findings_format); });
  if (options_.doctor && options_.out) {
    std::fprintf(options_.out, "%s", format_findings(findings, options_.findings_format).c_str());
    std::fflush(options_.out);
  }
}

} // namespace flotilla::profile
