"""Slurm hostlist expressions: ``node[01-04,07],gpu1`` <-> a list of node names.

Users paste these from ``sinfo``/``squeue`` into ``--nodelist``/``--exclude`` and read them back
in listings, so both directions follow Slurm: zero padding is kept per range (``[08-10]`` gives
``node08 node09 node10``), several bracket groups form a product (``a[1-2]b[3-4]``), and the
compressed form sorts by prefix then number.  Expansion is capped so a typo such as
``node[0-99999999]`` is refused instead of eating the controller's memory.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable

MAX_HOSTS = 100_000
_FORMS = "use e.g. node[01-04,07],gpu1"
_LITERAL_RE = re.compile(r"[A-Za-z0-9_.\-]*")
_HOST_RE = re.compile(r"[A-Za-z0-9_.\-]+")
_RANGE_RE = re.compile(r"(\d+)(?:-(\d+))?")
_TRAILING_NUMBER_RE = re.compile(r"(.*?)(\d+)")


def _split_top_level(text: str) -> list[str]:
    """Split on commas and whitespace that are outside brackets."""
    pieces: list[str] = []
    current: list[str] = []
    depth = 0
    for ch in text:
        if ch == "[":
            if depth:
                raise ValueError(f"invalid host list {text!r}: nested '['; {_FORMS}")
            depth = 1
        elif ch == "]":
            if not depth:
                raise ValueError(f"invalid host list {text!r}: ']' without '['; {_FORMS}")
            depth = 0
        elif not depth and (ch == "," or ch.isspace()):
            if current:
                pieces.append("".join(current))
            current = []
            continue
        current.append(ch)
    if depth:
        raise ValueError(f"invalid host list {text!r}: '[' is never closed; {_FORMS}")
    if current:
        pieces.append("".join(current))
    return pieces


def _expand_brackets(text: str, body: str) -> list[str]:
    """``01-03,07`` -> ``["01", "02", "03", "07"]``; each range keeps its start's width."""
    values: list[str] = []
    for item in body.split(","):
        m = _RANGE_RE.fullmatch(item.strip())
        if m is None:
            raise ValueError(f"invalid host list {text!r}: cannot read [{body}]; {_FORMS}")
        lo_text, hi_text = m[1], m[2] if m[2] is not None else m[1]
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise ValueError(
                f"invalid host list {text!r}: range {item!r} ends before it starts; {_FORMS}"
            )
        if len(values) + hi - lo + 1 > MAX_HOSTS:
            raise ValueError(f"invalid host list {text!r}: more than {MAX_HOSTS} hosts")
        width = len(lo_text)
        values.extend(f"{n:0{width}d}" for n in range(lo, hi + 1))
    return values


def _expand_piece(text: str, piece: str) -> list[str]:
    choices: list[list[str]] = []
    pos = 0
    while pos < len(piece):
        start = piece.find("[", pos)
        literal = piece[pos:] if start < 0 else piece[pos:start]
        if not _LITERAL_RE.fullmatch(literal):
            raise ValueError(
                f"invalid host list {text!r}: {literal!r} is not a host name "
                f"(letters, digits, '-', '_', '.'); {_FORMS}"
            )
        if literal:
            choices.append([literal])
        if start < 0:
            break
        end = piece.index("]", start)
        choices.append(_expand_brackets(text, piece[start + 1 : end]))
        pos = end + 1
    total = 1
    for options in choices:
        total *= len(options)
        if total > MAX_HOSTS:
            raise ValueError(f"invalid host list {text!r}: more than {MAX_HOSTS} hosts")
    return ["".join(parts) for parts in itertools.product(*choices)]


def expand_hostlist(text: str) -> list[str]:
    """Expand a hostlist expression into node names, in the order written, without repeats.

    Duplicates are dropped because every caller (``--nodelist``, ``--exclude``) treats the
    result as a set of nodes, and a repeated node would otherwise be counted twice.
    """
    seen: dict[str, None] = {}
    for piece in _split_top_level(text):
        for name in _expand_piece(text, piece):
            seen.setdefault(name, None)
            if len(seen) > MAX_HOSTS:
                raise ValueError(f"invalid host list {text!r}: more than {MAX_HOSTS} hosts")
    return list(seen)


def _split_name(name: str) -> tuple[str, str | None]:
    m = _TRAILING_NUMBER_RE.fullmatch(name)
    return (m[1], m[2]) if m else (name, None)


def hostname_sort_key(name: str) -> tuple[str, int, int, str]:
    """Sort key "prefix, then number": ``node9`` before ``node10`` (plain sorting gets it wrong).

    Names without a trailing number sort before numbered names with the same prefix; equal
    numbers with different padding (``n1``, ``n01``) order shortest first.
    """
    prefix, digits = _split_name(name)
    if digits is None:
        return (prefix, -1, 0, "")
    return (prefix, int(digits), len(digits), digits)


def compress_hostlist(names: Iterable[str]) -> str:
    """Compress node names into Slurm's bracket form, e.g. ``node[01-04,07],gpu1``.

    The inverse of ``expand_hostlist`` up to order and repeats: expanding the result yields the
    unique names sorted by ``hostname_sort_key``.  A range only grows while the next number,
    padded to the range's start width, spells the next name exactly, which is what keeps
    ``node9,node10`` and ``node09,node10`` distinct and round-trippable.
    """
    unique = set()
    for name in names:
        if not _HOST_RE.fullmatch(name):
            raise ValueError(
                f"invalid host name {name!r}: use letters, digits, '-', '_' and '.' only"
            )
        unique.add(name)
    out: list[str] = []
    for prefix, group in itertools.groupby(
        sorted(unique, key=hostname_sort_key), key=lambda n: _split_name(n)[0]
    ):
        items: list[str] = []
        numbered = 0
        # (start text, width, last value, last text) of the run being built
        run: tuple[str, int, int, str] | None = None
        for name in group:
            digits = _split_name(name)[1]
            if digits is None:
                out.append(name)
                continue
            numbered += 1
            value = int(digits)
            if run is not None:
                start, width, last, _ = run
                if value == last + 1 and f"{value:0{width}d}" == digits:
                    run = (start, width, value, digits)
                    continue
                items.append(_run_text(run))
            run = (digits, len(digits), value, digits)
        if run is not None:
            items.append(_run_text(run))
        if not items:
            continue
        if numbered == 1:
            out.append(prefix + items[0])
        else:
            out.append(f"{prefix}[{','.join(items)}]")
    return ",".join(out)


def _run_text(run: tuple[str, int, int, str]) -> str:
    start, _, _, end = run
    return start if start == end else f"{start}-{end}"
