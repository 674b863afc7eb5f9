"""REST endpoints for fair share and priority, included by `api.create_app`.

GET /v1/share              the account tree as `sshare` shows it (every association)
GET /v1/jobs/{ref}/priority  a pending job's priority factor by factor (`sprio`), with the
                             arithmetic written out; the job's owner, operators and admins

Accounts, user associations and QOS (`sacctmgr`; domain/accounts.py, store/accounts.py):

GET  /v1/accounts            the tree: accounts, users (associations), QOS, the change counter
POST /v1/accounts/add        {kind, names, accounts (users), settings, dry_run}      (admins)
POST /v1/accounts/modify     {kind, where, settings, dry_run}                        (admins)
POST /v1/accounts/delete     {kind, where, dry_run}                                  (admins)
POST /v1/accounts/import     {replace}: the controller's [fairshare] again           (admins)

`kind`: account, user or qos; `where`: {names, accounts (users), parents (accounts)}, each a
list; `settings`: parent, shares, description, organization, default_account, priority,
priority_tier, preempt_mode and the limits max_running_jobs, max_submit_jobs, max_gpus,
max_wall_s (null or -1 clears a limit). A change is checked whole, applied in one
transaction, recorded as an `acct.*` event with its actor, and seen by every controller within
one scheduling loop. Refusals: 422 a value, 409 a clash (exists, in use), 404 nothing matched.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from phalanx.controller import access
from phalanx.domain import accounts as accts
from phalanx.errors import NotFound

Names = list[Annotated[str, Field(min_length=1, max_length=128)]]
Value = int | str | None


class AcctWhere(BaseModel):
    names: Names | None = Field(default=None, max_length=10_000)
    accounts: Names | None = Field(default=None, max_length=10_000)
    parents: Names | None = Field(default=None, max_length=10_000)

    def given(self) -> dict[str, list[str]]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


class AcctChange(BaseModel):
    kind: Literal["account", "user", "qos"]
    names: Names = Field(default_factory=list, max_length=10_000)
    accounts: Names = Field(default_factory=list, max_length=10_000)
    where: AcctWhere = Field(default_factory=AcctWhere)
    settings: dict[Annotated[str, Field(max_length=64)], Value] = Field(
        default_factory=dict, max_length=32
    )
    dry_run: bool = False


class AcctImport(BaseModel):
    replace: bool = True


def accounts_view(ctl: Any) -> dict[str, Any]:
    """`GET /v1/accounts`: the store's tree as every controller uses it."""
    fs = ctl.fairshare
    tree = fs.view(max_age=0.0).tree
    return {
        "version": tree.version,
        "declared": tree.declared,
        "cluster": ctl.config.cluster.name,
        "default_account": fs.cfg.default_account,
        "default_qos": fs.cfg.default_qos,
        "open": fs.cfg.open,
        "accounts": [accts.row_of(a) for a in tree.accounts.values()],
        "users": [accts.row_of(a) for a in tree.assocs.values()],
        "qos": [accts.row_of(q) for q in tree.qos.values()],
    }


def router(ctl: Any) -> APIRouter:
    """The endpoints, bound to a controller (`runtime.Controller`)."""
    r = APIRouter()

    @r.get("/v1/share")
    def share() -> dict[str, Any]:
        rows: dict[str, Any] = ctl.fairshare.share_rows()
        return rows

    @r.get("/v1/jobs/{ref}/priority")
    def job_priority(ref: str, request: Request) -> dict[str, Any]:
        ids = ctl.store.resolve_refs([ref])
        if not ids:
            raise NotFound(f"job {ref} does not exist", job=ref)
        rows = [ctl.store.get_job(jid) for jid in ids]
        access.check_owner(request.state.identity, rows, "reading a job's priority")
        snap = SimpleNamespace(
            nodes=ctl.store.list_nodes(), partitions=ctl.store.partitions(), pending=rows
        )
        out = []
        for row in rows:
            b = ctl.fairshare.job_breakdown(row, snap).as_dict()
            b.update(
                job_id=row["id"],
                user=row["user"],
                account=row.get("account") or ctl.fairshare.cfg.default_account,
                qos=row.get("qos") or ctl.fairshare.cfg.default_qos,
                state=row["state"],
            )
            out.append(b)
        return {"jobs": out}

    def change(what: str, body: AcctChange, request: Request) -> dict[str, Any]:
        fs = ctl.fairshare
        fs.view()  # the first import, on a store that has no tree yet
        out: dict[str, Any] = ctl.store.change_accounts(
            what,
            body.kind,
            names=body.names,
            accounts=body.accounts,
            where=body.where.given(),
            settings=body.settings,
            keep={"account": fs.cfg.default_account, "qos": fs.cfg.default_qos},
            actor=request.state.identity.actor,
            dry_run=body.dry_run,
        )
        if not body.dry_run:
            fs.changed()
            ctl.kick()  # pending jobs may fit (or not) under the new tree
        return out

    @r.get("/v1/accounts")
    def list_accounts() -> dict[str, Any]:
        return accounts_view(ctl)

    @r.post("/v1/accounts/add")
    def add_accounts(body: AcctChange, request: Request) -> dict[str, Any]:
        return change("add", body, request)

    @r.post("/v1/accounts/modify")
    def modify_accounts(body: AcctChange, request: Request) -> dict[str, Any]:
        return change("modify", body, request)

    @r.post("/v1/accounts/delete")
    def delete_accounts(body: AcctChange, request: Request) -> dict[str, Any]:
        return change("delete", body, request)

    @r.post("/v1/accounts/import")
    def import_accounts(body: AcctImport, request: Request) -> dict[str, Any]:
        """Replace the store's tree with this controller's configuration's [fairshare]."""
        fs = ctl.fairshare
        fs.view()
        tree = accts.from_config(fs.cfg)
        actor = request.state.identity.actor
        done = ctl.store.import_accounts(
            tree, actor, replace=body.replace, source=f"[fairshare] of {ctl.cid}'s file"
        )
        fs.changed()
        ctl.kick()
        return {"imported": done, **accounts_view(ctl)}

    return r
