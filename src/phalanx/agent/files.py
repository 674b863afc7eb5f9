"""Small JSON files in task directories, read leniently and written atomically (agent side)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def read_json(p: Path) -> dict[str, Any] | None:
    """The JSON object in `p`, or None when it is missing, unreadable or not an object."""
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_json(p: Path, data: dict[str, Any]) -> None:
    """Write `p` through a temporary file and a rename, so readers never see half of it."""
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, p)


def write_private_json(p: Path, data: dict[str, Any]) -> None:
    """Create `p` (it must not exist: a task directory being prepared under a temporary name,
    renamed into place once complete) readable by this user only, in one open: the job's
    environment and its attempt's token are nobody else's business."""
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(json.dumps(data))
