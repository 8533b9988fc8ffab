#!/usr/bin/env bash
# A small Slurm cluster on this one machine, each node with the machine's CPUs and memory and 4 fake
# GPUs, for tests: start | stop | status.
# Debian's slurmd is built with multiple-slurmd support, so several nodes (one slurmd each, on
# its own port) run on one host; that makes multi-node jobs (srun across nodes) testable here.
#
#   tests/slurm/cluster.sh start    install (if missing), configure and start munged, slurmctld, one
#                                   slurmd per node; wait until every node is idle in `sinfo`
#   tests/slurm/cluster.sh stop     stop only the daemons this script started (by their pid files)
#   tests/slurm/cluster.sh status   print the daemons' state and `sinfo`
#
# Needs root (it writes /etc/slurm/slurm.conf: Snakemake's job-step executor drops SLURM_CONF,
# so every Slurm command must find the config at its default path). Environment:
#   DETSCALE_SLURM_STATE    state folder (spool, logs, pid files, fake devices) [/tmp/detscale-slurm]
#   DETSCALE_SLURM_NODES    number of nodes, named dsnode1..N [2]
#   DETSCALE_SLURM_TIMEOUT  seconds to wait for the nodes to become idle [90]
#   DETSCALE_SLURM_FORCE=1  overwrite an /etc/slurm/slurm.conf this script did not write
#   DETSCALE_SLURM_NO_INSTALL=1  never run apt-get (fail if the packages are missing)
#
# Facts this relies on (Debian 12, Slurm 22.05): node names are not the host name, so each slurmd
# starts with `-N <node>`; GPU GRES needs File= device paths, and symlinks
# to /dev/null pass for nvidia0..3; without DefMemPerCPU every job takes the node's whole memory;
# there is no accounting database, so `sacct` cannot answer and clients must use `squeue`
# (MinJobAge keeps finished jobs visible to it for a while).
set -euo pipefail

STATE=${DETSCALE_SLURM_STATE:-/tmp/detscale-slurm}
NODES=${DETSCALE_SLURM_NODES:-2}
NODE_NAMES=()
for ((i = 1; i <= NODES; i++)); do NODE_NAMES+=("dsnode$i"); done
TIMEOUT=${DETSCALE_SLURM_TIMEOUT:-90}
CONF=/etc/slurm/slurm.conf
GRES_CONF=/etc/slurm/gres.conf
MARKER="# written by detscale tests/slurm/cluster.sh"
PACKAGES=(slurmctld slurmd slurm-client munge)

die() { echo "cluster.sh: $*" >&2; exit 1; }
say() { echo "cluster.sh: $*" >&2; }

pid_alive() {  # pid file -> 0 when the process it names runs
    [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

install_packages() {
    local missing=()
    command -v slurmctld >/dev/null || missing+=(slurmctld)
    command -v slurmd >/dev/null || missing+=(slurmd)
    command -v sinfo >/dev/null || missing+=(slurm-client)
    command -v munged >/dev/null || missing+=(munge)
    ((${#missing[@]} == 0)) && return 0
    [[ ${DETSCALE_SLURM_NO_INSTALL:-0} == 1 ]] && die "missing ${missing[*]} and DETSCALE_SLURM_NO_INSTALL=1"
    command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get to install them (install: ${PACKAGES[*]})"
    say "installing ${PACKAGES[*]} with apt-get (once; takes a minute)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >"$STATE/apt.log" 2>&1 || { tail -n 20 "$STATE/apt.log" >&2; die "apt-get update failed"; }
    apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >>"$STATE/apt.log" 2>&1 \
        || { tail -n 20 "$STATE/apt.log" >&2; die "apt-get install ${PACKAGES[*]} failed"; }
}

write_config() {
    local cpus mem_mb host hw nproc_cpus
    host=$(hostname -s)
    # Every node declares the machine's real CPUs and memory, as slurmd detects them (`slurmd -C`),
    # so that a job asking more than such a node has pends with Reason=PartitionConfig here as it
    # would on a site (and the workflow's check refuses it first). The CPUs are capped at what
    # this process may use (`nproc`: a container's share of a larger host). GNU nproc also obeys
    # OMP_NUM_THREADS and OMP_THREAD_LIMIT, which a test run sets to 1: they are not the machine's.
    hw=$(slurmd -C 2>/dev/null | head -n 1 || true)
    cpus=$(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<<"$hw")
    nproc_cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
    [[ -n $cpus ]] && ((cpus <= nproc_cpus)) || cpus=$nproc_cpus
    mem_mb=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$hw")
    [[ -n $mem_mb ]] || mem_mb=$(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo)
    if [[ -e $CONF ]] && ! grep -qF "$MARKER" "$CONF" && [[ ${DETSCALE_SLURM_FORCE:-0} != 1 ]]; then
        die "$CONF exists and was not written by this script; set DETSCALE_SLURM_FORCE=1 to overwrite it"
    fi
    mkdir -p /etc/slurm "$STATE/ctld" "$STATE/dev"
    for i in 0 1 2 3; do ln -sfn /dev/null "$STATE/dev/nvidia$i"; done
    cat >"$CONF" <<EOF
$MARKER
ClusterName=detscale
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool-%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
DefMemPerCPU=1024
GresTypes=gpu
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MinJobAge=600
ReturnToService=2
KillWait=10
SchedulerType=sched/backfill
EOF
    local i
    for ((i = 1; i <= NODES; i++)); do
        echo "NodeName=dsnode$i NodeHostname=$host NodeAddr=127.0.0.1 Port=$((6817 + i)) CPUs=$cpus" \
            "RealMemory=$mem_mb Gres=gpu:4 State=UNKNOWN" >>"$CONF"
    done
    echo "PartitionName=debug Nodes=dsnode[1-$NODES] Default=YES MaxTime=INFINITE State=UP" >>"$CONF"
    # A partition an administrator has set DOWN: jobs are accepted and pend (Reason=PartitionDown).
    echo "PartitionName=maint Nodes=dsnode[1-$NODES] MaxTime=INFINITE State=DOWN" >>"$CONF"
    printf '%s\nNodeName=dsnode[1-%d] Name=gpu File=%s/dev/nvidia[0-3]\n' "$MARKER" "$NODES" "$STATE" >"$GRES_CONF"
}

start_munge() {
    # Reuse a munged that already answers (a host's own); otherwise start one we own.
    if command -v munge >/dev/null && munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
        return 0
    fi
    [[ -s /etc/munge/munge.key ]] || { mungekey --create --force >/dev/null 2>&1 || die "cannot create /etc/munge/munge.key"; }
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge/munge.key 2>/dev/null || true
    chmod 0755 /run/munge
    # munged refuses to run as root; the Debian package's user runs it.
    runuser -u munge -- munged --pid-file=/run/munge/munged.pid >"$STATE/munged.out" 2>&1 \
        || { cat "$STATE/munged.out" >&2; die "munged did not start"; }
    cp /run/munge/munged.pid "$STATE/munged.pid"
    for _ in $(seq 50); do
        munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    die "munged started but does not answer (see /var/log/munge/munged.log)"
}

start_daemon() {  # name, pid file, command...
    local name=$1 pidfile=$2; shift 2
    if pid_alive "$pidfile"; then
        say "$name already running (pid $(cat "$pidfile"))"
        return 0
    fi
    "$@" >"$STATE/$name.out" 2>&1 || { cat "$STATE/$name.out" >&2; tail -n 20 "$STATE/$name.log" >&2 2>/dev/null; die "$name did not start"; }
    for _ in $(seq 50); do pid_alive "$pidfile" && return 0; sleep 0.1; done
    tail -n 20 "$STATE/$name.log" >&2 2>/dev/null || true
    die "$name did not write its pid file $pidfile"
}

wait_idle() {
    local deadline=$((SECONDS + TIMEOUT)) states="" idle node
    while ((SECONDS < deadline)); do
        states=$(sinfo -h -N -o '%N=%t' 2>/dev/null | sort -u | tr '\n' ' ' || true)
        idle=0
        for node in "${NODE_NAMES[@]}"; do
            case " $states" in
                *" $node=idle"* | *" $node=mix"* | *" $node=alloc"*) idle=$((idle + 1)) ;;
                *" $node=drain"* | *" $node=down"* | *" $node=inval"* | *" $node=fail"*)
                    # A node left down by an earlier run's state comes back with an explicit resume.
                    scontrol update NodeName="$node" State=RESUME >/dev/null 2>&1 || true ;;
            esac
        done
        if ((idle == NODES)); then say "nodes up: $states"; return 0; fi
        sleep 1
    done
    {
        echo "nodes did not become idle within ${TIMEOUT}s (last states: '${states:-none}')"
        sinfo -N -l 2>&1 || true
        echo "--- slurmctld.log"; tail -n 20 "$STATE/slurmctld.log" 2>/dev/null || true
        for node in "${NODE_NAMES[@]}"; do
            echo "--- slurmd-$node.log"; tail -n 10 "$STATE/slurmd-$node.log" 2>/dev/null || true
        done
    } >&2
    die "cluster did not come up"
}

cmd_start() {
    [[ $(id -u) == 0 ]] || die "needs root (it installs packages and writes $CONF)"
    mkdir -p "$STATE"
    install_packages
    write_config
    start_munge
    # -c: start from a clean state (no jobs left over from an earlier run).
    start_daemon slurmctld "$STATE/slurmctld.pid" slurmctld -c
    local node
    for node in "${NODE_NAMES[@]}"; do
        start_daemon "slurmd-$node" "$STATE/slurmd-$node.pid" slurmd -N "$node"
    done
    wait_idle
}

stop_one() {  # name, pid file
    local pidfile=$2 pid
    pid_alive "$pidfile" || { rm -f "$pidfile"; return 0; }
    pid=$(cat "$pidfile")
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && { say "$1 (pid $pid) ignores SIGTERM; killing it"; kill -KILL "$pid" 2>/dev/null || true; }
    rm -f "$pidfile"
}

cmd_stop() {
    # Only what this script started: pid files under $STATE (a host's own munged has none there).
    local pidfile
    for pidfile in "$STATE"/slurmd-*.pid; do
        [[ -e $pidfile ]] && stop_one "$(basename "$pidfile" .pid)" "$pidfile"
    done
    stop_one slurmctld "$STATE/slurmctld.pid"
    stop_one munged "$STATE/munged.pid"
}

cmd_status() {
    local name
    for name in munged slurmctld "${NODE_NAMES[@]/#/slurmd-}"; do
        if pid_alive "$STATE/$name.pid"; then echo "$name: running (pid $(cat "$STATE/$name.pid"))"
        else echo "$name: not started by this script"; fi
    done
    sinfo -N -o '%N %t %c %m %G' 2>&1 || true
}

case ${1:-} in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
