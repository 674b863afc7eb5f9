"""Small JSON files in task directories, read leniently and written atomically (agent side).

Both go through :mod:`phalanx.agent.jobfiles`: a file is read only when it is a regular file of
the agent's own uid (never through a link, never blocking, bounded), and written through a
temporary file created exclusively and renamed over it, never through whatever is there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from phalanx.agent import jobfiles


def read_json(p: Path) -> dict[str, Any] | None:
    """The JSON object in `p`, or None when it is missing, unreadable, refused (not a regular
    file the agent's uid owns: reported once) or not an object."""
    got = jobfiles.read_or_none(p, (os.geteuid(),), jobfiles.MAX_NODE_FILE)
    if got is None:
        return None
    try:
        data = json.loads(got[0])
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def write_json(p: Path, data: dict[str, Any]) -> None:
    """Write `p` through a temporary file and a rename, so readers never see half of it."""
    jobfiles.replace_file(p, json.dumps(data).encode())


def write_private_json(p: Path, data: dict[str, Any]) -> None:
    """Create `p` (it must not exist: a task directory being prepared under a temporary name,
    renamed into place once complete) readable by this user only, in one open: the job's
    environment and its attempt's token are nobody else's business."""
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(json.dumps(data))
