#!/usr/bin/env bash
# Stops what kube-up.sh started in STATE_DIR, by the pids it recorded (never by process name):
# TERM, then KILL after a bound. Idempotent: a missing state dir or an already-gone process is
# success.
#
#   kube-down.sh STATE_DIR [--purge]     --purge also removes STATE_DIR afterwards
#
# Before signalling a pid it checks that the process's command line mentions STATE_DIR (every
# process kube-up.sh starts has it there), so a pid reused by an unrelated process is left alone.
set -euo pipefail

log() { printf 'kube-down.sh: %s\n' "$*" >&2; }

[[ $# -ge 1 && $# -le 2 ]] || { log "usage: kube-down.sh STATE_DIR [--purge]"; exit 2; }
purge=0
[[ "${2:-}" == --purge ]] && purge=1
[[ $# -eq 2 && $purge -eq 0 ]] && { log "unknown option '$2'"; exit 2; }
[[ -d "$1" ]] || exit 0
STATE="$(cd "$1" && pwd)"
PIDS="$STATE/pids"
GRACE_SECONDS="${KUBE_DOWN_GRACE:-10}"

# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
ours() { tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | grep -qF -- "$STATE"; }

# The watchdog first (it would otherwise notice nothing and keep polling), then the apiserver
# before its storage.
for name in watchdog kube-apiserver etcd; do
    f="$PIDS/$name.pid"
    [[ -f "$f" ]] || continue
    pid="$(cat "$f")"
    # The watchdog execs this script: do not signal ourselves.
    if [[ "$pid" =~ ^[0-9]+$ && "$pid" != "$$" ]] && alive "$pid"; then
        if ours "$pid"; then
            kill -TERM "$pid" 2>/dev/null || true
            deadline=$((SECONDS + GRACE_SECONDS))
            while alive "$pid" && ((SECONDS < deadline)); do sleep 0.1; done
            if alive "$pid"; then
                log "$name (pid $pid) ignored TERM for ${GRACE_SECONDS}s; sending KILL"
                kill -KILL "$pid" 2>/dev/null || true
                for _ in $(seq 50); do alive "$pid" || break; sleep 0.1; done
            fi
        else
            log "pid $pid in $f is not a process of $STATE any more; leaving it alone"
        fi
    fi
    rm -f "$f"
done

if [[ $purge -eq 1 ]]; then
    rm -rf "$STATE"
fi
