# shellcheck shell=bash disable=SC2034
# Neutron for up.sh (sourced): the API under uWSGI, neutron-rpc-server, and one node — a private
# network namespace holding its own ovsdb-server/ovs-vswitchd (userspace datapath) and the ML2/OVS
# agent. The agent reaches RabbitMQ, which listens on the host's loopback, through a socat pair
# joined by a unix socket (a network namespace has a loopback of its own).
#
# The agent's firewall is `noop` (security groups are API state only) unless
# NEUTRON_FIREWALL_DRIVER says otherwise: `openvswitch` enforces them with OpenFlow and conntrack
# on the userspace datapath (what kuryr-policy's Neutron security-group suite asks for).
#
# Uses from up.sh: STATE LOGS TRANSPORT_URL RABBIT_AMQP_PORT AGENT_HOST POD_NET_V4 POD_NET_V6,
# start/wait_ready/fail/envline/took/create_db/migrate/uwsgi_ini.

# neutron_api GET|POST PATH [JSON]: one call to the Neutron API; prints the body, fails on >= 400.
neutron_api() {
    curl -sS --fail-with-body --max-time 60 -X "$1" -H 'Content-Type: application/json' \
        ${3:+--data "$3"} "$NEUTRON_URL$2"
}
# json_get EXPR: evaluates a Python expression on the JSON document `d` read from stdin.
json_get() { python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }

# Runs a command inside the node's network namespace, with this node's OVS directories.
NODE_EXEC=()
in_node() { "${NODE_EXEC[@]}" "$@"; }

agent_alive() {
    neutron_api GET "/v2.0/agents?binary=neutron-openvswitch-agent&host=$AGENT_HOST" |
        json_get "'yes' if any(a['alive'] for a in d['agents']) else sys.exit(1)"
}

# host_agent_alive HOST: agent_alive for another host.
host_agent_alive() { AGENT_HOST="$1" agent_alive; }

start_neutron() {
    local n="$STATE/neutron" venv port files
    venv="$(venv_dir neutron)"
    mkdir -p "$n/state" "$n/lock"
    port="$(free_ports 1)"
    NEUTRON_URL="http://127.0.0.1:$port"
    # There is no sudo here and everything runs as root already: the root helper just executes.
    printf '#!/bin/sh\nexec "$@"\n' >"$n/root-helper"
    chmod 755 "$n/root-helper"
    cat >"$n/neutron.conf" <<EOF
[DEFAULT]
core_plugin = ml2
service_plugins = router,trunk
auth_strategy = noauth
api_paste_config = $venv/etc/neutron/api-paste.ini
transport_url = $TRANSPORT_URL
state_path = $n/state
allow_overlapping_ips = true
notify_nova_on_port_status_changes = false
notify_nova_on_port_data_changes = false
dhcp_agent_notification = false
api_workers = 1
rpc_workers = 1
rpc_state_report_workers = 1
use_stderr = true
[database]
connection = $(create_db neutron)
# Notifications on the bus, as a deployment with a notification consumer (Ceilometer, Designate,
# kuryr) configures them: port.create.end, port.update.end, ... on exchange neutron, topic
# notifications.
[oslo_messaging_notifications]
driver = messagingv2
[oslo_concurrency]
lock_path = $n/lock
[agent]
root_helper = $n/root-helper
# Quotas stay enforceable per project through the API; the defaults do not get in the way of
# tests creating hundreds of ports.
[quotas]
quota_network = -1
quota_subnet = -1
quota_port = -1
quota_security_group = -1
quota_security_group_rule = -1
EOF
    cat >"$n/ml2_conf.ini" <<EOF
[ml2]
type_drivers = flat,vxlan,local
tenant_network_types = vxlan
mechanism_drivers = openvswitch
# tag_ports_during_bulk_creation: tags in a port create (single or bulk) are applied in the same
# call; without it Neutron drops them and the allocator tags each new port with one more call.
extension_drivers = port_security,tag_ports_during_bulk_creation
[ml2_type_vxlan]
vni_ranges = 1:1000
[ml2_type_flat]
flat_networks = *
[securitygroup]
firewall_driver = ${NEUTRON_FIREWALL_DRIVER:-noop}
EOF
    cat >"$n/openvswitch_agent.ini" <<EOF
[DEFAULT]
host = $AGENT_HOST
[ovs]
integration_bridge = br-int
tunnel_bridge = br-tun
datapath_type = netdev
ovsdb_connection = unix:$STATE/ovs/run/db.sock
of_listen_address = 127.0.0.1
local_ip = 127.0.0.1
[agent]
tunnel_types = vxlan
root_helper = $n/root-helper
[securitygroup]
firewall_driver = ${NEUTRON_FIREWALL_DRIVER:-noop}
EOF
    files=(--config-file "$n/neutron.conf" --config-file "$n/ml2_conf.ini")
    migrate neutron neutron "$venv/bin/neutron-db-manage" "${files[@]}" upgrade heads
    took "Neutron database ready"

    uwsgi_ini neutron "$port" neutron.wsgi.api "${NEUTRON_API_PROCESSES:-2}" 1 >"$n/uwsgi.ini"
    start neutron-api env OS_NEUTRON_CONFIG_DIR="$n" OS_NEUTRON_CONFIG_FILES="neutron.conf;ml2_conf.ini" \
        "$venv/bin/uwsgi" --ini "$n/uwsgi.ini"
    start neutron-rpc env PATH="$venv/bin:$PATH" "$venv/bin/neutron-rpc-server" "${files[@]}"
    start_node
    local i=2 h
    for h in ${NEUTRON_EXTRA_AGENT_HOSTS:+${NEUTRON_EXTRA_AGENT_HOSTS//,/ }}; do
        start_extra_node "$h" "$i"
        i=$((i + 1))
    done
}
ready_neutron() {
    wait_ready neutron-api curl -sf --max-time 5 "$NEUTRON_URL/v2.0/networks"
    took "Neutron API ready at $NEUTRON_URL"
    # The agent is up once the RPC server has recorded its first report.
    wait_ready neutron-agent agent_alive
    took "Neutron agent alive on host $AGENT_HOST"
    local i=2 h
    for h in ${NEUTRON_EXTRA_AGENT_HOSTS:+${NEUTRON_EXTRA_AGENT_HOSTS//,/ }}; do
        wait_ready "neutron-agent-$i" host_agent_alive "$h"
        took "Neutron agent alive on host $h"
        i=$((i + 1))
    done
    envline NEUTRON_EXTRA_AGENT_HOSTS "${NEUTRON_EXTRA_AGENT_HOSTS:-}"
    envline NEUTRON_URL "$NEUTRON_URL"
    envline NEUTRON_API_PID "$(pid_of neutron-api)"
    envline NEUTRON_RPC_PID "$(pid_of neutron-rpc)"
    envline NEUTRON_AGENT_PID "$(pid_of neutron-agent)"
    envline NEUTRON_AGENT_HOST "$AGENT_HOST"
    envline NEUTRON_NODE_NETNS "$NODE_NETNS"
    envline NEUTRON_INTEGRATION_BRIDGE br-int
    envline OVS_RUNDIR "$STATE/ovs/run"
}

# The node: network namespace, Open vSwitch, the AMQP bridge and the agent.
start_node() {
    local o="$STATE/ovs" venv
    venv="$(venv_dir neutron)"
    NODE_NETNS="kos-$(basename "$STATE" | tr -dc 'a-zA-Z0-9' | tail -c 10)-$$"
    ip netns add "$NODE_NETNS" || die "ip netns add $NODE_NETNS failed"
    echo "$NODE_NETNS" >"$STATE/netns"
    NODE_EXEC=(nsenter --net="/var/run/netns/$NODE_NETNS" env OVS_RUNDIR="$o/run" OVS_DBDIR="$o/db"
        OVS_LOGDIR="$o/log" OVS_SYSCONFDIR="$o/etc")
    ip -n "$NODE_NETNS" link set lo up
    mkdir -p "$o/run" "$o/db" "$o/log" "$o/etc"
    ovsdb-tool create "$o/db/conf.db" /usr/share/openvswitch/vswitch.ovsschema ||
        die "ovsdb-tool create failed"
    start ovsdb-server "${NODE_EXEC[@]}" ovsdb-server "$o/db/conf.db" --remote="punix:$o/run/db.sock" \
        --pidfile="$o/run/ovsdb-server.pid" --log-file="$o/log/ovsdb-server.log"
    wait_ready ovsdb-server test -S "$o/run/db.sock"
    in_node ovs-vsctl --db="unix:$o/run/db.sock" --no-wait init || die "ovs-vsctl init failed"
    start ovs-vswitchd "${NODE_EXEC[@]}" ovs-vswitchd "unix:$o/run/db.sock" --pidfile="$o/run/ovs-vswitchd.pid" \
        --log-file="$o/log/ovs-vswitchd.log"
    wait_ready ovs-vswitchd in_node ovs-appctl -t ovs-vswitchd version
    envline OVSDB_SERVER_PID "$(pid_of ovsdb-server)"
    envline OVS_VSWITCHD_PID "$(pid_of ovs-vswitchd)"

    start amqp-bridge-host socat "UNIX-LISTEN:$STATE/rabbitmq/amqp.sock,fork,unlink-early" \
        "TCP:127.0.0.1:$RABBIT_AMQP_PORT"
    wait_ready amqp-bridge-host test -S "$STATE/rabbitmq/amqp.sock"
    start amqp-bridge-node "${NODE_EXEC[@]}" socat "TCP-LISTEN:$RABBIT_AMQP_PORT,bind=127.0.0.1,reuseaddr,fork" \
        "UNIX-CONNECT:$STATE/rabbitmq/amqp.sock"
    start neutron-agent "${NODE_EXEC[@]}" env PATH="$venv/bin:$PATH" "$venv/bin/neutron-openvswitch-agent" \
        --config-file "$STATE/neutron/neutron.conf" --config-file "$STATE/neutron/openvswitch_agent.ini"
    took "node $AGENT_HOST: OVS up in netns $NODE_NETNS, agent started"
}

# An extra node (NEUTRON_EXTRA_AGENT_HOSTS), as start_node's but without the host side of the AMQP
# bridge (shared): its own network namespace, Open vSwitch and ML2/OVS agent with host HOST, so
# that ports bound to HOST bind. Processes are named NAME-I (ovsdb-server-2, neutron-agent-2,
# ...); `I NETNS` lines in STATE/extra-netns tell down.sh what to remove.
start_extra_node() {
    local host="$1" i="$2" o="$STATE/ovs-$2" venv ns
    venv="$(venv_dir neutron)"
    ns="kos-$(basename "$STATE" | tr -dc 'a-zA-Z0-9' | tail -c 10)-$$-$i"
    ip netns add "$ns" || die "ip netns add $ns failed"
    echo "$i $ns" >>"$STATE/extra-netns"
    local exec=(nsenter --net="/var/run/netns/$ns" env OVS_RUNDIR="$o/run" OVS_DBDIR="$o/db"
        OVS_LOGDIR="$o/log" OVS_SYSCONFDIR="$o/etc")
    ip -n "$ns" link set lo up
    # Its tunnel address (local_ip below): one endpoint per host.
    ip -n "$ns" addr add "127.0.0.$i/8" dev lo || die "adding 127.0.0.$i to lo in $ns failed"
    mkdir -p "$o/run" "$o/db" "$o/log" "$o/etc"
    ovsdb-tool create "$o/db/conf.db" /usr/share/openvswitch/vswitch.ovsschema ||
        die "ovsdb-tool create failed"
    start "ovsdb-server-$i" "${exec[@]}" ovsdb-server "$o/db/conf.db" --remote="punix:$o/run/db.sock" \
        --pidfile="$o/run/ovsdb-server.pid" --log-file="$o/log/ovsdb-server.log"
    wait_ready "ovsdb-server-$i" test -S "$o/run/db.sock"
    "${exec[@]}" ovs-vsctl --db="unix:$o/run/db.sock" --no-wait init || die "ovs-vsctl init failed"
    start "ovs-vswitchd-$i" "${exec[@]}" ovs-vswitchd "unix:$o/run/db.sock" \
        --pidfile="$o/run/ovs-vswitchd.pid" --log-file="$o/log/ovs-vswitchd.log"
    wait_ready "ovs-vswitchd-$i" "${exec[@]}" ovs-appctl -t ovs-vswitchd version
    start "amqp-bridge-node-$i" "${exec[@]}" socat "TCP-LISTEN:$RABBIT_AMQP_PORT,bind=127.0.0.1,reuseaddr,fork" \
        "UNIX-CONNECT:$STATE/rabbitmq/amqp.sock"
    sed -e "s|^host = .*|host = $host|" -e "s|^ovsdb_connection = .*|ovsdb_connection = unix:$o/run/db.sock|" \
        -e "s|^local_ip = .*|local_ip = 127.0.0.$i|" \
        "$STATE/neutron/openvswitch_agent.ini" >"$STATE/neutron/openvswitch_agent-$i.ini"
    start "neutron-agent-$i" "${exec[@]}" env PATH="$venv/bin:$PATH" "$venv/bin/neutron-openvswitch-agent" \
        --config-file "$STATE/neutron/neutron.conf" --config-file "$STATE/neutron/openvswitch_agent-$i.ini"
    took "node $host: OVS up in netns $ns, agent started"
}

# The pod network: a vxlan network owned by the project, with an IPv4 and an IPv6 subnet.
init_neutron() {
    local project="${OS_PROJECT_ID:-}" net v4 v6
    # Without Keystone any id names a project (noauth); keep it stable within this environment.
    [[ -n "$project" ]] || project="$(openssl rand -hex 16)"
    net="$(neutron_api POST /v2.0/networks \
        "{\"network\": {\"name\": \"pods\", \"project_id\": \"$project\", \"admin_state_up\": true}}" |
        json_get "d['network']['id']")" || die "creating the pod network failed"
    v4="$(neutron_api POST /v2.0/subnets "{\"subnet\": {\"name\": \"pods-v4\", \"network_id\": \"$net\",
        \"project_id\": \"$project\", \"ip_version\": 4, \"cidr\": \"$POD_NET_V4\"}}" |
        json_get "d['subnet']['id']")" || die "creating the IPv4 pod subnet failed"
    v6="$(neutron_api POST /v2.0/subnets "{\"subnet\": {\"name\": \"pods-v6\", \"network_id\": \"$net\",
        \"project_id\": \"$project\", \"ip_version\": 6, \"cidr\": \"$POD_NET_V6\"}}" |
        json_get "d['subnet']['id']")" || die "creating the IPv6 pod subnet failed"
    envline POD_PROJECT_ID "$project"
    envline POD_NETWORK_ID "$net"
    envline POD_SUBNET_V4_ID "$v4"
    envline POD_SUBNET_V4_CIDR "$POD_NET_V4"
    envline POD_SUBNET_V6_ID "$v6"
    envline POD_SUBNET_V6_CIDR "$POD_NET_V6"
    took "pod network $net with subnets $POD_NET_V4 and $POD_NET_V6"
}
