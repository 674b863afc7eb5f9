"""Shared pytest fixtures (database URLs for SQLite and a throwaway PostgreSQL server), and
how `make test` spreads the suite over parallel workers.

The store contract suite is written once against ``db_url`` and runs on both backends, because
production HA deployments use PostgreSQL while single-node installs and most unit tests use
SQLite; divergence between the two is a bug we want to catch.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

_TESTS_DIR = Path(__file__).resolve().parent
_SRC_DIR = _TESTS_DIR.parent / "src"
# Make helper modules in tests/ (``from pgserver import PgServer``) and the package under src/
# importable regardless of how pytest was invoked (plain ``pytest`` or ``PYTHONPATH=src``).
for _path in (str(_TESTS_DIR), str(_SRC_DIR)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

# `make test` runs the suite in two parts (Makefile): everything but `serial` on parallel
# workers (pytest-xdist, `--dist loadgroup`), then the `serial` modules one at a time with
# nothing beside them. A module is serial when it asserts that something does NOT happen
# within a bound (no node declared DOWN across a failover or an outage, a wakeup or a watchdog
# ping within its interval): on a 2-core machine another module's load beside it could turn
# a pass into a false failure, and a flaky test is a failing test. A single test can say so
# itself with `@pytest.mark.serial`.
RUN_ALONE = frozenset(
    (
        "store/test_op_deadline.py",  # a cut round trip ends within 4 s
        *(
            f"system/{name}.py"
            for name in (
                "test_agent_restart",
                "test_control_plane_outage",
                "test_controller_restart",
                "test_db_cutoff",
                "test_db_failover",
                "test_ha",
                "test_heartbeat_rule",
                "test_node_failure",
                "test_partition",
                "test_store_outage",
                "test_systemd",
                "test_wakeups",
            )
        ),
    )
)
# Modules that change the same machine-wide state run one after another on one worker: these
# create Unix users and make /root searchable for their length (system/unixusers.py), which
# one module's cleanup would undo under another's feet.
SHARED_STATE = {
    f"system/{name}.py": "unix-users"
    for name in (
        "test_fairshare",
        "test_hostile_users",
        "test_isolation",
        "test_job_files",
        "test_multiuser",
        "test_patroni",
    )
}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects and xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark RUN_ALONE modules `serial`; keep each module on one worker (its module-scoped
    clusters are set up once), and SHARED_STATE modules on the same one."""
    for item in items:
        try:
            rel = item.path.resolve().relative_to(_TESTS_DIR).as_posix()
        except ValueError:  # a test outside tests/ (none today)
            continue
        if rel in RUN_ALONE:
            item.add_marker(pytest.mark.serial)
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(SHARED_STATE.get(rel, rel)))


from pgserver import PgServer, PostgresNotAvailable  # noqa: E402
from pgserver import in_ci as _in_ci  # noqa: E402


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """One PostgreSQL cluster for the whole session (starting one costs ~1-2 s).

    Skips when PostgreSQL is not installed (developer laptop), but fails under ``CI=true`` so a
    broken CI image cannot turn the PostgreSQL half of the suite into silent skips.  Any other
    start-up error propagates as a real error.
    """
    try:
        server = PgServer.start()
    except PostgresNotAvailable as exc:
        if _in_ci():
            pytest.fail(f"PostgreSQL is required in CI: {exc}", pytrace=False)
        pytest.skip(f"PostgreSQL not available: {exc}")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def pg_url(pg_server: PgServer) -> Iterator[str]:
    """SQLAlchemy URL of a fresh, empty database, dropped after the test.

    A database per test gives isolation as strong as a new server at a fraction of the cost.
    """
    name = f"t_{uuid.uuid4().hex}"
    url = pg_server.create_database(name)
    try:
        yield url
    finally:
        if pg_server.is_paused:  # a test that paused the server and failed before resuming
            pg_server.resume()
        pg_server.drop_database(name)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Database URL for each backend; ``-m "not postgres"`` runs the SQLite half only.

    ``pg_url`` is requested lazily so SQLite-only runs never start PostgreSQL.
    """
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/phalanx.db"
    url: str = request.getfixturevalue("pg_url")
    return url
