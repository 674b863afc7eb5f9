"""Slurm's time forms, as `sacct -S/-E` and `sbatch --begin` take them, to epoch seconds.

Pure: the current time is a parameter, and the local time zone is the caller's (a relative
form is resolved where the command runs, as Slurm resolves it at submission).
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta

_UNITS = {
    "": 1, "s": 1, "sec": 1, "secs": 1, "second": 1, "seconds": 1,
    "m": 60, "min": 60, "mins": 60, "minute": 60, "minutes": 60,
    "h": 3600, "hour": 3600, "hours": 3600,
    "d": 86400, "day": 86400, "days": 86400,
    "w": 604800, "week": 604800, "weeks": 604800,
}  # fmt: skip
_CLOCK = r"(\d{1,2}):(\d{2})(?::(\d{2}))?"


def parse_time(text: str, now: float) -> float:
    """Slurm's time forms (sacct -S/-E, sbatch --begin) to epoch seconds, local time:
    `YYYY-MM-DD[THH:MM[:SS]]`, `MM/DD[/YY]`, `MMDD[YY]`, `HH:MM[:SS]` (today),
    `now[{+|-}N[unit]]`, `today`, `midnight`, `noon`, `teatime`, `tomorrow`, epoch seconds.
    Raises ValueError naming the text otherwise."""
    raw = text
    text = text.strip().lower()
    base = datetime.fromtimestamp(now)
    midnight = base.replace(hour=0, minute=0, second=0, microsecond=0)
    if text in ("today", "midnight"):
        return midnight.timestamp()
    if text == "noon":
        return midnight.replace(hour=12).timestamp()
    if text == "teatime":
        return midnight.replace(hour=16).timestamp()
    if text == "tomorrow":
        return (midnight + timedelta(days=1)).timestamp()
    if m := re.fullmatch(r"now(?:([+-])(\d+)([a-z]*))?", text):
        if m[1] is None:
            return now
        if m[3] not in _UNITS:
            raise ValueError(f"Invalid time specification: {raw} (unknown unit {m[3]!r})")
        step = int(m[2]) * _UNITS[m[3]]
        return now + step if m[1] == "+" else now - step
    if m := re.fullmatch(rf"(\d{{4}})-(\d{{2}})-(\d{{2}})(?:t{_CLOCK})?", text):
        y, mo, d = int(m[1]), int(m[2]), int(m[3])
        h, mi, s = int(m[4] or 0), int(m[5] or 0), int(m[6] or 0)
        return _stamp(raw, y, mo, d, h, mi, s)
    if m := re.fullmatch(r"(\d{1,2})[/.](\d{1,2})(?:[/.](\d{2}|\d{4}))?", text):
        year = _year(m[3], base.year)
        return _stamp(raw, year, int(m[1]), int(m[2]))
    if m := re.fullmatch(r"(\d{2})(\d{2})(\d{2})?", text):
        return _stamp(raw, _year(m[3], base.year), int(m[1]), int(m[2]))
    if m := re.fullmatch(_CLOCK, text):
        return _stamp(raw, base.year, base.month, base.day, int(m[1]), int(m[2]), int(m[3] or 0))
    if re.fullmatch(r"\d{9,}", text):
        return float(text)
    raise ValueError(
        f"Invalid time specification: {raw} (use YYYY-MM-DD[THH:MM[:SS]], MM/DD[/YY], "
        "HH:MM[:SS], now-1days, today, midnight)"
    )


def _year(text: str | None, default: int) -> int:
    if text is None:
        return default
    return int(text) + (2000 if len(text) == 2 else 0)


def _stamp(raw: str, y: int, mo: int, d: int, h: int = 0, mi: int = 0, s: int = 0) -> float:
    try:
        return datetime(y, mo, d, h, mi, s).timestamp()
    except ValueError as e:
        raise ValueError(f"Invalid time specification: {raw} ({e})") from None
