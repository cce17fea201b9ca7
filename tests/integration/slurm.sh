#!/usr/bin/env bash
# flotilla under a real Slurm (Debian's slurm-wlm 22.05: slurmctld, slurmd and munged, started
# here as root with a private configuration, key, ports and directories, and stopped at the end):
# `sbatch --wait examples/slurm/train.sbatch` with 2 and then 3 tasks on this one node trains
# (srun's variables, flotilla's Slurm resolver, the cluster token file the script makes); then a
# job SIGTERMed mid-training saves, exits 75, is requeued by the script and resumes. Nothing
# of a system Slurm is touched: every daemon gets -f with this test's slurm.conf.
#   slurm.sh FLOTILLA_BIN_DIR      (ctest -R slurm_sbatch; exit 77, skipped, without Slurm or root)
set -euo pipefail
bin_dir=$1
root=$(cd "$(dirname "$0")/../.." && pwd)
skip() { echo "SKIPPED: $*"; exit 77; }
source "$(dirname "$0")/slurm_lib.sh"
[[ $(id -u) -eq 0 ]] || skip "needs root (slurmd runs jobs as their user)"
for tool in slurmctld slurmd munged sbatch sinfo python3; do
  command -v "$tool" >/dev/null || skip "$tool is not installed (apt install slurm-wlm munge)"
done
[[ -d /usr/share/datasets/fashion-mnist ]] || skip "no Fashion-MNIST"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/flotilla-slurm.XXXXXX")
chmod 755 "$tmp"
pids=()
cleanup() {
  local rc=$?
  for f in "$tmp"/slurmd.pid "$tmp"/slurmctld.pid "$tmp"/munge/munged.pid; do
    [[ -s $f ]] && kill -TERM "$(cat "$f")" 2>/dev/null
  done
  sleep 1
  for f in "$tmp"/slurmd.pid "$tmp"/slurmctld.pid "$tmp"/munge/munged.pid; do
    [[ -s $f ]] && kill -KILL "$(cat "$f")" 2>/dev/null
  done
  if ((rc == 0)); then rm -rf "$tmp"; else echo "logs kept in $tmp"; fi
  exit "$rc"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; tail -n 20 "$tmp"/log/*.log 2>/dev/null; exit 1; }

mkdir -p "$tmp"/{state,spool,log,shared}
munge_start "$tmp/munge" || fail "munged did not start"

# Two free TCP ports for slurmctld and slurmd.
read -r ctld_port slurmd_port < <(python3 -c 'import socket
s=[socket.socket() for _ in range(2)]
[x.bind(("127.0.0.1", 0)) for x in s]
print(*[x.getsockname()[1] for x in s])')
node=$(hostname)
export SLURM_CONF=$tmp/slurm.conf
cat >"$SLURM_CONF" <<CONF
ClusterName=flit
SlurmctldHost=$node(127.0.0.1)
$(slurm_conf_common "$tmp/munge/munge.socket")
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
StateSaveLocation=$tmp/state
SlurmdSpoolDir=$tmp/spool
SlurmctldPidFile=$tmp/slurmctld.pid
SlurmdPidFile=$tmp/slurmd.pid
SlurmctldLogFile=$tmp/log/slurmctld.log
SlurmdLogFile=$tmp/log/slurmd.log
NodeName=$node NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
PartitionName=flit Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
slurmctld -f "$SLURM_CONF" || fail "slurmctld did not start"
slurmd -f "$SLURM_CONF" || fail "slurmd did not start"
start=$SECONDS
until sinfo -h -o %T 2>/dev/null | grep -q idle; do
  ((SECONDS - start < 30)) || fail "the node did not become idle: $(sinfo 2>&1)"
  sleep 0.5
done
echo "Slurm $(slurmd -V | awk '{print $2}'): node $node idle (slurmctld :$ctld_port, slurmd :$slurmd_port)"

export PATH=$bin_dir:$PATH # the example calls `flotilla`
export FLOTILLA_SHARED=$tmp/shared
export FLOTILLA_TRAIN_ARGS="--model mlp --epochs 1 --steps-per-epoch 5 --batch-per-replica 16 --verbose 0"
export OMP_NUM_THREADS=1
unset TF_CONFIG RANK WORLD_SIZE MASTER_ADDR MASTER_PORT FLOTILLA_RENDEZVOUS
for tasks in 2 3; do
  out=$tmp/job-$tasks.out
  rc=0
  timeout 300 sbatch --wait --nodes=1 --ntasks="$tasks" --ntasks-per-node="$tasks" \
    --cpus-per-task=1 --job-name="flit$tasks" --output="$out" --chdir="$tmp" \
    "$root/examples/slurm/train.sbatch" >/dev/null || rc=$?
  ((rc == 0)) || { cat "$out"; fail "sbatch with $tasks tasks exited $rc"; }
  grep -q "MultiWorkerMirroredStrategy: $tasks worker(s).*cluster from Slurm environment" "$out" ||
    { cat "$out"; fail "the job of $tasks tasks did not train as $tasks workers"; }
  grep -q "Test: loss: " "$out" || { cat "$out"; fail "no test result with $tasks tasks"; }
  [[ -f $FLOTILLA_SHARED/cluster-token ]] || fail "the script made no cluster token file"
  echo "sbatch, $tasks tasks: $(grep -o 'MultiWorkerMirroredStrategy: [^,]*' "$out"), $(grep -o 'Test: .*' "$out")"
done
# Preemption, as Slurm's two --signal forms deliver it: TERM to the job's steps (--signal=TERM@N,
# the example's) or USR1 to the batch script alone (--signal=B:USR1@N, which the script passes
# on). Mid-training the workers save a backup at one step and exit 75, the script requeues the
# job, and the requeued job resumes from the backup and finishes. Signalled once epoch 2 of 5
# shows in the job's output, with three epochs (3 s or more) left: the output and the signal
# each take a moment through Slurm, and with 3 epochs the signal once came at the last step
# (training had ended, nothing to resume). 1500 steps an epoch: with the gradients summed
# through shared memory a step takes about 1 ms, and at 150 steps the training ended before
# the signal came.
export FLOTILLA_TRAIN_ARGS="--model mlp --epochs 5 --steps-per-epoch 1500 --batch-per-replica 16 --verbose 2"
preempt() {  # name, then scancel's options that send the signal
  local name=$1 job state start out=$tmp/job-$1.out
  shift
  job=$(sbatch --parsable --nodes=1 --ntasks=2 --ntasks-per-node=2 --cpus-per-task=1 \
    --job-name="$name" --output="$out" --open-mode=append --chdir="$tmp" \
    "$root/examples/slurm/train.sbatch")
  start=$SECONDS
  until grep -q "Epoch 2/5" "$out" 2>/dev/null; do
    ((SECONDS - start < 120)) || { cat "$out"; fail "job $name did not reach epoch 2"; }
    sleep 0.2
  done
  scancel "$@" "$job"
  echo "job $job ($name): scancel $* in epoch 2 (at ${SECONDS}s)"
  # Slurm holds the requeued job back until the killed one's credential expired (cred_expire,
  # slurm_lib.sh). Starting it sooner (scontrol update StartTime=now) raced with slurmd and
  # failed on a fresh machine.
  start=$SECONDS
  until [[ $(scontrol show job "$job" 2>/dev/null | grep -o 'JobState=[A-Z]*') == JobState=COMPLETED ]]; do
    state=$(scontrol show job "$job" 2>/dev/null | grep -o 'JobState=[A-Z_]*' || true)
    [[ $state != JobState=FAILED && $state != JobState=CANCELLED ]] || { cat "$out"; fail "job $job: $state"; }
    ((SECONDS - start < 240)) || { cat "$out"; fail "job $job did not complete after the requeue ($state)"; }
    sleep 0.5
  done
  grep -q "BackupAndRestore: resuming from $FLOTILLA_SHARED/$name/backup" "$out" ||
    { cat "$out"; fail "the requeued job $name did not resume from the backup"; }
  grep -q "Test: loss: " "$out" || { cat "$out"; fail "the requeued job $name gave no test result"; }
  echo "requeued job $name, done at ${SECONDS}s: $(grep -o 'BackupAndRestore: resuming from .*' "$out" | head -n1 | sed "s|$tmp/||")"
}
preempt flitrq --signal=TERM            # what --signal=TERM@N sends: every step's tasks
preempt flitusr1 --batch --signal=USR1  # what --signal=B:USR1@N sends: the batch script only
echo PASSED
