#!/usr/bin/env bash
# Stops, kills and starts again single processes of an environment up.sh started, for fault tests
# (an API gone in the middle of a burst, a worker crashing):
#
#   ctl.sh STATE_DIR stop NAME...    TERM (KILL after a bound) to the process and its group
#   ctl.sh STATE_DIR kill NAME...    KILL at once, as a crash would
#   ctl.sh STATE_DIR start NAME...   starts it again with the command line up.sh used; returns
#                                    once it is running (ready is the caller's to wait for)
#   ctl.sh STATE_DIR names           the processes of the environment, in start order
#
# NAMEs are those of STATE_DIR/pids and logs: mariadb, epmd, rabbitmq, keystone, neutron-api,
# neutron-rpc, ovsdb-server, ovs-vswitchd, amqp-bridge-host, amqp-bridge-node, neutron-agent,
# octavia-api, octavia-worker. A process started again keeps its port, its log and its state.
set -euo pipefail
SCRIPT=openstack/ctl.sh
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

[[ $# -ge 2 ]] || die "usage: ctl.sh STATE_DIR stop|kill|start NAME... | names"
[[ -d "$1/pids" ]] || die "$1 is not an environment started by up.sh"
STATE="$(cd "$1" && pwd)"
PIDS="$STATE/pids" LOGS="$STATE/logs"
action="$2"
shift 2
export KURYR_OS_STATE="$STATE"

case "$action" in
names)
    cat "$STATE/start-order"
    exit 0
    ;;
stop | kill | start) ;;
*) die "unknown action '$action' (stop, kill, start, names)" ;;
esac
[[ $# -ge 1 ]] || die "$action: which process?"

for name in "$@"; do
    [[ -f "$STATE/cmds/$name" ]] || die "no process '$name' in $STATE (known: $(tr '\n' ' ' <"$STATE/start-order"))"
    case "$action" in
    stop) stop "$name" TERM ;;
    kill) OS_DOWN_GRACE=0 stop "$name" KILL ;;
    start)
        if [[ -f "$PIDS/$name.pid" ]] && ours "$name" "$(cat "$PIDS/$name.pid")" &&
            alive "$(cat "$PIDS/$name.pid")"; then
            die "$name is running already (pid $(cat "$PIDS/$name.pid"))"
        fi
        # The command line as up.sh recorded it, shell-quoted.
        eval "cmd=($(cat "$STATE/cmds/$name"))"
        echo "---- started again by ctl.sh at $(date -u +%FT%TZ) ----" >>"$LOGS/$name.log"
        # shellcheck disable=SC2154 # cmd is assigned by the eval above
        launch "$name" "${cmd[@]}"
        sleep 0.3
        pid="$(cat "$PIDS/$name.pid")"
        alive "$pid" || {
            tail -n 30 "$LOGS/$name.log" >&2
            die "$name exited right after starting again"
        }
        echo "$pid"
        ;;
    esac
done
