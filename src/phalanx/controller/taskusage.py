"""Live usage of a running job's tasks, asked of its nodes' agents (`sstat`).

Slurm's `sstat` asks the slurmds of a job's nodes for the usage their gatherers hold; here
the controller asks the agents, at the address each takes direct step launches on
(agent/step_listener.py), with a request signed by that node's key as a launch is
(auth/launchcred.py): an agent answers only a controller, and only about the attempt the
request names. Every node is asked at once, each within `timeout`; a node that does not
answer is reported with the reason, not waited for longer, so one sick node cannot hang a
user's `sstat`.
"""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from phalanx.netaddr import split_address

MAX_ANSWER = 4 << 20  # a node's answer: one line of JSON, a few hundred bytes a task


def ask_node(at: str, cred: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    """The usage entries one agent answers (agent/taskstat.py `step_usage`); OSError or
    ValueError with the reason when it cannot or will not answer."""
    host, port = split_address(at)
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(json.dumps(cred, separators=(",", ":")).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            buf += chunk
            if len(buf) > MAX_ANSWER:
                raise ValueError("answer too long")
    line = buf.decode(errors="replace").strip()
    word, _, rest = line.partition(" ")
    if word != "stat":
        raise ValueError(line or "no answer")
    tasks = json.loads(rest)
    if not isinstance(tasks, list):
        raise ValueError("not a list of tasks")
    return [t for t in tasks if isinstance(t, dict)]


def ask_nodes(
    asks: dict[str, tuple[str, dict[str, Any]]], timeout: float
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Ask every node of `asks` (node -> (address, signed request)) at once: (every task's
    entry, with its ``node``; node -> why it gave no answer)."""
    if not asks:
        return [], {}

    def one(node: str) -> tuple[str, list[dict[str, Any]] | str]:
        at, cred = asks[node]
        try:
            return node, ask_node(at, cred, timeout)
        except (OSError, ValueError) as e:
            return node, f"{at}: {e}"

    tasks: list[dict[str, Any]] = []
    failed: dict[str, str] = {}
    with ThreadPoolExecutor(max_workers=min(32, len(asks))) as pool:
        for node, got in pool.map(one, sorted(asks)):
            if isinstance(got, str):
                failed[node] = got
            else:
                tasks.extend({**t, "node": node} for t in got)
    return tasks, failed
