"""Virtual nodes: one process serves many simulated nodes, speaking the real agent protocol.

Each virtual node does what `phalanx agent` does on the wire (agent/agent.py): it registers
(POST /v1/agents/NODE/register, with its own agent credential minted from the node key, as a
real agent's), then long-polls POST /v1/agents/NODE/heartbeat with the full list of its tasks
(level-triggered), and applies the reply: `start` makes a task that "runs" for the simulated
duration in its command (sim/workload.run_of), `stop` ends one as a stopped shepherd would,
`forget` drops an ended one. A task that ends is reported at once by an extra heartbeat with
no wait (the agent's exit watcher does the same), with the exit record a shepherd writes.
No processes, cgroups or files: a task is a timer. All nodes of the process share one
asyncio loop and each node keeps its own keep-alive connections to its controller (its long-poll holds
one, as an agent's does; a minimal HTTP/1.1 client, `Conn`).

Failure injection: nodes named in the plan's `stop_at` stop heartbeating that many seconds
after they registered (their tasks vanish with them, as with a powered-off host); each such stop is
appended to `stopped_file` first, so the caller can tell a deliberate DOWN from a false one.

Run as `python -m phalanx.sim.nodes PLAN.json` (sim/run.py writes the plan); SIGTERM ends it,
after which it writes its counters to the plan's `stats_file`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phalanx import __version__
from phalanx.agent.agent_timing import learned_timing
from phalanx.auth import keys as keyfiles
from phalanx.auth.tokens import mint_agent
from phalanx.backoff import Backoff
from phalanx.sim.workload import run_of

log = logging.getLogger("phalanx.sim.nodes")

GRACE_MIN = 0.5  # as agent.heartbeat_grace: how long past its wait a heartbeat may take
SIM_REGISTER_TIMEOUT_S = 30.0  # a virtual node waits this long for a registration
SIM_REGISTER_CAP_S = 5.0  # and backs off up to this between registration attempts


class HttpError(Exception):
    """A call to a controller failed (refused, timed out, not 200)."""


class Conn:
    """One keep-alive HTTP/1.1 connection to a controller, for one virtual node's calls.

    A minimal client (requests with Content-Length, replies with Content-Length or chunked):
    httpx's pool looks at every pooled connection on each request, which costs O(nodes) per
    heartbeat with thousands of long-polls open; a connection per node costs O(1)."""

    def __init__(self, url: str) -> None:
        rest = url.split("://", 1)[1].rstrip("/")
        host, _, port = rest.partition(":")
        self.url, self.host, self.port = url, host, int(port or 80)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.busy = asyncio.Lock()  # one request at a time on a connection

    async def post(self, path: str, body: dict[str, Any], token: str) -> Any:
        async with self.busy:
            return await self._post(path, body, token)

    async def _post(self, path: str, body: dict[str, Any], token: str) -> Any:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        data = json.dumps(body, separators=(",", ":")).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        )
        self.writer.write(head.encode() + data)
        await self.writer.drain()
        status_line = await self.reader.readuntil(b"\r\n")
        status = int(status_line.split()[1])
        length, chunked, close = 0, False, False
        while True:
            line = await self.reader.readuntil(b"\r\n")
            if line == b"\r\n":
                break
            name, _, value = line.decode("latin-1").partition(":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "transfer-encoding" and "chunked" in value:
                chunked = True
            elif name == "connection" and value == "close":
                close = True
        if chunked:
            parts = []
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                chunk = await self.reader.readexactly(size + 2)
                if size == 0:
                    break
                parts.append(chunk[:-2])
            payload = b"".join(parts)
        else:
            payload = await self.reader.readexactly(length)
        if close:
            self.close()
        if status != 200:
            raise HttpError(f"{status}: {payload[:200]!r}")
        return json.loads(payload)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


@dataclass
class Task:
    attempt_id: int
    token: str
    started_at: float
    exit: dict[str, Any] | None = None  # set when it ended
    timer: asyncio.TimerHandle | None = None

    def report(self) -> dict[str, Any]:
        rep: dict[str, Any] = {
            "attempt_id": self.attempt_id,
            "token": self.token,
            "state": "exited" if self.exit else "running",
            "started_at": self.started_at,
            "signals_done": 0,
        }
        if self.exit:
            rep["exit"] = self.exit
        return rep


@dataclass
class Node:
    name: str
    body: dict[str, Any]  # the register request
    url_index: int
    tasks: dict[int, Task] = field(default_factory=dict)
    stopped: bool = False
    token: str = ""
    token_expires: float = 0.0
    reporting: bool = False  # an immediate (exit) report is in flight
    report_again: bool = False  # an exit since that report was taken
    # forgotten attempts: a reply computed before the forget may still say "start" (as agent.py)
    forgotten: set[int] = field(default_factory=set)


@dataclass
class Counters:
    registered: int = 0
    heartbeats: int = 0
    errors: int = 0
    started: int = 0
    exited: int = 0
    stopped_tasks: int = 0
    hb_seconds: list[float] = field(default_factory=list)  # sample of heartbeat round trips


class NodeServer:
    def __init__(self, plan: dict[str, Any]) -> None:
        self.urls: list[str] = list(plan["urls"])
        self.cluster: str = plan["cluster"]
        self.ttl = float(plan.get("credential_ttl", 3600.0))
        self.interval = float(plan.get("heartbeat_interval", 1.0))
        # registrations are spread over this long (a cluster's nodes do not boot in one instant)
        self.register_spread = float(plan.get("register_spread", 1.0))
        self.keys = keyfiles.load(Path(plan["key_file"]))
        self.stop_at: dict[str, float] = {k: float(v) for k, v in plan.get("stop_at", {}).items()}
        self.stopped_file = Path(plan["stopped_file"])
        self.nodes = [
            Node(n["name"], n["body"], i % len(self.urls)) for i, n in enumerate(plan["nodes"])
        ]
        self.counters = Counters()
        self.rng = random.Random(plan.get("seed", 1))
        self._stoppers: list[asyncio.Task[None]] = []
        self._reports: set[asyncio.Task[None]] = set()
        self._conns: dict[tuple[str, int], Conn] = {}

    # ---------------------------------------------------------------- transport
    def _auth(self, node: Node) -> str:
        now = time.time()
        if not node.token or now >= node.token_expires - min(30.0, self.ttl / 3):
            keys = self.keys.for_scope("node", node.name)
            node.token = mint_agent(keys, node=node.name, cluster=self.cluster, lifetime=self.ttl)
            node.token_expires = now + self.ttl
        return node.token

    async def _post(
        self, node: Node, what: str, body: dict[str, Any], timeout: float, conn: int = 0
    ) -> Any:
        """POST to the node's controller on the node's own connection `conn` (0: the long-poll
        loop's, 1: the exit reports'); on failure the next call goes to the next controller."""
        t = time.monotonic()
        url = self.urls[node.url_index]
        key = (node.name, conn)
        c = self._conns.get(key)
        if c is None or c.url != url:
            if c is not None:
                c.close()
            c = self._conns[key] = Conn(url)
        try:
            reply = await asyncio.wait_for(
                c.post(f"/v1/agents/{node.name}/{what}", body, self._auth(node)), timeout
            )
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError, HttpError):
            self.counters.errors += 1
            c.close()
            self._conns.pop(key, None)
            node.url_index = (node.url_index + 1) % len(self.urls)
            raise HttpError(f"{what} for {node.name} failed") from None
        if len(self.counters.hb_seconds) < 100_000:
            self.counters.hb_seconds.append(time.monotonic() - t)
        return reply

    # ---------------------------------------------------------------- protocol
    async def _register(self, node: Node) -> None:
        retry = Backoff(rng=self.rng)  # jittered, as the agent's (phalanx/backoff.py)
        while not node.stopped:
            try:
                # 30 s, not the agent's 10 s (REGISTER_TIMEOUT_S): with 10 s a 10,000-node
                # boot storm did not settle on this machine (docs/sim.md, "Registration
                # storms"); the figures recorded there are with 30 s
                reply = await self._post(
                    node, "register", node.body, timeout=SIM_REGISTER_TIMEOUT_S
                )
            except HttpError:
                # a retry's backoff, not a wait for a condition
                await asyncio.sleep(retry.next_delay(SIM_REGISTER_CAP_S))
                continue
            self._learn_interval(reply)
            self.counters.registered += 1
            return

    def _learn_interval(self, reply: dict[str, Any]) -> None:
        """The interval a register or heartbeat reply gives (the controllers lengthen it as
        the cluster grows: the heartbeat rule), taken as the agent takes it."""
        timing, _bad = learned_timing({"heartbeat_interval": self.interval}, reply.get("timing"))
        self.interval = float(timing["heartbeat_interval"])

    async def _heartbeat(self, node: Node, wait: float, conn: int = 0) -> None:
        body = {
            "tasks": [t.report() for t in node.tasks.values()],
            "taken_at": time.time(),
            "wait": wait,
        }
        reply = await self._post(
            node, "heartbeat", body, timeout=wait + max(GRACE_MIN, self.interval) + 10.0, conn=conn
        )
        self.counters.heartbeats += 1
        self._learn_interval(reply)
        if not node.stopped:
            self._apply(node, reply)

    def _apply(self, node: Node, reply: dict[str, Any]) -> None:
        now = time.time()
        loop = asyncio.get_running_loop()
        for launch in reply.get("start", []):
            aid = int(launch["attempt_id"])
            if aid in node.tasks or aid in node.forgotten:
                continue  # launching is idempotent per attempt, as the agent's
            task = Task(aid, str(launch["token"]), now)
            node.tasks[aid] = task
            self.counters.started += 1
            if launch.get("holder"):
                continue  # a gang job's other nodes hold the allocation until it is stopped
            seconds, code, timed_out = run_of(launch.get("command"), launch.get("time_limit_s"))
            task.timer = loop.call_later(seconds, self._end, node, task, code, timed_out, None)
        for stop in reply.get("stop", []):
            task_or_none = node.tasks.get(int(stop["attempt_id"]))
            if task_or_none is not None and task_or_none.exit is None:
                self.counters.stopped_tasks += 1
                self._end(node, task_or_none, None, False, str(stop.get("reason") or "stop"))
        for aid in reply.get("forget", []):
            node.tasks.pop(int(aid), None)
            node.forgotten.add(int(aid))

    def _end(
        self, node: Node, task: Task, code: int | None, timed_out: bool, stop_reason: str | None
    ) -> None:
        """The task ended (its run time passed, or a stop request): the exit a shepherd writes."""
        if node.stopped or task.exit is not None:
            return
        if task.timer is not None:
            task.timer.cancel()
        stopped = stop_reason is not None
        task.exit = {
            "exit_code": None if (stopped or timed_out) else code,
            "signal": 15 if (stopped or timed_out) else None,
            "timed_out": timed_out,
            "cancelled": stopped,
            "fenced": False,
            "launch_failed": False,
            "error": None,
            "started_at": task.started_at,
            "ended_at": time.time(),
            "stop_requested": stopped,
            "stop_reason": stop_reason,
            "checkpoint_signal_sent_at": None,
        }
        self.counters.exited += 1
        node.report_again = True
        if not node.reporting:
            node.reporting = True
            report = asyncio.get_running_loop().create_task(self._report_now(node))
            self._reports.add(report)
            report.add_done_callback(self._reports.discard)

    async def _report_now(self, node: Node) -> None:
        """The exit watcher's report: at once, no wait; exits while it is in flight go in
        another one right after it (one report at a time per node)."""
        try:
            while node.report_again and not node.stopped:
                node.report_again = False
                await asyncio.sleep(0)  # exits of the same instant go in one report
                try:
                    await self._heartbeat(node, 0.0, conn=1)
                except HttpError:
                    return  # the long-poll loop reports it next
        finally:
            node.reporting = False

    async def _node_loop(self, node: Node) -> None:
        await asyncio.sleep(self.rng.uniform(0, self.register_spread))  # spread the starts
        await self._register(node)
        if node.name in self.stop_at:  # the injected failure, counted from its registration
            loop_task = asyncio.current_task()
            assert loop_task is not None
            stopper = asyncio.create_task(self._stop_later(node, self.stop_at[node.name]))
            self._stoppers.append(stopper)
            stopper.add_done_callback(lambda _t: loop_task.cancel())
        # spread the heartbeats over one interval, as independent agents' are
        await asyncio.sleep(self.rng.uniform(0, self.interval))
        retry = Backoff(rng=self.rng)
        while not node.stopped:
            try:
                await self._heartbeat(node, self.interval)
                retry.reset()
            except HttpError:
                await asyncio.sleep(retry.next_delay(self.interval))  # as the agent's
            except Exception:  # a bug here must not look like a dead node: say it, go on
                log.exception("virtual node %s: unexpected error in its heartbeat loop", node.name)
                self.counters.errors += 1
                await asyncio.sleep(retry.next_delay(self.interval))

    async def _stop_later(self, node: Node, after: float) -> None:
        await asyncio.sleep(after)  # the simulated failure's moment
        with self.stopped_file.open("a") as f:  # first: a DOWN after this is deliberate
            f.write(f"{node.name} {time.time():.3f}\n")
        node.stopped = True
        for t in node.tasks.values():
            if t.timer is not None:
                t.timer.cancel()

    # ---------------------------------------------------------------- main
    async def run(self, done: asyncio.Event) -> None:
        jobs = [asyncio.create_task(self._node_loop(node)) for node in self.nodes]
        await done.wait()
        for j in jobs + self._stoppers:
            j.cancel()
        await asyncio.gather(*jobs, *self._stoppers, return_exceptions=True)
        for c in self._conns.values():
            c.close()

    def stats(self) -> dict[str, Any]:
        hb = sorted(self.counters.hb_seconds)
        c = self.counters
        return {
            "nodes": len(self.nodes),
            "registered": c.registered,
            "heartbeats": c.heartbeats,
            "errors": c.errors,
            "tasks_started": c.started,
            "tasks_exited": c.exited,
            "tasks_stopped": c.stopped_tasks,
            "rtt_p50": hb[len(hb) // 2] if hb else None,
            "rtt_p99": hb[int(len(hb) * 0.99)] if hb else None,
            "version": __version__,
        }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m phalanx.sim.nodes PLAN.json", file=sys.stderr)
        return 2
    plan = json.loads(Path(args[0]).read_text())
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s sim-nodes %(message)s")
    server = NodeServer(plan)

    async def go() -> None:
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, done.set)
        await server.run(done)

    asyncio.run(go())
    Path(plan["stats_file"]).write_text(json.dumps(server.stats()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
