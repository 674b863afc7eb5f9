"""Group commit for one-job submissions (POST /v1/jobs): one writer thread, one transaction
for every request waiting when it starts.

Each `sbatch` is one HTTP request with one job. Stored one transaction each (a thread-pool hop,
a pooled connection, BEGIN, two inserts, COMMIT), the store's fixed cost per transaction is
most of the controller's work per submission. Here the event loop hands each request to a
single writer thread and awaits it; the writer takes everything queued so far and stores it
with `Controller.submit_group`, in one transaction, then answers every request of the group.
Nothing waits on a timer: a lone request is stored at once (the group is just it), and the
requests that arrive while one transaction commits form the next group, so the more requests
are in flight, the more each transaction carries.

Durability is unchanged: a request is answered (201) only after the transaction holding its
job has committed; a request whose group failed to commit gets that error, and a request
refused on its own (validation, an unknown dependency) fails alone (`submit_group`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable

from phalanx.domain.spec import JobSpec

log = logging.getLogger("phalanx.controller")

#: The most requests one transaction carries (the rest wait for the next one).
MAX_GROUP = 512

Outcome = list[int] | Exception
_Waiting = tuple[JobSpec, str, asyncio.AbstractEventLoop, "asyncio.Future[list[int]]"]


class SubmitQueue:
    """Requests in, one writer thread storing them in groups; `submit` awaits one's ids.

    `store_group` (Controller.submit_group) takes [(spec, user)] and returns, per request,
    its ids or its error. The thread starts with the first request."""

    def __init__(
        self,
        store_group: Callable[[list[tuple[JobSpec, str]]], list[Outcome]],
        *,
        max_group: int = MAX_GROUP,
    ) -> None:
        self.store_group = store_group
        self.max_group = max_group
        self.groups = 0  # transactions run (for tests)
        self.largest = 0  # the most requests one transaction carried (for tests)
        self._waiting: list[_Waiting] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    async def submit(self, spec: JobSpec, user: str) -> list[int]:
        """Store one request's job(s) with whatever else is waiting; its ids once committed."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[int]] = loop.create_future()
        with self._cond:
            self._waiting.append((spec, user, loop, fut))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="phx-submit", daemon=True)
                self._thread.start()
            self._cond.notify()
        return await fut

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._waiting:
                    self._cond.wait()
                group = self._waiting[: self.max_group]
                del self._waiting[: self.max_group]
            self.groups += 1
            self.largest = max(self.largest, len(group))
            try:
                outcomes = self.store_group([(spec, user) for spec, user, _, _ in group])
            except Exception as e:  # a bug in the group's path: every request hears of it
                log.exception("storing a group of %d submissions failed", len(group))
                outcomes = [e] * len(group)
            answers: dict[
                asyncio.AbstractEventLoop, list[tuple[asyncio.Future[list[int]], Outcome]]
            ]
            answers = {}
            for (_, _, loop, fut), outcome in zip(group, outcomes, strict=True):
                answers.setdefault(loop, []).append((fut, outcome))
            for loop, pairs in answers.items():  # one wake-up per event loop, not per request
                with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits
                    loop.call_soon_threadsafe(_answer, pairs)


def _answer(pairs: list[tuple[asyncio.Future[list[int]], Outcome]]) -> None:
    for fut, outcome in pairs:
        if fut.done():  # the request was cancelled (client gone); its job may still be stored
            continue
        if isinstance(outcome, Exception):
            fut.set_exception(outcome)
        else:
            fut.set_result(outcome)
