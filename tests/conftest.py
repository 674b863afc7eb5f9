"""Shared pytest fixtures: database URLs for SQLite and a throwaway PostgreSQL server.

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
