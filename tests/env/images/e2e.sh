#!/usr/bin/env bash
# Builds the container images the test clusters (tests/env/cluster) and the upstream e2e tests
# need, without a registry or a container engine, under the exact names e2e.test v1.34.4 expects
# (test/utils/image/manifest.go), so that nothing is ever pulled:
#
#   registry.k8s.io/pause:3.10.1                       the pod sandbox (static pause.c)
#   registry.k8s.io/e2e-test-images/busybox:1.37.0-1   busybox-static
#   registry.k8s.io/e2e-test-images/agnhost:2.56       agnhost (built by tools.sh) on busybox, with
#                                                      bash, curl, nc (OpenBSD's: UDP), ip, ss,
#                                                      getent and dig from this machine
#   registry.k8s.io/e2e-test-images/jessie-dnsutils:1.7, nginx:1.14-4
#                                                      stand-ins on the agnhost root file system:
#                                                      the DNS tests run dig/getent scripts in the
#                                                      first, the EndpointSlice tests only need a
#                                                      running pod of the second
#   registry.k8s.io/coredns/coredns:v1.14.7            the cluster DNS (CoreDNS built by tools.sh)
#
# Usage: e2e.sh [OUT_DIR]   (default ${KURYR_IMAGES_DIR:-/var/cache/kuryr-rs/images})
# Prints KEY=VALUE lines on stdout (and writes them to OUT_DIR/e2e-images.env): <NAME>_IMAGE and
# <NAME>_TAR for each image, PAUSE_IMAGE and COREDNS_IMAGE among them. Cached: rebuilt only when
# an input (these scripts, the programs copied in) changed. Concurrent callers serialise on a lock.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT_DIR=${1:-${KURYR_IMAGES_DIR:-/var/cache/kuryr-rs/images}}
TOOLS=${KURYR_TOOLS_DIR:-/var/cache/kuryr-rs/bin}
CC=${CC:-gcc}
KUBE_VERSION=v1.34.4

mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
exec 9>"$OUT_DIR/.e2e.lock"
flock 9

for t in agnhost coredns; do
    [[ -x "$TOOLS/$t" ]] || { echo "e2e.sh: $TOOLS/$t is missing: run tests/env/tools.sh" >&2; exit 1; }
done
HOST_PROGRAMS=(/bin/bash /usr/bin/curl /usr/bin/nc.openbsd /usr/sbin/ip /usr/bin/ss /usr/bin/getent /usr/bin/dig)

inputs=$(
    {
        sha256sum "$HERE/e2e.sh" "$HERE/oci.sh" "$HERE/pause.c" /bin/busybox "$TOOLS/agnhost" "$TOOLS/coredns" \
            "${HOST_PROGRAMS[@]}" | awk '{print $1}'
        "$CC" --version | head -n1
    } | sha256sum | awk '{print $1}'
)
# Cached when the inputs match and every tar the env file names is still there.
cached() {
    [[ -f "$OUT_DIR/e2e-inputs.sha256" && "$(cat "$OUT_DIR/e2e-inputs.sha256")" == "$inputs" &&
        -f "$OUT_DIR/e2e-images.env" ]] || return 1
    local tar
    for tar in $(sed -n 's/^[A-Z_]*_TAR=//p' "$OUT_DIR/e2e-images.env"); do [[ -f $tar ]] || return 1; done
}
if cached; then
    cat "$OUT_DIR/e2e-images.env"
    exit 0
fi

WORK=$(mktemp -d "$OUT_DIR/.e2e.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
umask 022
# shellcheck source=oci.sh
source "$HERE/oci.sh"
PATH_ENV='"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"'
env_lines=()
add() { # KEY NAME TAR
    env_lines+=("$1_IMAGE=$2" "$1_TAR=$3")
}

# pause
mkdir -p "$WORK/pause"
"$CC" -static -Os -s -Wall -Wextra -Werror -o "$WORK/pause/pause" "$HERE/pause.c"
make_image registry.k8s.io/pause:3.10.1 "$WORK/pause" '{"Entrypoint":["/pause"],"Env":["PATH=/"]}' "$OUT_DIR/e2e-pause.tar"
add PAUSE registry.k8s.io/pause:3.10.1 "$OUT_DIR/e2e-pause.tar"

# busybox
busybox_root "$WORK/busybox"
make_image registry.k8s.io/e2e-test-images/busybox:1.37.0-1 "$WORK/busybox" "{\"Env\":[$PATH_ENV],\"Cmd\":[\"sh\"]}" \
    "$OUT_DIR/e2e-busybox.tar"
add BUSYBOX registry.k8s.io/e2e-test-images/busybox:1.37.0-1 "$OUT_DIR/e2e-busybox.tar"

# agnhost: upstream's image is alpine-based; this one has what its subcommands and the tests'
# shell snippets call.
A="$WORK/agnhost"
busybox_root "$A"
copy_dynamic "$A" /bin/bash /bin/bash
# busybox's sh runs its own applets (a minimal nc without -u) before PATH: make /bin/sh bash, so
# that `sh -c 'nc ...'` finds OpenBSD's nc, as on the upstream image.
ln -sf bash "$A/bin/sh"
copy_dynamic "$A" /usr/bin/curl /usr/bin/curl
copy_dynamic "$A" /usr/bin/nc.openbsd /usr/bin/nc
ln -sf /usr/bin/nc "$A/bin/nc"
copy_dynamic "$A" /usr/sbin/ip /sbin/ip
ln -sf /sbin/ip "$A/bin/ip"
copy_dynamic "$A" /usr/bin/ss /usr/bin/ss
copy_dynamic "$A" /usr/bin/getent /usr/bin/getent
copy_dynamic "$A" /usr/bin/dig /usr/bin/dig
# getent and the resolver load NSS modules at run time (not listed by ldd).
for lib in /lib/x86_64-linux-gnu/libnss_dns.so.2 /lib/x86_64-linux-gnu/libnss_files.so.2 /lib/x86_64-linux-gnu/libresolv.so.2; do
    [[ -e "$lib" ]] && { mkdir -p "$A/$(dirname "$lib")"; cp -L "$lib" "$A/$lib"; }
done
printf 'hosts: files dns\n' >"$A/etc/nsswitch.conf"
cp "$TOOLS/agnhost" "$A/agnhost"
ln -sf agnhost "$A/agnhost-2"
mkdir -p "$A/uploads"
# The porter subcommand serves TLS with the certificate that ships in agnhost's source tree.
PORTER="$(go env GOMODCACHE)/k8s.io/kubernetes@$KUBE_VERSION/test/images/agnhost/porter"
if [[ -f "$PORTER/localhost.crt" ]]; then cp "$PORTER/localhost.crt" "$PORTER/localhost.key" "$A/"; fi
echo 'user-defined-in-image:x:1000:1000::/home/user-defined-in-image:/bin/sh' >>"$A/etc/passwd"
printf 'user-defined-in-image:x:1000:\ngroup-defined-in-image:x:50000:user-defined-in-image\n' >>"$A/etc/group"
make_image registry.k8s.io/e2e-test-images/agnhost:2.56 "$A" \
    "{\"Entrypoint\":[\"/agnhost\"],\"Cmd\":[\"pause\"],\"Env\":[$PATH_ENV],\"ExposedPorts\":{\"80/tcp\":{},\"8080/tcp\":{},\"8081/tcp\":{},\"9376/tcp\":{},\"5000/tcp\":{}}}" \
    "$OUT_DIR/e2e-agnhost.tar"
add AGNHOST registry.k8s.io/e2e-test-images/agnhost:2.56 "$OUT_DIR/e2e-agnhost.tar"
make_image registry.k8s.io/e2e-test-images/jessie-dnsutils:1.7 "$A" "{\"Cmd\":[\"/bin/sh\"],\"Env\":[$PATH_ENV]}" \
    "$OUT_DIR/e2e-jessie-dnsutils.tar"
add JESSIE_DNSUTILS registry.k8s.io/e2e-test-images/jessie-dnsutils:1.7 "$OUT_DIR/e2e-jessie-dnsutils.tar"
make_image registry.k8s.io/e2e-test-images/nginx:1.14-4 "$A" \
    "{\"Entrypoint\":[\"/agnhost\",\"test-webserver\",\"--port=80\"],\"Env\":[$PATH_ENV]}" "$OUT_DIR/e2e-nginx.tar"
add NGINX registry.k8s.io/e2e-test-images/nginx:1.14-4 "$OUT_DIR/e2e-nginx.tar"

# CoreDNS (static)
mkdir -p "$WORK/coredns/etc"
cp "$TOOLS/coredns" "$WORK/coredns/coredns"
make_image registry.k8s.io/coredns/coredns:v1.14.7 "$WORK/coredns" '{"Entrypoint":["/coredns"]}' "$OUT_DIR/e2e-coredns.tar"
add COREDNS registry.k8s.io/coredns/coredns:v1.14.7 "$OUT_DIR/e2e-coredns.tar"

printf '%s\n' "${env_lines[@]}" >"$WORK/env"
mv -f "$WORK/env" "$OUT_DIR/e2e-images.env"
echo "$inputs" >"$OUT_DIR/e2e-inputs.sha256"
cat "$OUT_DIR/e2e-images.env"
