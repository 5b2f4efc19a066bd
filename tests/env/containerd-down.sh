#!/usr/bin/env bash
# Stops what containerd-up.sh STATE_DIR started and removes every trace of it from the host.
#
# Usage: containerd-down.sh STATE_DIR
#
# Order matters:
#   1. while containerd still answers: SIGKILL and delete every task in the CRI namespace (the
#      shims unmount the rootfs and exit), and note each container's network namespace path;
#   2. stop containerd by pid (TERM, then KILL after KURYR_STOP_TIMEOUT seconds, default 10);
#   3. kill what is left of *this* instance only: shims whose command line names this instance's
#      socket, their descendants, and processes in this instance's cgroup parent;
#   4. unmount everything under STATE_DIR, remove the pod network namespaces this containerd
#      created (/var/run/netns/cni-*, found in its metadata store, never by listing the host's)
#      and the namespace containerd ran in, and CNI cache files naming its sandboxes;
#   5. remove STATE_DIR, unless KURYR_KEEP_STATE=1 (then logs and config stay for debugging).
#
# Idempotent: running it again, or on a STATE_DIR whose start failed halfway, is fine. Other
# instances (another STATE_DIR) are never touched. Exits non-zero if something stayed behind.
set -uo pipefail

STATE_DIR=${1:?usage: containerd-down.sh STATE_DIR}
STOP_TIMEOUT=${KURYR_STOP_TIMEOUT:-10}
[[ -d "$STATE_DIR" ]] || exit 0
STATE_DIR=$(cd "$STATE_DIR" && pwd)

failures=0
warn() {
    echo "containerd-down: $*" >&2
}

# --- what up.sh recorded ---------------------------------------------------------------------
NETNS="" NETNS_CREATED=0 CONTAINERD_PID="" CGROUP_PARENT=""
if [[ -f "$STATE_DIR/env" ]]; then
    while IFS='=' read -r key value; do
        case "$key" in
        NETNS | NETNS_CREATED | CONTAINERD_PID | CGROUP_PARENT) printf -v "$key" '%s' "$value" ;;
        esac
    done <"$STATE_DIR/env"
fi
[[ -z "$CONTAINERD_PID" && -f "$STATE_DIR/pids/containerd" ]] && CONTAINERD_PID=$(cat "$STATE_DIR/pids/containerd")
ADDRESS="$STATE_DIR/containerd.sock"
CONFIG="$STATE_DIR/config.toml"
NS=k8s.io

now_ms() { date +%s%3N; }

# True if pid $1 is alive and its command line contains the string $2 (guards against pid reuse).
pid_matches() {
    local pid=$1 needle=$2
    [[ -r "/proc/$pid/cmdline" ]] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$needle"
}

# Waits until none of the given pids exists, up to $1 seconds; returns 1 on timeout.
wait_gone() {
    local secs=$1
    shift
    local deadline=$(($(now_ms) + secs * 1000)) pid alive
    while :; do
        alive=0
        for pid in "$@"; do
            [[ -d "/proc/$pid" ]] && ! grep -q '^State:.*Z' "/proc/$pid/status" 2>/dev/null && alive=1
        done
        ((alive)) || return 0
        (($(now_ms) > deadline)) && return 1
        sleep 0.02
    done
}

ids=()
netns_paths=()

# --- 1. tasks, while containerd answers ------------------------------------------------------
if [[ -n "$CONTAINERD_PID" ]] && pid_matches "$CONTAINERD_PID" "$CONFIG" &&
    ctr --address "$ADDRESS" --timeout 5s version >/dev/null 2>&1; then
    c() { ctr --address "$ADDRESS" --timeout 10s -n "$NS" "$@"; }
    for id in $(c containers ls -q 2>/dev/null); do
        ids+=("$id")
        while read -r p; do netns_paths+=("$p"); done < <(
            c containers info "$id" 2>/dev/null | grep -o '/var/run/netns/cni-[0-9a-f-]*' | sort -u
        )
    done
    for id in $(c tasks ls -q 2>/dev/null); do
        c tasks kill --all --signal SIGKILL "$id" >/dev/null 2>&1
    done
    # CRI deletes exited tasks itself, racing with us: only what is still listed is a failure.
    for id in $(c tasks ls -q 2>/dev/null); do
        c tasks delete --force "$id" >/dev/null 2>&1
    done
    for id in $(c tasks ls -q 2>/dev/null); do
        warn "task $id could not be deleted; its processes are killed below"
    done
fi

# Also from the on-disk state, for when containerd is already gone: sandbox and container
# directories name the ids, and the metadata store holds each sandbox spec (JSON) verbatim.
for d in "$STATE_DIR"/root/io.containerd.grpc.v1.cri/{sandboxes,containers}/* \
    "$STATE_DIR/state/io.containerd.runtime.v2.task/$NS"/*; do
    [[ -d "$d" ]] && ids+=("$(basename "$d")")
done
META="$STATE_DIR/root/io.containerd.metadata.v1.bolt/meta.db"
if [[ -f "$META" ]]; then
    while read -r p; do netns_paths+=("$p"); done < <(
        grep -a -o '/var/run/netns/cni-[0-9a-f]\{8\}-[0-9a-f]\{4\}-[0-9a-f]\{4\}-[0-9a-f]\{4\}-[0-9a-f]\{12\}' "$META" | sort -u
    )
fi

# --- 2. containerd ---------------------------------------------------------------------------
if [[ -n "$CONTAINERD_PID" ]] && pid_matches "$CONTAINERD_PID" "$CONFIG"; then
    kill -TERM "$CONTAINERD_PID" 2>/dev/null
    if ! wait_gone "$STOP_TIMEOUT" "$CONTAINERD_PID"; then
        warn "containerd $CONTAINERD_PID ignored TERM for ${STOP_TIMEOUT}s; killing"
        kill -KILL "$CONTAINERD_PID" 2>/dev/null
        wait_gone 5 "$CONTAINERD_PID" || { warn "containerd $CONTAINERD_PID survived KILL"; failures=1; }
    fi
fi

# --- 3. leftover processes of this instance --------------------------------------------------
# Shims carry `-address <this socket>` on their command line; a shim is the parent (subreaper) of
# its containers' processes, so its descendants are ours too.
shims=()
for p in /proc/[0-9]*; do
    pid=${p#/proc/}
    [[ "$(readlink "$p/exe" 2>/dev/null)" == */containerd-shim-runc-v2* ]] || continue
    pid_matches "$pid" "-address $ADDRESS " && shims+=("$pid")
done
descendants() {
    # Prints every descendant of the given pids (breadth first) using the ppid field of stat.
    local frontier=("$@") next pid ppid stat p child
    declare -A children=()
    for p in /proc/[0-9]*/stat; do
        stat=$(<"$p") 2>/dev/null || continue
        pid=${stat%% *}
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses; cut at the last ") ".
        read -r _ ppid _ <<<"${stat##*) }"
        children[$ppid]+="$pid "
    done
    while ((${#frontier[@]})); do
        next=()
        for pid in "${frontier[@]}"; do
            for child in ${children[$pid]:-}; do
                echo "$child"
                next+=("$child")
            done
        done
        frontier=("${next[@]}")
    done
}
cgroup_pids() {
    [[ -n "$CGROUP_PARENT" ]] || return 0
    local d
    for d in /sys/fs/cgroup/*"$CGROUP_PARENT" /sys/fs/cgroup"$CGROUP_PARENT"; do
        [[ -d "$d" ]] && find "$d" -name cgroup.procs -exec cat {} + 2>/dev/null
    done
}
# Containers first, then their shims (a shim outliving its container only waits for it).
mapfile -t victims < <({
    ((${#shims[@]})) && descendants "${shims[@]}"
    cgroup_pids
} | sort -un)
victims+=("${shims[@]}")
if ((${#victims[@]})); then
    warn "killing leftover processes of this instance: ${victims[*]}"
    kill -KILL "${victims[@]}" 2>/dev/null
    wait_gone 5 "${victims[@]}" || { warn "processes survived KILL: ${victims[*]}"; failures=1; }
fi
if [[ -n "$CGROUP_PARENT" ]]; then
    for d in /sys/fs/cgroup/*"$CGROUP_PARENT" /sys/fs/cgroup"$CGROUP_PARENT"; do
        [[ -d "$d" ]] && find "$d" -depth -type d -exec rmdir {} + 2>/dev/null
        [[ -d "$d" ]] && { warn "cgroup $d could not be removed"; failures=1; }
    done
fi

# --- 4. mounts, network namespaces, CNI caches -----------------------------------------------
# Mount points are field 5 of mountinfo; unmount the deepest first.
mounts_under() {
    awk -v pre="$1/" 'index($5, pre) == 1 { print $5 }' /proc/self/mountinfo | sort -r
}
for m in $(mounts_under "$STATE_DIR"); do
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || { warn "cannot unmount $m"; failures=1; }
done

for p in $(printf '%s\n' "${netns_paths[@]}" | sort -u); do
    [[ -e "$p" ]] || continue
    ip netns delete "$(basename "$p")" 2>/dev/null || { umount "$p" 2>/dev/null; rm -f "$p"; }
    [[ -e "$p" ]] && { warn "network namespace $p stayed"; failures=1; }
done
if [[ -n "$NETNS" && "$NETNS_CREATED" == 1 && -e "/var/run/netns/$NETNS" ]]; then
    ip netns delete "$NETNS" || { warn "cannot delete netns $NETNS"; failures=1; }
fi

# Shared host paths that containerd 1.6 cannot be told to avoid, each naming a container id:
# the shims' sockets (/run/containerd/s/sha256(<address>/<namespace>/<id>); normally removed when
# a shim exits cleanly), libcni's result cache, and host-local's default lease store. Only entries
# of this instance's containers are removed.
for id in $(printf '%s\n' "${ids[@]}" | sort -u); do
    [[ "$id" =~ ^[0-9a-f]{64}$ ]] || continue
    sock=$(printf '%s' "$ADDRESS/$NS/$id" | sha256sum | awk '{print $1}')
    rm -f "/run/containerd/s/$sock"
    rm -f /var/lib/cni/results/*-"$id"-* 2>/dev/null
    for f in /var/lib/cni/networks/*/*; do
        [[ -f "$f" ]] && [[ "$(head -n1 "$f" 2>/dev/null)" == "$id" ]] && rm -f "$f"
    done
done

# --- 5. state --------------------------------------------------------------------------------
if [[ -n "$(mounts_under "$STATE_DIR")" ]]; then
    warn "mounts remain under $STATE_DIR; leaving it in place"
    exit 1
fi
if [[ "${KURYR_KEEP_STATE:-0}" == 1 ]]; then
    warn "KURYR_KEEP_STATE=1: keeping $STATE_DIR"
else
    rm -rf --one-file-system "$STATE_DIR" || { warn "cannot remove $STATE_DIR"; failures=1; }
fi
exit "$failures"
