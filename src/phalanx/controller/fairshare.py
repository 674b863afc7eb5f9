"""The controller's side of priority and fair share: the cached fair share table, the queue
policy each scheduling pass uses, submit-time account/QOS/limit checks, and the charging tick.

The pure arithmetic is in domain/fairshare.py, domain/priority.py and domain/limits.py; this
module reads the configuration and the store and keeps what is costly (the usage table, read
once per `priority.calc_period`) between passes, so a pass only looks factors up.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

from phalanx.config import Config
from phalanx.domain import accounts as accts
from phalanx.domain import fairshare as fs
from phalanx.domain import limits as lim
from phalanx.domain import priority as prio
from phalanx.errors import Forbidden, InvalidSpec
from phalanx.store.sqlbits import Fence
from phalanx.store.store import Store

log = logging.getLogger("phalanx.controller.fairshare")

CHECK_EVERY = 1.0  # seconds: how stale the submit path's view of the tree may be at most


def _config_name() -> str:
    return os.environ.get("PHALANX_CONFIG") or "the default configuration"


class _View:
    """One version of the tree and what the checks derive from it (immutable: swapped whole
    when the store's counter moves)."""

    def __init__(self, tree: accts.Tree, default_account: str, default_qos: str) -> None:
        self.tree = tree
        self.account_names = set(tree.accounts)
        # No account declared (the default configuration): any --account is accepted and
        # becomes a top-level account with 1 share, so scripts that name their site's account
        # keep working and fair share still balances the accounts jobs name.
        self.dynamic = not tree.declared
        self.listed = set(tree.users())
        self.limits = tree.limits()
        self.submit_limited = tree.submit_limited()


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
        # the tree, its limits and QOS come from the store (`sacctmgr`; the configuration's
        # [fairshare] is its first import): read when its change counter moves, checked
        # every scheduling pass and, on the submit path, at most every CHECK_EVERY seconds
        self._view: _View | None = None
        self._checked_at = -1e18  # monotonic time the counter was last read
        self._load_lock = threading.Lock()
        self._lock = threading.Lock()
        self._usage: dict[tuple[str, str], float] = {}
        self._usage_at = -1e18  # monotonic time the usage was read
        self._table: fs.FairShareTable | None = None
        self._table_users: frozenset[tuple[str, str]] = frozenset()

    # ------------------------------------------------------------------ accounts
    # ------------------------------------------------------------------ the tree
    def view(self, max_age: float = CHECK_EVERY) -> _View:
        """The tree as the store holds it, re-read if its change counter moved since (the
        counter is read when the last read is older than `max_age` seconds). On a store with
        no tree yet, the configuration's [fairshare] is imported first (once, cluster-wide)."""
        now_m = time.monotonic()
        view = self._view
        if view is not None and now_m - self._checked_at < max_age:
            return view
        with self._load_lock:
            view = self._view
            if view is not None and time.monotonic() - self._checked_at < max_age:
                return view
            version = self.store.accounts_version()
            if version is None:
                self._first_import()
            if view is None or version is None or version != view.tree.version:
                view = self._load()
            self._checked_at = time.monotonic()
            return view

    def changed(self) -> None:
        """This controller changed the tree: the next use re-reads it."""
        self._checked_at = -1e18

    def _first_import(self) -> None:
        tree = accts.from_config(self.cfg)
        source = f"[fairshare] of {_config_name()}"
        if self.store.import_accounts(tree, self.store.actor, source=source):
            log.info(
                "accounts: imported %s into the store (%d accounts, %d user associations, "
                "%d QOS); from now on the store's tree is used (sacctmgr changes it)",
                source,
                len(tree.accounts),
                len(tree.assocs),
                len(tree.qos),
            )

    def _load(self) -> _View:
        read = self.store.accounts_tree()
        if read is None:  # the import was undone under us (a restored store): the file's
            tree, meta = accts.from_config(self.cfg), {"digest": ""}
        else:
            tree, meta = read
        if self._view is None and read is not None:
            mine = accts.from_config(self.cfg).digest()
            if meta.get("digest") != mine:
                log.warning(
                    "accounts: the [fairshare] accounts, users and qos of %s differ from the "
                    "tree imported into the store (by %s); the store's tree is used and the "
                    "file's is ignored: change accounts with sacctmgr, or re-import the file "
                    "(POST /v1/accounts/import, docs/fairshare.md)",
                    _config_name(),
                    meta.get("imported_by"),
                )
        view = _View(tree, self.cfg.default_account, self.cfg.default_qos)
        with self._lock:
            self._view = view
            self._table = None  # the next table uses the new tree
        return view

    def qos_source(self) -> Any:
        """The QOS with their preemption tiers and modes, as PreemptionConfig.tiers reads
        them (`.qos`)."""
        return SimpleNamespace(qos=list(self.view().tree.qos.values()))

    def resolve(self, user: str, account: str | None, qos: str | None) -> tuple[str, str]:
        """The account and QOS a job of `user` is charged to; refuse what the tree does not
        allow with a message that says what would be allowed. A refusal is checked against
        the store's latest tree first (an account added a moment ago on another controller)."""
        try:
            return self._resolve(self.view(), user, account, qos)
        except (Forbidden, InvalidSpec):
            return self._resolve(self.view(max_age=0.0), user, account, qos)

    def _resolve(
        self, v: _View, user: str, account: str | None, qos: str | None
    ) -> tuple[str, str]:
        mine = v.tree.accounts_of(user)
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
                    "(fairshare.open = false): ask an admin to add them (`sacctmgr add user "
                    f"{user} account=ACCOUNT`)"
                )
            account = mine[0]
        elif v.dynamic and self.cfg.open and user not in v.listed:
            pass  # no tree declared: an account is made by naming it (see `dynamic`)
        elif account not in v.account_names:
            known = ", ".join(sorted(v.account_names))
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
        if qos not in v.tree.qos:
            known = ", ".join(sorted(v.tree.qos))
            raise InvalidSpec(f"qos: QOS {qos!r} does not exist (QOS: {known})", field="qos")
        return account, qos

    def check_submit(self, jobs: Sequence[tuple[str, str, str, int]]) -> None:
        """Refuse a submission that breaks a submit limit: jobs are (user, account, qos, count
        of jobs, array tasks counted)."""
        v = self.view()
        if not v.submit_limited or not jobs:
            return
        limits = v.limits
        counted = lim.Usage()
        for row in self.store.submitted_counts():
            job = {"user": row["user"], "account": row["account"] or self.cfg.default_account}
            job.update(qos=row["qos"], nodes=0, gpus_per_node=0)
            for key in lim.keys(job, limits):
                counted.jobs[key] += int(row["n"])
        for user, account, qos, n in jobs:
            job = {"user": user, "account": account, "qos": qos, "nodes": 0, "gpus_per_node": 0}
            why = lim.submit_refusal(job, counted, limits, n)
            if why:
                raise InvalidSpec(f"submit limit: {why}", field="account")
            for key in lim.keys(job, limits):
                counted.jobs[key] += n

    # ------------------------------------------------------------------ the table
    def _tree(
        self, v: _View, extra: set[tuple[str, str]]
    ) -> tuple[list[fs.Account], list[fs.Member]]:
        """The stored tree plus the associations jobs and usage name that it lacks: an
        unlisted user in the default account (or, with no tree declared, in the account they
        named, made a top-level account), with 1 share."""
        accounts = v.tree.tree_accounts()
        members = v.tree.members()
        listed = {(m.account, m.user) for m in members}
        made: set[str] = set()
        for account, user in sorted(extra - listed):
            if account not in v.account_names:
                if not v.dynamic:
                    continue  # an account since removed
                if account not in made:
                    accounts.append(fs.Account(account, fs.ROOT, 1))
                    made.add(account)
            members.append(fs.Member(user, account, 1))
        return accounts, members

    def table(self, *, refresh: bool = False, more: set[tuple[str, str]] | None = None) -> Any:
        """The fair share table from the cached usage (re-read every calc_period or when
        `refresh`); `more`: associations to rank besides the configured ones (users submitting
        to the default account without being listed)."""
        v = self.view(max_age=0.0 if refresh else CHECK_EVERY)
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
                accounts, members = self._tree(v, known)
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
        self.view(max_age=0.0)  # every pass sees the store's latest tree
        table = self.table(more=more)
        v = self.view()
        return prio.QueuePolicy(
            weights=self.weights,
            fairshare=table.factor,
            qos_priority={name: q.priority for name, q in v.tree.qos.items()},
            limits=v.limits,
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
