"""The scheduling snapshot's reads of live attempts (allocations, --group holders, licences
held) go through ix_attempts_state: a store that has served for months holds a million ended
attempts, and reading them all three times a pass made every pass (and every submission
competing with it) slower as the store grew (docs/scheduling.md)."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select, text

from phalanx.domain.states import AttemptState
from phalanx.store import schema as s
from phalanx.store.sqlbits import HOLDING, active_tasks, attempt_holds
from phalanx.store.store import Store


def _plan(store: Store, q: object) -> str:
    with store.db.begin(write=False) as conn:
        sql = str(q.compile(conn, compile_kwargs={"literal_binds": True}))  # type: ignore[attr-defined]
        return " | ".join(str(r[-1]) for r in conn.execute(text("EXPLAIN QUERY PLAN " + sql)))


def test_live_attempts_are_found_by_the_state_index(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'p.db'}", actor="test")
    try:
        store.migrate()
        assert set(HOLDING) == {a.value for a in AttemptState} - {AttemptState.ENDED.value}
        for q in (
            active_tasks(s.tasks.c.node, s.attempts.c.job_id),
            select(s.attempts.c.job_id).where(attempt_holds()),
        ):
            plan = _plan(store, q)
            assert "ix_attempts_state" in plan, plan
        # the old form could not use it: a scan of every attempt
        old = select(s.attempts.c.job_id).where(s.attempts.c.state != AttemptState.ENDED.value)
        assert "ix_attempts_state" not in _plan(store, old)
    finally:
        store.close()
