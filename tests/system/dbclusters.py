"""One lifecycle for the database clusters system tests start (tests/pgcluster.py's primary and
standby pair, tests/patronicluster.py's etcd and Patroni members).

Each is started for one test, skipped where its programs are missing (but failed under CI=true,
as tests/conftest.py does for PostgreSQL), and afterwards stopped and checked: no process left
running in its directory, the directory removed. Its logs are printed, so a failing test shows
them.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol, TypeVar

import pytest

from pgserver import in_ci


class DbCluster(Protocol):
    """What PgCluster and PatroniCluster both offer."""

    @property
    def base_dir(self) -> Path: ...

    def stop(self) -> None: ...

    def leftover_processes(self) -> list[int]: ...

    def log_tails(self, chars: int = 3000) -> str: ...


C = TypeVar("C", bound=DbCluster)


@contextlib.contextmanager
def running(
    start: Callable[[], C],
    *,
    unavailable: type[Exception] | tuple[type[Exception], ...],
    what: str,
    processes: str,
) -> Iterator[C]:
    """`start()` a cluster for the block; `what` names it in skip and failure messages and
    `processes` names what must not be left running (e.g. "PostgreSQL")."""
    try:
        cluster = start()
    except unavailable as exc:
        if in_ci():
            pytest.fail(f"{what} is required in CI: {exc}", pytrace=False)
        pytest.skip(f"{what} is not available: {exc}")
    try:
        yield cluster
    finally:
        print(cluster.log_tails(), file=sys.stderr)  # shown when the test fails
        base = cluster.base_dir
        cluster.stop()
        left = cluster.leftover_processes()
        assert not left, f"{processes} processes left behind: {left}"
        assert not base.exists(), f"{base} was not removed"
