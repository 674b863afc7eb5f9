"""Remove empty node cgroups left by agents: ``<...>/phalanx/<node>-<8 hex>`` under /sys/fs/cgroup.

Before agents removed their own roots when stopping (agent/cgroup_roots.py), every test run
and local cluster left one per node and hierarchy.  This removes those that are EMPTY, and
nothing else: each candidate is one ``rmdir``, which the kernel refuses for a cgroup that
still holds processes or child cgroups (they are counted as busy and left alone).  Roots
changed in the last ``--min-age`` seconds are skipped too, so an agent that is making its
root right now (another test run) is not disturbed.  The shared ``phalanx`` directories stay.

    sudo python3 scripts/clean-cgroup-leftovers.py [--dry-run] [--min-age SECONDS]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Iterator

CGROUP_FS = "/sys/fs/cgroup"
ROOT_NAME = re.compile(r"[A-Za-z0-9._-]+-[0-9a-f]{8}")
MAX_DEPTH = 8  # v1: <hierarchy>/<agent's cgroup>/phalanx; v2: <parent of the agent>/phalanx


def is_leftover_name(name: str) -> bool:
    """A node root's name: ``<node>-<8 hex digits>`` (pure)."""
    return ROOT_NAME.fullmatch(name) is not None


def phalanx_dirs(top: str, depth: int = MAX_DEPTH) -> Iterator[str]:
    """Every ``phalanx`` directory under ``top`` (not looking inside them)."""
    try:
        entries = list(os.scandir(top))
    except OSError:
        return
    for e in entries:
        if not e.is_dir(follow_symlinks=False):
            continue
        if e.name == "phalanx":
            yield e.path
        elif depth > 1:
            yield from phalanx_dirs(e.path, depth - 1)


def looks_empty(d: str) -> bool:
    """No child cgroups and no processes (for --dry-run; a real run lets rmdir decide)."""
    try:
        if any(e.is_dir(follow_symlinks=False) for e in os.scandir(d)):
            return False
        with open(f"{d}/cgroup.procs") as f:
            return not f.read().strip()
    except FileNotFoundError:
        return True  # no cgroup.procs: not a cgroupfs (tests); emptiness is the rmdir's
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="only count what would be removed")
    ap.add_argument("--min-age", type=float, default=600.0, help="skip roots changed since (s)")
    ap.add_argument("--top", default=CGROUP_FS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    removed = busy = young = 0
    now = time.time()
    for parent in sorted(phalanx_dirs(args.top)):
        try:
            names = sorted(os.listdir(parent))
        except OSError:
            continue
        for name in names:
            d = f"{parent}/{name}"
            if not is_leftover_name(name) or not os.path.isdir(d) or os.path.islink(d):
                continue
            try:
                if now - os.stat(d).st_mtime < args.min_age:
                    young += 1
                    continue
                if args.dry_run:
                    if not looks_empty(d):
                        busy += 1
                        continue
                else:
                    os.rmdir(d)  # refused (EBUSY) while it has processes or children
                removed += 1
            except FileNotFoundError:
                continue
            except OSError:
                busy += 1
    what = "would remove" if args.dry_run else "removed"
    print(
        f"{what} {removed} empty node cgroups; {busy} not empty (kept); "
        f"{young} changed in the last {args.min_age:g}s (skipped)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
