"""Where nodes sit in the network and power tree, and which nodes a job gets because of it (pure).

A node's *place* maps levels to domain names, e.g. ``{switch: sw3, rack: r1, pdu: pa}``. The
cluster's levels are listed leaf first (``topology.levels``, default switch, rack, pdu); each
level is expected to group whole domains of the level below (a tree), though nothing breaks if
it does not. A node with no name at some level is its own domain there: with no topology at
all, spreading over racks means spreading over nodes, and nothing is wrongly packed together.

Choices made here (every tie broken by the candidates' given order, so the result is
deterministic and follows placement's preference: idle nodes first, then name order):

- **compact** (:func:`pick_compact`), the default for multi-node jobs on a cluster with a
  topology: fewest domains at the top level, then within them fewest at the next level, down
  to the leaf switches. When several domains can each hold the whole job, the one where it is
  most compact further down wins, then the smallest (best fit: big domains stay whole for big
  jobs); otherwise the largest domains are filled first (that needs the fewest), and the
  remainder goes to the smallest domain that can hold it.
- **switches** (``--switches=N``): the job's rank nodes are under at most N leaf switches.
  The compact choice is kept when it already is; otherwise the nodes are packed by leaf switch
  alone (the fewest switches there can be); if even that needs more than N, the job does not
  fit now.
- **spread** (``--spread=LEVEL``): rank nodes round-robin over the domains of LEVEL, so as
  many domains as possible are used and no domain has more than one node above another.
- **spares**: hot spares are taken from domains (at the spread or anti-affinity level, else the
  top level) that hold none of the job's rank nodes when there are such nodes, so a failure of
  one domain does not take a rank and its spare together.
- **anti-affinity** (``--group=G --anti-affinity=LEVEL``): :func:`avoided` gives the nodes in
  every LEVEL domain where a running job of group G already is; placement excludes them.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "DEFAULT_LEVELS",
    "Layout",
    "Places",
    "avoided",
    "count_domains",
    "domain",
    "parse_place",
    "pick_compact",
    "pick_spread",
    "select",
]

DEFAULT_LEVELS = ("switch", "rack", "pdu")

# node name -> {level: domain name}
Places = Mapping[str, Mapping[str, str]]


@dataclass(frozen=True)
class Layout:
    """The cluster's levels (leaf first) and the config's rules: (node globs, {level: name}).

    A node's place is, level by level, the first rule whose globs match its name, else what
    its agent reported at register (``phalanx agent --topology``), else nothing: the config is
    the operator's word and wins over a node's own claim.
    """

    levels: tuple[str, ...] = DEFAULT_LEVELS
    rules: tuple[tuple[tuple[str, ...], tuple[tuple[str, str], ...]], ...] = field(default=())

    def place(
        self, node: str, reported: Mapping[str, str] | None = None
    ) -> tuple[tuple[str, str], ...]:
        out: dict[str, str] = {}
        for globs, where in self.rules:
            if any(fnmatch.fnmatchcase(node, g) for g in globs):
                for level, name in where:
                    out.setdefault(level, name)
        for level, name in (reported or {}).items():
            out.setdefault(str(level), str(name))
        return tuple((lv, out[lv]) for lv in self.levels if out.get(lv))


_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def parse_place(text: str) -> dict[str, str]:
    """An agent's ``--topology switch=s1,rack=r1`` as {level: domain}; ValueError if bad."""
    out: dict[str, str] = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        level, eq, name = (p.strip() for p in item.partition("="))
        if not eq or not _NAME.match(level) or not name or len(name) > 128:
            raise ValueError(
                f"{item!r} is not LEVEL=DOMAIN (e.g. switch=s1,rack=r1; levels are letters, "
                "digits, '_', '.', '-')"
            )
        if level in out:
            raise ValueError(f"level {level} is given twice")
        out[level] = name
    return out


def domain(places: Places, node: str, level: str) -> str:
    """The node's domain at ``level``; a node without one is a domain of its own."""
    name = places.get(node, {}).get(level)
    return f"={name}" if name else f"@{node}"


def count_domains(nodes: Iterable[str], places: Places, level: str) -> int:
    return len({domain(places, n, level) for n in nodes})


def _groups(cands: Sequence[str], places: Places, level: str) -> list[list[str]]:
    """Candidates grouped by domain, groups in order of their first candidate."""
    out: dict[str, list[str]] = {}
    for n in cands:
        out.setdefault(domain(places, n, level), []).append(n)
    return list(out.values())


def pick_compact(
    cands: Sequence[str], need: int, places: Places, levels: Sequence[str]
) -> list[str]:
    """``need`` of ``cands`` (at most len(cands)) in the fewest domains, top level first."""
    need = min(need, len(cands))
    if need <= 0:
        return []
    # a level none of the candidates has (no pdu given anywhere) says nothing about
    # compactness; it must not make every node a domain of its own
    levels = [lv for lv in levels if any(places.get(n, {}).get(lv) for n in cands)]
    if not levels:
        return list(cands[:need])
    top, below = levels[-1], levels[:-1]
    groups = _groups(cands, places, top)
    whole = [g for g in groups if len(g) >= need]
    if whole:
        # One domain holds the job: the one where it is most compact further down (fewest
        # domains level by level), then the smallest (best fit); min keeps the first of equals.
        picks = [pick_compact(g, need, places, below) for g in whole]
        return min(
            zip(picks, whole, strict=True),
            key=lambda pg: (
                tuple(count_domains(pg[0], places, lv) for lv in reversed(below)),
                tuple(_held(pg[0], pg[1], places, lv) for lv in below),
                len(pg[1]),
            ),
        )[0]
    out: list[str] = []
    while len(out) < need:
        rem = need - len(out)
        fitting = [g for g in groups if len(g) >= rem]
        # best fit for what is left (min keeps the first of equals), else the largest domain
        g = min(fitting, key=len) if fitting else max(groups, key=len)
        groups.remove(g)
        out += pick_compact(g, min(rem, len(g)), places, below)
    return out


def _held(chosen: Sequence[str], cands: Sequence[str], places: Places, level: str) -> int:
    """Candidates in the ``level`` domains the choice touches: the smaller, the better the
    fit (what is left of those domains is what the job breaks up)."""
    used = {domain(places, n, level) for n in chosen}
    return sum(1 for n in cands if domain(places, n, level) in used)


def pick_spread(cands: Sequence[str], need: int, places: Places, level: str) -> list[str]:
    """``need`` of ``cands`` round-robin over the domains of ``level``."""
    groups = _groups(cands, places, level)
    out: list[str] = []
    i = 0
    while len(out) < min(need, len(cands)):
        for g in groups:
            if i < len(g) and len(out) < need:
                out.append(g[i])
        i += 1
    return out


def avoided(
    nodes: Iterable[str], places: Places, level: str, occupied: Iterable[str]
) -> frozenset[str]:
    """Every one of ``nodes`` in a ``level`` domain that one of ``occupied`` is in."""
    taken = {domain(places, n, level) for n in occupied}
    if not taken:
        return frozenset()
    return frozenset(n for n in nodes if domain(places, n, level) in taken)


def select(
    cands: Sequence[str],
    ranks: int,
    spares: int,
    places: Places,
    levels: Sequence[str],
    *,
    fixed: Sequence[str] = (),
    switches: int | None = None,
    spread: str | None = None,
    spare_level: str | None = None,
) -> tuple[list[str], list[str]] | None:
    """Rank nodes and spare nodes for one job, or None when the topology rules cannot be met.

    ``cands``: eligible nodes in preference order (``fixed`` ones, from --nodelist, excluded);
    ``ranks``: rank nodes still to choose besides ``fixed``; ``levels``: leaf first.
    """
    if ranks + spares > len(cands):
        return None
    if spread is not None:
        chosen = pick_spread(cands, ranks, places, spread)
    else:
        chosen = pick_compact(cands, ranks, places, levels)
    if switches is not None and levels:
        leaf = levels[0]
        if count_domains([*fixed, *chosen], places, leaf) > switches:
            chosen = pick_compact(cands, ranks, places, levels[:1])
            if count_domains([*fixed, *chosen], places, leaf) > switches:
                return None
    taken = set(chosen)
    rest = [n for n in cands if n not in taken]
    level = spare_level or (levels[-1] if levels else None)
    if level is not None and spares:
        own = {domain(places, n, level) for n in (*fixed, *chosen)}
        # stable: nodes outside the job's own domains first, each group in its given order
        rest.sort(key=lambda n: domain(places, n, level) in own)
    return chosen, rest[:spares]
