"""The torchrun rendezvous the controllers host: /v1/jobs/{ref}/rendezvous/{run_id}/...

`torchrun --rdzv-backend=phalanx` (phalanx/rendezvous.py) keeps torch's rendezvous state and
the round's key-value store here (store/rendezvous.py), so that the rendezvous survives the
loss of any one node of the job, the node that started it included. The job's processes call
these routes as srun in a job does (its node's local credential, the job's owner), failing
over between the controllers listed in $PHALANX_URL:

* ``GET .../state``: the state (base64) and its token, or nulls; ``departed``: the members
  on nodes that left the job (a --no-kill job's regroup), which the caller drops at once
  instead of waiting for their keep-alive to lapse;
* ``PUT .../state``: compare-and-set on the token (null: only if there is none yet); the
  reply is the state now, its token and whether this call set it (torch's `set_state`).
  Repeating it changes nothing once it was applied (the token has moved on), so a client
  may send it again to another controller when an answer is lost;
* ``POST .../kv``: one operation of torch's `Store` on the round's keys: set, get (the keys
  that exist; the client waits for the others itself), add, delete, count.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from phalanx.auth.tokens import Identity
from phalanx.controller.api_context import ApiContext, caller
from phalanx.errors import InvalidSpec
from phalanx.store.rendezvous import KV_PREFIX, STATE_KEY

MAX_VALUE = 4 * 1024 * 1024  # bytes of one value (a state of thousands of nodes is ~1 MB)
MAX_KEYS = 4096  # keys of one kv call (torch's multi_get of a large world)
RUN_ID = r"^[A-Za-z0-9_.:@+-]{1,128}$"
Key = Annotated[str, Field(min_length=1, max_length=500)]
B64 = Annotated[str, Field(max_length=(MAX_VALUE * 4) // 3 + 4)]


class StateIn(BaseModel):
    state: B64 = Field(description="torch's rendezvous state, base64")
    token: int | None = Field(default=None, ge=0, le=2**31, description="null: only if none")
    desc: str | None = Field(default=None, max_length=300, description="the writer's node desc")
    node: str | None = Field(default=None, max_length=128, description="the writer's node")


class KvIn(BaseModel):
    op: Literal["set", "get", "add", "delete", "count"]
    keys: list[Key] = Field(default_factory=list, max_length=MAX_KEYS)
    values: list[B64] = Field(default_factory=list, max_length=MAX_KEYS)
    delta: int = Field(default=0, ge=-(2**62), le=2**62)


def _b64(text: str) -> bytes:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidSpec("a rendezvous value must be base64") from None
    if len(raw) > MAX_VALUE:
        raise InvalidSpec(f"a rendezvous value may hold at most {MAX_VALUE} bytes")
    return raw


def _text(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _run_id(run_id: str) -> str:
    if not re.match(RUN_ID, run_id):
        raise InvalidSpec(
            "a rendezvous id (torchrun --rdzv-id) is 1-128 letters, digits and _.:@+-"
        )
    return run_id


def router(api: ApiContext) -> APIRouter:
    """The /v1/jobs/{ref}/rendezvous routes."""
    store = api.ctl.store
    r = APIRouter()

    @r.get("/v1/jobs/{ref}/rendezvous/{run_id}/state")
    def get_state(ref: str, run_id: str, ident: Identity = Depends(caller)) -> dict[str, Any]:
        jid = int(api.own_job(ref, ident, "rendezvous")["id"])
        got = store.rdzv_get(jid, _run_id(run_id), [STATE_KEY], departed=True)
        value = got.values.get(STATE_KEY)
        return {
            "state": _text(value[0]) if value else None,
            "token": value[1] if value else None,
            "departed": got.departed,
        }

    @r.put("/v1/jobs/{ref}/rendezvous/{run_id}/state")
    def set_state(
        ref: str, run_id: str, body: StateIn, ident: Identity = Depends(caller)
    ) -> dict[str, Any]:
        jid = int(api.own_job(ref, ident, "rendezvous")["id"])
        member = (body.desc, body.node) if body.desc and body.node else None
        value, token, done, departed = store.rdzv_cas(
            jid, _run_id(run_id), STATE_KEY, _b64(body.state), body.token, member=member
        )
        return {
            "state": _text(value) if token else None,
            "token": token or None,
            "set": done,
            "departed": departed,
        }

    @r.post("/v1/jobs/{ref}/rendezvous/{run_id}/kv")
    def kv(ref: str, run_id: str, body: KvIn, ident: Identity = Depends(caller)) -> dict[str, Any]:
        jid = int(api.own_job(ref, ident, "rendezvous")["id"])
        rid = _run_id(run_id)
        keys = [KV_PREFIX + k for k in body.keys]
        if body.op == "set":
            if len(body.values) != len(keys) or not keys:
                raise InvalidSpec("set takes as many values as keys, at least one")
            store.rdzv_set(jid, rid, dict(zip(keys, (_b64(v) for v in body.values), strict=True)))
            return {"ok": True}
        if body.op == "get":
            got = store.rdzv_get(jid, rid, keys)
            return {
                "values": {k[len(KV_PREFIX) :]: _text(v) for k, (v, _version) in got.values.items()}
            }
        if body.op == "add":
            if len(keys) != 1:
                raise InvalidSpec("add takes one key")
            return {"value": store.rdzv_add(jid, rid, keys[0], body.delta)}
        if body.op == "delete":
            if len(keys) != 1:
                raise InvalidSpec("delete takes one key")
            return {"deleted": store.rdzv_delete(jid, rid, keys[0])}
        return {"count": store.rdzv_count(jid, rid, KV_PREFIX)}

    return r
