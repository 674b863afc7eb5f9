"""Fair share as Slurm's Fair Tree computes it, and the usage it is computed from.

Pure functions only: the controller hands in the account tree (from the configuration) and the
decayed usage of each user association (from the store), and gets back one row per association
with every number `phalanx share` prints.

Fair Tree (https://slurm.schedmd.com/fair_tree.html), in short:

* at each level of the tree, every association (account or user) gets a *level fair share*
  ``LF = S / U``: ``S`` its raw shares over the raw shares of itself and its siblings, ``U`` its
  usage over the usage of itself and its siblings (``LF`` is infinite when ``U`` is 0: an
  association that has used nothing is the most under-served);
* siblings are sorted by ``LF``, highest first, and the tree is walked depth first in that
  order; users are ranked in the order they are met, the first getting ``rank = number of
  users``, the next one less, and so on;
* a user's fair share factor is ``rank / number of users``: 1.0 for the most under-served user.

Ties (as Slurm): sibling users with equal ``LF`` get the same rank; sibling accounts with equal
``LF`` have their children merged before the walk descends; a user tied with a sibling account
gets the rank of that account's highest ranked user.

Usage is decayed with a half-life: ``u(t) = u(t0) * 2 ** (-(t - t0) / half_life)``. The store
keeps, per user association, the decayed usage and the time it was last decayed, so decaying is
incremental (`decay`) instead of a sum over all history.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

ROOT = "root"


@dataclass(frozen=True)
class Account:
    name: str
    parent: str  # ROOT for a top-level account
    shares: int = 1


@dataclass(frozen=True)
class Member:
    """A user association: `user` may charge `account`, with `shares` of it."""

    user: str
    account: str
    shares: int = 1


@dataclass
class ShareRow:
    """One association as `phalanx share` prints it (user None: an account)."""

    account: str
    user: str | None
    depth: int
    raw_shares: int
    norm_shares: float  # S: shares over siblings' shares at its level
    raw_usage: float  # decayed usage (charge units), its own or its subtree's
    effective_usage: float  # U: usage over siblings' usage at its level
    level_fs: float  # LF = S / U (inf when U == 0)
    fairshare: float | None = None  # users only: rank / users
    rank: int | None = None  # users only
    children: list[ShareRow] = field(default_factory=list)


@dataclass
class FairShareTable:
    """Rows in tree order (depth first, highest level fair share first) and each user
    association's factor."""

    rows: list[ShareRow]
    factors: dict[tuple[str, str], float]  # (account, user) -> fair share factor
    users: int  # user associations ranked (the denominator)

    def factor(self, account: str, user: str) -> float:
        """The association's factor; one that is not in the tree (not yet known) has used
        nothing, so it ranks as the least served: 1.0."""
        return self.factors.get((account, user), 1.0)


def decay(usage: float, since: float, now: float, half_life: float) -> float:
    """`usage` recorded at `since`, as it stands at `now` after half-life decay."""
    if half_life <= 0 or now <= since:
        return usage
    return usage * math.pow(2.0, -(now - since) / half_life)


def charge(cpus: int, gpus: int, seconds: float, cpu_weight: float, gpu_weight: float) -> float:
    """What holding `cpus` CPUs and `gpus` GPUs for `seconds` costs, in charge units (Slurm's
    TRES billing: each resource's count times its weight, summed, per second)."""
    return max(0.0, seconds) * (cpus * cpu_weight + gpus * gpu_weight)


def level_fs(shares: float, sibling_shares: float, usage: float, sibling_usage: float) -> float:
    """LF = S / U with S = shares / all siblings' shares, U = usage / all siblings' usage.

    Siblings include the association itself. No usage (U = 0) is infinitely under-served."""
    s = shares / sibling_shares if sibling_shares > 0 else 0.0
    u = usage / sibling_usage if sibling_usage > 0 else 0.0
    if u <= 0:
        return math.inf
    return s / u


def validate_tree(accounts: Iterable[Account], members: Iterable[Member]) -> None:
    """Raise ValueError naming the first problem: a duplicate, a missing parent, a cycle, a
    member of an unknown account, a bad share count."""
    by_name: dict[str, Account] = {}
    for a in accounts:
        if a.name == ROOT:
            raise ValueError(f"'{ROOT}' is the tree's root; it cannot be declared as an account")
        if a.name in by_name:
            raise ValueError(f"account {a.name!r} is declared twice")
        if a.shares < 1:
            raise ValueError(f"account {a.name!r}: shares must be at least 1 (got {a.shares})")
        by_name[a.name] = a
    for a in by_name.values():
        if a.parent != ROOT and a.parent not in by_name:
            raise ValueError(
                f"account {a.name!r}: parent {a.parent!r} is not an account (use '{ROOT}' for "
                "a top-level account)"
            )
        seen = {a.name}
        p = a.parent
        while p != ROOT:
            if p in seen:
                raise ValueError(f"account {a.name!r}: its parents form a cycle through {p!r}")
            seen.add(p)
            p = by_name[p].parent
    pairs = set()
    for m in members:
        if m.account not in by_name:
            raise ValueError(f"user {m.user!r}: account {m.account!r} is not declared")
        if (m.user, m.account) in pairs:
            raise ValueError(f"user {m.user!r} is in account {m.account!r} twice")
        if m.shares < 1:
            raise ValueError(
                f"user {m.user!r} in {m.account!r}: shares must be at least 1 (got {m.shares})"
            )
        pairs.add((m.user, m.account))


def fair_tree(
    accounts: Iterable[Account],
    members: Iterable[Member],
    usage: Mapping[tuple[str, str], float],
) -> FairShareTable:
    """Rank every user association of the tree (Fair Tree) from each one's decayed usage.

    `usage` maps (account, user) to the association's decayed usage; absent means 0. An
    account's usage is the sum of its subtree's. The tree is assumed valid (`validate_tree`).
    """
    accts = list(accounts)
    mems = list(members)
    kids: dict[str, list[ShareRow]] = {ROOT: []}
    rows_by_account: dict[str, ShareRow] = {}
    for a in accts:
        rows_by_account[a.name] = ShareRow(a.name, None, 0, a.shares, 0.0, 0.0, 0.0, 0.0)
        kids.setdefault(a.name, [])
    for a in accts:
        kids.setdefault(a.parent, []).append(rows_by_account[a.name])
    for m in mems:
        row = ShareRow(m.account, m.user, 0, m.shares, 0.0, 0.0, 0.0, 0.0)
        row.raw_usage = max(0.0, float(usage.get((m.account, m.user), 0.0)))
        kids[m.account].append(row)

    def fill(name: str, depth: int) -> float:
        """Set depth, subtree usage and the level numbers of `name`'s children; return the
        subtree's usage."""
        children = kids.get(name, [])
        for c in children:
            c.depth = depth
            if c.user is None:
                c.raw_usage = fill(c.account, depth + 1)
                c.children = kids.get(c.account, [])
        total_shares = sum(c.raw_shares for c in children)
        total_usage = sum(c.raw_usage for c in children)
        for c in children:
            c.norm_shares = c.raw_shares / total_shares if total_shares else 0.0
            c.effective_usage = c.raw_usage / total_usage if total_usage else 0.0
            c.level_fs = level_fs(c.raw_shares, total_shares, c.raw_usage, total_usage)
        return total_usage

    fill(ROOT, 0)
    n_users = len(mems)
    counter = [n_users]  # the next rank to give
    factors: dict[tuple[str, str], float] = {}

    def give(user_row: ShareRow, rank: int) -> None:
        user_row.rank = rank
        user_row.fairshare = rank / n_users if n_users else 0.0
        assert user_row.user is not None
        factors[(user_row.account, user_row.user)] = user_row.fairshare

    def walk(level: list[ShareRow]) -> int | None:
        """Rank the users under `level` (siblings, or merged children of tied accounts); return
        the highest rank given (None if the level holds no user)."""
        ranked = sorted(level, key=_display_key)
        top: int | None = None
        i = 0
        while i < len(ranked):
            j = i
            while j < len(ranked) and ranked[j].level_fs == ranked[i].level_fs:
                j += 1
            group = ranked[i:j]
            group_accounts = [r for r in group if r.user is None]
            group_users = [r for r in group if r.user is not None]
            start = counter[0]
            # tied accounts: their children are merged, then the walk descends once
            best = None
            if group_accounts:
                merged = [c for r in group_accounts for c in r.children]
                best = walk(merged)
            # tied users share one rank: that of a tied account's highest user, if any
            rank = best if best is not None else start
            for r in group_users:
                give(r, rank)
                counter[0] -= 1
            got = best if best is not None else (rank if group_users else None)
            if top is None and got is not None:
                top = got
            i = j
        return top

    walk(kids[ROOT])
    order: list[ShareRow] = []

    def listing(level: list[ShareRow]) -> None:
        for r in sorted(level, key=_display_key):
            order.append(r)
            if r.user is None:
                listing(r.children)

    listing(kids[ROOT])
    return FairShareTable(rows=order, factors=factors, users=n_users)


def _display_key(r: ShareRow) -> tuple[float, bool, str, str]:
    """Siblings as Fair Tree visits them: highest level fair share first, accounts before
    users on a tie, then by name."""
    return (-r.level_fs, r.user is not None, r.account, r.user or "")
