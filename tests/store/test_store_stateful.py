"""Model-based test of the store (SQLite): random interleavings of what users, the scheduler,
agents and the failure detector do, with the safety invariants checked after every step.

Invariants:
* no node is over-committed (cpus, memory, GPU devices) by attempts that have not ENDED;
* no job has two attempts that have not ENDED, and a job holds an attempt iff it is active;
* the scheduler lease's term never goes backwards, and a stale fence writes nothing;
* no submitted job is ever lost, and every job has a valid state;
* a job in a terminal state never changes state again.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    rule,
)
from sqlalchemy import select

from phalanx.config import load_config
from phalanx.controller.runtime import partition_rows
from phalanx.domain import scheduling
from phalanx.domain.spec import JobSpec, normalize
from phalanx.domain.states import ACTIVE, JobState
from phalanx.errors import Fenced
from phalanx.store import schema as s
from phalanx.store.store import Fence, Store, TaskReport
from schema_copy import fresh_db, migrate_new

NODES: dict[str, dict[str, Any]] = {
    "n1": {"cpus": 4, "mem_mb": 4096, "gpus": [[0, "a100"], [1, "a100"]]},
    "n2": {"cpus": 4, "mem_mb": 4096, "gpus": []},
    "n3": {"cpus": 2, "mem_mb": 2048, "gpus": [[0, "t4"]]},
}
LEASE = "sched"


@functools.cache
def _schema() -> Path:
    """A database at the latest schema, migrated once a module (each example copies it)."""
    return migrate_new(Path(tempfile.mkdtemp(prefix="phx-stateful-schema-")) / "migrated.db")


class StoreMachine(RuleBasedStateMachine):
    jobs = Bundle("jobs")

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="phx-stateful-")
        self.store = Store(fresh_db(_schema(), Path(self.dir) / "phalanx.db"), actor="model")
        self.store.sync_partitions(partition_rows(load_config(overrides={"timing": {}})))
        self.submitted: list[int] = []
        self.terminal: dict[int, tuple[str, float | None]] = {}
        self.holder_n = 0
        self.fence: Fence | None = None
        self.max_term = 0

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ setup
    @initialize()
    def boot(self) -> None:
        for name, r in NODES.items():
            self.store.register_node(
                name,
                cpus=r["cpus"],
                mem_mb=r["mem_mb"],
                gpus=r["gpus"],
                features=[],
                addr=None,
                boot_id="b0",
                version="t",
            )
        self._take_lease()

    def _take_lease(self) -> None:
        self.holder_n += 1
        holder = f"ctl{self.holder_n}"
        term = self.store.acquire_lease(LEASE, holder, ttl=3600)
        assert term is not None, "a released lease must be free to take"
        assert term > self.max_term
        self.max_term = term
        self.fence = Fence(LEASE, holder, term)

    # ------------------------------------------------------------------ helpers
    def _live_tasks(self, states: tuple[str, ...]) -> list[dict[str, Any]]:
        with self.store.db.begin(write=False) as conn:
            rows = conn.execute(
                select(s.tasks.c.attempt_id, s.tasks.c.node, s.tasks.c.state, s.attempts.c.token)
                .join(s.attempts, s.attempts.c.id == s.tasks.c.attempt_id)
                .where(s.attempts.c.state != "ENDED", s.tasks.c.state.in_(states))
                .order_by(s.tasks.c.attempt_id, s.tasks.c.node)
            ).mappings()
            return [dict(r) for r in rows]

    def _jobs_table(self) -> list[dict[str, Any]]:
        with self.store.db.begin(write=False) as conn:
            return [dict(r) for r in conn.execute(select(s.jobs).order_by(s.jobs.c.id)).mappings()]

    # ------------------------------------------------------------------ users
    @rule(
        target=jobs,
        nodes=st.integers(1, 2),
        cpus=st.integers(1, 4),
        mem=st.sampled_from([256, 1024, 3000]),
        gpus=st.sampled_from([0, 0, 1, 2]),
        requeue=st.booleans(),
        array=st.sampled_from([None, None, "0-2", "0-3%2"]),
        hold=st.sampled_from([False, False, False, True]),
        dep=st.sampled_from([None, None, "afterok", "afterany", "afternotok"]),
        data=st.data(),
    )
    def submit(
        self,
        nodes: int,
        cpus: int,
        mem: int,
        gpus: int,
        requeue: bool,
        array: str | None,
        hold: bool,
        dep: str | None,
        data: st.DataObject,
    ) -> Any:
        dependency = None
        if dep and self.submitted:
            dependency = f"{dep}:{data.draw(st.sampled_from(self.submitted))}"
        spec = JobSpec(
            argv=["/bin/true"],
            nodes=nodes,
            cpus_per_task=cpus,
            mem_mb=mem,
            gpus_per_node=gpus or None,
            requeue=requeue,
            array=array,
            hold=hold,
            dependency=dependency,
            name=data.draw(st.sampled_from(["a", "b"])),
        )
        resolved = normalize(
            spec, self.store.partition_infos(), default_mem_per_cpu_mb=512, default_requeue=True
        )
        (ids,) = self.store.submit([(resolved, spec.model_dump(exclude={"ignored"}))], "u")
        self.submitted.extend(ids)
        return multiple(*ids)

    @rule(job=jobs, action=st.sampled_from(["cancel", "hold", "release"]))
    def user_action(self, job: int, action: str) -> None:
        getattr(self.store, action)([job], "user")

    # ------------------------------------------------------------------ scheduler
    @rule()
    def schedule(self) -> None:
        snap = self.store.sched_snapshot()
        plan = scheduling.plan(snap, time.time())
        for jid, why in plan.never:
            self.store.end_pending(jid, JobState.CANCELLED, why, self.fence)
        exclusive = {int(j["id"]): bool(j["exclusive"]) for j in snap.pending}
        self.store.start_attempts(
            [p.start_item(exclusive=exclusive[p.job_id]) for p in plan.starts],
            self.fence,
        )

    @rule(stale_write=st.booleans())
    def failover(self, stale_write: bool) -> None:
        """Another controller takes the scheduler duty (the old one released or expired).

        Then, maybe, the paused old leader wakes up and tries to write under its old term.
        """
        assert self.fence is not None
        assert self.store.release_lease(LEASE, self.fence.holder, self.fence.term)
        old = self.fence
        self._take_lease()
        if not stale_write:
            return
        before = self._jobs_table()
        pending = [j["id"] for j in before if j["state"] == "PENDING"]
        try:
            if pending:
                self.store.start_attempts(
                    [
                        {
                            "job_id": pending[0],
                            "partition": "batch",
                            "nodes": ["n2"],
                            "cpus_per_node": 1,
                            "mem_per_node_mb": [1],
                            "gpu_ids": [[]],
                            "exclusive": False,
                        }
                    ],
                    old,
                )
            else:
                self.store.fail_node_tasks("n2", "stale", old)
        except Fenced:
            pass
        else:
            raise AssertionError("a stale fence was accepted")
        assert self._jobs_table() == before

    # ------------------------------------------------------------------ agents
    @rule(data=st.data())
    def report_running(self, data: st.DataObject) -> None:
        tasks = self._live_tasks(("STARTING",))
        if not tasks:
            return
        t = data.draw(st.sampled_from(tasks))
        self.store.apply_reports(
            t["node"],
            [TaskReport(t["attempt_id"], t["token"], "running", started_at=time.time())],
            time.time(),
        )

    @rule(data=st.data(), code=st.sampled_from([0, 0, 1]), timed_out=st.booleans())
    def report_exit(self, data: st.DataObject, code: int, timed_out: bool) -> None:
        tasks = self._live_tasks(("STARTING", "RUNNING"))
        if not tasks:
            return
        t = data.draw(st.sampled_from(tasks))
        ex: dict[str, Any] = {"exit_code": code, "started_at": time.time()}
        if timed_out:
            ex.update(exit_code=None, signal=9, timed_out=True)
        self.store.apply_reports(
            t["node"], [TaskReport(t["attempt_id"], t["token"], "exited", exit=ex)], None
        )

    @rule(
        node=st.sampled_from(sorted(NODES)), what=st.sampled_from(["down", "agent_restart", "back"])
    )
    def node_event(self, node: str, what: str) -> None:
        if what == "down":  # the failure detector declares it DOWN
            self.store.mark_down(node, "no heartbeat", self.fence)
            self.store.fail_node_tasks(node, f"node {node} is DOWN", self.fence)
        elif what == "agent_restart":  # the agent lost its memory: it reports nothing
            self.store.apply_reports(node, [], time.time() + 1)
        else:  # it registers again (back from DOWN, or a no-op re-registration)
            r = NODES[node]
            self.store.register_node(
                node,
                cpus=r["cpus"],
                mem_mb=r["mem_mb"],
                gpus=r["gpus"],
                features=[],
                addr=None,
                boot_id="b1",
                version="t",
            )

    # ------------------------------------------------------------------ invariants
    @invariant()
    def no_node_overcommitted(self) -> None:
        with self.store.db.begin(write=False) as conn:
            rows = conn.execute(
                select(s.tasks.c.node, s.tasks.c.cpus, s.tasks.c.mem_mb, s.tasks.c.gpu_ids)
                .join(s.attempts, s.attempts.c.id == s.tasks.c.attempt_id)
                .where(s.attempts.c.state != "ENDED")
            ).all()
        cpus: Counter[str] = Counter()
        mem: Counter[str] = Counter()
        gpus: dict[str, list[int]] = {n: [] for n in NODES}
        for node, c, m, g in rows:
            cpus[node] += c
            mem[node] += m
            gpus[node].extend(g or [])
        for node, r in NODES.items():
            assert cpus[node] <= r["cpus"], f"{node}: {cpus[node]} cpus allocated of {r['cpus']}"
            assert mem[node] <= r["mem_mb"], f"{node}: {mem[node]} MB allocated of {r['mem_mb']}"
            assert len(gpus[node]) == len(set(gpus[node])), f"{node}: GPU given twice {gpus[node]}"
            assert set(gpus[node]) <= {i for i, _ in r["gpus"]}, f"{node}: unknown GPU {gpus[node]}"

    @invariant()
    def one_live_attempt_per_active_job(self) -> None:
        with self.store.db.begin(write=False) as conn:
            live = conn.execute(
                select(s.attempts.c.job_id, s.attempts.c.id).where(s.attempts.c.state != "ENDED")
            ).all()
        per_job = Counter(j for j, _ in live)
        assert all(n == 1 for n in per_job.values()), f"jobs with several live attempts: {per_job}"
        live_of = {j: a for j, a in live}
        for job in self._jobs_table():
            active = JobState(job["state"]) in ACTIVE
            assert active == (job["id"] in live_of), (job["id"], job["state"], live_of)
            if active:
                assert job["attempt_id"] == live_of[job["id"]]

    @invariant()
    def lease_term_monotonic(self) -> None:
        lease = self.store.get_lease(LEASE)
        if lease is None:
            return
        assert lease["term"] == self.max_term
        assert self.fence is not None and lease["holder"] == self.fence.holder

    @invariant()
    def no_job_lost_and_terminal_is_final(self) -> None:
        rows = {j["id"]: j for j in self._jobs_table()}
        assert set(self.submitted) <= set(rows), set(self.submitted) - set(rows)
        assert len(rows) == len(self.submitted)
        for jid, job in rows.items():
            state = JobState(job["state"])  # raises on an unknown state
            if jid in self.terminal:
                assert (job["state"], job["end_time"]) == self.terminal[jid], (
                    f"terminal job {jid} changed: {self.terminal[jid]} -> {job['state']}"
                )
            elif state.terminal:
                assert job["end_time"] is not None
                self.terminal[jid] = (job["state"], job["end_time"])


StoreMachine.TestCase.settings = settings(
    max_examples=15,
    stateful_step_count=30,
    deadline=None,
    # Shrinking a run that rebuilds a database per example can take many minutes; an unshrunk
    # failure still prints every step, which is enough to reproduce it.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestStoreStateful = StoreMachine.TestCase
