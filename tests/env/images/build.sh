#!/usr/bin/env bash
# Builds the two container images the CRI tests need, without any registry:
#
#   localhost/kuryr/pause:1    a static `pause` (pause.c) as the pod sandbox's infra process
#   localhost/kuryr/busybox:1  busybox-static with its applet links, for test containers
#
# Each is written as an OCI image-layout tar (oci-layout, index.json, blobs/sha256/...) that
# `ctr images import` takes as is; index.json carries `io.containerd.image.name` so the import
# lands under the full reference. Digests are computed here with sha256sum.
#
# Usage: build.sh OUT_DIR
# Writes OUT_DIR/pause.tar, OUT_DIR/busybox.tar and OUT_DIR/images.env (PAUSE_IMAGE=...,
# BUSYBOX_IMAGE=..., PAUSE_TAR=..., BUSYBOX_TAR=...). The output is cached: it is rebuilt only when
# this script, pause.c, /bin/busybox or the compiler changed. Concurrent callers with the same
# OUT_DIR serialise on a lock, and outputs are renamed into place, so a reader never sees half a tar.
set -euo pipefail

OUT_DIR=${1:?usage: build.sh OUT_DIR}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
BUSYBOX=${BUSYBOX:-/bin/busybox}
CC=${CC:-gcc}

PAUSE_IMAGE=localhost/kuryr/pause:1
BUSYBOX_IMAGE=localhost/kuryr/busybox:1

mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)

exec 9>"$OUT_DIR/.lock"
flock 9

inputs=$(
    {
        sha256sum "$HERE/build.sh" "$HERE/pause.c" "$BUSYBOX" | awk '{print $1}'
        "$CC" --version | head -n1
        echo "$PAUSE_IMAGE $BUSYBOX_IMAGE"
    } | sha256sum | awk '{print $1}'
)
if [[ -f "$OUT_DIR/inputs.sha256" && "$(cat "$OUT_DIR/inputs.sha256")" == "$inputs" &&
    -f "$OUT_DIR/pause.tar" && -f "$OUT_DIR/busybox.tar" && -f "$OUT_DIR/images.env" ]]; then
    exit 0
fi

WORK=$(mktemp -d "$OUT_DIR/.build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
umask 022

sha() { sha256sum "$1" | awk '{print $1}'; }
size() { stat -c %s "$1"; }

# Stores a file as a blob of the layout in $1 and prints its hex digest.
put_blob() {
    local layout=$1 file=$2 d
    d=$(sha "$file")
    mkdir -p "$layout/blobs/sha256"
    cp "$file" "$layout/blobs/sha256/$d"
    echo "$d"
}

# make_image NAME ROOTFS_DIR CONFIG_SECTION_JSON OUT_TAR
# Packs ROOTFS_DIR as one gzip layer (reproducible: sorted, owner 0, mtime 0, no gzip name/time),
# writes the image config, the manifest and an annotated index, and tars the layout.
make_image() {
    local name=$1 rootfs=$2 config_section=$3 out=$4
    local layout
    layout="$WORK/layout-$(basename "$out" .tar)"
    mkdir -p "$layout"

    tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 \
        -C "$rootfs" -cf "$WORK/layer.tar" .
    local diff_id
    diff_id=$(sha "$WORK/layer.tar")
    gzip -n -6 -c "$WORK/layer.tar" >"$WORK/layer.tar.gz"
    local layer_digest layer_size
    layer_digest=$(put_blob "$layout" "$WORK/layer.tar.gz")
    layer_size=$(size "$WORK/layer.tar.gz")

    printf '{"architecture":"amd64","os":"linux","created":"1970-01-01T00:00:00Z","config":%s,"rootfs":{"type":"layers","diff_ids":["sha256:%s"]},"history":[{"created":"1970-01-01T00:00:00Z","created_by":"tests/env/images/build.sh"}]}' \
        "$config_section" "$diff_id" >"$WORK/config.json"
    local config_digest config_size
    config_digest=$(put_blob "$layout" "$WORK/config.json")
    config_size=$(size "$WORK/config.json")

    printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"sha256:%s","size":%s}]}' \
        "$config_digest" "$config_size" "$layer_digest" "$layer_size" >"$WORK/manifest.json"
    local manifest_digest manifest_size
    manifest_digest=$(put_blob "$layout" "$WORK/manifest.json")
    manifest_size=$(size "$WORK/manifest.json")

    printf '{"imageLayoutVersion":"1.0.0"}' >"$layout/oci-layout"
    # ref.name is the tag (the OCI convention); io.containerd.image.name the full reference that
    # `ctr images import` registers the image under.
    printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"platform":{"architecture":"amd64","os":"linux"},"annotations":{"io.containerd.image.name":"%s","org.opencontainers.image.ref.name":"%s"}}]}' \
        "$manifest_digest" "$manifest_size" "$name" "${name##*:}" >"$layout/index.json"

    tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 \
        -C "$layout" -cf "$WORK/out.tar" oci-layout index.json blobs
    mv -f "$WORK/out.tar" "$out"
    rm -f "$WORK/layer.tar" "$WORK/layer.tar.gz"
}

# --- pause -----------------------------------------------------------------------------------
PAUSE_ROOT="$WORK/pause-root"
mkdir -p "$PAUSE_ROOT"
"$CC" -static -Os -s -Wall -Wextra -Werror -o "$PAUSE_ROOT/pause" "$HERE/pause.c"
make_image "$PAUSE_IMAGE" "$PAUSE_ROOT" '{"Entrypoint":["/pause"],"Env":["PATH=/"]}' "$OUT_DIR/pause.tar"

# --- busybox ---------------------------------------------------------------------------------
BB_ROOT="$WORK/busybox-root"
mkdir -p "$BB_ROOT"/{bin,sbin,usr/bin,usr/sbin,etc,root,proc,sys,dev,tmp,var/run}
chmod 1777 "$BB_ROOT/tmp"
chmod 0700 "$BB_ROOT/root"
cp "$BUSYBOX" "$BB_ROOT/bin/busybox"
chmod 0755 "$BB_ROOT/bin/busybox"
while read -r applet; do
    [[ -z "$applet" || "$applet" == bin/busybox ]] && continue
    mkdir -p "$BB_ROOT/$(dirname "$applet")"
    ln -sf /bin/busybox "$BB_ROOT/$applet"
done < <("$BB_ROOT/bin/busybox" --list-full)
printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' >"$BB_ROOT/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' >"$BB_ROOT/etc/group"
make_image "$BUSYBOX_IMAGE" "$BB_ROOT" \
    '{"Env":["PATH=/usr/sbin:/usr/bin:/sbin:/bin"],"Cmd":["sh"]}' "$OUT_DIR/busybox.tar"

cat >"$WORK/images.env" <<EOF
PAUSE_IMAGE=$PAUSE_IMAGE
BUSYBOX_IMAGE=$BUSYBOX_IMAGE
PAUSE_TAR=$OUT_DIR/pause.tar
BUSYBOX_TAR=$OUT_DIR/busybox.tar
EOF
mv -f "$WORK/images.env" "$OUT_DIR/images.env"
echo "$inputs" >"$WORK/inputs.sha256"
mv -f "$WORK/inputs.sha256" "$OUT_DIR/inputs.sha256"
