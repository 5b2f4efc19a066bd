#!/usr/bin/env bash
# Stops the cluster up.sh started in STATE_DIR and removes every trace of it from the host:
#
#   down.sh STATE_DIR [--purge]     --purge also removes STATE_DIR (logs, configuration)
#
# Order: the kubelets (so nothing restarts containers), every process in the nodes' cgroups (the
# pods' containers), the containerd shims of these nodes and containerd itself, the control
# plane; then the pins of the nodes' mount namespaces (taking every mount made inside them with
# them: pod network namespaces, root filesystems, volumes), the cgroups, and the network
# namespaces (with every veth, bridge, route and nftables rule in them).
#
# Processes are found by the pids up.sh recorded, checked against their command line (which names
# STATE_DIR), and by cgroup — never by name. Idempotent; safe on a start that failed halfway.
# Exits non-zero if something stayed behind.
set -uo pipefail

[[ $# -ge 1 && $# -le 2 ]] || { echo "usage: down.sh STATE_DIR [--purge]" >&2; exit 2; }
[[ -d "$1" ]] || exit 0
S="$(cd "$1" && pwd)"
PURGE=0
[[ "${2:-}" == --purge ]] && PURGE=1
GRACE="${CLUSTER_STOP_GRACE:-10}"
failures=0

log() { printf 'cluster/down.sh: %s\n' "$*" >&2; }
# shellcheck source=../lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
ours() { tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | grep -qF -- "$S"; }

# What up.sh recorded (partial.env is written as it goes; env once it finished).
declare -A E=()
for f in "$S/partial.env" "$S/env"; do
    [[ -f "$f" ]] || continue
    while IFS='=' read -r k v; do [[ -n "$k" ]] && E[$k]="$v"; done <"$f"
done
NODE_COUNT="${E[NODE_COUNT]:-0}"

stop() { # NAME: TERM the recorded pid, KILL after the grace period
    local f="$S/pids/$1.pid" pid
    [[ -f "$f" ]] || return 0
    pid="$(cat "$f")"
    if [[ "$pid" =~ ^[0-9]+$ && "$pid" != "$$" ]] && alive "$pid" && ours "$pid"; then
        kill -TERM "$pid" 2>/dev/null
        local deadline=$((SECONDS + GRACE))
        while alive "$pid" && ((SECONDS < deadline)); do sleep 0.1; done
        if alive "$pid"; then
            log "$1 (pid $pid) ignored TERM for ${GRACE}s; killing it"
            kill -KILL "$pid" 2>/dev/null
            sleep 0.1
        fi
    fi
    rm -f "$f"
}

# Every process in a node's cgroups, until none is left.
kill_cgroup() { # CGROUP_NAME
    local cg="$1" pids round
    for round in $(seq 50); do
        pids="$(find /sys/fs/cgroup/*/"$cg" -name cgroup.procs -exec cat {} + 2>/dev/null | sort -u)"
        [[ -z "$pids" ]] && return 0
        # shellcheck disable=SC2086
        kill -KILL $pids 2>/dev/null
        sleep 0.1
    done
    log "processes left in cgroup $cg: $pids"
    failures=$((failures + 1))
}

# The pod network namespaces are mounted inside the nodes' mount namespaces only, but their mount
# points are files in the host's /var/run/netns too: note them while the namespaces exist.
pod_netns=()
if [[ -d "$S/ns" ]]; then
    for m in "$S"/ns/*.mnt; do
        [[ -e "$m" ]] || continue
        while read -r t; do pod_netns+=("$t"); done < <(
            nsenter --mount="$m" findmnt -rn -o TARGET 2>/dev/null | grep -E '^/(var/)?run/netns/cni-[0-9a-f-]+$'
        )
    done
fi

# The watchdog execs this script: never signal ourselves (stop() checks).
stop watchdog
for i in $(seq "$NODE_COUNT"); do stop "kubelet-$i"; done
for i in $(seq "$NODE_COUNT"); do
    cg="${E[NODE${i}_CGROUP]:-}"
    [[ -n "$cg" ]] && kill_cgroup "$cg"
done
for i in $(seq "$NODE_COUNT"); do
    sock="$S/nodes/$(basename "${E[NODE${i}_MOUNTNS]:-x}" .mnt)/containerd.sock"
    stop "containerd-$i"
    # The shims of this node's containerd name its socket on their command line.
    for pid in $(pgrep -f -- "-address $sock" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
done
# Shims and containers of nodes whose mount-namespace line was not recorded yet.
for pid in $(pgrep -f -- "-address $S/nodes/" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
for n in kube-scheduler kube-controller-manager kube-apiserver etcd; do stop "$n"; done

# Mount namespace pins, then the private mount holding them.
if [[ -d "$S/ns" ]]; then
    for m in "$S"/ns/*.mnt; do
        [[ -e "$m" ]] || continue
        if findmnt -rn "$m" >/dev/null 2>&1; then
            umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || { log "cannot unmount $m"; failures=$((failures + 1)); }
        fi
    done
    while findmnt -rn "$S/ns" >/dev/null 2>&1; do
        umount "$S/ns" 2>/dev/null || umount -l "$S/ns" 2>/dev/null || { log "cannot unmount $S/ns"; failures=$((failures + 1)); break; }
    done
fi
# Anything else mounted under the state dir on the host (nothing, normally).
findmnt -rn -o TARGET | grep -F "$S/" | sort -r | while read -r m; do umount -l "$m" && log "unmounted $m"; done

for p in "${pod_netns[@]}"; do
    # Gone with the node's mount namespace; unless the host mounted something there, the file is
    # all that is left.
    findmnt -rn "$p" >/dev/null 2>&1 || rm -f "$p"
done

for i in $(seq "$NODE_COUNT"); do
    cg="${E[NODE${i}_CGROUP]:-}"
    [[ -n "$cg" ]] || continue
    # Every hierarchy, not only the controllers up.sh made it in: runc also makes the pods'
    # cgroups in the others it finds (the hybrid layout's `unified` one).
    for d in /sys/fs/cgroup/*/"$cg"; do
        [[ -d "$d" ]] || continue
        find "$d" -depth -type d -exec rmdir {} \; 2>/dev/null
        [[ -d "$d" ]] && { log "cgroup $d remains"; failures=$((failures + 1)); }
    done
done

for i in $(seq "$NODE_COUNT"); do
    ns="${E[NODE${i}_NETNS]:-}"
    [[ -n "$ns" && -e "/var/run/netns/$ns" ]] && { ip netns del "$ns" || failures=$((failures + 1)); }
done
ns="${E[UNDERLAY_NETNS]:-}"
[[ -n "$ns" && -e "/var/run/netns/$ns" ]] && { ip netns del "$ns" || failures=$((failures + 1)); }

rm -f "$S/env"
if ((PURGE)); then
    rm -rf "$S" || failures=$((failures + 1))
fi
((failures == 0)) || { log "$failures thing(s) stayed behind"; exit 1; }
exit 0
