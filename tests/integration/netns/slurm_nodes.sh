#!/usr/bin/env bash
# flotilla under a real Slurm across hosts: slurmctld on one namespaced host and a slurmd on each
# of two others (Debian's slurm-wlm, this test's own configuration, key, ports and directories;
# munged shared through its socket file), the hosts' names in an /etc/hosts bound for them
# alone. `sbatch --nodes=2 examples/slurm/train.sbatch` puts one worker on each node: Slurm
# gives the step its node list compressed (n[1-2]), flotilla finds the chief on n1, and the
# workers train across the bridge.
#   slurm_nodes.sh [FLOTILLA] [PYTHON]     (ctest -R netns_slurm_nodes; exit 77 without Slurm)
set -euo pipefail
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/../slurm_lib.sh"
netns_init slurm_nodes 150 "$@"
for tool in slurmctld slurmd munged sbatch sinfo; do
  command -v "$tool" >/dev/null || skip "$tool is not installed (apt install slurm-wlm munge)"
done
[[ -d /usr/share/datasets/fashion-mnist ]] || skip "no Fashion-MNIST"

root_dir=$(cd "$(dirname "$0")/../../.." && pwd)
netns_add_hosts 3
names=("$(hostname -s)-ctl" n1 n2) # slurmctld must run on a host of the machine's own name
# Each host resolves the three names through an /etc/hosts of its own, bound in a mount
# namespace of its own (not ip netns exec: it remounts /sys, and slurmd needs the cgroup
# filesystem there).
{
  echo "127.0.0.1 localhost"
  for k in 0 1 2; do echo "$(host_ip "$k") ${names[$k]}"; done
} >"$tmp/hosts"
stop_slurm() {
  local f
  for f in "$tmp"/slurm/*.pid "$tmp"/munge/munged.pid; do
    [[ -s $f ]] && kill -TERM "$(cat "$f")" 2>/dev/null
  done
}
cleanup_all() {
  local rc=$?
  set +e
  stop_slurm
  (exit "$rc")
  netns_cleanup
}
trap cleanup_all EXIT
mkdir -p "$tmp"/{slurm,shared,log}
chmod 755 "$tmp"
munge_start "$tmp/munge" || die "munged did not start"

export SLURM_CONF=$tmp/slurm/slurm.conf
cat >"$SLURM_CONF" <<CONF
ClusterName=flitn
SlurmctldHost=$(hostname -s)($(host_ip 0))
$(slurm_conf_common "$tmp/munge/munge.socket")
SlurmctldPort=26817
SlurmdPort=26818
StateSaveLocation=$tmp/slurm/state
SlurmdSpoolDir=$tmp/slurm/spool-%n
SlurmctldPidFile=$tmp/slurm/slurmctld.pid
SlurmdPidFile=$tmp/slurm/slurmd-%n.pid
SlurmctldLogFile=$tmp/log/slurmctld.log
SlurmdLogFile=$tmp/log/slurmd-%n.log
NodeName=n1 NodeAddr=$(host_ip 1) CPUs=2 State=UNKNOWN
NodeName=n2 NodeAddr=$(host_ip 2) CPUs=2 State=UNKNOWN
PartitionName=flitn Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
on() {  # HOST COMMAND...: in that host's network namespace, with the hosts file above
  local h=$1
  shift
  unshare -m bash -c 'mount --bind "$1" /etc/hosts && exec nsenter --net="$2" -- "${@:3}"' _ \
    "$tmp/hosts" "/run/netns/$(host_ns "$h")" "$@"
}
on 0 slurmctld -f "$SLURM_CONF" 2>"$tmp/log/slurmctld.err" ||
  die "slurmctld did not start: $(cat "$tmp/log/slurmctld.err")"
for n in 1 2; do
  on "$n" slurmd -f "$SLURM_CONF" -N "n$n" 2>"$tmp/log/slurmd-n$n.err" ||
    die "slurmd n$n did not start: $(tail -n 3 "$tmp/log/slurmd-n$n.err" "$tmp/log/slurmd-n$n.log")"
done
start=$SECONDS
until [[ $(on 0 sinfo -h -N -o %T 2>/dev/null | grep -c idle) -eq 2 ]]; do
  ((SECONDS - start < 30)) || die "the nodes did not become idle: $(on 0 sinfo -N 2>&1)"
  sleep 0.5
done
log "Slurm $(slurmd -V | awk '{print $2}'): nodes n1 and n2 idle on $(host_ip 1) and $(host_ip 2)"

export PATH=$(dirname "$bin"):$PATH # the example calls `flotilla`: the copy netns_init made
export FLOTILLA_SHARED=$tmp/shared
export FLOTILLA_TRAIN_ARGS="--model mlp --epochs 1 --steps-per-epoch 5 --batch-per-replica 16 --verbose 0"
export OMP_NUM_THREADS=1
unset TF_CONFIG RANK WORLD_SIZE MASTER_ADDR MASTER_PORT FLOTILLA_RENDEZVOUS
out=$tmp/job.out
on 0 sbatch --wait --nodes=2 --ntasks-per-node=1 --cpus-per-task=1 --job-name=flitn \
  --output="$out" --chdir="$tmp" "$root_dir/examples/slurm/train.sbatch" >/dev/null ||
  { cat "$out"; die "the 2-node job failed"; }
grep -q "MultiWorkerMirroredStrategy: 2 worker(s).*cluster from Slurm environment" "$out" ||
  { cat "$out"; die "the job did not train as 2 workers"; }
grep -q "Test: loss: " "$out" || { cat "$out"; die "no test result"; }
# Slurm gave the step its node list compressed; flotilla expanded it and found the chief on n1.
grep -qE '(NodeList=| on )n\[1-2\]' "$tmp/log/slurmctld.log" ||
  die "slurmctld did not start the job on n[1-2]: $(grep -m1 -e Allocate -e _start_job "$tmp/log/slurmctld.log")"
grep -q "rendezvous n1:" "$out" || { cat "$out"; die "the chief's rendezvous is not on n1"; }
log "sbatch --nodes=2: $(grep -o 'MultiWorkerMirroredStrategy: [^;]*; cluster from Slurm environment, rendezvous [^ ]*' "$out" | head -n 1)"
log "$(grep -o 'Test: .*' "$out" | head -n 1)"
netns_finish
