"""Job steps on a node: one shepherd per step task, inside the job's allocation on this node.

A step task is started like a job task (same shepherd, same file protocol, so an agent restart
re-adopts it and self-fencing stops it), with three differences:

* it joins the cgroup and CPU set that the job's own shepherd made on this node (``join_only``:
  the step never creates or removes it), so ``--mem`` and the CPU set hold for everything the
  job runs here, and whatever is left of a step dies with the job;
* its standard streams are connections to its ``srun`` (``io``), unless srun gave ``-o``/``-e``;
  the shepherd sends the task's exit record to srun too, so srun ends without waiting for a
  heartbeat;
* it starts only once the job's own task on this node has (the allocation is in place): a step
  that arrives earlier is simply launched on a later reply (the protocol is level-triggered).

Task directories live in ``<state>/steps/<attempt>.<step>.<task>``; ``signals-done`` in each
records the last signal request delivered, so a restarted agent never delivers one twice.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from phalanx.agent import checkpoint_requests, jobfiles, shepherd_control, shepherd_files
from phalanx.agent.files import read_json as _read_json
from phalanx.agent.files import write_json as _write_json
from phalanx.agent.files import write_private_json
from phalanx.agent.jobenv import node_environment

log = logging.getLogger("phalanx.agent")

FORGOTTEN_MAX = 4096
SIGNALS_DONE = "signals-done"


class StepRunner:
    def __init__(
        self,
        steps_dir: Path,
        tasks_dir: Path,
        *,
        job_env: dict[str, str],
        srun_dir: Path | None = None,
        fence: Callable[[], dict[str, Any]],
        launch: Callable[[Path], None],
    ) -> None:
        self.steps_dir = steps_dir
        self.tasks_dir = tasks_dir
        self.job_env = job_env
        self.srun_dir = srun_dir
        self.fence = fence  # the shepherd's fence settings, as the agent's tasks get them
        self._launch_dir = launch
        self._forgotten: dict[tuple[int, int], None] = {}
        # task dirs started since the poller last looked (Agent._hold_step_exits)
        self._launched: list[str] = []

    # ------------------------------------------------------------------ reading
    def _dirs(self, attempt_id: int | None = None, step_id: int | None = None) -> list[Path]:
        if not self.steps_dir.is_dir():
            return []
        out = []
        for d in sorted(self.steps_dir.iterdir()):
            parts = d.name.split(".")
            if len(parts) != 3 or not all(p.isdigit() for p in parts):
                continue
            if attempt_id is not None and int(parts[0]) != attempt_id:
                continue
            if step_id is not None and int(parts[1]) != step_id:
                continue
            out.append(d)
        return out

    def take_launched(self) -> list[str]:
        """The names of the step task dirs started since the last call (for the poller)."""
        out, self._launched = self._launched, []
        return out

    def exited_dirs(self) -> list[str]:
        return [d.name for d in self._dirs() if (d / "exit.json").exists()]

    def snapshot(self) -> list[dict[str, Any]]:
        """One report per (attempt, step) on this node: running while any task runs, exited
        (with every task's exit record) when all have ended, lost if a shepherd vanished."""
        groups: dict[tuple[int, int], list[tuple[dict[str, Any], dict[str, Any]]]] = {}
        for d in self._dirs():
            meta = _read_json(d / "meta.json")
            if meta is None:
                continue
            key = (int(meta["attempt_id"]), int(meta["step_id"]))
            groups.setdefault(key, []).append((meta, shepherd_control.read_status(d)))
        out = []
        for (aid, sid), items in groups.items():
            states = [st.get("state") for _meta, st in items]
            rep: dict[str, Any] = {"attempt_id": aid, "step_id": sid, "token": items[0][0]["token"]}
            started = [float(st["started_at"]) for _m, st in items if st.get("started_at")]
            rep["started_at"] = min(started) if started else None
            if all(s in ("exited", "lost") for s in states):
                rep["state"] = "lost" if "lost" in states else "exited"
                rep["exits"] = [
                    {
                        **{k: v for k, v in st.items() if k != "state"},
                        "task": int(meta["task_id"]),
                        **({"lost": True} if st.get("state") == "lost" else {}),
                    }
                    for meta, st in items
                ]
            elif "running" in states or "exited" in states:
                rep["state"] = "running"
            else:
                rep["state"] = "starting"
            out.append(rep)
        return out

    # ------------------------------------------------------------------ acting
    def apply(self, reply: dict[str, Any]) -> bool:
        """Act on the step half of a reply; whether it asked for anything new (not only the
        stops already requested, which replies repeat while a stop's grace runs)."""
        news = bool(reply.get("start") or reply.get("signal") or reply.get("forget"))
        for item in reply.get("start") or []:
            self.launch(item)
        for stop in reply.get("stop") or []:
            news = self.stop(int(stop["attempt_id"]), int(stop["step_id"]), stop) > 0 or news
        for item in reply.get("signal") or []:
            self.deliver(int(item["attempt_id"]), int(item["step_id"]), item.get("signals") or [])
        for aid, sid in reply.get("forget") or []:
            for d in self._dirs(int(aid), int(sid)):
                shutil.rmtree(d, ignore_errors=True)
            self._forgotten[(int(aid), int(sid))] = None
        while len(self._forgotten) > FORGOTTEN_MAX:
            del self._forgotten[next(iter(self._forgotten))]
        return news

    def stop(self, attempt_id: int, step_id: int | None, item: dict[str, Any]) -> int:
        """Stop a step's tasks here (all steps of the attempt when `step_id` is None).

        A planned stop gives them its checkpoint signal and grace; with ``--signal=B:``
        (``batch_only``) the signal is the batch shell's alone, as in Slurm: the steps get
        the grace without it, so the shell can forward the signal and they can save."""
        signum = item.get("checkpoint_signal")
        batch_only = bool(item.get("batch_only"))
        new = 0
        for d in self._dirs(attempt_id, step_id):
            if (d / "exit.json").exists():
                continue
            new += not (d / shepherd_files.STOP_FILE).exists()
            shepherd_control.request_stop(
                d,
                checkpoint_signal=None if batch_only else signum,
                checkpoint_grace=float(item.get("checkpoint_grace") or 0.0),
                reason=item.get("reason"),
                wait=batch_only and signum is not None,
            )
        return new

    def signal_attempt(self, attempt_id: int, signum: int) -> int:
        """Deliver a signal to every step task of the attempt running here (scancel --signal)."""
        return sum(
            1
            for d in self._dirs(attempt_id)
            if shepherd_control.forward_signal(d, signum, batch_only=False)
        )

    def deliver(self, attempt_id: int, step_id: int, signals: list[dict[str, Any]]) -> None:
        """Deliver each requested signal once per task, in order of its sequence number."""
        for d in self._dirs(attempt_id, step_id):
            done_file = d / SIGNALS_DONE
            # the agent's own small file (jobfiles: never a link, a FIFO, or unbounded)
            got = jobfiles.read_or_none(done_file, (os.geteuid(),), 64)
            try:
                done = int(got[0] or 0) if got is not None else 0
            except ValueError:
                done = 0
            for sig in sorted(signals, key=lambda x: int(x["seq"])):
                if int(sig["seq"]) <= done:
                    continue
                shepherd_control.forward_signal(d, int(sig["signum"]), batch_only=False)
                done = int(sig["seq"])
            jobfiles.replace_file(done_file, str(done).encode())

    def launch(self, item: dict[str, Any], *, hold_exits: bool = True) -> bool:
        """Start the step's tasks on this node (once); False while the job's own task here has
        not started yet (the next reply brings the step again).  `hold_exits`: the poller
        waits for these tasks' ends before its next heartbeat (Agent._hold_step_exits); a
        direct launch is no heartbeat's answer, so there is nothing to hold."""
        aid, sid = int(item["attempt_id"]), int(item["step_id"])
        if (aid, sid) in self._forgotten or self._dirs(aid, sid):
            return True
        job_dir = self.tasks_dir / str(aid)
        job_spec = _read_json(job_dir / "spec.json")
        if job_spec is None or not (job_dir / "job.json").exists():
            log.info("step %s.%s waits for its job's task on this node to start", aid, sid)
            return False
        if (job_dir / "exit.json").exists():
            return True  # the job's task here is over: the store ends the step
        self.steps_dir.mkdir(parents=True, exist_ok=True)
        plan = job_spec.get("cgroup")
        job_hooks = job_spec.get("hooks")
        task_prolog = (
            {"task_prolog": job_hooks["task_prolog"]}
            if isinstance(job_hooks, dict) and isinstance(job_hooks.get("task_prolog"), dict)
            else {}
        )
        cgroup = {**plan, "join_only": True} if isinstance(plan, dict) else None
        base_env = node_environment(item["env"], self.job_env, self.srun_dir)
        base_env.update(checkpoint_requests.control_environment(job_dir))
        tmpdir = job_dir / "tmp"
        if tmpdir.is_dir():
            base_env["TMPDIR"] = str(tmpdir)
        argv = list(item["argv"])
        if "/" not in argv[0]:
            found = shutil.which(argv[0], path=base_env.get("PATH") or os.defpath)
            if found:
                argv[0] = found
        dirs = []
        for task in item["tasks"]:
            d = self.steps_dir / f"{aid}.{sid}.{int(task['task_id'])}"
            tmp = self.steps_dir / f".{d.name}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            tmp.chmod(0o711)
            env = {**base_env, **task["env"], "PHX_TASK_DIR": str(d)}
            io = {**item["io"], "task": int(task["task_id"])}
            spec = {
                "attempt_id": aid,
                "step_id": sid,
                "job_id": item["job_id"],
                "token": item["token"],
                "node": item["node"],
                "rank": int(task["task_id"]),
                "argv": argv,
                "env": env,
                "cwd": item["cwd"],
                "stdout": task.get("stdout") or os.devnull,
                "stderr": task.get("stderr"),
                "io": io,
                "open_mode": item.get("open_mode") or "truncate",
                "time_limit_s": item.get("time_limit_s"),
                "kill_grace_s": item["kill_grace_s"],
                "signal": item.get("signal"),
                "fence": self.fence(),
                "user": item.get("user"),
                "cpus": job_spec.get("cpus"),
                "cgroup": cgroup,
                "job_dir": str(job_dir),  # where it says it got --signal (shepherd)
                # the node's task prolog runs before each task too (Slurm's TaskProlog);
                # the prolog and epilog are the job's task's, once per node
                "hooks": task_prolog,
            }
            write_private_json(tmp / "spec.json", spec)
            write_private_json(
                tmp / "meta.json",
                {
                    "attempt_id": aid,
                    "step_id": sid,
                    "task_id": int(task["task_id"]),
                    "token": item["token"],
                    "job_id": item["job_id"],
                    "launched_at": time.time(),
                },
            )
            os.replace(tmp, d)
            dirs.append(d)
        if hold_exits:
            self._launched.extend(d.name for d in dirs)
        for d in dirs:
            try:
                self._launch_dir(d)
            except Exception as e:
                log.error("could not start a shepherd for step task %s: %s", d.name, e)
                _write_json(
                    d / "exit.json",
                    {
                        "exit_code": None,
                        "signal": None,
                        "launch_failed": True,
                        "error": f"cannot start the shepherd: {e}",
                        "started_at": None,
                        "ended_at": time.time(),
                    },
                )
        how = "from a heartbeat reply" if hold_exits else "handed over by srun"
        log.info("started step %s.%s: %d tasks (%s)", item["job_id"], sid, len(dirs), how)
        return True
