"""Counted cluster resources (licences): Slurm's ``Licenses=fluent:30,matlab:5`` (pure).

A licence is a name with a cluster-wide count, not tied to any node. A job asks for some with
``--licenses=fluent:2,matlab`` (``-L``; a name alone means 1). Every attempt that still holds
its nodes (not ENDED: starting, running or stopping) holds its job's licences too, so a
requeued job whose old attempt is still stopping cannot start again on licences it has not
given back. The scheduler's pass starts a job only when all of its licences are free after the
jobs started before it in the same pass (:class:`Pool`); a job that waits only for licences
shows the reason ``Licenses`` as in Slurm.

What is not modelled (documented in docs/configuration.md): Slurm's ``|`` (one licence OR
another) and remote (database-held) licences; a job that waits for licences gets no backfill
reservation, so jobs asking for fewer of the same licence may pass it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

__all__ = [
    "Pool",
    "format_licenses",
    "held",
    "parse_licenses",
    "parse_totals",
    "refusal",
]

_NAME = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")
MAX_COUNT = 1_000_000_000


def _parse(text: str, *, what: str, need_count: bool) -> dict[str, int]:
    out: dict[str, int] = {}
    text = text.strip()
    if not text:
        raise ValueError(f"empty {what}: write e.g. fluent:2,matlab:1")
    if "|" in text:
        raise ValueError(
            f"{what} {text!r}: '|' (one licence or another) is not supported; "
            "ask for every licence the job needs, separated by ','"
        )
    for item in text.split(","):
        item = item.strip()
        name, sep, count = item.partition(":")
        if not sep:
            count = "" if need_count else "1"
        name = name.strip()
        if not _NAME.match(name):
            raise ValueError(
                f"{what} {text!r}: {name!r} is not a licence name "
                "(letters, digits, '_', '.', '-', '@'; up to 64)"
            )
        count = count.strip()
        if not count.isdecimal():
            raise ValueError(
                f"{what} {text!r}: the count of {name} must be a whole number, "
                f"e.g. {name}:{2 if need_count else 1}"
            )
        n = int(count)
        if n > MAX_COUNT:
            raise ValueError(f"{what} {text!r}: {name}:{n} is more than {MAX_COUNT}")
        if need_count and n < 0:
            raise ValueError(f"{what} {text!r}: negative count for {name}")
        if not need_count and n < 1:
            raise ValueError(f"{what} {text!r}: ask for at least 1 {name} (or leave it out)")
        if name in out:
            raise ValueError(f"{what} {text!r}: {name} is named twice")
        out[name] = n
    return out


def parse_licenses(text: str) -> dict[str, int]:
    """A job's request (``fluent:2,matlab`` -> {fluent: 2, matlab: 1}); ValueError if bad."""
    return _parse(text, what="--licenses", need_count=False)


def parse_totals(value: str | Mapping[str, int]) -> dict[str, int]:
    """The cluster's counts from config: Slurm's string ``fluent:30,matlab:5`` or a table."""
    if isinstance(value, str):
        return _parse(value, what="licenses", need_count=True) if value.strip() else {}
    out: dict[str, int] = {}
    for name, n in value.items():
        if not _NAME.match(str(name)):
            raise ValueError(f"licenses: {name!r} is not a licence name")
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_COUNT:
            raise ValueError(f"licenses: the count of {name} must be a whole number >= 0")
        out[str(name)] = n
    return out


def format_licenses(licenses: Mapping[str, int]) -> str:
    """Canonical text (names sorted): what is stored and shown (``fluent:2,matlab:1``)."""
    return ",".join(f"{name}:{n}" for name, n in sorted(licenses.items()))


def refusal(request: Mapping[str, int], totals: Mapping[str, int]) -> str | None:
    """Why a request can never be granted on this cluster (submit-time check), or None."""
    for name, n in sorted(request.items()):
        if name not in totals:
            known = ", ".join(f"{k}:{v}" for k, v in sorted(totals.items())) or "none"
            return f"unknown licence {name!r} (licences of this cluster: {known})"
        if n > totals[name]:
            return f"asks for {name}:{n} but the cluster has only {totals[name]} {name} in all"
    return None


def held(requests: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """Licences in use: the sum of the requests of every attempt that holds its resources."""
    out: dict[str, int] = {}
    for req in requests:
        for name, n in req.items():
            out[name] = out.get(name, 0) + n
    return out


class Pool:
    """Free licences during one scheduling pass: jobs placed earlier in the pass take theirs.

    ``blocked``: ids of jobs that were skipped because their licences were not free (the
    scheduler shows them with the reason ``Licenses``). A licence unknown to ``totals`` (the
    config lost it after the job was submitted) is never free.
    """

    __slots__ = ("blocked", "totals", "used")

    def __init__(self, totals: Mapping[str, int], used: Mapping[str, int] | None = None) -> None:
        self.totals = dict(totals)
        self.used = dict(used or {})
        self.blocked: set[int] = set()

    def free(self, name: str) -> int:
        return self.totals.get(name, 0) - self.used.get(name, 0)

    def fits(self, request: Iterable[tuple[str, int]]) -> bool:
        return all(n <= self.free(name) for name, n in request)

    def take(self, request: Iterable[tuple[str, int]]) -> None:
        for name, n in request:
            self.used[name] = self.used.get(name, 0) + n

    def gate(self, job_id: int, request: Iterable[tuple[str, int]]) -> bool:
        """Whether the job may be tried now; if not, it is recorded in ``blocked``."""
        if self.fits(request):
            return True
        self.blocked.add(job_id)
        return False
