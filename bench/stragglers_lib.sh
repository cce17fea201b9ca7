# Shared by bench/stragglers.sh and bench/stragglers_more.sh (sourced, not run): CPU quotas in
# cgroups, free ports, medians, an epoch's samples/s from flotilla's metrics JSON.

# A cgroup named flotilla-stragglers-$$-$1 with quota $2 (a fraction of one core; "max": none):
# prints its directory, or nothing where none can be made (root, cgroup v2 cpu or v1 cpu). Sets
# nothing else; the caller removes it (rmdir) when done.
quota_cgroup() {
  local name=$1 quota=$2 dir
  if [ -w /sys/fs/cgroup/cgroup.subtree_control ] &&
    grep -qw cpu /sys/fs/cgroup/cgroup.controllers 2>/dev/null; then
    dir=/sys/fs/cgroup/flotilla-stragglers-$$-$name
    mkdir "$dir" 2>/dev/null && set_quota "$dir" "$quota" && echo "$dir" && return
  elif [ -w /sys/fs/cgroup/cpu ]; then
    dir=/sys/fs/cgroup/cpu/flotilla-stragglers-$$-$name
    mkdir "$dir" 2>/dev/null && set_quota "$dir" "$quota" && echo "$dir" && return
  fi
  [ -n "${dir:-}" ] && rmdir "$dir" 2>/dev/null
  return 0
}
# The quota of cgroup $1 (v2 or v1) to $2 of a core, or "max" for none, over periods of
# PERIOD_US microseconds (100000, the kernel's and Kubernetes' default: a half-core quota runs
# 50 ms and stalls 50 ms; 10000 spreads the same quota over 5 ms stalls).
PERIOD_US=${PERIOD_US:-100000}
set_quota() {
  local dir=$1 quota=$2 us
  us=$([ "$quota" = max ] && echo max || awk -v s="$quota" -v p="$PERIOD_US" 'BEGIN { printf "%d", s * p }')
  if [ -e "$dir/cpu.max" ]; then
    echo "$us $PERIOD_US" > "$dir/cpu.max"
  else
    echo "$PERIOD_US" > "$dir/cpu.cfs_period_us"
    echo "$([ "$us" = max ] && echo -1 || echo "$us")" > "$dir/cpu.cfs_quota_us"
  fi
}
cgroup_kind() {
  local period="a $((PERIOD_US / 1000)) ms period"
  [ -e "$1/cpu.max" ] && echo "cgroup v2 cpu.max, $period" || echo "cgroup v1 cpu.cfs_quota_us, $period"
}
# Runs "$@" inside cgroup $1 (none: as it is).
in_cgroup() {
  local dir=$1
  shift
  if [ -n "$dir" ]; then
    sh -c 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"' sh "$dir" "$@"
  else
    "$@"
  fi
}
port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
median() { sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
# Epoch $2's samples/s (default 2) in metrics JSON file $1.
epoch_speed() { grep "\"epoch\": *${2:-2}[,}]" "$1" | sed 's/.*"samples_per_s": *\([0-9.e+-]*\).*/\1/'; }
