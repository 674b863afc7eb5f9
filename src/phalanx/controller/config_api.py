"""The cluster configuration's versions over HTTP (`phalanx config`), admins only.

    GET  /v1/config                 the current version: document, TOML, who made it, and the
                                    version each controller runs
    GET  /v1/config/history         versions, newest first (no documents)
    GET  /v1/config/{version}       one version
    POST /v1/config/check           {text}: the document a TOML text describes, checked as
                                    apply would, and its diff against the current version;
                                    nothing is written (`phalanx config diff`)

A version is checked by every rule of loading with the serving controller's own file, and by
the rules that read a controller's own values (`timing.db_op_timeout`, `[watchdog]`) with each
other live controller's, which they publish when they register (confversions.validate).
    POST /v1/config/apply           {text, base_version, comment}: checked whole, then written
                                    as the next version with its partitions, or refused (422,
                                    naming every rule broken; 409 when base_version is no
                                    longer current); nothing half-applied
    POST /v1/config/rollback        {version, base_version, comment}: an older version's
                                    document applied again as the next version (checked the
                                    same way)

Every write is a row of `cluster_config` and a `config.*` event naming the admin and the keys
that changed (controller/confversions.py, store/configs.py).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Path
from pydantic import BaseModel, Field

from phalanx.auth.tokens import Identity
from phalanx.config.versioned import (
    changed_keys,
    document_from_toml,
    documents_equal,
    to_toml,
    unified_diff,
)
from phalanx.controller import confversions
from phalanx.controller.api_context import ApiContext, caller
from phalanx.domain.text import PlainText
from phalanx.errors import ConfigError, InvalidSpec, NotFound

MAX_TEXT = 1024 * 1024


class ConfigIn(BaseModel):
    text: str = Field(max_length=MAX_TEXT, description="a configuration file (TOML)")
    base_version: int | None = Field(
        default=None,
        ge=0,
        le=2**31 - 1,
        description="apply only if this is still the current version (what the diff was "
        "shown against)",
    )
    comment: PlainText | None = Field(default=None, max_length=1024)


class RollbackIn(BaseModel):
    version: int | None = Field(
        default=None,
        ge=1,
        le=2**31 - 1,
        description="the version to restore (default: the one before the current)",
    )
    base_version: int | None = Field(default=None, ge=0, le=2**31 - 1)
    comment: PlainText | None = Field(default=None, max_length=1024)


VERSION = Path(ge=1, le=2**31 - 1, description="a configuration version")


def version_view(row: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in row.items() if k != "document"}
    if "document" in row:
        out["document"] = row["document"]
        out["toml"] = to_toml(row["document"])
    return out


def router(api: ApiContext) -> APIRouter:
    ctl = api.ctl
    r = APIRouter()

    def current() -> dict[str, Any] | None:
        return ctl.store.config_current()

    def parse(text: str) -> tuple[dict[str, Any], list[str]]:
        try:
            return document_from_toml(text, "the given configuration", ctl.versions.local)
        except ConfigError as e:
            raise InvalidSpec(f"refused, nothing changed: {e.message}", field="text") from None

    def peers() -> list[dict[str, Any]]:
        """The other live controllers, with their own settings (the rules that read them)."""
        return [c for c in ctl.store.controllers_seen(ctl.timing.lease_ttl) if c["id"] != ctl.cid]

    def checked(
        doc: dict[str, Any], cur: dict[str, Any] | None, what: str, others: list[dict[str, Any]]
    ) -> None:
        confversions.validate(ctl.store, ctl.versions.local, doc, cur, what, others)

    def diff_of(cur: dict[str, Any] | None, doc: dict[str, Any], new_label: str) -> str:
        old_label = f"version {cur['version']}" if cur else "(none)"
        return unified_diff(cur["document"] if cur else None, doc, old_label, new_label)

    @r.get("/v1/config")
    def show() -> dict[str, Any]:
        cur = current()
        if cur is None:
            raise NotFound("the store holds no cluster configuration version yet")
        controllers = [
            {k: c.get(k) for k in ("id", "url", "last_seen", "config_version", "config_problem")}
            for c in ctl.store.list_controllers()
        ]
        return {**version_view(cur), "controllers": controllers}

    @r.get("/v1/config/history")
    def history() -> dict[str, Any]:
        return {"versions": ctl.store.config_history()}

    @r.get("/v1/config/{version}")
    def one(version: int = VERSION) -> dict[str, Any]:
        row = ctl.store.config_get(version)
        if row is None:
            raise NotFound(f"there is no cluster configuration version {version}")
        return version_view(row)

    @r.post("/v1/config/check")
    def check(body: ConfigIn) -> dict[str, Any]:
        doc, ignored = parse(body.text)
        cur = current()
        problems: list[str] = []
        others = peers()
        try:
            checked(doc, cur, "the given configuration", others)
        except InvalidSpec as e:
            problems.append(e.message)
        return {
            "current_version": cur["version"] if cur else None,
            "document": doc,
            "toml": to_toml(doc),
            "diff": diff_of(cur, doc, "the given file"),
            "changed": changed_keys(cur["document"] if cur else None, doc),
            "ignored": ignored,
            "problems": problems,
            # checked against every live controller's own settings but these (an older
            # release publishes none)
            "unchecked_controllers": confversions.unchecked_peers(others),
        }

    def write(
        doc: dict[str, Any],
        cur: dict[str, Any] | None,
        *,
        ident: Identity,
        action: str,
        base: int | None,
        comment: str | None,
        source: int | None = None,
    ) -> dict[str, Any]:
        nxt = (cur["version"] + 1) if cur else 1
        new = confversions.validate(
            ctl.store, ctl.versions.local, doc, cur, f"cluster configuration version {nxt}", peers()
        )
        changed = changed_keys(cur["document"] if cur else None, doc)
        what = f"rolled back to version {source}'s document" if source else "applied"
        message = f"{what}; changed: {', '.join(changed) or 'nothing'}" + (
            f" ({comment})" if comment else ""
        )
        version = ctl.store.config_put(
            doc,
            actor=ident.actor,
            action=action,
            base_version=base if base is not None else (cur["version"] if cur else None),
            partitions=confversions.partition_rows(new),
            message=message,
            comment=comment,
            source=source,
        )
        ctl.versions.move()  # this controller at once; the others within one presence tick
        return {
            "version": version,
            "changed": changed,
            "diff": diff_of(cur, doc, f"version {version}"),
        }

    @r.post("/v1/config/apply")
    def apply(body: ConfigIn, ident: Identity = Depends(caller)) -> dict[str, Any]:
        doc, ignored = parse(body.text)
        cur = current()
        if cur is not None and documents_equal(cur["document"], doc):
            return {"version": cur["version"], "changed": [], "diff": "", "ignored": ignored}
        out = write(
            doc, cur, ident=ident, action="apply", base=body.base_version, comment=body.comment
        )
        return {**out, "ignored": ignored}

    @r.post("/v1/config/rollback")
    def rollback(body: RollbackIn, ident: Identity = Depends(caller)) -> dict[str, Any]:
        cur = current()
        if cur is None:
            raise NotFound("the store holds no cluster configuration version yet")
        target = body.version
        if target is None:
            target = cur["parent"] if cur.get("parent") else cur["version"] - 1
        if target < 1 or target == cur["version"]:
            raise InvalidSpec(
                f"version {target} is the current version; name an older one "
                "(phalanx config history)",
                field="version",
            )
        old = ctl.store.config_get(target)
        if old is None:
            raise NotFound(f"there is no cluster configuration version {target}")
        if documents_equal(cur["document"], old["document"]):
            return {"version": cur["version"], "changed": [], "diff": "", "restored": target}
        out = write(
            old["document"],
            cur,
            ident=ident,
            action="rollback",
            base=body.base_version,
            comment=body.comment,
            source=target,
        )
        return {**out, "restored": target}

    return r
