"""Why a job waits, or why it ended the way it did, in sentences (`phalanx explain`).

Pure functions of plain data: the controller reads a scheduling snapshot (the same
`store.SchedSnapshot` the scheduler plans from), the job's attempts and events, and passes them
here. The verdict for a pending job is the scheduler's own: `explain_pending` runs
`scheduling.plan` on the snapshot and reports what it decided (starts now, waits with which
reason, can never run), so an explanation never disagrees with the next pass on the same state.
The details (per partition: which nodes have what the job needs, which are drained and by whom,
which are busy and until when) come from the predicates placement itself uses
(`placement.statically_eligible`, `node_shortfall`, `node_free_at`, `earliest_start`).

Times are estimates from the time limits of running work: a job that ends early frees its nodes
sooner, one without a time limit never gives an estimate.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from phalanx.domain import maintenance, scheduling
from phalanx.domain.deps import DepVerdict, evaluate
from phalanx.domain.hostlist import compress_hostlist
from phalanx.domain.placement_fit import statically_eligible
from phalanx.domain.placement_reasons import (
    earliest_start,
    fits_now,
    node_free_at,
    node_shortfall,
    usable_nodes,
)
from phalanx.domain.placement_types import Allocation, JobRequest, NodeView
from phalanx.domain.states import JobState

__all__ = ["Explanation", "display_id", "explain_history", "explain_pending"]

_AHEAD_CHECKS = 2000  # jobs ahead examined for "behind N jobs" (each costs one node scan)
_WAITING = ("Resources", "Priority")
PREEMPTING = "Preempting"  # the reason of a job waiting for its victims (controller/preemption.py)


@dataclass
class Explanation:
    """What `GET /v1/jobs/{ref}/explain` returns: a one-line summary and the detail lines."""

    job: str  # the id users type (123, or 123_4 for an array task)
    state: str
    summary: str
    lines: list[str] = field(default_factory=list)
    # the scheduler's verdict for a pending job: "start", "wait", "never", "held" (else None)
    verdict: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "state": self.state,
            "summary": self.summary,
            "lines": list(self.lines),
            "verdict": self.verdict,
        }


def display_id(job: Mapping[str, Any]) -> str:
    arr = job.get("array_job_id")
    return f"{arr}_{job.get('array_task_id')}" if arr is not None else str(job["id"])


def _plural(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {plural or word + 's'}"


def _when(t: float, now: float) -> str:
    return "~" + maintenance.format_when(t, now)


def _nodes_text(names: Iterable[str]) -> str:
    return compress_hostlist(list(names))


# --------------------------------------------------------------------------------------------
# Pending jobs
# --------------------------------------------------------------------------------------------


def need_text(req: JobRequest) -> str:
    """What one rank asks of a node, as the first words of the resource sentence."""
    parts = []
    if req.gpus_per_node > 0:
        kind = f"{req.gpu_type} " if req.gpu_type else ""
        parts.append(_plural(req.gpus_per_node, f"{kind}GPU"))
    parts.append(_plural(req.cpus_per_node, "CPU"))
    if req.mem_per_node_mb > 0:
        parts.append(f"{req.mem_per_node_mb} MB memory")
    else:
        parts.append("all of a node's memory")
    what = ", ".join(parts)
    if req.exclusive:
        what += " (exclusive)"
    if req.nodes == 1 and not req.spares:
        return f"needs {what} on one node"
    n = req.nodes + max(0, req.spares)
    spares = f" ({_plural(req.spares, 'spare')} included)" if req.spares else ""
    return f"needs {n} nodes{spares} with {what} each"


def _drained_text(row: Mapping[str, Any]) -> str:
    reason = row.get("drain_reason") or "no reason given"
    by = row.get("drain_by")
    return f"{row['name']} '{reason}'" + (f" (by {by})" if by else "")


@dataclass
class _PartitionNodes:
    """The nodes of one partition sorted by why the job can or cannot use them now."""

    name: str
    members: int = 0
    excluded: list[str] = field(default_factory=list)
    avoided: list[str] = field(default_factory=list)
    no_features: list[str] = field(default_factory=list)
    short: dict[str, list[str]] = field(default_factory=dict)  # shortfall -> nodes
    qualified: list[str] = field(default_factory=list)
    free: list[str] = field(default_factory=list)
    busy: dict[str, float] = field(default_factory=dict)  # node -> estimated free time
    busy_unknown: list[str] = field(default_factory=list)
    drained: list[str] = field(default_factory=list)  # "node07 'XID 79' (by health:gpu)"
    down: list[str] = field(default_factory=list)
    unregistered: list[str] = field(default_factory=list)
    maint: dict[int, list[str]] = field(default_factory=dict)  # window id -> nodes
    reserved: dict[int, list[str]] = field(default_factory=dict)  # job id -> nodes


def _sort_nodes(
    req: JobRequest,
    partition: str,
    views: Sequence[NodeView],
    rows: Mapping[str, Mapping[str, Any]],
    allocs: Mapping[str, Sequence[Allocation]],
    avoid: frozenset[str],
    keep_off: Mapping[str, maintenance.Window],
    others: Mapping[str, int],
    now: float,
) -> _PartitionNodes:
    out = _PartitionNodes(partition)
    for v in views:
        if partition not in v.partitions:
            continue
        out.members += 1
        if v.name in req.exclude:
            (out.avoided if v.name in avoid else out.excluded).append(v.name)
            continue
        if not statically_eligible(req, v):
            out.no_features.append(v.name)
            continue
        short = node_shortfall(req, v)
        if short is not None:
            out.short.setdefault(short, []).append(v.name)
            continue
        out.qualified.append(v.name)
        row = rows.get(v.name, {})
        if not row.get("registered"):
            out.unregistered.append(v.name)
        elif row.get("down"):
            reason = row.get("down_reason") or "not responding"
            out.down.append(f"{v.name} '{reason}'")
        elif row.get("drain"):
            out.drained.append(_drained_text(row))
        elif v.name in others:
            out.reserved.setdefault(others[v.name], []).append(v.name)
        elif v.name in keep_off:
            out.maint.setdefault(keep_off[v.name].id, []).append(v.name)
        else:
            here = allocs.get(v.name, ())
            at = node_free_at(req, v, here, now)
            if fits_now(req, v, here):
                out.free.append(v.name)
            elif at is None:
                out.busy_unknown.append(v.name)
            else:  # (work past its time limit is ending: "until ~now")
                out.busy[v.name] = at
    return out


def _partition_lines(
    req: JobRequest,
    pn: _PartitionNodes,
    windows: Mapping[int, maintenance.Window],
    now: float,
) -> list[str]:
    """The resource sentence for one partition, then one line per kind of unusable node."""
    if pn.members == 0:
        return [f"partition {pn.name} has no nodes"]
    head = f"{need_text(req)} in partition {pn.name}: "
    if not pn.qualified:
        head += f"none of its {_plural(pn.members, 'node')} can hold it"
    else:
        n = len(pn.qualified)
        head += f"{_plural(n, 'node')} {'has' if n == 1 else 'have'} them"
        parts = []
        if pn.free:
            parts.append(f"{len(pn.free)} {'is' if len(pn.free) == 1 else 'are'} free now")
        if pn.busy:
            lo, hi = min(pn.busy.values()), max(pn.busy.values())
            until = _when(hi, now) if lo == hi else f"{_when(lo, now)} to {_when(hi, now)}"
            verb = "is" if len(pn.busy) == 1 else "are"
            parts.append(f"{len(pn.busy)} {verb} busy until {until} (estimated)")
        if pn.busy_unknown:
            verb = "is" if len(pn.busy_unknown) == 1 else "are"
            parts.append(
                f"{len(pn.busy_unknown)} {verb} busy with work that has no time limit "
                f"({_nodes_text(pn.busy_unknown)})"
            )
        if pn.drained:
            verb = "is" if len(pn.drained) == 1 else "are"
            parts.append(f"{len(pn.drained)} {verb} drained: {', '.join(pn.drained)}")
        if pn.down:
            verb = "is" if len(pn.down) == 1 else "are"
            parts.append(f"{len(pn.down)} {verb} down: {', '.join(pn.down)}")
        if pn.unregistered:
            verb = "has" if len(pn.unregistered) == 1 else "have"
            parts.append(
                f"{len(pn.unregistered)} {verb} no agent registered "
                f"({_nodes_text(pn.unregistered)})"
            )
        for wid, names in sorted(pn.maint.items()):
            w = windows[wid]
            at = "now" if w.start <= now else f"at {maintenance.format_when(w.start, now)}"
            verb = "is" if len(names) == 1 else "are"
            parts.append(
                f"{len(names)} {verb} kept free for maintenance window {wid} {at} "
                f"({_nodes_text(names)}), which its time limit would cross"
            )
        for jid, names in sorted(pn.reserved.items()):
            verb = "is" if len(names) == 1 else "are"
            parts.append(
                f"{len(names)} {verb} reserved for the restart of job {jid} ({_nodes_text(names)})"
            )
        if parts:
            head += ": " + ", ".join(parts)
    lines = [head]
    need = req.nodes + max(0, req.spares)
    if pn.qualified and len(pn.qualified) < need:
        lines.append(
            f"partition {pn.name} has only {_plural(len(pn.qualified), 'node')} that could "
            f"hold it, {need} needed"
        )
    elif pn.free and len(pn.free) < need:
        lines.append(f"only {len(pn.free)} of the {need} nodes it needs are free now")
    for why, names in pn.short.items():
        lines.append(f"{_plural(len(names), 'node')} of {pn.name} {why}: {_nodes_text(names)}")
    if pn.no_features:
        lines.append(
            f"{_plural(len(pn.no_features), 'node')} of {pn.name} lack the --constraint "
            f"features: {_nodes_text(pn.no_features)}"
        )
    if pn.excluded:
        lines.append(f"excluded by --exclude: {_nodes_text(pn.excluded)}")
    if pn.avoided:
        lines.append(f"avoided because an earlier attempt failed there: {_nodes_text(pn.avoided)}")
    return lines


def _dependency_lines(
    job: Mapping[str, Any],
    dep_states: Mapping[int, JobState],
    dep_started: Mapping[int, bool],
    singleton_busy: bool,
) -> list[str]:
    out = []
    for dep in job.get("dependency") or []:
        kind = dep["type"]
        if kind == "singleton":
            if singleton_busy:
                out.append(
                    f"dependency singleton not met: another job named '{job.get('name')}' "
                    f"of {job.get('user')} is active"
                )
            else:
                out.append("dependency singleton met")
            continue
        for jid in dep["jobs"]:
            state = dep_states.get(int(jid))
            single = [{"type": kind, "jobs": [jid]}]
            verdict, why = evaluate(single, dep_states, started=dep_started)
            name = f"{kind}:{jid}"
            if verdict is DepVerdict.READY:
                seen = f"job {jid} {state.value}" if state is not None else f"job {jid} is gone"
                out.append(f"dependency {name} met ({seen})")
            elif verdict is DepVerdict.NEVER:
                out.append(f"dependency {why}")
            else:
                now_state = state.value if state is not None else "unknown"
                out.append(f"dependency {name} not met (job {jid} is {now_state})")
    return out


def _competing(reason: str | None) -> bool:
    """Whether a job with this pass's reason takes part in placement (so it can be ahead)."""
    return reason is not None and (
        reason in _WAITING or reason.startswith(("Maintenance", "Reserved"))
    )


def explain_pending(
    job: Mapping[str, Any],
    snap: Any,
    now: float,
    *,
    backfill: bool = True,
    policy: Any = None,
    license_totals: dict[str, int] | None = None,
    topo: Any = None,
    queue_depth: int | None = None,
) -> Explanation:
    """Why pending (or held) ``job`` waits, from ``snap`` (a `store.SchedSnapshot` that the job
    is in, or that lacks it: a held job, or one beyond the snapshot's limit, is added).

    ``policy``, ``license_totals``, ``topo`` and ``queue_depth`` are the scheduling pass's
    own keywords (scheduling.plan): with a queue policy the jobs ahead are those ahead in its
    order; a job behind the queue depth is not examined by the pass, and says so."""
    if policy is not None:
        snap = copy.copy(snap)
        snap.pending = policy.order(snap, now)
    jid = int(job["id"])
    state = str(job["state"])
    shown = display_id(job)
    pending = [p for p in snap.pending if int(p["id"]) != jid]
    position = next((i for i, p in enumerate(snap.pending) if int(p["id"]) == jid), None)
    row = {**job, "state": JobState.PENDING.value}
    pos = position if position is not None else len(pending)
    pending.insert(pos, row)
    # Jobs after it in priority order cannot change its placement (they are placed after it),
    # except those restarting on reserved nodes, which go first: the rest are left out, so
    # explaining a job early in a long queue costs a short pass, not a whole one. (Only the
    # maintenance wording could differ: the scheduler words it after placing later jobs too.)
    pending = pending[: pos + 1] + [p for p in pending[pos + 1 :] if p.get("reserved_until")]
    snap = copy.copy(snap)  # the caller's snapshot stays as it was
    snap.pending = pending
    plan = scheduling.plan(
        snap,
        now,
        backfill=backfill,
        policy=policy,
        license_totals=license_totals,
        topo=topo,
        queue_depth=queue_depth,
    )

    views = scheduling.node_views(snap.nodes, snap.partitions, topo)
    views.sort(key=lambda v: _natural(v.name))
    rows = {n["name"]: n for n in snap.nodes}
    allocs = scheduling.allocations(snap.allocations)
    by_node: dict[str, list[Allocation]] = {}
    for a in allocs:
        by_node.setdefault(a.node, []).append(a)
    req = scheduling.job_request(dict(job))
    avoid = frozenset(job.get("avoid_nodes") or ())
    set_aside = False
    if avoid:  # as the pass does: a list that leaves too few nodes is set aside
        soft = scheduling.soft_avoid(dict(job), req, scheduling.avoid_cluster(views, snap.nodes))
        set_aside = soft is not req
        req = soft
    windows = [
        w
        for w in (maintenance.Window.from_row(r) for r in getattr(snap, "maintenance", []) or [])
        if w.live_at(now)
    ]
    keep_off = maintenance.blocking_windows(windows, now, req.time_limit_s)
    by_id = {w.id: w for w in windows}
    others: dict[str, int] = {}
    for r in getattr(snap, "reservations", None) or []:
        if int(r["id"]) == jid:
            continue
        for name in scheduling.live_reservation(r, now):
            others.setdefault(name, int(r["id"]))

    lines: list[str] = []
    held = state == JobState.HELD.value
    if held:
        lines.append(
            f"{job.get('reason') or 'held'}: it does not run until released "
            f"(phalanx release {shown})"
        )
    eligible_at = job.get("eligible_time")
    if eligible_at and eligible_at > now:
        lines.append(f"begin time: not before {maintenance.format_when(eligible_at, now)}")
    key = (job.get("name"), job.get("user"))
    singleton = any(d["type"] == "singleton" for d in job.get("dependency") or [])
    lines += _dependency_lines(
        job, snap.dep_states, snap.dep_started, singleton and key in snap.active_names
    )
    arr, limit = job.get("array_job_id"), job.get("array_limit")
    if arr is not None and limit:
        running = dict(snap.array_active).get(int(arr), 0)
        lines.append(f"array {arr}: {running} of at most {limit} tasks running (%{limit})")
    own = scheduling.live_reservation(dict(job), now)
    preempting = str(job.get("reason") or "").startswith(PREEMPTING)
    if own and preempting:
        until = maintenance.format_when(float(job["reserved_until"]), now)
        lines.append(
            f"preemption: {_nodes_text(own)} held for it until {until} (it starts there once "
            "the jobs it preempts have checkpointed and left)"
        )
    elif own:
        until = maintenance.format_when(float(job["reserved_until"]), now)
        lines.append(
            f"restart reservation: {_nodes_text(own)} held for it until {until} "
            "(it restarts there after a node failure)"
        )
    if set_aside:
        lines.append(
            f"not avoiding {_nodes_text(sorted(avoid))}, where an earlier attempt failed: "
            "the other nodes could never hold it (docs/retries.md)"
        )
        avoid = frozenset()
    for partition in dict.fromkeys(req.partitions):
        pn = _sort_nodes(req, partition, views, rows, by_node, avoid, keep_off, others, now)
        lines += _partition_lines(req, pn, by_id, now)

    started = next((p for p in plan.starts if p.job_id == jid), None)
    never = dict(plan.never).get(jid)
    reason = plan.reasons.get(jid)
    ahead = _ahead(snap.pending, jid, plan, req, views)
    if ahead:
        listed = ", ".join(display_id(j) for j in ahead[:10])
        more = f" and {len(ahead) - 10} more" if len(ahead) > 10 else ""
        lines.append(
            f"behind {_plural(len(ahead), 'job')} of higher priority that could use the same "
            f"nodes: {listed}{more}"
        )
    verdict = "held" if held else "wait"
    if held:
        summary = f"held: {job.get('reason') or 'held'}; release it to let it run"
    elif never is not None:
        verdict = "never"
        summary = f"can never run: {never} (the scheduler cancels it)"
    elif started is not None:
        verdict = "start"
        where = _nodes_text(started.nodes)
        summary = f"would start now on {where} (partition {started.partition})"
    elif preempting:
        summary = str(job.get("reason"))
    elif reason is None:
        summary = "waits for the next scheduling pass"
    elif reason.startswith("BeginTime"):
        summary = f"waits for its begin time: {reason}"
    elif reason.startswith("Dependency") or reason.startswith("singleton"):
        unmet = [x for x in lines if x.startswith("dependency") and "not met" in x]
        summary = unmet[0] if unmet else reason
    elif reason == "Resources":
        at = earliest_start(req, [v for v in views if v.name not in keep_off], allocs, now)
        blocked = next((x for x in lines if x.startswith("needs ")), reason)
        est = f" (estimated start {_when(at, now)})" if at is not None and at > now else ""
        summary = f"first in line, waits for resources{est}" if est else f"waits: {blocked}"
        lines.append(
            "first in line for these nodes: the scheduler keeps lower-priority jobs from "
            f"delaying it (backfill){est}"
        )
    elif reason == "Priority" and jid in plan.beyond:
        summary = (
            f"behind the scheduler's queue depth ({queue_depth} jobs examined per pass, "
            "cluster.queue_depth): not looked at until the jobs ahead of it start or leave"
        )
    elif reason == "Priority":
        summary = (
            f"behind {_plural(len(ahead), 'job')} of higher priority"
            if ahead
            else "waits behind jobs of higher priority"
        )
    else:
        summary = reason
    if not held and reason is not None and not preempting:
        lines.append(f"scheduler's reason: {reason}")
    recorded = job.get("reason")
    if recorded and recorded != reason and not held:
        lines.append(f"reason recorded by the last pass: {recorded}")
    return Explanation(shown, state, summary, lines, verdict)


def _natural(name: str) -> tuple[Any, ...]:
    return tuple(int(p) if p.isdecimal() else p for p in re.split(r"(\d+)", name))


def _ahead(
    pending: Sequence[Mapping[str, Any]],
    jid: int,
    plan: scheduling.Plan,
    req: JobRequest,
    views: Sequence[NodeView],
) -> list[Mapping[str, Any]]:
    """Jobs before ``jid`` in priority order that take part in placement and could use one of
    the nodes it could use."""
    mine = usable_nodes(req, views)
    if not mine:
        return []
    placed = {p.job_id for p in plan.starts}
    out = []
    # queues hold few request shapes: the usable nodes are computed once per shape
    seen: dict[tuple[Any, ...], bool] = {}
    for other in pending[:_AHEAD_CHECKS]:
        oid = int(other["id"])
        if oid == jid:
            break
        if oid not in placed and not _competing(plan.reasons.get(oid)):
            continue
        shape = tuple(
            other.get(k) if not isinstance(other.get(k), list) else tuple(other[k]) for k in _SHAPE
        )
        if shape not in seen:
            theirs = usable_nodes(scheduling.job_request(dict(other)), views)
            seen[shape] = bool(theirs & mine)
        if seen[shape]:
            out.append(other)
    return out


# what decides which nodes a job could use (scheduling.job_request's inputs, less its id)
_SHAPE = (
    "partitions",
    "cpus_per_node",
    "mem_per_node_mb",
    "gpus_per_node",
    "gpu_type",
    "exclusive",
    "constraint_expr",
    "nodelist",
    "exclude",
    "avoid_nodes",
)


# --------------------------------------------------------------------------------------------
# Jobs that ran: what happened to each attempt
# --------------------------------------------------------------------------------------------

_JOB_EVENTS = (
    "job.requeue",
    "job.held",
    "job.restart",
    "job.spare_lost",
    "job.signal",
    "job.preempted",
    "job.preempting",
    "resv.stop",  # stopped as its reservation ended (domain/reservations.py)
)
_NODE_EVENTS = ("node.drain", "node.down")
_NODE_EVENT_SLACK_S = 120.0  # a drain this long after an attempt ended still explains it


def _exit_text(code: Any, sig: Any) -> str:
    if sig:
        return f"killed by signal {sig}"
    if code is not None:
        return f"exit code {code}"
    return ""


def _task_text(t: Mapping[str, Any]) -> str | None:
    """What went wrong with one task, from the shepherd's exit record (None: nothing), and
    the node's epilog failing after it (which drains the node, not the job's outcome)."""
    text = _task_end_text(t)
    epilog = (t.get("detail") or {}).get("epilog_failed")
    if not epilog:
        return text
    said = f"{epilog} (node drained; the job's outcome is unchanged)"
    return f"{text}; {said}" if text else f"{t['node']}: {said}"


def _task_end_text(t: Mapping[str, Any]) -> str | None:
    """How one task ended badly, from the shepherd's exit record (None: it did not)."""
    d = t.get("detail") or {}
    if t.get("state") == "LOST":
        return f"{t['node']}: lost ({d.get('error') or 'the node no longer knows it'})"
    if d.get("oom"):
        return f"{t['node']}: killed for running out of memory"
    if d.get("timed_out"):
        return f"{t['node']}: reached its time limit"
    if d.get("hung"):
        return f"{t['node']}: stopped by hang detection (no progress)"
    if d.get("fenced"):
        return f"{t['node']}: stopped because the node lost contact with the controllers"
    if d.get("launch_failed") or (d.get("error") and not d.get("cancelled")):
        return f"{t['node']}: {d.get('error') or 'launch failed'}"
    code, sig = t.get("exit_code"), t.get("exit_signal")
    if sig or (code not in (None, 0)):
        return f"{t['node']}: {_exit_text(code, sig)}"
    return None


def explain_history(
    job: Mapping[str, Any],
    attempts: Sequence[Mapping[str, Any]],
    events: Sequence[Mapping[str, Any]],
    node_events: Sequence[Mapping[str, Any]],
    now: float,
) -> Explanation:
    """Why a job that ran (finished, failed, requeued, running) is where it is: per attempt,
    where it ran and how it ended; the requeue and retry decisions (their messages carry the
    retry rule applied); drains and failures of its nodes around each attempt's end."""
    shown = display_id(job)
    state = str(job["state"])
    reason = job.get("reason")
    lines: list[str] = []
    for a in attempts:
        nodes = [n for n in a.get("nodes") or []]
        head = f"attempt {int(a['seq']) + 1} on {_nodes_text(nodes) if nodes else '(no nodes)'}"
        if a.get("start_time"):
            head += f", started {maintenance.format_when(a['start_time'], now)}"
        if a.get("state") == "ENDED":
            head += f": {a.get('result') or 'ended'}"
            ex = _exit_text(a.get("exit_code"), a.get("exit_signal"))
            if ex:
                head += f" ({ex})"
            if a.get("end_time"):
                head += f" at {maintenance.format_when(a['end_time'], now)}"
        else:
            head += f": {a.get('state')}"
            if a.get("expected_end"):
                head += f", time limit ends {_when(a['expected_end'], now)}"
        if a.get("stop_reason"):
            head += f"; asked to stop: {a['stop_reason']}"
        lines.append(head)
        for t in a.get("tasks") or []:
            if t.get("spare"):
                continue
            what = _task_text(t)
            if what:
                lines.append(f"  {what}")
        start = a.get("start_time") or a.get("created_at") or 0.0
        end = (a.get("end_time") or now) + _NODE_EVENT_SLACK_S
        for e in node_events:
            if e.get("kind") in _NODE_EVENTS and e.get("node") in nodes and start <= e["ts"] <= end:
                lines.append(f"  node {e['node']}: {e['message']} (by {e.get('actor')})")
    for e in events:
        kind = str(e.get("kind"))
        if kind in _JOB_EVENTS or (
            kind.startswith("job.") and (e.get("data") or {}).get("to") in _ENDED_STATES
        ):
            lines.append(f"{maintenance.format_when(e['ts'], now)} {kind}: {e['message']}")
    ex = _exit_text(job.get("exit_code"), job.get("exit_signal"))
    if state in _ENDED_STATES:
        summary = f"{state}" + (f" ({ex})" if ex else "") + (f": {reason}" if reason else "")
    elif state == JobState.PENDING.value and len(attempts):
        summary = f"requeued: {reason}" if reason else "requeued"
    else:
        summary = state + (f": {reason}" if reason else "")
    return Explanation(shown, state, summary, lines)


_ENDED_STATES = frozenset(s.value for s in JobState if s.terminal)
LIVE_STATES = frozenset({JobState.STARTING.value, JobState.RUNNING.value})


def reservation_end_line(
    name: str, end: float | None, overrun: float | None, now: float
) -> str | None:
    """For a job running in reservation `name`: what its end does to it (None: unknown)."""
    if end is None:
        return None
    ends = "ended" if end <= now else "ends"
    head = f"reservation {name} {ends} at {maintenance.format_when(end, now)}"
    if overrun is None:
        return f"{head}: the job runs on to its time limit (reservation_overrun UNLIMITED)"
    at = "then" if overrun == 0 else f"{overrun:g}s later (reservation_overrun)"
    return (
        f"{head}: the job is stopped {at}, with its checkpoint signal its grace before, and "
        "ends TIMEOUT"
    )
