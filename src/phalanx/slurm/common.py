"""What every Slurm front end shares: option parsing with Slurm's errors, time and state forms.

Tools parse what these commands print, so the forms here are Slurm's own:

* durations (``squeue %M``/``%l``, ``sacct Elapsed``/``Timelimit``): ``M:SS``, ``H:MM:SS``,
  ``D-HH:MM:SS``; ``UNLIMITED`` for no limit, ``INVALID`` for a negative time;
* timestamps: local ``YYYY-MM-DDTHH:MM:SS``, ``N/A`` (squeue) or ``Unknown`` (sacct) when unset;
* states: Phalanx's states named as Slurm's (``HELD`` is ``PENDING`` with a held reason,
  ``STARTING`` is ``CONFIGURING``), with Slurm's compact codes (``PD``, ``R``, ``CG``, ...).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from phalanx.domain.states import TERMINAL
from phalanx.errors import PhalanxError

if TYPE_CHECKING:
    from phalanx.api_calls import ApiCalls
    from phalanx.lean_client import LeanClient

# Phalanx state -> Slurm state name (what squeue %T and sacct State print).
SLURM_STATE = {
    "PENDING": "PENDING",
    "HELD": "PENDING",
    "STARTING": "CONFIGURING",
    "RUNNING": "RUNNING",
    "COMPLETING": "COMPLETING",
    "COMPLETED": "COMPLETED",
    "FAILED": "FAILED",
    "CANCELLED": "CANCELLED",
    "TIMEOUT": "TIMEOUT",
    "NODE_FAIL": "NODE_FAIL",
    "OUT_OF_MEMORY": "OUT_OF_MEMORY",
}
# What sacct prints: accounting has a job RUNNING from its allocation on (Slurm's CONFIGURING is
# a flag that squeue shows while nodes boot). Tools poll sacct and take any state they do not
# know as final: submitit's list of unfinished states has no CONFIGURING, so a job caught
# STARTING was written off as over before it ran.
ACCT_STATE = {**SLURM_STATE, "STARTING": "RUNNING"}
# Slurm state name -> its compact code (squeue %t, -t accepts either).
STATE_CODE = {
    "PENDING": "PD",
    "RUNNING": "R",
    "CONFIGURING": "CF",
    "COMPLETING": "CG",
    "COMPLETED": "CD",
    "FAILED": "F",
    "CANCELLED": "CA",
    "TIMEOUT": "TO",
    "NODE_FAIL": "NF",
    "OUT_OF_MEMORY": "OOM",
    "PREEMPTED": "PR",
    "SUSPENDED": "S",
    "BOOT_FAIL": "BF",
    "DEADLINE": "DL",
    "REQUEUED": "RQ",
    "REQUEUE_HOLD": "RH",
    "RESV_DEL_HOLD": "RD",
    "REQUEUE_FED": "RF",
    "RESIZING": "RS",
    "REVOKED": "RV",
    "SIGNALING": "SI",
    "SPECIAL_EXIT": "SE",
    "STAGE_OUT": "SO",
    "STOPPED": "ST",
}


class SlurmUsageError(Exception):
    """Bad command-line use: printed as ``CMD: error: ...`` with exit code 1, as Slurm does."""


class SlurmFatal(SlurmUsageError):
    """Bad use that Slurm's command reports as fatal: ``CMD: fatal: ...``, exit code 1."""


class AmbiguousOption(SlurmUsageError):
    """A long-option prefix that more than one option starts with: printed as getopt_long
    prints it for Slurm's commands (``squeue: option '--st' is ambiguous; possibilities:
    '--start' '--steps' '--states'``, then ``Try "squeue --help" ...``), exit code 1."""


class SlurmParser(argparse.ArgumentParser):
    """argparse with Slurm's manners: errors are one line naming the option, exit code 1.

    Long options may be shortened to any unique prefix, as Slurm's commands take them
    (getopt_long: ``squeue --noh --form=%i``, scripts written against Slurm do it), and an
    exact name wins over the longer ones it starts; an ambiguous prefix is refused with
    getopt_long's message (`AmbiguousOption`).
    """

    def __init__(self, prog: str, **kw: Any) -> None:
        kw.setdefault("allow_abbrev", True)
        super().__init__(prog=prog, **kw)

    def error(self, message: str) -> NoReturn:
        m = re.fullmatch(r"ambiguous option: (\S+) could match (.+)", message)
        if m:
            options = " ".join(f"'{o}'" for o in m.group(2).split(", "))
            raise AmbiguousOption(f"option '{m.group(1)}' is ambiguous; possibilities: {options}")
        raise SlurmUsageError(message)


def fail(prog: str, message: str, code: int = 1) -> NoReturn:
    """Print Slurm's one-line error (``squeue: error: ...``) and exit."""
    sys.stderr.write(f"{prog}: error: {message}\n")
    sys.exit(code)


def run_command(prog: str, body: Any, argv: Sequence[str]) -> int:
    """Call ``body(argv)``; usage and client errors become one line and exit code 1."""
    try:
        return int(body(list(argv)) or 0)
    except AmbiguousOption as e:
        sys.stderr.write(f'{prog}: {e}\nTry "{prog} --help" for more information\n')
        return 1
    except SlurmFatal as e:
        sys.stderr.write(f"{prog}: fatal: {e}\n")
        return 1
    except SlurmUsageError as e:
        sys.stderr.write(f"{prog}: error: {e}\n")
        return 1
    except PhalanxError as e:
        sys.stderr.write(f"{prog}: error: {e.message}\n")
        return 1
    except ValueError as e:  # a value the parsers read (a hostlist, a time) and refused
        sys.stderr.write(f"{prog}: error: {e}\n")
        return 1
    except BrokenPipeError:  # `squeue | head`: the reader went away, which is not an error
        return 0


def client() -> LeanClient:
    """The client of the one-shot commands: the standard library's HTTP, with the same
    credentials ($PHALANX_URL, the local credential socket or a token), failover, calls and
    errors as `phalanx`'s (`phalanx.api_calls`). httpx alone took 60-70 ms of every call's
    start-up (bench/cli.py), which a loop of `sbatch` or a tool polling `squeue` pays each time."""
    from phalanx.lean_client import LeanClient

    return LeanClient()


def slurm_state(state: str) -> str:
    return SLURM_STATE.get(state, state)


def acct_state(state: str) -> str:
    """sacct's name for a Phalanx job state (see ACCT_STATE)."""
    return ACCT_STATE.get(state, state)


def state_code(state: str) -> str:
    return STATE_CODE.get(slurm_state(state), slurm_state(state)[:2])


def parse_states(text: str) -> set[str]:
    """``-t``/``--state`` values (names or codes, any case, comma list; ``all``) to Slurm names.

    Raises SlurmUsageError naming an unknown state, as squeue and sacct refuse them.
    """
    names = set(STATE_CODE)
    by_code = {code: name for name, code in STATE_CODE.items()}
    out: set[str] = set()
    for raw in text.split(","):
        word = raw.strip().upper()
        if not word:
            continue
        if word == "ALL":
            return set(names)
        if word in names:
            out.add(word)
        elif word in by_code:
            out.add(by_code[word])
        else:
            raise SlurmUsageError(f"Invalid job state specified: {raw.strip()}")
    return out


def phalanx_states(slurm_names: set[str], names: dict[str, str] = SLURM_STATE) -> list[str]:
    """The Phalanx states that show as these Slurm states (as squeue names them, or sacct
    with `names=ACCT_STATE`)."""
    return sorted(p for p, s in names.items() if s in slurm_names)


def _parts(seconds: float) -> tuple[int, int, int, int]:
    s = int(seconds)
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    return days, hours, minutes, s


def duration(seconds: float | None, *, unlimited: bool = False) -> str:
    """Slurm's duration form: ``0:00``, ``5:07``, ``1:02:03``, ``2-03:04:05``.

    ``None`` is ``UNLIMITED`` when ``unlimited`` (time limits), else ``0:00``.
    """
    if seconds is None:
        return "UNLIMITED" if unlimited else "0:00"
    if seconds < 0:
        return "INVALID"
    days, hours, minutes, s = _parts(seconds)
    if days:
        return f"{days}-{hours:02d}:{minutes:02d}:{s:02d}"
    if hours:
        return f"{hours}:{minutes:02d}:{s:02d}"
    return f"{minutes}:{s:02d}"


def duration_full(seconds: float | None, *, unlimited: bool = False) -> str:
    """sacct's fixed form: ``HH:MM:SS`` or ``D-HH:MM:SS`` (``00:00:05``, ``1-00:00:00``)."""
    if seconds is None:
        return "UNLIMITED" if unlimited else "00:00:00"
    if seconds < 0:
        return "INVALID"
    days, hours, minutes, s = _parts(seconds)
    if days:
        return f"{days}-{hours:02d}:{minutes:02d}:{s:02d}"
    return f"{hours:02d}:{minutes:02d}:{s:02d}"


def timestamp(t: float | None, missing: str = "N/A") -> str:
    """Local ``YYYY-MM-DDTHH:MM:SS`` (Slurm's default time format), ``missing`` when unset."""
    if t is None:
        return missing
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t))


def job_id_text(job: dict[str, Any]) -> str:
    """A job's id as Slurm prints it: ``12`` or, for an array task, ``12_3``."""
    if job.get("array_job_id") is not None and job.get("array_task_id") is not None:
        return f"{job['array_job_id']}_{job['array_task_id']}"
    return str(job["job_id"])


# ---------------------------------------------------------------------------------------------
# Output formats shared by squeue and sinfo: `-o "%.18i %9P ..."` and `-O "JobID:10,Name"`.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """One field of an output format: what to print, how wide, which side, and the text after.

    ``width`` 0 prints the value whole; otherwise the value is cut to ``width`` and padded,
    on the left when ``right`` (``%.8j``), else on the right (``%8j``), as Slurm's
    ``_print_str`` does.
    """

    key: str
    width: int = 0
    right: bool = False
    suffix: str = ""


def parse_format(
    text: str, known: Collection[str], prog: str = "squeue"
) -> tuple[str, list[Field]]:
    """Parse a ``%[.][width]x`` format into (text before the first field, fields).

    Literal text after a field is kept as that field's suffix (``"%i %j"``: ``%i`` has the
    suffix ``" "``); ``%%`` is a literal percent. Raises SlurmUsageError for a letter not in
    ``known``.
    """
    prefix = ""
    fields: list[Field] = []
    i = 0
    lit = ""

    def flush_literal() -> None:
        nonlocal prefix
        if not lit:
            return
        if fields:
            last = fields[-1]
            fields[-1] = Field(last.key, last.width, last.right, last.suffix + lit)
        else:
            prefix += lit

    while i < len(text):
        ch = text[i]
        if ch != "%":
            lit += ch
            i += 1
            continue
        if text[i + 1 : i + 2] == "%":
            lit += "%"
            i += 2
            continue
        flush_literal()
        lit = ""
        i += 1
        right = False
        if text[i : i + 1] == ".":
            right = True
            i += 1
        digits = ""
        while i < len(text) and text[i].isdecimal():
            digits += text[i]
            i += 1
        if i >= len(text):
            raise SlurmUsageError(f"Invalid format specification: {text} (it ends in a bare %)")
        key = text[i]
        i += 1
        if key not in known:
            raise SlurmUsageError(
                f"Invalid format specification: %{key} is not a {prog} field known here "
                f"(known: {' '.join('%' + k for k in sorted(known))})"
            )
        fields.append(Field(key, int(digits) if digits else 0, right))
    flush_literal()
    return prefix, fields


def parse_long_format(
    text: str, known: Mapping[str, str], default_width: int = 20, prog: str = "squeue"
) -> list[Field]:
    """Parse ``-O``/``--Format``: ``name[:[.][width][suffix]]`` comma list, any case.

    ``known`` maps lower-case field names to the key the printer uses. A field without a
    width gets ``default_width`` (Slurm's is 20), left-justified, no separator: the padding is
    the separator, unless a suffix (text after the width) is given.
    """
    fields: list[Field] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        name, _, size = item.partition(":")
        key = known.get(name.strip().lower())
        if key is None:
            raise SlurmUsageError(f"Invalid job format specification: {name.strip()}")
        right = size.startswith(".")
        size = size[1:] if right else size
        digits = size[: len(size) - len(size.lstrip("0123456789"))]
        suffix = size[len(digits) :]  # Slurm's "type[:[.][size][suffix]]"
        width = int(digits) if digits else default_width
        fields.append(Field(key, width, right, suffix))
    if not fields:
        raise SlurmUsageError("Invalid job format specification: empty")
    return fields


def cell(value: str, f: Field) -> str:
    """One value printed as Slurm prints a field: cut to the width and padded (or whole)."""
    if f.width <= 0:
        return value + f.suffix
    value = value[: f.width]
    return (value.rjust(f.width) if f.right else value.ljust(f.width)) + f.suffix


def render_line(prefix: str, fields: Sequence[Field], values: Mapping[str, str]) -> str:
    """A whole line (no trailing newline). Trailing blanks are kept: Slurm prints them."""
    return prefix + "".join(cell(values[f.key], f) for f in fields)


def line_template(prefix: str, fields: Sequence[Field]) -> str:
    """`render_line` as one ``str.format`` template (positional, one per field): a listing
    of thousands of lines (squeue) formats each in one call. ``{:<W.W}`` cuts to W and pads
    as `cell` does."""

    def literal(text: str) -> str:
        return text.replace("{", "{{").replace("}", "}}")

    parts = [literal(prefix)]
    for i, f in enumerate(fields):
        side = ">" if f.right else "<"
        parts.append(f"{{{i}}}" if f.width <= 0 else f"{{{i}:{side}{f.width}.{f.width}}}")
        parts.append(literal(f.suffix))
    return "".join(parts)


def split_list(values: Sequence[str] | None) -> list[str]:
    """Repeated and comma-separated option values (``-u a,b -u c``) as one list."""
    return [x.strip() for v in values or [] for x in v.split(",") if x.strip()]


def refuse(parser: SlurmParser, *flags: str, why: str, nargs: str | int | None = None) -> None:
    """Add options Slurm has but these commands cannot honour: naming one fails in one line.

    Taking them as options (not leaving them unknown) makes the error say why, e.g.
    ``squeue: error: --iterate is not supported here: run squeue in a loop``.
    """

    class _Refuse(argparse.Action):
        def __call__(self, p: Any, ns: Any, values: Any, option: str | None = None) -> None:
            raise SlurmUsageError(f"{option or flags[0]} is not supported here: {why}")

    kw: dict[str, Any] = {"nargs": nargs} if nargs is not None else {}
    parser.add_argument(*flags, action=_Refuse, help=argparse.SUPPRESS, **kw)


def add_clusters(parser: SlurmParser) -> None:
    """``-M/--clusters NAMES``: the clusters to ask, as Slurm takes them. Phalanx runs one
    cluster per controller set, so NAMES must name it (its ``cluster.name``) or be ``all``;
    workflow tools pass ``--clusters all`` on every call (the Snakemake Slurm executor's
    ``sacct``), and a refusal there left their jobs finished but never seen."""
    parser.add_argument("-M", "--clusters", dest="clusters")


def check_clusters(c: Any, names: str | None) -> str | None:
    """The cluster's name when ``-M/--clusters`` was given and names it (or ``all``); None
    when it was not given. Another name fails as Slurm fails an unknown cluster."""
    if names is None:
        return None
    mine = str(c.get("/v1/whoami")["cluster"])
    for name in (n.strip() for n in names.split(",")):
        if name.lower() != "all" and name != mine:
            raise SlurmUsageError(
                f"'{name}' can't be reached now, or it is an invalid entry for --cluster.  "
                f"This cluster is '{mine}' (or use 'all')."
            )
    return mine


# ---------------------------------------------------------------------------------------------
# sbatch's own flags (also `phalanx submit`'s): what sbatch does, not what the job asks for.
# ---------------------------------------------------------------------------------------------


@dataclass
class SubmitFlags:
    """``--parsable`` (print only the id), ``--wait``/``-W`` (return when the job ends, with
    its exit status), ``--test-only`` (validate, submit nothing)."""

    parsable: bool = False
    wait: bool = False
    test_only: bool = False
    clusters: str | None = None  # -M/--clusters: check_clusters


_CLUSTERS = ("-M", "--clusters")


_FLAG_TOKENS = {
    "--parsable": "parsable",
    "--wait": "wait",
    "-W": "wait",
    "--test-only": "test_only",
}


def split_submit_flags(argv: Sequence[str]) -> tuple[SubmitFlags, list[str]]:
    """Take sbatch's own flags out of the options (before the script), keep the rest as is.

    Only the options part is looked at (``split_cli_args`` finds where it ends), so a script
    argument spelled ``--wait`` stays the script's.
    """
    from phalanx.domain.directives import split_cli_args

    opts, rest = split_cli_args(list(argv))
    flags = SubmitFlags()
    kept: list[str] = []
    tokens = iter(opts)
    for token in tokens:
        name = _FLAG_TOKENS.get(token)
        if token in _CLUSTERS:
            flags.clusters = next(tokens, "")
        elif token.startswith("--clusters="):
            flags.clusters = token.partition("=")[2]
        elif token.startswith("-M") and not token.startswith("--"):
            flags.clusters = token[2:]
        elif name is None:
            kept.append(token)
        else:
            setattr(flags, name, True)
    if len(opts) < len(argv) - len(rest):  # a "--" separated options from the script
        kept.append("--")
    return flags, kept + rest


def script_submit_flags(script_text: str, flags: SubmitFlags) -> SubmitFlags:
    """``#SBATCH --parsable`` / ``--wait`` in the script header count as on the command line."""
    from phalanx.domain.directives import script_directives

    try:
        lines = script_directives(script_text)
    except PhalanxError:
        return flags  # build_spec reports the bad line
    for _, tokens in lines:
        for token in tokens:
            name = _FLAG_TOKENS.get(token)
            if name in ("parsable", "wait"):
                setattr(flags, name, True)
    return flags


def script_file_flags(argv: Sequence[str], flags: SubmitFlags) -> SubmitFlags:
    """``script_submit_flags`` for the script file named in ``argv`` (options, script, args)."""
    from phalanx.domain.directives import split_cli_args

    _, rest = split_cli_args(list(argv))
    if not rest:
        return flags
    from phalanx.submitting import read_script

    try:
        with Path(rest[0]).open("rb") as f:
            text = read_script(f, rest[0])
    except (OSError, PhalanxError):
        return flags  # build_spec says what is wrong with it
    return script_submit_flags(text, flags)


TERMINAL_STATES = frozenset(s.value for s in TERMINAL)


def wait_exit_code(jobs: Sequence[dict[str, Any]]) -> int:
    """``sbatch --wait``'s exit status: 0 when every job (array task) COMPLETED, else the
    highest exit code of the others, or 1 when they have none (cancelled, node failure)."""
    failed = [j for j in jobs if j["state"] != "COMPLETED"]
    if not failed:
        return 0
    codes = [int(j.get("exit_code") or 0) for j in failed]
    return max(codes) if max(codes) > 0 else 1


def wait_for_jobs(c: ApiCalls, ref: str | int, poll: float = 0.25) -> list[dict[str, Any]]:
    """Block until every job of ``ref`` (an array: all its tasks) has ended; their records."""
    delay = poll
    while True:
        jobs = c.job(ref)
        if jobs and all(j["state"] in TERMINAL_STATES for j in jobs):
            return jobs
        time.sleep(delay)
        delay = min(delay * 1.5, 2.0)


def acct_cell(value: Any, width: int) -> str:
    """One column: right-justified (left for a negative width), a value too long cut to the
    width with `+` as its last character, as sacct and sstat do (squeue and sinfo: `cell`)."""
    text = str(value)
    n = abs(width)
    if len(text) > n:
        text = text[: n - 1] + "+" if n > 1 else "+"
    return f"{text:<{n}} " if width < 0 else f"{text:>{n}} "
