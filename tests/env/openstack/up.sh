#!/usr/bin/env bash
# Starts real OpenStack services on loopback for tests, with all state under STATE_DIR and ports
# chosen free at start (several test binaries run at once). Any subset can be started; what the
# chosen services need comes along:
#
#   up.sh STATE_DIR keystone|neutron|octavia ...
#
#   keystone  MariaDB + Keystone (PyPI `keystone` under uWSGI, fernet tokens). Bootstrapped with
#             an admin (password auth), a project `kuryr` with a user `kuryr` (role member) and an
#             application credential of that user; Neutron and Octavia, when started together,
#             are in its catalog (region RegionOne).
#   neutron   MariaDB + RabbitMQ + the Neutron API (uWSGI, auth_strategy=noauth: no token needed,
#             every caller is admin, `project_id` in the body sets the owner) + neutron-rpc-server
#             + one node: a private network namespace with its own ovsdb-server/ovs-vswitchd
#             (userspace datapath, `br-int`) and the ML2/OVS agent, whose host is
#             $NEUTRON_AGENT_HOST (default node-1). A vxlan network `pods` with an IPv4 subnet
#             (10.100.0.0/16) and an IPv6 one (fd00:100::/64) is created, owned by the project
#             `kuryr` (with keystone) or by a random project id.
#   octavia   MariaDB + RabbitMQ + the Octavia API (uWSGI, noauth: the project comes from the
#             X-Project-Id header or `project_id` in the body) + octavia-worker, provider
#             `amphora` with the no-op compute/network/amphora drivers: load balancers go
#             through the real worker's flows to ACTIVE, nothing is booted.
#
# Writes:
#   STATE_DIR/env          KEY=VALUE lines: MARIADB_PORT; RABBITMQ_AMQP_PORT, TRANSPORT_URL,
#                          RABBITMQ_AMQPS_PORT and RABBITMQ_CA_FILE (its TLS listener and CA);
#                          OS_AUTH_URL, OS_REGION_NAME, OS_ADMIN_PASSWORD, OS_PROJECT_{NAME,ID},
#                          OS_USERNAME, OS_USER_ID, OS_PASSWORD, OS_APPLICATION_CREDENTIAL_{ID,SECRET};
#                          NEUTRON_URL, NEUTRON_AGENT_HOST, NEUTRON_NODE_NETNS, OVS_RUNDIR,
#                          NEUTRON_INTEGRATION_BRIDGE, POD_{PROJECT,NETWORK,SUBNET_V4,SUBNET_V6}_ID,
#                          POD_SUBNET_V{4,6}_CIDR; OCTAVIA_URL; OS_CLIENT_CONFIG_FILE; *_PID
#   STATE_DIR/cmds/        each process's command line (ctl.sh stops and starts single processes)
#   STATE_DIR/clouds.yaml  clouds `admin`, `kuryr`, `kuryr-appcred` (with keystone) and `noauth`
#                          (direct endpoints, with neutron or octavia)
#   STATE_DIR/openrc       OS_* variables of the `kuryr` user (with keystone)
#   STATE_DIR/logs/        one log per process
#   STATE_DIR/pids/        one pid file per process; down.sh stops exactly these
#   STATE_DIR/netns        the node network namespace's name (with neutron)
#
# Next to each pid file is the process's start time, which down.sh checks before it signals the
# pid. The agents ignore SIGTERM, so down.sh ends with KILL.
#
# Environment:
#   OS_UP_TIMEOUT       seconds to wait for each server to become ready (default 300: a loaded
#                       2-core machine needs up to a minute for the Neutron API alone)
#   OS_UP_OWNER_PID     if set, a watchdog runs down.sh --purge (unless KURYR_KEEP_STATE=1) once
#                       that process is gone
#   NEUTRON_AGENT_HOST  the agent's host name, i.e. the `binding:host_id` ports bind to
#   NEUTRON_EXTRA_AGENT_HOSTS  more nodes, comma-separated host names: each a network namespace
#                       with its own Open vSwitch and ML2/OVS agent (processes NAME-2, NAME-3...),
#                       so that ports bound to those hosts bind too (NEUTRON_EXTRA_AGENT_HOSTS in
#                       the env file)
#   NEUTRON_API_PROCESSES  uWSGI processes of the Neutron API (default 2)
#   NEUTRON_FIREWALL_DRIVER  the agent's `[securitygroup] firewall_driver` (default noop;
#                       `openvswitch` enforces security groups)
set -euo pipefail
SCRIPT=openstack/up.sh
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

TIMEOUT="${OS_UP_TIMEOUT:-300}"
REGION=RegionOne
AGENT_HOST="${NEUTRON_AGENT_HOST:-node-1}"
# The pod network created with neutron: addresses that only exist inside the tests.
POD_NET_V4=10.100.0.0/16
POD_NET_V6=fd00:100::/64

[[ $# -ge 2 ]] || die "usage: up.sh STATE_DIR keystone|neutron|octavia ..."
mkdir -p "$1" || die "cannot create state dir $1"
STATE="$(cd "$1" && pwd)"
shift
WANT_KEYSTONE=0 WANT_NEUTRON=0 WANT_OCTAVIA=0
for s in "$@"; do
    case "$s" in
    keystone) WANT_KEYSTONE=1 ;;
    neutron) WANT_NEUTRON=1 ;;
    octavia) WANT_OCTAVIA=1 ;;
    *) die "unknown service '$s' (known: ${OS_SERVICES[*]})" ;;
    esac
done
WANT_RABBIT=$((WANT_NEUTRON | WANT_OCTAVIA))
LOGS="$STATE/logs" PIDS="$STATE/pids"
[[ -d "$PIDS" ]] && [[ -n "$(ls -A "$PIDS")" ]] &&
    die "$STATE already has running servers (pids/); run down.sh $STATE first"

need=(curl openssl python3 setsid flock mariadbd mariadb-install-db mariadb)
((WANT_RABBIT)) && need+=(/usr/lib/rabbitmq/bin/rabbitmq-server epmd)
((WANT_NEUTRON)) && need+=(ovsdb-server ovs-vswitchd ovs-vsctl ovsdb-tool socat ip nsenter)
for cmd in "${need[@]}"; do
    command -v "$cmd" >/dev/null || [[ -x "$cmd" ]] ||
        die "'$cmd' is required but missing (make setup installs it: tests/env/setup.sh)"
done
# The venvs: built (or found up to date) first.
bash "$OS_HERE/setup.sh" "$@" || die "building the venvs (openstack/setup.sh) failed"

mkdir -p "$LOGS" "$PIDS"
export KURYR_OS_STATE="$STATE"
: >"$STATE/env"

ok=0
on_exit() {
    if [[ $ok -ne 1 ]]; then
        bash "$OS_HERE/down.sh" "$STATE" >&2 || true
    fi
}
trap on_exit EXIT

# Shows the end of a log (on failures) and dies.
fail() {
    local msg="$1"
    shift
    show_logs 40 "$@"
    die "$msg"
}

# start NAME ARGS...: a server detached in its own session (stdio to its log); records its pid
# and its command line (ctl.sh starts it again from there).
start() {
    local name="$1"
    shift
    mkdir -p "$STATE/cmds"
    printf '%q ' "$@" >"$STATE/cmds/$name"
    launch "$name" "$@"
    echo "$name" >>"$STATE/start-order"
}
pid_of() { cat "$PIDS/$1.pid"; }

# wait_ready NAME CHECK...: polls CHECK until it succeeds; fails, showing the log, when the process
# exits or time runs out.
wait_ready() {
    local name="$1" pid deadline=$((SECONDS + TIMEOUT))
    shift
    pid="$(pid_of "$name")"
    while ((SECONDS < deadline)); do
        alive "$pid" || fail "$name (pid $pid) exited during startup" "$LOGS/$name.log"
        "$@" >/dev/null 2>&1 && return 0
        sleep 0.2
    done
    fail "$name not ready after ${TIMEOUT}s" "$LOGS/$name.log"
}

envline() { printf '%s=%s\n' "$1" "$2" >>"$STATE/env"; }
secret() { openssl rand -hex 16; }
t_start=$SECONDS
took() { log "$1 after $((SECONDS - t_start))s"; }

# ---------------------------------------------------------------------------------------------
# MariaDB: a private datadir, TCP on 127.0.0.1 only, one database per service. Durability off
# (test data): fsync dominates migrations on a busy disk.
# ---------------------------------------------------------------------------------------------
DB_PORT='' DB_PASSWORD="$(secret)" DB_SOCK="$STATE/mysql/mysqld.sock"
start_mariadb() {
    # Its own tmpdir too: bootstraps running at once in the shared /tmp trip over each other.
    mkdir -p "$STATE/mysql/tmp"
    # A small redo log: the default 96 MiB file per environment adds up with several at once.
    mariadb-install-db --no-defaults --datadir="$STATE/mysql/data" --user=root --innodb-log-file-size=8M \
        --tmpdir="$STATE/mysql/tmp" --auth-root-authentication-method=socket --skip-test-db >"$LOGS/mariadb-install.log" 2>&1 ||
        fail "mariadb-install-db failed" "$LOGS/mariadb-install.log"
    DB_PORT="$(free_ports 1)"
    start mariadb mariadbd --no-defaults --datadir="$STATE/mysql/data" --socket="$DB_SOCK" \
        --port="$DB_PORT" --bind-address=127.0.0.1 --user=root --pid-file="$STATE/mysql/mysqld.pid" \
        --skip-name-resolve --skip-log-bin --innodb-flush-log-at-trx-commit=0 --innodb-doublewrite=0 \
        --sync-frm=0 --max-connections=500 --character-set-server=utf8mb4 --innodb-log-file-size=8M \
        --innodb-buffer-pool-size=64M --tmpdir="$STATE/mysql/tmp"
    wait_ready mariadb mariadb-admin --no-defaults --socket="$DB_SOCK" -uroot ping
    sql "CREATE USER 'openstack'@'127.0.0.1' IDENTIFIED BY '$DB_PASSWORD';"
    envline MARIADB_PORT "$DB_PORT"
    envline MARIADB_SOCKET "$DB_SOCK"
    envline MARIADB_PID "$(pid_of mariadb)"
    took "MariaDB ready on 127.0.0.1:$DB_PORT"
}
sql() { mariadb --no-defaults --socket="$DB_SOCK" -uroot -e "$1"; }
# create_db NAME: a database the services' user owns; prints its SQLAlchemy URL.
create_db() {
    sql "CREATE DATABASE $1 CHARACTER SET utf8mb4; GRANT ALL ON $1.* TO 'openstack'@'127.0.0.1';" ||
        die "creating database $1 failed"
    printf 'mysql+pymysql://openstack:%s@127.0.0.1:%s/%s?charset=utf8mb4' "$DB_PASSWORD" "$DB_PORT" "$1"
}

# migrate SERVICE DB CMD...: brings database DB to the schema of SERVICE's venv. The first time for
# a venv, CMD (the service's own migration tool) runs and the result is dumped into the cache;
# later runs load that dump, which takes a fraction of a second instead of tens of seconds.
migrate() {
    local service="$1" db="$2" stamp cache
    shift 2
    stamp="$(cat "$(venv_dir "$service")/.kuryr-stamp")"
    cache="$OS_CACHE/schema/$service-${stamp:0:16}.sql"
    if [[ -s "$cache" ]]; then
        mariadb --no-defaults --socket="$DB_SOCK" -uroot "$db" <"$cache" ||
            die "loading the cached schema $cache into $db failed"
        return 0
    fi
    "$@" >>"$LOGS/$service-db-manage.log" 2>&1 || fail "$service: migrating the database failed" "$LOGS/$service-db-manage.log"
    mkdir -p "$OS_CACHE/schema"
    mariadb-dump --no-defaults --socket="$DB_SOCK" -uroot --skip-comments --skip-dump-date "$db" >"$cache.$$" &&
        mv "$cache.$$" "$cache" || log "warning: could not cache the schema of $db"
}

# A fernet key as Keystone writes them: 32 random bytes, URL-safe base64.
fernet_key() { openssl rand 32 | base64 | tr '+/' '-_'; }

# ---------------------------------------------------------------------------------------------
# RabbitMQ: its own node name, ports, cookie, mnesia and logs; its own epmd on a private port
# (the shared default one would outlive us). Run as root straight from /usr/lib/rabbitmq.
# ---------------------------------------------------------------------------------------------
RABBIT_PASSWORD="$(secret)" TRANSPORT_URL=
RABBIT_ENV=()
rabbitmqctl() { "${RABBIT_ENV[@]}" /usr/lib/rabbitmq/bin/rabbitmqctl -q "$@"; }
start_rabbitmq() {
    local amqp amqps dist r="$STATE/rabbitmq"
    read -r EPMD_PORT amqp dist amqps <<<"$(free_ports 4)"
    RABBIT_NODE="kuryr$$@localhost"
    # What the server and rabbitmqctl both need to find the node and authenticate to it.
    RABBIT_ENV=(env HOME="$r" RABBITMQ_NODENAME="$RABBIT_NODE" ERL_EPMD_PORT="$EPMD_PORT"
        RABBITMQ_CONF_ENV_FILE=/dev/null)
    mkdir -p "$r/mnesia" "$r/log"
    secret >"$r/.erlang.cookie"
    chmod 400 "$r/.erlang.cookie"
    printf '[].\n' >"$r/enabled_plugins"
    # A TLS listener too, with a certificate for 127.0.0.1 and localhost from a CA of its own
    # (clients that speak AMQP over TLS are tested against it; the OpenStack services use TCP).
    mkdir -p "$r/tls"
    openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=kuryr test RabbitMQ CA" \
        -keyout "$r/tls/ca.key" -out "$r/tls/ca.pem" >/dev/null 2>&1 || die "creating the RabbitMQ test CA failed"
    openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" -keyout "$r/tls/server.key" \
        -out "$r/tls/server.csr" >/dev/null 2>&1 || die "creating the RabbitMQ server key failed"
    printf 'subjectAltName = IP:127.0.0.1, DNS:localhost\n' >"$r/tls/san.ext"
    openssl x509 -req -in "$r/tls/server.csr" -CA "$r/tls/ca.pem" -CAkey "$r/tls/ca.key" -CAcreateserial \
        -days 30 -extfile "$r/tls/san.ext" -out "$r/tls/server.pem" >/dev/null 2>&1 ||
        die "signing the RabbitMQ server certificate failed"
    cat >"$r/rabbitmq.conf" <<EOF
listeners.tcp.1 = 127.0.0.1:$amqp
listeners.ssl.1 = 127.0.0.1:$amqps
ssl_options.cacertfile = $r/tls/ca.pem
ssl_options.certfile = $r/tls/server.pem
ssl_options.keyfile = $r/tls/server.key
ssl_options.verify = verify_none
ssl_options.fail_if_no_peer_cert = false
distribution.listener.interface = 127.0.0.1
distribution.listener.port_range.min = $dist
distribution.listener.port_range.max = $dist
loopback_users = none
log.console = true
log.console.level = warning
log.file = false
EOF
    start epmd epmd -port "$EPMD_PORT" -address 127.0.0.1
    start rabbitmq "${RABBIT_ENV[@]}" RABBITMQ_CONFIG_FILE="$r/rabbitmq.conf" \
        RABBITMQ_ENABLED_PLUGINS_FILE="$r/enabled_plugins" RABBITMQ_MNESIA_BASE="$r/mnesia" \
        RABBITMQ_LOG_BASE="$r/log" RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 RABBITMQ_NODE_PORT="$amqp" \
        RABBITMQ_DIST_PORT="$dist" /usr/lib/rabbitmq/bin/rabbitmq-server
    TRANSPORT_URL="rabbit://openstack:$RABBIT_PASSWORD@127.0.0.1:$amqp/"
    RABBIT_AMQP_PORT="$amqp"
    RABBIT_AMQPS_PORT="$amqps"
}
# Waits for RabbitMQ (it boots while MariaDB and Keystone are set up) and creates the services' user.
ready_rabbitmq() {
    wait_ready rabbitmq rabbitmqctl await_startup
    rabbitmqctl add_user openstack "$RABBIT_PASSWORD" >/dev/null
    rabbitmqctl set_permissions openstack '.*' '.*' '.*' >/dev/null
    envline RABBITMQ_NODE "$RABBIT_NODE"
    envline RABBITMQ_AMQP_PORT "$RABBIT_AMQP_PORT"
    envline RABBITMQ_EPMD_PORT "$EPMD_PORT"
    envline RABBITMQ_AMQPS_PORT "$RABBIT_AMQPS_PORT"
    envline RABBITMQ_CA_FILE "$STATE/rabbitmq/tls/ca.pem"
    envline TRANSPORT_URL "$TRANSPORT_URL"
    envline RABBITMQ_PID "$(pid_of rabbitmq)"
    took "RabbitMQ ready on 127.0.0.1:$RABBIT_AMQP_PORT"
}

# uwsgi_ini NAME PORT MODULE PROCESSES THREADS [PYARGV]: a uWSGI config serving MODULE:application
# over HTTP on 127.0.0.1:PORT.
uwsgi_ini() {
    cat <<EOF
[uwsgi]
http-socket = 127.0.0.1:$2
module = $3:application
master = true
processes = $4
threads = $5
enable-threads = true
# Each worker imports the application itself, after the fork (what the OpenStack services expect).
lazy-apps = true
# SIGTERM stops (uWSGI's default is to reload), and workers never outlive the master.
die-on-term = true
no-orphans = true
need-app = true
buffer-size = 65535
# uWSGI's http-socket closes the connection after each response without saying so; a client that
# pools connections would then send its next request into a closed socket (a reset).
add-header = Connection: close
# Reads the request body even when the app does not, so clients never see a reset.
post-buffering = 1
thunder-lock = true
${6:+pyargv = $6}
EOF
}

# ---------------------------------------------------------------------------------------------
# Keystone.
# ---------------------------------------------------------------------------------------------
start_keystone() {
    local k="$STATE/keystone" venv port url admin_pw user_pw
    venv="$(venv_dir keystone)"
    mkdir -p "$k/fernet-keys" "$k/credential-keys"
    port="$(free_ports 1)"
    url="http://127.0.0.1:$port/v3"
    cat >"$k/keystone.conf" <<EOF
[DEFAULT]
use_stderr = true
[database]
connection = $(create_db keystone)
[token]
provider = fernet
expiration = 3600
[fernet_tokens]
key_repository = $k/fernet-keys
[fernet_receipts]
key_repository = $k/fernet-keys
[credential]
key_repository = $k/credential-keys
[cache]
enabled = false
EOF
    local km=("$venv/bin/keystone-manage" --config-file "$k/keystone.conf")
    migrate keystone keystone "${km[@]}" db_sync
    # The key repositories keystone-manage fernet_setup/credential_setup would make: key 0 is the
    # staged key, the highest number the primary one.
    for d in fernet-keys credential-keys; do
        fernet_key >"$k/$d/0" || die "writing $d"
        fernet_key >"$k/$d/1" || die "writing $d"
        chmod 700 "$k/$d" && chmod 600 "$k/$d/0" "$k/$d/1"
    done
    took "Keystone database ready"
    admin_pw="$(secret)" user_pw="$(secret)"
    "${km[@]}" bootstrap --bootstrap-password "$admin_pw" --bootstrap-username admin \
        --bootstrap-project-name admin --bootstrap-role-name admin --bootstrap-region-id "$REGION" \
        --bootstrap-admin-url "$url" --bootstrap-internal-url "$url" --bootstrap-public-url "$url" \
        >>"$LOGS/keystone-manage.log" 2>&1 || fail "keystone-manage bootstrap failed" "$LOGS/keystone-manage.log"
    uwsgi_ini keystone "$port" keystone.wsgi.api 1 4 >"$k/uwsgi.ini"
    start keystone env OS_KEYSTONE_CONFIG_DIR="$k" "$venv/bin/uwsgi" --ini "$k/uwsgi.ini"
    KEYSTONE_URL="$url" KEYSTONE_ADMIN_PASSWORD="$admin_pw" KEYSTONE_USER_PASSWORD="$user_pw"
}
ready_keystone() {
    wait_ready keystone curl -sf --max-time 5 "$KEYSTONE_URL"
    took "Keystone ready at $KEYSTONE_URL"
}

# Keystone's project, user, application credential and catalog, once the other services' URLs
# are known.
init_keystone() {
    local venv catalog=() out
    venv="$(venv_dir keystone)"
    ((WANT_NEUTRON)) && catalog+=("network=neutron=$NEUTRON_URL")
    ((WANT_OCTAVIA)) && catalog+=("load-balancer=octavia=$OCTAVIA_URL")
    out="$("$venv/bin/python" "$OS_HERE/keystone_init.py" "$KEYSTONE_URL" "$KEYSTONE_ADMIN_PASSWORD" \
        "$KEYSTONE_USER_PASSWORD" "${catalog[@]}" 2>>"$LOGS/keystone-init.log")" ||
        fail "initialising Keystone (keystone_init.py) failed" "$LOGS/keystone-init.log" "$LOGS/keystone.log"
    printf '%s\n' "$out" >>"$STATE/env"
    # shellcheck disable=SC1090 # the KEY=VALUE lines just printed
    source <(printf '%s\n' "$out")
    envline OS_AUTH_URL "$KEYSTONE_URL"
    envline OS_ADMIN_PASSWORD "$KEYSTONE_ADMIN_PASSWORD"
    envline OS_REGION_NAME "$REGION"
    envline KEYSTONE_PID "$(pid_of keystone)"
    took "Keystone initialised (project $OS_PROJECT_NAME, user $OS_USERNAME, application credential)"
}

# shellcheck source=neutron.sh
source "$OS_HERE/neutron.sh"
# shellcheck source=octavia.sh
source "$OS_HERE/octavia.sh"

# Every server is launched as soon as what it needs is there and waited for only when something
# needs it in turn, so that their (CPU-heavy) start-ups overlap with the database migrations.
((WANT_RABBIT)) && start_rabbitmq
start_mariadb
((WANT_KEYSTONE)) && start_keystone
((WANT_RABBIT)) && ready_rabbitmq
((WANT_NEUTRON)) && start_neutron
((WANT_OCTAVIA)) && start_octavia
((WANT_KEYSTONE)) && ready_keystone
((WANT_NEUTRON)) && ready_neutron
((WANT_OCTAVIA)) && ready_octavia
((WANT_KEYSTONE)) && init_keystone
((WANT_NEUTRON)) && init_neutron

# ---------------------------------------------------------------------------------------------
# Outputs.
# ---------------------------------------------------------------------------------------------
umask 077
{
    echo "# Written by tests/env/openstack/up.sh for $STATE"
    echo "clouds:"
    if ((WANT_KEYSTONE)); then
        for cloud in admin kuryr; do
            if [[ $cloud == admin ]]; then u=admin p="$KEYSTONE_ADMIN_PASSWORD" proj=admin; else
                u="$OS_USERNAME" p="$OS_PASSWORD" proj="$OS_PROJECT_NAME"; fi
            cat <<EOF
  $cloud:
    auth_type: password
    auth:
      auth_url: $KEYSTONE_URL
      username: $u
      password: $p
      project_name: $proj
      user_domain_name: Default
      project_domain_name: Default
    region_name: $REGION
    interface: public
    identity_api_version: 3
EOF
        done
        cat <<EOF
  kuryr-appcred:
    auth_type: v3applicationcredential
    auth:
      auth_url: $KEYSTONE_URL
      application_credential_id: $OS_APPLICATION_CREDENTIAL_ID
      application_credential_secret: $OS_APPLICATION_CREDENTIAL_SECRET
    region_name: $REGION
    interface: public
    identity_api_version: 3
EOF
    fi
    if ((WANT_NEUTRON | WANT_OCTAVIA)); then
        echo "  noauth:"
        echo "    auth_type: none"
        ((WANT_NEUTRON)) && echo "    network_endpoint_override: $NEUTRON_URL"
        ((WANT_OCTAVIA)) && echo "    load_balancer_endpoint_override: $OCTAVIA_URL"
        echo "    region_name: $REGION"
    fi
} >"$STATE/clouds.yaml"
envline OS_CLIENT_CONFIG_FILE "$STATE/clouds.yaml"
if ((WANT_KEYSTONE)); then
    cat >"$STATE/openrc" <<EOF
export OS_AUTH_URL=$KEYSTONE_URL
export OS_AUTH_TYPE=password
export OS_IDENTITY_API_VERSION=3
export OS_USERNAME=$OS_USERNAME
export OS_PASSWORD=$OS_PASSWORD
export OS_PROJECT_NAME=$OS_PROJECT_NAME
export OS_USER_DOMAIN_NAME=Default
export OS_PROJECT_DOMAIN_NAME=Default
export OS_REGION_NAME=$REGION
EOF
fi

if [[ -n "${OS_UP_OWNER_PID:-}" ]]; then
    purge=--purge
    [[ "${KURYR_KEEP_STATE:-}" == 1 ]] && purge=
    # shellcheck disable=SC2016 # expanded by the inner bash, from its arguments
    start watchdog bash -c 'while kill -0 "$1" 2>/dev/null; do sleep 1; done
        exec bash "$2" "$3" ${4:+"$4"}' watchdog "$OS_UP_OWNER_PID" "$OS_HERE/down.sh" "$STATE" "$purge"
    envline WATCHDOG_PID "$(pid_of watchdog)"
fi
envline STATE_DIR "$STATE"
ok=1
log "up in $((SECONDS - t_start))s: $*; env in $STATE/env"
