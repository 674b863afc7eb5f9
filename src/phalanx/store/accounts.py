"""Accounts, user associations and QOS in the store (`sacctmgr`): the first import of the
configuration's tree, every change after it, and the change counter controllers watch.

A mixin of `Store`. A change is one transaction: it moves the counter first (so concurrent
changes queue behind one another on the counter's row), reads the tree, applies the change
with domain/accounts.py's rules, refuses deleting what a pending or running job still charges,
writes the difference and records one event per record changed, with its actor.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, Table, and_, delete, func, insert, select, update
from sqlalchemy.exc import IntegrityError

from phalanx.domain import accounts as acct
from phalanx.errors import Conflict, InvalidSpec, NotFound
from phalanx.store import schema as s
from phalanx.store.base import StoreBase
from phalanx.store.fairshare import SUBMITTED

_TABLES: dict[str, tuple[Table, tuple[str, ...]]] = {
    "account": (s.acct_accounts, ("name",)),
    "user": (s.acct_users, ("account", "user")),
    "qos": (s.acct_qos, ("name",)),
}


class _DryRun(Exception):
    """Ends a dry run's transaction: rolled back, as nothing is to be written."""

    def __init__(self, version: int) -> None:
        super().__init__("dry run")
        self.version = version


def refusal(e: acct.AcctError) -> Exception:
    """The API's error for a refused change: 404 nothing matched, 409 a clash, 422 a value."""
    if e.missing:
        return NotFound(e.message)
    if e.conflict:
        return Conflict(e.message)
    return InvalidSpec(e.message, field="accounts")


class AccountRecords(StoreBase):
    """The `acct_*` tables' operations (see the module docstring)."""

    def accounts_version(self) -> int | None:
        """The change counter; None: no tree imported yet."""
        with self.db.begin(write=False) as conn:
            v = conn.execute(select(s.acct_meta.c.version).where(s.acct_meta.c.id == 1)).scalar()
        return None if v is None else int(v)

    def accounts_tree(self) -> tuple[acct.Tree, dict[str, Any]] | None:
        """The tree and the import's record (digest, by, at); None: none imported yet."""
        with self.db.begin(write=False, snapshot=True) as conn:
            return self._read_tree(conn)

    def _read_tree(self, conn: Connection) -> tuple[acct.Tree, dict[str, Any]] | None:
        meta = conn.execute(select(s.acct_meta).where(s.acct_meta.c.id == 1)).mappings().first()
        if meta is None:
            return None

        def rows(t: Table) -> list[dict[str, Any]]:
            return [dict(r) for r in conn.execute(select(t).order_by(t.c.seq)).mappings()]

        tree = acct.Tree.from_rows(
            rows(s.acct_accounts),
            rows(s.acct_users),
            rows(s.acct_qos),
            declared=bool(meta["declared"]),
            version=int(meta["version"]),
        )
        return tree, dict(meta)

    def import_accounts(
        self, tree: acct.Tree, actor: str, *, replace: bool = False, source: str = "the file"
    ) -> bool:
        """Store `tree` as the first tree (False: one is there already, and `replace` is not
        set). With `replace`, the stored tree is replaced, refused while a pending or running
        job charges an account, association or QOS the new tree lacks."""
        tree.validate()
        now = time.time()
        old: tuple[acct.Tree, dict[str, Any]] | None = None
        verb = "imported"
        try:
            with self.db.begin() as conn:
                if replace:
                    moved = conn.execute(
                        update(s.acct_meta)
                        .where(s.acct_meta.c.id == 1)
                        .values(
                            version=s.acct_meta.c.version + 1,
                            declared=tree.declared,
                            digest=tree.digest(),
                            imported_by=actor,
                            imported_at=now,
                        )
                    ).rowcount
                    old = self._read_tree(conn) if moved else None
                    if old is not None:
                        self._check_active(conn, old[0], tree)
                        self._write_diff(conn, old[0], tree, actor, now)
                        verb = "re-imported"
                if old is None:
                    conn.execute(
                        insert(s.acct_meta).values(
                            id=1,
                            version=1,
                            declared=tree.declared,
                            digest=tree.digest(),
                            imported_by=actor,
                            imported_at=now,
                        )
                    )
                    self._write_diff(conn, acct.Tree(), tree, actor, now)
                self._event(
                    conn,
                    "acct.import",
                    f"accounts {verb} from {source} by {actor}: {len(tree.accounts)} accounts, "
                    f"{len(tree.assocs)} user associations, {len(tree.qos)} QOS",
                    actor=actor,
                    data={
                        "accounts": len(tree.accounts),
                        "users": len(tree.assocs),
                        "qos": len(tree.qos),
                        "digest": tree.digest(),
                    },
                )
        except IntegrityError:
            return False  # another controller imported first
        except acct.AcctError as e:
            raise refusal(e) from None
        return True

    def change_accounts(
        self,
        what: str,
        kind: str,
        *,
        names: Sequence[str] = (),
        where: Mapping[str, Sequence[str]] | None = None,
        settings: Mapping[str, Any] | None = None,
        accounts: Sequence[str] = (),
        keep: Mapping[str, str] | None = None,
        actor: str,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        """Add (`names`, for users also `accounts`), modify (`where`, `settings`) or delete
        (`where`) accounts, users or QOS; returns the changes in words and the new counter.
        `dry_run`: checked, nothing written (sacctmgr's question before a commit)."""
        now = time.time()
        try:
            with self.db.begin() as conn:
                moved = conn.execute(
                    update(s.acct_meta)
                    .where(s.acct_meta.c.id == 1)
                    .values(version=s.acct_meta.c.version + 1)
                ).rowcount
                read = self._read_tree(conn) if moved else None
                if read is None:
                    raise Conflict(
                        "no account tree in the store yet: a controller imports its "
                        "configuration's [fairshare] when it first starts; try again then"
                    )
                old = read[0]
                if what == "add":
                    res = acct.add(old, kind, names, settings or {}, accounts=accounts)
                elif what == "modify":
                    res = acct.modify(old, kind, where or {}, settings or {})
                elif what == "delete":
                    res = acct.delete(old, kind, where or {}, keep=keep or {})
                else:
                    raise InvalidSpec(f"unknown change {what!r}: add, modify or delete")
                self._check_active(conn, old, res.tree)
                if not dry_run:
                    self._write_diff(conn, old, res.tree, actor, now)
                    if res.tree.declared != old.declared:
                        conn.execute(
                            update(s.acct_meta)
                            .where(s.acct_meta.c.id == 1)
                            .values(declared=res.tree.declared)
                        )
                    for c in res.changes:
                        self._event(
                            conn,
                            f"acct.{c.what}",
                            f"{c.text()} by {actor}",
                            actor=actor,
                            data={
                                "kind": c.kind,
                                "key": list(c.key),
                                "settings": dict(c.settings),
                            },
                        )
                if dry_run:
                    raise _DryRun(old.version - 1)  # read after the counter moved
                version = old.version
        except _DryRun as e:
            version = e.version
        except acct.AcctError as e:
            raise refusal(e) from None
        return {
            "changes": [c.as_dict() for c in res.changes],
            "skipped": res.skipped,
            "version": version,
            "dry_run": dry_run,
        }

    # ------------------------------------------------------------------ helpers
    def _check_active(self, conn: Connection, old: acct.Tree, new: acct.Tree) -> None:
        """Refuse to remove an account, association or QOS a pending or running job charges
        (Slurm: "Job(s) active, cancel job(s) before remove")."""
        gone_accts = [a for a in old.accounts if a not in new.accounts]
        gone_assocs = [k for k in old.assocs if k not in new.assocs]
        gone_qos = [q for q in old.qos if q not in new.qos]
        if not (gone_accts or gone_assocs or gone_qos):
            return
        active = s.jobs.c.state.in_(SUBMITTED)
        found: list[tuple[str, list[int]]] = []

        def ids(cond: Any) -> list[int]:
            q = select(s.jobs.c.id).where(active, cond).order_by(s.jobs.c.id).limit(11)
            return [int(r.id) for r in conn.execute(q)]

        if gone_accts:
            jobs = ids(s.jobs.c.account.in_(gone_accts))
            if jobs:
                found.append((f"account {', '.join(gone_accts)}", jobs))
        for account, user in gone_assocs:
            jobs = ids(and_(s.jobs.c.account == account, s.jobs.c.user == user))
            if jobs:
                found.append((f"user {user} in account {account}", jobs))
        if gone_qos:
            jobs = ids(s.jobs.c.qos.in_(gone_qos))
            if jobs:
                found.append((f"QOS {', '.join(gone_qos)}", jobs))
        if found:
            what, jobs = found[0]
            listed = ", ".join(map(str, jobs[:10])) + (" ..." if len(jobs) > 10 else "")
            raise Conflict(
                f"Job(s) active, cancel job(s) before remove: job{'s' if len(jobs) > 1 else ''} "
                f"{listed} of {what} {'are' if len(jobs) > 1 else 'is'} pending or running; "
                "cancel them (scancel) or wait for them to end, then delete again",
                jobs=jobs,
            )

    def _write_diff(
        self, conn: Connection, old: acct.Tree, new: acct.Tree, actor: str, now: float
    ) -> None:
        for kind, (table, keycols) in _TABLES.items():
            pair: dict[str, tuple[Mapping[Any, Any], Mapping[Any, Any]]] = {
                "account": (old.accounts, new.accounts),
                "user": (old.assocs, new.assocs),
                "qos": (old.qos, new.qos),
            }
            before, after = pair[kind]
            stamps = {"updated_by": actor, "updated_at": now}

            def where(key: Any, table: Table = table, keycols: tuple[str, ...] = keycols) -> Any:
                parts = key if isinstance(key, tuple) else (key,)
                return and_(*(table.c[c] == v for c, v in zip(keycols, parts, strict=True)))

            for key in before:
                if key not in after:
                    conn.execute(delete(table).where(where(key)))
            seq = int(conn.execute(select(func.coalesce(func.max(table.c.seq), 0))).scalar() or 0)
            for key, rec in after.items():
                row = acct.row_of(rec)
                if key not in before:
                    seq += 1
                    conn.execute(insert(table).values(**row, **stamps, seq=seq))
                elif before[key] != rec:
                    conn.execute(update(table).where(where(key)).values(**row, **stamps))
