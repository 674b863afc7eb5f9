"""Who may call which route: authentication, the one authorization table, rate limits.

Every route of the API is in `RULES`, keyed by (method, path template). A route that is not
there is refused (and `tests/api/test_access_table.py` walks the OpenAPI document to keep the
table complete). Rules:

* ``public``: no credential needed (health checks for load balancers, Prometheus metrics,
  the dashboard's static files: they hold no data, the page calls the API with a token).
* ``user``: any verified user, operator or admin (never an agent); routes that act on jobs
  also check ownership per job (`check_owner`): a user acts only on their own jobs,
  operators and admins on any.
* ``operator`` / ``admin``: that role or above.
* ``agent``: an agent credential, for the node named in the path only.

The decisions are pure functions (`decide`, `check_owner`, `TokenBuckets.take`); the FastAPI
dependency around them only reads the request and raises.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from phalanx.auth.tokens import Identity, Verifier
from phalanx.errors import Forbidden, RateLimited, Unauthenticated


@dataclass(frozen=True)
class Rule:
    level: str  # public | user | operator | admin | agent
    what: str  # the action, for refusals: "draining a node"
    owner: bool = False  # the handler checks ownership of each job it touches


PUBLIC, USER, OPERATOR, ADMIN, AGENT = "public", "user", "operator", "admin", "agent"

RULES: dict[tuple[str, str], Rule] = {
    ("GET", "/healthz"): Rule(PUBLIC, "reading health"),
    ("GET", "/healthz/live"): Rule(PUBLIC, "reading liveness"),
    ("GET", "/healthz/ready"): Rule(PUBLIC, "reading readiness"),
    ("GET", "/metrics"): Rule(PUBLIC, "reading metrics"),
    # the dashboard's static files (no data: the page calls the API with the user's token)
    ("GET", "/ui"): Rule(PUBLIC, "loading the dashboard"),
    ("GET", "/ui/{asset}"): Rule(PUBLIC, "loading the dashboard"),
    # the API's description: the OpenAPI document and its pages (controller/docs_ui.py)
    ("GET", "/v1/openapi.json"): Rule(PUBLIC, "reading the OpenAPI document"),
    ("GET", "/v1/docs"): Rule(PUBLIC, "reading the API documentation"),
    ("GET", "/v1/redoc"): Rule(PUBLIC, "reading the API documentation"),
    ("GET", "/v1/docs/assets/{name}"): Rule(PUBLIC, "loading the API documentation"),
    ("GET", "/v1/whoami"): Rule(USER, "asking who you are"),
    ("POST", "/v1/jobs"): Rule(USER, "submitting a job"),
    ("POST", "/v1/jobs/batch"): Rule(USER, "submitting jobs"),
    ("GET", "/v1/jobs"): Rule(USER, "listing jobs"),
    ("GET", "/v1/jobs/{ref}"): Rule(USER, "showing a job", owner=True),
    ("GET", "/v1/jobs/{ref}/events"): Rule(USER, "reading a job's events", owner=True),
    ("GET", "/v1/jobs/{ref}/output"): Rule(USER, "reading a job's output", owner=True),
    ("GET", "/v1/queue"): Rule(USER, "listing the queue"),
    ("GET", "/v1/jobs/{ref}/explain"): Rule(USER, "explaining a job", owner=True),
    ("POST", "/v1/jobs/cancel"): Rule(USER, "cancelling jobs", owner=True),
    ("POST", "/v1/jobs/signal"): Rule(USER, "signalling jobs", owner=True),
    ("POST", "/v1/jobs/hold"): Rule(USER, "holding jobs", owner=True),
    ("POST", "/v1/jobs/release"): Rule(USER, "releasing jobs", owner=True),
    ("POST", "/v1/jobs/{ref}/steps"): Rule(USER, "starting a job step (srun)", owner=True),
    ("GET", "/v1/jobs/{ref}/steps/{step_id}"): Rule(USER, "showing a job step", owner=True),
    ("POST", "/v1/jobs/{ref}/steps/signal"): Rule(USER, "signalling job steps", owner=True),
    ("GET", "/v1/jobs/{ref}/usage"): Rule(USER, "reading a job's live usage (sstat)", owner=True),
    ("POST", "/v1/jobs/{ref}/steps/cancel"): Rule(USER, "cancelling job steps", owner=True),
    ("POST", "/v1/jobs/{ref}/steps/{step_id}/wake"): Rule(
        USER, "waking the nodes of a job step (srun)", owner=True
    ),
    ("POST", "/v1/jobs/{ref}/steps/{step_id}/attach"): Rule(
        USER, "attaching to a job step's I/O (sattach)", owner=True
    ),
    # torchrun --rdzv-backend=phalanx: the job's own processes, as srun (rendezvous_api.py)
    ("GET", "/v1/jobs/{ref}/rendezvous/{run_id}/state"): Rule(
        USER, "reading a job's rendezvous (torchrun)", owner=True
    ),
    ("PUT", "/v1/jobs/{ref}/rendezvous/{run_id}/state"): Rule(
        USER, "writing a job's rendezvous (torchrun)", owner=True
    ),
    ("POST", "/v1/jobs/{ref}/rendezvous/{run_id}/kv"): Rule(
        USER, "using a job's rendezvous store (torchrun)", owner=True
    ),
    ("POST", "/v1/jobs/requeue"): Rule(USER, "requeueing jobs", owner=True),
    ("POST", "/v1/jobs/update"): Rule(USER, "changing jobs", owner=True),
    ("GET", "/v1/jobs/{ref}/priority"): Rule(USER, "reading a job's priority", owner=True),
    ("GET", "/v1/share"): Rule(USER, "reading fair share"),
    # accounts, users and QOS (sacctmgr; controller/fairshare_api.py)
    ("GET", "/v1/accounts"): Rule(USER, "listing accounts, users and QOS"),
    ("POST", "/v1/accounts/add"): Rule(ADMIN, "adding accounts, users or QOS"),
    ("POST", "/v1/accounts/modify"): Rule(ADMIN, "changing accounts, users or QOS"),
    ("POST", "/v1/accounts/delete"): Rule(ADMIN, "deleting accounts, users or QOS"),
    ("POST", "/v1/accounts/import"): Rule(ADMIN, "re-importing the accounts of [fairshare]"),
    ("GET", "/v1/nodes"): Rule(USER, "listing nodes"),
    ("GET", "/v1/nodes/{name}"): Rule(USER, "showing a node"),
    ("POST", "/v1/nodes/{name}/drain"): Rule(OPERATOR, "draining a node"),
    ("POST", "/v1/nodes/{name}/resume"): Rule(OPERATOR, "resuming a node"),
    ("GET", "/v1/cluster"): Rule(USER, "showing the cluster"),
    ("GET", "/v1/diag"): Rule(USER, "reading the scheduler's statistics (sdiag)"),
    ("GET", "/v1/report/usage"): Rule(USER, "reading cluster utilisation (sreport)"),
    ("GET", "/v1/licenses"): Rule(USER, "listing licences"),
    ("GET", "/v1/events"): Rule(OPERATOR, "reading the cluster's event log"),
    ("GET", "/v1/maintenance"): Rule(USER, "listing maintenance windows"),
    ("GET", "/v1/maintenance/{wid}"): Rule(USER, "showing a maintenance window"),
    ("POST", "/v1/maintenance"): Rule(OPERATOR, "adding a maintenance window"),
    ("DELETE", "/v1/maintenance/{wid}"): Rule(OPERATOR, "removing a maintenance window"),
    ("GET", "/v1/reservations"): Rule(USER, "listing reservations"),
    ("GET", "/v1/reservations/{name}"): Rule(USER, "showing a reservation"),
    ("POST", "/v1/reservations"): Rule(OPERATOR, "creating a reservation"),
    ("POST", "/v1/reservations/{name}/update"): Rule(OPERATOR, "changing a reservation"),
    ("DELETE", "/v1/reservations/{name}"): Rule(OPERATOR, "deleting a reservation"),
    ("POST", "/v1/tokens"): Rule(ADMIN, "creating tokens"),
    # the cluster configuration's versions (controller/config_api.py)
    ("GET", "/v1/config"): Rule(ADMIN, "showing the cluster configuration"),
    ("GET", "/v1/config/history"): Rule(ADMIN, "listing cluster configuration versions"),
    ("GET", "/v1/config/{version}"): Rule(ADMIN, "showing a cluster configuration version"),
    ("POST", "/v1/config/check"): Rule(ADMIN, "checking a cluster configuration"),
    ("POST", "/v1/config/apply"): Rule(ADMIN, "applying a cluster configuration"),
    ("POST", "/v1/config/rollback"): Rule(ADMIN, "rolling the cluster configuration back"),
    ("POST", "/v1/agents/{node}/register"): Rule(AGENT, "registering a node"),
    ("POST", "/v1/agents/{node}/heartbeat"): Rule(AGENT, "reporting for a node"),
}


def decide(rule: Rule | None, ident: Identity | None, path_params: dict[str, Any]) -> None:
    """Raise Unauthenticated/Forbidden unless `ident` may use a route with `rule`."""
    if rule is None:
        raise Forbidden("this route has no authorization rule, so nobody may call it")
    if rule.level == PUBLIC:
        return
    if ident is None:
        raise Unauthenticated("no credential", reason="missing")
    if rule.level == AGENT:
        if ident.role != AGENT:
            raise Forbidden(f"{rule.what} is for agents only; {ident.user} is a {ident.role}")
        node = path_params.get("node")
        if node != ident.node:
            raise Forbidden(
                f"the agent of {ident.node} may report only for its own node, not for {node}"
            )
        return
    if ident.role == AGENT:
        raise Forbidden(
            f"agent credentials ({ident.node}) may only register and report for their node, "
            f"not be used for {rule.what}"
        )
    if not ident.at_least(rule.level):
        raise Forbidden(f"{rule.what} needs the {rule.level} role; {ident.user} is a {ident.role}")


def may_see_all(ident: Identity) -> bool:
    return ident.at_least(OPERATOR)


def check_owner(ident: Identity, rows: Iterable[dict[str, Any]], what: str) -> None:
    """A user acts only on their own jobs; operators and admins on any (as in Slurm)."""
    if may_see_all(ident):
        return
    for row in rows:
        if row["user"] != ident.user:
            ref = row.get("job_id") or row["id"]
            raise Forbidden(
                f"job {ref} belongs to {row['user']}; {ident.user} may act only on their own "
                f"jobs ({what})",
                job=str(ref),
                owner=row["user"],
            )


def check_attach(ident: Identity, row: dict[str, Any]) -> None:
    """`sattach` (reading a step's output, writing to its stdin): the job's owner or an admin
    (root on a cluster host). Operators act on others' jobs but do not attach to them: Slurm's
    slurmstepd lets only the owner, root and SlurmUser attach."""
    if row["user"] == ident.user or ident.at_least(ADMIN):
        return
    ref = row.get("job_id") or row["id"]
    raise Forbidden(
        f"job {ref} belongs to {row['user']}; {ident.user} may not attach to its steps "
        "(sattach): only its owner and admins may",
        job=str(ref),
        owner=row["user"],
    )


# fields of `show` that only the owner (or an operator) sees when data is private
PRIVATE_FIELDS = (
    "command",
    "workdir",
    "submit_dir",
    "stdout",
    "stderr",
    "comment",
    "checkpoint",
    "checkpoint_spec",
    "progress",
)


def redact(view: dict[str, Any]) -> dict[str, Any]:
    """Another user's job as `show` gives it under private_data: no command, paths or env."""
    out = {k: v for k, v in view.items() if k not in PRIVATE_FIELDS}
    out["attempts"] = [
        {k: a.get(k) for k in ("id", "seq", "state", "start_time", "end_time", "nodes")}
        for a in view.get("attempts") or []
    ]
    out["private"] = True
    return out


# a node drained by Phalanx for launch failures: "N launch failures in a row, last: ERROR"
# (store._count_node_launch_failures), where ERROR may name the last job's files
_LAUNCH_ERROR = ", last: "
_PHALANX_DRAIN = "drained by phalanx: "


def redact_drain_reason(reason: str | None, drain_by: str | None) -> str | None:
    """A node's drain reason as a user reads it under private_data: the last launch error of
    a Phalanx drain left out (it is another user's job's, and may hold their paths)."""
    if drain_by == "phalanx" and reason and _LAUNCH_ERROR in reason:
        head = reason.split(_LAUNCH_ERROR, 1)[0]
        return f"{head} (the last error is shown to operators and to its job's owner)"
    return reason


def redact_event(event: dict[str, Any], owner: str | None, viewer: str) -> dict[str, Any]:
    """An event of a node's history as `viewer` (a user, under private_data) reads it: an
    event of another user's job keeps its time, kind, job and node, not its message or data
    (a checkpoint's path, a launch error); a Phalanx drain loses its launch error."""
    job = event.get("job_id")
    if job is not None and owner != viewer:
        whose = f"{owner}'s" if owner else "another user's"
        return {
            **event,
            "message": f"{event.get('kind')}: job {job} is {whose} (private: auth.private_data)",
            "data": None,
            "private": True,
        }
    message = str(event.get("message") or "")
    if event.get("kind") == "node.drain" and message.startswith(_PHALANX_DRAIN):
        cut = redact_drain_reason(message[len(_PHALANX_DRAIN) :], "phalanx")
        return {**event, "message": _PHALANX_DRAIN + str(cut), "data": None}
    return event


class TokenBuckets:
    """Per-key token buckets (rate, burst); thread-safe; `take` says how long to wait."""

    def __init__(self, rate: float, burst: float, max_keys: int = 100_000) -> None:
        self.rate = rate
        self.burst = burst
        self.max_keys = max_keys
        self._state: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def take(self, key: str, n: float = 1.0, now: float | None = None) -> float:
        """Take n tokens: 0.0 if granted, else the seconds until n would be available
        (nothing is taken then). Asking for more than the burst waits for a full bucket and
        then takes all n: the bucket goes into debt, so the next call waits until the rate has
        paid for the excess (a big batch is not a way around the limit)."""
        now = time.monotonic() if now is None else now
        need = min(n, self.burst)
        with self._lock:
            level, at = self._state.get(key, (self.burst, now))
            level = min(self.burst, level + (now - at) * self.rate)
            if level >= need:
                self._state[key] = (level - n, now)
                return 0.0
            if len(self._state) >= self.max_keys:
                self._state.clear()  # bounded memory under a flood of names: start afresh
            self._state[key] = (level, now)
            return (need - level) / self.rate


def throttle(
    buckets: TokenBuckets,
    ident: Identity,
    exempt: list[str],
    n: float,
    what: str,
    setting: str = "api",
) -> None:
    """Take `n` tokens of `ident`'s bucket, or raise RateLimited saying when to retry
    (`setting`: the limits.<setting>_rate/_burst pair the bucket is configured by)."""
    if ident.role == AGENT or ident.role in exempt:
        return
    wait = buckets.take(ident.user, n)
    if wait > 0:
        retry = max(1, math.ceil(wait))
        big = ""
        if n > buckets.burst:
            # never refused for good: it goes from a full bucket and leaves it in debt
            big = (
                f"; this request counts {n:g} (an array counts each task, a batch each job), "
                f"more than a whole burst: it is taken only when the bucket is full, and "
                f"leaves it empty for {math.ceil((n - buckets.burst) / buckets.rate)} s more. "
                f"To submit such requests without waiting, split them or ask an administrator "
                f"to raise limits.{setting}_burst"
            )
        raise RateLimited(
            f"{ident.user} is over the {what} rate limit ({buckets.rate:g}/s, bursts of "
            f"{buckets.burst:g}); retry in {retry} s{big}",
            retry_after=retry,
            cost=n,
        )


def bearer(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer ...` header (None if there is none)."""
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        raise Unauthenticated(
            "the Authorization header must be 'Bearer <token>'", reason="malformed"
        )
    return value.strip()


def authenticate(verifier: Verifier, header: str | None) -> Identity | None:
    token = bearer(header)
    return verifier.verify(token) if token is not None else None
