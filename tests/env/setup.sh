#!/usr/bin/env bash
# Installs what the tests need from Debian packages and rustup: the container runtime, the
# reference CNI plugins, Open vSwitch, nftables and network tools. Idempotent; needs root.
set -euo pipefail

PACKAGES=(
  containerd runc busybox-static containernetworking-plugins
  openvswitch-switch nftables iproute2 ethtool conntrack iputils-ping
  jq openssl curl gcc libc6-dev make protobuf-compiler
  # The real OpenStack services (tests/env/openstack): their database, message bus, and the
  # helper that carries the node agent's AMQP connection into its network namespace.
  mariadb-server rabbitmq-server socat
  # Copied into the upstream e2e tests' images (tests/env/images/e2e.sh): nc that speaks UDP, dig.
  netcat-openbsd bind9-dnsutils
)

if [[ $(id -u) -ne 0 ]]; then
  echo "setup.sh: must run as root (it installs packages and the tests create network namespaces)" >&2
  exit 1
fi

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup.sh: installing ${missing[*]}" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
else
  echo "setup.sh: system packages present" >&2
fi

for tool in cargo go; do
  command -v "$tool" >/dev/null || { echo "setup.sh: $tool is required but not on PATH" >&2; exit 1; }
done
rustup component add clippy rustfmt >/dev/null 2>&1 || true
echo "setup.sh: done" >&2
