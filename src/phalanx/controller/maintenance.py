"""The maintenance part of the `cluster` duty, and the grace of maintenance stops.

Each cluster tick reads the live windows and the attempts on their nodes, asks
`domain.maintenance` what is due, and applies it in fenced writes (the fence is asked for again
before every write, so a holder that lost its lease mid-tick stops at once):

- attempts that would still run when a window starts get a planned stop ("requeue:
  maintenance N ...") ``max(maint_lead, the job's own grace)`` before it: the agent delivers the
  job's checkpoint signal, and the store requeues the job without spending a retry;
- windows whose start has come drain their nodes; windows that are over return them.

The agent gives a planned stop a fixed grace; for a maintenance stop `adjust_stops` replaces it
with the time left until the window starts, so the job is stopped (and requeued) at the start.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from phalanx.domain import maintenance as rules
from phalanx.domain.hostlist import compress_hostlist
from phalanx.errors import NotFound
from phalanx.store.store import Fence, Store


class MaintenanceDuty:
    def __init__(
        self,
        store: Store,
        *,
        lead: Callable[[], float],
        tick: Callable[[], float],
        fence: Callable[[], Fence | None],
        kick: Callable[[], None],
        notify: Callable[[list[str]], None],
    ) -> None:
        self.store = store
        self.lead = lead
        self.tick_interval = tick
        self.fence = fence
        self.kick = kick
        self.notify = notify
        self._graces: dict[int, float] = {}  # job id -> its checkpoint grace (spec: immutable)
        self._starts: dict[int, float] = {}  # window id -> start (never changes)

    def tick(self) -> str:
        """One pass: planned stops that are due, then windows that start or end."""
        if self.fence() is None:
            return "idle"
        rows = self.store.list_windows()
        if not rows:
            return "idle"
        now = time.time()
        windows = [rules.Window.from_row(r) for r in rows]
        for w in windows:
            self._starts[w.id] = w.start
        said: list[str] = []
        nodes = sorted({n for w in windows if w.live_at(now) for n in w.nodes})
        attempts = self.store.attempts_on(nodes)
        jobs = {int(a["job_id"]) for a in attempts}
        missing = sorted(jobs - self._graces.keys())
        if missing:
            self._graces.update(self.store.checkpoint_graces(missing))
        self._graces = {j: g for j, g in self._graces.items() if j in jobs}
        running = [
            rules.Running(
                attempt_id=int(a["attempt_id"]),
                job_id=int(a["job_id"]),
                nodes=tuple(a["nodes"]),
                end=a["end"],
                requeue=bool(a["requeue"]),
                grace=self._graces.get(int(a["job_id"]), 0.0),
            )
            for a in attempts
        ]
        due, _kept = rules.due_signals(
            windows, running, now, self.lead(), early=self.tick_interval()
        )
        if due:
            fence = self.fence()
            if fence is None:
                return "lost the cluster lease mid-cycle; nothing applied"
            stops = [(d.attempt_id, d.window.id, rules.stop_reason(d.window, now)) for d in due]
            stopped = self.store.stop_for_maintenance(stops, fence)
            if stopped:
                on = sorted({n for r in running if r.job_id in stopped for n in r.nodes})
                self.notify(on)
                said.append(
                    f"checkpointing and requeueing jobs {stopped} before maintenance "
                    f"{', '.join(sorted({str(d.window.id) for d in due}))}"
                )
        for t in rules.due_transitions(windows, now):
            fence = self.fence()
            if fence is None:
                said.append("lost the cluster lease mid-cycle")
                break
            if t.action == "start":
                started = self.store.start_window(t.window.id, fence)
                if started is not None:
                    drained = compress_hostlist(started[0]) or "no node"
                    said.append(f"maintenance {t.window.id} started: drained {drained}")
                    self.kick()
            else:
                returned = self.store.end_window(t.window.id, fence)
                if returned is not None:
                    back = compress_hostlist(returned) or "no node"
                    said.append(f"maintenance {t.window.id} over: returned {back}")
                    self.kick()
        return ", ".join(said) or "idle"

    def window_start(self, wid: int) -> float | None:
        if wid not in self._starts:
            try:
                self._starts[wid] = float(self.store.get_window(wid)["start"])
            except NotFound:
                return None
        return self._starts[wid]

    def adjust_stops(self, stops: list[dict[str, Any]], now: float | None = None) -> None:
        """Give each maintenance stop the time left until its window starts as its grace."""
        for item in stops:
            wid = rules.window_of_stop_reason(item.get("reason"))
            if wid is None or "checkpoint_grace" not in item:
                continue
            start = self.window_start(wid)
            if start is not None:
                item["checkpoint_grace"] = rules.stop_grace(
                    start, time.time() if now is None else now
                )
