"""Direct step launch: the agent's listener that takes a step's tasks for this node from srun.

Slurm's srun hands a step's tasks to the slurmds itself, with a credential slurmctld signed;
the controller only records the step.  Phalanx does the same when ``steps.direct`` is on
(docs/slurm.md, "What a step costs"): the controller records the step and signs each node's
launch with that node's key (auth/launchcred.py), srun sends it here, and the agent starts the
tasks as it would from a heartbeat reply.  The long-poll stays the safety net: a step srun
cannot hand over reaches the node through it, and one handed over twice starts once.

Protocol (one request per connection, text lines): srun sends the credential as one JSON line;
the agent answers one line:

* ``ok``: the tasks are started (or were already);
* ``wait``: the job's own task on this node has not started yet; the step starts with the
  node's next heartbeat reply (the step is in the store: the protocol is level-triggered);
* ``refused REASON``: not a credential for this node (forged, expired, another node's), or
  the agent cannot start it; srun has the controller wake the node's long-poll instead.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import socketserver
import threading
from collections.abc import Callable
from typing import Any

from phalanx.netaddr import local_address

log = logging.getLogger("phalanx.agent")

MAX_REQUEST = 16 << 20  # a step's environment travels in the credential
READ_TIMEOUT_S = 10.0

Take = Callable[[Any], str]  # a decoded credential -> the answer line ("ok", "wait", ...)


class _Handler(socketserver.StreamRequestHandler):
    timeout = READ_TIMEOUT_S
    server: _Server

    def handle(self) -> None:
        try:
            line = self.rfile.readline(MAX_REQUEST + 1)
        except OSError:
            return
        if not line.endswith(b"\n"):
            answer = "refused request too long or cut short"
        else:
            try:
                cred = json.loads(line)
            except ValueError:
                answer = "refused not JSON"
            else:
                try:
                    answer = self.server.take(cred)
                except Exception as e:  # never let one request take the listener down
                    log.exception("direct step launch failed")
                    answer = f"refused agent error: {e}"
        with contextlib.suppress(OSError):
            self.wfile.write(answer.replace("\n", " ").encode() + b"\n")


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    take: Take


class StepListener:
    """Serves direct step launches on (host, port) in a thread of its own until closed."""

    def __init__(self, host: str, port: int, take: Take) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        _Server.address_family = family
        self._server = _Server((host, port), _Handler, bind_and_activate=True)
        self._server.take = take
        self.host = host
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.5},
            name="phx-steps",
            daemon=True,
        )

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def advertised(self, controller_urls: list[str]) -> str:
        """host:port to tell the controllers: the bound address, or for a wildcard bind the
        local address this host reaches the first controller from (no packet is sent)."""
        return render(advertised_host(self.host, controller_urls), self.port)


def advertised_host(bound: str, controller_urls: list[str]) -> str:
    if bound not in ("0.0.0.0", "::", ""):
        return bound
    found = local_address(controller_urls[0] if controller_urls else "http://127.0.0.1")
    return found or socket.gethostname()


def render(host: str, port: int) -> str:
    """host:port, with an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
