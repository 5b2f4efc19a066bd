# shellcheck shell=bash
# Shell functions shared by the environment scripts (sourced, not run): kube-up.sh, kube-down.sh,
# containerd-up.sh, cluster/up.sh, cluster/down.sh and openstack/common.sh. Messages go through
# the caller's own `log`.

# alive PID: whether PID runs; a zombie (exited, not yet reaped) counts as gone.
alive() { kill -0 "$1" 2>/dev/null && [[ "$(cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null)" != Z ]]; }

# free_ports N: N distinct TCP ports on 127.0.0.1 that are free right now, at random from the
# 12,000 below the kernel's ephemeral range: outgoing connections take their local ports from that
# range, so a port from it may be some client's by the time the server binds it (a database
# migration or a bootstrap can sit in between). The same rule as free_port() in tests/src/util.rs.
free_ports() {
    python3 - "$1" <<'EOF'
import random, socket, sys
try:
    high = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
except (OSError, ValueError, IndexError):
    high = 32768
low = max(1024, high - 12000)
want, socks = int(sys.argv[1]), []
for _ in range(256):
    if len(socks) == want:
        break
    s = socket.socket()
    try:
        # An ephemeral range that starts too low to leave ports below it: any free port.
        s.bind(("127.0.0.1", random.randrange(low, high) if high - low >= 1000 else 0))
    except OSError:
        s.close()
        continue
    socks.append(s)
if len(socks) < want:
    sys.exit(f"free_ports: not {want} free TCP ports among 256 tries in {low}..{high}")
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

# show_logs LINES FILE...: the last LINES lines of each FILE that is not empty, to stderr (what
# the servers said, on a failed start).
show_logs() {
    local lines="$1" f
    shift
    for f in "$@"; do
        [[ -s "$f" ]] || continue
        log "---- last lines of $f ----"
        tail -n "$lines" "$f" >&2 || true
    done
}

# stop_on_failure LINES CMD...: from now on, until the caller sets ok=1, an exit (a failure) shows
# the last LINES lines of every log in $LOGS and runs CMD, which stops what was started. The log
# of the server that failed, if the caller names it in FAILED_LOG, comes first: a reader (or a CI
# report that keeps only the head of a long output) sees the cause before the other servers' logs.
stop_on_failure() {
    ON_FAILURE_LINES="$1"
    shift
    ON_FAILURE=("$@")
    ok=0
    FAILED_LOG=""
    trap _on_failure EXIT
}
_on_failure() {
    if [[ $ok -ne 1 ]]; then
        # A reader that went away (stderr a closed pipe) must not stop the clean-up: SIGPIPE is
        # ignored and a failed write does not end the shell (set -e does not apply left of ||).
        trap '' PIPE
        _show_failure_logs || true
        "${ON_FAILURE[@]}" >&2 || true
    fi
}
_show_failure_logs() {
    local f
    [[ -z "$FAILED_LOG" ]] || show_logs "$ON_FAILURE_LINES" "$FAILED_LOG"
    for f in "$LOGS"/*.log; do
        [[ "$f" == "$FAILED_LOG" ]] || show_logs "$ON_FAILURE_LINES" "$f"
    done
}

# containerd_config DIR SOCKET SANDBOX_IMAGE CNI_BIN_DIR CNI_CONF_DIR: the configuration of a
# containerd (CRI plugin, runc) whose root, state, runc state and opt directories are all in DIR,
# serving on SOCKET.
containerd_config() {
    local dir="$1" socket="$2" sandbox_image="$3" cni_bin_dir="$4" cni_conf_dir="$5"
    cat <<EOF
version = 2
root = "$dir/root"
state = "$dir/state"
# The caller may have a negative/positive score of its own; do not touch ours or the shims'.
oom_score = 0

[grpc]
  address = "$socket"

[ttrpc]
  address = "$socket.ttrpc"

[debug]
  level = "info"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$sandbox_image"
  # Root here lacks CAP_SYS_RESOURCE: without this runc fails with
  # "can't get final child's PID from pipe" when it tries to lower oom_score_adj.
  restrict_oom_score_adj = true
  # containerd listens inside a network namespace of its own, so its loopback is private: no
  # port can collide with another instance, and 0 lets the kernel pick one.
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  disable_apparmor = true

  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"

    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"

      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        # runc's state would otherwise go to the shared /run/containerd/runc.
        Root = "$dir/runc"
        SystemdCgroup = false

  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$cni_bin_dir"
    conf_dir = "$cni_conf_dir"
    max_conf_num = 1

[plugins."io.containerd.internal.v1.opt"]
  path = "$dir/opt"
EOF
}
