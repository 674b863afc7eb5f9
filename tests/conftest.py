"""Shared pytest fixtures (database URLs for SQLite and a throwaway PostgreSQL server), and
how `make test` spreads the suite over parallel workers.

The store contract suite is written once against ``db_url`` and runs on both backends, because
production HA deployments use PostgreSQL while single-node installs and most unit tests use
SQLite; divergence between the two is a bug we want to catch.
"""

from __future__ import annotations

import contextlib
import json
import signal
import statistics
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

# `make test` runs the suite in three parts (Makefile): everything but `paired` and `serial` on
# parallel workers (pytest-xdist, `--dist loadfile`: a module's tests stay on one worker, so
# its module-scoped clusters and users are set up once), then the `paired` modules three at a
# time, then the `serial` ones one at a time with nothing beside them. Modules that run at once
# share nothing that one of them changes for the machine (the Unix users they make have names
# of their own; system/unixusers.py opens /root for search once for all of them).
#
# A module is `paired` when it asserts that something does NOT happen within a bound (no node
# declared DOWN across a failover or an outage, no lease flapping): beside the CPU-bound
# modules of the parallel part, a 2-core machine could starve it into a false failure, and a
# flaky test is a failing test. Its bounds are a fault's timeouts (seconds), which hold beside
# two other such modules: they mostly wait. A module is `serial` when its bound is tight
# enough that even that could break it (a cut round trip ends within 4 s, a wakeup within its
# interval). A single test can say so itself with `@pytest.mark.serial`.
RUN_ALONE = frozenset(
    (
        "store/test_op_deadline.py",  # a cut round trip ends within 4 s
        "system/test_heartbeat_rule.py",
        "system/test_wakeups.py",
    )
)
#: where `paired` and `serial` tests live (the Makefile's test target collects only these
#: for those parts)
TIMED_DIRS = ("store/", "system/")
RUN_PAIRED = frozenset(
    f"system/{name}.py"
    for name in (
        "test_agent_restart",
        "test_control_plane_outage",
        "test_controller_restart",
        "test_db_cutoff",
        "test_db_failover",
        "test_ha",
        "test_node_failure",
        "test_partition",
        "test_store_outage",
        "test_systemd",
    )
)


def pytest_itemcollected(item: pytest.Item) -> None:
    """Mark the RUN_ALONE modules' tests `serial` and the RUN_PAIRED ones' `paired`, as each
    is collected (before `-m` deselects in `pytest_collection_modifyitems`)."""
    try:
        rel = item.path.resolve().relative_to(_TESTS_DIR).as_posix()
    except ValueError:  # a test outside tests/ (none today)
        return
    if rel in RUN_ALONE:
        item.add_marker(pytest.mark.serial)
    elif rel in RUN_PAIRED:
        item.add_marker(pytest.mark.paired)
    marked = item.get_closest_marker("serial") or item.get_closest_marker("paired")
    if marked and not rel.startswith(TIMED_DIRS):
        # make test collects only these for its paired and serial parts (collecting all of
        # tests/ again costs ~12 s a part): a test marked elsewhere would never run
        raise pytest.UsageError(
            f"{item.nodeid} is marked {marked.name} outside {', '.join(TIMED_DIRS)}: move it "
            "there, or add its directory to TIMED_DIRS and to the Makefile's test target"
        )


def _module_seconds() -> dict[str, float]:
    """Each module's seconds in a recent run (tests/module_seconds.json, written by
    scripts/test-durations.py); a module missing there gets its directory's median."""
    path = _TESTS_DIR / "module_seconds.json"
    try:
        known: dict[str, float] = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return known


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest modules first (`make test` runs with `--dist loadfile --no-loadscope-reorder`,
    so the parallel workers take whole modules in this order): a long module started last
    would run alone at the end while the other workers idle. xdist's own order (most tests
    first) put a 45 s one-test module (Snakemake) at the very end. The order of the tests
    inside a module is kept."""
    seconds = _module_seconds()
    if not seconds:
        return
    by_dir: dict[str, list[float]] = {}
    for module, s in seconds.items():
        by_dir.setdefault(module.split("/")[0], []).append(s)
    median = {d: statistics.median(v) for d, v in by_dir.items()}

    def weight(item: pytest.Item) -> float:
        try:
            rel = item.path.resolve().relative_to(_TESTS_DIR).as_posix()
        except ValueError:
            return 0.0
        return seconds.get(rel, median.get(rel.split("/")[0], 0.0))

    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (-weight(item), str(item.path), order[id(item)]))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """Fail a test that leaves the test process blocking or ignoring a signal (and undo it):
    every process the later tests start would inherit that, and a ^C or a SIGINT those tests
    send would be lost (the way `test_salloc` and `test_command_server` failed, twice in
    three suite runs, and never alone)."""
    result = yield
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    changed = {
        s.name: signal.getsignal(s)
        for s, default in _SIGNAL_DEFAULTS.items()
        if signal.getsignal(s) is not default
    }
    if blocked or changed:
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        for s, default in _SIGNAL_DEFAULTS.items():
            signal.signal(s, default)
        raise AssertionError(
            f"the test left the test process's signals changed: blocked {sorted(blocked)}, "
            f"handlers {changed}"
        )
    return result


#: the handlers the test process starts with (pytest-timeout's SIGALRM is its own business)
_SIGNAL_DEFAULTS = {
    signal.SIGINT: signal.default_int_handler,
    signal.SIGTERM: signal.SIG_DFL,
    signal.SIGHUP: signal.SIG_DFL,
    signal.SIGQUIT: signal.SIG_DFL,
}


from pgserver import PgServer, PostgresNotAvailable  # noqa: E402
from pgserver import in_ci as _in_ci  # noqa: E402
from schema_copy import fresh_db, migrate_new, migrate_url  # noqa: E402


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
    with _test_database(pg_server) as url:
        yield url


@contextlib.contextmanager
def _test_database(server: PgServer, template: str | None = None) -> Iterator[str]:
    """A new database for one test (empty, or a copy of `template`), dropped after it."""
    name = f"t_{uuid.uuid4().hex}"
    url = server.create_database(name, template=template)
    try:
        yield url
    finally:
        if server.is_paused:  # a test that paused the server and failed before resuming
            server.resume()
        server.drop_database(name)


@pytest.fixture(scope="session")
def schema_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty SQLite database at the latest schema, migrated once a session (schema_copy.py)."""
    return migrate_new(tmp_path_factory.mktemp("schema") / "migrated.db")


@pytest.fixture(scope="session")
def pg_schema(pg_server: PgServer) -> str:
    """The name of a PostgreSQL database at the latest schema, migrated once a session: the
    template `migrated_db_url` copies (schema_copy.py)."""
    name = f"schema_{uuid.uuid4().hex}"
    migrate_url(pg_server.create_database(name))
    return name


@pytest.fixture
def migrated_pg_url(pg_server: PgServer, pg_schema: str) -> Iterator[str]:
    """Like `pg_url`, a new PostgreSQL database for the test alone, but already at the latest
    schema (a copy of `pg_schema`)."""
    with _test_database(pg_server, pg_schema) as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def migrated_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Like `db_url`, a new database of each backend for the test alone, but already at the
    latest schema: a copy of one migrated once a session (the store tests' databases)."""
    if request.param == "sqlite":
        return fresh_db(request.getfixturevalue("schema_db"), tmp_path / "phalanx.db")
    url: str = request.getfixturevalue("migrated_pg_url")
    return url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Database URL for each backend; ``-m "not postgres"`` runs the SQLite half only.

    ``pg_url`` is requested lazily so SQLite-only runs never start PostgreSQL.
    """
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/phalanx.db"
    url: str = request.getfixturevalue("pg_url")
    return url
