"""The sbatch option table: every option `phalanx submit` and ``#SBATCH``/``#PHX`` lines
accept, refuse or ignore, what each sets, and how its value is read.

One row (`Option`) per option, with its long and short spelling, whether it takes a value, the
job fields it sets, the converter that turns its text into those fields (raising ValueError
with a reason a user can act on), its help line, and its effect: applied, stored only, ignored
for Slurm compatibility, or refused because Phalanx cannot honour it. The parser
(domain/directives.py) walks tokens against this table and the CLI prints its help from it; it
is a module of its own because it is data plus the value syntax, not the parsing rules.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from phalanx.domain import policy, values
from phalanx.domain.hostlist import expand_hostlist
from phalanx.domain.licenses import format_licenses, parse_licenses
from phalanx.domain.slurmtime import parse_time

__all__ = [
    "BY_LONG",
    "BY_SHORT",
    "OPTIONS",
    "WARNING_KEY",
    "Arg",
    "Converter",
    "Effect",
    "Option",
    "find_option",
]


Converter = Callable[[str], dict[str, Any]]
"""Turns one option value into field updates.  Raises ValueError with a user-facing reason."""

WARNING_KEY = "__warning__"  # converters may return this key to attach a warning to a field update


class Arg(StrEnum):
    """Whether an option takes a value (``OPTIONAL`` ones only via ``--opt=value``/``-oVALUE``)."""

    NONE = "none"
    REQUIRED = "required"
    OPTIONAL = "optional"


class Effect(StrEnum):
    """What accepting an option does."""

    APPLIED = "applied"  # sets fields the scheduler acts on
    STORED = "stored"  # value kept in fields for display, but no effect here (listed in ignored)
    IGNORED = "ignored"  # accepted so scripts run unchanged; nothing kept (listed in ignored)
    REFUSED = "refused"  # a Slurm option Phalanx cannot honour: the submission is refused


@dataclass(frozen=True)
class Option:
    """One row of the option table."""

    long: str
    short: str | None
    arg: Arg
    fields: tuple[str, ...]
    convert: Converter | None
    help: str
    metavar: str = ""
    effect: Effect = Effect.APPLIED
    conflicts: tuple[str, ...] = ()
    """Long names of options that may not be given together with this one in the same place
    (script or command line); across places the command line wins and clears the other."""

    @property
    def takes_value(self) -> bool:
        return self.arg is not Arg.NONE

    @property
    def field(self) -> str | None:
        """The primary target field (``None`` for options that keep nothing)."""
        return self.fields[0] if self.fields else None

    @property
    def flag(self) -> str:
        return f"--{self.long}"

    @property
    def usage(self) -> str:
        """``-t, --time=TIME`` style label for help output."""
        metavar = self.metavar or "VALUE"
        value = {Arg.NONE: "", Arg.REQUIRED: f"={metavar}", Arg.OPTIONAL: f"[={metavar}]"}
        label = f"--{self.long}{value[self.arg]}"
        return f"-{self.short}, {label}" if self.short else label


# --------------------------------------------------------------------------------------------
# Converters
# --------------------------------------------------------------------------------------------


def _whole(text: str, minimum: int, example: str = "4") -> int:
    stripped = text.strip()
    if not stripped.isdecimal() or int(stripped) < minimum:
        raise ValueError(f"invalid number {text!r}: use a whole number ≥ {minimum}, e.g. {example}")
    return int(stripped)


def _int_to(name: str, minimum: int = 1) -> Converter:
    return lambda text: {name: _whole(text, minimum)}


def _str_to(name: str, what: str = "value") -> Converter:
    def convert(text: str) -> dict[str, Any]:
        if not text.strip():
            raise ValueError(f"empty {what}: give a {what} after the option")
        return {name: text}

    return convert


def _const(**updates: Any) -> Converter:
    return lambda _text: dict(updates)


def _nodes(text: str) -> dict[str, Any]:
    """``-N 4`` or ``-N 2-4`` (the scheduler gets the minimum and may use up to the maximum)."""
    lo, dash, hi = text.strip().partition("-")
    forms = "use a node count such as 4, or a range such as 2-4"
    if not lo.isdecimal() or int(lo) < 1 or (dash and (not hi.isdecimal() or int(hi) < int(lo))):
        raise ValueError(f"invalid node count {text!r}: {forms}")
    if dash:
        return {"nodes": int(lo), "nodes_max": int(hi)}
    return {"nodes": int(lo)}


def _memory_to(name: str, allow_zero: bool) -> Converter:
    def convert(text: str) -> dict[str, Any]:
        mb = values.parse_memory_mb(text)
        if mb == 0 and not allow_zero:
            raise ValueError(f"invalid memory size {text!r}: must be more than 0, e.g. 4G")
        return {name: mb}

    return convert


def _gpu_updates(count_field: str, parsed: tuple[int, str | None]) -> dict[str, Any]:
    count, gpu_type = parsed
    updates: dict[str, Any] = {count_field: count}
    if gpu_type is not None:
        updates["gpu_type"] = gpu_type
    return updates


def _gres(text: str) -> dict[str, Any]:
    return _gpu_updates("gpus_per_node", values.parse_gres(text))


def _gpus_to(count_field: str) -> Converter:
    return lambda text: _gpu_updates(count_field, values.parse_gpus(text))


def _duration_to(name: str) -> Converter:
    return lambda text: {name: values.parse_duration(text)}


def _output_to(name: str) -> Converter:
    """sbatch treats ``-o none`` as /dev/null; every other value is a filename pattern."""

    def convert(text: str) -> dict[str, Any]:
        if not text.strip():
            raise ValueError("empty file name: use e.g. slurm-%j.out")
        return {name: "/dev/null" if text.lower() == "none" else text}

    return convert


def _open_mode(text: str) -> dict[str, Any]:
    word = text.strip().lower()
    # sbatch only looks at the first letter, so "a"/"t" are accepted too.
    if word and "append".startswith(word):
        return {"open_mode": "append"}
    if word and "truncate".startswith(word):
        return {"open_mode": "truncate"}
    raise ValueError(f"invalid open mode {text!r}: use append or truncate")


def _validated_raw(name: str, check: Callable[[str], object]) -> Converter:
    """Keep the string as written (the server parses it again) but refuse it now if invalid."""

    def convert(text: str) -> dict[str, Any]:
        check(text)
        return {name: text.strip()}

    return convert


def _reservation(text: str) -> dict[str, Any]:
    """--reservation=NAME; whether it exists and admits the job is checked at submission."""
    name = text.strip()
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.@+-]{0,127}", name):
        raise ValueError(
            f"invalid reservation name {text!r}: `scontrol show reservation` lists the "
            "reservations and their names"
        )
    return {"reservation": name}


def _licenses(text: str) -> dict[str, Any]:
    """--licenses in canonical form (names sorted, counts explicit); refused now if invalid."""
    return {"licenses": format_licenses(parse_licenses(text))}


def _switches(text: str) -> dict[str, Any]:
    """Slurm's ``--switches=N[@TIME]``: N leaf switches at most, for at most TIME (0: do
    not wait; UNLIMITED: wait for ever; absent: 5 minutes, Slurm's max_switch_wait)."""
    count, at, wait = text.strip().partition("@")
    n = _whole(count, 1, "2@10:00")
    if not at:
        return {"switches": n}
    wait = wait.strip()
    if wait == "0":
        return {"switches": n, "switches_wait_s": 0}
    secs = values.parse_duration(wait)
    return {"switches": n, "switches_wait_s": -1 if secs is None else secs}


_LEVEL = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def _level_to(name: str, what: str = "topology level") -> Converter:
    def convert(text: str) -> dict[str, Any]:
        if not _LEVEL.match(text.strip()):
            raise ValueError(f"invalid {what} {text!r}: letters, digits, '_', '.', '-' (e.g. rack)")
        return {name: text.strip()}

    return convert


def _hosts_to(name: str) -> Converter:
    def convert(text: str) -> dict[str, Any]:
        if "/" in text:
            raise ValueError(
                f"node list {text!r} looks like a file path; node list files are not "
                "supported, list the nodes instead, e.g. node[01-04]"
            )
        hosts = expand_hostlist(text)
        if not hosts:
            raise ValueError("empty node list: use e.g. node[01-04,07]")
        return {name: hosts}

    return convert


def _interval_to(name: str) -> Converter:
    return lambda text: {name: values.parse_interval(text)}


def _checkpoint_signal(text: str) -> dict[str, Any]:
    values.parse_signal_name(text)
    return {"checkpoint_signal": text.strip()}


def _checkpoint_interval(text: str) -> dict[str, Any]:
    if text.strip().lower() == "auto":
        return {"checkpoint_interval_s": "auto"}
    return {"checkpoint_interval_s": values.parse_interval(text)}


def _exclusive(text: str) -> dict[str, Any]:
    word = text.strip().lower()
    if not word:
        return {"exclusive": True}
    if word in ("user", "mcs", "topo"):
        return {
            "exclusive": True,
            WARNING_KEY: f"--exclusive={word} is treated as whole-node --exclusive",
        }
    raise ValueError(f"invalid --exclusive value {text!r}: use --exclusive (or =user, =mcs)")


def _partition(text: str) -> dict[str, Any]:
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise ValueError(f"invalid partition {text!r}: use a name or a list such as gpu,cpu")
    return {"partition": ",".join(names)}


def _nice(text: str) -> dict[str, Any]:
    """--nice (100, as Slurm) or --nice=N; a negative N raises priority (admins only)."""
    word = text.strip()
    if not word:
        return {"nice": 100}
    digits = word[1:] if word[:1] in "+-" else word
    if not digits.isdecimal() or int(digits) > 10_000_000:
        raise ValueError(f"invalid --nice value {text!r}: use a whole number, e.g. --nice=100")
    return {"nice": int(word)}


def _no_kill(text: str) -> dict[str, Any]:
    """-k/--no-kill, or --no-kill=off (Slurm's way to turn it off again)."""
    word = text.strip().lower()
    if word in ("", "on", "yes", "1"):
        return {"no_kill": True}
    if word in ("off", "no", "0"):
        return {"no_kill": False}
    raise ValueError(f"invalid --no-kill value {text!r}: give none, or off")


def _begin(text: str) -> dict[str, Any]:
    """--begin: resolved to epoch seconds now, at submission, as Slurm resolves it."""
    return {"begin_time": parse_time(text, time.time())}


def _priority(text: str) -> dict[str, Any]:
    return {"priority": _whole(text, 0, example="100")}


# --------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------


def _opt(
    long: str,
    short: str | None,
    arg: Arg,
    fields: tuple[str, ...],
    convert: Converter | None,
    help: str,
    metavar: str = "",
    effect: Effect = Effect.APPLIED,
    conflicts: tuple[str, ...] = (),
) -> Option:
    return Option(long, short, arg, fields, convert, help, metavar, effect, conflicts)


def _ignored(long: str, short: str | None = None, arg: Arg = Arg.REQUIRED) -> Option:
    return Option(
        long,
        short,
        arg,
        (),
        None,
        "accepted for Slurm compatibility; no effect",
        effect=Effect.IGNORED,
    )


def _refused(long: str, reason: str, short: str | None = None, arg: Arg = Arg.REQUIRED) -> Option:
    return Option(long, short, arg, (), None, reason, effect=Effect.REFUSED)


R, N, OPT = Arg.REQUIRED, Arg.NONE, Arg.OPTIONAL


# fmt: off
OPTIONS: tuple[Option, ...] = (
    # --- what runs and where ---
    _opt("job-name", "J", R, ("name",), _str_to("name", "job name"), "job name", "NAME"),
    _opt("partition", "p", R, ("partition",), _partition,
         "partition(s) to run in; a comma list means any of them", "PART[,PART]"),
    _opt("nodes", "N", R, ("nodes", "nodes_max"), _nodes,
         "number of nodes (or a MIN-MAX range)", "N[-MAX]"),
    _opt("ntasks", "n", R, ("ntasks",), _int_to("ntasks"), "number of tasks", "N"),
    _opt("ntasks-per-node", None, R, ("ntasks_per_node",), _int_to("ntasks_per_node"),
         "tasks per node", "N"),
    _opt("cpus-per-task", "c", R, ("cpus_per_task",), _int_to("cpus_per_task"),
         "CPUs per task", "N", conflicts=("cpus-per-gpu",)),
    _opt("cpus-per-gpu", None, R, ("cpus_per_gpu",), _int_to("cpus_per_gpu"),
         "CPUs per allocated GPU (CPUs per node = N x GPUs per node)", "N",
         conflicts=("cpus-per-task",)),
    _opt("mem", None, R, ("mem_mb",), _memory_to("mem_mb", allow_zero=True),
         "memory per node (MB, or K/M/G/T suffix); 0 means all of the node's memory", "SIZE",
         conflicts=("mem-per-cpu", "mem-per-gpu")),
    _opt("mem-per-cpu", None, R, ("mem_per_cpu_mb",),
         _memory_to("mem_per_cpu_mb", allow_zero=False),
         "memory per allocated CPU (MB, or K/M/G/T suffix)", "SIZE",
         conflicts=("mem", "mem-per-gpu")),
    _opt("mem-per-gpu", None, R, ("mem_per_gpu_mb",),
         _memory_to("mem_per_gpu_mb", allow_zero=False),
         "memory per allocated GPU (memory per node = SIZE x GPUs per node)", "SIZE",
         conflicts=("mem", "mem-per-cpu")),
    _opt("gres", None, R, ("gpus_per_node", "gpu_type"), _gres,
         "GPUs per node, e.g. gpu:4 or gpu:a40:1", "gpu[:TYPE][:N]",
         conflicts=("gpus-per-node",)),
    _opt("gpus-per-node", None, R, ("gpus_per_node", "gpu_type"), _gpus_to("gpus_per_node"),
         "GPUs per node, e.g. 4 or a100:4", "[TYPE:]N", conflicts=("gres",)),
    _opt("gpus", "G", R, ("gpus_total", "gpu_type"), _gpus_to("gpus_total"),
         "GPUs for the whole job, e.g. 8 or h100:8", "[TYPE:]N"),
    _opt("gpus-per-task", None, R, ("gpus_per_task", "gpu_type"), _gpus_to("gpus_per_task"),
         "GPUs per task, e.g. 1 or l40s:1", "[TYPE:]N"),
    _opt("time", "t", R, ("time_limit_s",), _duration_to("time_limit_s"),
         "time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED", "TIME"),
    _opt("constraint", "C", R, ("constraint",),
         _validated_raw("constraint", values.parse_constraint),
         "required node features, e.g. a100&ib or (a100|h100)&ib", "EXPR"),
    _opt("nodelist", "w", R, ("nodelist",), _hosts_to("nodelist"),
         "run on these nodes, e.g. node[01-04]", "HOSTLIST"),
    _opt("exclude", "x", R, ("exclude",), _hosts_to("exclude"),
         "never run on these nodes", "HOSTLIST"),
    _opt("exclusive", None, OPT, ("exclusive",), _exclusive,
         "do not share the allocated nodes with other jobs", "user|mcs"),
    # --- files and environment ---
    _opt("output", "o", R, ("output",), _output_to("output"),
         "stdout file pattern (%j job id, %x name, %A/%a array job/task, %N node)", "FILE"),
    _opt("error", "e", R, ("error",), _output_to("error"), "stderr file pattern", "FILE"),
    _opt("open-mode", None, R, ("open_mode",), _open_mode,
         "append to or truncate the output files", "append|truncate"),
    _opt("chdir", "D", R, ("workdir",), _str_to("workdir", "directory"),
         "working directory of the job", "DIR"),
    _opt("export", None, R, ("export",), _validated_raw("export", values.parse_export),
         "environment to pass: ALL, NONE, or a list such as ALL,VAR=value,OTHER", "ALL|NONE|VARS"),
    _opt("wrap", None, R, ("wrap",), _str_to("wrap", "command"),
         "run this shell command instead of a script", "COMMAND"),
    # --- lifecycle ---
    _opt("array", "a", R, ("array",), _validated_raw("array", values.parse_array),
         "job array indices, e.g. 0-15, 1,3,5-7, 0-15:4 or 1-100%10", "INDICES"),
    _opt("dependency", "d", R, ("dependency",),
         _validated_raw("dependency", values.parse_dependency),
         "start after other jobs, e.g. afterok:123:124 or singleton", "TYPE:JOB[:JOB]"),
    _opt("requeue", None, N, ("requeue",), _const(requeue=True),
         "requeue the job after a node failure or preemption"),
    _opt("no-requeue", None, N, ("requeue",), _const(requeue=False),
         "never requeue the job"),
    _opt("signal", None, R, ("signal",), _validated_raw("signal", values.parse_signal),
         "signal the job before its time limit, e.g. B:USR1@300", "[B:]SIG[@SECONDS]"),
    _opt("hold", "H", N, ("hold",), _const(hold=True), "submit the job held"),
    _opt("priority", None, R, ("priority",), _priority,
         "job priority: sorts before the multifactor priority (docs/fairshare.md)", "N"),
    _opt("nice", None, OPT, ("nice",), _nice,
         "lower the job's priority by N (default 100); negative N: admins only", "[N]"),
    # --- Phalanx extensions (stored; acted on by the fault-tolerance layer) ---
    _opt("all-nodes", None, N, ("all_nodes",), _const(all_nodes=True),
         "run the batch script on every node of the allocation (node rank in "
         "SLURM_NODEID), not once on the first node"),
    _opt("spares", None, R, ("spares",), _int_to("spares", 0),
         "extra nodes to keep allocated as hot spares", "N"),
    _opt("no-kill", "k", OPT, ("no_kill",), _no_kill,
         "keep the job running when one of its nodes fails: a spare (--spares) takes the "
         "lost node's place, its steps' tasks there start again (docs/elastic.md)", "off"),
    _opt("licenses", "L", R, ("licenses",), _licenses,
         "cluster-wide licences the job holds while it runs, e.g. fluent:2,matlab",
         "NAME[:N][,NAME[:N]]"),
    _opt("switches", None, R, ("switches", "switches_wait_s"), _switches,
         "pack the job under at most N leaf switches, waiting at most TIME for that "
         "(default 5 minutes) before ignoring it", "N[@TIME]"),
    _opt("spread", None, R, ("spread",), _level_to("spread"),
         "spread the job's nodes over the domains of this topology level, e.g. rack", "LEVEL"),
    _opt("group", None, R, ("group",), _level_to("group", "group name"),
         "the job's group, for --anti-affinity", "NAME"),
    _opt("anti-affinity", None, R, ("anti_affinity",), _level_to("anti_affinity"),
         "keep this job off every domain of LEVEL where a running job of its --group is",
         "LEVEL"),
    _opt("progress-timeout", None, R, ("progress_timeout_s",),
         _duration_to("progress_timeout_s"),
         "treat the job as hung when it reports no progress for this long", "TIME"),
    _opt("retries", None, R, ("retries",), _int_to("retries", 0),
         "retry a failed attempt at most N times (default: the cluster's retry.max_retries)",
         "N"),
    _opt("retry-on", None, R, ("retry_on",), _validated_raw("retry_on", policy.parse_retry_on),
         "failures that retry: node_fail,health,oom,timeout,launch,hang,exit (any code), "
         "exit:N, all or none", "KINDS"),
    _opt("retry-backoff", None, R, ("retry_backoff",),
         _validated_raw("retry_backoff", policy.parse_backoff),
         "seconds before a retry, doubling per retry up to MAX, e.g. 10:600", "BASE[:MAX]"),
    _opt("checkpoint-dir", None, R, ("checkpoint_dir",),
         _str_to("checkpoint_dir", "directory"), "where the job writes checkpoints", "DIR"),
    _opt("checkpoint-signal", None, R, ("checkpoint_signal",), _checkpoint_signal,
         "signal that asks the job to checkpoint (default USR1)", "SIG"),
    _opt("checkpoint-grace", None, R, ("checkpoint_grace_s",),
         _interval_to("checkpoint_grace_s"),
         "time between the checkpoint request and a planned stop, e.g. 2m", "DURATION"),
    _opt("checkpoint-interval", None, R, ("checkpoint_interval_s",), _checkpoint_interval,
         "ask for a checkpoint this often (e.g. 30m), or auto (Young/Daly)", "DURATION|auto"),
    # --- bookkeeping: kept and shown (account and QOS also weigh in fair share and limits) ---
    _opt("comment", None, R, ("comment",), _str_to("comment"), "free-text comment", "TEXT"),
    _opt("reservation", None, R, ("reservation",), _reservation,
         "run in this reservation, on its nodes only (scontrol show reservation)", "NAME"),
    _opt("begin", "b", R, ("begin_time",), _begin,
         "do not start before TIME: now+1hour, 16:00, 2026-12-24T08:00, tomorrow, ...",
         "TIME"),
    _opt("account", "A", R, ("account",), _str_to("account"),
         "account to charge (fair share, limits; docs/fairshare.md)", "ACCOUNT"),
    _opt("qos", "q", R, ("qos",), _str_to("qos"),
         "quality of service (priority, limits; docs/fairshare.md)", "QOS"),
    _opt("mail-user", None, R, ("mail_user",), _str_to("mail_user"),
         "mail address (recorded, no mail is sent)", "ADDRESS", Effect.STORED),
    _opt("mail-type", None, R, ("mail_type",), _str_to("mail_type"),
         "mail events (recorded, no mail is sent)", "EVENTS", Effect.STORED),
    # --- accepted for compatibility, no effect ---
    _ignored("acctg-freq"),
    _ignored("contiguous", arg=N),
    _ignored("core-spec", "S"),
    _ignored("cores-per-socket"),
    _ignored("cpu-bind"),
    _ignored("cpu-freq"),
    _ignored("deadline"),
    _ignored("delay-boot"),
    _ignored("distribution", "m"),
    _ignored("extra-node-info", "B"),
    _ignored("get-user-env", arg=OPT),
    _ignored("gpu-bind"),
    _ignored("gpu-freq"),
    _ignored("gres-flags"),
    _ignored("hint"),
    _ignored("ignore-pbs", arg=N),
    _ignored("immediate", "I", arg=OPT),
    _ignored("kill-on-invalid-dep"),
    _ignored("mcs-label"),
    _ignored("mem-bind"),
    _ignored("mincpus"),
    _ignored("network"),
    _ignored("ntasks-per-core"),
    _ignored("ntasks-per-socket"),
    _ignored("overcommit", "O", arg=N),
    _ignored("oversubscribe", "s", arg=N),
    _ignored("parsable", arg=N),
    _ignored("power"),
    _ignored("prefer"),
    _ignored("profile"),
    _ignored("propagate", arg=OPT),
    _ignored("quiet", "Q", arg=N),
    _ignored("reboot", arg=N),
    _ignored("sockets-per-node"),
    _ignored("spread-job", arg=N),
    _ignored("thread-spec"),
    _ignored("threads-per-core"),
    _ignored("time-min"),
    _ignored("tmp"),
    _ignored("use-min-nodes", arg=N),
    _ignored("verbose", "v", arg=N),
    _ignored("wait", "W", arg=N),
    _ignored("wait-all-nodes"),
    _ignored("wckey"),
    # --- Slurm options Phalanx cannot honour: refused, never silently dropped ---
    _refused("test-only", "--test-only would not submit, but a script line cannot stop the "
             "submission; give it on the command line (sbatch --test-only job.sh)", arg=N),
    _refused("ntasks-per-gpu", "not supported; use --ntasks-per-node and --gpus-per-task"),
    _refused("gpus-per-socket", "not supported; use --gpus-per-node"),
    _refused("tres-per-task", "not supported; use --cpus-per-task and --gpus-per-task"),
    _refused("clusters", "Phalanx schedules a single cluster; drop -M/--clusters", "M"),
    _refused("export-file", "not supported; use --export=ALL,VAR=value"),
    _refused("input", "stdin redirection is not supported; read the file in the script", "i"),
    _refused("nodefile", "node list files are not supported; use --nodelist", "F"),
    _refused("container", "OCI containers are not supported; run the container in the script"),
    _refused("uid", "submitting as another user is not supported"),
    _refused("gid", "submitting as another group is not supported"),
    _refused("batch", "features for the batch host alone are not supported; use --constraint"),
    _refused("bb", "burst buffers are not supported"),
    _refused("bbf", "burst buffers are not supported"),
    _refused("cluster-constraint", "Phalanx schedules a single cluster, not a federation"),
    # salloc's and srun's: refused there by name through this table (salloc builds its
    # allocation's spec here)
    _refused("x11", "X11 forwarding is not supported; use ssh -X to the node", arg=Arg.OPTIONAL),
)
# fmt: on


BY_LONG: dict[str, Option] = {opt.long: opt for opt in OPTIONS}
BY_SHORT: dict[str, Option] = {opt.short: opt for opt in OPTIONS if opt.short}
assert len(BY_LONG) == len(OPTIONS), "duplicate long option in OPTIONS"
assert len(BY_SHORT) == sum(1 for opt in OPTIONS if opt.short), "duplicate short option"


def find_option(name: str) -> Option | None:
    """Look up ``--name`` like getopt_long: exact match, else a unique prefix.

    Raises ValueError when the prefix is ambiguous (sbatch refuses those too).
    """
    if name in BY_LONG:
        return BY_LONG[name]
    matches = [opt for long, opt in BY_LONG.items() if long.startswith(name)]
    if len(matches) > 1:
        choices = ", ".join(opt.flag for opt in matches)
        raise ValueError(f"--{name} is ambiguous: could be {choices}; spell it out")
    return matches[0] if matches else None
