"""The controller's side of priority and fair share: the cached fair share table, the queue
policy each scheduling pass uses, submit-time account/QOS/limit checks, and the charging tick.

The pure arithmetic is in domain/fairshare.py, domain/priority.py and domain/limits.py; this
module reads the configuration and the store and keeps what is costly (the usage table, read
once per `priority.calc_period`) between passes, so a pass only looks factors up.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from phalanx.config import Config, LimitFields
from phalanx.domain import fairshare as fs
from phalanx.domain import limits as lim
from phalanx.domain import priority as prio
from phalanx.errors import Forbidden, InvalidSpec
from phalanx.store.sqlbits import Fence
from phalanx.store.store import Store


def _limit(c: LimitFields) -> lim.Limit:
    return lim.Limit(
        max_running_jobs=c.max_running_jobs,
        max_submit_jobs=c.max_submit_jobs,
        max_gpus=c.max_gpus,
        max_wall_s=c.max_wall_s(),
    )


def _has_limit(c: LimitFields) -> bool:
    return any(
        v is not None for v in (c.max_running_jobs, c.max_submit_jobs, c.max_gpus, c.max_wall)
    )


class FairShare:
    """One per controller. Thread-safe: the API threads and the scheduling loop share it."""

    def __init__(self, store: Store, config: Config) -> None:
        self.store = store
        self.config = config
        self.cfg = config.fairshare
        p = config.priority
        self.weights = prio.Weights(
            age=p.weight_age,
            fairshare=p.weight_fairshare,
            jobsize=p.weight_jobsize,
            partition=p.weight_partition,
            qos=p.weight_qos,
            max_age_s=p.max_age_s(),
            favor_small=p.favor_small,
        )
        self.half_life = p.half_life_s()
        accounts = self.cfg.all_accounts()
        self.account_names = {a.name for a in accounts}
        # No account declared (the default configuration): any --account is accepted and
        # becomes a top-level account with 1 share, so scripts that name their site's account
        # keep working and fair share still balances the accounts jobs name.
        self.dynamic = not self.cfg.accounts
        self.listed = {u.name for u in self.cfg.users}
        self.qos = {q.name: q for q in self.cfg.all_qos()}
        self.limits = lim.Limits(
            accounts={a.name: _limit(a) for a in accounts if _has_limit(a)},
            assocs={(u.account, u.name): _limit(u) for u in self.cfg.users if _has_limit(u)},
            qos={q.name: _limit(q) for q in self.qos.values() if _has_limit(q)},
            parents={a.name: a.parent for a in accounts},
        )
        self._submit_limited = any(
            x.max_submit_jobs is not None for x in [*accounts, *self.cfg.users, *self.qos.values()]
        )
        self._lock = threading.Lock()
        self._usage: dict[tuple[str, str], float] = {}
        self._usage_at = -1e18  # monotonic time the usage was read
        self._table: fs.FairShareTable | None = None
        self._table_users: frozenset[tuple[str, str]] = frozenset()

    # ------------------------------------------------------------------ accounts
    def resolve(self, user: str, account: str | None, qos: str | None) -> tuple[str, str]:
        """The account and QOS a job of `user` is charged to; refuse what the tree does not
        allow with a message that says what would be allowed."""
        mine = self.cfg.accounts_of(user)
        if not mine and self.cfg.open:
            mine = [self.cfg.default_account]
        if account == fs.ROOT:
            raise InvalidSpec(
                f"account: '{fs.ROOT}' is the root of the account tree, not an account to "
                "charge: give your account's name or none",
                field="account",
            )
        if account is None:
            if not mine:
                raise Forbidden(
                    f"user {user} is in no account and unlisted users may not submit "
                    "(fairshare.open = false): ask an admin to add them to [[fairshare.users]]"
                )
            account = mine[0]
        elif self.dynamic and self.cfg.open and user not in self.listed:
            pass  # no tree declared: an account is made by naming it (see `dynamic`)
        elif account not in self.account_names:
            known = ", ".join(sorted(self.account_names))
            raise InvalidSpec(
                f"account: account {account!r} does not exist (accounts: {known})",
                field="account",
            )
        elif account not in mine:
            have = ", ".join(mine) if mine else "none"
            raise Forbidden(
                f"user {user} may not charge account {account!r} (their accounts: {have}); "
                "submit with --account set to one of theirs or ask an admin to add them"
            )
        qos = qos or self.cfg.default_qos
        if qos not in self.qos:
            known = ", ".join(sorted(self.qos))
            raise InvalidSpec(f"qos: QOS {qos!r} does not exist (QOS: {known})", field="qos")
        return account, qos

    def check_submit(self, jobs: Sequence[tuple[str, str, str, int]]) -> None:
        """Refuse a submission that breaks a submit limit: jobs are (user, account, qos, count
        of jobs, array tasks counted)."""
        if not self._submit_limited or not jobs:
            return
        counted = lim.Usage()
        for row in self.store.submitted_counts():
            job = {"user": row["user"], "account": row["account"] or self.cfg.default_account}
            job.update(qos=row["qos"], nodes=0, gpus_per_node=0)
            for key in lim.keys(job, self.limits):
                counted.jobs[key] += int(row["n"])
        for user, account, qos, n in jobs:
            job = {"user": user, "account": account, "qos": qos, "nodes": 0, "gpus_per_node": 0}
            why = lim.submit_refusal(job, counted, self.limits, n)
            if why:
                raise InvalidSpec(f"submit limit: {why}", field="account")
            for key in lim.keys(job, self.limits):
                counted.jobs[key] += n

    # ------------------------------------------------------------------ the table
    def _tree(self, extra: set[tuple[str, str]]) -> tuple[list[fs.Account], list[fs.Member]]:
        """The configured tree plus the associations jobs and usage name that it lacks: an
        unlisted user in the default account (or, with no tree declared, in the account they
        named, made a top-level account), with 1 share."""
        accounts = self.cfg.tree_accounts()
        members = self.cfg.members()
        listed = {(m.account, m.user) for m in members}
        made: set[str] = set()
        for account, user in sorted(extra - listed):
            if account not in self.account_names:
                if not self.dynamic:
                    continue  # an account since removed from the configuration
                if account not in made:
                    accounts.append(fs.Account(account, fs.ROOT, 1))
                    made.add(account)
            members.append(fs.Member(user, account, 1))
        return accounts, members

    def table(self, *, refresh: bool = False, more: set[tuple[str, str]] | None = None) -> Any:
        """The fair share table from the cached usage (re-read every calc_period or when
        `refresh`); `more`: associations to rank besides the configured ones (users submitting
        to the default account without being listed)."""
        now_m = time.monotonic()
        with self._lock:
            stale = refresh or now_m - self._usage_at >= self.config.priority.calc_period
            if stale:
                self._usage = self.store.usage_table(time.time(), self.half_life)
                self._usage_at = now_m
            users = set(self._usage) | set(more or ())
            users = {(a, u) for a, u in users}
            key = frozenset(users)
            if self._table is None or stale or not key <= self._table_users:
                known = users | set(self._table_users)
                accounts, members = self._tree(known)
                self._table = fs.fair_tree(accounts, members, self._usage)
                self._table_users = frozenset(known)
            return self._table

    def share_rows(self) -> dict[str, Any]:
        """`phalanx share`: the table, refreshed, with every association the store knows."""
        more = {(a or self.cfg.default_account, u) for a, u in self.store.job_users()}
        t = self.table(refresh=True, more=more)
        return {
            "users": t.users,
            "half_life_s": self.half_life,
            "weights": {k: self.weights.of(k) for k in prio.FACTORS},
            "charge": {
                "cpu": self.config.priority.charge_cpu,
                "gpu": self.config.priority.charge_gpu,
            },
            "rows": [
                {
                    "account": r.account,
                    "user": r.user,
                    "depth": r.depth,
                    "raw_shares": r.raw_shares,
                    "norm_shares": r.norm_shares,
                    "raw_usage": r.raw_usage,
                    "effective_usage": r.effective_usage,
                    "level_fs": None if r.level_fs == float("inf") else r.level_fs,
                    "fairshare": r.fairshare,
                    "rank": r.rank,
                }
                for r in t.rows
            ],
        }

    def policy(self, snap: Any) -> prio.QueuePolicy:
        """The queue policy for one scheduling pass over `snap`."""
        more = {
            (str(j.get("account") or self.cfg.default_account), str(j["user"]))
            for j in snap.pending
        }
        table = self.table(more=more)
        return prio.QueuePolicy(
            weights=self.weights,
            fairshare=table.factor,
            qos_priority={name: q.priority for name, q in self.qos.items()},
            limits=self.limits,
            default_account=self.cfg.default_account,
        )

    def job_breakdown(self, job: Mapping[str, Any], snap: Any) -> prio.Breakdown:
        """`phalanx priority JOB`: one job's factors against the cluster as it is now."""
        pol = self.policy(snap)
        return pol.scorer(snap, time.time())(job)

    # ------------------------------------------------------------------ charging
    def charge(self, fence: Fence | None) -> int:
        p = self.config.priority
        n = self.store.charge_usage(
            time.time(),
            half_life=self.half_life,
            cpu_weight=p.charge_cpu,
            gpu_weight=p.charge_gpu,
            default_account=self.cfg.default_account,
            fence=fence,
        )
        with self._lock:
            self._usage_at = -1e18  # the next table reads the new usage
        return n
