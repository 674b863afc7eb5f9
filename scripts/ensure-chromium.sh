#!/usr/bin/env bash
# Make sure Debian's chromium is installed for the dashboard's browser tests.
#
# Why: tests/system/test_dashboard.py drives a real headless Chromium through Playwright, using
# the system browser (/usr/bin/chromium): Playwright's own browser downloads are never used, and
# CI must not skip the tests for want of a browser. Idempotent: exits 0 at once when chromium is
# there; as root it installs it with apt-get; otherwise it says what to install and exits 1.
# Override discovery with PHALANX_CHROMIUM (same variable as the tests).
set -euo pipefail

browser=${PHALANX_CHROMIUM:-/usr/bin/chromium}
if [[ -x "$browser" ]]; then
    echo "ensure-chromium: $browser found"
    exit 0
fi
if [[ -n "${PHALANX_CHROMIUM:-}" ]]; then
    echo "ensure-chromium: PHALANX_CHROMIUM=$PHALANX_CHROMIUM is not an executable" >&2
    exit 1
fi
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    cat >&2 <<'MSG'
ensure-chromium: /usr/bin/chromium not found.
Install it, then re-run:
  Debian/Ubuntu:  sudo apt-get install -y --no-install-recommends chromium
or point PHALANX_CHROMIUM at a Chromium or Chrome executable.
MSG
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
echo "ensure-chromium: installing chromium with apt-get"
apt-get update
apt-get install -y --no-install-recommends chromium
if [[ -x /usr/bin/chromium ]]; then
    echo "ensure-chromium: installed $(/usr/bin/chromium --version 2>/dev/null || echo chromium)"
    exit 0
fi
echo "ensure-chromium: installed chromium but /usr/bin/chromium is still missing" >&2
exit 1
