# shellcheck shell=bash disable=SC2034
# Octavia for up.sh (sourced): the API under uWSGI and octavia-worker over RabbitMQ, provider
# `amphora` with the no-op compute, network, amphora, volume and image drivers. The worker runs its
# real flows (database states, the certificate generator, the provisioning status machine); only
# the calls that would boot VMs or touch Neutron are no-ops. The no-op *provider* is not used: its
# load balancers never leave PENDING_CREATE.
#
# Uses from up.sh: STATE LOGS TRANSPORT_URL, start/wait_ready/fail/envline/took/create_db/migrate/
# uwsgi_ini/rabbitmqctl.

# The worker declares its queue when it starts consuming; an RPC cast sent before that is dropped
# silently, so the API is only handed out once the queue has a consumer.
OCTAVIA_QUEUE=octavia_provisioning_v2
octavia_consuming() {
    rabbitmqctl list_queues name consumers 2>/dev/null | awk -v q="$OCTAVIA_QUEUE" '$1 == q && $2 > 0 { found = 1 } END { exit !found }'
}

start_octavia() {
    local o="$STATE/octavia" venv port
    venv="$(venv_dir octavia)"
    mkdir -p "$o/ca" "$o/lock"
    port="$(free_ports 1)"
    OCTAVIA_URL="http://127.0.0.1:$port"
    # The CA that would sign the amphorae's certificates; the local generator really signs with it.
    openssl req -x509 -newkey rsa:2048 -nodes -days 365 -subj "/CN=kuryr-test-octavia-ca" \
        -keyout "$o/ca/ca.key" -out "$o/ca/ca.pem" >/dev/null 2>&1 || die "creating Octavia's CA failed"
    cat >"$o/octavia.conf" <<EOF
[DEFAULT]
transport_url = $TRANSPORT_URL
use_stderr = true
[api_settings]
bind_host = 127.0.0.1
bind_port = $port
auth_strategy = noauth
default_provider_driver = amphora
[database]
connection = $(create_db octavia)
[controller_worker]
amphora_driver = amphora_noop_driver
compute_driver = compute_noop_driver
network_driver = network_noop_driver
volume_driver = volume_noop_driver
image_driver = image_noop_driver
loadbalancer_topology = SINGLE
client_ca = $o/ca/ca.pem
workers = 1
[certificates]
cert_generator = local_cert_generator
ca_certificate = $o/ca/ca.pem
ca_private_key = $o/ca/ca.key
cert_manager = noop_cert_manager
[haproxy_amphora]
server_ca = $o/ca/ca.pem
client_cert = $o/ca/ca.pem
[task_flow]
jobboard_enabled = False
[oslo_concurrency]
lock_path = $o/lock
[oslo_messaging]
topic = octavia_prov
EOF
    migrate octavia octavia "$venv/bin/octavia-db-manage" --config-file "$o/octavia.conf" upgrade head
    took "Octavia database ready"
    uwsgi_ini octavia "$port" octavia.wsgi.api 1 4 "--config-file $o/octavia.conf" >"$o/uwsgi.ini"
    start octavia-api "$venv/bin/uwsgi" --ini "$o/uwsgi.ini"
    start octavia-worker "$venv/bin/octavia-worker" --config-file "$o/octavia.conf"
}
ready_octavia() {
    wait_ready octavia-api curl -sf --max-time 5 "$OCTAVIA_URL/"
    took "Octavia API ready at $OCTAVIA_URL"
    wait_ready octavia-worker octavia_consuming
    took "Octavia worker consuming $OCTAVIA_QUEUE"
    envline OCTAVIA_URL "$OCTAVIA_URL"
    envline OCTAVIA_API_PID "$(pid_of octavia-api)"
    envline OCTAVIA_WORKER_PID "$(pid_of octavia-worker)"
}
