#!/usr/bin/env bash
# Writes a kubeconfig that authenticates as a ServiceAccount of the cluster kube-up.sh started,
# with a bound token from the TokenRequest API (what a pod's projected token is, minus the pod).
# Creates the namespace and the ServiceAccount when missing (this cluster has no controller that
# would). Grants nothing: bind roles to system:serviceaccount:NAMESPACE:SERVICEACCOUNT yourself.
#
#   kube-sa.sh STATE_DIR NAMESPACE SERVICEACCOUNT OUT_KUBECONFIG
#
# Environment: KUBE_SA_TOKEN_DURATION (default 24h) is the token's requested lifetime.
set -euo pipefail

log() { printf 'kube-sa.sh: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[[ $# -eq 4 ]] || die "usage: kube-sa.sh STATE_DIR NAMESPACE SERVICEACCOUNT OUT_KUBECONFIG"
STATE="$1" NS="$2" SA="$3" OUT="$4"
DURATION="${KUBE_SA_TOKEN_DURATION:-24h}"

command -v kubectl >/dev/null || die "'kubectl' is required but not on PATH"
[[ -f "$STATE/env" ]] || die "$STATE/env not found: start the cluster with kube-up.sh $STATE first"

# Read the two values needed from the env file (KEY=VALUE lines written by kube-up.sh).
getenv() { sed -n "s/^$1=//p" "$STATE/env" | tail -n1; }
ADMIN="$(getenv KUBECONFIG)"
SERVER="$(getenv KUBE_APISERVER_URL)"
CA="$(getenv KUBE_CA_FILE)"
[[ -n "$ADMIN" && -n "$SERVER" && -n "$CA" ]] || die "$STATE/env lacks KUBECONFIG/KUBE_APISERVER_URL/KUBE_CA_FILE"

k() { kubectl --kubeconfig="$ADMIN" --request-timeout=30s "$@"; }

# create KIND NAME [ARGS]: tolerant of a concurrent creator (AlreadyExists is fine).
ensure() {
    local err
    k get "$@" >/dev/null 2>&1 && return 0
    if ! err="$(k create "$@" 2>&1 >/dev/null)"; then
        [[ "$err" == *AlreadyExists* || "$err" == *"already exists"* ]] || die "kubectl create $*: $err"
    fi
}
ensure namespace "$NS"
ensure serviceaccount "$SA" -n "$NS"

token="$(k create token "$SA" -n "$NS" --duration="$DURATION")" ||
    die "TokenRequest for $NS/$SA failed"
[[ -n "$token" ]] || die "TokenRequest for $NS/$SA returned an empty token"

mkdir -p "$(dirname "$OUT")"
tmp="$OUT.tmp.$$"
umask 077
cat >"$tmp" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: kuryr-test
  cluster:
    server: $SERVER
    certificate-authority-data: $(base64 -w0 <"$CA")
users:
- name: $NS-$SA
  user:
    token: $token
contexts:
- name: $NS-$SA@kuryr-test
  context:
    cluster: kuryr-test
    user: $NS-$SA
    namespace: $NS
current-context: $NS-$SA@kuryr-test
EOF
mv -f "$tmp" "$OUT"
