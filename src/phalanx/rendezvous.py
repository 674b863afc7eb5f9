"""torchrun's rendezvous, hosted by the controllers: ``torchrun --rdzv-backend=phalanx``.

torchrun's elastic mode (``--nnodes=MIN:MAX``) keeps the state of its rendezvous in a backend.
The usual one, ``c10d``, keeps it in a TCPStore on one node of the job (``--rdzv-endpoint``):
when that node dies, the rendezvous dies with it and no survivor can form a new group. This
backend keeps it in the controllers' store instead (controller/rendezvous_api.py,
store/rendezvous.py), which is highly available: any one node of the job may die, the first
included, and the others re-form their group with whoever joins (a hot spare of a --no-kill
job: docs/elastic.md).

Only the standard library and torch are needed (HTTP through `phalanx.lean_client`, the client
srun uses in jobs), so ``pip install --no-deps phalanx`` in a training environment is enough:
torchrun finds the backend through the ``torchrun.handlers`` entry point. Inside a job it
needs nothing else: the job id from ``$SLURM_JOB_ID``, the controllers from ``$PHALANX_URL``
(every controller of the cluster: it fails over between them) and the node's local credential,
as srun. ``--rdzv-endpoint``, when given, is a comma list of controller URLs instead.

    srun torchrun --nnodes=1:2 --nproc-per-node=8 --max-restarts=3 \\
        --rdzv-backend=phalanx --rdzv-id=$SLURM_JOB_ID train.py

What it adds to torch's own dynamic rendezvous (`DynamicRendezvousHandler`, unchanged):

* the state's compare-and-set is one transaction in the store; a set whose answer was lost is
  sent again to another controller (the token makes a repeat a no-op);
* the controllers say which participants are on nodes that left the job (`departed`), and
  those are dropped at once, as torch drops a participant whose keep-alive lapsed, instead of
  after ``keep_alive_interval * keep_alive_max_attempt`` (15 s by default);
* the round's key-value store (master address, worker ranks, the exit barrier) is in the
  controllers too (`PhalanxStore`);
* each round's master address is published afresh: torch kept a non-zero rank's first one,
  which named a dead node once the node that had been rank 0 was gone.
"""

from __future__ import annotations

import base64
import os
import pickle
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote

from phalanx.errors import PhalanxError
from phalanx.lean_client import LeanClient

BACKEND = "phalanx"
JOB_ENV = ("SLURM_JOB_ID", "PHX_JOB_ID")
NODE_ENV = ("PHX_NODENAME", "SLURMD_NODENAME")
POLL_FIRST_S = 0.01  # a blocking get's first wait; doubles up to POLL_MAX_S
POLL_MAX_S = 0.1
# How often a node waiting in a round reads the state: torch's once a second made every wait
# (a peer's join, the round's completion) last half a second on average. Small jobs poll
# faster; from SYNC_NODES nodes on, torch's second again (every waiting node is a request).
SYNC_MIN_S = 0.2
SYNC_NODES = 500
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _job_id(env: dict[str, str] | os._Environ[str]) -> str:
    for name in JOB_ENV:
        value = (env.get(name) or "").strip()
        if value.isdecimal():
            return value
    raise PhalanxError(
        "torchrun --rdzv-backend=phalanx runs inside a Phalanx job: no $SLURM_JOB_ID here"
    )


class RendezvousClient:
    """The HTTP side (standard library only): one job's rendezvous `run_id`."""

    def __init__(
        self,
        run_id: str,
        *,
        urls: str | None = None,
        job: str | None = None,
        client: LeanClient | None = None,
    ) -> None:
        self.job = job or _job_id(os.environ)
        self.run_id = run_id
        self.client = client or LeanClient(urls or None)
        self.base = f"/v1/jobs/{self.job}/rendezvous/{quote(run_id, safe='')}"

    def get_state(self) -> tuple[bytes | None, int | None, list[str]]:
        """(state, token, departed member descs)."""
        got = self.client.request("GET", f"{self.base}/state", None, idempotent=True)
        raw = base64.b64decode(got["state"]) if got["state"] is not None else None
        return raw, got["token"], list(got.get("departed") or [])

    def set_state(
        self, state: bytes, token: int | None, *, desc: str | None, node: str | None
    ) -> tuple[bytes | None, int | None, bool, list[str]]:
        """Compare-and-set: (state now, its token, whether this call set it, departed). Safe
        to repeat (another controller after a lost answer): the token has moved on then."""
        body = {"state": base64.b64encode(state).decode(), "token": token, "desc": desc,
                "node": node}  # fmt: skip
        got = self.client.request("PUT", f"{self.base}/state", body, idempotent=True)
        raw = base64.b64decode(got["state"]) if got["state"] is not None else None
        return raw, got["token"], bool(got["set"]), list(got.get("departed") or [])

    def kv(
        self,
        op: str,
        keys: Sequence[str] = (),
        values: Sequence[bytes] = (),
        delta: int = 0,
    ) -> dict[str, Any]:
        """One key-value operation (set, get, add, delete, count). An add is not repeated
        once it may have been applied (it would count twice)."""
        body = {
            "op": op,
            "keys": list(keys),
            "values": [base64.b64encode(v).decode() for v in values],
            "delta": delta,
        }
        reply: dict[str, Any] = self.client.request(
            "POST", f"{self.base}/kv", body, idempotent=op != "add"
        )
        return reply

    def get_values(self, keys: Sequence[str]) -> dict[str, bytes]:
        """The keys that exist, with their values."""
        got = self.kv("get", keys)["values"]
        return {k: base64.b64decode(v) for k, v in got.items()}

    def wait_for(self, keys: Sequence[str], timeout: float) -> dict[str, bytes]:
        """Every key's value, once all exist; TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        delay = POLL_FIRST_S
        while True:
            got = self.get_values(keys)
            if len(got) == len(set(keys)):
                return got
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(keys) - set(got))
                raise TimeoutError(f"rendezvous keys not set after {timeout:g}s: {missing}")
            time.sleep(min(delay, left))
            delay = min(delay * 2, POLL_MAX_S)


def drop_departed(state_bits: bytes, departed: Sequence[str]) -> bytes:
    """The state with the departed participants' keep-alive set to long ago, so that torch's
    own sanitizing drops them at once (the state is torch's pickle: unpickled here, in the
    job, as torch itself does; the controllers never unpickle it)."""
    state = pickle.loads(state_bits)
    gone = set(departed)
    nodes = set(state.last_heartbeats) | set(state.participants) | set(state.wait_list)
    nodes |= set(getattr(state, "redundancy_list", ()))
    hit = [n for n in nodes if repr(n) in gone]
    if not hit:
        return state_bits
    for n in hit:
        state.last_heartbeats[n] = _EPOCH
    return pickle.dumps(state)


def sync_interval(max_nodes: int) -> float:
    """Seconds between two reads of the state by a node waiting in a round."""
    return min(1.0, max(SYNC_MIN_S, max_nodes / SYNC_NODES))


def _node_name() -> str | None:
    for name in NODE_ENV:
        value = (os.environ.get(name) or "").strip()
        if value:
            return value
    return None


def _torch_classes() -> tuple[Any, Any, Any]:
    """The torch side, built on first use (torch is imported only by torchrun's process)."""
    import torch.distributed as dist
    from torch.distributed import DistStoreError
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousConnectionError,
        RendezvousStateError,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousBackend,
        RendezvousSettings,
        RendezvousTimeout,
        _BackendRendezvousStateHolder,
    )

    class PhalanxRendezvousBackend(RendezvousBackend):
        """torch's rendezvous state in the controllers (compare-and-set on a token)."""

        def __init__(self, rdzv: RendezvousClient) -> None:
            self.rdzv = rdzv
            self.desc: str | None = None  # this agent's node desc, once its handler made it
            self.node = _node_name()

        @property
        def name(self) -> str:
            return BACKEND

        def get_state(self) -> tuple[bytes, Any] | None:
            try:
                state, token, departed = self.rdzv.get_state()
            except PhalanxError as e:
                raise RendezvousConnectionError(f"phalanx rendezvous: {e.message}") from e
            if state is None:
                return None
            return self._fresh(state, departed), token

        def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
            try:
                expect = int(token) if token is not None else None
            except (TypeError, ValueError):
                return self._current()
            try:
                now, new, done, departed = self.rdzv.set_state(
                    state, expect, desc=self.desc, node=self.node
                )
            except PhalanxError as e:
                raise RendezvousConnectionError(f"phalanx rendezvous: {e.message}") from e
            if now is None:
                return None
            return self._fresh(now, departed), new, done

        def _current(self) -> tuple[bytes, Any, bool] | None:
            got = self.get_state()
            return None if got is None else (got[0], got[1], False)

        @staticmethod
        def _fresh(state: bytes, departed: list[str]) -> bytes:
            if not departed:
                return state
            try:
                return drop_departed(state, departed)
            except (pickle.PickleError, AttributeError, EOFError) as e:
                raise RendezvousStateError(f"phalanx rendezvous: unreadable state: {e}") from e

    class PhalanxStore(dist.Store):
        """The round's key-value store in the controllers (torch's c10d Store interface)."""

        def __init__(self, rdzv: RendezvousClient, timeout: timedelta) -> None:
            super().__init__()
            self.rdzv = rdzv
            self.set_timeout(timeout)

        def _seconds(self, override: timedelta | None = None) -> float:
            t = override if override is not None else self.timeout
            return max(0.0, t.total_seconds())

        def set(self, key: str, value: Any) -> None:
            raw = value if isinstance(value, bytes) else str(value).encode()
            self.rdzv.kv("set", [key], [raw])

        def get(self, key: str) -> bytes:
            try:
                return self.rdzv.wait_for([key], self._seconds())[key]
            except TimeoutError as e:
                raise DistStoreError(str(e)) from None

        def add(self, key: str, value: int) -> int:
            return int(self.rdzv.kv("add", [key], delta=int(value))["value"])

        def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
            try:
                self.rdzv.wait_for(list(keys), self._seconds(timeout))
            except TimeoutError as e:
                raise DistStoreError(str(e)) from None

        def check(self, keys: list[str]) -> bool:
            return len(self.rdzv.get_values(list(keys))) == len(set(keys))

        def delete_key(self, key: str) -> bool:
            return bool(self.rdzv.kv("delete", [key])["deleted"])

        def num_keys(self) -> int:
            return int(self.rdzv.kv("count")["count"])

    class PhalanxRendezvousHandler(DynamicRendezvousHandler):
        """torch's handler, publishing each round's master address afresh and reading the
        state anew on every look (no cache: it is polled at `sync_interval` instead)."""

        @classmethod
        def from_backend(  # torch's, with an uncached state holder
            cls,
            run_id: str,
            store: Any,
            backend: Any,
            min_nodes: int,
            max_nodes: int,
            local_addr: str | None = None,
            timeout: Any = None,
            keep_alive_interval: int = 5,
            keep_alive_max_attempt: int = 3,
        ) -> Any:
            node = cls._node_desc_generator.generate(local_addr)
            settings = RendezvousSettings(
                run_id,
                min_nodes,
                max_nodes,
                timeout or RendezvousTimeout(),
                keep_alive_interval=timedelta(seconds=keep_alive_interval),
                keep_alive_max_attempt=keep_alive_max_attempt,
            )
            holder = _BackendRendezvousStateHolder(backend, settings, cache_duration=0)
            return cls(node, settings, backend.name, store, holder)

        def next_rendezvous(self) -> Any:
            # torch keeps a non-zero rank's first bootstrap address for good; once the node
            # that was rank 0 (and hosted that address's store) has left, it names a dead node
            self._bootstrap_store_info = None
            return super().next_rendezvous()

    return PhalanxRendezvousBackend, PhalanxStore, PhalanxRendezvousHandler


def create_handler(params: Any) -> Any:
    """A torch RendezvousHandler for torchrun's `RendezvousParameters` (``--rdzv-conf``
    keys as for torch's own dynamic handler: join_timeout, last_call_timeout,
    close_timeout, heartbeat_timeout, keep_alive_interval, keep_alive_max_attempt)."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout

    backend_cls, store_cls, handler_cls = _torch_classes()
    endpoint = (params.endpoint or "").strip()
    urls = endpoint if "://" in endpoint else None
    rdzv = RendezvousClient(params.run_id, urls=urls)

    def seconds(key: str) -> timedelta | None:
        value = params.get_as_int(key + "_timeout")
        return None if value is None else timedelta(seconds=value)

    timeout = RendezvousTimeout(
        seconds("join"), seconds("last_call"), seconds("close"), seconds("heartbeat")
    )
    backend = backend_cls(rdzv)
    store = store_cls(rdzv, timeout.join)
    handler = handler_cls.from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        timeout,
        keep_alive_interval=params.get_as_int("keep_alive_interval", 5),
        keep_alive_max_attempt=params.get_as_int("keep_alive_max_attempt", 3),
    )
    backend.desc = repr(handler._this_node)
    _poll_every(sync_interval(int(params.max_nodes)))
    return handler


def _poll_every(every: float) -> None:
    """Make torch's wait between two looks at a round's state (its `_delay(seconds=1)` on
    SYNC) `every` seconds long, in this process: torchrun's, whose one rendezvous is this one.
    torch offers no setting for it; the random start-up jitter (a range) is left alone."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    original = getattr(dr._delay, "phalanx_original", dr._delay)

    def delay(seconds: Any) -> None:  # called as torch calls it: _delay(seconds=...)
        original(seconds=every if seconds == 1 else seconds)

    delay.phalanx_original = original  # type: ignore[attr-defined]
    dr._delay = delay


def handler() -> Callable[[Any], Any]:
    """The ``torchrun.handlers`` entry point: torch calls it for the handler's factory."""
    return create_handler
