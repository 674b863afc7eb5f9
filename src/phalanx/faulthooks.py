"""Every test-only fault hook in one place: ways for a system test to make one part of a real
daemon misbehave where no signal can (SIGSTOP stops a whole process, not one loop of it, and
cannot be timed between a reply's sending and its reading). Each is off unless its environment
variable is set and names a file that exists; production never sets them. A hook logs an
error when it fires, so a stray setting cannot go unnoticed.

- `maybe_wedge(loop, stop)`: with PHALANX_TEST_ONLY_WEDGE_LOOP naming `loop` and the file of
  PHALANX_TEST_ONLY_WEDGE_FILE present, that loop blocks for good at its next tick
  (tests/system/test_systemd.py: the watchdog must notice one wedged loop).
- `maybe_hold_reply(reply, stop)`: while the file of PHALANX_TEST_ONLY_HOLD_REPLY_FILE exists,
  an agent holds a heartbeat reply that starts work before looking at it
  (tests/system/test_node_failure.py: a stopped agent with the reply in its socket).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

log = logging.getLogger("phalanx.faulthooks")

FAULT_WEDGE_LOOP = "PHALANX_TEST_ONLY_WEDGE_LOOP"
FAULT_WEDGE_FILE = "PHALANX_TEST_ONLY_WEDGE_FILE"
FAULT_HOLD_REPLY_FILE = "PHALANX_TEST_ONLY_HOLD_REPLY_FILE"


def maybe_wedge(loop: str, stop: threading.Event) -> None:
    """Block `loop` until the daemon stops, when the wedge hook names it."""
    if os.environ.get(FAULT_WEDGE_LOOP) != loop:
        return
    trigger = os.environ.get(FAULT_WEDGE_FILE)
    if not trigger or not os.path.exists(trigger):
        return
    log.error("test-only fault hook: wedging loop %s (%s is set)", loop, FAULT_WEDGE_LOOP)
    stop.wait()


def maybe_hold_reply(reply: dict[str, Any], stop: threading.Event) -> None:
    """Hold a reply that starts work while the hold hook's file exists."""
    hold = os.environ.get(FAULT_HOLD_REPLY_FILE)
    if not hold or not reply.get("start") or not os.path.exists(hold):
        return
    log.error("test-only fault hook: holding a reply that starts work (%s)", FAULT_HOLD_REPLY_FILE)
    while os.path.exists(hold) and not stop.wait(0.05):
        pass
