#!/usr/bin/env bash
# Checks OCI image-layout tars the way an importer reads them, without a container runtime:
#
#   check.sh [-l] TAR...
#
# For each tar: `oci-layout` says 1.0.0; index.json is an image index whose manifests carry
# `io.containerd.image.name` (the reference `ctr images import` registers); every blob a
# descriptor names exists under blobs/sha256, hashes to its name and has the size the descriptor
# states; each manifest's config lists one diff_id per layer, equal to the sha256 of the layer
# uncompressed. Prints one line per image (reference, layers, size); -l also lists each layer's
# files. Exits non-zero at the first inconsistency.
set -euo pipefail

list=0
if [[ ${1:-} == -l ]]; then list=1; shift; fi
[[ $# -gt 0 ]] || { echo "usage: check.sh [-l] TAR..." >&2; exit 2; }
command -v jq >/dev/null || { echo "check.sh: needs jq (make setup installs it)" >&2; exit 2; }

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

fail() { echo "check.sh: $tar: $*" >&2; exit 1; }

# check_blob DIR DIGEST SIZE: the blob exists, hashes to its digest and has the stated size.
check_blob() {
    local dir=$1 digest=$2 want_size=$3 hex path
    [[ $digest == sha256:* ]] || fail "digest $digest is not sha256"
    hex=${digest#sha256:}
    path="$dir/blobs/sha256/$hex"
    [[ -f $path ]] || fail "blob $digest is missing"
    [[ $(sha256sum "$path" | cut -d' ' -f1) == "$hex" ]] || fail "blob $digest does not hash to its name"
    [[ $(stat -c %s "$path") == "$want_size" ]] || fail "blob $digest is $(stat -c %s "$path") bytes, descriptor says $want_size"
}

for tar in "$@"; do
    dir="$WORK/$(basename "$tar").d"
    mkdir -p "$dir"
    tar -xf "$tar" -C "$dir" || fail "not a readable tar"
    [[ -f $dir/oci-layout ]] || fail "no oci-layout"
    [[ $(jq -r .imageLayoutVersion "$dir/oci-layout") == 1.0.0 ]] || fail "oci-layout is not version 1.0.0"
    [[ -f $dir/index.json ]] || fail "no index.json"
    [[ $(jq -r .schemaVersion "$dir/index.json") == 2 ]] || fail "index.json schemaVersion is not 2"
    n=$(jq '.manifests | length' "$dir/index.json")
    ((n > 0)) || fail "index.json lists no manifests"
    for ((i = 0; i < n; i++)); do
        m=$(jq -c ".manifests[$i]" "$dir/index.json")
        ref=$(jq -r '.annotations["io.containerd.image.name"] // empty' <<<"$m")
        [[ -n $ref ]] || fail "manifest $i has no io.containerd.image.name annotation"
        [[ $(jq -r .mediaType <<<"$m") == application/vnd.oci.image.manifest.v1+json ]] ||
            fail "$ref: manifest media type is $(jq -r .mediaType <<<"$m")"
        mdig=$(jq -r .digest <<<"$m")
        check_blob "$dir" "$mdig" "$(jq -r .size <<<"$m")"
        man="$dir/blobs/sha256/${mdig#sha256:}"
        cdig=$(jq -r .config.digest "$man")
        check_blob "$dir" "$cdig" "$(jq -r .config.size "$man")"
        cfg="$dir/blobs/sha256/${cdig#sha256:}"
        [[ $(jq -r .os "$cfg")/$(jq -r .architecture "$cfg") == linux/amd64 ]] || fail "$ref: config is not linux/amd64"
        nl=$(jq '.layers | length' "$man")
        [[ $(jq '.rootfs.diff_ids | length' "$cfg") == "$nl" ]] || fail "$ref: diff_ids and layers differ in number"
        total=0
        for ((j = 0; j < nl; j++)); do
            ldig=$(jq -r ".layers[$j].digest" "$man")
            lsize=$(jq -r ".layers[$j].size" "$man")
            check_blob "$dir" "$ldig" "$lsize"
            total=$((total + lsize))
            layer="$dir/blobs/sha256/${ldig#sha256:}"
            case $(jq -r ".layers[$j].mediaType" "$man") in
                application/vnd.oci.image.layer.v1.tar) diff=$(sha256sum "$layer" | cut -d' ' -f1) ;;
                application/vnd.oci.image.layer.v1.tar+gzip) diff=$(gzip -dc "$layer" | sha256sum | cut -d' ' -f1) ;;
                *) fail "$ref: layer $j has media type $(jq -r ".layers[$j].mediaType" "$man")" ;;
            esac
            [[ "sha256:$diff" == $(jq -r ".rootfs.diff_ids[$j]" "$cfg") ]] || fail "$ref: layer $j does not match its diff_id"
            if ((list)); then
                if [[ $layer == *.gz || $(jq -r ".layers[$j].mediaType" "$man") == *gzip ]]; then
                    gzip -dc "$layer" | tar -tvf - | sed "s|^|  $ref layer $j: |"
                else
                    tar -tvf "$layer" | sed "s|^|  $ref layer $j: |"
                fi
            fi
        done
        printf '%s: ok  %s  %d layer(s), %d bytes  entrypoint=%s cmd=%s user=%s\n' "$tar" "$ref" "$nl" "$total" \
            "$(jq -c '.config.Entrypoint // []' "$cfg")" "$(jq -c '.config.Cmd // []' "$cfg")" \
            "$(jq -r '.config.User // "0"' "$cfg")"
    done
    rm -rf "$dir"
done
