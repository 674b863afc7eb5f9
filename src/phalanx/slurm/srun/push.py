"""srun's half of direct step launch: hand each node's signed launch to its agent.

The controller answers `POST /v1/jobs/ID/steps` (with ``direct``) with one credential per node
and the address its agent takes launches at (agent/step_listener.py).  srun sends them all at
once, over non-blocking connections in one thread (a step on many nodes is not a thread per
node), and waits up to the controller's ``push_timeout`` for the answers.  The nodes that did
not take theirs (unreachable, refused, too slow) are returned: srun then has the controller
wake their long-polls, which carry the same step (it is in the store), so a failed hand-over
costs time, never the step.
"""

from __future__ import annotations

import errno
import json
import selectors
import socket
import time
from typing import Any

from phalanx.netaddr import split_address

TAKEN = ("ok", "wait")  # "wait": the node starts it with its job's task (its next heartbeat)
MAX_ANSWER = 4096  # an agent answers one short line; whatever sends more is not one


class _Push:
    def __init__(self, node: str, sock: socket.socket, payload: bytes) -> None:
        self.node = node
        self.sock = sock
        self.out = memoryview(payload)
        self.answer = b""


def hand_over(launches: list[dict[str, Any]], timeout: float) -> list[str]:
    """Send each launch to its node's agent; the nodes that did not take theirs."""
    failed: list[str] = []
    pushes: dict[socket.socket, _Push] = {}
    sel = selectors.DefaultSelector()
    try:
        for launch in launches:
            node = str(launch.get("node"))
            try:
                host, port = split_address(str(launch["at"]))
                family, kind, proto, _, addr = socket.getaddrinfo(
                    host, port, type=socket.SOCK_STREAM
                )[0]
                sock = socket.socket(family, kind, proto)
            except (KeyError, ValueError, OSError):
                failed.append(node)
                continue
            sock.setblocking(False)
            err = sock.connect_ex(addr)
            if err not in (0, errno.EINPROGRESS):
                sock.close()
                failed.append(node)
                continue
            cred = {k: launch[k] for k in ("item", "kid", "sig") if k in launch}
            payload = json.dumps(cred, separators=(",", ":")).encode() + b"\n"
            pushes[sock] = _Push(node, sock, payload)
            sel.register(sock, selectors.EVENT_WRITE)
        deadline = time.monotonic() + timeout
        while pushes:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _events in sel.select(left):
                push = pushes[key.fileobj]  # type: ignore[index]
                try:
                    done = _progress(push, sel)
                except OSError:
                    done, push.answer = True, b""
                if done:
                    sel.unregister(push.sock)
                    push.sock.close()
                    del pushes[push.sock]
                    answer = push.answer.split(b"\n", 1)[0].decode(errors="replace")
                    if answer not in TAKEN:
                        failed.append(push.node)
        for push in pushes.values():  # too slow: the long-poll brings it instead
            failed.append(push.node)
            push.sock.close()
    finally:
        sel.close()
    return failed


def _progress(push: _Push, sel: selectors.BaseSelector) -> bool:
    """One step of one push (connected and writing, or reading the answer); True when over."""
    if push.out:
        err = push.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            raise OSError(err, "connect")
        push.out = push.out[push.sock.send(push.out) :]
        if not push.out:
            sel.modify(push.sock, selectors.EVENT_READ)
        return False
    chunk = push.sock.recv(4096)
    push.answer += chunk
    return not chunk or b"\n" in push.answer or len(push.answer) > MAX_ANSWER
