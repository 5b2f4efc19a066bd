#!/usr/bin/env bash
# Builds the test environment's tools from source at pinned versions and installs them into
# ${KURYR_TOOLS_DIR:-/var/cache/kuryr-rs/bin}:
#
#   kube-apiserver  k8s.io/kubernetes v1.34.4          (module: go/kube)
#   kube-controller-manager  the same release          (module: go/kcm)
#   kubelet, kube-scheduler, kubectl, agnhost, e2e.test  the same release (module: go/node):
#                   the real nodes of the test clusters, and the upstream e2e tests with the
#                   program of their test images
#   etcd            go.etcd.io/etcd/server/v3 v3.6.5   (module: go/etcd)
#   grpcurl         github.com/fullstorydev/grpcurl v1.9.3 (module: go/grpcurl)
#   cnitool         github.com/containernetworking/cni v1.3.0 (module: go/cnitool)
#   coredns         github.com/coredns/coredns v1.14.7 (module: go/coredns; the cluster DNS)
#
# Build times, measured on a 2-core machine (Go 1.26, `nice`d, other builds running: load 4-7):
#
#   tool                      cold    rebuild      cold: empty Go build cache, all tools in this
#   kube-apiserver            308 s   4 s          script's order, so each one reuses what those
#   kube-controller-manager   103 s   4 s          before it compiled (`tools.sh kubelet` alone
#   kubelet                    18 s   3 s          from nothing: 254 s); the module downloads
#   kube-scheduler              4 s   2 s          (1.2 GB, ~20 s here) not counted.
#   kubectl                    38 s   2 s          rebuild: build cache warm, binary gone or its
#   agnhost                     4 s   2 s          stamp stale (another tools dir, say).
#   e2e.test                  130 s   4 s          warm: every stamp matches, nothing built:
#   etcd                       26 s   1 s          0.1-0.4 s for the whole list.
#   grpcurl                    28 s   1 s
#   cnitool                     1 s   1 s          Earlier cold runs of kube-apiserver alone
#   coredns                   111 s   1 s          took 10-15 min on busier machines of this
#   all                       772 s  25 s          kind. Builds are reproducible: two cold builds
#                                                  gave bit-identical binaries.
#
# Each tool has a Go module of its own under tests/env/go/ whose go.mod and go.sum are committed:
# the module graph is resolved once, and every build afterwards is checked against go.sum
# (-mod=readonly), so no checksum database is needed. Separate modules keep each tool on the
# dependency versions its authors released it with.
#
# Idempotent: a stamp next to each binary records what it was built from (the package, the pinned
# version and a hash of go.mod/go.sum); a tool whose stamp matches is skipped. Builds use the
# default GOPATH and GOCACHE so that a machine that keeps them makes warm runs fast. Concurrent
# callers are serialised by a lock in the tools directory.
#
# Usage: tools.sh [TOOL...]   (default: all of them). Progress goes to stderr.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TOOLS_DIR="${KURYR_TOOLS_DIR:-/var/cache/kuryr-rs/bin}"

KUBE_VERSION=v1.34.4
ETCD_VERSION=v3.6.5
COREDNS_VERSION=v1.14.7
GRPCURL_VERSION=v1.9.3
CNI_VERSION=v1.3.0

# Every tool, in the order that reuses the most of the Go build cache.
ALL_TOOLS=(kube-apiserver kube-controller-manager kubelet kube-scheduler kubectl agnhost e2e.test etcd grpcurl cnitool
    coredns)

log() { printf 'tools.sh: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# Prints "module-dir module package version extra-ldflags" for a tool name.
tool_spec() {
    case "$1" in
        kube-apiserver | kube-controller-manager | kubelet | kube-scheduler | kubectl | e2e.test)
            # Both report these in /version and logs; without them they say v0.0.0-master.
            local v="${KUBE_VERSION#v}" major minor
            major="${v%%.*}"
            minor="${v#*.}"
            minor="${minor%%.*}"
            local x=""
            for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
                x+=" -X ${pkg}.gitVersion=${KUBE_VERSION} -X ${pkg}.gitMajor=${major}"
                x+=" -X ${pkg}.gitMinor=${minor} -X ${pkg}.gitTreeState=clean"
            done
            local moddir=kube pkg="k8s.io/kubernetes/cmd/$1"
            case $1 in
                kube-controller-manager) moddir=kcm ;;
                kubelet | kube-scheduler | kubectl) moddir=node ;;
                e2e.test) moddir=node pkg=k8s.io/kubernetes/test/e2e ;;
            esac
            echo "$moddir k8s.io/kubernetes $pkg ${KUBE_VERSION}${x}"
            ;;
        agnhost) echo "node k8s.io/kubernetes k8s.io/kubernetes/test/images/agnhost ${KUBE_VERSION}" ;;
        coredns) echo "coredns github.com/coredns/coredns kuryr-rs.invalid/tests/env/go/coredns ${COREDNS_VERSION}" ;;
        etcd) echo "etcd go.etcd.io/etcd/server/v3 go.etcd.io/etcd/server/v3 ${ETCD_VERSION}" ;;
        grpcurl)
            echo "grpcurl github.com/fullstorydev/grpcurl github.com/fullstorydev/grpcurl/cmd/grpcurl" \
                "${GRPCURL_VERSION} -X main.version=${GRPCURL_VERSION}"
            ;;
        cnitool)
            echo "cnitool github.com/containernetworking/cni github.com/containernetworking/cni/cnitool" \
                "${CNI_VERSION}"
            ;;
        *) die "unknown tool '$1' (known: ${ALL_TOOLS[*]})" ;;
    esac
}

# The stamp contents: what the binary was built from. Any change to it triggers a rebuild.
stamp_of() {
    local moddir="$1" pkg="$2" version="$3" ldextra="$4" sums
    sums="$(cat "$moddir/go.mod" "$moddir/go.sum" | sha256sum | cut -d' ' -f1)"
    printf '%s@%s go=%s mod=%s ld=%s\n' "$pkg" "$version" "$(go env GOVERSION)" "$sums" \
        "$(printf '%s' "$ldextra" | sha256sum | cut -d' ' -f1)"
}

build_tool() {
    local name="$1" spec moddir module pkg version ldextra
    spec="$(tool_spec "$name")"
    read -r moddir module pkg version ldextra <<<"$spec"
    moddir="$HERE/go/$moddir"
    [[ -f "$moddir/go.mod" && -f "$moddir/go.sum" ]] || die "missing $moddir/go.mod or go.sum"
    # The version above is stamped into binaries and logs: it must be the one go.mod pins.
    grep -qE "^[[:space:]]*(require[[:space:]]+)?${module//./\\.} ${version//./\\.}( |$)" "$moddir/go.mod" ||
        die "$moddir/go.mod does not require $module $version (update tools.sh and go.mod together)"

    local bin="$TOOLS_DIR/$name" stampfile="$TOOLS_DIR/.$name.stamp" want
    want="$(stamp_of "$moddir" "$pkg" "$version" "$ldextra")"
    if [[ -x "$bin" && -f "$stampfile" && "$(cat "$stampfile")" == "$want" ]]; then
        log "$name $version: up to date ($bin)"
        return 0
    fi

    local note=""
    [[ $name == kube-apiserver ]] && note=" (cold: 5-15 minutes on 2 cores; warm: seconds)"
    [[ $name == kube-controller-manager ]] && note=" (after kube-apiserver, mostly from its Go build cache)"
    [[ $name == e2e.test ]] && note=" (the upstream e2e tests: 2-4 minutes)"
    log "$name $version: building $pkg$note"
    local start=$SECONDS tmp="$TOOLS_DIR/.$name.tmp.$$"
    # -mod=readonly: the committed go.sum is the source of truth; a missing or changed hash fails.
    # GOSUMDB=off: the checksum database is not reachable here and go.sum already pins every hash.
    # CGO_ENABLED=0: static binaries, as the upstream release builds of both servers are.
    # e2e.test is the e2e package's test binary (`go test -c`), as upstream builds it.
    local build=(build)
    [[ $name == e2e.test ]] && build=(test -c)
    if ! (cd "$moddir" && CGO_ENABLED=0 GOTOOLCHAIN=local GOSUMDB=off \
        GOFLAGS="-mod=readonly -buildvcs=false" \
        nice go "${build[@]}" -trimpath -ldflags="-s -w${ldextra:+ $ldextra}" -o "$tmp" "$pkg"); then
        rm -f "$tmp"
        die "building $name ($pkg $version) failed"
    fi
    mv -f "$tmp" "$bin"
    printf '%s' "$want" >"$stampfile"
    log "$name $version: built in $((SECONDS - start))s -> $bin"
}

command -v go >/dev/null || die "the Go toolchain ('go') is not on PATH; install Go >= 1.24"
command -v flock >/dev/null || die "'flock' (util-linux) is not on PATH"
mkdir -p "$TOOLS_DIR" || die "cannot create the tools directory $TOOLS_DIR (set KURYR_TOOLS_DIR)"

tools=("$@")
[[ ${#tools[@]} -gt 0 ]] || tools=("${ALL_TOOLS[@]}")
for t in "${tools[@]}"; do tool_spec "$t" >/dev/null; done

# One builder at a time per tools directory: test binaries starting concurrently may all find a
# tool missing; the later ones wait and then see the stamp.
exec 9>"$TOOLS_DIR/.lock"
if ! flock -n 9; then
    log "another tools.sh is building in $TOOLS_DIR; waiting for it"
    flock 9
fi

total=$SECONDS
for t in "${tools[@]}"; do
    build_tool "$t"
done
log "all done in $((SECONDS - total))s (${tools[*]})"
