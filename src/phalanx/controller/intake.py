"""Submissions intake: a job spec checked, charged and stored, one request or a group.

`Intake` normalizes a spec against the partitions, charges it to the account and QOS fair
share allows, refuses what can never run here (licences, topology levels, no node that could
ever hold it) and stores it; `submit_group` is the group commit of controller/submitq.py. The
partition and node views it judges by are cached briefly, with each request shape's verdict,
since submissions come in bursts of the same shape.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from prometheus_client import Counter

from phalanx.config import Config
from phalanx.controller.fairshare import FairShare
from phalanx.domain import licenses, reservations, scheduling
from phalanx.domain.spec import JobSpec, ResolvedJob, normalize
from phalanx.errors import (
    InvalidSpec,
    NotFound,
    PhalanxError,
    StoreOutcomeUnknown,
    StoreUnavailable,
    Unsatisfiable,
)
from phalanx.store.surface import NodeStore, ReservationStore, SubmissionStore

SUBMITTED = Counter("phalanx_jobs_submitted_total", "Jobs (array tasks count one each) accepted")

CACHE_TTL = 2.0  # seconds submit-time checks may use a cached view of partitions and nodes
MAX_VERDICTS = 1024  # request shapes whose satisfiability is remembered per cached node view


class IntakeStore(SubmissionStore, NodeStore, ReservationStore, Protocol):
    """What intake asks of the store: the submission methods, and the nodes it judges by."""


class Intake:
    def __init__(
        self,
        store: IntakeStore,
        config: Config,
        fairshare: FairShare,
        kick: Callable[[], None],
    ) -> None:
        self.store = store
        self.config = config
        self.fairshare = fairshare  # accounts, QOS and submit limits
        self.kick = kick  # a job that may run now: the scheduler's next pass at once
        self._partitions_cache: tuple[float, Any] | None = None
        self._views_cache: tuple[float, list[Any]] | None = None
        # submit-time verdicts for the cached node views they were reached on (see
        # _check_satisfiable): the same views give the same verdict, so nothing here is stale
        self._verdicts: tuple[list[Any], dict[Any, str | None]] = ([], {})

    def partitions(self) -> Any:
        cached = self._partitions_cache
        if cached and time.monotonic() - cached[0] < CACHE_TTL:
            return cached[1]
        parts = self.store.partition_infos()
        self._partitions_cache = (time.monotonic(), parts)
        return parts

    def node_views(self) -> list[Any]:
        """Registered nodes as placement sees them, cached briefly for submit-time checks.

        A registration invalidates the cache, so a node that just joined is never missed;
        drained or down nodes count (they may come back), so their changes need no refresh.
        """
        cached = self._views_cache
        if cached and time.monotonic() - cached[0] < CACHE_TTL:
            return cached[1]
        nodes = [n for n in self.store.list_nodes() if n["registered"]]
        views = scheduling.node_views(nodes, self.store.partitions())
        self._views_cache = (time.monotonic(), views)
        return views

    def forget_views(self) -> None:
        """A node registered: the next submission reads the nodes afresh."""
        self._views_cache = None

    def submit(
        self, specs: list[JobSpec], user: str, *, validate_only: bool = False
    ) -> list[list[int]]:
        """Validate and store jobs; `validate_only` (sbatch --test-only) stops before storing
        and returns no ids."""
        parts = self.partitions()
        views = self.node_views()
        items = []
        for i, spec in enumerate(specs):
            try:
                items.append(self._prepare(spec, parts, views, user))
            except PhalanxError as e:
                if len(specs) > 1:
                    e.message = f"job {i}: {e.message}"
                    e.details["index"] = i
                raise
        self.fairshare.check_submit([self._limit_key(user, item) for item in items])
        if validate_only:
            return [[] for _ in items]
        ids = self.store.submit(items, user)
        self._submitted(ids, items)
        return ids

    def submit_group(self, requests: list[tuple[JobSpec, str]]) -> list[list[int] | Exception]:
        """Several one-job submissions (each its own request and submitter) committed in one
        transaction: the group commit of controller/submitq.py. Returns, per request, its ids or
        the error that request alone gets.

        A request refused by validation fails alone. If storing the group fails for a reason
        that may be one request's (an unknown dependency), each request is stored again in a
        transaction of its own, so that it fails only its author; a store failure (unavailable,
        or a commit whose outcome is unknown) is everyone's: retrying then could store a job
        twice.
        """
        parts = self.partitions()
        views = self.node_views()
        out: list[list[int] | Exception] = [[] for _ in requests]
        ready: list[tuple[int, tuple[ResolvedJob, dict[str, Any]], str]] = []
        counted: list[tuple[str, str, str, int]] = []  # submit limits count the group too
        for i, (spec, user) in enumerate(requests):
            try:
                item = self._prepare(spec, parts, views, user)
                key = self._limit_key(user, item)
                self.fairshare.check_submit([*counted, key])
            except PhalanxError as e:
                out[i] = e
                continue
            counted.append(key)
            ready.append((i, item, user))
        if not ready:
            return out
        try:
            ids = self.store.submit_each([(*item, user) for _, item, user in ready])
        except (StoreUnavailable, StoreOutcomeUnknown) as e:
            for i, _, _ in ready:
                out[i] = e
            return out
        except Exception as e:
            if len(ready) == 1:
                out[ready[0][0]] = e
                return out
            for i, item, user in ready:  # nothing was stored: each on its own
                try:
                    one = self.store.submit([item], user)
                    out[i] = one[0]
                    self._submitted(one, [item])
                except Exception as e1:
                    out[i] = e1
            return out
        for (i, _, _), jids in zip(ready, ids, strict=True):
            out[i] = jids
        self._submitted(ids, [item for _, item, _ in ready])
        return out

    def _prepare(
        self, spec: JobSpec, parts: Any, views: list[Any], user: str
    ) -> tuple[ResolvedJob, dict[str, Any]]:
        """A job as the store takes it: normalized, charged to the account and QOS the fair
        share tree allows `user` (controller/fairshare.py), and refused if it can never run
        here."""
        resolved = normalize(
            spec,
            parts,
            default_mem_per_cpu_mb=self.config.cluster.default_mem_per_cpu_mb,
            default_requeue=self.config.cluster.default_requeue,
        )
        self._check_licenses(resolved)
        self._check_topology(resolved)
        self._check_satisfiable(resolved, views)
        dump = spec.model_dump(exclude={"ignored"})
        dump["account"], dump["qos"] = self.fairshare.resolve(user, spec.account, spec.qos)
        if spec.reservation:
            self._check_reservation(spec.reservation, user, dump["account"], resolved, views)
        return resolved, dump

    def _check_reservation(
        self, name: str, user: str, account: str | None, resolved: Any, views: list[Any]
    ) -> None:
        """--reservation: refused, in Slurm's words, when it does not exist (or has ended),
        when neither the user nor the account may use it, or when the job could never fit
        on its nodes."""
        from phalanx.domain.placement_reasons import unsatisfiable_reason

        try:
            row = self.store.get_reservation(name)
        except NotFound:
            row = None
        resv = reservations.Reservation.from_row(row) if row is not None else None
        why = reservations.submit_refusal(resv, user, account, time.time())
        if why:
            raise InvalidSpec(why, field="reservation", reservation=name)
        assert resv is not None
        inside = set(resv.nodes)
        mine = [v for v in views if v.name in inside]
        if mine:
            fields = scheduling.resolved_fields(resolved)
            reason = unsatisfiable_reason(scheduling.job_request(fields), mine)
            if reason:
                raise Unsatisfiable(
                    "Requested node configuration is not available: on the nodes of "
                    f"reservation {name} ({resv.hostlist}): {reason}"
                )

    @staticmethod
    def _limit_key(
        user: str, item: tuple[ResolvedJob, dict[str, Any]]
    ) -> tuple[str, str, str, int]:
        """(user, account, qos, jobs it adds: array tasks counted) for the submit limits."""
        resolved, dump = item
        return user, dump["account"], dump["qos"], len(resolved.array_indices or [0])

    def _submitted(
        self, ids: list[list[int]], items: list[tuple[ResolvedJob, dict[str, Any]]]
    ) -> None:
        SUBMITTED.inc(sum(len(i) for i in ids))
        if any(not resolved.hold for resolved, _ in items):
            self.kick()

    def _check_licenses(self, resolved: Any) -> None:
        """Refuse a job asking for a licence the cluster does not have, or more than its
        total (it would wait forever); whether they are free now is the scheduler's matter."""
        if not resolved.licenses:
            return
        why = licenses.refusal(
            licenses.parse_licenses(resolved.licenses), self.config.cluster.license_totals()
        )
        if why:
            raise Unsatisfiable(
                f"this job can never run here: --licenses={resolved.licenses}: {why}"
            )

    def _check_topology(self, resolved: Any) -> None:
        """Refuse --spread/--anti-affinity with a level the cluster does not have (a typo
        would silently spread over nodes instead of racks)."""
        levels = self.config.topology.levels
        for option, level in (
            ("--spread", resolved.spread),
            ("--anti-affinity", resolved.anti_affinity),
        ):
            if level is not None and level not in levels:
                known = ", ".join(levels) or "none"
                raise Unsatisfiable(
                    f"{option}={level}: unknown topology level (levels of this cluster: {known})"
                )
        if resolved.switches is not None and not levels:
            raise Unsatisfiable("--switches: this cluster has no topology levels configured")

    def _check_satisfiable(self, resolved: Any, views: list[Any]) -> None:
        from phalanx.domain.placement_reasons import unsatisfiable_reason

        if not views:
            return  # no node has registered yet: nothing to judge against
        # The verdict is a function of the request and the views only, and placement sorts and
        # walks every node: remember it per request shape for as long as these views are used
        # (jobs submitted together, or one after the other, mostly share their shape).
        fields = scheduling.resolved_fields(resolved)
        key = tuple(tuple(v) if isinstance(v, list) else v for v in fields.values())
        known_views, verdicts = self._verdicts
        if known_views is not views:
            verdicts = {}
            self._verdicts = (views, verdicts)
        if key in verdicts:
            reason = verdicts[key]
        else:
            reason = unsatisfiable_reason(scheduling.job_request(fields), views)
            if len(verdicts) < MAX_VERDICTS:
                verdicts[key] = reason
        if reason:
            raise Unsatisfiable(f"this job can never run here: {reason}")
