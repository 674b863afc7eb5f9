"""Fixtures for system tests: clusters of real processes, always cleaned up, logs shown on failure."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from system.harness import Cluster

CLUSTERS = pytest.StashKey[list[Cluster]]()


@pytest.fixture
def make_cluster(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[Callable[..., Cluster]]:
    """Factory of (not yet started) clusters rooted under tmp_path; all are torn down after."""
    made: list[Cluster] = []
    request.node.stash[CLUSTERS] = made

    def make(**kw: object) -> Cluster:
        c = Cluster(tmp_path / f"c{len(made)}", **kw)  # type: ignore[arg-type]
        made.append(c)
        return c

    yield make
    swept = []
    for c in made:
        swept += c.cleanup()
    if swept:
        print(f"system-test cleanup had to sweep up stray processes: {swept}", file=sys.stderr)


@pytest.fixture
def cluster(make_cluster: Callable[..., Cluster]) -> Cluster:
    return make_cluster()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    rep = yield
    if rep.failed and rep.when in ("setup", "call"):
        for c in item.stash.get(CLUSTERS, []):
            rep.sections.append((f"daemon logs of {c.root}", c.log_tails()))
    return rep
