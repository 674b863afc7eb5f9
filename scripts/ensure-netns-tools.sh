#!/usr/bin/env bash
# Make sure the tools of the network-partition system test are here and work: `ip netns`
# (iproute2) and iptables.
#
# Why: tests/system/test_partition.py puts a controller and an agent in network namespaces of
# its own and cuts the link between them with iptables; CI (CI=true) must not silently skip it.
# Idempotent: exits 0 at once when both tools are present and usable; as root it installs the
# missing ones with apt-get; otherwise it says what to install and exits 1. Needs root either
# way: creating namespaces and firewall rules does. The check runs iptables in a throwaway
# network namespace (`unshare --net`), so it never reads or touches this host's own rules.
set -euo pipefail

missing_packages() {
    local out=()
    command -v ip >/dev/null 2>&1 || out+=(iproute2)
    command -v iptables >/dev/null 2>&1 || out+=(iptables)
    echo "${out[@]:-}"
}

usable() {
    # `ip netns` is known to this iproute2, and iptables can list rules in a fresh namespace
    ip netns list >/dev/null 2>&1 || { echo "ensure-netns-tools: 'ip netns list' fails" >&2; return 1; }
    if command -v unshare >/dev/null 2>&1; then
        unshare --net -- iptables -w -S >/dev/null 2>&1 ||
            { echo "ensure-netns-tools: iptables does not work in a network namespace" >&2; return 1; }
    fi
    return 0
}

if [[ $(id -u) -ne 0 ]]; then
    echo "ensure-netns-tools: must run as root (network namespaces and iptables need it)" >&2
    exit 1
fi

packages=$(missing_packages)
if [[ -z "$packages" ]]; then
    usable || exit 1
    echo "ensure-netns-tools: ip netns and iptables are available"
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    cat >&2 <<MSG
ensure-netns-tools: missing: $packages. Install them, then re-run:
  Debian/Ubuntu:  apt-get install -y $packages
  Fedora/RHEL:    dnf install -y $packages
MSG
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
echo "ensure-netns-tools: installing $packages with apt-get"
apt-get update
# shellcheck disable=SC2086  # word splitting of the package list is intended
apt-get install -y --no-install-recommends $packages

packages=$(missing_packages)
if [[ -n "$packages" ]]; then
    echo "ensure-netns-tools: installed, but still missing: $packages" >&2
    exit 1
fi
usable || exit 1
echo "ensure-netns-tools: ip netns and iptables are available"
