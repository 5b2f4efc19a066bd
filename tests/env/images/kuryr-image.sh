#!/usr/bin/env bash
# Assembles the `kuryr-rs` image that deploy/ installs (every kuryr binary in /usr/local/bin)
# from binaries already built on this machine, as an OCI image-layout tar for
# `ctr images import`:
#
#   kuryr-image.sh BIN_DIR OUT_TAR [NAME]      NAME defaults to docker.io/library/kuryr-rs:0.1.0
#                                              (what `image: kuryr-rs:0.1.0` resolves to)
#
# The lab and the tests use this, not deploy/Dockerfile: these machines have no container engine
# to run a Dockerfile build and no registry to push to, and an image made of the binaries just
# built is the very code under test (the Dockerfile would rebuild it). Besides the binaries it
# holds what the binder runs — nft, conntrack, ip, ovs-vsctl (where installed) — with the
# libraries ldd lists for them and for the services, busybox for the install-cni init container's
# shell, /etc/passwd with the non-root user 65532 the control-plane pods run as, and the CA
# certificates (Keystone, Neutron and Octavia over TLS). Takes a few seconds; the layer is stored
# uncompressed (it only travels to this machine's own runtimes).
set -euo pipefail

BIN_DIR=${1:?usage: kuryr-image.sh BIN_DIR OUT_TAR [NAME]}
OUT=${2:?usage: kuryr-image.sh BIN_DIR OUT_TAR [NAME]}
NAME=${3:-docker.io/library/kuryr-rs:0.1.0}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
BINARIES=(kuryr-watcher kuryr-vif-allocator kuryr-lbaas kuryr-policy kuryr-binder kuryr-cni)

for b in "${BINARIES[@]}"; do
    [[ -x "$BIN_DIR/$b" ]] || { echo "kuryr-image.sh: $BIN_DIR/$b is not built" >&2; exit 1; }
done
mkdir -p "$(dirname "$OUT")"
WORK=$(mktemp -d "$(dirname "$OUT")/.kuryr-image.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
umask 022
# shellcheck source=oci.sh
source "$HERE/oci.sh"

R="$WORK/root"
busybox_root "$R"
printf 'nonroot:x:65532:65532:nonroot:/nonexistent:/bin/false\n' >>"$R/etc/passwd"
printf 'nonroot:x:65532:\n' >>"$R/etc/group"
mkdir -p "$R/usr/local/bin" "$R/etc/ssl/certs"
for b in "${BINARIES[@]}"; do
    if ldd "$BIN_DIR/$b" >/dev/null 2>&1; then
        copy_dynamic "$R" "$BIN_DIR/$b" "/usr/local/bin/$b"
    else
        cp "$BIN_DIR/$b" "$R/usr/local/bin/$b"   # statically linked (the shim as shipped)
    fi
done
copy_dynamic "$R" /usr/sbin/nft /usr/sbin/nft
copy_dynamic "$R" /usr/sbin/conntrack /usr/sbin/conntrack
copy_dynamic "$R" /usr/sbin/ip /usr/sbin/ip
if [[ -x /usr/bin/ovs-vsctl ]]; then copy_dynamic "$R" /usr/bin/ovs-vsctl /usr/bin/ovs-vsctl; fi
[[ -f /etc/ssl/certs/ca-certificates.crt ]] && cp /etc/ssl/certs/ca-certificates.crt "$R/etc/ssl/certs/"

make_image "$NAME" "$R" \
    '{"Env":["PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],"User":"65532"}' "$WORK/image.tar" none
mv -f "$WORK/image.tar" "$OUT"
echo "kuryr-image.sh: $NAME from $BIN_DIR -> $OUT ($(du -h "$OUT" | cut -f1))" >&2
