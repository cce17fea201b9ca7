// TF_CONFIG parsing with TensorFlow's rules for MultiWorkerMirroredStrategy: at most one chief
// and one evaluator, the chief is the "chief" task or else worker 0, the evaluator trains with
// nobody, and parameter servers are refused. As TF does, it also takes what launchers write: an
// index as a numeric string, no cluster at all (this machine alone), "master" for the chief (AI
// Platform Training without useChiefInTfConfig), and keys of their own ("job", "trial", ...).
#include <map>
#include <nlohmann/json.hpp>

#include "flotilla/cluster/cluster_spec.h"
#include "flotilla/error.h"

namespace flotilla::cluster {
namespace {

using nlohmann::json;

const char* const kExample = "e.g. {\"cluster\": {\"worker\": [\"host1:2222\", \"host2:2222\"]}, "
                             "\"task\": {\"type\": \"worker\", \"index\": 0}}";
const char* const kNoPs = "parameter-server training is not supported; use chief/worker";

ConfigError error(const std::string& message) {
  return ConfigError("TF_CONFIG " + message);
}

// A value as JSON, escaped as JSON is and cut as echoed() cuts.
std::string shown(const json& value) {
  constexpr std::size_t kMax = 200;
  const std::string text = value.dump(-1, ' ', true); // non-ASCII as \uXXXX too
  if (text.size() <= kMax) return text;
  return text.substr(0, kMax) + "... (cut: " + std::to_string(text.size()) + " bytes)";
}

std::string type_name(const json& value) {
  if (value.is_number()) return "the number " + shown(value);
  if (value.is_string()) return "the string " + shown(value);
  return std::string(value.type_name()) + " " + shown(value);
}

std::vector<Address> parse_job(const json& cluster, const std::string& name) {
  std::vector<Address> out;
  auto it = cluster.find(name);
  if (it == cluster.end()) return out;
  const std::string field = "cluster." + name;
  if (!it->is_array()) {
    throw error(field + " must be a list of \"host:port\" strings; saw " + type_name(*it));
  }
  for (size_t i = 0; i < it->size(); ++i) {
    const json& entry = (*it)[i];
    const std::string entry_field = field + "[" + std::to_string(i) + "]";
    if (!entry.is_string()) {
      throw error(entry_field + " must be a \"host:port\" string; saw " + type_name(entry));
    }
    out.push_back(parse_address(entry.get<std::string>(), "TF_CONFIG " + entry_field));
  }
  return out;
}

void check_at_most_one(const std::vector<Address>& job, const std::string& name,
                       const std::string& fix) {
  if (job.size() <= 1) return;
  std::string listed;
  for (const auto& a : job) listed += (listed.empty() ? "\"" : ", \"") + a.to_string() + "\"";
  throw error("cluster." + name + " lists " + std::to_string(job.size()) + " addresses (" + listed +
              "); a cluster has at most one " + name + ": " + fix);
}

TaskType parse_task_type(const json& task, const json& cluster) {
  auto it = task.find("type");
  if (it == task.end()) {
    throw error("task has no \"type\"; set it to \"chief\", \"worker\" or \"evaluator\"");
  }
  if (!it->is_string()) {
    throw error("task.type must be a string (\"chief\", \"worker\" or \"evaluator\"); saw " +
                type_name(*it));
  }
  const std::string name = it->get<std::string>();
  TaskType type;
  if (name == "chief") {
    type = TaskType::kChief;
  } else if (name == "worker") {
    type = TaskType::kWorker;
  } else if (name == "evaluator") {
    type = TaskType::kEvaluator;
  } else if (name == "ps") {
    throw error("task.type is \"ps\": " + std::string(kNoPs));
  } else if (name == "master") {
    type = TaskType::kChief; // the seed's and AI Platform's name of the chief
  } else {
    throw error("task.type " + echoed(name) +
                " is not a task type; use \"chief\", \"worker\" or \"evaluator\"");
  }
  if (!cluster.contains(name) || cluster[name].empty()) {
    std::string listed;
    for (const auto& [job, addresses] : cluster.items()) {
      if (!addresses.empty()) listed += (listed.empty() ? "" : ", ") + echoed(job, 40);
    }
    throw error("task.type is \"" + name + "\" but cluster has no \"" + name +
                "\" addresses; add them to cluster or use a type it lists (" + listed + ")");
  }
  return type;
}

// An integer, or a string of one ("1": TF applies int()).
long long integer_of(const json& value) {
  if (value.is_number_integer()) return value.get<long long>();
  if (value.is_string()) {
    const std::string text = value.get<std::string>();
    std::size_t used = 0;
    try {
      const long long n = std::stoll(text, &used);
      if (used == text.size()) return n;
    } catch (const std::exception&) {
    }
  }
  throw error("task.index must be an integer (or a string of one, as TF's int() takes); saw " +
              type_name(value));
}

int parse_task_index(const json& task, const std::string& type_name_, size_t count) {
  auto it = task.find("index");
  if (it == task.end()) return 0; // TensorFlow's default
  const auto index = integer_of(*it);
  const std::string range = count == 1 ? "use 0" : "use 0 to " + std::to_string(count - 1);
  if (index < 0) {
    throw error("task.index is " + std::to_string(index) + "; an index counts from 0: " + range +
                " for the " + std::to_string(count) + " \"" + type_name_ + "\" address" +
                (count == 1 ? "" : "es"));
  }
  if (static_cast<size_t>(index) >= count) {
    throw error("task.index " + std::to_string(index) + " is out of range: cluster." + type_name_ +
                " has " + std::to_string(count) + " address" + (count == 1 ? "" : "es") + ", so " +
                range);
  }
  return static_cast<int>(index);
}

} // namespace

ClusterSpec parse_tf_config(std::string_view text) {
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::exception& e) {
    // e.what() is "[json.exception.parse_error.101] parse error at line 1, column 9: ...", or
    // out_of_range.406 for a number beyond double's range (1e999): both are bad JSON to us.
    std::string what = e.what();
    const auto pos = what.find("] ");
    // Its "last read: '...'" can hold a whole unterminated string: cut and escaped.
    throw error("is not valid JSON (" +
                printable(pos == std::string::npos ? what : what.substr(pos + 2), 300) +
                "); " + kExample);
  }
  if (!doc.is_object()) {
    throw error("must be a JSON object; saw " + type_name(doc) + "; " + kExample);
  }
  auto cluster_it = doc.find("cluster");
  if (cluster_it == doc.end() || (cluster_it->is_object() && cluster_it->empty())) {
    // TF_CONFIG={} (or no cluster): TF trains on this machine alone.
    ClusterSpec alone;
    alone.source = "TF_CONFIG without a cluster: this machine alone";
    alone.task = {TaskType::kWorker, 0};
    alone.rendezvous = Address{"127.0.0.1", 0}; // a group of one needs no network
    alone.local_host = "127.0.0.1";
    return alone;
  }
  json cluster = *cluster_it;
  if (!cluster.is_object()) {
    throw error("cluster must be an object of task lists; saw " + type_name(cluster));
  }
  std::vector<std::string> notes;
  if (cluster.contains("master")) {
    if (cluster.contains("chief")) {
      throw error("cluster lists both \"chief\" and \"master\" (the chief's deprecated name); "
                  "keep one");
    }
    cluster["chief"] = cluster["master"];
    cluster.erase("master");
    notes.push_back("TF_CONFIG: \"master\" is the deprecated name of the chief (AI Platform "
                    "Training writes it unless the job sets useChiefInTfConfig); it is the chief");
  }
  json task_json = doc.contains("task") ? doc["task"] : json();
  if (task_json.is_object() && task_json.value("type", json()) == "master") {
    task_json["type"] = "chief";
  }
  for (const auto& [name, value] : cluster.items()) {
    if (name == "ps") {
      if (!value.empty()) throw error("cluster has \"ps\" tasks: " + std::string(kNoPs));
    } else if (name != "chief" && name != "worker" && name != "evaluator") {
      throw error("cluster has unknown task type " + echoed(name) +
                  "; use \"chief\", \"worker\" and \"evaluator\"");
    }
  }

  ClusterSpec spec;
  spec.source = "TF_CONFIG";
  spec.notes = notes;
  spec.chief = parse_job(cluster, "chief");
  spec.worker = parse_job(cluster, "worker");
  spec.evaluator = parse_job(cluster, "evaluator");
  if (spec.chief.empty() && spec.worker.empty()) {
    throw error("cluster is empty: it lists no \"chief\" or \"worker\" address; " +
                std::string(kExample));
  }
  check_at_most_one(spec.chief, "chief", "keep one and list the others under \"worker\"");
  check_at_most_one(spec.evaluator, "evaluator", "keep one; the others cannot join training");

  std::map<std::string, std::string> seen; // address -> field that listed it first
  auto check_unique = [&](const std::vector<Address>& job, const std::string& name) {
    for (size_t i = 0; i < job.size(); ++i) {
      const std::string field = "cluster." + name + "[" + std::to_string(i) + "]";
      auto [it, inserted] = seen.emplace(job[i].to_string(), field);
      if (!inserted) {
        throw error("address \"" + job[i].to_string() + "\" appears twice (" + it->second +
                    " and " + field + "); every task needs its own host:port");
      }
    }
  };
  check_unique(spec.chief, "chief");
  check_unique(spec.worker, "worker");
  check_unique(spec.evaluator, "evaluator");

  auto task_it = task_json.is_null() ? doc.end() : doc.find("task");
  if (task_it == doc.end()) {
    throw error(
        "has no \"task\"; add \"task\": {\"type\": \"worker\", \"index\": i} to say which task "
        "this process is");
  }
  if (!task_json.is_object()) {
    throw error("task must be an object like {\"type\": \"worker\", \"index\": 0}; saw " +
                type_name(task_json));
  }
  spec.task.type = parse_task_type(task_json, cluster);
  const std::string type = std::string(to_string(spec.task.type));
  const auto& job = spec.task.type == TaskType::kChief    ? spec.chief
                    : spec.task.type == TaskType::kWorker ? spec.worker
                                                          : spec.evaluator;
  spec.task.index = parse_task_index(task_json, type, job.size());

  for (const char* key : {"rpc_layer", "environment"}) {
    auto it = doc.find(key);
    if (it == doc.end()) continue;
    if (!it->is_string())
      throw error(std::string(key) + " must be a string; saw " + type_name(*it));
    (key[0] == 'r' ? spec.rpc_layer : spec.environment) = it->get<std::string>();
  }

  spec.world_size = static_cast<int>(spec.chief.size() + spec.worker.size());
  switch (spec.task.type) {
  case TaskType::kChief:
    spec.rank = 0;
    break;
  case TaskType::kWorker:
    spec.rank = static_cast<int>(spec.chief.size()) + spec.task.index;
    break;
  case TaskType::kEvaluator:
    spec.rank = -1;
    break;
  }
  spec.rendezvous = spec.training_addresses().front();
  spec.local_host = job[spec.task.index].host;
  return spec;
}

std::string to_tf_config(const ClusterSpec& spec) {
  json cluster = json::object();
  auto put = [&](const char* name, const std::vector<Address>& job) {
    if (job.empty()) return;
    json list = json::array();
    for (const auto& a : job) list.push_back(a.to_string());
    cluster[name] = list;
  };
  put("chief", spec.chief);
  put("worker", spec.worker);
  put("evaluator", spec.evaluator);
  json doc = {
      {"cluster", cluster},
      {"task", {{"type", std::string(to_string(spec.task.type))}, {"index", spec.task.index}}}};
  if (!spec.rpc_layer.empty()) doc["rpc_layer"] = spec.rpc_layer;
  if (!spec.environment.empty()) doc["environment"] = spec.environment;
  return doc.dump();
}

} // namespace flotilla::cluster
