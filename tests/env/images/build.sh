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
        sha256sum "$HERE/build.sh" "$HERE/oci.sh" "$HERE/pause.c" "$BUSYBOX" | awk '{print $1}'
        "$CC" --version | head -n1
        echo "$PAUSE_IMAGE $BUSYBOX_IMAGE"
    } | sha256sum | awk '{print $1}'
)
# images.env names the tars by absolute path: a cache copied from another tree (a target/
# directory copied along with a checkout) names that tree's files, and is rebuilt.
if [[ -f "$OUT_DIR/inputs.sha256" && "$(cat "$OUT_DIR/inputs.sha256")" == "$inputs" &&
    -f "$OUT_DIR/pause.tar" && -f "$OUT_DIR/busybox.tar" && -f "$OUT_DIR/images.env" ]] &&
    grep -qxF "PAUSE_TAR=$OUT_DIR/pause.tar" "$OUT_DIR/images.env"; then
    exit 0
fi

WORK=$(mktemp -d "$OUT_DIR/.build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
umask 022

# shellcheck source=oci.sh
source "$HERE/oci.sh"

# --- pause -----------------------------------------------------------------------------------
PAUSE_ROOT="$WORK/pause-root"
mkdir -p "$PAUSE_ROOT"
"$CC" -static -Os -s -Wall -Wextra -Werror -o "$PAUSE_ROOT/pause" "$HERE/pause.c"
make_image "$PAUSE_IMAGE" "$PAUSE_ROOT" '{"Entrypoint":["/pause"],"Env":["PATH=/"]}' "$OUT_DIR/pause.tar"

# --- busybox ---------------------------------------------------------------------------------
BB_ROOT="$WORK/busybox-root"
busybox_root "$BB_ROOT"
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
