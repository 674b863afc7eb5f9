"""Parsers for the values of sbatch-style options (time, memory, arrays, dependencies, ...).

Users arrive with Slurm batch scripts that must either run unchanged or be refused before
submission, so every parser here accepts exactly the Slurm spelling of a value and raises
``ValueError`` whose message says what is wrong *and* shows an accepted form.  The callers in
``directives`` prefix the message with the script line and option name, which is all a user
needs to fix the script.

Everything in this module is pure (no I/O); the scheduler calls ``constraint_matches`` in its
placement loop, so that one is cached.
"""

from __future__ import annotations

import math
import re
import signal as _signal
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

# --------------------------------------------------------------------------------------------
# Durations
# --------------------------------------------------------------------------------------------

_TIME_FORMS = "use MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"
_UNLIMITED_WORDS = frozenset({"UNLIMITED", "INFINITE"})
# Time limits are stored in 32-bit signed columns on some backends; ~68 years is "unlimited".
_MAX_DURATION_S = 2**31 - 1

_DAYS_RE = re.compile(r"(\d+)-(\d+)(?::(\d+)(?::(\d+))?)?")
_CLOCK_RE = re.compile(r"(\d+)(?::(\d+)(?::(\d+))?)?")


def parse_duration(text: str) -> int | None:
    """Parse a Slurm time limit into seconds; ``UNLIMITED``/``INFINITE`` give ``None``.

    Forms follow sbatch exactly: a lone number is *minutes* (not seconds), two fields are
    MM:SS, three are HH:MM:SS, and a ``D-`` prefix adds days.  As in Slurm, fields after the
    first are not range-checked (``0:90:00`` is 90 minutes), so scripts that Slurm accepts are
    accepted here.  A zero or negative limit is refused rather than treated as "no limit",
    because a zero limit is almost always a typo and would otherwise kill the job at once or
    never.
    """
    raw = text
    text = text.strip()
    if text.upper() in _UNLIMITED_WORDS:
        return None
    if text.startswith("-"):
        raise ValueError(f"invalid time {raw!r}: a time limit must be positive; {_TIME_FORMS}")
    if m := _DAYS_RE.fullmatch(text):
        days, hours = int(m[1]), int(m[2])
        minutes = int(m[3]) if m[3] is not None else 0
        seconds = int(m[4]) if m[4] is not None else 0
    elif m := _CLOCK_RE.fullmatch(text):
        parts = [int(p) for p in m.groups() if p is not None]
        days = 0
        if len(parts) == 1:
            hours, minutes, seconds = 0, parts[0], 0
        elif len(parts) == 2:
            hours, (minutes, seconds) = 0, parts
        else:
            hours, minutes, seconds = parts
    else:
        raise ValueError(f"invalid time {raw!r}: {_TIME_FORMS} (or UNLIMITED)")
    total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    if total <= 0:
        raise ValueError(f"invalid time {raw!r}: a time limit must be positive; {_TIME_FORMS}")
    if total > _MAX_DURATION_S:
        raise ValueError(f"invalid time {raw!r}: longer than 68 years; use UNLIMITED instead")
    return total


def format_duration(seconds: int | float | None) -> str:
    """Render seconds the way squeue does: ``D-HH:MM:SS`` from one day up, else ``HH:MM:SS``.

    ``None`` means no limit and prints ``UNLIMITED``.  Fractions are rounded to the nearest
    second and negative values (a deadline already overshot) print as zero, because a display
    helper must never raise in the middle of a listing.  The output is accepted by
    ``parse_duration`` (round trip) for every positive whole number of seconds.
    """
    if seconds is None:
        return "UNLIMITED"
    total = max(0, round(seconds))
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}-{hours:02d}:{minutes:02d}:{secs:02d}"
    return f"{hours:02d}:{minutes:02d}:{secs:02d}"


# --------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------

_MEMORY_RE = re.compile(r"(\d+)(?:([KMGT])B?)?", re.IGNORECASE)
_MEMORY_FORMS = "use a whole number of megabytes or a K, M, G or T suffix, e.g. 4000, 512M, 4G"
_MB_PER_UNIT = {"M": 1, "G": 1024, "T": 1024 * 1024}
_MAX_MEMORY_MB = 2**40  # one exbibyte: anything bigger is a typo, not a node


def parse_memory_mb(text: str) -> int:
    """Parse a Slurm memory size into megabytes (binary units, like Slurm: 1G = 1024M).

    A bare number is megabytes, as in sbatch.  Kilobytes round *up* so that a small non-zero
    request never becomes 0, which Slurm (and Phalanx) reads as "all of the node's memory".
    """
    raw = text
    m = _MEMORY_RE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"invalid memory size {raw!r}: {_MEMORY_FORMS}")
    number = int(m[1])
    unit = (m[2] or "M").upper()
    mb = math.ceil(number / 1024) if unit == "K" else number * _MB_PER_UNIT[unit]
    if mb > _MAX_MEMORY_MB:
        raise ValueError(f"invalid memory size {raw!r}: unreasonably large; {_MEMORY_FORMS}")
    return mb


# --------------------------------------------------------------------------------------------
# Job arrays
# --------------------------------------------------------------------------------------------

MAX_ARRAY_INDEX = 1_000_000
MAX_ARRAY_TASKS = 100_000
_ARRAY_FORMS = "use e.g. 0-15, 1,3,5-7, 0-15:4 or 1-100%10"
_ARRAY_ITEM_RE = re.compile(r"(\d+)(?:-(\d+)(?::(\d+))?)?")


def parse_array(text: str) -> tuple[list[int], int | None]:
    """Parse an ``--array`` spec into sorted unique task indices and the ``%`` concurrency limit.

    Sizes are checked *before* expansion, so a hostile ``0-999999999`` costs nothing; the caps
    (index ≤ 1,000,000, ≤ 100,000 tasks) keep one submission from flooding the job table.
    """
    raw = text
    text = text.strip()
    limit: int | None = None
    if "%" in text:
        text, _, limit_text = text.rpartition("%")
        if not limit_text.isdecimal() or int(limit_text) < 1:
            raise ValueError(
                f"invalid array {raw!r}: the limit after '%' must be a whole number ≥ 1; "
                f"{_ARRAY_FORMS}"
            )
        limit = int(limit_text)
    if not text:
        raise ValueError(f"invalid array {raw!r}: no indices; {_ARRAY_FORMS}")
    indices: set[int] = set()
    described = 0
    for item in text.split(","):
        m = _ARRAY_ITEM_RE.fullmatch(item)
        if m is None:
            raise ValueError(f"invalid array {raw!r}: cannot read {item!r}; {_ARRAY_FORMS}")
        start = int(m[1])
        end = int(m[2]) if m[2] is not None else start
        step = int(m[3]) if m[3] is not None else 1
        if end < start:
            raise ValueError(
                f"invalid array {raw!r}: range {item!r} ends before it starts; {_ARRAY_FORMS}"
            )
        if step < 1:
            raise ValueError(f"invalid array {raw!r}: step in {item!r} must be ≥ 1")
        if end > MAX_ARRAY_INDEX:
            raise ValueError(
                f"invalid array {raw!r}: index {end} is above the maximum {MAX_ARRAY_INDEX}"
            )
        count = (end - start) // step + 1
        described += count
        if count > MAX_ARRAY_TASKS or described > 10 * MAX_ARRAY_TASKS:
            raise ValueError(
                f"invalid array {raw!r}: more than {MAX_ARRAY_TASKS} tasks; split the array"
            )
        indices.update(range(start, end + 1, step))
        if len(indices) > MAX_ARRAY_TASKS:
            raise ValueError(
                f"invalid array {raw!r}: more than {MAX_ARRAY_TASKS} tasks; split the array"
            )
    return sorted(indices), limit


# --------------------------------------------------------------------------------------------
# Dependencies
# --------------------------------------------------------------------------------------------

DEPENDENCY_TYPES = ("after", "afterany", "afterok", "afternotok")
_DEPENDENCY_FORMS = "use e.g. afterok:123:124, afterany:5,afternotok:7, after:9 or singleton"
_JOB_REF_RE = re.compile(r"\d+(?:_\d+)?")


def parse_dependency(text: str) -> list[dict[str, Any]]:
    """Parse ``--dependency`` into ``[{"type": ..., "jobs": [...]}, ...]`` (all must hold).

    Only the AND form (``,``) is supported: silently treating ``?`` (OR) as AND would hold a
    job forever that Slurm would have started, so it is refused with an explanation.  The
    Slurm types Phalanx does not implement (``aftercorr``, ``afterburstbuffer``, ``+time``
    delays) are refused by name for the same reason.
    """
    raw = text
    text = text.strip()
    if "?" in text:
        raise ValueError(
            f"invalid dependency {raw!r}: only AND (comma) dependencies are supported, "
            f"not OR ('?'); {_DEPENDENCY_FORMS}"
        )
    if not text:
        raise ValueError(f"invalid dependency {raw!r}: empty; {_DEPENDENCY_FORMS}")
    result: list[dict[str, Any]] = []
    for clause in text.split(","):
        kind, _, rest = clause.partition(":")
        kind = kind.strip().lower()
        if kind == "singleton":
            if rest:
                raise ValueError(
                    f"invalid dependency {raw!r}: singleton takes no job ids; {_DEPENDENCY_FORMS}"
                )
            result.append({"type": "singleton", "jobs": []})
            continue
        if kind not in DEPENDENCY_TYPES:
            raise ValueError(
                f"invalid dependency {raw!r}: unsupported type {kind!r} "
                f"(supported: {', '.join(DEPENDENCY_TYPES)}, singleton); {_DEPENDENCY_FORMS}"
            )
        jobs = rest.split(":") if rest else []
        if not jobs:
            raise ValueError(
                f"invalid dependency {raw!r}: {kind} needs at least one job id; {_DEPENDENCY_FORMS}"
            )
        for job in jobs:
            if "+" in job:
                raise ValueError(
                    f"invalid dependency {raw!r}: delayed dependencies ({job!r}) are not "
                    f"supported; {_DEPENDENCY_FORMS}"
                )
            if not _JOB_REF_RE.fullmatch(job):
                raise ValueError(
                    f"invalid dependency {raw!r}: {job!r} is not a job id (use 123 or 123_4 "
                    f"for an array task); {_DEPENDENCY_FORMS}"
                )
        result.append({"type": kind, "jobs": jobs})
    return result


# --------------------------------------------------------------------------------------------
# Signals
# --------------------------------------------------------------------------------------------

DEFAULT_SIGNAL_LEAD_S = 60  # sbatch's default when "@time" is omitted
_MAX_SIGNAL_LEAD_S = 0xFFFF  # Slurm stores the lead time in 16 bits
_SIGNAL_RE = re.compile(r"(?:([BR]+):)?([A-Za-z0-9]+)(?:@(\d+))?", re.IGNORECASE)
_SIGNAL_FORMS = "use [B:]SIG[@SECONDS], e.g. USR1@120, B:USR1@300, SIGUSR2@60 or 10@60"


def parse_signal(text: str) -> dict[str, Any]:
    """Parse ``--signal`` into ``{"signum", "before_s", "batch_only"}``.

    ``B:`` sends the signal to the batch shell only (how checkpointing scripts trap it);
    ``R:`` (reservation overlap) is accepted and has no effect here.  Names go through the
    ``signal`` module so the number matches what the job's processes will actually receive.
    """
    raw = text
    m = _SIGNAL_RE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"invalid signal {raw!r}: {_SIGNAL_FORMS}")
    flags, name, lead = m[1] or "", m[2], m[3]
    if name.isdecimal():
        signum = int(name)
        if signum not in _signal.valid_signals():
            raise ValueError(f"invalid signal {raw!r}: no signal number {signum}; {_SIGNAL_FORMS}")
    else:
        upper = name.upper()
        key = upper if upper.startswith("SIG") else "SIG" + upper
        try:
            signum = int(_signal.Signals[key])
        except KeyError:
            raise ValueError(
                f"invalid signal {raw!r}: unknown signal name {name!r}; {_SIGNAL_FORMS}"
            ) from None
    before_s = int(lead) if lead is not None else DEFAULT_SIGNAL_LEAD_S
    if before_s > _MAX_SIGNAL_LEAD_S:
        raise ValueError(
            f"invalid signal {raw!r}: at most {_MAX_SIGNAL_LEAD_S} seconds before the end"
        )
    return {"signum": signum, "before_s": before_s, "batch_only": "B" in flags.upper()}


def parse_signal_name(text: str) -> int:
    """A bare signal for ``--checkpoint-signal``: ``USR1``, ``SIGUSR2`` or a number."""
    if ":" in text or "@" in text:
        raise ValueError(
            f"invalid signal {text!r}: give only the signal, e.g. USR1, SIGUSR2 or 10 "
            "(the grace is --checkpoint-grace)"
        )
    try:
        return int(parse_signal(text)["signum"])
    except ValueError as e:
        raise ValueError(str(e).replace(_SIGNAL_FORMS, "use e.g. USR1, SIGUSR2 or 10")) from None


_INTERVAL_RE = re.compile(r"(\d+)\s*(s|sec|secs|m|min|mins|h|hr|hrs|d|day|days)", re.IGNORECASE)
_INTERVAL_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_INTERVAL_FORMS = (
    "use a number with a unit (90s, 10m, 2h, 1d) or a Slurm time (MM, MM:SS, HH:MM:SS, D-HH)"
)


def parse_interval(text: str) -> int:
    """Seconds for ``--checkpoint-grace``/``--checkpoint-interval``: ``90s``, ``10m``, ``2h``,
    ``1d``, or any Slurm time form (where, as for ``--time``, a bare number means minutes).

    Units are accepted because these are short durations where a bare "30" is ambiguous;
    the Slurm forms keep one spelling working across every time option.
    """
    raw = text
    m = _INTERVAL_RE.fullmatch(text.strip())
    if m is not None:
        seconds = int(m[1]) * _INTERVAL_UNITS[m[2][0].lower()]
    else:
        try:
            parsed = parse_duration(text)
        except ValueError:
            raise ValueError(f"invalid duration {raw!r}: {_INTERVAL_FORMS}") from None
        if parsed is None:
            raise ValueError(f"invalid duration {raw!r}: must be finite; {_INTERVAL_FORMS}")
        seconds = parsed
    if seconds <= 0:
        raise ValueError(f"invalid duration {raw!r}: must be more than 0; {_INTERVAL_FORMS}")
    if seconds > _MAX_DURATION_S:
        raise ValueError(f"invalid duration {raw!r}: longer than 68 years")
    return seconds


# --------------------------------------------------------------------------------------------
# GPUs
# --------------------------------------------------------------------------------------------

_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]+")
_GRES_FORMS = "use gpu, gpu:COUNT or gpu:TYPE:COUNT, e.g. gpu:4 or gpu:a40:1"
_GPUS_FORMS = "use COUNT or TYPE:COUNT, e.g. 2 or a100:2"


def _gpu_count(raw: str, count: str, forms: str) -> int:
    if not count.isdecimal():
        raise ValueError(f"invalid GPU request {raw!r}: count {count!r} is not a number; {forms}")
    return int(count)


def _gpu_type(raw: str, name: str, forms: str) -> str:
    if not _NAME_RE.fullmatch(name):
        raise ValueError(f"invalid GPU request {raw!r}: bad GPU type {name!r}; {forms}")
    return name


def parse_gres(text: str) -> tuple[int, str | None]:
    """Parse ``--gres`` into (GPUs per node, GPU type or None).

    ``gpu:a40`` (a type without a count) means one GPU, and ``none`` means no GPUs, as in
    Slurm.  Non-GPU gres are refused instead of ignored: a job asking for e.g. ``nvme:1`` relies
    on a resource Phalanx does not track, and would fail in a confusing way at run time.
    """
    raw = text
    if not text.strip():
        raise ValueError(f"invalid gres {raw!r}: empty; {_GRES_FORMS}")
    found: tuple[int, str | None] | None = None
    for entry in text.strip().split(","):
        entry = entry.strip()
        if entry.lower() == "none":
            continue
        parts = entry.split(":")
        if parts[0] != "gpu":
            raise ValueError(
                f"invalid gres {raw!r}: only gpu gres is supported, not {parts[0]!r}; {_GRES_FORMS}"
            )
        if found is not None:
            raise ValueError(f"invalid gres {raw!r}: only one gpu entry is allowed; {_GRES_FORMS}")
        if len(parts) == 1:
            found = (1, None)
        elif len(parts) == 2:
            # Slurm reads "gpu:X" as a count when X is numeric, else as a type with count 1.
            if parts[1].isdecimal():
                found = (int(parts[1]), None)
            else:
                found = (1, _gpu_type(raw, parts[1], _GRES_FORMS))
        elif len(parts) == 3:
            found = (
                _gpu_count(raw, parts[2], _GRES_FORMS),
                _gpu_type(raw, parts[1], _GRES_FORMS),
            )
        else:
            raise ValueError(f"invalid gres {raw!r}: too many ':' fields; {_GRES_FORMS}")
    return found if found is not None else (0, None)


def parse_gpus(text: str) -> tuple[int, str | None]:
    """Parse a ``--gpus``/``--gpus-per-node``/``--gpus-per-task`` value: ``[gpu:][TYPE:]COUNT``.

    The optional ``gpu:`` prefix is tolerated because people copy it over from ``--gres``.
    Several types at once (``a100:1,v100:1``) are refused: a job gets one kind of GPU.
    """
    raw = text
    text = text.strip()
    if "," in text:
        raise ValueError(
            f"invalid GPU request {raw!r}: only one GPU type is allowed; {_GPUS_FORMS}"
        )
    parts = text.split(":")
    if len(parts) >= 2 and parts[0] == "gpu":
        parts = parts[1:]
    if len(parts) == 1:
        return _gpu_count(raw, parts[0], _GPUS_FORMS), None
    if len(parts) == 2:
        return _gpu_count(raw, parts[1], _GPUS_FORMS), _gpu_type(raw, parts[0], _GPUS_FORMS)
    raise ValueError(f"invalid GPU request {raw!r}: too many ':' fields; {_GPUS_FORMS}")


# --------------------------------------------------------------------------------------------
# Environment export
# --------------------------------------------------------------------------------------------

_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_EXPORT_FORMS = "use ALL, NONE, ALL,VAR=value,OTHER or VAR1,VAR2"


def parse_export(text: str) -> tuple[str, dict[str, str | None]]:
    """Parse ``--export`` into a mode (``"ALL"`` or ``"NONE"``) and explicit variables.

    A variable mapped to ``None`` is copied from the submitting environment.  As in Slurm, a
    list that does not contain ``ALL`` means ``NONE`` plus the listed variables, and ``NIL``
    is treated as ``NONE``.  Values cannot contain commas (the separator), which matches
    sbatch's own limitation.
    """
    raw = text
    text = text.strip()
    if not text:
        raise ValueError(f"invalid export {raw!r}: empty; {_EXPORT_FORMS}")
    saw_all = saw_none = False
    variables: dict[str, str | None] = {}
    for item in text.split(","):
        keyword = item.strip().upper()
        if keyword == "ALL":
            saw_all = True
            continue
        if keyword in ("NONE", "NIL"):
            saw_none = True
            continue
        name, eq, value = item.partition("=")
        if not _ENV_NAME_RE.fullmatch(name):
            raise ValueError(
                f"invalid export {raw!r}: {item!r} is not a variable name or NAME=value; "
                f"{_EXPORT_FORMS}"
            )
        variables[name] = value if eq else None
    if saw_all and saw_none:
        raise ValueError(f"invalid export {raw!r}: ALL and NONE contradict; {_EXPORT_FORMS}")
    return ("ALL" if saw_all else "NONE"), variables


# --------------------------------------------------------------------------------------------
# Node feature constraints
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Feature:
    """A single node feature, e.g. ``a100-80G``."""

    name: str

    def matches(self, features: frozenset[str]) -> bool:
        return self.name in features


@dataclass(frozen=True)
class AllOf:
    """``a&b&...``: every term must match."""

    terms: tuple[Constraint, ...]

    def matches(self, features: frozenset[str]) -> bool:
        return all(term.matches(features) for term in self.terms)


@dataclass(frozen=True)
class AnyOf:
    """``a|b|...``: at least one term must match."""

    terms: tuple[Constraint, ...]

    def matches(self, features: frozenset[str]) -> bool:
        return any(term.matches(features) for term in self.terms)


Constraint = Feature | AllOf | AnyOf

_CONSTRAINT_FORMS = "use features joined by & and |, with parentheses, e.g. (a100|h100)&ib"
_CONSTRAINT_TOKEN_RE = re.compile(r"\s*(?:([A-Za-z0-9_.\-]+)|([&|()]))")


class _ConstraintParser:
    """Recursive descent; ``&`` binds tighter than ``|`` (the usual boolean precedence)."""

    def __init__(self, text: str) -> None:
        self.raw = text
        self.tokens: list[str] = []
        pos = 0
        stripped = text.rstrip()
        while pos < len(stripped):
            m = _CONSTRAINT_TOKEN_RE.match(stripped, pos)
            if m is None:
                bad = stripped[pos:].lstrip()[:1]
                raise self.error(f"unexpected character {bad!r}")
            self.tokens.append(m[1] or m[2])
            pos = m.end()
        self.pos = 0

    def error(self, what: str) -> ValueError:
        return ValueError(f"invalid constraint {self.raw!r}: {what}; {_CONSTRAINT_FORMS}")

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def parse(self) -> Constraint:
        if not self.tokens:
            raise self.error("empty")
        expr = self.parse_or()
        if self.peek() is not None:
            raise self.error(f"unexpected {self.peek()!r}")
        return expr

    def parse_or(self) -> Constraint:
        terms = [self.parse_and()]
        while self.peek() == "|":
            self.pos += 1
            terms.append(self.parse_and())
        return terms[0] if len(terms) == 1 else AnyOf(tuple(terms))

    def parse_and(self) -> Constraint:
        terms = [self.parse_atom()]
        while self.peek() == "&":
            self.pos += 1
            terms.append(self.parse_atom())
        return terms[0] if len(terms) == 1 else AllOf(tuple(terms))

    def parse_atom(self) -> Constraint:
        token = self.peek()
        if token is None:
            raise self.error("ends where a feature was expected")
        self.pos += 1
        if token == "(":
            inner = self.parse_or()
            if self.peek() != ")":
                raise self.error("missing ')'")
            self.pos += 1
            return inner
        if token in "&|)":
            raise self.error(f"unexpected {token!r} where a feature was expected")
        return Feature(token)


@lru_cache(maxsize=1024)
def parse_constraint(text: str) -> Constraint:
    """Parse a node-feature expression (``&``, ``|``, parentheses) into a small tree.

    Slurm's count (``*2``) and bracket (``[a|b]``) forms are refused: they change how nodes are
    *grouped*, and ignoring that would place a job on a mix of nodes Slurm would not pick.
    """
    return _ConstraintParser(text).parse()


def constraint_matches(expr: str, features: frozenset[str]) -> bool:
    """Whether a node with ``features`` satisfies ``expr`` (parsed once, then cached)."""
    return parse_constraint(expr).matches(features)


def constraint_features(expr: str) -> frozenset[str]:
    """Every feature name mentioned in ``expr`` (to tell "no node has feature X" apart)."""
    names: set[str] = set()
    stack: list[Constraint] = [parse_constraint(expr)]
    while stack:
        node = stack.pop()
        if isinstance(node, Feature):
            names.add(node.name)
        else:
            stack.extend(node.terms)
    return frozenset(names)
