"""Group commit for calls made from many threads at once: one transaction for all waiting.

The agents' exchanges (`AgentReports.apply_reports`) arrive from a dozen worker threads at
once and each is one write transaction. A controller's write transactions take turns
(store/writers.py), so under load most of those threads wait for the turn: with 200 simulated
nodes on PostgreSQL, 28 of them on average (py-spy, bench/sim.py placements), while the one
holding it spent its round trips on what every exchange repeats (BEGIN, reading the node's
tasks, the rows its attempts need, the events, COMMIT and its WAL flush). `GroupCommit` lets
the first caller lead: it takes every call waiting, runs them with one `run_group` call (one
transaction) and hands each caller its own result; the calls that arrive meanwhile form the
next group. Nothing waits on a timer: a lone call runs at once, as before.

Each caller still returns only after its change committed, and gets the exception its change
met: `run_group` returns one result or exception per call, so that a call refused on its own
fails alone (the store runs the group's calls one by one when the group as a whole fails
for a reason other than the database being unavailable).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class _Call(Generic[T, R]):
    item: T
    woken: threading.Event = field(default_factory=threading.Event)
    done: bool = False
    result: R | None = None
    error: BaseException | None = None


class GroupCommit(Generic[T, R]):
    """Callers hand in an item and block; a leader runs every waiting item in one group.

    Each waiting caller sleeps on its own event, woken once: when its item has run, or when
    it is appointed to lead the next group. A shared lock that every finished caller had to
    pass through to learn it was done made a convoy: with the interpreter lock contended,
    each hand-over cost a thread switch, and the next group waited behind all of them."""

    def __init__(
        self,
        run_group: Callable[[list[T]], Sequence[R | BaseException]],
        *,
        max_group: int = 64,
    ) -> None:
        self.run_group = run_group
        self.max_group = max_group
        self.groups = 0  # groups run (for tests)
        self.largest = 0  # the most calls one group carried (for tests)
        self._waiting: list[_Call[T, R]] = []
        self._lock = threading.Lock()  # guards _waiting and _leading
        self._leading = False  # a caller is running groups

    def waiting(self) -> int:
        """How many calls wait for a group (for tests and metrics)."""
        with self._lock:
            return len(self._waiting)

    def __call__(self, item: T) -> R:
        call: _Call[T, R] = _Call(item)
        with self._lock:
            self._waiting.append(call)
            lead = not self._leading
            self._leading = True
        if not lead:
            call.woken.wait()
        if not call.done:  # it leads (first in, or appointed)
            self._lead(call)
        if call.error is not None:
            raise call.error
        return call.result  # type: ignore[return-value]

    def _lead(self, me: _Call[T, R]) -> None:
        """Run groups until `me` has run, then hand the lead to the next waiting caller."""
        while True:
            with self._lock:
                group = self._waiting[: self.max_group]
                del self._waiting[: len(group)]
            self._run(group)
            with self._lock:
                if not me.done:
                    continue
                if self._waiting:
                    self._waiting[0].woken.set()  # woken not done: it leads next
                else:
                    self._leading = False
                return

    def _run(self, group: list[_Call[T, R]]) -> None:
        self.groups += 1
        self.largest = max(self.largest, len(group))
        try:
            results: Sequence[R | BaseException] = self.run_group([c.item for c in group])
            if len(results) != len(group):
                raise RuntimeError(f"group commit: {len(results)} results for {len(group)} calls")
        except BaseException as e:  # handed to every caller of the group
            results = [e] * len(group)
        for c, r in zip(group, results, strict=True):
            if isinstance(r, BaseException):
                c.error = r
            else:
                c.result = r
            c.done = True
            c.woken.set()
