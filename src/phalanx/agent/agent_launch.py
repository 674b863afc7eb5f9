"""Launching a job's task on this node: its task directory (script, spec, control and tmp
directories, owned by the job's user), the shepherd's spec, and the shepherd started for it.

A part of :class:`agent.Agent` (a mixin over :class:`agent_isolation.AgentIsolation`, whose
CPU pick and cgroup plan go into the spec).  Launching is idempotent per attempt: the task
directory is made whole under a temporary name and renamed into place, and an attempt that
has a directory, or was forgotten, is never launched again.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from phalanx.agent import checkpoint_requests, hooks, shepherd_files, shepherd_launch
from phalanx.agent.agent_isolation import AgentIsolation
from phalanx.agent.files import write_json as _write_json
from phalanx.agent.files import write_private_json
from phalanx.agent.jobenv import node_environment
from phalanx.agent.steps import StepRunner

log = logging.getLogger("phalanx.agent")


class AgentLaunch(AgentIsolation):
    """The agent's launch path: from a reply's ``start`` item to a running shepherd."""

    job_env: dict[str, str]
    srun_dir: Path | None
    hooks: hooks.NodeHooks | None  # the node's prolog, epilog and task prolog (hooks.py)
    fence_file: Path
    timing: dict[str, Any]
    steps: StepRunner
    _forgotten: dict[str, None]
    _launcher: shepherd_launch.Launcher | None

    def _fence_settings(self) -> dict[str, Any]:
        return {
            "heartbeat_file": str(self.fence_file),
            "timeout_s": float(self.timing["fence_timeout"]),
            "kill_grace_s": float(self.timing["fence_kill_grace"]),
        }

    def _launch_shepherd(self, d: Path) -> None:
        launcher: shepherd_launch.Launcher | None = getattr(self, "_launcher", None)
        if launcher is not None:
            launcher.launch(d)
        else:  # apply() used without run()
            shepherd_launch.launch(d)

    def _launch(self, launch: dict[str, Any]) -> None:
        d = self.tasks_dir / str(launch["attempt_id"])
        if d.exists() or str(launch["attempt_id"]) in self._forgotten:
            return  # already launched (replies may repeat), or already over and forgotten
        tmp = self.tasks_dir / f".{launch['attempt_id']}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        tmp.chmod(0o711)  # the job's user reaches its script and control/, lists nothing
        owner = job_owner(launch.get("user"))
        cmd = launch["command"]
        if "script" in cmd:
            script = tmp / "script"
            script.write_text(cmd["script"])
            script.chmod(0o700)
            if owner:
                os.chown(script, *owner)
            argv = [str(d / "script"), *cmd.get("args", [])]
        else:
            argv = list(cmd["argv"])
        env = node_environment(launch["env"], self.job_env, self.srun_dir)
        env["PHX_TASK_DIR"] = str(d)
        # the checkpoint protocol's control files (docs/checkpoints.md)
        (tmp / shepherd_files.CONTROL_DIR).mkdir(mode=0o700)
        if owner:  # the job writes checkpoint.json and progress.json there
            os.chown(tmp / shepherd_files.CONTROL_DIR, *owner)
        # a TMPDIR of the job's own on this node, for its batch step and its steps; it goes
        # with the task directory when the attempt is over
        (tmp / "tmp").mkdir(mode=0o700)
        if owner:
            os.chown(tmp / "tmp", *owner)
        env["TMPDIR"] = str(d / "tmp")
        env.update(checkpoint_requests.control_environment(d))
        cpus = self._pick_cpus(str(launch["attempt_id"]), int(launch.get("cpus") or 1))
        stdout = launch["stdout"]
        stderr = launch["stderr"]
        open_mode = launch["open_mode"]
        if launch.get("all_nodes") and int(env.get("PHX_NNODES", "1")) > 1:
            open_mode = "append"  # every node writes the same file: never truncate a peer's lines
        spec = {
            "attempt_id": launch["attempt_id"],
            "job_id": launch["job_id"],
            "token": launch["token"],
            "node": self.name,
            "rank": launch["rank"],
            "holder": bool(launch.get("holder")),
            "argv": argv,
            "env": env,
            "cwd": launch["cwd"],
            "stdout": stdout,
            "stderr": stderr,
            "open_mode": open_mode,
            "time_limit_s": launch["time_limit_s"],
            "kill_grace_s": launch["kill_grace_s"],
            "progress_timeout_s": launch.get("progress_timeout_s"),
            "signal": launch.get("signal"),
            # --signal without B: goes to the job's running steps when it has any (shepherd)
            "steps_dir": str(self.steps.steps_dir),
            "checkpoint": launch.get("checkpoint"),
            "fence": self._fence_settings(),
            "user": launch.get("user"),
            "cpus": cpus,
            "cgroup": self._cgroup_plan(launch, cpus),
            "hooks": hooks.task_spec(self.hooks, launch["env"], self.name),
        }
        # the job's environment and the attempt's token are nobody else's business
        write_private_json(tmp / "spec.json", spec)
        write_private_json(
            tmp / "meta.json",
            {
                "attempt_id": launch["attempt_id"],
                "token": launch["token"],
                "job_id": launch["job_id"],
                "launched_at": time.time(),
                "gpu_ids": list(launch.get("gpu_ids") or []),  # sampled for `eff`
            },
        )
        os.replace(tmp, d)
        launcher: shepherd_launch.Launcher | None = getattr(self, "_launcher", None)
        try:
            if launcher is not None:
                launcher.launch(d)
            else:  # apply() used without run()
                shepherd_launch.launch(d)
            log.info(
                "started job %s attempt %s rank %s",
                launch["job_id"],
                launch["attempt_id"],
                launch["rank"],
            )
        except Exception as e:
            log.error("could not start a shepherd for attempt %s: %s", launch["attempt_id"], e)
            _write_json(
                d / "exit.json",
                {
                    "exit_code": None,
                    "signal": None,
                    "timed_out": False,
                    "cancelled": False,
                    "fenced": False,
                    "launch_failed": True,
                    "error": f"cannot start the shepherd: {e}",
                    "started_at": None,
                    "ended_at": time.time(),
                },
            )


def job_owner(user: str | None) -> tuple[int, int] | None:
    """(uid, gid) to give the job's own files to, when the agent is root and the user is known
    (an unknown user is the shepherd's to report); None: leave them as they are."""
    if not user or os.geteuid() != 0:
        return None
    import pwd

    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        return None
    return (pw.pw_uid, pw.pw_gid) if pw.pw_uid != 0 else None
