#!/usr/bin/env bash
# Starts a Kubernetes cluster of real nodes on this machine, for the lab, the end-to-end suites and
# the upstream conformance tests:
#
#   up.sh STATE_DIR
#
# Every node is a network namespace plus a mount namespace of its own, running containerd and a
# real kubelet (Kubernetes v1.34.4 from tests/env/tools.sh; cgroupfs driver, cgroup v1). The nodes
# are plugged into an underlay: one more network namespace holding a bridge. The first node is
# also the control plane: etcd, kube-apiserver, kube-controller-manager and kube-scheduler run in
# its network namespace (as kubeadm puts them on a control-plane node), so the API server reaches
# kubelets and pods the way it would on a real cluster. Nothing listens or routes in the host's own
# network namespace, and the host's network configuration is never changed.
#
# A node's mount namespace gives it the paths a real node has, private to it: /etc/cni/net.d,
# /opt/cni/bin, /run/kuryr, /var/lib/cni, /var/lib/kuryr, /var/lib/kubelet and /var/log are bind
# mounts of the node's own directories (the host gets empty mount points at those paths, nothing
# else). kubelet binds its device-plugin socket at a fixed path,
# /var/lib/kubelet/device-plugins/kubelet.sock, whatever --root-dir says: shared, two kubelets
# starting together race for it and one exits. /var/lib/cni holds the runtime's cache of CNI
# results, which a cluster stopped with its pods still running would otherwise leave on the host.
# A network plugin is therefore installed exactly as on a real cluster — `kubectl apply -k
# deploy/overlays/embedded` — with hostPath volumes at their usual paths. Pod network namespaces,
# container root filesystems and volumes are mounted inside the node's mount namespace only, and go
# away with it.
#
# No kube-proxy: the network plugin under test is the Service dataplane too. With CLUSTER_CNI=none
# (the default) the nodes stay NotReady until a plugin writes its CNI configuration; with
# CLUSTER_CNI=bridge every node gets the reference plugins (bridge + host-local + portmap, a /24
# per node routed over the underlay), which is the peer kuryr is measured against.
#
# Environment:
#   CLUSTER_NODES        number of nodes (default 2; the first is the control plane)
#   CLUSTER_ID           1..250: distinguishes concurrent clusters in names and addresses
#                        (netns kr<ID>-n<i>, kr<ID>-ul; underlay 172.28.<ID>.0/24, fd00:172:28:<ID>::/64)
#                        (default: derived from this shell's pid)
#   CLUSTER_NODE_PREFIX  node names <prefix>-1, -2, ... (default node)
#   CLUSTER_CNI          none | bridge (default none)
#   CLUSTER_IMAGES       OCI image-layout tars imported into every node's containerd (space
#                        separated); must include the sandbox image
#   CLUSTER_SANDBOX_IMAGE the pod sandbox image (default registry.k8s.io/pause:3.10.1)
#   CLUSTER_OWNER_PID    if set, a watchdog runs down.sh --purge once that process is gone, so
#                        that a test killed before its clean-up leaves nothing behind
#   KURYR_TOOLS_DIR      where tools.sh installed the Kubernetes binaries
#   CLUSTER_TIMEOUT      seconds to wait for each component (default 180)
#   CLUSTER_PROFILING    true: the API server serves /debug/pprof (to cluster-admin clients), for
#                        profiling it under a benchmark (default false)
#
# Writes STATE_DIR/env (KEY=VALUE): KUBECONFIG (admin; the server is the control-plane node's
# underlay address, reachable from inside the nodes' namespaces), APISERVER_HOST, APISERVER_PORT,
# NODES (names), and per node i: NODE<i>_NAME, NODE<i>_IP4, NODE<i>_IP6, NODE<i>_NETNS,
# NODE<i>_MOUNTNS (a file to pass to nsenter --mount), NODE<i>_CONTAINERD (socket), NODE<i>_DIR.
# down.sh STATE_DIR stops everything and removes every trace.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TOOLS="${KURYR_TOOLS_DIR:-/var/cache/kuryr-rs/bin}"
NODES="${CLUSTER_NODES:-2}"
ID="${CLUSTER_ID:-$(($$ % 200 + 20))}"
PREFIX="${CLUSTER_NODE_PREFIX:-node}"
CNI="${CLUSTER_CNI:-none}"
SANDBOX_IMAGE="${CLUSTER_SANDBOX_IMAGE:-registry.k8s.io/pause:3.10.1}"
TIMEOUT="${CLUSTER_TIMEOUT:-180}"
SERVICE_CIDR=10.96.0.0/16
KUBERNETES_SERVICE_IP=10.96.0.1
CLUSTER_DNS=10.96.0.10
APISERVER_PORT=6443
# The paths a node has privately (see the header).
NODE_PATHS=(etc/cni/net.d opt/cni/bin run/kuryr var/lib/cni var/lib/kuryr var/lib/kubelet var/log)
CGROUP_CONTROLLERS=(cpu cpuacct cpuset memory pids blkio devices freezer systemd)

# shellcheck source=../lib.sh
source "$HERE/../lib.sh"
log() { printf 'cluster/up.sh: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[[ $# -eq 1 ]] || die "usage: up.sh STATE_DIR"
[[ "$ID" =~ ^[0-9]+$ && "$ID" -ge 1 && "$ID" -le 250 ]] || die "CLUSTER_ID must be 1..250, not '$ID'"
[[ "$NODES" =~ ^[0-9]+$ && "$NODES" -ge 1 && "$NODES" -le 9 ]] || die "CLUSTER_NODES must be 1..9, not '$NODES'"
[[ "$CNI" == none || "$CNI" == bridge ]] || die "CLUSTER_CNI must be none or bridge, not '$CNI'"
for t in etcd kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl; do
    [[ -x "$TOOLS/$t" ]] || die "$TOOLS/$t is missing: run tests/env/tools.sh (make tools)"
done
for c in containerd ctr runc openssl curl unshare nsenter setsid; do
    command -v "$c" >/dev/null || die "'$c' is required but not on PATH (make setup)"
done
mkdir -p "$1"
S="$(cd "$1" && pwd)"
[[ ! -f "$S/env" ]] || die "$S already holds a cluster; run down.sh $S first"
# Unix socket paths are limited to 107 bytes.
((${#S} < 60)) || die "STATE_DIR '$S' is too long for the sockets inside it"
PKI="$S/pki" LOGS="$S/logs" PIDS="$S/pids"
mkdir -p "$PKI" "$LOGS" "$PIDS" "$S/ns" "$S/nodes"
NS_PREFIX="kr$ID"
UNDERLAY="$NS_PREFIX-ul"
ip4() { echo "172.28.$ID.$((10 + $1))"; }
ip6() { echo "fd00:172:28:$ID::$((10 + $1))"; }
CP_IP="$(ip4 1)"

# Recorded first, so that down.sh can undo a start that fails halfway.
{
    echo "STATE_DIR=$S"
    echo "CLUSTER_ID=$ID"
    echo "NS_PREFIX=$NS_PREFIX"
    echo "NODE_COUNT=$NODES"
} >"$S/partial.env"

stop_on_failure 30 bash "$HERE/down.sh" "$S"

# start NAME NETNS MOUNTNS CMD...: a server detached in its own session, niced (the machine is
# small and the tests share it), inside the node's namespaces; its pid recorded for down.sh.
start() {
    local name="$1" netns="$2" mntns="$3"
    shift 3
    local enter=(nsenter "--net=/var/run/netns/$netns")
    [[ -n "$mntns" ]] && enter+=("--mount=$mntns")
    setsid nice -n 5 "${enter[@]}" "$@" </dev/null >"$LOGS/$name.log" 2>&1 &
    echo $! >"$PIDS/$name.pid"
}
# wait_for WHAT PIDNAME CMD...: polls CMD until it succeeds; fails when the process died or time ran out.
wait_for() {
    local what="$1" pidname="$2" deadline=$((SECONDS + TIMEOUT)) pid
    shift 2
    pid="$(cat "$PIDS/$pidname.pid" 2>/dev/null || echo 0)"
    FAILED_LOG="$LOGS/$pidname.log" # shown first if this wait fails
    until "$@" >/dev/null 2>&1; do
        alive "$pid" || die "$what exited during start (log: $FAILED_LOG)"
        ((SECONDS < deadline)) || die "$what not ready after ${TIMEOUT}s (log: $FAILED_LOG)"
        sleep 0.2
    done
    FAILED_LOG=""
}
in_netns() { local ns="$1"; shift; nsenter "--net=/var/run/netns/$ns" "$@"; }

t0=$SECONDS

# ---------------------------------------------------------------------------------------------
# Underlay and nodes' network namespaces.
# ---------------------------------------------------------------------------------------------
ip netns add "$UNDERLAY"
echo "UNDERLAY_NETNS=$UNDERLAY" >>"$S/partial.env"
ip -n "$UNDERLAY" link set lo up
ip -n "$UNDERLAY" link add br0 type bridge
in_netns "$UNDERLAY" sysctl -qw net.ipv6.conf.br0.disable_ipv6=1
ip -n "$UNDERLAY" link set br0 up
for i in $(seq "$NODES"); do
    ns="$NS_PREFIX-n$i"
    ip netns add "$ns"
    echo "NODE${i}_NETNS=$ns" >>"$S/partial.env"
    ip -n "$ns" link set lo up
    ip -n "$UNDERLAY" link add "n$i" type veth peer name eth0 netns "$ns"
    ip -n "$UNDERLAY" link set "n$i" master br0 up
    ip -n "$ns" addr add "$(ip4 "$i")/24" dev eth0
    ip -n "$ns" addr add "$(ip6 "$i")/64" dev eth0 nodad
    ip -n "$ns" link set eth0 up
    # The underlay is the nodes' only network: its bridge is their default gateway's segment. No
    # address answers there (no traffic leaves these namespaces); the routes only give every
    # address family a default route, which kubelet and the API server look for.
    ip -n "$ns" route add default dev eth0
    ip -n "$ns" -6 route add default dev eth0
    in_netns "$ns" sysctl -qw net.ipv4.ip_forward=1 net.ipv6.conf.all.forwarding=1
done

# ---------------------------------------------------------------------------------------------
# Nodes' mount namespaces (see the header): each pinned by a bind mount of its nsfs file under
# $S/ns, which is a private mount so that the pins do not propagate into the namespaces.
# ---------------------------------------------------------------------------------------------
mount --bind "$S/ns" "$S/ns"
mount --make-private "$S/ns"
echo "MOUNTS=$S/ns" >>"$S/partial.env"
for p in "${NODE_PATHS[@]}"; do mkdir -p "/$p"; done
for i in $(seq "$NODES"); do
    d="$S/nodes/$PREFIX-$i"
    mkdir -p "$d/containerd" "$d/kubelet"
    for p in "${NODE_PATHS[@]}"; do mkdir -p "$d/root/$p"; done
    touch "$S/ns/$PREFIX-$i.mnt"
    # slave: what the host mounts later is not needed here, and nothing mounted here reaches
    # the host; rshared inside, so that containers' HostToContainer volumes (the CNI daemon's
    # view of /var/run/netns) see the pod namespaces containerd mounts.
    unshare --mount="$S/ns/$PREFIX-$i.mnt" --propagation slave bash -c '
        set -e
        mount --make-rshared /
        d="$1"; shift
        for p in "$@"; do mount --bind "$d/root/$p" "/$p"; done' bash "$d" "${NODE_PATHS[@]}"
    echo "NODE${i}_MOUNTNS=$S/ns/$PREFIX-$i.mnt" >>"$S/partial.env"
    cp -f /usr/lib/cni/loopback "$d/root/opt/cni/bin/loopback"
done

# ---------------------------------------------------------------------------------------------
# Certificates (ECDSA P-256).
# ---------------------------------------------------------------------------------------------
gen_key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }
sign() { # NAME SUBJECT EXTENSIONS
    gen_key "$PKI/$1.key"
    openssl req -new -key "$PKI/$1.key" -subj "$2" -out "$PKI/$1.csr" 2>/dev/null
    printf '%s\n' "$3" >"$PKI/$1.ext"
    openssl x509 -req -in "$PKI/$1.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial \
        -days 30 -sha256 -extfile "$PKI/$1.ext" -out "$PKI/$1.crt" 2>/dev/null
    rm -f "$PKI/$1.csr" "$PKI/$1.ext"
}
CLIENT_EXT="basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
gen_key "$PKI/ca.key"
openssl req -x509 -new -key "$PKI/ca.key" -sha256 -days 30 -subj "/CN=kuryr-cluster-ca" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" \
    -out "$PKI/ca.crt" 2>/dev/null
# 127.0.0.1 too: the host reaches the API server through a local forwarder (the harness's).
sign apiserver "/CN=kube-apiserver" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,IP:$CP_IP,IP:$KUBERNETES_SERVICE_IP,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
sign admin "/O=system:masters/CN=kubernetes-admin" "$CLIENT_EXT"
sign apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" "$CLIENT_EXT"
sign controller-manager "/CN=system:kube-controller-manager" "$CLIENT_EXT"
sign scheduler "/CN=system:kube-scheduler" "$CLIENT_EXT"
for i in $(seq "$NODES"); do sign "kubelet-$i" "/O=system:nodes/CN=system:node:$PREFIX-$i" "$CLIENT_EXT"; done
gen_key "$PKI/sa.key"
openssl pkey -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub" 2>/dev/null
chmod 600 "$PKI"/*.key

kubeconfig() { # FILE CERTNAME SERVER
    local b64
    b64() { base64 -w0 <"$1"; }
    umask 077
    cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: kuryr
  cluster: {server: "$3", certificate-authority-data: "$(b64 "$PKI/ca.crt")"}
users:
- name: u
  user: {client-certificate-data: "$(b64 "$PKI/$2.crt")", client-key-data: "$(b64 "$PKI/$2.key")"}
contexts:
- name: kuryr
  context: {cluster: kuryr, user: u}
current-context: kuryr
EOF
    umask 022
}
API="https://$CP_IP:$APISERVER_PORT"
kubeconfig "$S/admin.kubeconfig" admin "$API"
kubeconfig "$S/controller-manager.kubeconfig" controller-manager "$API"
kubeconfig "$S/scheduler.kubeconfig" scheduler "$API"
for i in $(seq "$NODES"); do kubeconfig "$S/nodes/$PREFIX-$i/kubelet.kubeconfig" "kubelet-$i" "$API"; done

# ---------------------------------------------------------------------------------------------
# containerd on every node (started now: importing the images overlaps the control plane's start).
# ---------------------------------------------------------------------------------------------
import_pids=()
for i in $(seq "$NODES"); do
    d="$S/nodes/$PREFIX-$i"
    # The node's own CNI paths, as on any node (bind mounts of the node's directories, see above).
    containerd_config "$d/containerd" "$d/containerd.sock" "$SANDBOX_IMAGE" /opt/cni/bin /etc/cni/net.d \
        >"$d/containerd.toml"
    start "containerd-$i" "$NS_PREFIX-n$i" "$S/ns/$PREFIX-$i.mnt" containerd --config "$d/containerd.toml"
    (
        wait_for "containerd on $PREFIX-$i" "containerd-$i" ctr --address "$d/containerd.sock" --timeout 2s version
        for tar in ${CLUSTER_IMAGES:-}; do
            ctr --address "$d/containerd.sock" -n k8s.io images import --snapshotter overlayfs "$tar" \
                >>"$LOGS/import-$i.log" 2>&1 || die "importing $tar into $PREFIX-$i failed (log: $LOGS/import-$i.log)"
        done
    ) &
    import_pids+=($!)
done

# ---------------------------------------------------------------------------------------------
# Control plane, in the first node's network namespace.
# ---------------------------------------------------------------------------------------------
CP_NS="$NS_PREFIX-n1"
# Plain HTTP on the control-plane node's loopback: the API server is etcd's only client.
start etcd "$CP_NS" "" "$TOOLS/etcd" --name=default --data-dir="$S/etcd" \
    --listen-client-urls=http://127.0.0.1:2379 --advertise-client-urls=http://127.0.0.1:2379 \
    --listen-peer-urls=http://127.0.0.1:2380 --initial-advertise-peer-urls=http://127.0.0.1:2380 \
    --initial-cluster=default=http://127.0.0.1:2380 --initial-cluster-state=new \
    --unsafe-no-fsync=true --log-level=warn
wait_for etcd etcd in_netns "$CP_NS" curl -sf --max-time 2 http://127.0.0.1:2379/health

# --kubelet-preferred-address-types: reach kubelets (exec, logs, port-forward) by their InternalIP,
#   never by resolving node names through the host's DNS.
start kube-apiserver "$CP_NS" "" "$TOOLS/kube-apiserver" --bind-address=0.0.0.0 \
    --advertise-address="$CP_IP" --secure-port="$APISERVER_PORT" --cert-dir="$PKI" \
    --tls-cert-file="$PKI/apiserver.crt" --tls-private-key-file="$PKI/apiserver.key" \
    --client-ca-file="$PKI/ca.crt" --etcd-servers=http://127.0.0.1:2379 \
    --authorization-mode=Node,RBAC --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-account-key-file="$PKI/sa.pub" --service-account-signing-key-file="$PKI/sa.key" \
    --service-cluster-ip-range="$SERVICE_CIDR" --allow-privileged=true \
    --kubelet-client-certificate="$PKI/apiserver-kubelet-client.crt" \
    --kubelet-client-key="$PKI/apiserver-kubelet-client.key" \
    --kubelet-preferred-address-types=InternalIP,Hostname --profiling="${CLUSTER_PROFILING:-false}" --v=1
wait_for kube-apiserver kube-apiserver in_netns "$CP_NS" curl -sf --max-time 3 --cacert "$PKI/ca.crt" \
    --cert "$PKI/admin.crt" --key "$PKI/admin.key" "$API/readyz"

start kube-controller-manager "$CP_NS" "" "$TOOLS/kube-controller-manager" \
    --kubeconfig="$S/controller-manager.kubeconfig" \
    --authentication-kubeconfig="$S/controller-manager.kubeconfig" \
    --authorization-kubeconfig="$S/controller-manager.kubeconfig" \
    --bind-address=127.0.0.1 --leader-elect=false --use-service-account-credentials=true \
    --service-account-private-key-file="$PKI/sa.key" --root-ca-file="$PKI/ca.crt" \
    --cluster-signing-cert-file="$PKI/ca.crt" --cluster-signing-key-file="$PKI/ca.key" \
    --service-cluster-ip-range="$SERVICE_CIDR" --v=1
start kube-scheduler "$CP_NS" "" "$TOOLS/kube-scheduler" --kubeconfig="$S/scheduler.kubeconfig" \
    --authentication-kubeconfig="$S/scheduler.kubeconfig" --authorization-kubeconfig="$S/scheduler.kubeconfig" \
    --bind-address=127.0.0.1 --leader-elect=false --v=1
log "control plane up on $CP_IP after $((SECONDS - t0))s"

for p in "${import_pids[@]}"; do wait "$p" || die "a node's containerd did not come up"; done
log "containerd and images ready on every node after $((SECONDS - t0))s"

# ---------------------------------------------------------------------------------------------
# The reference plugins (CLUSTER_CNI=bridge): a /24 per node, routes to the others' via the underlay.
# ---------------------------------------------------------------------------------------------
if [[ "$CNI" == bridge ]]; then
    for i in $(seq "$NODES"); do
        d="$S/nodes/$PREFIX-$i"
        for p in bridge host-local portmap; do cp -f "/usr/lib/cni/$p" "$d/root/opt/cni/bin/$p"; done
        cat >"$d/root/etc/cni/net.d/10-bridge.conflist" <<EOF
{"cniVersion":"1.0.0","name":"bridge","plugins":[
 {"type":"bridge","bridge":"cbr0","isGateway":true,"ipMasq":false,"hairpinMode":true,
  "ipam":{"type":"host-local","ranges":[[{"subnet":"10.245.$i.0/24"}]],"routes":[{"dst":"0.0.0.0/0"}],
          "dataDir":"/var/lib/kuryr/reference-ipam"}},
 {"type":"portmap","capabilities":{"portMappings":true}}]}
EOF
        for j in $(seq "$NODES"); do
            [[ $j -eq $i ]] || ip -n "$NS_PREFIX-n$i" route add "10.245.$j.0/24" via "$(ip4 "$j")"
        done
    done
fi

# ---------------------------------------------------------------------------------------------
# kubelets.
# ---------------------------------------------------------------------------------------------
for i in $(seq "$NODES"); do
    name="$PREFIX-$i" d="$S/nodes/$PREFIX-$i" cg="kuryr-$NS_PREFIX-n$i"
    for c in "${CGROUP_CONTROLLERS[@]}"; do mkdir -p "/sys/fs/cgroup/$c/$cg"; done
    echo "NODE${i}_CGROUP=$cg" >>"$S/partial.env"
    # Names outside the cluster do not resolve here (no network leaves these namespaces).
    printf 'nameserver 127.0.0.1\noptions ndots:1 timeout:1 attempts:1\n' >"$d/resolv.conf"
    cat >"$d/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 0.0.0.0
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: "$PKI/ca.crt"}
authorization: {mode: Webhook}
containerRuntimeEndpoint: "unix://$d/containerd.sock"
# This kernel is cgroup v1 and there is no systemd; each node has a cgroup root of its own.
cgroupDriver: cgroupfs
cgroupRoot: /$cg
cgroupsPerQOS: true
failCgroupV1: false
failSwapOn: false
clusterDNS: ["$CLUSTER_DNS"]
clusterDomain: cluster.local
resolvConf: "$d/resolv.conf"
podLogsDir: /var/log/pods
# Images are imported, never pulled: never collect them, never evict for disk. "0%" switches a
# signal off (a 1% floor still tainted both nodes with disk-pressure on a nearly full large disk,
# and nothing could be scheduled); memory stays guarded.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "100Mi", nodefs.available: "0%", imagefs.available: "0%", nodefs.inodesFree: "0%", imagefs.inodesFree: "0%"}
serializeImagePulls: false
# Above the default 110: make bench-kubelet runs 300 pods on two nodes (each node's /24 of the
# reference plugin and kuryr's blocks hold that many).
maxPods: 250
# Pod status is reported sooner than the default 10 s resync when nothing else changes.
syncFrequency: 10s
EOF
    start "kubelet-$i" "$NS_PREFIX-n$i" "$S/ns/$name.mnt" "$TOOLS/kubelet" --config="$d/kubelet.yaml" \
        --kubeconfig="$d/kubelet.kubeconfig" --hostname-override="$name" --node-ip="$(ip4 "$i"),$(ip6 "$i")" \
        --root-dir="$d/kubelet" --cert-dir="$d/kubelet/pki" \
        --node-labels="kuryr.openstack.org/test-cluster=$NS_PREFIX" \
        --v=1
done
K() { in_netns "$CP_NS" "$TOOLS/kubectl" --kubeconfig="$S/admin.kubeconfig" --request-timeout=10s "$@"; }
for i in $(seq "$NODES"); do
    wait_for "kubelet of $PREFIX-$i (registered)" "kubelet-$i" K get node "$PREFIX-$i"
done
# kubelet may not set node-role labels itself; kubeadm labels the control-plane node the same way.
K label --overwrite node "$PREFIX-1" node-role.kubernetes.io/control-plane= >/dev/null
wait_for "the default ServiceAccount" kube-controller-manager K -n default get serviceaccount default
log "nodes registered after $((SECONDS - t0))s"

if [[ -n "${CLUSTER_OWNER_PID:-}" ]]; then
    # shellcheck disable=SC2016 # expanded by the inner bash
    setsid bash -c 'while kill -0 "$1" 2>/dev/null; do sleep 1; done; exec bash "$2" "$3" --purge' \
        watchdog "$CLUSTER_OWNER_PID" "$HERE/down.sh" "$S" </dev/null >"$LOGS/watchdog.log" 2>&1 &
    echo $! >"$PIDS/watchdog.pid"
fi

{
    cat "$S/partial.env"
    echo "KUBECONFIG=$S/admin.kubeconfig"
    echo "APISERVER_HOST=$CP_IP"
    echo "APISERVER_PORT=$APISERVER_PORT"
    echo "CA_FILE=$PKI/ca.crt"
    echo "SERVICE_CIDR=$SERVICE_CIDR"
    echo "CLUSTER_DNS=$CLUSTER_DNS"
    echo "CONTROL_PLANE_NETNS=$CP_NS"
    echo "CNI=$CNI"
    echo "NODES=$(for i in $(seq "$NODES"); do printf '%s ' "$PREFIX-$i"; done | sed 's/ $//')"
    for i in $(seq "$NODES"); do
        d="$S/nodes/$PREFIX-$i"
        echo "NODE${i}_NAME=$PREFIX-$i"
        echo "NODE${i}_IP4=$(ip4 "$i")"
        echo "NODE${i}_IP6=$(ip6 "$i")"
        echo "NODE${i}_CONTAINERD=$d/containerd.sock"
        echo "NODE${i}_DIR=$d"
    done
} >"$S/env.tmp"
mv "$S/env.tmp" "$S/env"
ok=1
log "up in $((SECONDS - t0))s: $NODES node(s), API server $API (inside the nodes' namespaces)"
