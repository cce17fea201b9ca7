#include "tools/flotilla/flags.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iomanip>
#include <sstream>

#include "flotilla/error.h"

namespace flotilla::tools {

namespace {

using Form = FlagFor::Form;

bool identifier_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

// Past a call's balanced parentheses at `at` (quoted text may hold any character); `at` itself
// when there is no call, or when it is not closed.
std::size_t past_call(const std::string& text, std::size_t at) {
  if (at >= text.size() || text[at] != '(') return at;
  int depth = 0;
  bool quoted = false;
  for (std::size_t i = at; i < text.size(); ++i) {
    const char c = text[i];
    if (quoted) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        quoted = false;
      }
    } else if (c == '"') {
      quoted = true;
    } else if (c == '(') {
      ++depth;
    } else if (c == ')' && --depth == 0) {
      return i + 1;
    }
  }
  return at;
}

// The table entry whose API name starts at `at` as a whole name, if any.
const FlagFor* name_at(const std::string& text, std::size_t at) {
  // A name starts a word, or follows a namespace ("train::CompileOptions::jit_compile").
  if (at > 0 && identifier_char(text[at - 1])) return nullptr;
  for (const auto& entry : flag_table()) {
    const std::string_view api = entry.api;
    if (text.compare(at, api.size(), api) != 0) continue;
    const std::size_t end = at + api.size();
    if (end < text.size() && identifier_char(text[end])) continue; // a longer name
    return &entry;
  }
  return nullptr;
}

} // namespace

const std::vector<FlagFor>& flag_table() {
  // flotilla train's, unless a command is named; tune's and doctor's for the batch search.
  static const std::vector<FlagFor> table = {
      // train: Model::compile and fit, the recipe's functions, the callbacks
      {"FitOptions::epochs", "--epochs"},
      {"FitOptions::steps_per_epoch", "--steps-per-epoch"},
      {"FitOptions::validation_data", "--validation", Form::kSwitch},
      {"FitOptions::verbose", "--verbose"},
      {"CompileOptions::jit_compile", "--jit-compile", Form::kSwitch},
      {"CompileOptions::channels_last", "--channels-last"},
      {"train::convert_sync_batchnorm", "--sync-batchnorm", Form::kSwitch},
      {"train::load_torchscript", "--model PATH"},
      {"ImageFolderOptions::validation_split", "--validation-split"},
      {"ImageFolderOptions::image_size", "--image-size"},
      {"ImageFolderOptions::color_mode", "--color-mode"},
      {"ImageFolderOptions::subset", "--validation-split"},
      {"ImageFolderOptions::seed", "--seed"},
      {"CompileOptions::steps_per_execution", "--steps-per-execution"},
      {"CompileOptions::gradient_accumulation_steps", "--accumulation-steps"},
      {"LossOptions::label_smoothing", "--label-smoothing"},
      {"OptimizerOptions::kind", "--optimizer"},
      {"OptimizerOptions::learning_rate", "--lr"},
      {"OptimizerOptions::momentum", "--momentum"},
      {"OptimizerOptions::weight_decay", "--weight-decay"},
      {"CosineDecayOptions::warmup_steps", "--warmup-epochs", Form::kEpochs},
      {"RecipeOptions::lr", "--lr"},
      {"RecipeOptions::base_lr", "--base-lr"},
      {"RecipeOptions::warmup_epochs", "--warmup-epochs"},
      {"RecipeOptions::weight_decay", "--weight-decay"},
      {"RecipeOptions::momentum", "--momentum"},
      {"RecipeOptions::global_clipnorm", "--global-clipnorm"},
      {"train::CosineDecay", "--schedule cosine"},
      {"train::linear_scaling", "--lr-scaling linear"},
      {"train::set_global_policy", "--precision"},
      {"train::fastest_policy", "--precision auto"},
      {"ModelCheckpointOptions::filepath", "--checkpoint-dir"},
      {"ModelCheckpointOptions::max_to_keep", "--max-to-keep"},
      {"BackupOptions::backup_dir", "--backup-dir"},
      {"BackupOptions::save_freq", "--backup-freq"},
      {"BackupOptions::preemption_check_interval", "--preemption-check-ms"},
      {"TensorBoardOptions::log_dir", "--tensorboard-dir"},
      {"train::CSVLogger", "--csv-log"},
      {"SidecarEvaluatorOptions::checkpoint_dir", "--checkpoint-dir"},
      {"SidecarEvaluatorOptions::log_dir", "--tensorboard-dir"},
      {"SidecarEvaluatorOptions::timeout", "--timeout"},
      {"SidecarEvaluatorOptions::last_epoch", "--epochs"},
      // collective, cluster, strategy
      {"CommunicationOptions::implementation", "--implementation"},
      {"CommunicationOptions::timeout", "--timeout"},
      {"CommunicationOptions::bytes_per_pack", "--bytes-per-pack"},
      {"CommunicationOptions::overlap", "--no-overlap", Form::kNegatedSwitch},
      {"CommunicationOptions::compression", "--compression"},
      {"CommunicationOptions::shared_memory", "--no-shared-memory", Form::kNegatedSwitch},
      {"ElasticOptions::enabled", "--elastic", Form::kSwitch},
      {"ElasticOptions::batch", "--elastic-batch"},
      {"CommunicationOptions::heartbeat_timeout", "--heartbeat-timeout"},
      {"CommunicationOptions::cluster_token", "--cluster-token-file"},
      {"CommunicationOptions::insecure", "--insecure", Form::kSwitch},
      {"cluster::cluster_token", "--cluster-token-file"},
      {"strategy::parse_devices", "--devices"},
      {"strategy::default_devices", "--replicas-per-worker"},
      // data, and the step's threads
      {"data::fashion_mnist", "--data-dir"},
      {"Dataset::cache", "--cache"},
      {"Dataset::shuffle", "--shuffle-buffer"},
      {"torch::set_num_threads", "--threads"},
      {"FitOptions::balance_shares_every", "--shares auto", Form::kSwitch},
      // profile
      {"RecipeFacts::batch_per_replica", "--batch-per-replica"},
      {"ProfilerOptions::trace", "--trace"},
      {"ProfilerOptions::summary", "--profile-json"},
      {"ProfilerOptions::report", "--report"},
      {"ProfilerOptions::doctor", "--no-doctor", Form::kNegatedSwitch},
      {"StepProbeOptions::memory_budget_bytes", "--memory-budget"},
      {"StepProbeOptions::device", "--device"},
      {"profile::search_max_batch", "flotilla tune --max-batch"},
      {"profile::best_bucket", "flotilla plan"},
      {"profile::predict", "flotilla plan --profile"},
  };
  return table;
}

const FlagFor* flag_for(std::string_view api) {
  for (const auto& entry : flag_table()) {
    if (api == entry.api) return &entry;
  }
  return nullptr;
}

std::string with_flags(const std::string& message) {
  std::string out;
  std::size_t copied = 0;
  for (std::size_t at = 0; at < message.size(); ++at) {
    const FlagFor* entry = name_at(message, at);
    if (!entry) continue;
    const std::size_t end = past_call(message, at + std::string_view(entry->api).size());
    const std::string flag = entry->flag;
    out.append(message, copied, end - copied);
    copied = end;
    at = end - 1;
    if (message.compare(end, flag.size() + 2, " (" + flag) == 0 ||
        message.compare(end, flag.size() + 2, ", " + flag) == 0) {
      continue; // already said
    }
    out += end < message.size() && message[end] == ')' ? ", " + flag : " (" + flag + ")";
  }
  out.append(message, copied, std::string::npos);
  return out;
}

std::string setting_as_flag(const profile::Setting& setting, std::int64_t updates_per_epoch) {
  const FlagFor* entry = flag_for(setting.option);
  if (!entry) return profile::to_string(setting);
  const std::string flag = entry->flag;
  const std::string& value = setting.value;
  switch (entry->form) {
  case Form::kValue:
    return value.empty() ? flag : flag + " " + value;
  case Form::kSwitch:
    if (value == "true") return flag;
    if (value == "false") return "without " + flag;
    break;
  case Form::kNegatedSwitch:
    if (value == "true") return "without " + flag;
    if (value == "false") return flag;
    break;
  case Form::kEpochs: {
    char* parsed_to = nullptr;
    const double updates = std::strtod(value.c_str(), &parsed_to);
    if (updates_per_epoch <= 0 || value.empty() || *parsed_to != '\0') break;
    char epochs[32];
    std::snprintf(epochs, sizeof epochs, "%g", updates / static_cast<double>(updates_per_epoch));
    return flag + " " + epochs;
  }
  }
  return profile::to_string(setting); // a value the flag cannot say
}

profile::FindingFormat cli_findings_format(std::int64_t updates_per_epoch) {
  profile::FindingFormat format;
  format.setting = [updates_per_epoch](const profile::Setting& s) {
    return setting_as_flag(s, updates_per_epoch);
  };
  format.text = with_flags;
  return format;
}

namespace {
// `rule` says what is taken ("above 0"); `ok` decides on a finite value.
template <class Ok> CLI::Validator finite_number(const std::string& rule, Ok ok) {
  return CLI::Validator(
      [rule, ok](std::string& text) -> std::string {
        char* end = nullptr;
        const double value = std::strtod(text.c_str(), &end);
        const bool parsed = !text.empty() && end == text.c_str() + text.size();
        if (parsed && std::isfinite(value) && ok(value)) return "";
        return "takes a finite number " + rule + "; saw " + text;
      },
      "NUMBER " + rule);
}
} // namespace

namespace {
std::string at_most(double max) {
  std::ostringstream rule;
  rule << std::setprecision(12) << " and at most " << max;
  return rule.str();
}
} // namespace

CLI::Validator positive_number(double max) {
  return finite_number("above 0" + at_most(max), [max](double v) { return v > 0 && v <= max; });
}

CLI::Validator non_negative_number(double max) {
  return finite_number("at least 0" + at_most(max), [max](double v) { return v >= 0 && v <= max; });
}

CLI::Validator number_in(double lo, double hi) {
  std::ostringstream rule;
  rule << std::setprecision(12) << "from " << lo << " to " << hi;
  return finite_number(rule.str(), [lo, hi](double v) { return v >= lo && v <= hi; });
}

std::chrono::milliseconds seconds_flag(double seconds, const std::string& flag) {
  constexpr double kWeek = 7 * 24 * 3600;
  if (!(seconds > 0 && seconds <= kWeek)) {
    std::ostringstream seen;
    seen << seconds;
    throw ConfigError(flag + " takes a number of seconds above 0 and at most a week (604800); "
                             "saw " + seen.str());
  }
  return std::chrono::milliseconds(static_cast<std::int64_t>(std::ceil(seconds * 1000)));
}

} // namespace flotilla::tools
