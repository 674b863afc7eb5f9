"""Cluster and user utilisation over a time window, from the history kept (`sreport`).

Slurm's sreport reads hourly rollups its database made of every job's allocation and every
node's state. Phalanx keeps the facts themselves (attempts with their start, end and CPUs;
nodes' DOWN and back events) for `accounting.keep_finished`, so a report is computed from
them for any window, to the second. Pure: the store gives the rows (store/history.py
`usage_rows`), this clips them to the window and sums.

- **Allocated**: CPU-seconds of every attempt's tasks (hot spares included: they hold their
  CPUs) within the window; an attempt still running counts up to `now`.
- **Down**: CPU-seconds of nodes while DOWN (from their `node.down` and `node.up` events, and
  the state a node was in when the window began).
- **Reported**: the CPU-seconds the cluster's nodes had, each from its first registration.
- **Idle**: Reported less Allocated and Down (never below 0).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


def overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    """Seconds [a0, a1) and [b0, b1) share."""
    return max(0.0, min(a1, b1) - max(a0, b0))


@dataclass
class UsageReport:
    """CPU-seconds in [start, end)."""

    start: float
    end: float
    reported: float = 0.0
    allocated: float = 0.0
    down: float = 0.0
    cpus: int = 0  # CPUs of the nodes reported on (sreport's TRES Count)
    by_assoc: dict[tuple[str, str], float] = field(default_factory=dict)  # (account, user)

    @property
    def idle(self) -> float:
        return max(0.0, self.reported - self.allocated - self.down)

    def as_dict(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "end": self.end,
            "reported_s": self.reported,
            "allocated_s": self.allocated,
            "down_s": self.down,
            "idle_s": self.idle,
            "cpus": self.cpus,
            "assocs": [
                {"account": a, "user": u, "cpu_s": s} for (a, u), s in sorted(self.by_assoc.items())
            ],
        }


def down_seconds(
    was_down: bool, events: Iterable[tuple[float, bool]], start: float, end: float
) -> float:
    """Seconds of [start, end) a node spent DOWN: `was_down` at `start`, then `events`
    (time, down?) in time order."""
    total, since = 0.0, start if was_down else None
    for ts, down in events:
        if down and since is None:
            since = ts
        elif not down and since is not None:
            total += overlap(since, ts, start, end)
            since = None
    if since is not None:
        total += overlap(since, end, start, end)
    return total


def build(
    start: float,
    end: float,
    now: float,
    attempts: Iterable[Mapping[str, Any]],
    nodes: Iterable[Mapping[str, Any]],
    node_events: Mapping[str, list[tuple[float, bool]]],
) -> UsageReport:
    """The report of [start, end) from the store's rows: `attempts` (start_time, end_time,
    cpus, account, user), `nodes` (name, cpus, registered_at) and each node's DOWN/back
    events in time order, those before `start` included (they say its state then)."""
    rep = UsageReport(start, end)
    horizon = min(end, now)  # nothing is known past now
    for a in attempts:
        if a["start_time"] is None:
            continue
        secs = overlap(float(a["start_time"]), float(a["end_time"] or now), start, horizon)
        used = secs * int(a["cpus"] or 0)
        if used <= 0:
            continue
        rep.allocated += used
        key = (str(a["account"] or ""), str(a["user"]))
        rep.by_assoc[key] = rep.by_assoc.get(key, 0.0) + used
    for n in nodes:
        cpus = int(n["cpus"] or 0)
        since = float(n["registered_at"] or start)
        rep.reported += cpus * overlap(since, horizon, start, horizon)
        if since < horizon:
            rep.cpus += cpus
        events = node_events.get(str(n["name"]), [])
        before = [down for ts, down in events if ts < start]
        was_down = bool(before and before[-1])
        during = [(ts, down) for ts, down in events if ts >= start]
        rep.down += cpus * down_seconds(was_down, during, start, horizon)
    return rep
