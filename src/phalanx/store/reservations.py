"""Reservations in the store: creating, changing, deleting and listing them, each change an
event with its actor, in one transaction with the checks that need the live cluster (known
nodes, overlapping reservations, running jobs, jobs that still use a reservation).

The `cluster` duty's fenced writes (controller/reservations.py): a reservation's move from one
`phase` to the next (compare-and-set, so its `resv.start` and `resv.end` events are written
once whatever the number of controllers), and the planned stop of jobs still running in a
reservation that has ended.

A mixin of `Store` (its methods take `self`). The rules are in domain/reservations.py; the
scheduler reads the live rows with its snapshot (store/scheduling.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, bindparam, delete, insert, select, update

from phalanx.domain import reservations as rules
from phalanx.domain.hostlist import compress_hostlist, expand_hostlist, hostname_sort_key
from phalanx.domain.maintenance import format_when
from phalanx.domain.policy import TIMEOUT_STOP
from phalanx.domain.scheduling import node_partitions
from phalanx.domain.states import TERMINAL, AttemptState, JobState
from phalanx.errors import Conflict, InvalidSpec, NotFound
from phalanx.store import schema as s
from phalanx.store.base import StoreBase
from phalanx.store.prebuilt import Prebuilt
from phalanx.store.sqlbits import Fence
from phalanx.store.sqlbits import active_tasks as _active_tasks
from phalanx.store.sqlbits import now as _now

# a job's --reservation, read from its stored spec (no column of its own)
RESERVATION_OF_JOB = s.jobs.c.spec["reservation"].as_string()


def _not_found(name: str) -> NotFound:
    return NotFound(
        f"Reservation {name} not found (`scontrol show reservation` lists them)",
        reservation=name,
    )


# read by every scheduling pass (store/scheduling.py): built once, run through the driver
_LIVE_RESERVATIONS = Prebuilt(
    select(s.reservations)
    .where(s.reservations.c.end > bindparam("now", type_=s.reservations.c.end.type))
    .order_by(s.reservations.c.start, s.reservations.c.name)
)


class Reservations(StoreBase):
    """The `reservations` table's operations (see the module docstring)."""

    def _live_reservations(
        self, conn: Connection, now: float | None = None
    ) -> list[dict[str, Any]]:
        """Reservations that have not ended, earliest first."""
        return _LIVE_RESERVATIONS.rows(conn, {"now": _now() if now is None else now})

    def list_reservations(self) -> list[dict[str, Any]]:
        with self.db.begin(write=False) as conn:
            return self._live_reservations(conn)

    def get_reservation(self, name: str) -> dict[str, Any]:
        with self.db.begin(write=False) as conn:
            row = self._row(conn, name)
        if row is None:
            raise _not_found(name)
        return row

    def _row(self, conn: Connection, name: str) -> dict[str, Any] | None:
        found = (
            conn.execute(
                select(s.reservations).where(
                    s.reservations.c.name == name, s.reservations.c.end > _now()
                )
            )
            .mappings()
            .first()
        )
        return dict(found) if found is not None else None

    # ---------------------------------------------------------------------------- checks
    def _resolve_nodes(
        self,
        conn: Connection,
        new: rules.Reservation,
        nodes_expr: str | None,
        node_count: int | None,
        others: Sequence[rules.Reservation],
        running: Sequence[dict[str, Any]],
    ) -> tuple[list[str], str]:
        """The reservation's nodes: those named (known to the cluster), or `node_count`
        usable ones picked (of its partition, if given). Returns (names, expression)."""
        rows = [
            dict(r)
            for r in conn.execute(
                select(
                    s.nodes.c.name,
                    s.nodes.c.registered,
                    s.nodes.c.down,
                    s.nodes.c.drain,
                )
            ).mappings()
        ]
        known = {str(r["name"]) for r in rows}
        if nodes_expr is not None:
            try:
                names = expand_hostlist(nodes_expr)
            except ValueError as e:
                raise InvalidSpec(f"Nodes={nodes_expr}: {e}", field="nodes") from None
            if not names:
                raise InvalidSpec(
                    "Nodes=: no node given; use e.g. Nodes=node[01-04]", field="nodes"
                )
            unknown = [n for n in names if n not in known]
            if unknown:
                raise InvalidSpec(
                    f"Nodes={nodes_expr}: unknown node{'s' if len(unknown) > 1 else ''} "
                    f"{compress_hostlist(unknown)} (`sinfo -N` lists the nodes of this cluster)",
                    field="nodes",
                    unknown=unknown,
                )
            return sorted(dict.fromkeys(names), key=hostname_sort_key), nodes_expr.strip()
        assert node_count is not None
        parts = [dict(r) for r in conn.execute(select(s.partitions)).mappings()]
        if new.partition is not None and new.partition not in {p["name"] for p in parts}:
            raise InvalidSpec(
                f"PartitionName={new.partition}: no such partition (`sinfo` lists them)",
                field="partition",
            )
        usable = [
            str(r["name"])
            for r in sorted(rows, key=lambda r: hostname_sort_key(str(r["name"])))
            if r["registered"]
            and not r["down"]
            and not r["drain"]
            and (new.partition is None or new.partition in node_partitions(r["name"], parts))
        ]
        probe = rules.Reservation(
            new.name, tuple(usable), new.start, new.end, flags=new.flags - {"IGNORE_JOBS"}
        )
        taken = {n for r in rules.overlapping(probe, others, new.start) for n in r.nodes}
        try:
            names = rules.pick_nodes(
                usable, node_count, taken=taken, busy=rules.busy_nodes(probe, running)
            )
        except ValueError as e:
            raise InvalidSpec(str(e), field="node_count") from None
        return sorted(names, key=hostname_sort_key), compress_hostlist(names)

    @staticmethod
    def _running(conn: Connection) -> list[dict[str, Any]]:
        """Jobs holding nodes: their nodes and when their time limit ends them (None:
        unknown or unlimited)."""
        by_job: dict[int, dict[str, Any]] = {}
        for r in conn.execute(
            _active_tasks(s.tasks.c.node, s.attempts.c.job_id, s.attempts.c.expected_end)
        ):
            item = by_job.setdefault(
                int(r.job_id), {"job_id": int(r.job_id), "nodes": [], "end": r.expected_end}
            )
            item["nodes"].append(str(r.node))
        return list(by_job.values())

    def _check(
        self,
        conn: Connection,
        new: rules.Reservation,
        others: Sequence[rules.Reservation],
        running: Sequence[dict[str, Any]],
        now: float,
    ) -> None:
        try:
            rules.check_times(new.start, new.end, now)
        except ValueError as e:
            raise InvalidSpec(str(e), field="start") from None
        if not new.users and not new.accounts:
            raise InvalidSpec(
                "Either Users/Groups and/or Accounts must be specified. No reservation made: "
                "give Users=NAME[,NAME] or Accounts=NAME[,NAME]",
                field="users",
            )
        clash = rules.overlapping(new, others, now)
        if clash:
            names = ", ".join(r.name for r in clash)
            raise Conflict(
                f"Requested reservation overlaps with another reservation ({names} on "
                f"{compress_hostlist(n for r in clash for n in r.nodes if n in new.nodes)}): "
                "choose other nodes or times, or add Flags=OVERLAP",
                reservation=new.name,
            )
        busy = rules.busy_nodes(new, running)
        if busy:
            raise Conflict(
                f"Requested nodes are busy: {compress_hostlist(busy)} run jobs that would still "
                f"run at {format_when(new.start, now)}; choose a later StartTime=, other nodes, "
                "or add Flags=IGNORE_JOBS to let them finish inside the reservation",
                reservation=new.name,
            )

    # ---------------------------------------------------------------------------- changes
    def create_reservation(
        self,
        name: str,
        *,
        start: float,
        end: float,
        nodes_expr: str | None,
        node_count: int | None,
        users: Sequence[str],
        accounts: Sequence[str],
        flags: Sequence[str],
        partition: str | None,
        actor: str,
    ) -> dict[str, Any]:
        """Create a reservation; InvalidSpec (422) or Conflict (409) says what to change."""
        if (nodes_expr is None) == (node_count is None):
            raise InvalidSpec(
                "give the reservation Nodes=... or NodeCnt=N (one of them)", field="nodes"
            )
        now = _now()
        flag_set = set(flags)
        if nodes_expr is not None:
            flag_set.add("SPEC_NODES")
        with self.db.begin() as conn:
            # an ended reservation of the same name is gone, as in Slurm, once no job runs in
            # it any more (reservation_overrun): the new one would take those jobs over
            still = self._running_in(conn, name, ended_by=now)
            if still:
                listed = ", ".join(map(str, still[:20])) + (" ..." if len(still) > 20 else "")
                raise Conflict(
                    f"Duplicate reservation name {name}: reservation {name} has ended but "
                    f"job{'s' if len(still) > 1 else ''} {listed} still "
                    f"run{'' if len(still) > 1 else 's'} in it (timing.reservation_overrun); "
                    "pick another name, or wait until they end",
                    reservation=name,
                    jobs=still,
                )
            conn.execute(
                delete(s.reservations).where(
                    s.reservations.c.name == name, s.reservations.c.end <= now
                )
            )
            if self._row(conn, name) is not None:
                raise Conflict(
                    f"Duplicate reservation name {name}: pick another name, or change it with "
                    f"`scontrol update ReservationName={name} ...`",
                    reservation=name,
                )
            others = [rules.Reservation.from_row(r) for r in self._live_reservations(conn, now)]
            running = self._running(conn)
            draft = rules.Reservation(
                name, (), start, end, tuple(users), tuple(accounts), frozenset(flag_set), partition
            )
            names, expr = self._resolve_nodes(conn, draft, nodes_expr, node_count, others, running)
            new = rules.Reservation(
                name, tuple(names), start, end, tuple(users), tuple(accounts),
                frozenset(flag_set), partition,
            )  # fmt: skip
            self._check(conn, new, others, running, now)
            row = {
                "name": name,
                "nodes_expr": expr[:1024],
                "nodes": names,
                "start": float(start),
                "end": float(end),
                "users": list(new.users),
                "accounts": list(new.accounts),
                "flags": sorted(new.flags),
                "partition": partition,
                "created_by": actor,
                "created_at": now,
                "updated_by": None,
                "updated_at": None,
            }
            pk = conn.execute(insert(s.reservations).values(**row)).inserted_primary_key
            assert pk is not None
            self._event(
                conn,
                "resv.create",
                f"reservation {name} on {new.hostlist} from {format_when(start, now)} to "
                f"{format_when(end, now)} for {_who(new)}"
                + (f" flags {rules.format_flags(new.flags)}" if new.flags else "")
                + f" created by {actor}",
                actor=actor,
                data={"reservation": name, **{k: row[k] for k in ("nodes", "start", "end")}},
            )
            return {"id": int(pk[0]), **row}

    def update_reservation(self, name: str, changes: dict[str, Any], actor: str) -> dict[str, Any]:
        """Change a live reservation: any of start, end, nodes_expr/node_count, users,
        accounts, flags, partition (already parsed). The result is checked as a new one
        would be, except that running jobs inside it are its own."""
        now = _now()
        with self.db.begin() as conn:
            row = self._row(conn, name)
            if row is None:
                raise _not_found(name)
            old = rules.Reservation.from_row(row)
            others = [
                rules.Reservation.from_row(r)
                for r in self._live_reservations(conn, now)
                if r["name"] != name
            ]
            start = float(changes.get("start", old.start))
            if "end" in changes:
                end = float(changes["end"])
            elif "duration" in changes:
                end = start + float(changes["duration"])
            else:  # a new start alone keeps the duration, as in Slurm
                end = start + (old.end - old.start)
            flags = set(changes.get("flags", old.flags))
            partition = changes.get("partition", old.partition)
            draft = rules.Reservation(
                name,
                old.nodes,
                start,
                end,
                tuple(changes.get("users", old.users)),
                tuple(changes.get("accounts", old.accounts)),
                frozenset(flags),
                partition,
            )
            nodes, expr = list(old.nodes), str(row["nodes_expr"])
            running = self._running(conn)
            mine = self._jobs_in(conn, name)
            outsiders = [j for j in running if j.get("job_id") not in mine]
            if "nodes_expr" in changes or "node_count" in changes:
                if "nodes_expr" in changes:
                    flags.add("SPEC_NODES")
                else:
                    flags.discard("SPEC_NODES")
                draft = replace_flags(draft, flags)
                nodes, expr = self._resolve_nodes(
                    conn,
                    draft,
                    changes.get("nodes_expr"),
                    changes.get("node_count"),
                    others,
                    outsiders,
                )
            new = rules.Reservation(
                name, tuple(nodes), start, end, draft.users, draft.accounts,
                frozenset(flags), partition,
            )  # fmt: skip
            self._check(conn, new, others, outsiders, now)
            values = {
                "nodes_expr": expr[:1024],
                "nodes": list(new.nodes),
                "start": new.start,
                "end": new.end,
                "users": list(new.users),
                "accounts": list(new.accounts),
                "flags": sorted(new.flags),
                "partition": new.partition,
                "updated_by": actor,
                "updated_at": now,
            }
            if row.get("phase") == rules.Phase.ACTIVE.value and new.start > now:
                # moved to start later: it starts again then (another resv.start event)
                values["phase"] = rules.Phase.SCHEDULED.value
            conn.execute(
                update(s.reservations).where(s.reservations.c.id == row["id"]).values(**values)
            )
            said = _changes_text(old, new, now)
            self._event(
                conn,
                "resv.update",
                f"reservation {name} updated by {actor}: {said or 'no change'}",
                actor=actor,
                data={"reservation": name, "changes": sorted(changes)},
            )
            return {**row, **values}

    def _running_in(self, conn: Connection, name: str, *, ended_by: float) -> list[int]:
        """Jobs running (or being stopped) in reservation `name` if it ended by `ended_by`."""
        ended = conn.execute(
            select(s.reservations.c.id).where(
                s.reservations.c.name == name, s.reservations.c.end <= ended_by
            )
        ).first()
        if ended is None:
            return []
        live = [JobState.STARTING.value, JobState.RUNNING.value, JobState.COMPLETING.value]
        return sorted(
            int(r.id)
            for r in conn.execute(
                select(s.jobs.c.id).where(s.jobs.c.state.in_(live), name == RESERVATION_OF_JOB)
            )
        )

    def _jobs_in(self, conn: Connection, name: str) -> set[int]:
        """Jobs not ended yet that ask for reservation `name`."""
        return {
            int(r.id)
            for r in conn.execute(
                select(s.jobs.c.id).where(
                    s.jobs.c.state.not_in([str(x) for x in TERMINAL]),
                    name == RESERVATION_OF_JOB,
                )
            )
        }

    def delete_reservation(self, name: str, actor: str) -> dict[str, Any]:
        """Delete a reservation no job uses any more (pending or running), as Slurm does."""
        with self.db.begin() as conn:
            row = self._row(conn, name)
            if row is None:
                raise _not_found(name)
            jobs = sorted(self._jobs_in(conn, name))
            if jobs:
                listed = ", ".join(map(str, jobs[:20])) + (" ..." if len(jobs) > 20 else "")
                raise Conflict(
                    f"{rules.IN_USE}: job{'s' if len(jobs) > 1 else ''} {listed} "
                    f"{'ask' if len(jobs) > 1 else 'asks'} for it; cancel "
                    f"{'them' if len(jobs) > 1 else 'it'} (scancel) or wait for "
                    f"{'them' if len(jobs) > 1 else 'it'} to end",
                    reservation=name,
                    jobs=jobs,
                )
            conn.execute(delete(s.reservations).where(s.reservations.c.id == row["id"]))
            r = rules.Reservation.from_row(row)
            self._event(
                conn,
                "resv.delete",
                f"reservation {name} on {r.hostlist} deleted by {actor}",
                actor=actor,
                data={"reservation": name},
            )
            return row

    # ---------------------------------------------------------------- the cluster duty
    def watched_reservations(self) -> list[dict[str, Any]]:
        """Reservations the cluster duty still has something to do for (not `closed`),
        earliest first, each with its `phase`."""
        with self.db.begin(write=False) as conn:
            q = (
                select(s.reservations)
                .where(s.reservations.c.phase != rules.Phase.CLOSED.value)
                .order_by(s.reservations.c.start, s.reservations.c.name)
            )
            return [dict(r) for r in conn.execute(q).mappings()]

    def attempts_in_reservations(self, names: Sequence[str]) -> list[dict[str, Any]]:
        """Live (starting, running or stopping) attempts, current for their job, of jobs
        that asked for one of the reservations `names`: attempt_id, job_id, nodes,
        reservation, stopping. Read from the live attempts (few, by index), not from every
        job's spec."""
        if not names:
            return []
        wanted = set(names)
        with self.db.begin(write=False) as conn:
            rows = conn.execute(
                select(
                    s.attempts.c.id,
                    s.attempts.c.job_id,
                    s.attempts.c.nodes,
                    s.attempts.c.state,
                    RESERVATION_OF_JOB.label("reservation"),
                )
                .join(s.jobs, s.jobs.c.id == s.attempts.c.job_id)  # by its primary key
                .where(
                    s.attempts.c.state.in_(
                        [
                            AttemptState.STARTING.value,
                            AttemptState.RUNNING.value,
                            AttemptState.STOPPING.value,
                        ]
                    ),
                    s.jobs.c.attempt_id == s.attempts.c.id,
                    RESERVATION_OF_JOB.is_not(None),
                )
            ).mappings()
            return [
                {
                    "attempt_id": int(r["id"]),
                    "job_id": int(r["job_id"]),
                    "nodes": list(r["nodes"] or ()),
                    "reservation": str(r["reservation"]),
                    "stopping": r["state"] == AttemptState.STOPPING.value,
                }
                for r in rows
                if r["reservation"] in wanted
            ]

    def reservation_end(self, name: str) -> float | None:
        """The end of reservation `name`, ended or not (None: no such row)."""
        with self.db.begin(write=False) as conn:
            end = conn.execute(
                select(s.reservations.c.end).where(s.reservations.c.name == name)
            ).scalar()
        return None if end is None else float(end)

    def move_reservation(
        self,
        rid: int,
        old: rules.Phase,
        new: rules.Phase,
        fence: Fence | None,
        *,
        message: str | None = None,
        data: dict[str, Any] | None = None,
    ) -> bool:
        """Move reservation `rid` from phase `old` to `new` (the cluster duty; fenced), with
        its `resv.start` (to active) or `resv.end` (to ended) event carrying `message`. False
        when it is no longer in `old` (another holder moved it, an update changed it) or no
        longer exists: nothing is written, so each event is written once."""
        with self.db.begin() as conn:
            self._check_fence(conn, fence)
            res = conn.execute(
                update(s.reservations)
                .where(s.reservations.c.id == rid, s.reservations.c.phase == old.value)
                .values(phase=new.value)
            )
            if res.rowcount != 1:
                return False
            kind = {rules.Phase.ACTIVE: "resv.start", rules.Phase.ENDED: "resv.end"}.get(new)
            if kind is not None:
                self._event(
                    conn,
                    kind,
                    message or f"reservation {rid} {new.value}",
                    actor="cluster",
                    term=fence.term if fence else None,
                    data=data,
                )
            return True

    def stop_at_reservation_end(
        self, stops: Sequence[tuple[int, str, str]], fence: Fence | None
    ) -> list[int]:
        """Planned stops of jobs still running in a reservation that has ended (cluster duty;
        fenced): each (attempt id, reservation, stop reason) is asked to checkpoint and stop,
        and its job ends TIMEOUT with the reason (domain/policy.py, TIMEOUT_STOP). Only
        attempts still live and current for their job. Returns the jobs stopped."""
        if not stops:
            return []
        stopped: list[int] = []
        with self.db.begin() as conn:
            self._check_fence(conn, fence)
            term = fence.term if fence else None
            for aid, name, why in stops:
                current = self._current_live_attempt(conn, aid)
                if current is None:
                    continue
                att, job = current
                if not self._planned_stop(conn, att, job, why, actor="cluster", term=term):
                    continue
                self._event(
                    conn,
                    "resv.stop",
                    f"stopped as reservation {name} ended: checkpoint signal now, then "
                    f"TIMEOUT: {why.removeprefix(TIMEOUT_STOP)}",
                    job_id=int(job["id"]),
                    actor="cluster",
                    term=term,
                    data={"reservation": name, "attempt": aid},
                )
                stopped.append(int(job["id"]))
        return stopped


def replace_flags(r: rules.Reservation, flags: set[str]) -> rules.Reservation:
    return rules.Reservation(
        r.name, r.nodes, r.start, r.end, r.users, r.accounts, frozenset(flags), r.partition
    )


def _who(r: rules.Reservation) -> str:
    parts = []
    if r.users:
        parts.append("users " + ",".join(r.users))
    if r.accounts:
        parts.append("accounts " + ",".join(r.accounts))
    return " and ".join(parts)


def _changes_text(old: rules.Reservation, new: rules.Reservation, now: float) -> str:
    out = []
    if old.nodes != new.nodes:
        out.append(f"nodes {old.hostlist} -> {new.hostlist}")
    if old.start != new.start:
        out.append(f"start {format_when(old.start, now)} -> {format_when(new.start, now)}")
    if old.end != new.end:
        out.append(f"end {format_when(old.end, now)} -> {format_when(new.end, now)}")
    if old.users != new.users or old.accounts != new.accounts:
        out.append(f"for {_who(new)}")
    if old.flags != new.flags:
        out.append(f"flags {rules.format_flags(new.flags) or '(none)'}")
    if old.partition != new.partition:
        out.append(f"partition {new.partition}")
    return ", ".join(out)
