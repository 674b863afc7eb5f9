"""The history checker of the chaos test: pure functions over what a fault run recorded.

A chaos run (tests/system/test_chaos.py) records four things while it injects faults:

- the submissions its client made (acknowledged with a job id, refused, or left unanswered: a
  request that timed out may or may not have been applied),
- what each job itself wrote when it ran (one `start`, a `tick` now and then, one `end` line per
  execution, appended with O_APPEND to a file per job),
- the store's view afterwards: jobs, their attempts and every event (state changes carry
  `{"from", "to"}`, duty writes carry the lease term they were made under),
- samples of the lease table taken while the faults happened,
- the windows in which a fault made a node unable to answer (its agent killed, frozen or cut
  off until the node was DOWN), and what was still held once every job had ended.

`check` turns these into a list of `Violation`s; an empty list means the run kept every promise
of DESIGN.md §8: no acknowledged job lost, no job run twice at once, an execution counted twice
only if the store recorded two attempts, exactly one terminal state per job, lease terms that
only grow with one holder per term, and no write under a stale term; and the node-level ones:
no job alive on a node while it is DOWN, no node declared DOWN while it could answer (a false
DOWN, across controller failovers too), work run to its end a second time only after its node
was declared DOWN, and nothing (CPUs, GPUs, licences, restart reservations) held once every
job has ended. Nothing here does I/O or reads a clock, so tests/unit/test_history.py feeds it
bad histories and shows each one caught.
"""

from __future__ import annotations

import itertools
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from phalanx.domain.states import TERMINAL

TERMINAL_STATES = frozenset(s.value for s in TERMINAL)
# A job's tick is stamped just before its write, a node.down event just before its commit,
# both on this host's clock: how far apart two such stamps of one instant may read.
CLOCK_SLACK = 0.1
TAKE_RE = re.compile(r"^(\S+) took lease (\S+) term (\d+)$")
STARTING_RE = re.compile(r"\bin (\S+) \(attempt (\d+)\)")
CLUSTER_LEASE = "cluster"


# ---------------------------------------------------------------------- recorded facts
@dataclass(frozen=True)
class Submission:
    """One submission the client tried; `name` is unique per submission (how the store's job is
    matched back). outcome: "acked" (job_id set), "refused" (a definite error: not applied), or
    "unknown" (no answer: applied at most once)."""

    name: str
    outcome: str
    job_id: int | None = None


@dataclass(frozen=True)
class Run:
    """One execution of a job as the job recorded it: started at `start`, last seen alive at
    `last` (its last tick, or its end), `finished` if it wrote its end line."""

    job_id: int
    attempt_id: int
    node: str
    start: float
    last: float
    finished: bool


@dataclass(frozen=True)
class Attempt:
    id: int
    seq: int
    partition: str
    fence_term: int
    created_at: float


@dataclass(frozen=True)
class Job:
    id: int
    name: str
    state: str
    exit_code: int | None
    attempts: tuple[Attempt, ...] = ()


@dataclass(frozen=True)
class Event:
    id: int
    ts: float
    kind: str
    message: str = ""
    job_id: int | None = None
    controller: str | None = None
    term: int | None = None
    from_state: str | None = None
    to_state: str | None = None
    node: str | None = None


@dataclass(frozen=True)
class Fault:
    """A fault that left `node` unable to answer from `start` until `end` (its agent killed or
    frozen, or its network cut, until the node was DOWN): the only time it may go DOWN."""

    node: str
    kind: str
    start: float
    end: float


@dataclass(frozen=True)
class Holding:
    """Something still held once every job had ended (and the bound for releasing it had
    passed): `amount` of `what` (e.g. "cpus", "gpus", "licence fluent", "restart
    reservation") on or by `subject`."""

    what: str
    subject: str
    amount: float


@dataclass(frozen=True)
class LeaseSample:
    """The lease table as one read saw it: name -> (holder, term)."""

    t: float
    leases: Mapping[str, tuple[str | None, int]]


@dataclass(frozen=True)
class History:
    submissions: Sequence[Submission] = ()
    jobs: Sequence[Job] = ()
    runs: Sequence[Run] = ()
    events: Sequence[Event] = ()
    samples: Sequence[LeaseSample] = ()
    faults: Sequence[Fault] = ()
    held: Sequence[Holding] = ()


@dataclass(frozen=True)
class Violation:
    kind: str
    subject: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind} [{self.subject}]: {self.detail}"


@dataclass(frozen=True)
class Take:
    """A `lease.take` event: `holder` took `lease` under `term` (event `id`, written at `ts`,
    after the take committed)."""

    id: int
    ts: float
    holder: str
    lease: str
    term: int


@dataclass(frozen=True)
class TermWrite:
    """A write a duty made under `term` of `lease`, stamped `ts` by the writer no later than
    its commit; `controller` is the writer when known."""

    lease: str
    term: int
    ts: float
    what: str
    controller: str | None = None


@dataclass
class Summary:
    """Counts for the test's report line."""

    jobs: int = 0
    runs: int = 0
    requeued_jobs: int = 0
    stopped_runs: int = 0  # executions that never wrote their end line (fenced or killed)
    finished_twice: int = 0  # jobs whose work ran to its end more than once (reports lost)
    downs: int = 0  # node.down events
    takes: int = 0
    term_writes: int = 0
    samples: int = 0
    by_state: dict[str, int] = field(default_factory=dict)


# ---------------------------------------------------------------------- parsing job records
def parse_runs(job_id: int, text: str) -> list[Run]:
    """The executions in one job's record file.

    Lines: `start ATTEMPT NODE EPOCH`, `tick ATTEMPT EPOCH`, `end ATTEMPT EPOCH`. Each `start`
    begins a new execution (two starts of one attempt are two executions); ticks and the end
    belong to the latest execution of their attempt. A partial last line (the job was killed
    mid-write) is ignored.
    """
    runs: list[Run] = []
    latest: dict[int, int] = {}  # attempt id -> index in runs of its latest execution
    for line in text.splitlines():
        parts = line.split()
        try:
            if len(parts) == 4 and parts[0] == "start":
                attempt, t = int(parts[1]), float(parts[3])
                latest[attempt] = len(runs)
                runs.append(Run(job_id, attempt, parts[2], t, t, False))
            elif len(parts) == 3 and parts[0] in ("tick", "end"):
                i = latest.get(int(parts[1]))
                if i is None:
                    continue  # its start line was cut short
                r = runs[i]
                runs[i] = replace(
                    r, last=max(r.last, float(parts[2])), finished=r.finished or parts[0] == "end"
                )
        except ValueError:
            continue
    return runs


# ---------------------------------------------------------------------- checks
def check_submissions(subs: Sequence[Submission], jobs: Sequence[Job]) -> list[Violation]:
    """No acknowledged job lost; no submission applied twice; nothing the client did not send
    (or was told was refused) in the store."""
    out: list[Violation] = []
    by_id = {j.id: j for j in jobs}
    by_name: dict[str, list[Job]] = defaultdict(list)
    for j in jobs:
        by_name[j.name].append(j)
    acked_ids: dict[int, str] = {}
    names = {s.name: s for s in subs}
    for s in subs:
        if s.outcome == "acked":
            if s.job_id is None:
                out.append(Violation("lost", s.name, "acknowledged without a job id"))
                continue
            if s.job_id in acked_ids:
                out.append(
                    Violation(
                        "duplicate-ack",
                        f"job {s.job_id}",
                        f"acknowledged for {acked_ids[s.job_id]} and {s.name}",
                    )
                )
            acked_ids[s.job_id] = s.name
            job = by_id.get(s.job_id)
            if job is None:
                out.append(
                    Violation("lost", f"job {s.job_id}", f"{s.name} acknowledged, not stored")
                )
            elif job.name != s.name:
                out.append(
                    Violation(
                        "lost",
                        f"job {s.job_id}",
                        f"acknowledged for {s.name} but the store holds {job.name} under that id",
                    )
                )
        elif s.outcome == "refused" and by_name.get(s.name):
            ids = [j.id for j in by_name[s.name]]
            out.append(Violation("phantom", s.name, f"refused, yet stored as job(s) {ids}"))
    for name, js in by_name.items():
        if len(js) > 1:
            out.append(
                Violation("duplicate-submit", name, f"stored {len(js)} times: {[j.id for j in js]}")
            )
        if name not in names:
            out.append(
                Violation("unknown-job", name, f"stored as {[j.id for j in js]}, never sent")
            )
    return out


def check_runs(jobs: Sequence[Job], runs: Sequence[Run]) -> list[Violation]:
    """No two executions of a job overlap; every execution belongs to an attempt the store
    recorded for that job, and no attempt ran twice; a COMPLETED job's last attempt ran to
    its end."""
    out: list[Violation] = []
    by_job: dict[int, list[Run]] = defaultdict(list)
    for r in runs:
        by_job[r.job_id].append(r)
    known = {j.id: j for j in jobs}
    for jid in sorted(set(by_job) - set(known)):
        out.append(Violation("unrecorded-run", f"job {jid}", "ran, but the store has no such job"))
    for job in jobs:
        rs = sorted(by_job.get(job.id, []), key=lambda r: r.start)
        subject = f"job {job.id}"
        attempt_ids = {a.id for a in job.attempts}
        seen: dict[int, Run] = {}
        for r in rs:
            if r.attempt_id not in attempt_ids:
                out.append(
                    Violation(
                        "unrecorded-run",
                        subject,
                        f"attempt {r.attempt_id} ran on {r.node} at {r.start:.3f} but the store "
                        f"records attempts {sorted(attempt_ids)}",
                    )
                )
            if r.attempt_id in seen:
                out.append(
                    Violation(
                        "double-run",
                        subject,
                        f"attempt {r.attempt_id} ran twice: on {seen[r.attempt_id].node} at "
                        f"{seen[r.attempt_id].start:.3f} and on {r.node} at {r.start:.3f}",
                    )
                )
            seen.setdefault(r.attempt_id, r)
        for i, a in enumerate(rs):
            for b in rs[i + 1 :]:
                if b.start < a.last:
                    out.append(
                        Violation(
                            "overlap",
                            subject,
                            f"attempt {b.attempt_id} started on {b.node} at {b.start:.3f} while "
                            f"attempt {a.attempt_id} on {a.node} was alive until {a.last:.3f}",
                        )
                    )
        if job.state == "COMPLETED":
            if not job.attempts:
                out.append(Violation("missing-run", subject, "COMPLETED without any attempt"))
                continue
            final = max(job.attempts, key=lambda a: (a.seq, a.id))
            if not any(r.attempt_id == final.id and r.finished for r in rs):
                out.append(
                    Violation(
                        "missing-run",
                        subject,
                        f"COMPLETED, but its last attempt {final.id} never ran to its end "
                        f"(runs: {[(r.attempt_id, r.node, r.finished) for r in rs]})",
                    )
                )
    return out


RETRY_RE = re.compile(r"\bretry (\d+) of (\d+)\b")
SPENT_RE = re.compile(r"not retried: all (\d+) retries used")


def retries_spent(chain: Sequence[Event]) -> bool:
    """A job that ended NODE_FAIL because node failures used up its retry budget: its last
    event says so, and its chain holds exactly one retry event for each retry it counted (1 of
    N, 2 of N, ... N of N). Chaos kills nodes far more often than a real cluster, so a long job
    can meet its budget; an end that skips a retry or counts one twice is still a violation."""
    if not chain or chain[-1].to_state != "NODE_FAIL":
        return False
    spent = SPENT_RE.search(chain[-1].message)
    if spent is None:
        return False
    n = int(spent[1])
    counted = [m for e in chain[:-1] if (m := RETRY_RE.search(e.message))]
    return [int(m[1]) for m in counted] == list(range(1, n + 1)) and all(
        int(m[2]) == n for m in counted
    )


def check_terminal(
    jobs: Sequence[Job], events: Sequence[Event], expect: str | None = "COMPLETED"
) -> list[Violation]:
    """Every job's state events form one chain from PENDING that ends in exactly one terminal
    state, the job's current state; with `expect`, that state is the expected one."""
    out: list[Violation] = []
    by_job: dict[int, list[Event]] = defaultdict(list)
    for e in events:
        if e.job_id is not None and e.to_state is not None:
            by_job[e.job_id].append(e)
    for job in jobs:
        subject = f"job {job.id}"
        chain = sorted(by_job.get(job.id, []), key=lambda e: e.id)
        state = "PENDING"
        for e in chain:
            if e.from_state != state:
                out.append(
                    Violation(
                        "state-chain",
                        subject,
                        f"event {e.id} ({e.kind}) moved it {e.from_state} -> {e.to_state}, but "
                        f"it was {state}",
                    )
                )
            state = e.to_state or state
        ends = [e for e in chain if e.to_state in TERMINAL_STATES]
        if len(ends) != 1:
            out.append(
                Violation(
                    "terminal-count",
                    subject,
                    f"{len(ends)} terminal state events: {[(e.id, e.to_state) for e in ends]}",
                )
            )
        if ends and chain[-1] is not ends[-1]:
            later = [(e.id, e.to_state) for e in chain if e.id > ends[-1].id]
            out.append(
                Violation(
                    "after-terminal", subject, f"state changes after {ends[-1].to_state}: {later}"
                )
            )
        if job.state not in TERMINAL_STATES:
            out.append(Violation("not-terminal", subject, f"still {job.state}"))
        elif chain and chain[-1].to_state != job.state:
            out.append(
                Violation(
                    "state-mismatch",
                    subject,
                    f"the store says {job.state}, its last event says {chain[-1].to_state}",
                )
            )
        if (
            expect is not None
            and job.state in TERMINAL_STATES
            and job.state != expect
            and not retries_spent(chain)
        ):
            out.append(
                Violation("unexpected-end", subject, f"ended {job.state} (exit {job.exit_code})")
            )
        if job.state == "COMPLETED" and job.exit_code not in (0, None):
            out.append(Violation("unexpected-end", subject, f"COMPLETED with exit {job.exit_code}"))
    return out


def lease_takes(events: Iterable[Event]) -> list[Take]:
    """Every `lease.take` event, in event order."""
    out = []
    for e in sorted(events, key=lambda e: e.id):
        if e.kind != "lease.take":
            continue
        m = TAKE_RE.match(e.message)
        if m is None or e.term is None or int(m[3]) != e.term:
            continue  # check_terms reports it
        out.append(Take(e.id, e.ts, m[1], m[2], int(m[3])))
    return out


def term_writes(
    events: Sequence[Event], jobs: Sequence[Job]
) -> tuple[list[TermWrite], list[Event]]:
    """The duty writes that carry a term: attempts (created under a `sched:<partition>` term,
    or `sched` for a store without per-partition leases), `job.starting` events (the same),
    `node.down` (the `cluster` lease) and job state changes a scheduler made under its term.
    Returns them, and the termed events it could not attribute to a lease (for check_terms).
    """
    takes = lease_takes(events)
    names = {t.lease for t in takes}

    def sched(partition: str | None) -> str:
        lease = f"sched:{partition}"
        return lease if lease in names or "sched" not in names else "sched"

    by_id = {j.id: j for j in jobs}
    out: list[TermWrite] = []
    unknown: list[Event] = []
    for j in jobs:
        for a in j.attempts:
            out.append(
                TermWrite(
                    sched(a.partition), a.fence_term, a.created_at, f"attempt {a.id} of job {j.id}"
                )
            )
    for e in events:
        if e.term is None or e.kind == "lease.take":
            continue
        lease: str | None = None
        if e.kind == "job.starting":
            m = STARTING_RE.search(e.message)
            lease = sched(m[1]) if m else None
        elif e.kind in ("node.down", "job.spare_lost"):  # both written by the failure detector
            lease = CLUSTER_LEASE
        elif e.job_id is not None and e.job_id in by_id and by_id[e.job_id].attempts:
            lease = sched(by_id[e.job_id].attempts[-1].partition)
        if lease is None:
            unknown.append(e)
        else:
            out.append(TermWrite(lease, e.term, e.ts, f"event {e.id} ({e.kind})", e.controller))
    return out, unknown


def check_terms(
    events: Sequence[Event], jobs: Sequence[Job], samples: Sequence[LeaseSample]
) -> list[Violation]:
    """Lease terms only grow and name one holder each; nothing is written under a stale term.

    - one holder per (lease, term), in `lease.take` events and in the sampled lease table;
    - each controller's takes of a lease, and the sampled term of each lease, never go down;
    - a write under term T of a lease is stamped before any take of a higher term was written
      (the take's event follows its commit, the write's stamp precedes its commit, and the
      store's fence check serialises the two), and, when its writer is known, was made by the
      controller that took term T.
    """
    out: list[Violation] = []
    for e in events:
        if e.kind == "lease.take":
            m = TAKE_RE.match(e.message)
            if m is None or e.term is None or int(m[3]) != e.term:
                out.append(
                    Violation(
                        "bad-take", f"event {e.id}", f"unreadable: {e.message!r} term {e.term}"
                    )
                )
    takes = lease_takes(events)
    holders: dict[tuple[str, int], set[str]] = defaultdict(set)
    for t in takes:
        holders[(t.lease, t.term)].add(t.holder)
    for (lease, term), who in sorted(holders.items()):
        if len(who) > 1:
            out.append(Violation("term-holder", f"{lease} term {term}", f"taken by {sorted(who)}"))
    last: dict[tuple[str, str], Take] = {}
    for t in takes:
        prev = last.get((t.holder, t.lease))
        if prev is not None and t.term < prev.term:
            out.append(
                Violation(
                    "term-regress",
                    f"{t.lease} by {t.holder}",
                    f"took term {t.term} (event {t.id}) after term {prev.term} (event {prev.id})",
                )
            )
        last[(t.holder, t.lease)] = t
    seen: dict[str, tuple[float, str | None, int]] = {}
    for s in sorted(samples, key=lambda s: s.t):
        for lease, (holder, term) in sorted(s.leases.items()):
            prev_s = seen.get(lease)
            if prev_s is not None:
                if term < prev_s[2]:
                    out.append(
                        Violation(
                            "term-regress",
                            lease,
                            f"term {term} at {s.t:.3f} after term {prev_s[2]} at {prev_s[0]:.3f}",
                        )
                    )
                elif term == prev_s[2] and holder != prev_s[1] and holder and prev_s[1]:
                    out.append(
                        Violation(
                            "term-holder",
                            f"{lease} term {term}",
                            f"held by {prev_s[1]} at {prev_s[0]:.3f} and {holder} at {s.t:.3f}",
                        )
                    )
            taken = holders.get((lease, term))
            if holder and taken and holder not in taken:
                out.append(
                    Violation(
                        "term-holder",
                        f"{lease} term {term}",
                        f"the table shows {holder} at {s.t:.3f}, lease.take says {sorted(taken)}",
                    )
                )
            seen[lease] = (s.t, holder, term)
    first_above: dict[str, list[Take]] = defaultdict(list)
    for t in takes:
        first_above[t.lease].append(t)
    writes, unknown = term_writes(events, jobs)
    for e in unknown:
        out.append(
            Violation(
                "unattributed", f"event {e.id}", f"{e.kind} under term {e.term}: which lease?"
            )
        )
    for w in writes:
        later = [t for t in first_above.get(w.lease, []) if t.term > w.term]
        if later:
            nxt = min(later, key=lambda t: t.ts)
            if w.ts >= nxt.ts:
                out.append(
                    Violation(
                        "stale-write",
                        w.what,
                        f"made under {w.lease} term {w.term} at {w.ts:.3f}, after {nxt.holder} "
                        f"took term {nxt.term} (event {nxt.id} at {nxt.ts:.3f})",
                    )
                )
        taken = holders.get((w.lease, w.term))
        if w.controller and taken and w.controller not in taken:
            out.append(
                Violation(
                    "foreign-write",
                    w.what,
                    f"made by {w.controller} under {w.lease} term {w.term}, "
                    f"taken by {sorted(taken)}",
                )
            )
    return out


def down_periods(events: Sequence[Event]) -> dict[str, list[tuple[float, float]]]:
    """Each node's DOWN periods, (from its node.down event, to its next node.up event or
    for ever), in time order."""
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    down_since: dict[str, float] = {}
    for e in sorted(events, key=lambda e: e.id):
        if e.node is None:
            continue
        if e.kind == "node.down" and e.node not in down_since:
            down_since[e.node] = e.ts
        elif e.kind == "node.up" and e.node in down_since:
            out[e.node].append((down_since.pop(e.node), e.ts))
    for node, since in down_since.items():
        out[node].append((since, float("inf")))
    return out


def check_nodes(
    runs: Sequence[Run], events: Sequence[Event], faults: Sequence[Fault]
) -> list[Violation]:
    """The node-level promises:

    - no job alive on a DOWN node: its self-fencing ends it before the detector may declare
      the node DOWN (fence_timeout + kill grace + margin < node_down_timeout), so no tick of
      a job on a node is stamped inside one of that node's DOWN periods;
    - no false DOWN: a node is declared DOWN only inside a window in which a fault kept it
      from answering (a controller killed, paused or failing over is no such fault);
    - work run to its end twice only after its node was declared DOWN: the first end was
      never reported (the agent was gone), and nothing else may run a finished job again.
    """
    out: list[Violation] = []
    downs = down_periods(events)
    for r in runs:
        for since, until in downs.get(r.node, []):
            if since + CLOCK_SLACK < r.last and r.start < until:
                alive = min(r.last, until)
                out.append(
                    Violation(
                        "alive-on-down",
                        f"job {r.job_id}",
                        f"attempt {r.attempt_id} on {r.node} was alive at {alive:.3f}, after "
                        f"the node was declared DOWN at {since:.3f}",
                    )
                )
                break
    windows: dict[str, list[Fault]] = defaultdict(list)
    for f in faults:
        windows[f.node].append(f)
    for e in events:
        if e.kind != "node.down" or e.node is None:
            continue
        if not any(f.start <= e.ts <= f.end + CLOCK_SLACK for f in windows.get(e.node, [])):
            out.append(
                Violation(
                    "false-down",
                    e.node,
                    f"declared DOWN at {e.ts:.3f} (event {e.id}: {e.message!r}) while no fault "
                    f"kept it from answering",
                )
            )
    by_job: dict[int, list[Run]] = defaultdict(list)
    for r in runs:
        if r.finished:
            by_job[r.job_id].append(r)
    for jid, finished in by_job.items():
        finished.sort(key=lambda r: r.start)
        for a, b in itertools.pairwise(finished):
            declared = any(a.start <= since <= b.start for since, _ in downs.get(a.node, []))
            if not declared:
                out.append(
                    Violation(
                        "early-rerun",
                        f"job {jid}",
                        f"ran to its end on {a.node} (attempt {a.attempt_id}, until "
                        f"{a.last:.3f}) and again from {b.start:.3f} on {b.node} (attempt "
                        f"{b.attempt_id}), but {a.node} was never declared DOWN in between",
                    )
                )
    return out


def check_held(held: Sequence[Holding]) -> list[Violation]:
    """Nothing held without a live attempt once every job has ended."""
    return [
        Violation("held-after-end", h.subject, f"{h.amount:g} {h.what} still held")
        for h in held
        if h.amount
    ]


def check(h: History, expect: str | None = "COMPLETED") -> list[Violation]:
    """Every check over one recorded history."""
    return [
        *check_submissions(h.submissions, h.jobs),
        *check_runs(h.jobs, h.runs),
        *check_terminal(h.jobs, h.events, expect),
        *check_terms(h.events, h.jobs, h.samples),
        *check_nodes(h.runs, h.events, h.faults),
        *check_held(h.held),
    ]


def summarize(h: History) -> Summary:
    by_state: dict[str, int] = defaultdict(int)
    for j in h.jobs:
        by_state[j.state] += 1
    writes, _ = term_writes(h.events, h.jobs)
    return Summary(
        jobs=len(h.jobs),
        runs=len(h.runs),
        requeued_jobs=sum(1 for j in h.jobs if len(j.attempts) > 1),
        stopped_runs=sum(1 for r in h.runs if not r.finished),
        finished_twice=sum(
            1
            for jid in {r.job_id for r in h.runs}
            if sum(1 for r in h.runs if r.job_id == jid and r.finished) > 1
        ),
        downs=sum(1 for e in h.events if e.kind == "node.down"),
        takes=len(lease_takes(h.events)),
        term_writes=len(writes),
        samples=len(h.samples),
        by_state=dict(by_state),
    )
