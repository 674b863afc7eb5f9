"""The cluster configuration's versions (`cluster_config`, migration 0020) and each
controller's report of the version it runs.

A version is written once and never changed: `config_put` adds the next one (an apply, or a
rollback, which is an older document applied again, so every change is a row and an event),
with the `partitions` table made to match it in the same transaction; `config_first` makes
version 1 from a controller's file when the store has none. `controller_presence` is the
presence loop's one transaction: it stamps the controller's `last_seen` (unless it takes no
duties), records the version it runs or why it cannot, and returns the current version, so
that reading it each loop costs no extra round trip. Documents are stored as JSON text in
their own key order (config/versioned.py shows them as TOML in that order).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, func, insert, select, update
from sqlalchemy.exc import IntegrityError

from phalanx.domain.states import TERMINAL
from phalanx.errors import Conflict
from phalanx.store import schema as s
from phalanx.store.base import StoreBase
from phalanx.store.prebuilt import Prebuilt
from phalanx.store.sqlbits import now as _now

_META = (
    s.cluster_config.c.version,
    s.cluster_config.c.created_at,
    s.cluster_config.c.actor,
    s.cluster_config.c.action,
    s.cluster_config.c.parent,
    s.cluster_config.c.source,
    s.cluster_config.c.comment,
)


def _row(r: Any, with_document: bool = True) -> dict[str, Any]:
    out = {k: r[k] for k in ("version", "created_at", "actor", "action", "parent", "source")}
    out["comment"] = r["comment"]
    if with_document:
        out["document"] = json.loads(r["document"])
    return out


def latest_config_version(conn: Connection) -> int | None:
    """The current cluster configuration version (the highest), in `conn`'s transaction."""
    v = _LATEST_VERSION.one(conn, {})["version"]
    return None if v is None else int(v)


# read by every scheduling pass (store/scheduling.py): built once, run through the driver
_LATEST_VERSION = Prebuilt(select(func.max(s.cluster_config.c.version).label("version")))


def _sync_partitions(conn: Connection, parts: Sequence[dict[str, Any]]) -> None:
    """The partitions table made to match a version's partitions (as Submission's
    sync_partitions does, inside the version's own transaction)."""
    existing = {r.name for r in conn.execute(select(s.partitions.c.name))}
    for p in parts:
        if p["name"] in existing:
            conn.execute(update(s.partitions).where(s.partitions.c.name == p["name"]).values(**p))
        else:
            conn.execute(insert(s.partitions).values(**p))
    gone = existing - {p["name"] for p in parts}
    if gone:
        conn.execute(s.partitions.delete().where(s.partitions.c.name.in_(sorted(gone))))


class ConfigRecords(StoreBase):
    """Versions of the cluster configuration, and which one each controller runs."""

    def config_current(self) -> dict[str, Any] | None:
        """The version in force (the highest), with its document; None: the store has none."""
        with self.db.begin(write=False) as conn:
            r = (
                conn.execute(
                    select(s.cluster_config).order_by(s.cluster_config.c.version.desc()).limit(1)
                )
                .mappings()
                .first()
            )
            return None if r is None else _row(r)

    def config_get(self, version: int) -> dict[str, Any] | None:
        with self.db.begin(write=False) as conn:
            r = (
                conn.execute(select(s.cluster_config).where(s.cluster_config.c.version == version))
                .mappings()
                .first()
            )
            return None if r is None else _row(r)

    def config_history(self, limit: int = 100) -> list[dict[str, Any]]:
        """Versions, newest first, without their documents."""
        with self.db.begin(write=False) as conn:
            rows = conn.execute(
                select(*_META).order_by(s.cluster_config.c.version.desc()).limit(limit)
            ).mappings()
            return [_row(r, with_document=False) for r in rows]

    def config_first(
        self, document: dict[str, Any], *, actor: str, partitions: Sequence[dict[str, Any]]
    ) -> dict[str, Any]:
        """Version 1 from `document` if the store has no version yet; return the version in
        force (this one, or the one another controller made first)."""
        try:
            with self.db.begin() as conn:
                if latest_config_version(conn) is None:
                    conn.execute(
                        insert(s.cluster_config).values(
                            version=1,
                            document=json.dumps(document),
                            created_at=_now(),
                            actor=actor,
                            action="create",
                            comment="created from the configuration file of the first "
                            "controller to start",
                        )
                    )
                    _sync_partitions(conn, partitions)
                    self._event(
                        conn,
                        "config.create",
                        f"cluster configuration version 1 created from {actor}'s file",
                        actor=actor,
                        data={"version": 1},
                    )
        except IntegrityError:
            pass  # another controller made version 1 at the same moment: theirs stands
        current = self.config_current()
        assert current is not None
        return current

    def config_put(
        self,
        document: dict[str, Any],
        *,
        actor: str,
        action: str,
        base_version: int | None,
        partitions: Sequence[dict[str, Any]],
        message: str,
        comment: str | None = None,
        source: int | None = None,
    ) -> int:
        """Add the next version (an apply or a rollback) and make the partitions match it,
        in one transaction, with a `config.<action>` event carrying `message`. Refused
        (Conflict) when `base_version` is given and is no longer the current version:
        someone applied another version after the caller looked."""
        try:
            with self.db.begin() as conn:
                latest = latest_config_version(conn)
                if base_version is not None and latest != base_version:
                    raise Conflict(
                        f"the cluster configuration changed meanwhile: version {latest} is "
                        f"current, not {base_version}; look at the difference again "
                        "(phalanx config diff FILE) and apply once more"
                    )
                version = (latest or 0) + 1
                conn.execute(
                    insert(s.cluster_config).values(
                        version=version,
                        document=json.dumps(document),
                        created_at=_now(),
                        actor=actor,
                        action=action,
                        parent=latest,
                        source=source,
                        comment=comment,
                    )
                )
                _sync_partitions(conn, partitions)
                self._event(
                    conn,
                    f"config.{action}",
                    f"{actor}: cluster configuration version {version}: {message}",
                    actor=actor,
                    data={"version": version, "parent": latest, "source": source},
                )
                return version
        except IntegrityError:
            raise Conflict(
                "another cluster configuration version was applied at the same moment; look "
                "at the difference again (phalanx config diff FILE) and apply once more"
            ) from None

    def controller_presence(
        self, cid: str, *, config_version: int | None, problem: str | None, seen: bool = True
    ) -> int | None:
        """Stamp the controller's `last_seen` (database clock; not when `seen` is False: a
        controller that takes no duties is left out of the lease spread), record the version
        it runs and its problem, and return the current version (None: no version yet).
        Urgent, like the lease writes."""
        with self.db.begin(urgent=True) as conn:
            values: dict[str, Any] = {"config_version": config_version, "config_problem": problem}
            if seen:
                values["last_seen"] = conn.execute(select(self.db.db_now_sql())).scalar_one()
            conn.execute(update(s.controllers).where(s.controllers.c.id == cid).values(**values))
            return latest_config_version(conn)

    def config_live_facts(self) -> dict[str, Any]:
        """What a new version is checked against (config/versioned.cross_check): the node
        names, and the jobs not yet ended by the first partition they list."""
        ended = [st.value for st in TERMINAL]
        with self.db.begin(write=False) as conn:
            nodes = [r.name for r in conn.execute(select(s.nodes.c.name))]
            active: dict[str, int] = {}
            for r in conn.execute(
                select(s.jobs.c.partitions, func.count().label("n"))
                .where(s.jobs.c.state.not_in(ended))
                .group_by(s.jobs.c.partitions)
            ):
                first = str(r.partitions).split(",")[0]
                active[first] = active.get(first, 0) + int(r.n)
        return {"nodes": nodes, "active_by_partition": active}
