"""Virtual nodes: one process serves many simulated nodes, speaking the real agent protocol.

Each virtual node does what `phalanx agent` does on the wire (agent/agent.py): it registers
(POST /v1/agents/NODE/register, with its own agent credential minted from the node key, as a
real agent's), then long-polls POST /v1/agents/NODE/heartbeat with the full list of its tasks
(level-triggered), and applies the reply: `start` makes a task that "runs" for the simulated
duration in its command (sim/workload.run_of), `stop` ends one as a stopped shepherd would,
`forget` drops an ended one. A task that ends is reported at once by an extra heartbeat with
no wait (the agent's exit watcher does the same), with the exit record a shepherd writes.
No processes, cgroups or files: a task is a timer. All nodes of the process share one
asyncio loop and one httpx connection pool to the controllers (a node's long-poll holds one
connection, as an agent's does).

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

import httpx

from phalanx import __version__
from phalanx.auth import keys as keyfiles
from phalanx.auth.tokens import mint_agent
from phalanx.sim.workload import run_of

log = logging.getLogger("phalanx.sim.nodes")

GRACE_MIN = 0.5  # as agent.heartbeat_grace: how long past its wait a heartbeat may take


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
        self._client: httpx.AsyncClient | None = None

    # ---------------------------------------------------------------- transport
    def _auth(self, node: Node) -> dict[str, str]:
        now = time.time()
        if not node.token or now >= node.token_expires - min(30.0, self.ttl / 3):
            keys = self.keys.for_scope("node", node.name)
            node.token = mint_agent(keys, node=node.name, cluster=self.cluster, lifetime=self.ttl)
            node.token_expires = now + self.ttl
        return {"Authorization": f"Bearer {node.token}"}

    async def _post(self, node: Node, what: str, body: dict[str, Any], timeout: float) -> Any:
        """POST to the node's controller; on failure the next call goes to the next one."""
        assert self._client is not None
        url = f"{self.urls[node.url_index]}/v1/agents/{node.name}/{what}"
        t = time.monotonic()
        try:
            r = await self._client.post(url, json=body, headers=self._auth(node), timeout=timeout)
            if r.status_code != 200:
                raise httpx.HTTPError(f"{r.status_code}: {r.text[:200]}")
        except httpx.HTTPError:
            self.counters.errors += 1
            node.url_index = (node.url_index + 1) % len(self.urls)
            raise
        if len(self.counters.hb_seconds) < 100_000:
            self.counters.hb_seconds.append(time.monotonic() - t)
        return r.json()

    # ---------------------------------------------------------------- protocol
    async def _register(self, node: Node) -> None:
        backoff = 0.2
        while not node.stopped:
            try:
                reply = await self._post(node, "register", node.body, timeout=30.0)
            except httpx.HTTPError:
                await asyncio.sleep(backoff)  # a retry's backoff, not a wait for a condition
                backoff = min(2 * backoff, 5.0)
                continue
            self.interval = float((reply.get("timing") or {}).get("heartbeat_interval", 1.0))
            self.counters.registered += 1
            return

    async def _heartbeat(self, node: Node, wait: float) -> None:
        body = {
            "tasks": [t.report() for t in node.tasks.values()],
            "taken_at": time.time(),
            "wait": wait,
        }
        reply = await self._post(
            node, "heartbeat", body, timeout=wait + max(GRACE_MIN, self.interval) + 10.0
        )
        self.counters.heartbeats += 1
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
        if not node.reporting:
            node.reporting = True
            asyncio.get_running_loop().create_task(self._report_now(node))

    async def _report_now(self, node: Node) -> None:
        """The exit watcher's report: at once, no wait (more exits in the meantime go too)."""
        await asyncio.sleep(0)  # exits of the same instant go in one report
        try:
            node.reporting = False
            await self._heartbeat(node, 0.0)
        except httpx.HTTPError:
            pass  # the long-poll loop reports it next

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
        backoff = 0.2
        while not node.stopped:
            try:
                await self._heartbeat(node, self.interval)
                backoff = 0.2
            except httpx.HTTPError:
                await asyncio.sleep(backoff)  # a retry's backoff, as the agent's
                backoff = min(2 * backoff, self.interval)

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
        limits = httpx.Limits(
            max_connections=len(self.nodes) * 2 + 16,
            max_keepalive_connections=len(self.nodes) * 2 + 16,
        )
        async with httpx.AsyncClient(limits=limits, timeout=30.0) as client:
            self._client = client
            jobs: list[asyncio.Task[None]] = []
            for node in self.nodes:
                jobs.append(asyncio.create_task(self._node_loop(node)))
            await done.wait()
            for j in jobs + self._stoppers:
                j.cancel()
            await asyncio.gather(*jobs, *self._stoppers, return_exceptions=True)

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
