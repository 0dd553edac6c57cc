#!/usr/bin/env bash
# A real Slurm on one host for tests and trials: munged, slurmctld and one `slurmd -N node-N` per node.
#
#   scripts/slurm-cluster.sh start DIR [NODES]    write DIR/slurm.conf and a munge key, start everything
#   scripts/slurm-cluster.sh stop DIR             stop every daemon started from DIR
#   scripts/slurm-cluster.sh stop-controller DIR  stop slurmctld only (the controller goes unreachable)
#   scripts/slurm-cluster.sh start-controller DIR start slurmctld again, with its saved state
#
# Everything (config, key, sockets, spool, state, logs) lives in DIR, which is made private (0700).
# Clients reach this cluster with SLURM_CONF=DIR/slurm.conf. Nodes are node-1..node-N (default 4), all
# on 127.0.0.1 with a port each. Needs Debian's slurmctld, slurmd, slurm-client and munge packages.
set -euo pipefail

usage() {
    echo "usage: $0 start DIR [NODES] | stop DIR | stop-controller DIR | start-controller DIR" >&2
    exit 2
}

[ $# -ge 2 ] || usage
cmd=$1
dir=$2
nodes=${3:-4}

need() {
    local missing=()
    for bin in munged slurmctld slurmd scontrol; do
        command -v "$bin" >/dev/null 2>&1 || [ -x "/usr/sbin/$bin" ] || missing+=("$bin")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "$0: missing ${missing[*]}; install: apt-get install -y slurmctld slurmd slurm-client munge" >&2
        exit 1
    fi
}

bin() { command -v "$1" 2>/dev/null || echo "/usr/sbin/$1"; }

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop_pidfiles() {
    # Stop the daemons whose pids are in the files given, all at once, and wait until they are gone, so a
    # restart finds their ports free. One that outlives 10 s is killed.
    local pidfile pids=() pid i
    for pidfile in "$@"; do
        if pid_alive "$pidfile"; then
            pid=$(cat "$pidfile")
            kill "$pid" 2>/dev/null || true
            pids+=("$pid")
        fi
    done
    for i in $(seq 1 100); do
        local alive=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ "$alive" -eq 0 ] && break
        sleep 0.1
    done
    for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
    rm -f "$@"
}

wait_for() {
    # wait_for SECONDS WHAT COMMAND...: run COMMAND until it succeeds, or fail naming WHAT.
    local seconds=$1 what=$2 i
    shift 2
    for i in $(seq 1 $((seconds * 10))); do
        "$@" >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    echo "$0: $what did not come up within ${seconds}s; see $dir/log/" >&2
    return 1
}

write_config() {
    local host ctld_port i
    host=$(hostname -s)
    ctld_port=$(free_port)
    mkdir -p "$dir"/{etc,run,log,state,spool}
    chmod 0700 "$dir"
    if [ ! -f "$dir/etc/munge.key" ]; then
        # munged wants a key of at least 32 bytes that only its user can read.
        (umask 077 && head -c 1024 /dev/urandom >"$dir/etc/munge.key")
    fi
    {
        echo "# Written by scripts/slurm-cluster.sh: a test cluster on $host, everything under $dir."
        echo "ClusterName=gw"
        echo "SlurmctldHost=$host(127.0.0.1)"
        echo "SlurmctldPort=$ctld_port"
        echo "SlurmUser=$(id -un)"
        echo "SlurmdUser=$(id -un)"
        echo "AuthType=auth/munge"
        echo "AuthInfo=socket=$dir/run/munge.socket"
        echo "CredType=cred/munge"
        echo "StateSaveLocation=$dir/state"
        echo "SlurmdSpoolDir=$dir/spool/%n"
        echo "SlurmctldPidFile=$dir/run/slurmctld.pid"
        echo "SlurmdPidFile=$dir/run/slurmd-%n.pid"
        echo "SlurmctldLogFile=$dir/log/slurmctld.log"
        echo "SlurmdLogFile=$dir/log/slurmd-%n.log"
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "JobAcctGatherType=jobacct_gather/none"
        echo "SwitchType=switch/none"
        echo "MpiDefault=none"
        echo "SchedulerType=sched/backfill"
        echo "SelectType=select/linear"
        echo "ReturnToService=2"
        echo "SlurmctldTimeout=30"
        echo "SlurmdTimeout=30"
        echo "MessageTimeout=5"
        echo "SlurmctldDebug=info"
        echo "SlurmdDebug=info"
        for i in $(seq 1 "$nodes"); do
            echo "NodeName=node-$i NodeAddr=127.0.0.1 NodeHostname=$host Port=$(free_port) CPUs=1 RealMemory=100 State=UNKNOWN"
        done
        echo "PartitionName=gw Nodes=node-[1-$nodes] Default=YES MaxTime=INFINITE State=UP"
    } >"$dir/etc/slurm.conf"
    for i in $(seq 1 "$nodes"); do mkdir -p "$dir/spool/node-$i"; done
}

start_munge() {
    pid_alive "$dir/run/munged.pid" && return 0
    "$(bin munged)" --force --key-file="$dir/etc/munge.key" --socket="$dir/run/munge.socket" \
        --pid-file="$dir/run/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/run/munged.seed"
    wait_for 10 munged test -S "$dir/run/munge.socket"
}

start_controller() {
    pid_alive "$dir/run/slurmctld.pid" && return 0
    # -i: a restart keeps the saved state (drains, reasons) and ignores what it cannot recover.
    SLURM_CONF="$dir/etc/slurm.conf" "$(bin slurmctld)" -i -f "$dir/etc/slurm.conf"
    wait_for 30 slurmctld env SLURM_CONF="$dir/etc/slurm.conf" scontrol ping
}

start_nodes() {
    local i
    for i in $(seq 1 "$nodes"); do
        pid_alive "$dir/run/slurmd-node-$i.pid" && continue
        SLURM_CONF="$dir/etc/slurm.conf" "$(bin slurmd)" -f "$dir/etc/slurm.conf" -N "node-$i"
    done
    wait_for 60 "the slurmd nodes" nodes_up
}

nodes_up() {
    # Every node registered: none is still down or unknown to the controller.
    local out
    out=$(SLURM_CONF="$dir/etc/slurm.conf" sinfo -h -N -o '%N %T') || return 1
    [ "$(echo "$out" | grep -c .)" -ge "$nodes" ] || return 1
    ! echo "$out" | grep -Eqi 'down|unknown|not_responding|\*'
}

node_count() { grep -c '^NodeName=' "$dir/etc/slurm.conf"; }

case $cmd in
    start)
        need
        mkdir -p "$dir"
        dir=$(cd "$dir" && pwd)
        [ -f "$dir/etc/slurm.conf" ] || write_config
        nodes=$(node_count)
        start_munge
        start_controller
        start_nodes
        echo "SLURM_CONF=$dir/etc/slurm.conf"
        ;;
    stop)
        [ -d "$dir" ] || exit 0
        dir=$(cd "$dir" && pwd)
        stop_pidfiles "$dir"/run/slurmd-*.pid "$dir/run/slurmctld.pid" "$dir/run/munged.pid"
        ;;
    stop-controller)
        dir=$(cd "$dir" && pwd)
        stop_pidfiles "$dir/run/slurmctld.pid"
        ;;
    start-controller)
        need
        dir=$(cd "$dir" && pwd)
        start_controller
        ;;
    *)
        usage
        ;;
esac
