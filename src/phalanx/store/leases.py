"""Leases and the controllers' registry: who holds which single-owner duty, and who is alive.

A lease is granted, renewed and released on the database's clock (never the caller's), so a
controller whose own clock jumps cannot keep a duty it lost. The registry of controllers is
what `phalanx status` and the clients' URL lists read.
"""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import (
    insert,
    select,
    text,
    update,
)

from phalanx.store import schema as s
from phalanx.store.base import StoreBase
from phalanx.store.sqlbits import now as _now


class LeaseRecords(StoreBase):
    """Leases and the controllers' registry."""

    def acquire_lease(
        self, name: str, holder: str, ttl: float, *, after_expiry: float = 0.0
    ) -> int | None:
        """Take or keep the lease; return its term, or None if someone else holds it.

        `after_expiry`: take an expired lease only once it has been expired this long (lets
        the preferred holder go first without any coordination)."""
        now = self.db.db_now_sql()
        with self.db.begin(urgent=True) as conn:
            # a lease that never existed counts as expired just now, so that its preferred
            # holder gets the first chance at it
            if self.dialect == "postgresql":
                conn.execute(
                    text(
                        "INSERT INTO leases (name, holder, term, expires_at) "
                        f"VALUES (:n, NULL, 0, {now.text}) ON CONFLICT (name) DO NOTHING"
                    ),
                    {"n": name},
                )
            else:
                conn.execute(
                    text(
                        "INSERT OR IGNORE INTO leases (name, holder, term, expires_at) "
                        f"VALUES (:n, NULL, 0, {now.text})"
                    ),
                    {"n": name},
                )
            res = conn.execute(
                text(
                    f"UPDATE leases SET "
                    f"term = CASE WHEN holder = :me THEN term ELSE term + 1 END, "
                    f"holder = :me, expires_at = {now.text} + :ttl "
                    f"WHERE name = :n AND (holder = :me OR expires_at <= {now.text} - :slack)"
                ),
                {"n": name, "me": holder, "ttl": ttl, "slack": after_expiry},
            )
            if res.rowcount != 1:
                return None
            row = conn.execute(select(s.leases.c.term).where(s.leases.c.name == name)).one()
            return int(row.term)

    def renew_lease(self, name: str, holder: str, term: int, ttl: float) -> bool:
        now = self.db.db_now_sql()
        with self.db.begin(urgent=True) as conn:
            res = conn.execute(
                text(
                    f"UPDATE leases SET expires_at = {now.text} + :ttl "
                    "WHERE name = :n AND holder = :me AND term = :term"
                ),
                {"n": name, "me": holder, "term": term, "ttl": ttl},
            )
            return res.rowcount == 1

    def release_lease(self, name: str, holder: str, term: int) -> bool:
        with self.db.begin(urgent=True) as conn:
            res = conn.execute(
                update(s.leases)
                .where(
                    s.leases.c.name == name, s.leases.c.holder == holder, s.leases.c.term == term
                )
                .values(expires_at=0.0)
            )
            return res.rowcount == 1

    def get_lease(self, name: str) -> dict[str, Any] | None:
        with self.db.begin(write=False) as conn:
            row = conn.execute(select(s.leases).where(s.leases.c.name == name)).mappings().first()
            return dict(row) if row else None

    def list_leases(self) -> list[dict[str, Any]]:
        now = self.db.db_now_sql()
        with self.db.begin(write=False) as conn:
            db_now = conn.execute(select(now)).scalar_one()
            rows = conn.execute(select(s.leases).order_by(s.leases.c.name)).mappings().all()
            return [{**dict(r), "valid": r["expires_at"] > db_now} for r in rows]

    def register_controller(
        self, cid: str, url: str | None, local_settings: dict[str, Any] | None = None
    ) -> None:
        """`local_settings`: what its own file sets of the values the configuration's rules
        read across sections (config/versioned.py, local_part), for `config apply`'s checks."""
        now = _now()
        local = None if local_settings is None else json.dumps(local_settings, sort_keys=True)
        values = {
            "url": url,
            "started_at": now,
            "last_seen": now,
            "flushed_through": now,
            "local_settings": local,
        }
        with self.db.begin() as conn:
            res = conn.execute(
                update(s.controllers).where(s.controllers.c.id == cid).values(**values)
            )
            if res.rowcount == 0:
                # nothing heard yet, so nothing held back: its heartbeats are "stored" through
                # now (the failure detector's horizon, domain/detector.py)
                conn.execute(insert(s.controllers).values(id=cid, **values))
            self._event(conn, "controller.start", f"controller {cid} started at {url}")

    def touch_controller(self, cid: str) -> None:
        """Stamp a controller's last_seen with the database's clock (peers compare it).
        Urgent, like the lease writes: peers spread leases over the controllers seen lately."""
        with self.db.begin(urgent=True) as conn:
            now = conn.execute(select(self.db.db_now_sql())).scalar_one()
            conn.execute(
                update(s.controllers).where(s.controllers.c.id == cid).values(last_seen=now)
            )

    def live_controllers(self, within: float) -> list[str]:
        with self.db.begin(write=False) as conn:
            now = float(conn.execute(select(self.db.db_now_sql())).scalar_one())
            return [
                r.id
                for r in conn.execute(
                    select(s.controllers.c.id).where(s.controllers.c.last_seen >= now - within)
                )
            ]

    def controllers_seen(self, within: float) -> list[dict[str, Any]]:
        """The controllers seen within `within` seconds (database clock; one that takes no
        duties is not stamped, so not among them): id, config_version and local_settings
        (decoded; None when it did not publish them)."""
        with self.db.begin(write=False) as conn:
            now = float(conn.execute(select(self.db.db_now_sql())).scalar_one())
            rows = conn.execute(
                select(
                    s.controllers.c.id,
                    s.controllers.c.config_version,
                    s.controllers.c.local_settings,
                )
                .where(s.controllers.c.last_seen >= now - within)
                .order_by(s.controllers.c.id)
            ).mappings()
            return [
                {
                    "id": r["id"],
                    "config_version": r["config_version"],
                    "local_settings": _decoded(r["local_settings"]),
                }
                for r in rows
            ]

    def list_controllers(self) -> list[dict[str, Any]]:
        """Every controller's row but its local settings (`controllers_seen` has them)."""
        cols = [c for c in s.controllers.c if c.name != "local_settings"]
        with self.db.begin(write=False) as conn:
            return [
                dict(r) for r in conn.execute(select(*cols).order_by(s.controllers.c.id)).mappings()
            ]


def _decoded(text: str | None) -> dict[str, Any] | None:
    """A controller's published local settings; None when absent or unreadable."""
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
