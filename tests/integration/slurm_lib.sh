# Sourced by tests/integration/slurm.sh and netns/slurm_nodes.sh: what every test Slurm of
# flotilla's shares.

# munge_start DIR: a munged of the test's own, its key, socket, pid and log under DIR.
munge_start() {
  local dir=$1
  mkdir -p "$dir"
  chmod 711 "$dir" # munged wants its socket directory searchable by all
  head -c 1024 /dev/urandom >"$dir/munge.key"
  chmod 400 "$dir/munge.key"
  munged --key-file="$dir/munge.key" --socket="$dir/munge.socket" \
    --pid-file="$dir/munged.pid" --log-file="$dir/munged.log" --seed-file="$dir/seed"
}

# slurm_conf_common MUNGE_SOCKET: slurm.conf lines both tests use (root daemons, munge on that
# socket, no cgroups, accounting or MPI, one core per task).
slurm_conf_common() {
  cat <<CONF
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire: Slurm keeps a requeued job back until the killed job's credential has expired
# (slurmd refuses it until then: "Job credential revoked"); 5 s instead of 120.
AuthInfo=socket=$1,cred_expire=5
# A startable job is started by the next scheduling pass: every 60 s by default (30 s for
# backfill), which made a requeued job wait 30-120 s at random.
SchedulerParameters=sched_interval=1,bf_interval=1
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
CONF
}
