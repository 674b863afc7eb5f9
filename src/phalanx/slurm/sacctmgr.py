"""``sacctmgr``: accounts, users and QOS, as sites script them against Slurm 22.05.

    sacctmgr [-i] add account NAME[,NAME] [Parent=P] [Fairshare=N] [Description=..] [Organization=..]
    sacctmgr [-i] add user NAME Account=A[,B] [DefaultAccount=A] [Fairshare=N] [MaxJobs=N] ...
    sacctmgr [-i] add qos NAME [Priority=N] [MaxTRESPerUser=gres/gpu=N] [MaxWall=4:00:00] ...
    sacctmgr [-i] modify account|user|qos [where] COND... set KEY=VALUE...
    sacctmgr [-i] delete account|user|qos [where] NAME|COND...
    sacctmgr show|list assoc|user|account|qos [where COND...] [format=F[%W],...] [-P|-p] [-n]

Keys and entities are case-insensitive; a limit of -1 clears it. The limits Phalanx has are
mapped from Slurm's names (docs/fairshare.md, "Limits"; docs/slurm.md, "sacctmgr"); any other
Slurm key is refused by name, in one line. Changes go to `POST /v1/accounts/{add,modify,
delete}` (admins); without ``-i`` the change is shown first (a dry run) and committed only on
``y``, as Slurm asks ("Would you like to commit changes? (You have 30 seconds to decide)").
Listings read ``GET /v1/accounts``; their columns print as sacctmgr's (``-P``: ``|`` between
values, ``-p``: and after the last; ``-n``: no header; ``format=Name%W`` sets a width).
"""

from __future__ import annotations

import select
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from phalanx.slurm.common import (
    SlurmUsageError,
    acct_cell,
    client,
    duration_full,
    run_command,
)

PROG = "sacctmgr"
PROMPT_S = 30.0

VERBS = {
    "add": "add", "create": "add",
    "modify": "modify", "update": "modify",
    "delete": "delete", "remove": "delete",
    "show": "show", "list": "show",
}  # fmt: skip
ENTITIES = {
    "account": "account", "accounts": "account",
    "user": "user", "users": "user",
    "qos": "qos",
    "association": "assoc", "associations": "assoc", "assoc": "assoc", "assocs": "assoc",
}  # fmt: skip
# what sacctmgr manages that Phalanx does not (one line each, naming it)
UNSUPPORTED_ENTITIES = {
    "cluster": "one cluster per controller set, named by [cluster] name",
    "clusters": "one cluster per controller set, named by [cluster] name",
    "coordinator": "account coordinators",
    "event": "cluster events (`phalanx events` lists Phalanx's)",
    "federation": "federations",
    "problem": "association problems",
    "reservation": "reservations are `scontrol create|update|delete reservation`",
    "resource": "licence resources ([cluster] licenses in the configuration)",
    "runawayjobs": "runaway jobs (the store has no jobs apart from the controller's)",
    "stats": "slurmdbd statistics (`sdiag` shows the controller's)",
    "transaction": "the transaction log (`phalanx events` lists who changed what)",
    "transactions": "the transaction log (`phalanx events` lists who changed what)",
    "tres": "TRES (Phalanx counts CPUs and GPUs)",
    "wckey": "workload characterization keys",
    "wckeys": "workload characterization keys",
}
UNSUPPORTED_VERBS = ("archive", "dump", "load", "reconfigure", "shutdown", "clear")

# Slurm key (lowercase) -> Phalanx setting, per kind. GPU limits are TRES (gres/gpu=N).
_COMMON = {"fairshare": "shares", "share": "shares", "shares": "shares"}
_WALL = {"maxwall": "max_wall_s", "maxwalldurationperjob": "max_wall_s"}
SET_KEYS: dict[str, dict[str, str]] = {
    "account": {
        **_COMMON,
        **_WALL,
        "parent": "parent",
        "parentname": "parent",
        "description": "description",
        "descr": "description",
        "organization": "organization",
        "org": "organization",
        "grpjobs": "max_running_jobs",
        "grpsubmitjobs": "max_submit_jobs",
        "grpsubmit": "max_submit_jobs",
        "grptres": "max_gpus",
    },
    "user": {
        **_COMMON,
        **_WALL,
        "defaultaccount": "default_account",
        "defaccount": "default_account",
        "defacct": "default_account",
        "maxjobs": "max_running_jobs",
        "grpjobs": "max_running_jobs",
        "maxsubmitjobs": "max_submit_jobs",
        "maxsubmit": "max_submit_jobs",
        "grpsubmitjobs": "max_submit_jobs",
        "grpsubmit": "max_submit_jobs",
        "grptres": "max_gpus",
    },
    "qos": {
        **_WALL,
        "description": "description",
        "descr": "description",
        "priority": "priority",
        "prioritytier": "priority_tier",  # Phalanx's own: the QOS's preemption tier
        "preemptmode": "preempt_mode",
        "maxjobsperuser": "max_running_jobs",
        "maxjobspu": "max_running_jobs",
        "maxsubmitjobsperuser": "max_submit_jobs",
        "maxsubmitjobspu": "max_submit_jobs",
        "maxsubmitpu": "max_submit_jobs",
        "maxtresperuser": "max_gpus",
        "maxtrespu": "max_gpus",
    },
}
# Slurm keys with a near equivalent here: the refusal says which to use
HINTS = {
    ("account", "maxjobs"): "an account's limits count all its jobs: use GrpJobs=",
    ("account", "maxsubmitjobs"): "an account's limits count all its jobs: use GrpSubmitJobs=",
    ("account", "maxsubmit"): "an account's limits count all its jobs: use GrpSubmitJobs=",
    ("account", "maxtres"): "use GrpTRES=gres/gpu=N (GPUs in use by the account)",
    ("user", "maxtres"): "use GrpTRES=gres/gpu=N (GPUs in use by the user in the account)",
    ("qos", "grpjobs"): "a QOS's limits here are per user: use MaxJobsPerUser=",
    ("qos", "grptres"): "a QOS's limits here are per user: use MaxTRESPerUser=gres/gpu=N",
    ("qos", "maxtres"): "a QOS's limits here are per user: use MaxTRESPerUser=gres/gpu=N",
    ("qos", "preempt"): "preemption is by tier here: set PriorityTier=N on the QOS",
    ("account", "priority"): "priority is a QOS's here: sacctmgr modify qos NAME set Priority=N",
    ("user", "priority"): "priority is a QOS's here: sacctmgr modify qos NAME set Priority=N",
    ("account", "qos"): "every QOS is open to every association here",
    ("user", "qos"): "every QOS is open to every association here",
    ("account", "defaultqos"): "the default QOS is [fairshare] default_qos",
    ("user", "defaultqos"): "the default QOS is [fairshare] default_qos",
    ("user", "adminlevel"): "roles are tokens' (`phalanx token create --role`)",
}
# where keys (lowercase) -> the API's where field, per kind
WHERE_KEYS: dict[str, dict[str, str]] = {
    "account": {
        "name": "names", "names": "names", "account": "names", "accounts": "names",
        "acct": "names", "parent": "parents", "parentname": "parents",
    },
    "user": {
        "name": "names", "names": "names", "user": "names", "users": "names",
        "account": "accounts", "accounts": "accounts", "acct": "accounts",
        "defaultaccount": "accounts",
    },
    "qos": {"name": "names", "names": "names", "qos": "names"},
    "assoc": {
        "user": "users", "users": "users", "account": "accounts", "accounts": "accounts",
        "acct": "accounts",
    },
}  # fmt: skip
ADD_KEYS = {"account": "accounts", "accounts": "accounts", "acct": "accounts"}
NAME_KEYS = ("name", "names", "user", "users", "qos")


@dataclass
class Command:
    verb: str  # add modify delete show
    entity: str  # account user qos assoc
    names: list[str] = field(default_factory=list)
    where: dict[str, list[str]] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    accounts: list[str] = field(default_factory=list)  # add user: its accounts
    fields: list[tuple[str, int | None]] = field(default_factory=list)  # format=
    clusters: list[str] = field(default_factory=list)


@dataclass
class Options:
    immediate: bool = False
    header: bool = True
    sep: str | None = None  # "|" with -p/-P
    trailing: bool = False  # -p
    quiet: bool = False
    json: bool = False


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def parse_options(argv: Sequence[str]) -> tuple[Options, list[str]]:
    """sacctmgr's options (anywhere on the line, as getopt permutes them) and the rest."""
    o = Options()
    rest: list[str] = []
    for arg in argv:
        if arg in ("-i", "--immediate"):
            o.immediate = True
        elif arg in ("-n", "--noheader"):
            o.header = False
        elif arg in ("-p", "--parsable"):
            o.sep, o.trailing = "|", True
        elif arg in ("-P", "--parsable2"):
            o.sep, o.trailing = "|", False
        elif arg in ("-Q", "--quiet"):
            o.quiet = True
        elif arg in ("-r", "--readonly", "-v", "--verbose", "-s", "--associations"):
            pass  # readonly: no change is made without a change command anyway
        elif arg == "--json":
            o.json = True
        elif arg in ("-h", "--help", "--usage"):
            raise SystemExit(_usage())
        elif arg.startswith("-") and len(arg) > 1 and not arg.lstrip("-")[:1].isdigit():
            if not arg.startswith("--") and len(arg) > 2 and all(c in "inpPQrsv" for c in arg[1:]):
                sub, _ = parse_options([f"-{c}" for c in arg[1:]])
                o = _merge(o, sub, arg[1:])
                continue
            raise SlurmUsageError(f"unrecognized option '{arg}'\nTry \"sacctmgr --help\"")
        else:
            rest.append(arg)
    return o, rest


def _merge(o: Options, sub: Options, letters: str) -> Options:
    o.immediate |= sub.immediate
    o.header &= sub.header
    o.quiet |= sub.quiet
    if sub.sep is not None:
        o.sep, o.trailing = sub.sep, sub.trailing
    return o


def _usage() -> int:
    sys.stdout.write(__doc__.split("\n\n")[1] + "\n")
    return 0


def parse(words: Sequence[str]) -> Command:
    """The command of a sacctmgr line (options removed): verb, entity, names, where, set."""
    if not words:
        raise SlurmUsageError(
            "interactive mode is not supported here: give the command on the line "
            "(e.g. sacctmgr show assoc)"
        )
    verb_word = words[0].lower()
    if verb_word in UNSUPPORTED_VERBS:
        raise SlurmUsageError(f"'{words[0]}' is not supported here (add, modify, delete, show)")
    verb = VERBS.get(verb_word)
    if verb is None:
        raise SlurmUsageError(f"Invalid keyword: {words[0]}")
    if len(words) < 2:
        raise SlurmUsageError(f"No entity given to {verb_word}: account, user, qos or assoc")
    ent_word = words[1].lower()
    if ent_word in UNSUPPORTED_ENTITIES:
        raise SlurmUsageError(
            f"'{words[1]}' is not supported here ({UNSUPPORTED_ENTITIES[ent_word]})"
        )
    entity = ENTITIES.get(ent_word)
    if entity is None:
        raise SlurmUsageError(f"No valid entity in list command: {words[1]}")
    if entity == "assoc" and verb != "show":
        raise SlurmUsageError(
            f"{verb_word} of associations: use `sacctmgr {verb_word} user ...` (a user's "
            "associations) or `... account ...`"
        )
    cmd = Command(verb, entity)
    mode = "set" if verb == "add" else "where"
    for word in words[2:]:
        low = word.lower()
        if low == "where":
            mode = "where"
            continue
        if low == "set":
            if verb != "modify":
                raise SlurmUsageError(f"'set' is for modify, not {verb_word}")
            mode = "set"
            continue
        if low in ("withassoc", "withsubaccounts", "withcoordinators", "withdeleted", "tree"):
            continue  # listing flags: the listing is the same here
        key, eq, value = word.partition("=")
        if not eq:
            cmd.names += _split(word)
            continue
        key_low = key.strip().lower().rstrip("+-")
        if key.endswith(("+", "-")):
            raise SlurmUsageError(
                f"{key}=: adding to or removing from a list is not supported here"
            )
        if key_low == "format":
            cmd.fields += [parse_field(f) for f in _split(value)]
            continue
        if key_low in ("cluster", "clusters"):
            cmd.clusters += _split(value)
            continue
        if verb == "add" and entity == "user" and key_low in ADD_KEYS:
            cmd.accounts += _split(value)
            continue
        if verb == "add" and key_low in NAME_KEYS:
            cmd.names += _split(value)
            continue
        if mode == "set" and verb in ("add", "modify"):
            name, val = setting(entity, key, value)
            cmd.settings[name] = val
            continue
        where = WHERE_KEYS[entity].get(key_low)
        if where is None:
            known = sorted({k for k in WHERE_KEYS[entity]})
            raise SlurmUsageError(
                f"Unknown condition: {key}  (a {entity} is selected by: {', '.join(known)}; "
                "use keyword 'set' before what to change)"
            )
        cmd.where.setdefault(where, []).extend(_split(value))
    if cmd.names and verb != "add":
        key = "users" if entity == "assoc" else "names"
        cmd.where.setdefault(key, []).extend(cmd.names)
        cmd.names = []
    if verb == "add" and not cmd.names:
        raise SlurmUsageError(f"Need name of {entity} to add")
    if verb == "modify" and not cmd.settings:
        raise SlurmUsageError("No settings given to modify: `... where COND set KEY=VALUE`")
    if verb in ("modify", "delete") and not any(cmd.where.values()):
        raise SlurmUsageError(
            f"No conditions given: `sacctmgr {verb_word} {ent_word} where name=...`"
        )
    return cmd


def setting(kind: str, key: str, value: str) -> tuple[str, Any]:
    """One Slurm `KEY=VALUE` as a Phalanx setting; a key Phalanx lacks is refused by name."""
    low = key.strip().lower()
    name = SET_KEYS[kind].get(low)
    if name is None:
        hint = HINTS.get((kind, low))
        raise SlurmUsageError(
            f"{key} is not supported for a {kind} here"
            + (f": {hint}" if hint else f" (supported: {', '.join(supported(kind))})")
        )
    if name == "max_gpus":
        return name, tres_gpus(key, value)
    if name == "max_wall_s":
        return name, wall(key, value)
    if name in ("shares", "priority", "priority_tier", "max_running_jobs", "max_submit_jobs"):
        text = value.strip()
        if name == "shares" and text.lower() == "parent":
            raise SlurmUsageError("Fairshare=parent is not supported here: give a number")
        try:
            number = int(text)
        except ValueError:
            raise SlurmUsageError(f"{key}={value}: not a number") from None
        return name, number
    return name, value


def supported(kind: str) -> list[str]:
    names = {
        "shares": "Fairshare", "parent": "Parent", "description": "Description",
        "organization": "Organization", "default_account": "DefaultAccount",
        "priority": "Priority", "priority_tier": "PriorityTier", "preempt_mode": "PreemptMode",
        "max_wall_s": "MaxWall",
    }  # fmt: skip
    limits = {
        "account": {"max_running_jobs": "GrpJobs", "max_submit_jobs": "GrpSubmitJobs",
                    "max_gpus": "GrpTRES=gres/gpu=N"},
        "user": {"max_running_jobs": "MaxJobs", "max_submit_jobs": "MaxSubmitJobs",
                 "max_gpus": "GrpTRES=gres/gpu=N"},
        "qos": {"max_running_jobs": "MaxJobsPerUser", "max_submit_jobs": "MaxSubmitJobsPerUser",
                "max_gpus": "MaxTRESPerUser=gres/gpu=N"},
    }[kind]  # fmt: skip
    out = dict.fromkeys(SET_KEYS[kind].values())
    return [limits.get(k) or names[k] for k in out]


def tres_gpus(key: str, value: str) -> int | None:
    """`gres/gpu=N` (or `gres/gpu:TYPE=N`, `gpu=N`) as a GPU count; -1 clears. Other TRES
    (cpu, mem, node, billing) are refused by name."""
    if value.strip() == "-1":
        return None
    gpus: int | None = None
    found = False
    for part in _split(value):
        name, eq, count = part.partition("=")
        n = name.strip().lower()
        if not eq:
            raise SlurmUsageError(f"{key}={value}: give TRES as gres/gpu=N")
        if n in ("gres/gpu", "gpu") or n.startswith("gres/gpu:"):
            try:
                c = int(count)
            except ValueError:
                raise SlurmUsageError(f"{key}={value}: {count!r} is not a number") from None
            gpus, found = (None if c == -1 else c), True
        else:
            raise SlurmUsageError(
                f"{key}: TRES {name} is not limited here (only gres/gpu=N: GPUs in use)"
            )
    if not found:
        raise SlurmUsageError(f"{key}={value}: give TRES as gres/gpu=N")
    return gpus


def wall(key: str, value: str) -> int | None:
    from phalanx.domain import values

    text = value.strip()
    if text in ("-1", "") or text.upper() in ("UNLIMITED", "INFINITE"):
        return None
    try:
        seconds = values.parse_duration(text)
    except ValueError as e:
        raise SlurmUsageError(f"{key}={value}: {e}") from None
    return seconds


# ---------------------------------------------------------------------- listings
@dataclass(frozen=True)
class Col:
    header: str
    width: int
    get: Callable[[dict[str, Any]], str]


def _lim(key: str) -> Callable[[dict[str, Any]], str]:
    return lambda r: "" if r.get(key) is None else str(r[key])


def _gpus(r: dict[str, Any]) -> str:
    return "" if r.get("max_gpus") is None else f"gres/gpu={r['max_gpus']}"


def _wall(r: dict[str, Any]) -> str:
    return "" if r.get("max_wall_s") is None else duration_full(r["max_wall_s"])


def _acct_only(f: Callable[[dict[str, Any]], str]) -> Callable[[dict[str, Any]], str]:
    return lambda r: f(r) if not r.get("user") else ""


def _user_only(f: Callable[[dict[str, Any]], str]) -> Callable[[dict[str, Any]], str]:
    return lambda r: f(r) if r.get("user") else ""


def _blank(r: dict[str, Any]) -> str:
    return ""


ASSOC_COLS: dict[str, Col] = {
    "cluster": Col("Cluster", 10, lambda r: str(r["cluster"])),
    "account": Col("Account", 10, lambda r: str(r["account"])),
    "user": Col("User", 10, lambda r: str(r.get("user") or "")),
    "partition": Col("Partition", 10, _blank),
    "share": Col("Share", 9, lambda r: str(r["shares"])),
    "priority": Col("Priority", 10, _blank),
    "grpjobs": Col("GrpJobs", 7, _acct_only(_lim("max_running_jobs"))),
    "grptres": Col("GrpTRES", 13, _gpus),
    "grpsubmit": Col("GrpSubmit", 9, _acct_only(_lim("max_submit_jobs"))),
    "grpwall": Col("GrpWall", 11, _blank),
    "grptresmins": Col("GrpTRESMins", 13, _blank),
    "maxjobs": Col("MaxJobs", 7, _user_only(_lim("max_running_jobs"))),
    "maxtres": Col("MaxTRES", 13, _blank),
    "maxtrespernode": Col("MaxTRESPerNode", 14, _blank),
    "maxsubmit": Col("MaxSubmit", 9, _user_only(_lim("max_submit_jobs"))),
    "maxwall": Col("MaxWall", 11, _wall),
    "maxtresmins": Col("MaxTRESMins", 13, _blank),
    "qos": Col("QOS", 20, lambda r: str(r["qos"])),
    "defaultqos": Col("Def QOS", 9, _blank),
    "grptresrunmins": Col("GrpTRESRunMins", 13, _blank),
    "parentname": Col("Par Name", 10, lambda r: str(r.get("parent") or "")),
    "defaultaccount": Col("Def Acct", 10, lambda r: str(r.get("default_of") or "")),
}
ASSOC_DEFAULT = [
    "cluster", "account", "user", "partition", "share", "priority", "grpjobs", "grptres",
    "grpsubmit", "grpwall", "grptresmins", "maxjobs", "maxtres", "maxtrespernode", "maxsubmit",
    "maxwall", "maxtresmins", "qos", "defaultqos", "grptresrunmins",
]  # fmt: skip
ACCOUNT_COLS: dict[str, Col] = {
    "account": Col("Account", 10, lambda r: str(r["name"])),
    "description": Col("Descr", 20, lambda r: str(r["description"])),
    "organization": Col("Org", 20, lambda r: str(r["organization"])),
    "parentname": Col("Par Name", 10, lambda r: str(r["parent"])),
    "share": Col("Share", 9, lambda r: str(r["shares"])),
    "grpjobs": Col("GrpJobs", 7, _lim("max_running_jobs")),
    "grpsubmit": Col("GrpSubmit", 9, _lim("max_submit_jobs")),
    "grptres": Col("GrpTRES", 13, _gpus),
    "maxwall": Col("MaxWall", 11, _wall),
}
ACCOUNT_DEFAULT = ["account", "description", "organization"]
USER_COLS: dict[str, Col] = {
    "user": Col("User", 10, lambda r: str(r["user"])),
    "defaultaccount": Col("Def Acct", 10, lambda r: str(r["default_account"])),
    "adminlevel": Col("Admin", 9, lambda r: "None"),
    "account": Col("Account", 10, lambda r: str(r["accounts"])),
}
USER_DEFAULT = ["user", "defaultaccount", "adminlevel"]
QOS_COLS: dict[str, Col] = {
    "name": Col("Name", 10, lambda r: str(r["name"])),
    "priority": Col("Priority", 10, lambda r: str(r["priority"])),
    "gracetime": Col("GraceTime", 10, lambda r: "00:00:00"),
    "preempt": Col("Preempt", 10, _blank),
    "preemptexempttime": Col("PreemptExemptTime", 19, _blank),
    "preemptmode": Col("PreemptMode", 11, lambda r: str(r.get("preempt_mode") or "cluster")),
    "flags": Col("Flags", 10, _blank),
    "usagethreshold": Col("UsageThres", 10, _blank),
    "usagefactor": Col("UsageFactor", 11, lambda r: "1.000000"),
    "grptres": Col("GrpTRES", 13, _blank),
    "grptresmins": Col("GrpTRESMins", 13, _blank),
    "grptresrunmins": Col("GrpTRESRunMins", 13, _blank),
    "grpjobs": Col("GrpJobs", 7, _blank),
    "grpsubmitjobs": Col("GrpSubmit", 9, _blank),
    "grpwall": Col("GrpWall", 11, _blank),
    "maxtres": Col("MaxTRES", 13, _blank),
    "maxtrespernode": Col("MaxTRESPerNode", 14, _blank),
    "maxtresmins": Col("MaxTRESMins", 13, _blank),
    "maxwall": Col("MaxWall", 11, _wall),
    "maxtresperuser": Col("MaxTRESPU", 13, _gpus),
    "maxjobsperuser": Col("MaxJobsPU", 9, _lim("max_running_jobs")),
    "maxsubmitjobsperuser": Col("MaxSubmitPU", 11, _lim("max_submit_jobs")),
    "maxtresperaccount": Col("MaxTRESPA", 13, _blank),
    "maxjobsperaccount": Col("MaxJobsPA", 9, _blank),
    "maxsubmitjobsperaccount": Col("MaxSubmitPA", 11, _blank),
    "mintres": Col("MinTRES", 13, _blank),
    "description": Col("Descr", 11, lambda r: str(r["description"])),
    "prioritytier": Col("PriorityTier", 12, _lim("priority_tier")),
}
QOS_DEFAULT = [
    "name", "priority", "gracetime", "preempt", "preemptexempttime", "preemptmode", "flags",
    "usagethreshold", "usagefactor", "grptres", "grptresmins", "grptresrunmins", "grpjobs",
    "grpsubmitjobs", "grpwall", "maxtres", "maxtrespernode", "maxtresmins", "maxwall",
    "maxtresperuser", "maxjobsperuser", "maxsubmitjobsperuser", "maxtresperaccount",
    "maxjobsperaccount", "maxsubmitjobsperaccount", "mintres",
]  # fmt: skip
# other spellings sacctmgr takes for a column (lowercase)
ALIASES = {
    "fairshare": "share", "shares": "share", "acct": "account", "defqos": "defaultqos",
    "descr": "description", "org": "organization", "par name": "parentname",
    "parent": "parentname", "defacct": "defaultaccount", "admin": "adminlevel",
    "maxjobspu": "maxjobsperuser", "maxsubmitpu": "maxsubmitjobsperuser",
    "maxsubmitjobspu": "maxsubmitjobsperuser", "maxtrespu": "maxtresperuser",
    "maxjobspa": "maxjobsperaccount", "maxsubmitpa": "maxsubmitjobsperaccount",
    "maxtrespa": "maxtresperaccount", "grpsubmitjobs": "grpsubmit",
    "maxsubmitjobs": "maxsubmit", "maxwalldurationperjob": "maxwall", "usagethres": "usagethreshold",
    "names": "name", "users": "user", "accounts": "account", "qoslevel": "qos",
}  # fmt: skip
COLUMNS = {"assoc": ASSOC_COLS, "account": ACCOUNT_COLS, "user": USER_COLS, "qos": QOS_COLS}
DEFAULTS = {
    "assoc": ASSOC_DEFAULT,
    "account": ACCOUNT_DEFAULT,
    "user": USER_DEFAULT,
    "qos": QOS_DEFAULT,
}


def parse_field(spec: str) -> tuple[str, int | None]:
    """`Name` or `Name%W` (W: the width; negative: left-justified)."""
    name, pct, width = spec.partition("%")
    if pct:
        try:
            return name.strip(), int(width)
        except ValueError:
            raise SlurmUsageError(f"Unknown field '{spec}'") from None
    return name.strip(), None


def columns(entity: str, fields: Sequence[tuple[str, int | None]]) -> list[Col]:
    """The columns to print: `format=`'s (names case-insensitive, a unique prefix will do),
    else the entity's default ones."""
    table = COLUMNS[entity]
    if not fields:
        return [table[k] for k in DEFAULTS[entity]]
    out = []
    for name, width in fields:
        low = name.lower()
        key = ALIASES.get(low, low)
        if key not in table:
            found = [k for k in table if k.startswith(low)]
            if len(found) != 1:
                raise SlurmUsageError(f"Unknown field '{name}'")
            key = found[0]
        col = table[key]
        out.append(col if width is None else Col(col.header, width, col.get))
    return out


def render(cols: Sequence[Col], rows: Sequence[dict[str, Any]], o: Options) -> list[str]:
    """sacctmgr's print_fields: right-justified in their widths, `+` where cut; or `|`."""
    lines = []
    if o.sep is not None:
        end = o.sep if o.trailing else ""
        if o.header:
            lines.append(o.sep.join(c.header for c in cols) + end)
        lines += [o.sep.join(c.get(r) for c in cols) + end for r in rows]
        return lines
    if o.header:
        lines.append("".join(acct_cell(c.header, c.width) for c in cols).rstrip(" "))
        lines.append(" ".join("-" * abs(c.width) for c in cols))
    for r in rows:
        lines.append("".join(acct_cell(c.get(r), c.width) for c in cols).rstrip(" "))
    return lines


def rows_for(
    entity: str, data: dict[str, Any], where: dict[str, list[str]]
) -> list[dict[str, Any]]:
    """The rows of a listing (pure: `data` is `GET /v1/accounts`' answer)."""

    def want(key: str, value: str) -> bool:
        given = where.get(key)
        return not given or value in given

    if entity == "qos":
        return [q for q in data["qos"] if want("names", q["name"])]
    if entity == "account":
        return [
            a for a in data["accounts"] if want("names", a["name"]) and want("parents", a["parent"])
        ]
    if entity == "user":
        by_user: dict[str, dict[str, Any]] = {}
        for a in data["users"]:
            if not (want("names", a["user"]) and want("accounts", a["account"])):
                continue
            row = by_user.setdefault(
                a["user"], {"user": a["user"], "default_account": "", "accounts": ""}
            )
            if a["default"]:
                row["default_account"] = a["account"]
            row["accounts"] = ",".join(filter(None, [row["accounts"], a["account"]]))
        return sorted(by_user.values(), key=lambda r: r["user"])
    return assoc_rows(data, where)


def assoc_rows(data: dict[str, Any], where: dict[str, list[str]]) -> list[dict[str, Any]]:
    """Associations as Slurm lists them: root, then the tree depth first (an account, its
    users, its sub-accounts), each row with its cluster and the QOS it may use."""
    qos = ",".join(sorted(q["name"] for q in data["qos"]))
    cluster = data["cluster"]
    accounts = data["accounts"]
    kids: dict[str, list[dict[str, Any]]] = {}
    for a in accounts:
        kids.setdefault(a["parent"], []).append(a)
    users: dict[str, list[dict[str, Any]]] = {}
    for u in data["users"]:
        users.setdefault(u["account"], []).append(u)
    default_of = {u["user"]: u["account"] for u in data["users"] if u["default"]}
    out: list[dict[str, Any]] = []
    base = {"cluster": cluster, "qos": qos}
    out.append({**base, "account": "root", "user": "", "shares": 1, "parent": ""})

    def walk(parent: str, seen: set[str]) -> None:
        for a in sorted(kids.get(parent, []), key=lambda a: a["name"]):
            if a["name"] in seen:
                continue
            seen.add(a["name"])
            out.append({**base, **a, "account": a["name"], "user": ""})
            for u in sorted(users.get(a["name"], []), key=lambda u: u["user"]):
                out.append(
                    {**base, **u, "parent": a["name"], "default_of": default_of.get(u["user"])}
                )
            walk(a["name"], seen)

    walk("root", set())
    wanted_users = set(where.get("users") or ())
    wanted_accts = set(where.get("accounts") or ())
    return [
        r
        for r in out
        if (not wanted_accts or r["account"] in wanted_accts)
        and (not wanted_users or r["user"] in wanted_users)
    ]


# ---------------------------------------------------------------------- changes in words
def describe(cmd: Command, result: dict[str, Any], cluster: str) -> list[str]:
    """What sacctmgr prints about a change (from the API's list of changes)."""
    changes = result["changes"]
    lines: list[str] = []
    if cmd.verb == "add":
        if cmd.entity == "account":
            lines.append(" Adding Account(s)")
            lines += [f"  {c['key'][0]}" for c in changes]
            s = changes[0]["settings"] if changes else {}
            lines += [
                " Settings",
                f"  Description     = {s.get('description', '')}",
                f"  Organization    = {s.get('organization', '')}",
                " Associations",
            ]
            lines += [f"  A = {c['key'][0]:<10} C = {cluster:<10}" for c in changes]
            lines += [" Settings", f"  Parent        = {s.get('parent', 'root')}"]
            lines += _limit_lines(cmd.entity, s)
        elif cmd.entity == "user":
            lines.append(" Adding User(s)")
            lines += [f"  {u}" for u in dict.fromkeys(c["key"][1] for c in changes)]
            lines += [" Settings =", f"  Default Account = {_default(cmd)}", " Associations ="]
            lines += [
                f"  U = {c['key'][1]:<9} A = {c['key'][0]:<10} C = {cluster:<10}" for c in changes
            ]
            extra = _limit_lines(cmd.entity, changes[0]["settings"] if changes else {})
            if extra:
                lines += [" Non Default Settings", *extra]
        else:
            lines.append(" Adding QOS(s)")
            lines += [f"  {c['key'][0]}" for c in changes]
            s = changes[0]["settings"] if changes else {}
            lines += [" Settings", f"  Description    = {s.get('description', '')}"]
            lines += _limit_lines(cmd.entity, s)
    elif cmd.verb == "modify":
        if cmd.entity == "qos":
            lines.append(" Modified qos...")
            lines += [f"  {c['key'][0]}" for c in changes]
        elif cmd.entity == "account":
            plain = set(cmd.settings) <= {"description", "organization"}
            lines.append(" Modified accounts..." if plain else " Modified account associations...")
            lines += [
                f"  {c['key'][0]}" if plain else f"  C = {cluster:<10} A = {c['key'][0]:<10}"
                for c in changes
            ]
        else:
            lines.append(" Modified user associations...")
            lines += [
                f"  C = {cluster:<10} A = {c['key'][0]:<10} U = {c['key'][1]:<9}" for c in changes
            ]
    else:
        if cmd.entity == "qos":
            lines.append(" Deleting QOS(s)...")
            lines += [f"  {c['key'][0]}" for c in changes]
        elif cmd.entity == "account":
            lines.append(" Deleting accounts...")
            lines += [f"  {c['key'][0]}" for c in changes]
        elif not cmd.where.get("accounts"):
            lines.append(" Deleting users...")
            lines += [f"  {u}" for u in dict.fromkeys(c["key"][1] for c in changes)]
        else:
            lines.append(" Deleting user associations...")
            lines += [
                f"  C = {cluster:<10} A = {c['key'][0]:<10} U = {c['key'][1]:<9}" for c in changes
            ]
    return [line.rstrip() for line in lines]


def _default(cmd: Command) -> str:
    return str(cmd.settings.get("default_account") or (cmd.accounts[0] if cmd.accounts else ""))


_SAY = {
    "shares": "Fairshare",
    "priority": "Priority",
    "priority_tier": "PriorityTier",
    "preempt_mode": "PreemptMode",
}


def _limit_lines(kind: str, s: dict[str, Any]) -> list[str]:
    names = {
        "account": {"max_running_jobs": "GrpJobs", "max_submit_jobs": "GrpSubmitJobs",
                    "max_gpus": "GrpTRES", "max_wall_s": "MaxWall"},
        "user": {"max_running_jobs": "MaxJobs", "max_submit_jobs": "MaxSubmitJobs",
                 "max_gpus": "GrpTRES", "max_wall_s": "MaxWall"},
        "qos": {"max_running_jobs": "MaxJobsPU", "max_submit_jobs": "MaxSubmitPU",
                "max_gpus": "MaxTRESPU", "max_wall_s": "MaxWall"},
    }[kind]  # fmt: skip
    out = []
    for key, value in s.items():
        label = _SAY.get(key) or names.get(key)
        if label is None or value is None:
            continue
        if key == "max_gpus":
            value = f"gres/gpu={value}"
        elif key == "max_wall_s":
            value = duration_full(value)
        out.append(f"  {label:<13} = {value}")
    return out


# ---------------------------------------------------------------------- running
def confirm(stdin: Any = None, timeout: float = PROMPT_S) -> bool:
    """Slurm's commit_check: ask, wait up to 30 s for a line; only y/Y commits. End of input
    is a no (Slurm's would ask again forever)."""
    stdin = stdin or sys.stdin
    sys.stdout.write("Would you like to commit changes? (You have 30 seconds to decide)\n")
    while True:
        sys.stdout.write("(N/y): ")
        sys.stdout.flush()
        try:
            ready, _, _ = select.select([stdin], [], [], timeout)
        except (OSError, ValueError, TypeError):
            ready = [stdin]  # not a selectable stream (tests): just read it
        if not ready:
            sys.stdout.write("timeout\n")
            return False
        line = stdin.readline()
        sys.stdout.write("\n")
        if not line:
            return False
        answer = line.strip()[:1]
        if answer in ("y", "Y"):
            return True
        if answer in ("n", "N", ""):
            return False
        sys.stdout.write("Y or N please\n")


def body(cmd: Command, dry_run: bool) -> dict[str, Any]:
    return {
        "kind": cmd.entity,
        "names": cmd.names,
        "accounts": cmd.accounts,
        "where": cmd.where,
        "settings": cmd.settings,
        "dry_run": dry_run,
    }


def main(argv: list[str]) -> int:
    return run_command(PROG, _main, argv)


def _main(argv: list[str]) -> int:
    import json

    o, words = parse_options(argv)
    cmd = parse(words)
    with client() as c:
        if cmd.clusters:
            mine = str(c.get("/v1/whoami")["cluster"])
            other = [n for n in cmd.clusters if n != mine and n.lower() != "all"]
            if other:
                raise SlurmUsageError(f"cluster '{other[0]}' is unknown here: this is '{mine}'")
        if cmd.verb == "show":
            data = c.get("/v1/accounts")
            if o.json:
                print(json.dumps(data, indent=2))
                return 0
            cols = columns(cmd.entity, cmd.fields)
            for line in render(cols, rows_for(cmd.entity, data, cmd.where), o):
                print(line)
            return 0
        path = f"/v1/accounts/{cmd.verb}"
        cluster = str(c.get("/v1/whoami")["cluster"])
        if not o.immediate:
            preview = c.post(path, body(cmd, True))
            if not o.quiet:
                print("\n".join(describe(cmd, preview, cluster)))
            if not confirm():
                print(" Changes Discarded")
                return 0
        result = c.post(path, body(cmd, False))
        if o.json:
            print(json.dumps(result, indent=2))
        elif o.immediate and not o.quiet:
            print("\n".join(describe(cmd, result, cluster)))
    return 0
