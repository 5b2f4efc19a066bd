# Sourced by the image scripts in this directory: OCI image-layout tars without a registry or a
# container engine, importable with `ctr images import`. The caller sets WORK (a scratch
# directory it removes).
#
#   make_image NAME ROOTFS_DIR CONFIG_SECTION_JSON OUT_TAR [gzip|none]
#       one layer holding ROOTFS_DIR (reproducible: sorted, owner 0, mtime 0, gzip without name
#       or time; `none` stores it uncompressed, which is faster for large layers imported locally)
#   busybox_root DIR       busybox-static with its applet links, /etc/passwd and /etc/group, /tmp
#   copy_dynamic ROOT SRC DEST   a dynamically linked program and the libraries ldd lists for it

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

make_image() {
    local name=$1 rootfs=$2 config_section=$3 out=$4 compression=${5:-gzip}
    local layout="$WORK/layout-$(basename "$out" .tar)"
    rm -rf "$layout"
    mkdir -p "$layout"

    tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$rootfs" -cf "$WORK/layer.tar" .
    local diff_id layer=$WORK/layer.tar media=application/vnd.oci.image.layer.v1.tar
    diff_id=$(sha "$WORK/layer.tar")
    if [[ $compression == gzip ]]; then
        # Images made from the same root file system (e2e.sh's stand-ins) share one layer: it is
        # compressed once per WORK and reused, which gives the same bytes as compressing it again.
        local gz="$WORK/layer-$diff_id.tar.gz"
        [[ -f $gz ]] || gzip -n -6 -c "$WORK/layer.tar" >"$gz"
        layer=$gz media=application/vnd.oci.image.layer.v1.tar+gzip
    fi
    local layer_digest layer_size
    layer_digest=$(put_blob "$layout" "$layer")
    layer_size=$(size "$layer")

    printf '{"architecture":"amd64","os":"linux","created":"1970-01-01T00:00:00Z","config":%s,"rootfs":{"type":"layers","diff_ids":["sha256:%s"]},"history":[{"created":"1970-01-01T00:00:00Z","created_by":"tests/env/images"}]}' \
        "$config_section" "$diff_id" >"$WORK/config.json"
    local config_digest config_size
    config_digest=$(put_blob "$layout" "$WORK/config.json")
    config_size=$(size "$WORK/config.json")

    printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:%s","size":%s},"layers":[{"mediaType":"%s","digest":"sha256:%s","size":%s}]}' \
        "$config_digest" "$config_size" "$media" "$layer_digest" "$layer_size" >"$WORK/manifest.json"
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
    rm -rf "$WORK/layer.tar" "$layout"
}

busybox_root() {
    local r=$1 applet
    mkdir -p "$r"/{bin,sbin,usr/bin,usr/sbin,etc,root,proc,sys,dev,tmp,var/run}
    chmod 1777 "$r/tmp"
    chmod 0700 "$r/root"
    cp "${BUSYBOX:-/bin/busybox}" "$r/bin/busybox"
    chmod 0755 "$r/bin/busybox"
    while read -r applet; do
        [[ -z "$applet" || "$applet" == bin/busybox ]] && continue
        mkdir -p "$r/$(dirname "$applet")"
        ln -sf /bin/busybox "$r/$applet"
    done < <("$r/bin/busybox" --list-full)
    printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' >"$r/etc/passwd"
    printf 'root:x:0:\nnogroup:x:65534:\n' >"$r/etc/group"
}

copy_dynamic() {
    local r=$1 src=$2 dst=$3 lib
    [[ -x "$src" ]] || { echo "images: $src is missing (make setup installs it)" >&2; return 1; }
    mkdir -p "$r/$(dirname "$dst")"
    rm -f "$r/$dst"
    cp -L "$src" "$r/$dst"
    if ldd "$src" 2>&1 | grep -q 'not found'; then
        echo "images: $src needs libraries this machine lacks: $(ldd "$src" | grep 'not found')" >&2
        return 1
    fi
    for lib in $(ldd "$src" 2>/dev/null | grep -oE '/[^ ]+\.so[^ ]*'); do
        [[ -e "$r/$lib" ]] && continue
        mkdir -p "$r/$(dirname "$lib")"
        cp -L "$lib" "$r/$lib"
    done
}
