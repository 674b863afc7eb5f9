"""A node's prolog, epilog and task prolog (Slurm's Prolog, Epilog and TaskProlog): their
configuration, checked when the agent starts, and what the agent hands each task's shepherd.

Why the shepherd runs them, not the agent: the shepherd owns the task from its launch to its
exit record, so the prolog runs just before the job's processes start on the node, the epilog
runs once all of them have ended (steps included), and an agent restart in between neither
skips nor repeats either.  The shepherd records a failure in the task's ``exit.json``
(``prolog_failed`` / ``epilog_failed``, a sentence with the exit status and the script's first
output), and the controller drains the node with it (store/exchange.py) and, for a prolog,
requeues the job without spending a retry (domain/policy.py).

Configuration: tables of the agent's node file (``phalanx agent --health-config FILE``, the
file that holds ``[health]``)::

    [prolog]                              # as root, before the job's processes start here
    path = "/etc/phalanx/prolog.sh"
    timeout = 30                          # seconds; then killed, and that is a failure
    [epilog]                              # as root, after all of them have ended here
    path = "/etc/phalanx/epilog.sh"
    timeout = 60
    [task_prolog]                         # as the job's user, before the script and each task
    path = "/etc/phalanx/task_prolog.sh"
    timeout = 30

Every key but ``path`` has a default; unknown keys, relative or missing paths, files that are
not executable and timeouts out of range are refused with the field named, so a typo cannot
silently switch a site's prolog off.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# the tables of the node file that configure hooks (the rest of the file is [health])
HOOK_TABLES = ("prolog", "epilog", "task_prolog")
_KEYS = ("path", "timeout")
# seconds each hook may run before it is killed (a kill counts as a failure)
DEFAULT_TIMEOUTS = {"prolog": 30.0, "epilog": 60.0, "task_prolog": 30.0}
MAX_TIMEOUT_S = 3600.0
# what the environment of a root hook keeps of the job's: Slurm's names and Phalanx's own
_JOB_PREFIXES = ("SLURM_", "PHX_")
# a root hook gets a fixed PATH, never the submitter's (Slurm's prolog runs with a minimal one)
ROOT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class Hook:
    """One configured script: an absolute path and how long it may run."""

    path: str
    timeout: float

    def spec(self) -> dict[str, Any]:
        return {"path": self.path, "timeout": self.timeout}


@dataclass(frozen=True)
class NodeHooks:
    """The node's hooks; None where a hook is not configured."""

    prolog: Hook | None = None
    epilog: Hook | None = None
    task_prolog: Hook | None = None

    def before_start_s(self) -> float:
        """The longest the hooks can hold a launch before the job's process starts."""
        return sum(h.timeout for h in (self.prolog, self.task_prolog) if h is not None)


def _err(where: str, message: str) -> ValueError:
    return ValueError(f"{where}: {message}")


def parse_hook(name: str, value: Any, *, check_file: bool = True) -> Hook | None:
    """One table (``[prolog]``); a bare string is taken as its path, ``false`` turns it off.
    `check_file`: the path must name an executable file now (the agent's start)."""
    if value is None or value is False:
        return None
    if isinstance(value, str):
        value = {"path": value}
    if not isinstance(value, Mapping):
        raise _err(name, f"expected a table with 'path' (and 'timeout'), got {value!r}")
    for key in value:
        if key not in _KEYS:
            raise _err(name, f"unknown key '{key}' (known: {', '.join(_KEYS)})")
    path = value.get("path")
    if not isinstance(path, str) or not path:
        raise _err(f"{name}.path", f"must be a non-empty string, got {path!r}")
    if not os.path.isabs(path):
        raise _err(f"{name}.path", f"must be an absolute path, got {path!r}")
    if check_file and not (os.path.isfile(path) and os.access(path, os.X_OK)):
        why = "is not executable" if os.path.isfile(path) else "does not exist or is not a file"
        raise _err(f"{name}.path", f"{path} {why}")
    timeout = value.get("timeout", DEFAULT_TIMEOUTS[name])
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not math.isfinite(timeout)
        or not 0 < timeout <= MAX_TIMEOUT_S
    ):
        raise _err(
            f"{name}.timeout",
            f"must be a number of seconds above 0 and at most {MAX_TIMEOUT_S:g}, got {timeout!r}",
        )
    return Hook(path, float(timeout))


def parse_hooks(config: Mapping[str, Any], *, check_file: bool = True) -> NodeHooks:
    """The hooks of a node file's tables (see the module docstring); ValueError naming the
    field on anything wrong."""
    return NodeHooks(
        **{name: parse_hook(name, config.get(name), check_file=check_file) for name in HOOK_TABLES}
    )


def launch_timeout_warning(hooks: NodeHooks, launch_timeout: Any) -> str | None:
    """A sentence when the prolog and task prolog together may outlast the controllers'
    `timing.launch_timeout` (learned at registration): an attempt no task of which has started
    by then is requeued as an unconfirmed launch, so a slow prolog would be cut short by a
    requeue elsewhere rather than by its own timeout."""
    before = hooks.before_start_s()
    if (
        not before
        or not isinstance(launch_timeout, int | float)
        or isinstance(launch_timeout, bool)
    ):
        return None
    if before < float(launch_timeout):
        return None
    return (
        f"the prolog and task prolog may take {before:g}s together (prolog.timeout + "
        f"task_prolog.timeout), not less than the controllers' timing.launch_timeout "
        f"({float(launch_timeout):g}s): a launch they hold that long is requeued elsewhere; "
        "shorten the timeouts or lengthen launch_timeout"
    )


def hook_environment(job_env: Mapping[str, str], node: str, context: str) -> dict[str, str]:
    """The environment of a root hook (prolog, epilog) for one job: the job's Slurm and
    Phalanx variables (SLURM_JOB_ID, SLURM_JOB_USER, SLURM_JOB_NODELIST, SLURM_JOB_PARTITION,
    ...; never the submitter's own variables, which are not the site's to trust), this node's
    name and the context, as Slurm gives them; the shepherd adds SLURM_JOB_UID and
    SLURM_JOB_GID once it has resolved the user."""
    env = {k: v for k, v in job_env.items() if k.startswith(_JOB_PREFIXES)}
    env.update(
        {
            "PATH": ROOT_PATH,
            "SLURMD_NODENAME": node,
            "SLURM_SCRIPT_CONTEXT": f"{context}_slurmd",
            "PHX_HOOK": context,
        }
    )
    return env


def task_spec(hooks: NodeHooks | None, job_env: Mapping[str, str], node: str) -> dict[str, Any]:
    """What a job task's shepherd spec says about its hooks (``hooks`` in spec.json): the root
    hooks with their environment, the task prolog (which gets the task's own environment)."""
    if hooks is None:
        return {}
    out: dict[str, Any] = {}
    for name in ("prolog", "epilog"):
        hook = getattr(hooks, name)
        if hook is not None:
            out[name] = {**hook.spec(), "env": hook_environment(job_env, node, name)}
    if hooks.task_prolog is not None:
        out["task_prolog"] = hooks.task_prolog.spec()
    return out
