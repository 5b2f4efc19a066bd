#!/usr/bin/env bash
# Stops what up.sh started in STATE_DIR, by the pids it recorded (never by process name), newest
# first: TERM to the process's group (each server was started as a session leader, so its workers
# and helpers share its group), KILL after a bound — the Neutron agent and RPC workers ignore
# TERM. Before that, Open vSwitch's bridges and userspace datapath are deleted (or its TAP
# devices would outlive it), and afterwards the node network namespace. Idempotent: a missing
# state dir or an already-gone process is success.
#
#   down.sh STATE_DIR [--purge]     --purge also removes STATE_DIR afterwards
#
# A pid is only signalled while its start time is the one up.sh recorded (pids/NAME.start), so a
# pid reused by an unrelated process is left alone.
set -euo pipefail
SCRIPT=openstack/down.sh
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

[[ $# -ge 1 && $# -le 2 ]] || die "usage: down.sh STATE_DIR [--purge]"
purge=0
[[ "${2:-}" == --purge ]] && purge=1
[[ $# -eq 2 && $purge -eq 0 ]] && die "unknown option '$2'"
[[ -d "$1" ]] || exit 0
STATE="$(cd "$1" && pwd)"
PIDS="$STATE/pids"

[[ -d "$PIDS" ]] || { [[ $purge -eq 1 ]] && rm -rf "$STATE"; exit 0; }

# The watchdog first (it execs this script: never signal ourselves).
stop watchdog

# Open vSwitch, while ovs-vswitchd is still there to do it.
netns="$(cat "$STATE/netns" 2>/dev/null || true)"
if [[ -f "$PIDS/ovs-vswitchd.pid" && -n "$netns" ]]; then
    ovs=(nsenter --net="/var/run/netns/$netns" env OVS_RUNDIR="$STATE/ovs/run" OVS_DBDIR="$STATE/ovs/db"
        OVS_LOGDIR="$STATE/ovs/log" OVS_SYSCONFDIR="$STATE/ovs/etc")
    # The agent would recreate what is deleted under it.
    stop neutron-agent
    for br in $("${ovs[@]}" ovs-vsctl --timeout=5 list-br 2>/dev/null); do
        "${ovs[@]}" ovs-vsctl --timeout=5 --if-exists del-br "$br" || true
    done
    "${ovs[@]}" ovs-appctl --timeout=5 -t ovs-vswitchd dpctl/del-dp netdev@ovs-netdev >/dev/null 2>&1 || true
fi

# The extra nodes' Open vSwitch likewise.
while read -r i ns; do
    [[ -f "$PIDS/ovs-vswitchd-$i.pid" ]] || continue
    ovs=(nsenter --net="/var/run/netns/$ns" env OVS_RUNDIR="$STATE/ovs-$i/run" OVS_DBDIR="$STATE/ovs-$i/db"
        OVS_LOGDIR="$STATE/ovs-$i/log" OVS_SYSCONFDIR="$STATE/ovs-$i/etc")
    stop "neutron-agent-$i"
    for br in $("${ovs[@]}" ovs-vsctl --timeout=5 list-br 2>/dev/null); do
        "${ovs[@]}" ovs-vsctl --timeout=5 --if-exists del-br "$br" || true
    done
    "${ovs[@]}" ovs-appctl --timeout=5 -t ovs-vswitchd dpctl/del-dp netdev@ovs-netdev >/dev/null 2>&1 || true
done < <(cat "$STATE/extra-netns" 2>/dev/null || true)

# Everything else, newest first.
if [[ -f "$STATE/start-order" ]]; then
    for name in $(tac "$STATE/start-order"); do stop "$name"; done
fi
for f in "$PIDS"/*.pid; do
    [[ -e "$f" ]] && stop "$(basename "$f" .pid)"
done

if [[ -n "$netns" ]]; then
    ip netns del "$netns" 2>/dev/null || true
    rm -f "$STATE/netns"
fi
while read -r _ ns; do
    ip netns del "$ns" 2>/dev/null || true
done < <(cat "$STATE/extra-netns" 2>/dev/null || true)
rm -f "$STATE/start-order" "$STATE/extra-netns"
if [[ $purge -eq 1 ]]; then
    rm -rf "$STATE"
fi
