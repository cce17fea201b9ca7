// The process environment as flotilla sees it. This is the one place that reads environment
// variables: everything else takes an Environment, so tests pass their own.
#pragma once

#include <map>
#include <optional>
#include <string>

namespace flotilla::cluster {

class Environment {
 public:
  Environment() = default;
  explicit Environment(std::map<std::string, std::string> vars) : vars_(std::move(vars)) {}

  // Snapshot of the variables flotilla understands: TF_CONFIG; RANK, WORLD_SIZE, MASTER_ADDR,
  // MASTER_PORT, LOCAL_RANK, LOCAL_WORLD_SIZE (torchrun's names, also set by `flotilla launch`);
  // FLOTILLA_TERMINAL (set by `flotilla launch` when its own output is a
  // terminal, so a worker draws a progress bar through the launcher's pipe);
  // FLOTILLA_CLUSTER_TOKEN, or FLOTILLA_CLUSTER_TOKEN_FILE naming a file that holds it (a shared
  // secret for the HMAC-SHA256 rendezvous handshake; never logged), and
  // FLOTILLA_CLUSTER_TOKEN_RUN_ONLY (set by `flotilla launch` beside a token it made for the
  // run, which therefore keys no checkpoint); FLOTILLA_RENDEZVOUS (a
  // rendezvous outside the workers, see resolve_cluster); FLOTILLA_ETCD_CACERT, _CERT, _KEY,
  // _USER and _PASSWORD (a secured etcd's, see complete_etcd_security); Slurm's SLURM_PROCID,
  // SLURM_LOCALID, SLURM_NTASKS, SLURMD_NODENAME, SLURM_STEP_NODELIST, SLURM_JOB_NODELIST,
  // SLURM_STEP_TASKS_PER_NODE, SLURM_TASKS_PER_NODE, SLURM_NTASKS_PER_NODE and SLURM_JOB_ID
  // (set by srun for each task; see from_slurm_env); torchrun's TORCHELASTIC_USE_AGENT_STORE,
  // TORCHELASTIC_RUN_ID and TORCHELASTIC_RESTART_COUNT (see ClusterSpec::agent_store_key).
  static Environment from_process();

  // The value, or nullopt when unset or empty.
  std::optional<std::string> get(const std::string& name) const;
  // Whether the variable is set, even to "" (where an empty value is a mistake, not an absence).
  bool is_set(const std::string& name) const { return vars_.count(name) != 0; }

 private:
  std::map<std::string, std::string> vars_;
};

} // namespace flotilla::cluster
