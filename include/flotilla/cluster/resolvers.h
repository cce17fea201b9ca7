// Where a worker learns its cluster. In order: TF_CONFIG (TFJob, Vertex, `flotilla launch`,
// `flotilla tf-config`); torchrun-style RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT; a Slurm job
// step (`srun`: SLURM_PROCID, SLURM_NTASKS and the step's node list); otherwise a single local
// worker.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "flotilla/cluster/cluster_spec.h"
#include "flotilla/cluster/environment.h"

namespace flotilla::cluster {

// The most hosts a Slurm node list may expand to (and the most repetitions in a tasks-per-node
// list): far beyond any job, small enough that a corrupt range cannot exhaust memory.
inline constexpr std::size_t kMaxSlurmHosts = 65536;

// The rendezvous port of a Slurm job without MASTER_PORT: 29500 + SLURM_JOB_ID % 1000, so every
// task of a job computes the same port on its own, two jobs whose chiefs share a node rarely
// collide, and the port stays below Linux's ephemeral range (32768-60999) that Gloo's own
// connections use. 29500 (torchrun's default) when SLURM_JOB_ID is unset.
inline constexpr int kSlurmBasePort = 29500;

// Slurm's hostlist syntax expanded in order: "node[01-03,07],gpu-a[1-2]" -> node01 node02
// node03 node07 gpu-a1 gpu-a2. Zero padding follows each range's lower bound; several bracket
// groups in one name expand as a product ("r[1-2]n[1-2]" -> r1n1 r1n2 r2n1 r2n2). ConfigError
// names `variable`, the text and what is wrong, also when it would exceed kMaxSlurmHosts.
std::vector<std::string> expand_slurm_hostlist(std::string_view text, const std::string& variable);

// Slurm's tasks-per-node syntax expanded to one count per node: "2(x3),1" -> 2 2 2 1.
std::vector<int> expand_slurm_tasks_per_node(std::string_view text, const std::string& variable);

// From a Slurm job step: rank SLURM_PROCID, world size SLURM_NTASKS, this task's host
// SLURMD_NODENAME. The chief (rank 0, on the step's first node under Slurm's block and cyclic
// distributions) hosts the rendezvous at MASTER_ADDR if set, else the first host of
// SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST), on MASTER_PORT if set, else kSlurmBasePort +
// SLURM_JOB_ID % 1000.
ClusterSpec from_slurm_env(const Environment& env);

// From RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; rank 0 is the chief and hosts the
// rendezvous store at MASTER_ADDR:MASTER_PORT.
ClusterSpec from_torchrun_env(const Environment& env);

// One worker, alone: world size 1, rank 0, nothing to connect to.
ClusterSpec single_worker();

// TF_CONFIG when set, else torchrun variables when RANK or WORLD_SIZE is set, else Slurm's when
// SLURM_PROCID and SLURM_NTASKS are set, else a single worker. FLOTILLA_RENDEZVOUS=host:port
// then names a rendezvous hosted outside the workers (`flotilla rendezvous`; `flotilla launch
// --elastic` sets it): spec.rendezvous is that address and spec.external_rendezvous is true;
// FLOTILLA_RENDEZVOUS=etcd://... or etcds://... fills spec.etcd (see complete_etcd_security).
ClusterSpec resolve_cluster(const Environment& env);

// What a client needs to reach a secured etcd, from the environment where `etcd` has none of
// its own (flags set it first): FLOTILLA_ETCD_CACERT, FLOTILLA_ETCD_CERT and FLOTILLA_ETCD_KEY
// (PEM files; any of them means TLS), FLOTILLA_ETCD_USER and FLOTILLA_ETCD_PASSWORD. Then
// checks what it has: a certificate needs its key and a key its certificate, every file must be
// a readable regular file, a user needs a password (and a password a user), and a password is
// never sent over plain HTTP. ConfigError naming the flag or variable, the value and what to do.
void complete_etcd_security(EtcdRendezvous& etcd, const Environment& env);

// Workers started on this machine, and how that was found: LOCAL_WORLD_SIZE (set by `flotilla
// launch` and torchrun); else, under TF_CONFIG, its training tasks at this task's address (workers
// started by hand on one host: loopback by any name is one host); else, when resolve_cluster
// picks Slurm, this node's entry of the step's tasks per node; else 1. Used to share the cores
// (and GPUs) between them.
struct LocalWorkers {
  int count = 1;
  std::string source; // "LOCAL_WORLD_SIZE", "TF_CONFIG's tasks at this task's address", ...
};
LocalWorkers local_workers(const Environment& env);
int local_world_size(const Environment& env); // local_workers(env).count
// This worker's index among them: LOCAL_RANK (flotilla launch, torchrun), SLURM_LOCALID, its
// place among TF_CONFIG's tasks at its address (in rank order), or 0.
int local_rank(const Environment& env);

} // namespace flotilla::cluster
