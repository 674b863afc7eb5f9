"""Start-up helpers shared by every daemon (controller, agent, authd).

They live here, apart from `phalanx.controller.server`, because that module imports the whole
HTTP stack (FastAPI, uvicorn, SQLAlchemy): an agent that took these helpers from there paid
about 1.7 s of CPU per start for modules it never uses.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from phalanx.watchdog import DeviceWatchdog


class StartupError(Exception):
    """A problem that stops the daemon at start, with a one-line explanation."""


def check_state_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise StartupError(f"state dir {path} is not writable: {e.strerror or e}") from None


def open_device(path: str | None, interval: float) -> DeviceWatchdog | None:
    """The hardware watchdog of `watchdog.device`, armed; None when none is configured.

    Refused at start when it cannot be opened, or when its own timeout would fire between two
    pets (the daemon pets it every `interval` seconds)."""
    if not path:
        return None
    device = DeviceWatchdog(path)
    try:
        timeout = device.open()
    except OSError as e:
        raise StartupError(
            f"cannot open the watchdog device {path} (watchdog.device): {e.strerror or e}"
        ) from None
    if timeout is not None and timeout <= interval:
        device.close(disarm=True)
        raise StartupError(
            f"the watchdog device {path} fires after {timeout:g}s, but it is petted only every "
            f"{interval:g}s: raise its timeout (e.g. softdog's soft_margin) above that"
        )
    return device


def setup_logging(level: str, name: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("httpx", "httpcore", "alembic", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
