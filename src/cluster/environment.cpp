#include "flotilla/cluster/environment.h"

#include <cstdlib>

namespace flotilla::cluster {

Environment Environment::from_process() {
  static const char* const kNames[] = {
      "TF_CONFIG", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
      "LOCAL_WORLD_SIZE", "FLOTILLA_TERMINAL", "FLOTILLA_CLUSTER_TOKEN",
      "FLOTILLA_CLUSTER_TOKEN_FILE", "FLOTILLA_CLUSTER_TOKEN_RUN_ONLY", "FLOTILLA_RENDEZVOUS",
      // A secured etcd's, read by complete_etcd_security.
      "FLOTILLA_ETCD_CACERT", "FLOTILLA_ETCD_CERT", "FLOTILLA_ETCD_KEY", "FLOTILLA_ETCD_USER",
      "FLOTILLA_ETCD_PASSWORD",
      // torchrun's agent, read by from_torchrun_env.
      "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
      // Kubeflow Trainer v2's torch runtime, read by from_kubeflow_env.
      "PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT",
      // Slurm's, read by from_slurm_env, local_rank and local_world_size.
      "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURMD_NODENAME", "SLURM_STEP_NODELIST",
      "SLURM_JOB_NODELIST", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
      "SLURM_NTASKS_PER_NODE", "SLURM_JOB_ID"};
  std::map<std::string, std::string> vars;
  for (const char* name : kNames) {
    if (const char* value = std::getenv(name)) vars[name] = value;
  }
  return Environment(std::move(vars));
}

std::optional<std::string> Environment::get(const std::string& name) const {
  auto it = vars_.find(name);
  if (it == vars_.end() || it->second.empty()) return std::nullopt;
  return it->second;
}

} // namespace flotilla::cluster
