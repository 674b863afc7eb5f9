"""Job steps (srun inside a job): create one, wake its nodes, show, signal and cancel."""

from __future__ import annotations

import os
from typing import Any

from fastapi import APIRouter, Depends

from phalanx.auth.attachcred import attach_token
from phalanx.auth.tokens import Identity
from phalanx.controller import access, taskusage
from phalanx.controller.api_context import ApiContext, caller
from phalanx.controller.api_models import StepCancelIn, StepIn, StepSignalIn, StepWakeIn
from phalanx.controller.launch import job_layout
from phalanx.domain.steps import StepRequest
from phalanx.errors import InvalidSpec


def router(api: ApiContext) -> APIRouter:
    """The /v1/jobs/{ref}/steps routes."""
    ctl = api.ctl
    r = APIRouter()

    @r.post("/v1/jobs/{ref}/steps", status_code=201)
    def create_step(ref: str, body: StepIn, ident: Identity = Depends(caller)) -> dict[str, Any]:
        row = api.own_job(ref, ident, "srun")
        req = StepRequest(
            nodes=body.nodes,
            ntasks=body.ntasks,
            ntasks_per_node=body.ntasks_per_node,
            cpus_per_task=body.cpus_per_task,
            gpus_per_task=body.gpus_per_task,
            gpus_per_node=body.gpus_per_node,
            nodelist=tuple(body.nodelist),
            job_ntasks_per_node=tuple(job_layout(row["spec"], len(row["nodelist_run"] or [None]))),
        )
        spec = {
            "argv": body.argv,
            "env": body.env,
            "cwd": body.cwd,
            "cpus_per_task": body.cpus_per_task,
            "output": body.output,
            "error": body.error,
            "label": body.label,
            "open_mode": body.open_mode,
            "io": {
                "host": body.host,
                "port": body.port,
                "cookie": body.cookie,
                "stdout": body.output is None,
                "stderr": body.error is None,
                **({"pty": True} if body.pty else {}),
                **({"stdin": True} if body.stdin and body.output is None else {}),
            },
        }
        if body.pmi_port is not None:
            spec["pmi"] = {"port": body.pmi_port, "id_base": body.pmi_id_base}
        name = body.name or os.path.basename(body.argv[0])
        direct = body.direct and ctl.config.steps.direct
        step = ctl.store.create_step(
            int(row["id"]), req, spec, name, ident.actor, launch_rows=direct
        )
        gens: dict[str, int] = step.pop("work_gens")
        rows = step.pop("launch_rows")
        if direct:
            # srun hands the launches over itself (Slurm's model): no long-poll is woken for
            # them, and the nodes whose agents have told no address yet are woken now
            step["launch"], unknown = ctl.direct_launches(rows, api.keys.signing)
            step["push_timeout"] = ctl.config.steps.push_timeout
            ctl.seen_gens(gens)
            if unknown:
                ctl.woke({n: gens[n] for n in unknown if n in gens})
        else:
            # this controller's long-polling agents start it at once (SQLite has no NOTIFY,
            # and the work_gen poll would cost up to GEN_POLL per step); the poll is told, so
            # it does not wake them a second time for the same step
            ctl.woke(gens)
        return step

    @r.post("/v1/jobs/{ref}/steps/{step_id}/wake")
    def wake_step_nodes(
        ref: str, step_id: int, body: StepWakeIn, ident: Identity = Depends(caller)
    ) -> dict[str, Any]:
        """The nodes of a step whose direct launch srun could not hand over: their agents'
        long-polls on this controller answer with it now (the others' controllers have
        woken them already: the step bumped their work generation)."""
        row = api.own_job(ref, ident, "srun")
        if not 0 <= step_id < 2**31:
            raise InvalidSpec(f"invalid step id {step_id}")
        step = ctl.store.get_step(int(row["id"]), step_id)
        nodes = sorted(set(body.nodes) & set(step["nodes"]))
        ctl.waiters.notify(nodes)
        return {"step_id": step_id, "woken": nodes}

    @r.post("/v1/jobs/{ref}/steps/{step_id}/attach")
    def attach_step(ref: str, step_id: int, ident: Identity = Depends(caller)) -> dict[str, Any]:
        """`sattach`: the step's layout and, while it runs, where its I/O flows (its srun's
        address) with a token that attaches there (auth/attachcred.py). Its owner may
        attach, and admins (root on a cluster host); not operators, as Slurm's slurmstepd
        lets only the owner, root and SlurmUser attach."""
        row = api.own_job(ref, ident, "sattach")
        access.check_attach(ident, row)
        if not 0 <= step_id < 2**31:
            raise InvalidSpec(f"invalid step id {step_id}")
        step = ctl.store.step_io(int(row["id"]), step_id)
        io = step.pop("io")
        out = {**step, "job_id": int(row["id"])}
        if step["state"] == "RUNNING" and io.get("cookie"):
            out["attach"] = {
                "host": io["host"],
                "port": io["port"],
                "token": attach_token(str(io["cookie"])),
                "stdout": bool(io.get("stdout") or io.get("pty")),
                "stderr": bool(io.get("stderr")) and not io.get("pty"),
                "stdin": bool(io.get("stdin") or io.get("pty")),
                "pty": bool(io.get("pty")),
            }
        return out

    @r.get("/v1/jobs/{ref}/steps/{step_id}")
    def show_step(ref: str, step_id: int, ident: Identity = Depends(caller)) -> dict[str, Any]:
        row = api.own_job(ref, ident, "show a step")
        if not 0 <= step_id < 2**31:
            raise InvalidSpec(f"invalid step id {step_id}")
        return ctl.store.get_step(int(row["id"]), step_id)

    @r.get("/v1/jobs/{ref}/usage")
    def job_usage(
        ref: str, steps: str | None = None, batch: bool = False, ident: Identity = Depends(caller)
    ) -> dict[str, Any]:
        """Live usage of a running job's tasks (`sstat`): every running step's, or those of
        `steps` (a comma list of ids), and with `batch` the batch script's. The nodes'
        agents are asked at once (controller/taskusage.py); each answers for its own tasks
        within `steps.push_timeout`, and a node that does not is listed in `unreachable`."""
        row = api.own_job(ref, ident, "sstat")
        jid = int(row["id"])
        wanted = _step_ids(steps)
        out: dict[str, Any] = {
            "job_id": jid,
            "state": row["state"],
            "steps": [],
            "tasks": [],
            "unreachable": {},
        }
        att = row.get("attempt_id")
        if row["state"] != "RUNNING" or att is None:
            return out
        seq = next((a["seq"] for a in ctl.store.attempts_of(jid) if a["id"] == att), None)
        live = [
            st
            for st in ctl.store.steps_of(jid)
            if st["attempt_seq"] == seq
            and st["state"] == "RUNNING"
            and (wanted is None or st["step_id"] in wanted)
        ]
        asks: dict[str, dict[str, Any]] = {}
        for st in live:
            for node in st["nodes"]:
                ask = asks.setdefault(node, {"attempt_id": att, "steps": [], "batch": False})
                ask["steps"].append(st["step_id"])
        host = (row.get("nodelist_run") or [None])[0]
        if batch and host:
            asks.setdefault(host, {"attempt_id": att, "steps": [], "batch": False})["batch"] = True
        requests, unknown = ctl.usage_requests(asks, api.keys.signing)
        tasks, failed = taskusage.ask_nodes(requests, ctl.config.steps.push_timeout)
        for node in unknown:
            failed[node] = "its agent told no address for usage requests (steps.direct off?)"
        out.update(
            steps=[
                {k: st[k] for k in ("step_id", "name", "nodes", "tasks", "ntasks", "start_time")}
                for st in live
            ],
            tasks=tasks,
            unreachable=failed,
            batch_host=host if batch else None,
        )
        return out

    @r.post("/v1/jobs/{ref}/steps/signal")
    def signal_steps(
        ref: str, body: StepSignalIn, ident: Identity = Depends(caller)
    ) -> dict[str, Any]:
        row = api.own_job(ref, ident, "signal")
        done = ctl.store.signal_steps(int(row["id"]), body.signal, body.step_id, ident.actor)
        ctl.waiters.notify(ctl.waiters.waiting_nodes())
        return {"steps": done}

    @r.post("/v1/jobs/{ref}/steps/cancel")
    def cancel_steps(
        ref: str, body: StepCancelIn, ident: Identity = Depends(caller)
    ) -> dict[str, Any]:
        row = api.own_job(ref, ident, "cancel a step")
        reason = body.reason or f"cancelled by {ident.actor}"
        done = ctl.store.cancel_steps(int(row["id"]), body.step_id, reason, ident.actor)
        ctl.waiters.notify(ctl.waiters.waiting_nodes())
        return {"steps": done}

    return r


def _step_ids(text: str | None) -> set[int] | None:
    """`steps=0,2` as a set of step ids; None (every step) when absent."""
    if text is None or not text.strip():
        return None
    ids = set()
    for part in text.split(","):
        part = part.strip()
        if not part.isdecimal() or int(part) >= 2**31:
            raise InvalidSpec(f"invalid step id {part!r} in steps={text!r}: give step numbers")
        ids.add(int(part))
    return ids
