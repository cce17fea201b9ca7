#include "flotilla/profile/run_summary.h"

#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

#include "flotilla/base/atomic_file.h"
#include "flotilla/error.h"

namespace flotilla::profile {

namespace {

constexpr const char* kSchema = "flotilla.run/1";

// Reads `key` of `object` into `out` when present; a value of the wrong type is an error that
// names the field and the file.
template <class T>
void read_field(const nlohmann::json& object, const char* key, T& out, const std::string& where) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return;
  try {
    out = it->get<T>();
  } catch (const nlohmann::json::exception&) {
    throw ConfigError(where + ": field \"" + key + "\" has the wrong type (" + it->type_name() +
                      ": " + it->dump().substr(0, 60) +
                      "); is this a run profile written by ProfilerOptions::summary?");
  }
}

const nlohmann::json& require(const nlohmann::json& object, const char* key,
                              const std::string& where) {
  auto it = object.find(key);
  if (it == object.end()) {
    throw ConfigError(where + ": no \"" + key +
                      "\" field; write the file with ProfilerOptions::summary");
  }
  return *it;
}

nlohmann::json phases_to_json(const train::PhaseTimes& p) {
  nlohmann::json phases = nlohmann::json::object();
  for (int i = 0; i < train::kPhaseCount; ++i) {
    phases[train::phase_name(static_cast<train::Phase>(i))] =
        p.seconds[static_cast<std::size_t>(i)];
  }
  return {{"steps", p.steps},
          {"step_seconds", p.step_seconds},
          {"comm_seconds", p.comm_seconds},
          {"phases", phases}};
}

train::PhaseTimes phases_from_json(const nlohmann::json& j, const std::string& where) {
  train::PhaseTimes p;
  read_field(j, "steps", p.steps, where);
  read_field(j, "step_seconds", p.step_seconds, where);
  read_field(j, "comm_seconds", p.comm_seconds, where);
  const auto& phases = require(j, "phases", where);
  for (int i = 0; i < train::kPhaseCount; ++i) {
    read_field(phases, train::phase_name(static_cast<train::Phase>(i)),
               p.seconds[static_cast<std::size_t>(i)], where);
  }
  return p;
}

// Every RecipeFacts field, for to_json and run_summary_from_json (one list, so the two agree).
// clang-format off
#define FLOTILLA_RECIPE_FIELDS(X) \
  X(model) X(device) X(workers) X(replicas_per_worker) X(batch_per_replica) X(global_batch) \
  X(max_batch_per_replica) X(memory_budget_bytes) X(peak_memory_bytes) X(precision) \
  X(hardware_bf16) X(hardware_fp16) X(loss_scaling) X(jit_compile) \
  X(compiled_step_available) X(optimizer) X(base_lr) X(base_batch) X(lr_scaling) X(peak_lr) \
  X(schedule) X(warmup_steps) X(total_steps) X(threads_per_worker) X(cores) \
  X(local_workers) X(parameters) X(gradient_bytes) X(gradient_layout) X(gradient_kinds) \
  X(bytes_per_pack) \
  X(buckets) X(overlap) X(compression) X(input_pipeline) X(train_flops_per_sample) \
  X(matmul_peak_gflops) X(shares) X(shares_refused)
// clang-format on

} // namespace

double EpochSummary::value(const std::string& key) const {
  for (const auto& [k, v] : values) {
    if (k == key) return v;
  }
  return std::numeric_limits<double>::quiet_NaN();
}

std::vector<train::PhaseTimes> RunSummary::steady_phases() const {
  if (epochs.empty()) return {};
  if (epochs.size() > 1) return epochs.back().workers;
  return epochs.front().workers;
}

nlohmann::json to_json(const RunSummary& s) {
  nlohmann::json recipe = nlohmann::json::object();
#define X(name) recipe[#name] = s.recipe.name;
  FLOTILLA_RECIPE_FIELDS(X)
#undef X
  nlohmann::json epochs = nlohmann::json::array();
  for (const auto& e : s.epochs) {
    nlohmann::json values = nlohmann::json::array();
    for (const auto& [k, v] : e.values)
      values.push_back({k, std::isfinite(v) ? nlohmann::json(v) : nullptr});
    nlohmann::json workers = nlohmann::json::array();
    for (const auto& w : e.workers) workers.push_back(phases_to_json(w));
    epochs.push_back({{"epoch", e.epoch},
                      {"steps", e.steps},
                      {"seconds", e.seconds},
                      {"samples_per_s", e.samples_per_s},
                      {"values", values},
                      {"workers", workers}});
  }
  return {{"schema", kSchema},
          {"command", s.command},
          {"started", s.started},
          {"recipe", recipe},
          {"epochs", epochs}};
}

RunSummary run_summary_from_json(const nlohmann::json& j, const std::string& where) {
  if (!j.is_object()) throw ConfigError(where + ": not a JSON object");
  std::string schema;
  read_field(j, "schema", schema, where);
  if (schema != kSchema) {
    throw ConfigError(where + ": schema \"" + schema + "\", expected \"" + kSchema +
                      "\"; write the file again with this version (ProfilerOptions::summary)");
  }
  RunSummary s;
  read_field(j, "command", s.command, where);
  read_field(j, "started", s.started, where);
  const auto& recipe = require(j, "recipe", where);
#define X(name) read_field(recipe, #name, s.recipe.name, where);
  FLOTILLA_RECIPE_FIELDS(X)
#undef X
  for (const auto& e : require(j, "epochs", where)) {
    EpochSummary epoch;
    read_field(e, "epoch", epoch.epoch, where);
    read_field(e, "steps", epoch.steps, where);
    read_field(e, "seconds", epoch.seconds, where);
    read_field(e, "samples_per_s", epoch.samples_per_s, where);
    for (const auto& pair : require(e, "values", where)) {
      if (!pair.is_array() || pair.size() != 2 || !pair[0].is_string()) {
        throw ConfigError(where + ": an epoch's \"values\" must be [name, number] pairs; saw " +
                          pair.dump().substr(0, 60));
      }
      epoch.values.emplace_back(pair[0].get<std::string>(),
                                pair[1].is_number() ? pair[1].get<double>()
                                                    : std::numeric_limits<double>::quiet_NaN());
    }
    for (const auto& w : require(e, "workers", where))
      epoch.workers.push_back(phases_from_json(w, where));
    s.epochs.push_back(std::move(epoch));
  }
  return s;
}

void write_run_summary(const std::filesystem::path& path, const RunSummary& summary) {
  base::write_file_atomic(path, to_json(summary).dump(1) + "\n");
}

RunSummary read_run_summary(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) {
    throw ConfigError("cannot read the run profile " + path.string() +
                      "; write one first (ProfilerOptions::summary)");
  }
  nlohmann::json j;
  try {
    in >> j;
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError(path.string() + " is not valid JSON (" + e.what() + ")");
  }
  return run_summary_from_json(j, path.string());
}

} // namespace flotilla::profile
