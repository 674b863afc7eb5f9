#!/usr/bin/env bash
# Make sure PostgreSQL *server* binaries (initdb, pg_ctl, postgres) are installed.
#
# Why: the store contract and outage tests start a throwaway cluster (tests/pgserver.py) and CI
# must not silently skip them. Debian keeps server binaries in /usr/lib/postgresql/N/bin, off
# $PATH, so look there too. Idempotent: exits 0 at once when the binaries are already present;
# as root it installs them with apt-get; otherwise it says what to install and exits 1.
# Override discovery with PHALANX_PG_BINDIR (same variable as tests/pgserver.py).
set -euo pipefail

has_server() {
    local dir=$1
    [[ -x "$dir/initdb" && -x "$dir/pg_ctl" && -x "$dir/postgres" ]]
}

find_bindir() {
    local dir
    if [[ -n "${PHALANX_PG_BINDIR:-}" ]]; then
        has_server "$PHALANX_PG_BINDIR" && { echo "$PHALANX_PG_BINDIR"; return 0; }
        return 1
    fi
    if command -v pg_config >/dev/null 2>&1; then
        dir=$(pg_config --bindir 2>/dev/null || true)
        [[ -n "$dir" ]] && has_server "$dir" && { echo "$dir"; return 0; }
    fi
    for dir in $(ls -d /usr/lib/postgresql/*/bin /usr/pgsql-*/bin 2>/dev/null | sort -rV); do
        has_server "$dir" && { echo "$dir"; return 0; }
    done
    if command -v initdb >/dev/null 2>&1; then
        dir=$(dirname "$(command -v initdb)")
        has_server "$dir" && { echo "$dir"; return 0; }
    fi
    return 1
}

if bindir=$(find_bindir); then
    echo "ensure-postgres: PostgreSQL server binaries found in $bindir"
    exit 0
fi

if [[ -n "${PHALANX_PG_BINDIR:-}" ]]; then
    echo "ensure-postgres: PHALANX_PG_BINDIR=$PHALANX_PG_BINDIR lacks initdb/pg_ctl/postgres" >&2
    exit 1
fi

if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    cat >&2 <<'MSG'
ensure-postgres: PostgreSQL server binaries (initdb, pg_ctl, postgres) not found.
Install them, then re-run:
  Debian/Ubuntu:  sudo apt-get install -y --no-install-recommends postgresql-15   (or postgresql)
  Fedora/RHEL:    sudo dnf install -y postgresql-server
  macOS:          brew install postgresql@15
or point PHALANX_PG_BINDIR at a directory containing them.
MSG
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
echo "ensure-postgres: installing PostgreSQL server with apt-get"
apt-get update
if apt-cache show postgresql-15 >/dev/null 2>&1; then
    package=postgresql-15
else
    package=postgresql  # distribution's default major version
fi
apt-get install -y --no-install-recommends "$package"

if bindir=$(find_bindir); then
    echo "ensure-postgres: installed $package; server binaries in $bindir"
    exit 0
fi
echo "ensure-postgres: installed $package but still cannot find initdb/pg_ctl/postgres" >&2
exit 1
