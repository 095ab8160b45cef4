#!/usr/bin/env bash
# A real single-host Slurm cluster for tests and for trying DynaResize without a cluster.
#
#   bash slurm/local-cluster.sh install   # as root: apt-get install slurmctld slurmd slurm-client munge (Slurm 22.05)
#   bash slurm/local-cluster.sh start     # write the configs, start munged + slurmctld + 3 slurmd, wait for idle nodes
#   bash slurm/local-cluster.sh status    # sinfo + squeue
#   bash slurm/local-cluster.sh stop      # kill the daemons this script started
#
# Layout (all on this host, NodeAddr=127.0.0.1, one slurmd per node on its own port):
#   partition cpu : node cpu1 (4 CPUs)                       -> het component 0 (coordinator + Redis)
#   partition gpu : nodes gpu[1-2] (8 CPUs, 4 fake GPUs each) -> het component 1 (one worker rank per GPU)
#   partition urgent: every node, PriorityTier 10 -> preempts jobs of cpu/gpu (PriorityTier 1): Slurm requeues them
#                     (PreemptType=preempt/partition_prio, PreemptMode=REQUEUE) after SIGTERM and a GraceTime of
#                     DYNARESIZE_SLURM_GRACE_S seconds (default 60) to finish the step and checkpoint
# Fake GPUs are character devices (mknod c 1 3, i.e. /dev/null) listed in gres.conf with AutoDetect=off.
# Every step is idempotent: install skips what is installed, start skips daemons that already run.
# Environment knobs: DYNARESIZE_SLURM_GPUS_PER_NODE (default 4), DYNARESIZE_SLURM_CTLD_PORT (default 16817),
# DYNARESIZE_SLURM_GRACE_S (default 60: preemption grace time of the cpu and gpu partitions).
set -euo pipefail

GPUS_PER_NODE="${DYNARESIZE_SLURM_GPUS_PER_NODE:-4}"
CTLD_PORT="${DYNARESIZE_SLURM_CTLD_PORT:-16817}"
GRACE_S="${DYNARESIZE_SLURM_GRACE_S:-60}"
GPU_NODES=(gpu1 gpu2)
CPU_NODES=(cpu1)
ALL_NODES=("${CPU_NODES[@]}" "${GPU_NODES[@]}")
ETC=/etc/slurm
SPOOL=/var/spool/slurm
LOGS=/var/log/slurm
RUN=/run/slurm
FAKE_GPU_DIR=/dev/fake-gpu

log() { echo "local-cluster: $*" >&2; }
die() { log "error: $*"; exit 1; }
need_root() { [ "$(id -u)" = 0 ] || die "'$1' needs root (it installs packages / starts system daemons): run it in a root shell, or as a user with sudo in front: sudo bash slurm/local-cluster.sh $1"; }

node_port() {  # cpu1 -> 17001, gpu1 -> 17002, ...
  local i=0 n
  for n in "${ALL_NODES[@]}"; do i=$((i + 1)); [ "$n" = "$1" ] && { echo $((17000 + i)); return; }; done
  die "unknown node $1"
}

cmd_install() {
  need_root install
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sinfo >/dev/null && command -v munged >/dev/null; then
    log "slurm and munge already installed ($(slurmctld -V 2>/dev/null || echo '?'))"
    return 0
  fi
  command -v apt-get >/dev/null || die "apt-get not found: install slurmctld slurmd slurm-client munge (Slurm 22.05) by hand"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq || log "apt-get update failed; trying the install anyway"
  # policy-rc.d keeps the packages' own services from starting: this script starts the daemons itself.
  local prc=/usr/sbin/policy-rc.d created_prc=0
  if [ ! -e "$prc" ]; then printf '#!/bin/sh\nexit 101\n' >"$prc"; chmod +x "$prc"; created_prc=1; fi
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
  [ "$created_prc" = 1 ] && rm -f "$prc"
  log "installed $(slurmctld -V)"
}

write_configs() {
  local host; host="$(hostname)"
  mkdir -p "$ETC" "$SPOOL/ctld" "$LOGS" "$RUN" "$FAKE_GPU_DIR"
  local n g
  for n in "${ALL_NODES[@]}"; do mkdir -p "$SPOOL/d/$n"; done
  for n in "${GPU_NODES[@]}"; do
    for ((g = 0; g < GPUS_PER_NODE; g++)); do
      [ -c "$FAKE_GPU_DIR/$n-$g" ] || { rm -f "$FAKE_GPU_DIR/$n-$g"; mknod "$FAKE_GPU_DIR/$n-$g" c 1 3; chmod 666 "$FAKE_GPU_DIR/$n-$g"; }
    done
  done
  local tmp; tmp="$(mktemp)"
  cat >"$tmp" <<EOF
# Written by slurm/local-cluster.sh: a single-host test cluster (do not use in production).
ClusterName=dynaresize-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire also sets how long a requeued job waits before it may start again (default 120 s)
AuthInfo=cred_expire=5
StateSaveLocation=$SPOOL/ctld
SlurmdSpoolDir=$SPOOL/d/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
SlurmdParameters=config_overrides
GresTypes=gpu
ReturnToService=2
JobRequeue=1
MinJobAge=5
SlurmctldTimeout=10
SlurmdTimeout=10
InactiveLimit=0
KillWait=3
MessageTimeout=10
BatchStartTimeout=10
UnkillableStepTimeout=10
OverTimeLimit=0
# Preemption: a job of a partition with a higher PriorityTier (urgent) takes the nodes of lower ones (cpu, gpu);
# the preempted job gets SIGTERM, GraceTime seconds, then SIGKILL, and Slurm requeues it (same job id).
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
# As many sites do: a task that fails takes its whole step down, unless srun says --kill-on-bad-exit=0 (the
# worker step does: the coordinator decides what a dead rank means)
KillOnBadExit=1
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SlurmctldDebug=info
SlurmdDebug=info
NodeName=${CPU_NODES[0]} NodeHostname=$host NodeAddr=127.0.0.1 Port=$(node_port "${CPU_NODES[0]}") CPUs=4 RealMemory=4000 State=UNKNOWN
EOF
  for n in "${GPU_NODES[@]}"; do
    echo "NodeName=$n NodeHostname=$host NodeAddr=127.0.0.1 Port=$(node_port "$n") CPUs=8 RealMemory=8000 Gres=gpu:$GPUS_PER_NODE State=UNKNOWN" >>"$tmp"
  done
  local gpu_list; gpu_list="$(IFS=,; echo "${GPU_NODES[*]}")"
  cat >>"$tmp" <<EOF
PartitionName=cpu Nodes=${CPU_NODES[0]} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=$GRACE_S
PartitionName=gpu Nodes=$gpu_list MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=$GRACE_S
PartitionName=urgent Nodes=${CPU_NODES[0]},$gpu_list MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
EOF
  install -m 644 "$tmp" "$ETC/slurm.conf"
  {
    echo "# Written by slurm/local-cluster.sh: fake GPUs (character devices aliasing /dev/null)."
    echo "AutoDetect=off"
    for n in "${GPU_NODES[@]}"; do
      echo "NodeName=$n Name=gpu File=$FAKE_GPU_DIR/$n-[0-$((GPUS_PER_NODE - 1))]"
    done
  } >"$tmp"
  install -m 644 "$tmp" "$ETC/gres.conf"
  printf '# Written by slurm/local-cluster.sh (cgroup v2 fails here with "Hybrid mode is not supported").\nCgroupPlugin=cgroup/v1\nCgroupAutomount=no\n' >"$tmp"
  install -m 644 "$tmp" "$ETC/cgroup.conf"
  rm -f "$tmp"
}

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start_munge() {
  if pgrep -u munge -x munged >/dev/null 2>&1 && munge -n </dev/null >/dev/null 2>&1; then return 0; fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  chmod 755 /run/munge
  if [ ! -s /etc/munge/munge.key ]; then
    if command -v mungekey >/dev/null; then mungekey --create --keyfile=/etc/munge/munge.key; else
      dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; fi
    chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
  fi
  runuser -u munge -- /usr/sbin/munged --force
  local i
  for i in $(seq 1 20); do munge -n </dev/null >/dev/null 2>&1 && return 0; sleep 0.25; done
  die "munged did not start (see /var/log/munge/munged.log)"
}

cmd_start() {
  need_root start
  command -v slurmctld >/dev/null || die "slurmctld not installed: run 'bash slurm/local-cluster.sh install' first"
  local reconfigure=0 before after
  before="$( (cat "$ETC/slurm.conf" "$ETC/gres.conf" 2>/dev/null || true) | md5sum)"
  write_configs
  after="$(cat "$ETC/slurm.conf" "$ETC/gres.conf" | md5sum)"
  [ "$before" != "$after" ] && reconfigure=1
  start_munge
  if pid_alive "$RUN/slurmctld.pid" && [ "$reconfigure" = 1 ]; then log "config changed: restarting"; cmd_stop; start_munge; fi
  if ! pid_alive "$RUN/slurmctld.pid"; then
    slurmctld -i  # -i: ignore stale state files from an older layout
  fi
  local n
  for n in "${ALL_NODES[@]}"; do
    pid_alive "$RUN/slurmd-$n.pid" || slurmd -N "$n"
  done
  local i
  for i in $(seq 1 60); do
    if idle_ok; then log "cluster up: $(sinfo -h -o '%P:%D:%t' | tr '\n' ' ')"; return 0; fi
    # nodes left DOWN by an earlier unclean stop come back with an explicit resume
    sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 ~ /down|drain|fail/ {print $1}' | while read -r n; do
      scontrol update NodeName="$n" State=RESUME >/dev/null 2>&1 || true
    done
    sleep 1
  done
  sinfo -N -l >&2 || true
  die "nodes did not become idle within 60 s (logs in $LOGS)"
}

idle_ok() {  # every node idle (or allocated/mixed by a running job)
  local states
  states="$(sinfo -h -N -o '%t' 2>/dev/null)" || return 1
  [ -n "$states" ] || return 1
  [ "$(echo "$states" | wc -l)" -ge "${#ALL_NODES[@]}" ] || return 1
  ! echo "$states" | grep -qvE '^(idle|alloc|mix)$'
}

kill_pidfile() {
  local f="$1"
  pid_alive "$f" || { rm -f "$f"; return 0; }
  local pid; pid="$(cat "$f")"
  kill "$pid" 2>/dev/null || true
  local i
  for i in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || { rm -f "$f"; return 0; }; sleep 0.25; done
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$f"
}

cmd_stop() {
  need_root stop
  local n
  for n in "${ALL_NODES[@]}"; do kill_pidfile "$RUN/slurmd-$n.pid"; done
  kill_pidfile "$RUN/slurmctld.pid"
  log "slurm daemons stopped (munged left running)"
}

cmd_status() {
  if ! command -v sinfo >/dev/null; then echo "slurm not installed"; return 1; fi
  sinfo -N -o '%N %P %t %G' || return 1
  squeue || true
  idle_ok
}

case "${1:-}" in
  install) cmd_install ;;
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  *) echo "usage: $0 {install|start|stop|status}" >&2; exit 2 ;;
esac
