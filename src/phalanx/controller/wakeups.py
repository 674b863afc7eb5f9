"""Waking agents' long-polls when their node has new work.

`Waiters` holds the long-polls themselves (per node, woken from any thread). `WorkWakeups`
notices work that other controllers gave these nodes: through PostgreSQL LISTEN/NOTIFY
(store/notify.py) while it is healthy, else by polling the nodes' work generations
(`nodes.work_gen`); the generations this controller committed itself are taken as seen, so
its own agents are not woken twice. Together they are how work reaches an agent within one
long-poll whichever controller placed it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from phalanx.config import Timing
from phalanx.store.notify import WorkListener
from phalanx.store.surface import SchedulingStore

# Seconds between polls of nodes.work_gen for long-polling agents whose work another controller
# changed: fast while no LISTEN/NOTIFY wakes us (SQLite, database outage), a slow safety net
# while the PostgreSQL listener is healthy (store/notify.py).
GEN_POLL = 0.2
GEN_POLL_LISTENING = 2.0


class Waiters:
    """Long-poll wake-ups for agents, per node, safe to trigger from any thread."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self._events: dict[str, set[asyncio.Event]] = {}
        self._woken: dict[str, float] = {}  # node -> monotonic time of its last notify

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def waiting_nodes(self) -> list[str]:
        return [n for n, evs in list(self._events.items()) if evs]

    async def wait(self, node: str, timeout: float, since: float | None = None) -> bool:
        """Wait for a wakeup of `node`; True if woken. With `since` (the monotonic time the
        caller read the node's work), a wakeup that came in between counts too: the caller was
        not waiting yet, and would otherwise sleep through new work for a whole long-poll."""
        if since is not None and self._woken.get(node, -1.0) >= since:
            return True
        ev = asyncio.Event()
        self._events.setdefault(node, set()).add(ev)
        try:
            await asyncio.wait_for(ev.wait(), timeout)
            return True
        except TimeoutError:
            return False
        finally:
            self._events.get(node, set()).discard(ev)

    def _wake(self, nodes: list[str]) -> None:
        for n in nodes:
            for ev in list(self._events.get(n, ())):
                ev.set()

    def notify(self, nodes: list[str]) -> None:
        now = time.monotonic()
        for n in nodes:
            self._woken[n] = now
        if self.loop is not None and nodes:
            self.loop.call_soon_threadsafe(self._wake, list(nodes))


class WorkWakeups:
    def __init__(
        self,
        store: SchedulingStore,  # only the nodes' work generations
        waiters: Waiters,
        timing: Callable[[], Timing],
    ) -> None:
        self.store = store
        self.waiters = waiters
        self.timing = timing  # the timings in force (controller/timings.py)
        self.listener: WorkListener | None = None  # PostgreSQL only: cross-controller wakeups
        self._gens: dict[str, int] = {}
        self._gens_total: int | None = None  # node_gens_total() when _gens was last read

    def listen(
        self,
        connect_args: tuple[list[Any], dict[str, Any]],
        *,
        op_timeout: float,
        on_sched: Callable[[], None] | None = None,
    ) -> None:
        """Listen for other controllers' work notifications on a connection of its own (and,
        with `on_sched`, for their news for the schedulers: store/notify.py SCHED_CHANNEL)."""
        self.listener = WorkListener(
            connect_args, self._work_notice, op_timeout=op_timeout, on_sched=on_sched
        )
        self.listener.start()

    def stop(self) -> None:
        if self.listener is not None:
            self.listener.stop()

    def mode(self) -> str:
        """How work placed by other controllers reaches agents long-polling this one."""
        return "listen" if self.listener is not None and self.listener.healthy else "poll"

    def _work_notice(self, nodes: list[str] | None) -> None:
        """A notification: wake these nodes' long-polls (None: every waiting one re-checks)."""
        self.waiters.notify(self.waiters.waiting_nodes() if nodes is None else nodes)

    def poll_interval(self) -> float:
        """Fast while no notifications arrive; while they do, a safety net that never polls
        faster than agents re-heartbeat anyway (a missed wakeup costs at most one long-poll)."""
        listener = self.listener
        if listener is not None and listener.healthy:
            return max(GEN_POLL_LISTENING, self.timing().heartbeat_interval)
        return GEN_POLL

    def woke(self, gens: dict[str, int]) -> None:
        """Wake these nodes' long-polls for work this controller has just committed, whose
        work generations are `gens`: tick then takes them as seen.  Without this, its next
        poll finds the generations changed and wakes the same agents again, each of which
        answers with a whole exchange (a few per job step, the largest cost of a short step)."""
        self._gens.update(gens)
        self.waiters.notify(sorted(gens))

    def seen_gens(self, gens: dict[str, int]) -> None:
        """Take these nodes' new work generations as seen without waking them: a step srun
        hands to the agents itself (direct launch) needs no long-poll.  A node srun cannot
        reach is woken afterwards (`POST .../steps/N/wake`)."""
        self._gens.update(gens)

    def tick(self) -> str:
        """Wake this controller's long-polls when another controller gave their nodes work
        (the fallback for LISTEN/NOTIFY: see poll_interval)."""
        total = self.store.node_gens_total()  # first: a change after it is read next tick
        if total == self._gens_total:
            return "idle"
        waiting = self.waiters.waiting_nodes()  # after: 10,000 long-polls are a long list
        if not waiting:
            return "idle"
        gens = self.store.node_gens()
        self._gens_total = total
        changed = [n for n in waiting if gens.get(n) is not None and gens[n] != self._gens.get(n)]
        self._gens.update(gens)
        if changed:
            self.waiters.notify(changed)
        return "idle"
