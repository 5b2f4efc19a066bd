# shellcheck shell=bash disable=SC2034
# Shared by the OpenStack environment scripts (sourced, not run). Defines where the venvs live,
# how the Python interpreter and uv are found, and the small process helpers every up/down script
# uses. Callers set SCRIPT (their name, for messages) before sourcing.

OS_HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# alive, free_ports, show_logs.
# shellcheck source=../lib.sh
source "$OS_HERE/../lib.sh"
# Venvs, the uv tool and its download cache; kept between runs (a warm setup takes seconds).
OS_CACHE="${KURYR_OPENSTACK_CACHE:-/var/cache/kuryr-rs/openstack}"
# uv resolves and installs the pinned sets several times faster than pip; itself pinned.
UV_VERSION=0.13.8
UV="$OS_CACHE/uv-tool/bin/uv"
export UV_CACHE_DIR="$OS_CACHE/uv-cache"
OS_SERVICES=(keystone neutron octavia)
# Built only when named (setup.sh kuryr): Kuryr-Kubernetes, the system kuryr-rs replaces.
OS_EXTRA_VENVS=(kuryr)

log() { printf '%s: %s\n' "${SCRIPT:-openstack}" "$*" >&2; }
die() { log "error: $*"; exit 1; }

# The venv of a service (keystone, neutron, octavia).
venv_dir() { printf '%s/%s' "$OS_CACHE" "$1"; }

# Prints a Python ≥ 3.11 interpreter's real path: $KURYR_PYTHON, else python3.11 (the version the
# constraints are resolved for), python3.12, python3.13, python3, else a pyenv one. The OpenStack
# releases pinned here need ≥ 3.11.
find_python() {
    local c p
    for c in ${KURYR_PYTHON:-} python3.11 python3.12 python3.13 python3 /usr/bin/python3 \
        "$HOME"/.pyenv/versions/3.1[1-9]*/bin/python3; do
        p="$(command -v "$c" 2>/dev/null)" || continue
        "$p" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null || continue
        # pyenv shims re-resolve on every call; the venv must point at one fixed interpreter.
        "$p" -c 'import sys; print(sys.executable)'
        return 0
    done
    return 1
}

# The start time of a process (clock ticks since boot, /proc/PID/stat field 22): with the pid, it
# names one process for good, where a pid alone may be reused. (Command lines and environments do
# not: the OpenStack services rewrite both when they set their process titles.)
starttime() {
    local stat
    stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
    stat="${stat##*) }"
    # shellcheck disable=SC2086 # split into fields on purpose
    set -- $stat
    echo "${20}"
}

# Installs uv (pinned) from PyPI into a venv of its own unless it is there already.
ensure_uv() {
    local python="$1"
    [[ "$("$UV" --version 2>/dev/null)" == "uv $UV_VERSION"* ]] && return 0
    log "installing uv $UV_VERSION"
    rm -rf "$OS_CACHE/uv-tool"
    "$python" -m venv "$OS_CACHE/uv-tool" || die "python -m venv failed for $python"
    "$OS_CACHE/uv-tool/bin/pip" install -q "uv==$UV_VERSION" || die "pip install uv==$UV_VERSION failed"
}

# launch NAME ARGS...: runs ARGS detached in a session of its own, stdio appended to
# $LOGS/NAME.log; records the pid and its start time in $PIDS (down.sh signals the pid only while
# the start time still matches).
launch() {
    local name="$1"
    shift
    setsid "$@" </dev/null >>"$LOGS/$name.log" 2>&1 &
    echo $! >"$PIDS/$name.pid"
    starttime $! >"$PIDS/$name.start" || true
}

# ours NAME PID: whether PID is still the process up.sh started as NAME.
ours() { [[ -s "$PIDS/$1.start" && "$(starttime "$2")" == "$(cat "$PIDS/$1.start")" ]]; }

# stop NAME [SIGNAL]: ends the process recorded in $PIDS/NAME.pid and everything in its process
# group: SIGNAL (default TERM), then KILL after $OS_DOWN_GRACE seconds (default 5).
stop() {
    local name="$1" sig="${2:-TERM}" f pid deadline
    f="$PIDS/$name.pid"
    [[ -f "$f" ]] || return 0
    pid="$(cat "$f")"
    if [[ "$pid" =~ ^[0-9]+$ && "$pid" != "$$" ]] && alive "$pid"; then
        if ours "$name" "$pid"; then
            kill "-$sig" -- "-$pid" 2>/dev/null || kill "-$sig" "$pid" 2>/dev/null || true
            # These never act on TERM (measured): do not wait for them long.
            case "$name" in neutron-agent | neutron-rpc) deadline=$((SECONDS + 1)) ;; *) deadline=$((SECONDS + ${OS_DOWN_GRACE:-5})) ;; esac
            while alive "$pid" && ((SECONDS < deadline)); do sleep 0.1; done
            # The group too: uWSGI workers and agent helpers may linger after their leader.
            kill -KILL -- "-$pid" 2>/dev/null || true
            if alive "$pid"; then
                kill -KILL "$pid" 2>/dev/null || true
                for _ in $(seq 50); do alive "$pid" || break; sleep 0.1; done
            fi
        else
            log "pid $pid in $f is not a process of $STATE any more; leaving it alone"
        fi
    fi
    rm -f "$f" "$PIDS/$name.start"
}
