"""What running work holds on each node during one placement pass, and the nodes it holds.

`State` is the usage of every node (CPUs, memory, GPU devices counted per device, holders,
exclusive holders), changed one `Hold` at a time as work is placed or ends. `Cluster` is the
schedulable nodes of a snapshot by partition, in natural name order (`name_key`). `Index`
groups those nodes into classes of identical node and usage, so that a job is checked once per
class instead of once per node; the state marks the nodes it changes and the index moves just
those. The fitting, backfill and explanation modules all work on this one model, which is why it
is a module of its own. Pure: no I/O, no clock.
"""

from __future__ import annotations

import bisect
import functools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from phalanx.domain.placement_types import Allocation, NodeView

__all__ = [
    "IDLE",
    "ClassKey",
    "Cluster",
    "Hold",
    "Index",
    "State",
    "Usage",
    "holding",
    "merged",
    "name_key",
    "shares",
]


_DIGITS = re.compile(r"(\d+)")


@functools.lru_cache(maxsize=1 << 17)
def name_key(name: str) -> tuple[tuple[str | int, ...], str]:
    """Natural order ("node2" < "node10") so rank layouts read like hostlists; raw name breaks ties.

    ``re.split`` with a capture group alternates text/digits starting with text, so position i
    always holds the same type in every key and tuples compare without type errors.
    """
    parts = _DIGITS.split(name)
    return tuple(int(p) if i % 2 else p for i, p in enumerate(parts)), name


@dataclass(slots=True)
class Usage:
    """Mutable usage of one node. GPU devices are counted, not set, so bad input that already
    double-books a device stays visible (the device stays busy until every holder leaves)."""

    cpus: int = 0
    mem: int = 0
    gpus: dict[int, int] = field(default_factory=dict)
    holders: int = 0
    exclusive: int = 0

    def copy(self) -> Usage:
        return Usage(self.cpus, self.mem, dict(self.gpus), self.holders, self.exclusive)


IDLE = Usage()  # shared read-only "nothing here"; never mutated (see State.add)


@dataclass(frozen=True, slots=True)
class Hold:
    """One node's share of a running or just-placed job, with when it frees up."""

    node: str
    cpus: int
    mem: int
    gpus: tuple[int, ...]
    exclusive: bool
    end: float | None


class State:
    """Usage of every node; nodes never mentioned are idle. ``index``: the node classes of
    this state (see Index), kept up to date through ``dirty`` (nodes changed since)."""

    __slots__ = ("dirty", "index", "usage")

    def __init__(self, usage: dict[str, Usage] | None = None) -> None:
        self.usage: dict[str, Usage] = usage if usage is not None else {}
        self.index: Index | None = None
        self.dirty: set[str] = set()

    def get(self, node: str) -> Usage:
        return self.usage.get(node, IDLE)

    def put(self, node: str, u: Usage) -> None:
        self.usage[node] = u
        if self.index is not None:
            self.dirty.add(node)

    def add(self, hold: Hold) -> None:
        if self.index is not None:
            self.dirty.add(hold.node)
        u = self.usage.get(hold.node)
        if u is None:
            u = self.usage[hold.node] = Usage()
        u.cpus += hold.cpus
        u.mem += hold.mem
        for g in hold.gpus:
            u.gpus[g] = u.gpus.get(g, 0) + 1
        u.holders += 1
        u.exclusive += int(hold.exclusive)

    def remove(self, hold: Hold) -> None:
        if self.index is not None:
            self.dirty.add(hold.node)
        u = self.usage[hold.node]
        u.cpus -= hold.cpus
        u.mem -= hold.mem
        for g in hold.gpus:
            left = u.gpus[g] - 1
            if left:
                u.gpus[g] = left
            else:
                del u.gpus[g]
        u.holders -= 1
        u.exclusive -= int(hold.exclusive)

    def copy(self) -> State:
        return State({k: v.copy() for k, v in self.usage.items()})


def merged(a: Usage, b: Usage) -> Usage:
    """Usage that fits a job iff the job fits on both ``a`` and ``b`` (used for backfill: a long
    job must fit now *and* beside the reserved head at the reservation time)."""
    gpus = dict(a.gpus)
    for g in b.gpus:
        gpus[g] = max(gpus.get(g, 0), b.gpus[g])
    return Usage(
        max(a.cpus, b.cpus),
        max(a.mem, b.mem),
        gpus,
        max(a.holders, b.holders),
        max(a.exclusive, b.exclusive),
    )


def shares(u: Usage, exclusive: bool) -> bool:
    """Whether a node with usage ``u`` can take one more holder: not while an exclusive job
    holds it, and an exclusive job only an idle one."""
    return not (u.exclusive or (exclusive and u.holders))


def holding(allocations: Iterable[Allocation]) -> tuple[State, list[Hold]]:
    """The usage running work puts on the nodes, and each allocation as a hold (whose end
    frees it, for the backfill reservation)."""
    state = State()
    holds: list[Hold] = []
    for a in allocations:
        h = Hold(a.node, a.cpus, a.mem_mb, tuple(a.gpu_ids), a.exclusive, a.expected_end)
        state.add(h)
        holds.append(h)
    return state, holds


class Cluster:
    """Schedulable nodes indexed by partition, in natural name order (built once per call)."""

    def __init__(self, nodes: Sequence[NodeView], levels: Sequence[str] = ()) -> None:
        by_name: dict[str, NodeView] = {}
        for n in nodes:
            by_name[n.name] = n  # a duplicate name: the last view wins, deterministically
        self.by_name = by_name
        self.levels = tuple(levels)  # topology levels, leaf first; () = no topology
        self.places: dict[str, dict[str, str]] = {
            n.name: dict(n.place) for n in by_name.values() if n.place
        }
        ordered = sorted(by_name.values(), key=lambda n: name_key(n.name))
        self.ordered = ordered  # natural name order; a node's ordinal is its place here
        self.ordinal = {n.name: i for i, n in enumerate(ordered)}
        self.by_partition: dict[str, list[NodeView]] = {}
        for n in ordered:
            if not n.schedulable:
                continue
            for p in n.partitions:
                self.by_partition.setdefault(p, []).append(n)


# --------------------------------------------------------------------------------------------
# Node classes: the nodes of each partition grouped by what fitting looks at
# --------------------------------------------------------------------------------------------

_NOGPU: frozenset[int] = frozenset()
ClassKey = tuple[object, ...]


def _class_key(node: NodeView, u: Usage) -> ClassKey:
    """What `fit_node` looks at of a node and its usage, and nothing else (not its name):
    two nodes with the same key fit every job alike, with the same devices."""
    if u is IDLE:
        return (node.cpus, node.mem_mb, node.gpus, node.features, *_IDLE_TAIL)
    return (
        node.cpus,
        node.mem_mb,
        node.gpus,
        node.features,
        u.cpus,
        u.mem,
        frozenset(u.gpus) if u.gpus else _NOGPU,
        u.holders > 0,
        u.exclusive > 0,
    )


_IDLE_TAIL = (0, 0, _NOGPU, False, False)


class Index:
    """The schedulable nodes of each partition grouped in classes (`_class_key` over one
    `State`): each class is the ascending list of its nodes' ordinals (natural name order).
    A 10,000-node cluster has a few hundred classes, and a job is checked once per class.
    The state marks the nodes it changes (``dirty``); `refresh` moves just those."""

    __slots__ = ("cluster", "key", "parts")

    def __init__(self, cluster: Cluster, state: State, like: Index | None = None) -> None:
        self.cluster = cluster
        if like is not None:
            # a copy of another state's index, then the nodes where the states differ moved:
            # a few list copies instead of a class key per node
            self.key: dict[str, ClassKey] = dict(like.key)
            self.parts: dict[str, dict[ClassKey, list[int]]] = {
                p: {k: list(v) for k, v in c.items()} for p, c in like.parts.items()
            }
            state.index = self
            return
        self.key = {}
        self.parts = {}
        for p, members in cluster.by_partition.items():
            classes: dict[ClassKey, list[int]] = {}
            self.parts[p] = classes
            for n in members:  # natural name order: every list is built ascending
                k = self.key.get(n.name)
                if k is None:
                    k = self.key[n.name] = _class_key(n, state.get(n.name))
                classes.setdefault(k, []).append(cluster.ordinal[n.name])
        state.index = self
        state.dirty.clear()

    def refresh(self, state: State) -> None:
        for name in state.dirty:
            old = self.key.get(name)
            if old is None:
                continue  # not schedulable, or in no partition
            node = self.cluster.by_name[name]
            new = _class_key(node, state.get(name))
            if new == old:
                continue
            o = self.cluster.ordinal[name]
            for p in node.partitions:
                classes = self.parts.get(p)
                if classes is None:
                    continue
                members = classes[old]
                del members[bisect.bisect_left(members, o)]
                if not members:
                    del classes[old]
                bisect.insort(classes.setdefault(new, []), o)
            self.key[name] = new
        state.dirty.clear()
