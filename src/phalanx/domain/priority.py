"""Multifactor job priority as Slurm's priority/multifactor plugin computes it, and the order
of the pending queue that follows.

Each factor is a number from 0 to 1; the priority is the weighted sum, less the job's nice::

    priority = round(w_age * age + w_fairshare * fairshare + w_jobsize * jobsize
                     + w_partition * partition + w_qos * qos) - nice

* age: time since the job became eligible (its submit time or --begin), over `max_age`,
  capped at 1;
* fairshare: the user association's Fair Tree factor (domain/fairshare.py);
* jobsize: the larger of the job's share of the cluster's nodes and of its CPUs (with
  `favor_small`, one less that: small jobs first);
* partition: the partition's priority over the highest partition priority;
* qos: the QOS's priority over the highest QOS priority.

The job's own ``--priority`` (any user may set it, Phalanx's habit since before multifactor) is
kept as it was: the first sort key, so a job with a higher --priority still goes before every job
with a lower one, and jobs with the same (default 0) are ordered by the multifactor priority,
then by id. `explain` writes the numbers as arithmetic a user can follow (`phalanx priority`).
"""

from __future__ import annotations

import bisect
import heapq
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, TypeVar

from phalanx.domain import limits as lim

J = TypeVar("J", bound=Mapping[str, Any])

FACTORS = ("age", "fairshare", "jobsize", "partition", "qos")


@dataclass(frozen=True)
class Weights:
    age: int = 1000
    fairshare: int = 10000
    jobsize: int = 1000
    partition: int = 1000
    qos: int = 1000
    max_age_s: float = 7 * 86400.0
    favor_small: bool = False

    def of(self, name: str) -> int:
        return int(getattr(self, name))


@dataclass(frozen=True)
class ClusterSize:
    """What the job size factor is measured against."""

    nodes: int
    cpus: int


@dataclass(frozen=True)
class Breakdown:
    """One job's priority, factor by factor."""

    job_id: int
    factors: dict[str, float]  # name -> 0..1
    weights: dict[str, int]
    nice: int
    total: int  # the multifactor priority
    explicit: int  # the job's own --priority (first sort key)
    notes: dict[str, str] | None = None  # how each factor's value was reached

    def products(self) -> dict[str, float]:
        return {k: self.weights[k] * self.factors[k] for k in FACTORS}

    def explain(self) -> list[str]:
        """The arithmetic, one line per factor, then the sum."""
        lines = []
        notes = self.notes or {}
        for k in FACTORS:
            lines.append(
                f"{k:<10} {self.weights[k]:>6} x {self.factors[k]:.6f} = "
                f"{self.weights[k] * self.factors[k]:12.2f}"
                + (f"   ({notes[k]})" if k in notes else "")
            )
        terms = " + ".join(f"{v:.2f}" for v in self.products().values())
        lines.append(
            f"priority = round({terms}) - nice {self.nice} = {self.total}"
            + (f"; --priority={self.explicit} sorts before it" if self.explicit else "")
        )
        return lines

    def as_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "factors": self.factors,
            "weights": self.weights,
            "products": self.products(),
            "nice": self.nice,
            "priority": self.total,
            "explicit_priority": self.explicit,
            "notes": self.notes or {},
            "explain": self.explain(),
        }


def clamp01(x: float) -> float:
    return 0.0 if x < 0 else 1.0 if x > 1 else x


def breakdown(
    job: Mapping[str, Any],
    now: float,
    weights: Weights,
    *,
    fairshare: float,
    size: ClusterSize,
    partition_priority: Mapping[str, int],
    qos_priority: Mapping[str, int],
) -> Breakdown:
    """The factors of one pending job (a job row: id, submit_time, eligible_time, nodes,
    cpus_per_node, partitions, qos, nice, priority)."""
    since = job.get("eligible_time") or job["submit_time"]
    waited = max(0.0, now - float(since))
    age = clamp01(waited / weights.max_age_s) if weights.max_age_s > 0 else 1.0
    nodes = int(job["nodes"])
    cpus = nodes * int(job["cpus_per_node"])
    frac = max(
        nodes / size.nodes if size.nodes > 0 else 0.0,
        cpus / size.cpus if size.cpus > 0 else 0.0,
    )
    jobsize = clamp01(1.0 - frac) if weights.favor_small else clamp01(frac)
    top_part = max(partition_priority.values(), default=0)
    first = str(job["partitions"]).split(",")[0]
    part = partition_priority.get(first, 0) / top_part if top_part > 0 else 0.0
    top_qos = max(qos_priority.values(), default=0)
    qos_name = str(job.get("qos") or "")
    qos = qos_priority.get(qos_name, 0) / top_qos if top_qos > 0 else 0.0
    small = "1 - " if weights.favor_small else ""
    notes = {
        "age": f"waited {waited:.0f} s of max age {weights.max_age_s:.0f} s, capped at 1",
        "fairshare": f"Fair Tree factor of {job['user']} in "
        f"{job.get('account') or 'the default account'}: rank / users, see `phalanx share`",
        "jobsize": f"{small}max({nodes}/{size.nodes} nodes, {cpus}/{size.cpus} CPUs)",
        "partition": f"partition {first} priority {partition_priority.get(first, 0)} / "
        f"highest {top_part}",
        "qos": f"QOS {qos_name or '-'} priority {qos_priority.get(qos_name, 0)} / highest {top_qos}",
    }
    factors = {
        "age": age,
        "fairshare": clamp01(fairshare),
        "jobsize": jobsize,
        "partition": clamp01(part),
        "qos": clamp01(qos),
    }
    ws = {k: weights.of(k) for k in FACTORS}
    nice = int(job.get("nice") or 0)
    total = round(sum(ws[k] * factors[k] for k in FACTORS)) - nice
    return Breakdown(
        job_id=int(job["id"]),
        factors=factors,
        weights=ws,
        nice=nice,
        total=total,
        explicit=int(job.get("priority") or 0),
        notes=notes,
    )


def order(pending: Sequence[J], score: Callable[[Mapping[str, Any]], Breakdown]) -> list[J]:
    """Pending jobs in scheduling order: --priority, then multifactor priority (both highest
    first), then job id (oldest first)."""
    keyed = []
    for job in pending:
        b = score(job)
        keyed.append(((-b.explicit, -b.total, int(job["id"])), job))
    keyed.sort(key=lambda kv: kv[0])
    return [job for _, job in keyed]


_GROUP_COLUMNS = ("account", "user", "nodes", "cpus_per_node", "partitions", "qos")
_OWN_COLUMNS = ("nice", "priority", "eligible_time", "submit_time", "id")
_GROUP = itemgetter(*_GROUP_COLUMNS)
_OWN = itemgetter(*_OWN_COLUMNS)
# what places a job in the standing queue: its group's columns, nice, --priority, since
_FIELDS = itemgetter(*_GROUP_COLUMNS, *_OWN_COLUMNS[:4])
_ID = itemgetter("id")


class Queue:
    """Pending jobs in queue order, taken one at a time (`QueuePolicy.queue`): either a list
    already in order, or a heap of keys whose low bits (``mask``) index ``rows``."""

    def __init__(
        self, rows: Sequence[dict[str, Any]], heap: list[int] | None = None, mask: int = 0
    ) -> None:
        self._rows = rows
        self._heap = heap
        self._mask = mask
        self._at = 0  # list form: the next row to take

    def take(self) -> dict[str, Any] | None:
        """The next job in queue order; None when none is left."""
        if self._heap is None:
            if self._at >= len(self._rows):
                return None
            self._at += 1
            return self._rows[self._at - 1]
        if not self._heap:
            return None
        return self._rows[heapq.heappop(self._heap) & self._mask]

    def rest(self) -> list[dict[str, Any]]:
        """The jobs not taken yet: in queue order from a list, in no particular order from
        a heap (the pass only marks them as waiting: their order does not matter)."""
        if self._heap is None:
            return list(self._rows[self._at :])
        mask = self._mask
        return [self._rows[k & mask] for k in self._heap]

    def rest_ids(self) -> list[Any]:
        """The ids of `rest` (all the pass needs of the jobs behind its depth)."""
        return [j["id"] for j in self.rest()]


# the ranges the integer sort key of `QueuePolicy.order` holds exactly: -2^62 < total < 2^62,
# 0 <= id < 2^64 (store ids are below 2^63)
_HALF = 1 << 62
_SPAN = 1 << 64


@dataclass
class QueuePolicy:
    """What the scheduling pass needs to order the queue and apply limits: the weights, the
    fair share factors (computed from the cached usage, not per pass), QOS priorities and the
    limits. `scheduling.plan` calls `order`, `holding` and `blocker`; all pure."""

    weights: Weights
    fairshare: Callable[[str, str], float]  # (account, user) -> factor
    qos_priority: Mapping[str, int]
    limits: lim.Limits
    default_account: str

    def account(self, job: Mapping[str, Any]) -> str:
        return str(job.get("account") or self.default_account)

    def scorer(self, snap: Any, now: float) -> Callable[[Mapping[str, Any]], Breakdown]:
        """A function giving one job's breakdown against this snapshot's cluster."""
        nodes = [n for n in snap.nodes if n.get("registered")]
        size = ClusterSize(len(nodes), sum(int(n["cpus"]) for n in nodes))
        parts = {name: int(p.get("priority") or 0) for name, p in snap.partitions.items()}
        cache: dict[tuple[str, str], float] = {}

        def score(job: Mapping[str, Any]) -> Breakdown:
            key = (self.account(job), str(job["user"]))
            if key not in cache:
                cache[key] = self.fairshare(*key)
            return breakdown(
                job,
                now,
                self.weights,
                fairshare=cache[key],
                size=size,
                partition_priority=parts,
                qos_priority=self.qos_priority,
            )

        return score

    def order(self, snap: Any, now: float) -> list[dict[str, Any]]:
        """The pending jobs in queue order: the same totals `breakdown` gives (a unit test
        holds them equal), computed inline because this runs over every pending job each
        pass: a few microseconds a job instead of building each job's explanation."""
        pending = snap.pending
        keys = self._keys(snap, now)
        if keys is None:  # beyond what one integer key encodes (absurd nice or ids)
            return order(pending, self.scorer(snap, now))
        return [pending[i] for i in sorted(range(len(keys)), key=keys.__getitem__)]

    def queue(self, snap: Any, now: float, wanted: int | None = None) -> Queue:
        """The pending jobs in the order of `order`, taken one by one (`Queue.take`).

        A pass examines only the head of the queue (``wanted``: about how many jobs it will
        take, its queue depth); sorting 100,000 keys to take 1,000 is wasted. With ``wanted``
        well below the queue's length the keys go into a heap (linear) and each job taken is
        one pop, so the head comes out in exactly `order`'s order and the rest is never
        sorted; otherwise the keys are sorted once."""
        pending = snap.pending
        if wanted is not None and wanted * 8 < len(pending):
            merged = self._standing(snap, now)
            if merged is not None:
                return merged
        keys = self._keys(snap, now)
        if keys is None:
            return Queue(order(pending, self.scorer(snap, now)))
        n = len(keys)
        if wanted is None or wanted * 8 >= n:
            return Queue([pending[i] for i in sorted(range(n), key=keys.__getitem__)])
        # the row's index in the low bits: keys are distinct (ids are), so it never decides
        # the order, and each popped key names its row
        shift = max(1, n.bit_length())
        heap = [(k << shift) | i for i, k in enumerate(keys)]
        heapq.heapify(heap)
        return Queue(pending, heap, (1 << shift) - 1)

    def _standing(self, snap: Any, now: float) -> Queue | None:
        """The queue as the merge of the standing classes (`_Standing`), brought up to date
        with this snapshot; None where the rows lack a column, repeat an id, or hold a key
        the integer encoding cannot (then `queue` takes the other ways)."""
        pending = snap.pending
        try:
            ids = list(map(_ID, pending))
            fields = dict(zip(ids, map(_FIELDS, pending), strict=True))
        except KeyError:
            return None
        if len(fields) != len(pending) or (ids and not (min(ids) >= 0 and max(ids) < _SPAN)):
            return None
        products = self._products(snap)
        w_age, max_age = self.weights.age, self.weights.max_age_s
        with _STANDING_LOCK:  # the scheduling loop and `explain` (API threads) share it
            _STANDING.update(fields)
            classes = [(c, list(lst)) for c, lst in _STANDING.classes.items()]
        streams = []
        for (g, nice, explicit), lst in classes:  # g: the _GROUP_COLUMNS' values
            statics = products(g)
            # totals never increase along a class: its first and last bound them all
            for since in (lst[0][0], lst[-1][0]):
                t = _total(since, statics, nice, now, w_age, max_age)
                if not -_HALF < t < _HALF:
                    return None
            streams.append(_class_keys(lst, statics, nice, explicit, now, w_age, max_age))
        return _MergedQueue(dict(zip(ids, pending, strict=True)), streams)

    def _keys(self, snap: Any, now: float) -> list[int] | None:
        """Each pending job's sort key (-priority, -total, id) as one integer: sorting ints
        is 3-4 times faster than sorting tuples whose first fields are mostly equal. None
        when a total or an id does not fit the encoding (absurd nice or ids)."""
        products = self._products(snap)
        max_age = self.weights.max_age_s
        w_age = self.weights.age
        keyed: list[int] = []
        append = keyed.append
        pending = snap.pending
        try:
            # the fields read in C (itemgetter) rather than a dict lookup each in Python;
            # rows from the store have every column, hand-made ones may not (KeyError)
            rows = zip(map(_GROUP, pending), map(_OWN, pending), strict=True)
            fields = list(rows)
        except KeyError:
            fields = [
                (
                    tuple(j.get(c) for c in _GROUP_COLUMNS),
                    tuple(j.get(c) for c in _OWN_COLUMNS),
                )
                for j in pending
            ]
        for g, (nice, explicit, eligible, submitted, jid) in fields:
            f, size_w, p_w, q_w = products(g)
            if max_age > 0:
                age = (now - float(eligible or submitted)) / max_age
                age = 0.0 if age < 0 else 1.0 if age > 1 else age
            else:
                age = 1.0
            total = round(w_age * age + f + size_w + p_w + q_w) - int(nice or 0)
            jid = int(jid)
            if not (-_HALF < total < _HALF and 0 <= jid < _SPAN):
                return None
            if explicit:
                append(((-int(explicit)) << 128) + ((_HALF - total) << 64) + jid)
            else:
                append(((_HALF - total) << 64) + jid)
        return keyed

    def _products(
        self, snap: Any
    ) -> Callable[[tuple[Any, ...]], tuple[float, float, float, float]]:
        """weight x factor of fair share, job size, partition and QOS of a job group
        (`_GROUP_COLUMNS`' values), computed once per group and pass: every job of a group
        has the same (only age differs), and the sum is still taken in `breakdown`'s order,
        so the totals stay equal to the bit."""
        w = self.weights
        nodes = [n for n in snap.nodes if n.get("registered")]
        n_nodes = len(nodes)
        n_cpus = sum(int(n["cpus"]) for n in nodes)
        parts = {name: int(p.get("priority") or 0) for name, p in snap.partitions.items()}
        top_part = max(parts.values(), default=0)
        # each product as `breakdown` computes it (weight x factor), so totals are equal
        part_w = {
            k: w.partition * (clamp01(v / top_part) if top_part > 0 else 0.0)
            for k, v in parts.items()
        }
        top_qos = max(self.qos_priority.values(), default=0)
        qos_w = {
            k: w.qos * (clamp01(v / top_qos) if top_qos > 0 else 0.0)
            for k, v in self.qos_priority.items()
        }
        groups: dict[tuple[Any, ...], tuple[float, float, float, float]] = {}

        def products(g: tuple[Any, ...]) -> tuple[float, float, float, float]:
            got = groups.get(g)
            if got is None:
                got = groups[g] = self._static_products(g, n_nodes, n_cpus, part_w, qos_w)
            return got

        return products

    def _static_products(
        self,
        g: tuple[Any, ...],
        n_nodes: int,
        n_cpus: int,
        part_w: Mapping[str, float],
        qos_w: Mapping[str, float],
    ) -> tuple[float, float, float, float]:
        """weight x factor of fair share, job size, partition and QOS for one job group
        (account, user, nodes, cpus per node, partitions, qos), as `breakdown` has them."""
        w = self.weights
        account, user, nodes, cpus_per_node, partitions, qos = g
        account = account or self.default_account
        qos = qos or ""
        f = w.fairshare * clamp01(self.fairshare(str(account), str(user)))
        nn = int(nodes)
        frac = max(
            nn / n_nodes if n_nodes > 0 else 0.0,
            nn * int(cpus_per_node) / n_cpus if n_cpus > 0 else 0.0,
        )
        size = clamp01(1.0 - frac) if w.favor_small else clamp01(frac)
        first = str(partitions).split(",", 1)[0]
        return f, w.jobsize * size, part_w.get(first, 0.0), qos_w.get(qos, 0.0)

    def holding(self, snap: Any) -> lim.Usage:
        """What the jobs that hold resources count against the limits."""
        usage = lim.Usage()
        if self.limits.any():
            for job in getattr(snap, "active_jobs", None) or []:
                usage.add(self._limited(job), self.limits)
        return usage

    def blocker(self, job: Mapping[str, Any], usage: lim.Usage) -> str | None:
        return lim.run_blocker(self._limited(job), usage, self.limits)

    def take(self, job: Mapping[str, Any], usage: lim.Usage) -> None:
        if self.limits.any():
            usage.add(self._limited(job), self.limits)

    def _limited(self, job: Mapping[str, Any]) -> dict[str, Any]:
        return {**job, "account": self.account(job)}


class _Standing:
    """The pending queue kept from one pass to the next (`QueuePolicy.queue`).

    A job's total is ``round(w_age * age + S) - nice`` where S, the products of fair share,
    job size, partition and QOS, is the same for every job of a class (account, user, nodes,
    CPUs per node, partitions, QOS, and the job's nice and --priority), and age grows with
    the time since the job became eligible, the same for every job as the clock moves. So
    within a class, sorted by that time (oldest first), the totals never increase: the
    class's jobs in queue order are its runs of equal totals, one after the other, each run
    by id. The queue is then the merge of the classes (a heap of one head per class), and
    only the jobs the pass takes are ever ordered. Between passes only the jobs that came,
    left or changed move in or out of their class (a dict difference in C over the rows'
    fields); S is recomputed per class each pass (fair share moves as usage is charged), and
    the runs are found at the time of the pass, so nothing cached depends on the clock.
    """

    def __init__(self) -> None:
        self.fields: dict[int, tuple[Any, ...]] = {}  # job id -> its _FIELDS values
        # (group, nice, --priority) -> [(eligible since, id)], sorted
        self.classes: dict[tuple[Any, ...], list[tuple[float, int]]] = {}

    @staticmethod
    def _place(fields: tuple[Any, ...]) -> tuple[tuple[Any, ...], float]:
        *g, nice, explicit, eligible, submitted = fields
        return (tuple(g), nice, explicit), float(eligible or submitted)

    def update(self, now_fields: dict[int, tuple[Any, ...]]) -> None:
        old = self.fields
        was = old.get
        # an unchanged row's values are mostly the very objects of the last read: the tuple
        # comparison is then a few identity checks
        changed = [(jid, f) for jid, f in now_fields.items() if was(jid) != f]
        if len(changed) * 4 > len(now_fields) or not old:
            classes: dict[tuple[Any, ...], list[tuple[float, int]]] = {}
            for jid, f in now_fields.items():
                c, since = self._place(f)
                got = classes.get(c)
                if got is None:
                    classes[c] = [(since, jid)]
                else:
                    got.append((since, jid))
            for lst in classes.values():
                lst.sort()
            self.classes = classes
        else:
            for jid in old.keys() - now_fields.keys():
                self._drop(jid, old[jid])
            for jid, f in changed:
                prev = old.get(jid)
                if prev is not None:
                    self._drop(jid, prev)
                c, since = self._place(f)
                bisect.insort(self.classes.setdefault(c, []), (since, jid))
        self.fields = now_fields

    def _drop(self, jid: int, fields: tuple[Any, ...]) -> None:
        c, since = self._place(fields)
        lst = self.classes[c]
        i = bisect.bisect_left(lst, (since, jid))
        del lst[i]
        if not lst:
            del self.classes[c]


def _class_keys(
    lst: list[tuple[float, int]],
    statics: tuple[float, float, float, float],
    nice: Any,
    explicit: Any,
    now: float,
    w_age: int,
    max_age: float,
) -> Iterator[int]:
    """One class's jobs in queue order, as `QueuePolicy._keys`'s integer keys: runs of equal
    totals (the list is oldest first, so totals never increase along it), each by id."""
    high = (-int(explicit)) << 128 if explicit else 0

    def total(since: float) -> int:
        return _total(since, statics, nice, now, w_age, max_age)

    i, n = 0, len(lst)
    while i < n:
        t = total(lst[i][0])
        # the run's end: totals along the list never increase, so a bisection finds it
        j = bisect.bisect_right(lst, -t, lo=i + 1, key=lambda x: -total(x[0]))
        base = high + ((_HALF - t) << 64)
        if j == i + 1:
            yield base + lst[i][1]
        else:
            for jid in sorted(x[1] for x in lst[i:j]):
                yield base + jid
        i = j


def _total(
    since: float,
    statics: tuple[float, float, float, float],
    nice: Any,
    now: float,
    w_age: int,
    max_age: float,
) -> int:
    """A job's multifactor total, the arithmetic of `QueuePolicy._keys` (and `breakdown`)."""
    f, size_w, p_w, q_w = statics
    if max_age > 0:
        age = (now - since) / max_age
        age = 0.0 if age < 0 else 1.0 if age > 1 else age
    else:
        age = 1.0
    return round(w_age * age + f + size_w + p_w + q_w) - int(nice or 0)


class _MergedQueue(Queue):
    """`Queue` over the standing classes: each take pops the smallest head of the classes'
    streams (`_class_keys`)."""

    def __init__(self, rows: dict[int, dict[str, Any]], streams: list[Iterator[int]]) -> None:
        super().__init__([])
        self._by_id = rows
        self._streams = streams
        heap: list[tuple[int, int]] = []
        for k, s in enumerate(streams):
            first = next(s, None)
            if first is not None:
                heap.append((first, k))
        heapq.heapify(heap)
        self._merge = heap
        self._taken: set[int] = set()

    def take(self) -> dict[str, Any] | None:
        if not self._merge:
            return None
        key, k = self._merge[0]
        following = next(self._streams[k], None)
        if following is None:
            heapq.heappop(self._merge)
        else:
            heapq.heapreplace(self._merge, (following, k))
        jid = key & _LOW
        self._taken.add(jid)
        return self._by_id[jid]

    def rest(self) -> list[dict[str, Any]]:
        by_id = self._by_id
        return [by_id[j] for j in by_id.keys() - self._taken]

    def rest_ids(self) -> list[Any]:
        # the ids straight from the set difference (in C): no row looked up
        return list(self._by_id.keys() - self._taken)


_LOW = (1 << 64) - 1
_STANDING = _Standing()
_STANDING_LOCK = threading.Lock()
