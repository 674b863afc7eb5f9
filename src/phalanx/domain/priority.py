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

import heapq
from collections.abc import Callable, Mapping, Sequence
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

    def _keys(self, snap: Any, now: float) -> list[int] | None:
        """Each pending job's sort key (-priority, -total, id) as one integer: sorting ints
        is 3-4 times faster than sorting tuples whose first fields are mostly equal. None
        when a total or an id does not fit the encoding (absurd nice or ids)."""
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
        max_age = w.max_age_s
        w_age = w.age
        # The products that do not depend on the job's age are the same for every job of one
        # (account, user, nodes, cpus, partitions, qos): computed once per such group. The
        # sum is still taken in `breakdown`'s order, so the totals stay equal to the bit.
        groups: dict[tuple[Any, ...], tuple[float, float, float, float]] = {}
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
            parts4 = groups.get(g)
            if parts4 is None:
                parts4 = groups[g] = self._static_products(g, n_nodes, n_cpus, part_w, qos_w)
            f, size_w, p_w, q_w = parts4
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
