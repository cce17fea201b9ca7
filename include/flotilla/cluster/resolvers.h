// Where a worker learns its cluster. In order: TF_CONFIG (TFJob, Vertex, `flotilla launch`,
// `flotilla tf-config`); torchrun-style RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT; otherwise a
// single local worker.
#pragma once

#include "flotilla/cluster/cluster_spec.h"
#include "flotilla/cluster/environment.h"

namespace flotilla::cluster {

// From RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; rank 0 is the chief and hosts the
// rendezvous store at MASTER_ADDR:MASTER_PORT.
ClusterSpec from_torchrun_env(const Environment& env);

// One worker, alone: world size 1, rank 0, nothing to connect to.
ClusterSpec single_worker();

// TF_CONFIG when set, else torchrun variables when RANK is set, else a single worker.
ClusterSpec resolve_cluster(const Environment& env);

// Workers started on this machine (LOCAL_WORLD_SIZE, set by `flotilla launch` and torchrun);
// 1 when unset. Used to share the cores between them.
int local_world_size(const Environment& env);

} // namespace flotilla::cluster
