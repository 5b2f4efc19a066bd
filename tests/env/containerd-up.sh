#!/usr/bin/env bash
# Starts a private containerd (with its CRI plugin and runc) inside its own network namespace, the
# way kubelet's node runtime runs, for one test.
#
# Usage: containerd-up.sh STATE_DIR NETNS CNI_BIN_DIR CNI_CONF_DIR
#
#   STATE_DIR     private directory for everything: config, root, state, sockets, logs, pid
#   NETNS         name of the network namespace containerd runs in (created if missing, lo up);
#                 CNI plugins called by CRI run in it too, so a bridge they create lives there
#   CNI_BIN_DIR   plugin directory handed to CRI (`loopback` is linked in from /usr/lib/cni if
#                 absent: CRI calls it for every sandbox's lo)
#   CNI_CONF_DIR  conflist directory handed to CRI (picked up without restart)
#
# Environment: KURYR_IMAGES_DIR (image cache, default <repo>/target/kuryr-images),
#              KURYR_CONTAINERD_TIMEOUT (seconds to wait for the socket, default 30).
#
# Writes STATE_DIR/env (KEY=VALUE) describing the instance; containerd-down.sh STATE_DIR undoes
# everything. Several instances run side by side as long as STATE_DIR and NETNS differ: nothing
# here uses a fixed path, port or name outside them.
set -euo pipefail

STATE_DIR=${1:?usage: containerd-up.sh STATE_DIR NETNS CNI_BIN_DIR CNI_CONF_DIR}
NETNS=${2:?missing NETNS}
CNI_BIN_DIR=${3:?missing CNI_BIN_DIR}
CNI_CONF_DIR=${4:?missing CNI_CONF_DIR}

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
IMAGES_DIR=${KURYR_IMAGES_DIR:-$REPO/target/kuryr-images}
TIMEOUT=${KURYR_CONTAINERD_TIMEOUT:-30}
REF_CNI=${KURYR_REFERENCE_CNI_DIR:-/usr/lib/cni}

# Milliseconds since the epoch, for the timings written to the env file.
now_ms() { date +%s%3N; }
t0=$(now_ms)

if ((${#NETNS} > 15)); then
    # Not a kernel limit for netns names, but NETNS ends up in interface names in callers.
    echo "containerd-up: NETNS '$NETNS' is longer than 15 characters" >&2
    exit 2
fi

mkdir -p "$STATE_DIR" "$CNI_BIN_DIR" "$CNI_CONF_DIR"
STATE_DIR=$(cd "$STATE_DIR" && pwd)
CNI_BIN_DIR=$(cd "$CNI_BIN_DIR" && pwd)
CNI_CONF_DIR=$(cd "$CNI_CONF_DIR" && pwd)
mkdir -p "$STATE_DIR"/{root,state,logs,pids,runc,pod-logs}

if [[ -f "$STATE_DIR/pids/containerd" ]] && kill -0 "$(cat "$STATE_DIR/pids/containerd")" 2>/dev/null; then
    echo "containerd-up: a containerd for $STATE_DIR is already running" >&2
    exit 1
fi

# --- images (cached; built once per input change) ----------------------------------------------
bash "$HERE/images/build.sh" "$IMAGES_DIR"
# shellcheck disable=SC1091
source "$IMAGES_DIR/images.env"
t_images=$(now_ms)

# --- network namespace -----------------------------------------------------------------------
created_netns=0
if [[ ! -e "/var/run/netns/$NETNS" ]]; then
    ip netns add "$NETNS"
    created_netns=1
fi
ip -n "$NETNS" link set lo up
# Recorded at once, so that containerd-down.sh removes the netns even if a later step fails.
echo "NETNS=$NETNS
NETNS_CREATED=$created_netns" >"$STATE_DIR/env"

# --- CNI bin dir needs loopback --------------------------------------------------------------
if [[ ! -e "$CNI_BIN_DIR/loopback" ]]; then
    ln -s "$REF_CNI/loopback" "$CNI_BIN_DIR/loopback"
fi

# --- config ----------------------------------------------------------------------------------
ADDRESS="$STATE_DIR/containerd.sock"
# A unix socket path is limited to 107 bytes; the shim's own sockets are hashed, but ours are not.
if ((${#ADDRESS} + 7 > 107)); then
    echo "containerd-up: STATE_DIR too long for a unix socket path: $ADDRESS" >&2
    exit 2
fi
CGROUP_PARENT="/kuryr-$NETNS"
CONFIG="$STATE_DIR/config.toml"
# shellcheck source=lib.sh
source "$HERE/lib.sh"
{
    echo "# Written by tests/env/containerd-up.sh for one test; every path is private to $STATE_DIR."
    containerd_config "$STATE_DIR" "$ADDRESS" "$PAUSE_IMAGE" "$CNI_BIN_DIR" "$CNI_CONF_DIR"
} >"$CONFIG"

# --- start -----------------------------------------------------------------------------------
# nsenter --net only: `ip netns exec` would also unshare the mount namespace, hiding the
# /var/run/netns/cni-* bind mounts CRI creates from the rest of the host (and from down.sh).
LOG="$STATE_DIR/logs/containerd.log"
nsenter --net="/var/run/netns/$NETNS" containerd --config "$CONFIG" >>"$LOG" 2>&1 </dev/null &
PID=$!
echo "$PID" >"$STATE_DIR/pids/containerd"
t_started=$(now_ms)

# Written now so that containerd-down.sh can clean up even if the wait below fails.
write_env() {
    cat >"$STATE_DIR/env.tmp" <<EOF
STATE_DIR=$STATE_DIR
NETNS=$NETNS
NETNS_PATH=/var/run/netns/$NETNS
NETNS_CREATED=$created_netns
CONTAINERD_ADDRESS=$ADDRESS
CONTAINERD_PID=$PID
CONTAINERD_CONFIG=$CONFIG
CONTAINERD_LOG=$LOG
CRI_NAMESPACE=k8s.io
CNI_BIN_DIR=$CNI_BIN_DIR
CNI_CONF_DIR=$CNI_CONF_DIR
CGROUP_PARENT=$CGROUP_PARENT
POD_LOG_DIR=$STATE_DIR/pod-logs
PAUSE_IMAGE=$PAUSE_IMAGE
BUSYBOX_IMAGE=$BUSYBOX_IMAGE
$*
EOF
    mv -f "$STATE_DIR/env.tmp" "$STATE_DIR/env"
}
write_env

deadline=$(($(now_ms) + TIMEOUT * 1000))
until ctr --address "$ADDRESS" --timeout 2s version >/dev/null 2>&1; do
    if ! kill -0 "$PID" 2>/dev/null; then
        echo "containerd-up: containerd exited during start; log follows" >&2
        tail -n 50 "$LOG" >&2
        exit 1
    fi
    if (($(now_ms) > deadline)); then
        echo "containerd-up: containerd did not answer on $ADDRESS within ${TIMEOUT}s; log follows" >&2
        tail -n 50 "$LOG" >&2
        exit 1
    fi
    sleep 0.02
done
t_ready=$(now_ms)

# Imported into CRI's namespace and unpacked into the snapshotter CRI uses, so that
# RunPodSandbox finds the sandbox image without pulling. (Importing both at once was measured: no
# faster on two busy cores.)
for tar in "$PAUSE_TAR" "$BUSYBOX_TAR"; do
    log="$STATE_DIR/logs/import-$(basename "$tar" .tar).log"
    if ! ctr --address "$ADDRESS" -n k8s.io images import --snapshotter overlayfs "$tar" >"$log" 2>&1; then
        echo "containerd-up: importing $tar failed:" >&2
        cat "$log" >&2
        exit 1
    fi
done
t_imported=$(now_ms)

write_env "TIMING_IMAGES_MS=$((t_images - t0))
TIMING_CONTAINERD_READY_MS=$((t_ready - t_started))
TIMING_IMPORT_MS=$((t_imported - t_ready))"
cat "$STATE_DIR/env"
