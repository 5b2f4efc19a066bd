#!/usr/bin/env bash
# Creates the Python venvs of the real OpenStack services the tests run against, from the pinned
# sets committed beside this script (constraints-<service>.txt), under
# /var/cache/kuryr-rs/openstack/<service> (KURYR_OPENSTACK_CACHE overrides).
#
#   setup.sh [keystone|neutron|octavia|kuryr ...]     default: keystone, neutron, octavia
#
# kuryr (Kuryr-Kubernetes 10.0.0, for the side-by-side runs) is built only when named.
#
# Each venv carries a stamp: the hash of its constraints file, the interpreter's version and uv's
# version. A venv whose stamp matches is left alone, so a warm run takes well under a second; any
# change rebuilds that venv from scratch (uv's download cache, kept beside the venvs, makes a
# rebuild a matter of seconds once the wheels were fetched). Concurrent runs are serialised with
# a lock. The system packages (MariaDB, RabbitMQ, Open vSwitch, socat) come from tests/env/setup.sh.
#
# Environment: KURYR_PYTHON  the interpreter to build the venvs with (≥ 3.11)
set -euo pipefail
SCRIPT=openstack/setup.sh
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

services=("$@")
((${#services[@]})) || services=("${OS_SERVICES[@]}")
for s in "${services[@]}"; do
    [[ " ${OS_SERVICES[*]} ${OS_EXTRA_VENVS[*]} " == *" $s "* ]] ||
        die "unknown service '$s' (known: ${OS_SERVICES[*]} ${OS_EXTRA_VENVS[*]})"
    [[ -f "$OS_HERE/constraints-$s.txt" ]] || die "missing $OS_HERE/constraints-$s.txt"
done

mkdir -p "$OS_CACHE" || die "cannot create $OS_CACHE"
exec 9>"$OS_CACHE/.lock"
flock 9 || die "cannot lock $OS_CACHE/.lock"

PYTHON="$(find_python)" || die "no Python ≥ 3.11 found (set KURYR_PYTHON to one)"
PY_VERSION="$("$PYTHON" -c 'import platform; print(platform.python_version())')"

ensure_uv "$PYTHON"

for s in "${services[@]}"; do
    venv="$(venv_dir "$s")"
    constraints="$OS_HERE/constraints-$s.txt"
    stamp="$( (cat "$constraints"; echo "python $PY_VERSION $PYTHON"; echo "uv $UV_VERSION") | sha256sum | cut -d' ' -f1)"
    if [[ -x "$venv/bin/python" && "$(cat "$venv/.kuryr-stamp" 2>/dev/null)" == "$stamp" ]]; then
        log "$s: venv up to date ($venv)"
        continue
    fi
    t0=$SECONDS
    log "$s: building the venv in $venv (Python $PY_VERSION)"
    rm -rf "$venv"
    "$UV" venv -q --python "$PYTHON" "$venv" || die "$s: uv venv failed"
    # sync installs exactly the pinned set: nothing more, nothing newer.
    "$UV" pip sync -q --python "$venv/bin/python" "$constraints" || die "$s: installing $constraints failed"
    if [[ "$s" == kuryr ]]; then
        # Kuryr's CRD manifests ship in its source distribution only (not the wheel): fetched
        # at the pinned version and kept beside the venv, in share/kuryr-crds/.
        version="$(sed -n 's/^kuryr-kubernetes==//p' "$constraints")"
        dl="$(mktemp -d)"
        "$OS_CACHE/uv-tool/bin/pip" download -q --no-deps --no-binary :all: -d "$dl" \
            "kuryr-kubernetes==$version" || die "kuryr: downloading the kuryr-kubernetes $version sdist failed"
        mkdir -p "$venv/share/kuryr-crds"
        tar -xzf "$dl"/kuryr*kubernetes-"$version".tar.gz -C "$dl" || die "kuryr: unpacking the sdist failed"
        cp "$dl"/kuryr*kubernetes-"$version"/kubernetes_crds/kuryr_crds/*.yaml "$venv/share/kuryr-crds/" ||
            die "kuryr: no kubernetes_crds/kuryr_crds/*.yaml in the sdist"
        rm -rf "$dl"
    fi
    echo "$stamp" >"$venv/.kuryr-stamp"
    log "$s: venv ready in $((SECONDS - t0))s"
done
