#!/usr/bin/env bash
# Make sure an etcd server binary (`etcd`, v3 API) is installed.
#
# Why: tests/system/test_patroni.py runs the documented production store (PostgreSQL managed by
# Patroni, with etcd as its distributed configuration store) and CI (CI=true) must not silently
# skip it. Debian ships the server as `etcd-server` (3.4 on bookworm). Idempotent: exits 0 at
# once when `etcd` is present; as root it installs the package with apt-get; otherwise it says
# what to install and exits 1. Override discovery with PHALANX_ETCD (the same variable as the
# test): the path of an etcd binary.
set -euo pipefail

find_etcd() {
    if [[ -n "${PHALANX_ETCD:-}" ]]; then
        [[ -x "$PHALANX_ETCD" ]] && { echo "$PHALANX_ETCD"; return 0; }
        return 1
    fi
    command -v etcd 2>/dev/null && return 0
    [[ -x /usr/bin/etcd ]] && { echo /usr/bin/etcd; return 0; }
    return 1
}

if etcd=$(find_etcd); then
    echo "ensure-etcd: etcd found at $etcd ($("$etcd" --version 2>/dev/null | head -1))"
    exit 0
fi

if [[ -n "${PHALANX_ETCD:-}" ]]; then
    echo "ensure-etcd: PHALANX_ETCD=$PHALANX_ETCD is not an executable etcd binary" >&2
    exit 1
fi

if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    cat >&2 <<'MSG'
ensure-etcd: the etcd server (`etcd`) was not found.
Install it, then re-run:
  Debian/Ubuntu:  sudo apt-get install -y --no-install-recommends etcd-server
  Fedora/RHEL:    sudo dnf install -y etcd
  macOS:          brew install etcd
or point PHALANX_ETCD at an etcd binary.
MSG
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
echo "ensure-etcd: installing etcd-server with apt-get"
# wait for another apt-get or dpkg (a parallel ensure-*.sh) rather than fail on its lock
apt_get() { apt-get -o DPkg::Lock::Timeout=600 "$@"; }
apt_get update
apt_get install -y --no-install-recommends etcd-server

if etcd=$(find_etcd); then
    echo "ensure-etcd: installed etcd-server; etcd is $etcd"
    exit 0
fi
echo "ensure-etcd: installed etcd-server but still cannot find etcd" >&2
exit 1
