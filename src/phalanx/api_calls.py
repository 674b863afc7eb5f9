"""The controller's API calls, one method each, over a client's `get`, `post` and `delete`.

Shared by the full client (`phalanx.client.Client`, httpx) and the standard-library one
(`phalanx.lean_client.LeanClient`) that the one-shot commands use (`srun`, and the Slurm
commands: `squeue` in a loop pays its start-up on every call, and httpx's import alone was
half of it): one definition of each call, whichever transport carries it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

from phalanx.errors import InvalidSpec


class ApiCalls:
    """The API's calls; the class it is mixed into sends them."""

    def get(self, path: str, **params: Any) -> Any:
        raise NotImplementedError

    def post(
        self, path: str, body: Any = None, *, idempotent: bool = False, timeout: float | None = None
    ) -> Any:
        raise NotImplementedError

    def delete(self, path: str) -> Any:
        raise NotImplementedError

    def submit(self, spec: dict[str, Any], *, test_only: bool = False) -> dict[str, Any]:
        """Submit a job; `test_only` validates it fully on the controller and stores nothing."""
        if test_only:
            return self.post("/v1/jobs?test_only=true", spec)
        return self.post("/v1/jobs", spec)

    def submit_batch(self, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return self.post("/v1/jobs/batch", {"jobs": specs})["jobs"]

    def jobs(self, **filters: Any) -> list[dict[str, Any]]:
        return self.get("/v1/jobs", **filters)["jobs"]

    def job(self, ref: str | int) -> list[dict[str, Any]]:
        return self.get(f"/v1/jobs/{seg(ref, 'job id')}")["jobs"]

    def cancel(self, refs: Sequence[str | int], reason: str | None = None) -> dict[str, str]:
        return self.post("/v1/jobs/cancel", {"jobs": [str(r) for r in refs], "reason": reason})[
            "results"
        ]

    def signal(
        self, refs: Sequence[str | int], signum: int, target: str = "steps"
    ) -> dict[str, str]:
        """Signal running jobs without ending them (scancel --signal). `target`: "steps" (the
        job's steps), "batch" (the batch shell only) or "full" (batch shell, children, steps).
        Results per job: signalled, pending, done or not found."""
        body = {"jobs": [str(r) for r in refs], "signal": int(signum), "target": target}
        return self.post("/v1/jobs/signal", body)["results"]

    def hold(self, refs: Sequence[str | int]) -> dict[str, str]:
        return self.post("/v1/jobs/hold", {"jobs": [str(r) for r in refs]})["results"]

    def release(self, refs: Sequence[str | int]) -> dict[str, str]:
        return self.post("/v1/jobs/release", {"jobs": [str(r) for r in refs]})["results"]

    def requeue(self, refs: Sequence[str | int], *, hold: bool = False) -> dict[str, str]:
        """Requeue jobs (scontrol requeue; `hold`: requeuehold). Per job: "requeued",
        "requeued and held", "held", or why not."""
        return self.post("/v1/jobs/requeue", {"jobs": [str(r) for r in refs], "hold": hold})[
            "results"
        ]

    def update_jobs(self, refs: Sequence[str | int], **changes: Any) -> dict[str, str]:
        """Change pending jobs: time_limit (text), nodes, partition, dependency (text)."""
        body = {"jobs": [str(r) for r in refs], **changes}
        return self.post("/v1/jobs/update", body)["results"]

    def explain(self, ref: str | int) -> dict[str, Any]:
        """Why a job waits or ended: {"job", "state", "summary", "lines"} (docs/explain.md)."""
        return self.get(f"/v1/jobs/{seg(ref, 'job id')}/explain")

    def job_events(self, ref: str | int) -> list[dict[str, Any]]:
        return self.get(f"/v1/jobs/{seg(ref, 'job id')}/events")["events"]

    def events(self, since: int = 0, limit: int = 1000) -> list[dict[str, Any]]:
        return self.get("/v1/events", since=since, limit=limit)["events"]

    def nodes(self) -> list[dict[str, Any]]:
        return self.get("/v1/nodes")["nodes"]

    def node(self, name: str) -> dict[str, Any]:
        return self.get(f"/v1/nodes/{seg(name, 'node name')}")

    def drain(self, name: str, reason: str, *, now: bool = False) -> dict[str, Any]:
        return self.post(
            f"/v1/nodes/{seg(name, 'node name')}/drain", {"reason": reason, "now": now}
        )

    def resume(self, name: str) -> dict[str, Any]:
        return self.post(f"/v1/nodes/{seg(name, 'node name')}/resume")

    def cluster(self) -> dict[str, Any]:
        return self.get("/v1/cluster")

    def licenses(self) -> list[dict[str, Any]]:
        """The cluster's licences: name, total, used, free."""
        return self.get("/v1/licenses")["licenses"]

    def health(self) -> dict[str, Any]:
        return self.get("/healthz")

    # maintenance windows (start/end: epoch seconds or text; duration: seconds or text)
    def add_maintenance(
        self,
        nodes: str,
        start: float | str,
        *,
        duration: float | str | None = None,
        end: float | str | None = None,
        reason: str | None = None,
    ) -> dict[str, Any]:
        body = {"nodes": nodes, "start": start, "duration": duration, "end": end, "reason": reason}
        res = self.post("/v1/maintenance", body)
        return {**res["window"], "warnings": res.get("warnings", [])}

    def maintenance(self, *, all: bool = False) -> list[dict[str, Any]]:
        return self.get("/v1/maintenance", all="true" if all else None)["windows"]

    def remove_maintenance(self, wid: int) -> dict[str, Any]:
        return self.delete(f"/v1/maintenance/{seg(wid, 'maintenance window id')}")

    # reservations (times: epoch seconds or text; duration: seconds or text)
    def create_reservation(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.post("/v1/reservations", body)["reservation"]

    def update_reservation(self, name: str, changes: dict[str, Any]) -> dict[str, Any]:
        path = f"/v1/reservations/{seg(name, 'reservation name')}/update"
        return self.post(path, changes)["reservation"]

    def delete_reservation(self, name: str) -> dict[str, Any]:
        return self.delete(f"/v1/reservations/{seg(name, 'reservation name')}")["reservation"]

    def reservations(self) -> list[dict[str, Any]]:
        return self.get("/v1/reservations")["reservations"]

    def reservation(self, name: str) -> dict[str, Any]:
        return self.get(f"/v1/reservations/{seg(name, 'reservation name')}")["reservation"]


def seg(value: str | int, what: str) -> str:
    """One path segment from a user's value: quoted (a `/` or `?` in a job id or node name
    never reaches another route), and never empty (`/v1/jobs/` is the job list)."""
    text = str(value).strip()
    if not text:
        raise InvalidSpec(f"the {what} is empty: give one, e.g. `phalanx show 12`", field=what)
    return quote(text, safe="")
