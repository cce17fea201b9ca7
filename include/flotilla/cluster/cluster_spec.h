// The cluster a worker belongs to: every task's address and which task this process is, as
// TF_CONFIG describes it, plus the training group derived from it (world size, this worker's
// rank, the chief's rendezvous address). Resolvers (resolvers.h) build one from TF_CONFIG,
// torchrun-style variables, Slurm's, or nothing at all.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace flotilla::cluster {

struct Address {
  std::string host;
  int port = 0;

  std::string to_string() const; // "host:port", "[v6]:port"
  bool operator==(const Address& other) const { return host == other.host && port == other.port; }
  bool operator!=(const Address& other) const { return !(*this == other); }
};

// Parses "host:port" or "[ipv6]:port". `what` names the field in the error message, e.g.
// "TF_CONFIG cluster.worker[1]" or "MASTER_ADDR/MASTER_PORT".
Address parse_address(std::string_view text, const std::string& what);

// FLOTILLA_RENDEZVOUS=etcd://HOST:PORT,HOST:PORT,...[/JOB] (plain HTTP) or etcds://... (TLS):
// an etcd cluster (v3 API, through its client URLs' JSON gateway) in which `flotilla rendezvous
// --etcd` replicas elect the one that serves JOB's rendezvous ("flotilla" when no JOB is given).
struct EtcdRendezvous {
  std::vector<Address> endpoints;
  std::string job;
  // Client TLS (etcds://, or any certificate named): etcd's certificate is verified against
  // `ca_file` (PEM; the system's CAs when empty) and must name the endpoint's host, and
  // `cert_file` with `key_file` (PEM) are presented where etcd asks for a client certificate
  // (its --client-cert-auth).
  bool tls = false;
  std::string ca_file, cert_file, key_file;
  // etcd's own authentication (its `auth enable`): this user's name and password, exchanged for
  // the token etcd issues, sent with every call. None when `user` is empty.
  std::string user, password;
  // The key the serving replica holds under its lease; its value is that replica's HOST:PORT.
  std::string key() const { return "/flotilla/" + job + "/rendezvous"; }
  // "etcd://" or "etcds://", the endpoints and the job, as a user writes it.
  std::string url() const;
};
// Parses "etcd://h1:2379,h2:2379/job" or "etcds://..."; ConfigError naming `what`, the value
// and the form.
EtcdRendezvous parse_etcd_rendezvous(std::string_view text, const std::string& what);

enum class TaskType { kChief, kWorker, kEvaluator };
std::string_view to_string(TaskType type);

struct TaskSpec {
  TaskType type = TaskType::kWorker;
  int index = 0;
};

struct ClusterSpec {
  // Jobs as listed in TF_CONFIG (empty when the source does not list them, e.g. torchrun env).
  std::vector<Address> chief; // at most one
  std::vector<Address> worker;
  std::vector<Address> evaluator; // at most one; never part of the training group
  TaskSpec task;
  std::string rpc_layer;   // accepted and kept; flotilla always speaks c10d/Gloo/NCCL
  std::string environment; // accepted and kept ("cloud", "google", ...)

  // The training group, derived once by the resolver.
  int world_size = 1; // chief + workers
  int rank = 0;       // chief is 0, then workers by index; -1 for the evaluator
  Address rendezvous; // the chief's address; it hosts the rendezvous store on that port
  // The rendezvous is hosted outside the training tasks (FLOTILLA_RENDEZVOUS: `flotilla
  // rendezvous`, or `flotilla launch --elastic`): `rendezvous` is that process's address.
  bool external_rendezvous = false;
  // FLOTILLA_RENDEZVOUS=etcd://...: the rendezvous is whichever replica etcd names now (found
  // again after a lost connection); `rendezvous` is then unused. No endpoints otherwise.
  EtcdRendezvous etcd;
  // Under torchrun, whose agent keeps its own c10d store on MASTER_ADDR:MASTER_PORT
  // (TORCHELASTIC_USE_AGENT_STORE=True), `rendezvous` is that store, not a free port: the chief
  // hosts flotilla's rendezvous on a port of its own on that host and publishes its address in
  // the agent's store under this key (one per run and restart), where the others read it.
  // "" without an agent store.
  std::string agent_store_key;
  std::string local_host; // this task's own host (to bind collectives to); "" when unknown
  // "TF_CONFIG", "torchrun environment", "Slurm environment" or "single worker".
  std::string source;
  // What the resolver accepted with a remark the user should see once (TF_CONFIG's deprecated
  // "master"); the CLI logs them.
  std::vector<std::string> notes;

  bool is_chief() const { return rank == 0; }
  bool is_evaluator() const { return task.type == TaskType::kEvaluator; }
  // Training tasks in rank order: chief first, then workers by index.
  std::vector<Address> training_addresses() const;
};

// A TF_CONFIG JSON document for this spec's jobs and task (what `flotilla tf-config` prints and
// `flotilla launch` sets); parse_tf_config(to_tf_config(spec)) gives the spec back.
std::string to_tf_config(const ClusterSpec& spec);

// Parses and validates a TF_CONFIG document with the rules TensorFlow applies; throws
// ConfigError naming the field, the value seen and the fix.
ClusterSpec parse_tf_config(std::string_view json);

} // namespace flotilla::cluster
