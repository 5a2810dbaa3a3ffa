#!/usr/bin/env bash
# A real two-node Slurm cluster on this machine, for tests/integration/test_slurm.py:
#
#   slurm_cluster.sh start DIR TAG    slurmctld on a bridge, one slurmd per network namespace
#   slurm_cluster.sh stop DIR TAG     (nodes n1 and n2 at 10.TAG.0.1 and .2: their tasks run
#                                     in those namespaces, with the node's name as hostname)
#
# Everything lives in DIR (slurm.conf, state, spool, logs, pid files); clients use
# SLURM_CONF=DIR/slurm.conf. Debian's slurmctld, slurmd and slurm-client (scripts/install.sh),
# with auth/none (no munge) and no cgroups. TAG (2-254) names the namespaces, the bridge and the
# subnet, so that runs side by side do not meet. Needs root and iproute2.
set -euo pipefail

cmd=${1:?usage: slurm_cluster.sh start|stop DIR TAG}
D=${2:?usage: slurm_cluster.sh start|stop DIR TAG}
TAG=${3:?usage: slurm_cluster.sh start|stop DIR TAG}
BR=kfsbr$TAG
NET=10.$TAG.0
PORT=$((17000 + TAG * 4))  # slurmctld's; slurmd's is the next
die() { echo "slurm_cluster.sh: $*" >&2; exit 1; }

stop() {
    export SLURM_CONF=$D/slurm.conf
    if [ -f "$D/slurm.conf" ]; then
        scancel --full --quiet -u root >/dev/null 2>&1 || true
        for _ in $(seq 30); do  # the jobs' processes end before their slurmd
            [ -z "$(squeue -h 2>/dev/null)" ] && break
            sleep 0.5
        done
    fi
    local pids=""
    for f in "$D"/run/*.pid; do [ -f "$f" ] && pids="$pids $(cat "$f")"; done
    # Also a daemon not yet writing its pid file, and job steps: found by this DIR's config.
    for p in $(grep -lsa "SLURM_CONF=$D/slurm.conf" /proc/[0-9]*/environ | cut -d/ -f3); do
        pids="$pids $p"
    done
    for p in $(pgrep -f "slurm(ctld|d|stepd).*" || true); do
        tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null | grep -q "$D" && pids="$pids $p"
    done
    [ -n "${pids// }" ] && kill $pids 2>/dev/null || true
    for _ in $(seq 40); do
        alive=""
        for p in $pids; do kill -0 "$p" 2>/dev/null && alive="$alive $p"; done
        [ -z "$alive" ] && break
        sleep 0.25
    done
    [ -n "${alive:-}" ] && kill -9 $alive 2>/dev/null || true
    for i in 1 2; do ip netns del "kfs$TAG-n$i" 2>/dev/null || true; done
    ip link del "$BR" 2>/dev/null || true
    rm -f "$D"/run/*.pid
}

start() {
    [ "$(id -u)" = 0 ] || die "needs root (network namespaces)"
    for c in slurmctld slurmd srun sbatch scontrol sinfo ip unshare nsenter; do
        command -v $c >/dev/null || die "$c not found (scripts/install.sh installs Slurm)"
    done
    stop
    rm -rf "$D/state" "$D/spool" "$D/log" "$D/run"
    mkdir -p "$D/state" "$D/spool" "$D/log" "$D/run"
    cat > "$D/slurm.conf" <<EOF
ClusterName=kungfutest
SlurmctldHost=$(hostname -s)($NET.254)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/run/slurmctld.pid
SlurmdPidFile=$D/run/slurmd-%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MailProg=/bin/true
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
KillWait=2
MinJobAge=4
InactiveLimit=0
NodeName=n1 NodeHostname=n1 NodeAddr=$NET.1 CPUs=2 State=UNKNOWN
NodeName=n2 NodeHostname=n2 NodeAddr=$NET.2 CPUs=2 State=UNKNOWN
PartitionName=test Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
EOF
    export SLURM_CONF=$D/slurm.conf
    ip link add "$BR" type bridge
    ip addr add "$NET.254/24" dev "$BR"
    ip link set "$BR" up
    for i in 1 2; do
        ns=kfs$TAG-n$i
        ip netns add "$ns"
        ip link add "kfs${TAG}v$i" type veth peer name eth0 netns "$ns"
        ip link set "kfs${TAG}v$i" master "$BR" up
        ip -n "$ns" addr add "$NET.$i/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
    done
    slurmctld -c || die "slurmctld did not start: $(tail -5 "$D/log/slurmctld.log" 2>/dev/null)"
    for _ in $(seq 100); do [[ $(scontrol ping 2>/dev/null) == *UP* ]] && break; sleep 0.2; done
    for i in 1 2; do
        nsenter --net="/run/netns/kfs$TAG-n$i" unshare --uts \
            sh -c "hostname n$i && exec slurmd -N n$i" \
            || die "slurmd n$i did not start: $(tail -5 "$D/log/slurmd-n$i.log" 2>/dev/null)"
    done
    for _ in $(seq 120); do
        state=$(sinfo -h -N -o '%N=%t' 2>/dev/null | sort -u | tr '\n' ' ' || true)
        case "$state" in *"n1=idle"*"n2=idle"*) return 0 ;; esac
        sleep 0.5
    done
    die "the nodes are not idle after 60 s (sinfo: $state); logs in $D/log"
}

case $cmd in
    start) start ;;
    stop) stop ;;
    *) die "unknown command $cmd (start or stop)" ;;
esac
