#include "flotilla/cluster/resolvers.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <cctype>
#include <optional>

#include "flotilla/error.h"

namespace flotilla::cluster {
namespace {

// A host and a port given apart (an IPv6 host without brackets, as torchrun takes it).
Address master_address(const std::string& host, const std::string& port, const std::string& what) {
  const bool v6 = host.find(':') != std::string::npos && host.front() != '[';
  return parse_address((v6 ? "[" + host + "]" : host) + ":" + port, what);
}

long parse_int(const Environment& env, const std::string& name, long min, const std::string& fix) {
  const auto value = env.get(name);
  if (!value) throw ConfigError(name + " is not set; " + fix);
  long out = 0;
  bool ok = !value->empty() && value->size() < 10;
  for (char c : *value) ok = ok && std::isdigit(static_cast<unsigned char>(c));
  if (ok) out = std::stol(*value);
  if (!ok || out < min) {
    throw ConfigError(name + " must be an integer >= " + std::to_string(min) + "; saw \"" + *value +
                      "\"; " + fix);
  }
  return out;
}

const char* const kHostlistForm = "Slurm writes node lists like \"node[01-03,07],gpu-a[1-2]\"";
const char* const kSlurmFix = "srun sets SLURM_PROCID, SLURM_NTASKS, SLURMD_NODENAME and "
                              "SLURM_STEP_NODELIST for every task: start flotilla with srun "
                              "(docs/deploy.md), or unset SLURM_PROCID to train alone";

// Bounded and escaped, so that a corrupt value cannot make a megabyte-long message.
std::string shown(std::string_view text) {
  return echoed(text);
}

bool host_char(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.' || c == '_';
}

// Host names in Slurm are short; more digits than this is not a node number but damage.
constexpr std::size_t kMaxDigits = 9;

struct Range {
  unsigned long low = 0;
  unsigned long high = 0;
  std::size_t width = 0; // zero padding, from the lower bound's digits
};

// The inside of one bracket group: "01-03,07".
std::vector<Range> parse_ranges(std::string_view inside, std::string_view text,
                                const std::string& variable, std::size_t& count) {
  auto fail = [&](const std::string& problem) {
    return ConfigError(variable + " is " + shown(text) + ": " + problem + "; " + kHostlistForm);
  };
  auto number = [&](std::string_view digits) {
    if (digits.empty() || digits.size() > kMaxDigits ||
        !std::all_of(digits.begin(), digits.end(),
                     [](char c) { return std::isdigit(static_cast<unsigned char>(c)); })) {
      throw fail("\"[" + std::string(inside) + "]\" holds \"" + std::string(digits) +
                 "\", which is not a node number of 1 to " + std::to_string(kMaxDigits) +
                 " digits");
    }
    return std::stoul(std::string(digits));
  };
  std::vector<Range> out;
  count = 0;
  std::size_t start = 0;
  for (;;) {
    const std::size_t comma = inside.find(',', start);
    const std::string_view item = inside.substr(
        start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
    const std::size_t dash = item.find('-');
    Range r;
    const std::string_view low = item.substr(0, dash);
    r.low = number(low);
    r.high = dash == std::string_view::npos ? r.low : number(item.substr(dash + 1));
    r.width = low.size();
    if (r.high < r.low) {
      throw fail("the range \"" + std::string(item) + "\" runs backwards; write it low-high");
    }
    const unsigned long size = r.high - r.low + 1;
    if (size > kMaxSlurmHosts || count + size > kMaxSlurmHosts) {
      throw fail("it names more than " + std::to_string(kMaxSlurmHosts) + " hosts (\"[" +
                 std::string(inside) +
                 "]\"), more than any job has; the value "
                 "is damaged");
    }
    count += size;
    out.push_back(r);
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return out;
}

// One host name pattern, e.g. "rack[1-2]-n[01-04]": literal parts and bracket groups.
void expand_entry(std::string_view entry, std::string_view text, const std::string& variable,
                  std::vector<std::string>& out) {
  auto fail = [&](const std::string& problem) {
    return ConfigError(variable + " is " + shown(text) + ": " + problem + "; " + kHostlistForm);
  };
  if (entry.empty()) throw fail("it has an empty host name (two commas, or one at an end)");
  // First the pieces and the total count, so nothing is allocated for a list that is refused.
  struct Piece {
    std::string literal;
    std::vector<Range> ranges; // empty for a literal
  };
  std::vector<Piece> pieces;
  std::size_t total = 1;
  for (std::size_t i = 0; i < entry.size();) {
    if (entry[i] == '[') {
      const std::size_t close = entry.find(']', i);
      if (close == std::string_view::npos) throw fail("a '[' is never closed");
      const std::string_view inside = entry.substr(i + 1, close - i - 1);
      if (inside.find('[') != std::string_view::npos) throw fail("brackets cannot nest");
      std::size_t count = 0;
      Piece piece;
      piece.ranges = parse_ranges(inside, text, variable, count);
      if (total > kMaxSlurmHosts / count) {
        throw fail("it names more than " + std::to_string(kMaxSlurmHosts) +
                   " hosts, more than any job has; the value is damaged");
      }
      total *= count;
      pieces.push_back(std::move(piece));
      i = close + 1;
    } else if (entry[i] == ']') {
      throw fail("a ']' has no '[' before it");
    } else if (!host_char(entry[i])) {
      throw fail(std::string("the character '") + entry[i] +
                 "' cannot be part of a host name (letters, digits, '-', '.' and '_')");
    } else {
      if (pieces.empty() || !pieces.back().ranges.empty()) pieces.emplace_back();
      pieces.back().literal += entry[i++];
    }
  }
  if (out.size() + total > kMaxSlurmHosts) {
    throw fail("it names more than " + std::to_string(kMaxSlurmHosts) +
               " hosts, more than any job has; the value is damaged");
  }
  std::vector<std::string> names = {""};
  for (const auto& piece : pieces) {
    if (piece.ranges.empty()) {
      for (auto& name : names) name += piece.literal;
      continue;
    }
    std::vector<std::string> next;
    for (const auto& name : names) {
      for (const auto& r : piece.ranges) {
        for (unsigned long n = r.low; n <= r.high; ++n) {
          std::string digits = std::to_string(n);
          if (digits.size() < r.width) digits.insert(0, r.width - digits.size(), '0');
          next.push_back(name + digits);
        }
      }
    }
    names = std::move(next);
  }
  out.insert(out.end(), names.begin(), names.end());
}

// SLURM_JOB_ID only matters modulo 1000: read its last three digits, whatever its length.
int job_port(const Environment& env) {
  const auto id = env.get("SLURM_JOB_ID");
  if (!id) return kSlurmBasePort;
  if (!std::all_of(id->begin(), id->end(),
                   [](char c) { return std::isdigit(static_cast<unsigned char>(c)); })) {
    throw ConfigError("SLURM_JOB_ID must be a job number; saw " + shown(*id) +
                      "; Slurm sets it, or set MASTER_PORT to choose the rendezvous port");
  }
  const std::string last = id->substr(id->size() > 3 ? id->size() - 3 : 0);
  return kSlurmBasePort + std::stoi(last);
}

// The node list of this step, its variable's name, and its hosts.
std::pair<std::string, std::vector<std::string>> slurm_hosts(const Environment& env) {
  for (const char* name : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"}) {
    if (const auto list = env.get(name)) return {name, expand_slurm_hostlist(*list, name)};
  }
  throw ConfigError("neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set, so the chief's "
                    "host is unknown; " +
                    std::string(kSlurmFix));
}

bool slurm_applies(const Environment& env) {
  return !env.get("TF_CONFIG") && !env.get("RANK") && !env.get("WORLD_SIZE") &&
         env.get("SLURM_PROCID") && env.get("SLURM_NTASKS");
}

} // namespace

std::vector<std::string> expand_slurm_hostlist(std::string_view text, const std::string& variable) {
  std::vector<std::string> out;
  if (text.empty()) {
    throw ConfigError(variable + " is empty; " + kHostlistForm);
  }
  std::size_t start = 0;
  std::size_t depth = 0;
  for (std::size_t i = 0; i <= text.size(); ++i) {
    if (i == text.size() || (text[i] == ',' && depth == 0)) {
      expand_entry(text.substr(start, i - start), text, variable, out);
      start = i + 1;
    } else if (text[i] == '[') {
      ++depth;
    } else if (text[i] == ']' && depth > 0) {
      --depth;
    }
  }
  return out;
}

std::vector<int> expand_slurm_tasks_per_node(std::string_view text, const std::string& variable) {
  const std::string form = "; Slurm writes tasks per node like \"2(x3),1\" (2 tasks on each "
                           "of 3 nodes, then 1)";
  auto fail = [&](const std::string& problem) {
    return ConfigError(variable + " is " + shown(text) + ": " + problem + form);
  };
  auto number = [&](std::string_view digits, const char* what) {
    if (digits.empty() || digits.size() > kMaxDigits ||
        !std::all_of(digits.begin(), digits.end(),
                     [](char c) { return std::isdigit(static_cast<unsigned char>(c)); })) {
      throw fail(std::string(what) + " \"" + std::string(digits) + "\" is not a number");
    }
    const unsigned long n = std::stoul(std::string(digits));
    if (n < 1) throw fail(std::string(what) + " is 0; it counts from 1");
    return n;
  };
  std::vector<int> out;
  if (text.empty()) throw fail("it is empty");
  std::size_t start = 0;
  for (;;) {
    const std::size_t comma = text.find(',', start);
    const std::string_view item = text.substr(
        start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
    const std::size_t open = item.find("(x");
    unsigned long repeat = 1;
    if (open != std::string_view::npos) {
      if (item.back() != ')') throw fail("\"" + std::string(item) + "\" lacks its closing ')'");
      repeat = number(item.substr(open + 2, item.size() - open - 3), "the repeat count");
    }
    const unsigned long tasks = number(item.substr(0, open), "the task count");
    if (tasks > kMaxSlurmHosts) {
      throw fail("a node with " + std::to_string(tasks) + " tasks is more than flotilla allows (" +
                 std::to_string(kMaxSlurmHosts) + ")");
    }
    if (repeat > kMaxSlurmHosts - out.size()) {
      throw fail("it describes more than " + std::to_string(kMaxSlurmHosts) +
                 " nodes, more than any job has; the value is damaged");
    }
    out.insert(out.end(), repeat, static_cast<int>(tasks));
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return out;
}

ClusterSpec from_slurm_env(const Environment& env) {
  ClusterSpec spec;
  spec.source = "Slurm environment";
  spec.world_size = static_cast<int>(parse_int(env, "SLURM_NTASKS", 1, kSlurmFix));
  spec.rank = static_cast<int>(parse_int(env, "SLURM_PROCID", 0, kSlurmFix));
  if (spec.rank >= spec.world_size) {
    throw ConfigError("SLURM_PROCID " + std::to_string(spec.rank) +
                      " is out of range for SLURM_NTASKS " + std::to_string(spec.world_size) +
                      "; use 0 to " + std::to_string(spec.world_size - 1) + " (" + kSlurmFix + ")");
  }
  const auto node = env.get("SLURMD_NODENAME");
  if (!node) throw ConfigError("SLURMD_NODENAME is not set; " + std::string(kSlurmFix));
  const auto [list_name, hosts] = slurm_hosts(env);
  if (std::find(hosts.begin(), hosts.end(), *node) == hosts.end()) {
    throw ConfigError("SLURMD_NODENAME " + shown(*node) + " is not among the " +
                      std::to_string(hosts.size()) + " hosts of " + list_name + " " +
                      shown(*env.get(list_name)) +
                      "; the variables come from different jobs or steps. " + kSlurmFix);
  }
  const auto master = env.get("MASTER_ADDR");
  if (!master && spec.rank == 0 && *node != hosts.front()) {
    throw ConfigError("SLURM_PROCID 0 (the chief) runs on " + shown(*node) +
                      ", not on the first host of " + list_name + " (" + shown(hosts.front()) +
                      "), where the others look for it; use srun's block or cyclic "
                      "distribution, or set MASTER_ADDR to the chief's host");
  }
  const std::string host = master ? *master : hosts.front();
  const auto port = env.get("MASTER_PORT");
  spec.rendezvous = master_address(host, port ? *port : std::to_string(job_port(env)),
                                   port ? "MASTER_ADDR/MASTER_PORT" : "the Slurm rendezvous");
  spec.task = {spec.rank == 0 ? TaskType::kChief : TaskType::kWorker, spec.rank};
  spec.local_host = *node;
  return spec;
}

namespace {
// A rank and a world size from two variables (range checked; rank 0 is the chief) and the
// rendezvous at a master host and port from two more: torchrun's and Kubeflow's shape.
ClusterSpec ranked(const Environment& env, const std::string& rank, const std::string& size,
                   const std::string& addr, const std::string& port, const std::string& fix) {
  ClusterSpec spec;
  spec.world_size = static_cast<int>(parse_int(env, size, 1, fix));
  spec.rank = static_cast<int>(parse_int(env, rank, 0, fix));
  if (spec.rank >= spec.world_size) {
    throw ConfigError(rank + " " + std::to_string(spec.rank) + " is out of range for " + size +
                      " " + std::to_string(spec.world_size) + "; use 0 to " +
                      std::to_string(spec.world_size - 1));
  }
  const auto host = env.get(addr);
  if (!host) throw ConfigError(addr + " is not set; " + fix);
  const auto at = env.get(port);
  if (!at) throw ConfigError(port + " is not set; " + fix);
  spec.rendezvous = master_address(*host, *at, addr + "/" + port);
  spec.task = {spec.rank == 0 ? TaskType::kChief : TaskType::kWorker, spec.rank};
  // A loopback master means every rank is on this machine; otherwise let Gloo pick the
  // address this host's name resolves to.
  if (spec.rendezvous.host == "127.0.0.1" || spec.rendezvous.host == "localhost" ||
      spec.rendezvous.host == "::1") {
    spec.local_host = spec.rendezvous.host;
  }
  return spec;
}
} // namespace

ClusterSpec from_torchrun_env(const Environment& env) {
  ClusterSpec spec =
      ranked(env, "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "torchrun-style launch sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT");
  spec.source = "torchrun environment";
  if (env.get("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True") {
    spec.agent_store_key = "flotilla/rendezvous/" + env.get("TORCHELASTIC_RUN_ID").value_or("run") +
                           "/restart-" + env.get("TORCHELASTIC_RESTART_COUNT").value_or("0");
  }
  return spec;
}

ClusterSpec single_worker() {
  ClusterSpec spec;
  spec.source = "single worker";
  spec.task = {TaskType::kWorker, 0};
  spec.rendezvous = Address{"127.0.0.1", 0}; // nothing listens: a group of one needs no network
  spec.local_host = "127.0.0.1";
  return spec;
}

namespace {
// Kubeflow Trainer v2's torch runtime gives each node PET_NNODES, PET_NPROC_PER_NODE,
// PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT for its default command, torchrun (which
// turns them into RANK, WORLD_SIZE, ...: from_torchrun_env). A container that runs flotilla
// itself is one process per node: node rank = rank.
ClusterSpec from_kubeflow_env(const Environment& env) {
  if (const auto per_node = env.get("PET_NPROC_PER_NODE"); per_node && *per_node != "1") {
    throw ConfigError("PET_NPROC_PER_NODE is \"" + *per_node +
                      "\": the TrainJob expects that many processes on each node, but flotilla "
                      "started directly is one; set numProcPerNode: 1 (one flotilla worker uses "
                      "all of a node's cores), or start it through torchrun (torchrun --no-python "
                      "flotilla train ...)");
  }
  ClusterSpec spec =
      ranked(env, "PET_NODE_RANK", "PET_NNODES", "PET_MASTER_ADDR", "PET_MASTER_PORT",
             "Kubeflow Trainer v2 sets PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR "
             "and PET_MASTER_PORT on every node");
  spec.source = "Kubeflow Trainer environment (PET_*)";
  return spec;
}

ClusterSpec resolve_cluster_only(const Environment& env) {
  if (const auto tf_config = env.get("TF_CONFIG")) return parse_tf_config(*tf_config);
  if (env.get("RANK") || env.get("WORLD_SIZE")) return from_torchrun_env(env);
  if (env.get("PET_NNODES")) return from_kubeflow_env(env);
  if (env.get("SLURM_PROCID") && env.get("SLURM_NTASKS")) return from_slurm_env(env);
  return single_worker();
}
} // namespace

void complete_etcd_security(EtcdRendezvous& etcd, const Environment& env) {
  // Each setting, filled from its variable where no flag set it; `source` names whichever did.
  struct Setting {
    std::string& value;
    std::string source;
  };
  const auto setting = [&](std::string& value, const char* flag, const char* variable) {
    if (!value.empty()) return Setting{value, flag};
    if (const auto v = env.get(variable)) value = *v;
    return Setting{value, variable};
  };
  const Setting ca = setting(etcd.ca_file, "--etcd-cacert", "FLOTILLA_ETCD_CACERT");
  const Setting cert = setting(etcd.cert_file, "--etcd-cert", "FLOTILLA_ETCD_CERT");
  const Setting key = setting(etcd.key_file, "--etcd-key", "FLOTILLA_ETCD_KEY");
  const Setting user = setting(etcd.user, "--etcd-user", "FLOTILLA_ETCD_USER");
  setting(etcd.password, "", "FLOTILLA_ETCD_PASSWORD");
  const auto file = [&](const Setting& s, const char* holding) {
    if (s.value.empty()) return;
    struct stat info {};
    const std::string named = s.source + " (" + holding + ") " + echoed(s.value);
    if (::stat(s.value.c_str(), &info) != 0) {
      throw ConfigError(named + ": " + std::strerror(errno) + "; name the PEM file");
    }
    if (!S_ISREG(info.st_mode) || ::access(s.value.c_str(), R_OK) != 0) {
      throw ConfigError(named + " is not a file this process can read; name the PEM file");
    }
    etcd.tls = true;
  };
  file(ca, "the CA that signed etcd's certificate");
  file(cert, "this client's certificate");
  file(key, "this client's private key");
  if (etcd.cert_file.empty() != etcd.key_file.empty()) {
    throw ConfigError(etcd.cert_file.empty()
                          ? key.source + " names a private key without its certificate; give " +
                                "--etcd-cert or FLOTILLA_ETCD_CERT too"
                          : cert.source + " names a certificate without its private key; give " +
                                "--etcd-key or FLOTILLA_ETCD_KEY too");
  }
  if (etcd.user.empty() != etcd.password.empty()) {
    throw ConfigError(etcd.user.empty()
                          ? "FLOTILLA_ETCD_PASSWORD is set but no etcd user; give --etcd-user or "
                            "FLOTILLA_ETCD_USER too"
                          : user.source + " names the etcd user " + echoed(etcd.user, 80) +
                                " without a password; set FLOTILLA_ETCD_PASSWORD");
  }
  if (!etcd.user.empty() && !etcd.tls) {
    throw ConfigError("the etcd user " + echoed(etcd.user, 80) + " (" + user.source +
                      ") would send its password over plain HTTP to " + etcd.url() +
                      "; write etcds:// (TLS) instead of etcd://");
  }
}

ClusterSpec resolve_cluster(const Environment& env) {
  ClusterSpec spec = resolve_cluster_only(env);
  if (const auto external = env.get("FLOTILLA_RENDEZVOUS")) {
    if (external->rfind("etcd://", 0) == 0 || external->rfind("etcds://", 0) == 0) {
      spec.etcd = parse_etcd_rendezvous(*external, "FLOTILLA_RENDEZVOUS");
      complete_etcd_security(spec.etcd, env);
      spec.rendezvous = spec.etcd.endpoints.front(); // unused: etcd names the replica
    } else {
      spec.rendezvous = parse_address(*external, "FLOTILLA_RENDEZVOUS");
    }
    spec.external_rendezvous = true;
    spec.agent_store_key.clear(); // the rendezvous is that process, not torchrun's agent store
  }
  return spec;
}

namespace {

// Loopback by any name is one host.
std::string host_key(const std::string& host) {
  if (host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0) return "loopback";
  return host;
}

// TF_CONFIG's training tasks at this task's host (the same address, loopback by any name), in
// rank order, and this task's place among them; nullopt where TF_CONFIG is unset or this task is
// the evaluator.
std::optional<std::pair<int, int>> tf_config_host(const Environment& env) {
  const auto text = env.get("TF_CONFIG");
  if (!text) return std::nullopt;
  const ClusterSpec spec = parse_tf_config(*text);
  if (spec.is_evaluator() || spec.rank < 0) return std::nullopt;
  const std::vector<Address> tasks = spec.training_addresses();
  const std::string mine = host_key(tasks.at(static_cast<std::size_t>(spec.rank)).host);
  int count = 0, index = 0;
  for (std::size_t r = 0; r < tasks.size(); ++r) {
    if (host_key(tasks[r].host) != mine) continue;
    if (static_cast<int>(r) == spec.rank) index = count;
    ++count;
  }
  return std::make_pair(count, index);
}

} // namespace

int local_rank(const Environment& env) {
  for (const char* name : {"LOCAL_RANK", "SLURM_LOCALID"}) {
    if (env.get(name)) {
      return static_cast<int>(parse_int(env, name, 0, "it is this worker's index on its machine"));
    }
  }
  if (!env.get("LOCAL_WORLD_SIZE")) {
    if (const auto host = tf_config_host(env)) return host->second;
  }
  return 0;
}

LocalWorkers local_workers(const Environment& env) {
  if (env.get("LOCAL_WORLD_SIZE")) {
    return {static_cast<int>(parse_int(env, "LOCAL_WORLD_SIZE", 1,
                                       "it is the number of workers on this machine")),
            "LOCAL_WORLD_SIZE"};
  }
  if (const auto host = tf_config_host(env)) {
    return {host->first, "TF_CONFIG's tasks at this task's address"};
  }
  if (!slurm_applies(env)) return {1, "one worker: no LOCAL_WORLD_SIZE, TF_CONFIG or Slurm"};
  const auto [list_name, hosts] = slurm_hosts(env);
  const auto node = env.get("SLURMD_NODENAME");
  const auto at = node ? std::find(hosts.begin(), hosts.end(), *node) : hosts.end();
  for (const char* name : {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
    const auto text = env.get(name);
    if (!text) continue;
    const auto counts = expand_slurm_tasks_per_node(*text, name);
    if (counts.size() != hosts.size()) {
      throw ConfigError(std::string(name) + " " + shown(*text) + " gives " +
                        std::to_string(counts.size()) + " nodes, " + list_name + " lists " +
                        std::to_string(hosts.size()) +
                        "; the variables come from different jobs or steps. " + kSlurmFix);
    }
    if (at != hosts.end()) {
      return {counts[static_cast<std::size_t>(at - hosts.begin())],
              std::string("Slurm's ") + name + " for this node"};
    }
  }
  if (env.get("SLURM_NTASKS_PER_NODE")) {
    return {static_cast<int>(parse_int(env, "SLURM_NTASKS_PER_NODE", 1,
                                       "it is the number of tasks on each node (sbatch "
                                       "--ntasks-per-node)")),
            "Slurm's SLURM_NTASKS_PER_NODE"};
  }
  // No per-node counts: assume the tasks are spread evenly.
  const long tasks = parse_int(env, "SLURM_NTASKS", 1, kSlurmFix);
  const long nodes = static_cast<long>(hosts.size());
  return {static_cast<int>((tasks + nodes - 1) / nodes),
          "Slurm's SLURM_NTASKS over its nodes, spread evenly"};
}

int local_world_size(const Environment& env) {
  return local_workers(env).count;
}


} // namespace flotilla::cluster
