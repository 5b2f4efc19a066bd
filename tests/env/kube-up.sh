#!/usr/bin/env bash
# Starts a real Kubernetes control plane for tests: etcd and kube-apiserver on 127.0.0.1, with all
# state under STATE_DIR and ports chosen free at start (several test binaries run at once).
#
#   kube-up.sh STATE_DIR
#
# Writes:
#   STATE_DIR/kubeconfig   admin credentials (client certificate, O=system:masters), certs inlined
#   STATE_DIR/env          KEY=VALUE lines: KUBECONFIG, KUBE_APISERVER_URL, KUBE_CA_FILE, ETCD_URL,
#                          ETCD_PID, APISERVER_PID, WATCHDOG_PID, ...
#   STATE_DIR/pki/         CA, serving and client certificates, service-account signing key
#   STATE_DIR/logs/        etcd.log, kube-apiserver.log, watchdog.log
#   STATE_DIR/pids/        one pid file per process started; kube-down.sh stops exactly these
#
# The cluster has no kube-controller-manager, scheduler or kubelet. What the apiserver does by
# itself is there: the namespaces default, kube-system, kube-public and kube-node-lease, the
# `kubernetes` Service, the bootstrap RBAC roles and priority classes. What controllers would do is
# not: no `default` ServiceAccount per namespace (so the ServiceAccount admission plugin, which
# rejects pods whose service account does not exist, is disabled), no garbage collection of
# dependents, a deleted namespace stays Terminating, and the aggregated ClusterRoles `admin`,
# `edit` and `view` have no rules (aggregation is a controller too): grant with explicit Roles, or
# bind `system:aggregate-to-view` and friends. Pods are never scheduled or run; set spec.nodeName
# and nothing will complain.
#
# Environment:
#   KURYR_TOOLS_DIR       where tools.sh installs kube-apiserver and etcd (built if missing)
#   KUBE_UP_OWNER_PID     if set, a watchdog stops everything (kube-down.sh --purge, unless
#                         KURYR_KEEP_STATE=1) once that process is gone: a test binary killed
#                         before its destructors run does not leave servers behind
#   KUBE_UP_TIMEOUT       seconds to wait for each server to become ready (default 120)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TOOLS_DIR="${KURYR_TOOLS_DIR:-/var/cache/kuryr-rs/bin}"
TIMEOUT="${KUBE_UP_TIMEOUT:-120}"
# Addresses handed out to Services inside the API only; nothing routes them.
SERVICE_CIDR=10.96.0.0/16
KUBERNETES_SERVICE_IP=10.96.0.1

# shellcheck source=lib.sh
source "$HERE/lib.sh"
log() { printf 'kube-up.sh: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[[ $# -eq 1 ]] || die "usage: kube-up.sh STATE_DIR"
mkdir -p "$1" || die "cannot create state dir $1"
STATE="$(cd "$1" && pwd)"
PKI="$STATE/pki" LOGS="$STATE/logs" PIDS="$STATE/pids"

for cmd in openssl curl python3 base64 setsid; do
    command -v "$cmd" >/dev/null || die "'$cmd' is required but not on PATH"
done
if [[ ! -x "$TOOLS_DIR/kube-apiserver" || ! -x "$TOOLS_DIR/etcd" ]]; then
    log "kube-apiserver or etcd missing in $TOOLS_DIR; building them with tools.sh"
    bash "$HERE/tools.sh" kube-apiserver etcd || die "tools.sh could not build kube-apiserver/etcd"
fi
[[ -f "$PIDS/etcd.pid" || -f "$PIDS/kube-apiserver.pid" ]] &&
    die "$STATE already has running servers (pids/); run kube-down.sh $STATE first"
mkdir -p "$PKI" "$LOGS" "$PIDS"

# On any failure: show what the servers said and stop whatever this script started.
stop_on_failure 40 bash "$HERE/kube-down.sh" "$STATE"

# ---------------------------------------------------------------------------------------------
# Certificates. ECDSA P-256 keys: generated instantly, accepted by kube-apiserver, kubectl and
# rustls alike.
# ---------------------------------------------------------------------------------------------
gen_key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

# sign NAME SUBJECT EXTENSIONS: a leaf certificate NAME.crt for key NAME.key signed by the CA.
sign() {
    local name="$1" subj="$2" ext="$3"
    gen_key "$PKI/$name.key"
    openssl req -new -key "$PKI/$name.key" -subj "$subj" -out "$PKI/$name.csr" 2>/dev/null
    printf '%s\n' "$ext" >"$PKI/$name.ext"
    openssl x509 -req -in "$PKI/$name.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" \
        -CAcreateserial -days 365 -sha256 -extfile "$PKI/$name.ext" -out "$PKI/$name.crt" 2>/dev/null
    rm -f "$PKI/$name.csr" "$PKI/$name.ext"
}

make_pki() {
    gen_key "$PKI/ca.key"
    openssl req -x509 -new -key "$PKI/ca.key" -sha256 -days 3650 -subj "/CN=kuryr-test-ca" \
        -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" \
        -out "$PKI/ca.crt" 2>/dev/null
    sign apiserver "/CN=kube-apiserver" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,IP:$KUBERNETES_SERVICE_IP,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
    sign admin "/O=system:masters/CN=kubernetes-admin" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
    # Service-account tokens are signed with this key and verified with its public half.
    gen_key "$PKI/sa.key"
    openssl pkey -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub" 2>/dev/null
    chmod 600 "$PKI"/*.key
}
make_pki || die "generating certificates with openssl failed"

# ---------------------------------------------------------------------------------------------
# Processes.
# ---------------------------------------------------------------------------------------------

# start NAME ARGS...: runs a server detached (own session, stdio to its log) and records its pid.
start() {
    local name="$1"
    shift
    setsid "$@" </dev/null >"$LOGS/$name.log" 2>&1 &
    echo $! >"$PIDS/$name.pid"
}

stop_one() { # used between retries; kube-down.sh does the same for the whole set
    local name="$1" pid
    [[ -f "$PIDS/$name.pid" ]] || return 0
    pid="$(cat "$PIDS/$name.pid")"
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do alive "$pid" || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$PIDS/$name.pid"
}

# wait_ready NAME PID CHECK...: polls CHECK until it succeeds, the process dies or time runs out.
# Returns 0 when ready, 2 when the process died with a port conflict, 1 otherwise.
wait_ready() {
    local name="$1" pid="$2" deadline=$((SECONDS + TIMEOUT))
    shift 2
    while ((SECONDS < deadline)); do
        if ! alive "$pid"; then
            grep -qiE 'address already in use|bind: ' "$LOGS/$name.log" && return 2
            log "$name (pid $pid) exited during startup"
            return 1
        fi
        "$@" >/dev/null 2>&1 && return 0
        sleep 0.2
    done
    log "$name not ready after ${TIMEOUT}s"
    return 1
}

# Ports are free when picked but another process may take them before the server binds; a bind
# failure is retried with fresh ports.
start_etcd() {
    local attempt rc client peer
    for attempt in 1 2 3; do
        read -r client peer <<<"$(free_ports 2)"
        ETCD_URL="http://127.0.0.1:$client"
        # Plain HTTP on loopback: only this machine's processes can reach it, and the apiserver is
        # its only client. --unsafe-no-fsync: test data, and fsync dominates latency on a busy disk.
        start etcd "$TOOLS_DIR/etcd" \
            --name=default \
            --data-dir="$STATE/etcd" \
            --listen-client-urls="$ETCD_URL" \
            --advertise-client-urls="$ETCD_URL" \
            --listen-peer-urls="http://127.0.0.1:$peer" \
            --initial-advertise-peer-urls="http://127.0.0.1:$peer" \
            --initial-cluster="default=http://127.0.0.1:$peer" \
            --initial-cluster-state=new \
            --unsafe-no-fsync=true \
            --log-level=warn
        ETCD_PID="$(cat "$PIDS/etcd.pid")"
        rc=0
        wait_ready etcd "$ETCD_PID" curl -sf --max-time 2 "$ETCD_URL/health" || rc=$?
        [[ $rc -eq 0 ]] && return 0
        stop_one etcd
        [[ $rc -eq 2 ]] || return 1
        log "etcd: port conflict on attempt $attempt, retrying with other ports"
        rm -rf "$STATE/etcd"
    done
    return 1
}

apiserver_ready() {
    curl -sf --max-time 3 --cacert "$PKI/ca.crt" --cert "$PKI/admin.crt" --key "$PKI/admin.key" \
        "$KUBE_APISERVER_URL/readyz"
}

start_apiserver() {
    local attempt rc port
    for attempt in 1 2 3; do
        port="$(free_ports 1)"
        KUBE_APISERVER_URL="https://127.0.0.1:$port"
        # --advertise-address: otherwise the apiserver looks for a default route's address.
        # --endpoint-reconciler-type=none: the `kubernetes` Service's endpoints would be 127.0.0.1,
        #   which Endpoints validation rejects (loopback); nothing in the tests reaches it anyway.
        # ServiceAccount admission off: no controller creates the `default` ServiceAccount.
        # --allow-privileged: the CNI daemon pods of a real deployment are privileged.
        start kube-apiserver "$TOOLS_DIR/kube-apiserver" \
            --bind-address=127.0.0.1 \
            --advertise-address=127.0.0.1 \
            --secure-port="$port" \
            --cert-dir="$PKI" \
            --tls-cert-file="$PKI/apiserver.crt" \
            --tls-private-key-file="$PKI/apiserver.key" \
            --client-ca-file="$PKI/ca.crt" \
            --etcd-servers="$ETCD_URL" \
            --authorization-mode=Node,RBAC \
            --service-account-issuer="$KUBE_APISERVER_URL" \
            --service-account-key-file="$PKI/sa.pub" \
            --service-account-signing-key-file="$PKI/sa.key" \
            --service-cluster-ip-range="$SERVICE_CIDR" \
            --endpoint-reconciler-type=none \
            --disable-admission-plugins=ServiceAccount \
            --allow-privileged=true \
            --profiling=false \
            --v=1
        APISERVER_PID="$(cat "$PIDS/kube-apiserver.pid")"
        rc=0
        wait_ready kube-apiserver "$APISERVER_PID" apiserver_ready || rc=$?
        [[ $rc -eq 0 ]] && return 0
        stop_one kube-apiserver
        [[ $rc -eq 2 ]] || return 1
        log "kube-apiserver: port conflict on attempt $attempt, retrying with another port"
    done
    return 1
}

t0=$SECONDS
start_etcd || die "etcd did not start (log: $LOGS/etcd.log)"
log "etcd ready at $ETCD_URL (pid $ETCD_PID) after $((SECONDS - t0))s"
start_apiserver || die "kube-apiserver did not start (log: $LOGS/kube-apiserver.log)"
log "kube-apiserver ready at $KUBE_APISERVER_URL (pid $APISERVER_PID) after $((SECONDS - t0))s"

# ---------------------------------------------------------------------------------------------
# Outputs.
# ---------------------------------------------------------------------------------------------
b64() { base64 -w0 <"$1"; }
umask 077
cat >"$STATE/kubeconfig.tmp" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: kuryr-test
  cluster:
    server: $KUBE_APISERVER_URL
    certificate-authority-data: $(b64 "$PKI/ca.crt")
users:
- name: admin
  user:
    client-certificate-data: $(b64 "$PKI/admin.crt")
    client-key-data: $(b64 "$PKI/admin.key")
contexts:
- name: admin@kuryr-test
  context:
    cluster: kuryr-test
    user: admin
current-context: admin@kuryr-test
EOF
mv "$STATE/kubeconfig.tmp" "$STATE/kubeconfig"

WATCHDOG_PID=
if [[ -n "${KUBE_UP_OWNER_PID:-}" ]]; then
    purge=--purge
    [[ "${KURYR_KEEP_STATE:-}" == 1 ]] && purge=
    # Polls once a second; the state dir is on its command line so kube-down.sh can verify it.
    # shellcheck disable=SC2016 # expanded by the inner bash, from its arguments
    start watchdog bash -c 'while kill -0 "$1" 2>/dev/null; do sleep 1; done
        exec bash "$2" "$3" ${4:+"$4"}' watchdog "$KUBE_UP_OWNER_PID" "$HERE/kube-down.sh" "$STATE" "$purge"
    WATCHDOG_PID="$(cat "$PIDS/watchdog.pid")"
fi

cat >"$STATE/env.tmp" <<EOF
STATE_DIR=$STATE
KUBECONFIG=$STATE/kubeconfig
KUBE_APISERVER_URL=$KUBE_APISERVER_URL
KUBE_CA_FILE=$PKI/ca.crt
KUBE_SERVICE_CIDR=$SERVICE_CIDR
KUBE_SA_ISSUER=$KUBE_APISERVER_URL
ETCD_URL=$ETCD_URL
ETCD_PID=$ETCD_PID
APISERVER_PID=$APISERVER_PID
WATCHDOG_PID=$WATCHDOG_PID
EOF
mv "$STATE/env.tmp" "$STATE/env"
ok=1
log "up in $((SECONDS - t0))s; KUBECONFIG=$STATE/kubeconfig"
