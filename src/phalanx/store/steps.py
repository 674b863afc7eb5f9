"""Job steps in the store: created by `srun` inside a running job, run by the agents of the
allocation's nodes, recorded per node, ended with the job's attempt at the latest.

Steps belong to an attempt: a requeued job starts numbering its steps at 0 again, as a new
Slurm allocation does.  The agent protocol for steps is level-triggered like the one for
tasks (controller/exchange.py): the store holds which step tasks should run on each node and
the signals asked of them; the agents report what runs.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Select, bindparam, func, insert, or_, select, update

from phalanx.domain.states import AttemptState, JobState
from phalanx.domain.steps import AllocNode, StepRequest, plan_step, step_outcome, step_usage
from phalanx.errors import InvalidTransition, NotFound
from phalanx.store import schema as s
from phalanx.store.base import StoreBase
from phalanx.store.prebuilt import Prebuilt, select_where
from phalanx.store.sqlbits import NODE_WORK_COLUMNS
from phalanx.store.sqlbits import now as _now

RUNNING = "RUNNING"
_LIVE_NODE = ("STARTING", "RUNNING")
MAX_SIGNALS = 64  # a step keeps its latest signal requests only (agents dedupe by seq)


@dataclass
class StepReport:
    """What an agent says about one step's tasks on its node."""

    attempt_id: int
    step_id: int
    token: str
    state: str  # "starting" | "running" | "exited" | "lost"
    started_at: float | None = None
    exits: list[dict[str, Any]] = field(default_factory=list)  # per task, when exited


class JobSteps(StoreBase):
    """Steps of running jobs (`srun`): create, hand to nodes, record, signal, end."""

    def create_step(
        self,
        job_id: int,
        req: StepRequest,
        spec: dict[str, Any],
        name: str,
        actor: str,
        *,
        launch_rows: bool = False,
    ) -> dict[str, Any]:
        """Start a step in the job's running allocation; refuses (InvalidSpec) what the
        allocation cannot hold, and a job that is not running.  With `launch_rows`, the
        result's ``launch_rows`` are the step's node_step_work rows, read in the same
        transaction (for a direct launch: no node reads them before srun hands them over)."""
        now = _now()
        with self.db.begin() as conn:
            job = (
                conn.execute(
                    select(s.jobs.c.id, s.jobs.c.state, s.jobs.c.attempt_id).where(
                        s.jobs.c.id == job_id
                    )
                )
                .mappings()
                .first()
            )
            if job is None:
                raise NotFound(f"job {job_id} not found", job_id=job_id)
            att = None
            if job["attempt_id"] is not None:
                att = (
                    conn.execute(select(s.attempts).where(s.attempts.c.id == job["attempt_id"]))
                    .mappings()
                    .first()
                )
            # STARTING too: the batch step may run srun before its node's report of it arrives
            if (
                job["state"] not in (JobState.STARTING.value, JobState.RUNNING.value)
                or att is None
                or att["state"] not in (AttemptState.STARTING.value, AttemptState.RUNNING.value)
            ):
                raise InvalidTransition(
                    f"job {job_id} is {job['state']}: srun starts steps only in a running job",
                    job_id=job_id,
                )
            alloc = [
                AllocNode(str(t.node), int(t.cpus), tuple(int(g) for g in (t.gpu_ids or [])))
                for t in conn.execute(
                    select(s.tasks.c.node, s.tasks.c.cpus, s.tasks.c.gpu_ids)
                    .where(s.tasks.c.attempt_id == att["id"], s.tasks.c.spare.is_(False))
                    .order_by(s.tasks.c.rank)
                )
            ]
            plan = plan_step(req, alloc)
            step_id = int(
                conn.execute(
                    select(func.coalesce(func.max(s.steps.c.step_id) + 1, 0)).where(
                        s.steps.c.attempt_id == att["id"]
                    )
                ).scalar_one()
            )
            full_spec = {**spec, "task_ids": plan.task_ids, "gpus": plan.gpus}
            conn.execute(
                insert(s.steps).values(
                    attempt_id=att["id"],
                    step_id=step_id,
                    job_id=job_id,
                    name=name[:256],
                    state=RUNNING,
                    nodes=plan.nodes,
                    tasks=plan.tasks,
                    spec=full_spec,
                    signals=[],
                    created_at=now,
                )
            )
            conn.execute(
                insert(s.step_nodes),
                [
                    {"attempt_id": att["id"], "step_id": step_id, "node": n, "state": "STARTING"}
                    for n in plan.nodes
                ],
            )
            self._event(
                conn,
                "step.start",
                f"step {job_id}.{step_id} ({name}): {sum(plan.tasks)} tasks on "
                f"{','.join(plan.nodes)}",
                job_id=job_id,
                actor=actor,
                data={"step_id": step_id, "nodes": plan.nodes, "tasks": plan.tasks},
            )
            self._bump_gen(conn, plan.nodes)
            rows = (
                [
                    dict(r)
                    for r in conn.execute(
                        _step_launch_query(), {"attempt_id": att["id"], "step_id": step_id}
                    ).mappings()
                ]
                if launch_rows
                else []
            )
            gens = {
                str(r.name): int(r.work_gen)
                for r in conn.execute(
                    select(s.nodes.c.name, s.nodes.c.work_gen).where(s.nodes.c.name.in_(plan.nodes))
                )
            }
        return {
            "job_id": job_id,
            "step_id": step_id,
            "attempt_id": int(att["id"]),
            "nodes": plan.nodes,
            "tasks": plan.tasks,
            "task_ids": plan.task_ids,
            "work_gens": gens,  # for the caller's wakeups (Controller.woke), not the API
            "launch_rows": rows,  # node_step_work rows of the new step (direct launch)
        }

    def node_step_work(self, node: str, conn: Connection | None = None) -> list[dict[str, Any]]:
        """Every step of a live attempt with tasks on this node not yet recorded as ended
        (in `conn`'s transaction when given: an exchange reads it with the node's task work)."""
        if conn is not None:
            return _node_step_work_query().rows(conn, {"node": node})
        with self.db.begin(write=False) as c:
            return _node_step_work_query().rows(c, {"node": node})

    def apply_step_reports(self, node: str, reports: Sequence[StepReport]) -> bool:
        """Record what an agent says about its step tasks; end steps whose every node is done.
        Returns whether anything changed.

        One heartbeat carries the reports of every step that started or ended on the node
        since the last (a loop of short steps: several), so they are applied together: one
        read of the node's rows, one statement per kind of change (executemany), one read of
        the steps that may have ended; a constant number of statements per heartbeat instead
        of a few per report (docs/slurm.md, "What a step costs")."""
        latest = {(rep.attempt_id, rep.step_id): rep for rep in reports}  # the last one wins
        if not latest:
            return False
        now = _now()
        with self.db.begin() as conn:
            rows = {
                (int(r["attempt_id"]), int(r["step_id"])): r
                for r in conn.execute(
                    _live_step_nodes_query(),
                    {"node": node, "attempt_ids": sorted({a for a, _ in latest})},
                ).mappings()
            }
            started: list[dict[str, Any]] = []
            ended: list[dict[str, Any]] = []
            for key, rep in latest.items():
                row = rows.get(key)
                if row is None or row["token"] != rep.token:
                    continue
                ids = {"a": rep.attempt_id, "s": rep.step_id, "n": node}
                if rep.state == "running" and row["state"] == "STARTING":
                    started.append({**ids, "started": rep.started_at or now})
                elif rep.state in ("exited", "lost"):
                    ended.append(
                        {
                            **ids,
                            "st": "EXITED" if rep.state == "exited" else "LOST",
                            "started": row["started_at"] or rep.started_at,
                            "ended": now,
                            "xs": list(rep.exits),
                        }
                    )
            if started:
                conn.execute(_mark_step_node_running(), started)
                conn.execute(_set_step_start_time(), started)
            if ended:
                conn.execute(_mark_step_node_ended(), ended)
                self._end_finished_steps(conn, {(e["a"], e["s"]) for e in ended}, now)
        return bool(started or ended)

    def _end_finished_steps(self, conn: Connection, keys: set[tuple[int, int]], now: float) -> None:
        """End each of these steps whose every node has reported its tasks' end."""
        per_step: dict[tuple[int, int], list[Any]] = {k: [] for k in keys}
        for r in conn.execute(  # by both ids: an attempt may have run thousands of steps
            select(s.step_nodes).where(
                s.step_nodes.c.attempt_id.in_(sorted({a for a, _ in keys})),
                s.step_nodes.c.step_id.in_(sorted({sid for _, sid in keys})),
            )
        ).mappings():
            key = (int(r["attempt_id"]), int(r["step_id"]))
            if key in per_step:
                per_step[key].append(r)
        done = {
            k: rs for k, rs in per_step.items() if not any(r["state"] in _LIVE_NODE for r in rs)
        }
        if not done:
            return
        steps = [
            st
            for st in conn.execute(
                select(s.steps).where(
                    s.steps.c.attempt_id.in_(sorted({a for a, _ in done})),
                    s.steps.c.step_id.in_(sorted({sid for _, sid in done})),
                    s.steps.c.state == RUNNING,
                )
            ).mappings()
            if (int(st["attempt_id"]), int(st["step_id"])) in done
        ]
        updates, events = [], []
        for step in steps:
            step_id = int(step["step_id"])
            rows = done[(int(step["attempt_id"]), step_id)]
            exits = [ex for r in rows for ex in (r["exits"] or [])]
            usage = step_usage([(str(r["node"]), ex) for r in rows for ex in (r["exits"] or [])])
            state, code, sig = step_outcome(
                exits,
                lost=any(r["state"] == "LOST" for r in rows),
                stop_reason=step["stop_reason"],
            )
            started = [r["started_at"] for r in rows if r["started_at"] is not None]
            updates.append(
                {
                    "a": int(step["attempt_id"]),
                    "s": step_id,
                    "st": state,
                    "end": now,
                    "code": code,
                    "sig": sig,
                    "start": step["start_time"] or (min(started) if started else None),
                    "usage": usage,
                }
            )
            events.append(
                {
                    "kind": "step.end",
                    "message": f"step {step['job_id']}.{step_id} {state}"
                    + (f" exit code {code}" if code is not None else "")
                    + (f" signal {sig}" if sig else ""),
                    "job_id": int(step["job_id"]),
                    "data": {"step_id": step_id, "state": state, "exit_code": code, "signal": sig},
                }
            )
        if updates:
            conn.execute(_end_step(), updates)
            self._events_many(conn, events)

    def _end_steps_of_attempt(
        self, conn: Connection, attempt_id: int, result: JobState, now: float
    ) -> None:
        """The attempt ended: steps still running end with it (a node failure is theirs too;
        steps left when the batch step ends are cancelled, as Slurm's), and nodes that never
        reported their step tasks' end are marked lost so nothing waits for them."""
        state = (
            result.value
            if result in (JobState.NODE_FAIL, JobState.TIMEOUT, JobState.OUT_OF_MEMORY)
            else "CANCELLED"
        )
        running = select_where(
            conn, s.steps, {"attempt_id": attempt_id, "state": RUNNING}, cols=("step_id", "nodes")
        )
        if not running:
            return
        conn.execute(
            update(s.steps)
            .where(s.steps.c.attempt_id == attempt_id, s.steps.c.state == RUNNING)
            .values(state=state, end_time=now)
        )
        conn.execute(
            update(s.step_nodes)
            .where(s.step_nodes.c.attempt_id == attempt_id, s.step_nodes.c.state.in_(_LIVE_NODE))
            .values(state="LOST", ended_at=now)
        )
        self._bump_gen(conn, sorted({n for r in running for n in r["nodes"]}))

    def signal_steps(self, job_id: int, signum: int, step_id: int | None, actor: str) -> list[int]:
        """Ask the running steps of the job (or one of them) for a signal; returns their ids.
        Level-triggered: the agents deliver each request once, by its sequence number."""
        with self.db.begin() as conn:
            rows = self._running_steps(conn, job_id, step_id)
            for r in rows:
                signals = list(r["signals"] or [])
                seq = (signals[-1]["seq"] + 1) if signals else 1
                signals = [*signals, {"seq": seq, "signum": int(signum)}][-MAX_SIGNALS:]
                conn.execute(
                    update(s.steps)
                    .where(
                        s.steps.c.attempt_id == r["attempt_id"],
                        s.steps.c.step_id == r["step_id"],
                    )
                    .values(signals=signals)
                )
                self._bump_gen(conn, list(r["nodes"]))
            if rows:
                self._event(
                    conn,
                    "step.signal",
                    f"signal {signum} to step(s) "
                    + ",".join(f"{job_id}.{r['step_id']}" for r in rows),
                    job_id=job_id,
                    actor=actor,
                )
        return [int(r["step_id"]) for r in rows]

    def cancel_steps(self, job_id: int, step_id: int | None, reason: str, actor: str) -> list[int]:
        """Stop the job's running steps (or one of them): their tasks get SIGTERM, then
        SIGKILL after the kill grace; the job goes on."""
        with self.db.begin() as conn:
            rows = self._running_steps(conn, job_id, step_id)
            for r in rows:
                conn.execute(
                    update(s.steps)
                    .where(
                        s.steps.c.attempt_id == r["attempt_id"],
                        s.steps.c.step_id == r["step_id"],
                        s.steps.c.stop_reason.is_(None),
                    )
                    .values(stop_reason=f"cancel: {reason}")
                )
                self._bump_gen(conn, list(r["nodes"]))
            if rows:
                self._event(
                    conn,
                    "step.cancel",
                    "cancelling step(s) "
                    + ",".join(f"{job_id}.{r['step_id']}" for r in rows)
                    + f": {reason}",
                    job_id=job_id,
                    actor=actor,
                )
        return [int(r["step_id"]) for r in rows]

    def _running_steps(
        self, conn: Connection, job_id: int, step_id: int | None
    ) -> list[dict[str, Any]]:
        att = conn.execute(select(s.jobs.c.attempt_id).where(s.jobs.c.id == job_id)).scalar()
        if att is None:
            return []
        q = select(s.steps).where(s.steps.c.attempt_id == att, s.steps.c.state == RUNNING)
        if step_id is not None:
            q = q.where(s.steps.c.step_id == step_id)
        return [dict(r) for r in conn.execute(q).mappings()]

    def get_step(self, job_id: int, step_id: int) -> dict[str, Any]:
        """The job's current attempt's step `step_id` (NotFound if there is none)."""
        return step_view(self._current_step(job_id, step_id))

    def step_io(self, job_id: int, step_id: int) -> dict[str, Any]:
        """`get_step` with where its I/O flows (`sattach`): the spec's `io` (its srun's address
        and cookie, which streams it carries) and each node's task ids. Not for users as it is:
        the controller derives an attach token from the cookie (auth/attachcred.py)."""
        row = self._current_step(job_id, step_id)
        spec = row["spec"] or {}
        return {**step_view(row), "io": dict(spec.get("io") or {}), "task_ids": spec["task_ids"]}

    def _current_step(self, job_id: int, step_id: int) -> dict[str, Any]:
        with self.db.begin(write=False) as conn:
            att = conn.execute(select(s.jobs.c.attempt_id).where(s.jobs.c.id == job_id)).scalar()
            row = (
                conn.execute(
                    select(s.steps).where(s.steps.c.attempt_id == att, s.steps.c.step_id == step_id)
                )
                .mappings()
                .first()
            )
        if row is None:
            raise NotFound(f"job {job_id} has no step {step_id}", job_id=job_id)
        return dict(row)

    def steps_of(self, job_id: int) -> list[dict[str, Any]]:
        """Every recorded step of the job, its attempts in order (accounting, `phalanx show`)."""
        with self.db.begin(write=False) as conn:
            rows = conn.execute(
                select(s.steps, s.attempts.c.seq)
                .join(s.attempts, s.attempts.c.id == s.steps.c.attempt_id)
                .where(s.steps.c.job_id == job_id)
                .order_by(s.steps.c.attempt_id, s.steps.c.step_id)
            ).mappings()
            return [step_view(dict(r)) for r in rows]

    def steps_of_jobs(self, job_ids: Sequence[int]) -> dict[int, list[dict[str, Any]]]:
        """`steps_of` for many jobs in one query (sacct lists)."""
        out: dict[int, list[dict[str, Any]]] = {}
        if not job_ids:
            return out
        with self.db.begin(write=False) as conn:
            for i in range(0, len(job_ids), 500):
                rows = conn.execute(
                    select(s.steps, s.attempts.c.seq)
                    .join(s.attempts, s.attempts.c.id == s.steps.c.attempt_id)
                    .where(s.steps.c.job_id.in_(list(job_ids[i : i + 500])))
                    .order_by(s.steps.c.attempt_id, s.steps.c.step_id)
                ).mappings()
                for r in rows:
                    out.setdefault(int(r["job_id"]), []).append(step_view(dict(r)))
        return out

    def finished_steps(self, keys: Sequence[tuple[int, int, str]]) -> set[tuple[int, int]]:
        """Which (attempt, step) of these (attempt, step, node) the store has recorded as
        ended on that node, or never heard of: the agent may forget them."""
        out: set[tuple[int, int]] = set()
        if not keys:
            return out
        with self.db.begin(write=False) as conn:
            for aid, sid, node in keys:
                st = conn.execute(
                    select(s.step_nodes.c.state).where(
                        s.step_nodes.c.attempt_id == aid,
                        s.step_nodes.c.step_id == sid,
                        s.step_nodes.c.node == node,
                    )
                ).scalar()
                if st is None or st not in _LIVE_NODE:
                    out.add((aid, sid))
        return out


def step_view(row: dict[str, Any]) -> dict[str, Any]:
    """A step as the API shows it (no environment: that is the job's private data)."""
    return {
        "step_id": int(row["step_id"]),
        "attempt_seq": row.get("seq"),
        "name": row["name"],
        "state": row["state"],
        "nodes": list(row["nodes"]),
        "tasks": list(row["tasks"]),
        "ntasks": sum(row["tasks"]),
        "start_time": row["start_time"],
        "end_time": row["end_time"],
        "exit_code": row["exit_code"],
        "exit_signal": row["exit_signal"],
        "stop_reason": row["stop_reason"],
        "usage": row.get("usage"),
    }


@functools.cache
def _node_step_work_query() -> Prebuilt:
    """JobSteps.node_step_work's query, built once with the node as a parameter (every
    heartbeat runs it: see store._NODE_WORK). The live states are tested as `=`s, not an
    `IN`: an `IN` list renders anew on every call, which keeps a statement off SQLite's
    driver path; SQLite's planner makes the same `IN` of them again."""
    return Prebuilt(
        _step_work_select().where(
            s.step_nodes.c.node == bindparam("node"),
            or_(*(s.step_nodes.c.state == state for state in _LIVE_NODE)),
        )
    )


@functools.cache
def _live_step_nodes_query() -> Select[Any]:
    """A node's live step rows in these attempts, with the attempt's token (apply_step_reports:
    a report is taken only from the attempt it names)."""
    return (
        select(s.step_nodes, s.attempts.c.token)
        .join(s.attempts, s.attempts.c.id == s.step_nodes.c.attempt_id)
        .where(
            s.step_nodes.c.node == bindparam("node"),
            s.step_nodes.c.attempt_id.in_(bindparam("attempt_ids", expanding=True)),
            s.step_nodes.c.state.in_(_LIVE_NODE),
        )
    )


def _step_node_key() -> Any:
    return (
        (s.step_nodes.c.attempt_id == bindparam("a"))
        & (s.step_nodes.c.step_id == bindparam("s"))
        & (s.step_nodes.c.node == bindparam("n"))
    )


@functools.cache
def _mark_step_node_running() -> Any:
    return (
        update(s.step_nodes)
        .where(_step_node_key())
        .values(state="RUNNING", started_at=bindparam("started"))
    )


@functools.cache
def _set_step_start_time() -> Any:
    """The step's start is its first node's (kept once set)."""
    return (
        update(s.steps)
        .where(
            s.steps.c.attempt_id == bindparam("a"),
            s.steps.c.step_id == bindparam("s"),
            s.steps.c.start_time.is_(None),
        )
        .values(start_time=bindparam("started"))
    )


@functools.cache
def _mark_step_node_ended() -> Any:
    return (
        update(s.step_nodes)
        .where(_step_node_key())
        .values(
            state=bindparam("st"),
            started_at=bindparam("started"),
            ended_at=bindparam("ended"),
            exits=bindparam("xs", type_=s.step_nodes.c.exits.type),
        )
    )


@functools.cache
def _end_step() -> Any:
    return (
        update(s.steps)
        .where(s.steps.c.attempt_id == bindparam("a"), s.steps.c.step_id == bindparam("s"))
        .values(
            state=bindparam("st"),
            end_time=bindparam("end"),
            exit_code=bindparam("code"),
            exit_signal=bindparam("sig"),
            start_time=bindparam("start"),
            usage=bindparam("usage", type_=s.steps.c.usage.type),
        )
    )


@functools.cache
def _step_launch_query() -> Select[Any]:
    """The same rows for one step on every node of it (direct launch: create_step)."""
    return _step_work_select().where(
        s.step_nodes.c.attempt_id == bindparam("attempt_id"),
        s.step_nodes.c.step_id == bindparam("step_id"),
    )


def _step_work_select() -> Select[Any]:
    """A node_step_work row per (step, node): the step, its node's state there and the job's
    task on that node (what build_step_launch turns into the node's launch)."""
    return (
        select(
            s.step_nodes.c.attempt_id,
            s.step_nodes.c.step_id,
            s.step_nodes.c.node,
            s.step_nodes.c.state.label("node_state"),
            s.steps.c.state.label("step_state"),
            s.steps.c.stop_reason.label("step_stop_reason"),
            s.steps.c.nodes.label("step_nodes"),
            s.steps.c.tasks.label("step_tasks"),
            s.steps.c.spec.label("step_spec"),
            s.steps.c.signals,
            s.attempts.c.expected_end,
            *NODE_WORK_COLUMNS,
        )
        .join(
            s.steps,
            (s.steps.c.attempt_id == s.step_nodes.c.attempt_id)
            & (s.steps.c.step_id == s.step_nodes.c.step_id),
        )
        .join(s.attempts, s.attempts.c.id == s.step_nodes.c.attempt_id)
        .join(
            s.tasks,
            (s.tasks.c.attempt_id == s.step_nodes.c.attempt_id)
            & (s.tasks.c.node == s.step_nodes.c.node),
        )
        .join(s.jobs, s.jobs.c.id == s.steps.c.job_id)
    )
