"""Turn `phalanx submit` arguments and a batch script into a JobSpec body (client side)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, BinaryIO

from phalanx.domain.directives import (
    COMMAND_LINE,
    parse_options,
    parse_submission,
    split_cli_args,
)
from phalanx.domain.sbatch_options import OPTIONS, Effect
from phalanx.errors import InvalidSpec

# The longest batch script read: what a controller stores (domain/spec.py refuses longer
# ones); a longer file, or an endless one (/dev/zero), is refused before it fills memory.
MAX_SCRIPT_READ = 4 * 1024 * 1024


def read_script(stream: BinaryIO, name: str) -> str:
    """A batch script's text from `stream`, at most MAX_SCRIPT_READ bytes, as UTF-8."""
    data = stream.read(MAX_SCRIPT_READ + 1)
    if len(data) > MAX_SCRIPT_READ:
        raise InvalidSpec(
            f"batch script {name} is longer than {MAX_SCRIPT_READ // (1024 * 1024)} MiB: keep "
            "the script small and read data files from it",
            field="script",
        )
    try:
        return data.decode()
    except UnicodeDecodeError as e:
        raise InvalidSpec(f"cannot read batch script {name}: not UTF-8 text ({e.reason})") from None


def build_spec(
    argv: list[str], *, cwd: str | None = None, environ: dict[str, str] | None = None
) -> tuple[dict[str, Any], list[str], list[str]]:
    """Return (spec body, warnings, options accepted without effect)."""
    opts, rest = split_cli_args(argv)
    # Options first: with `--typo VALUE script.sh` the value looks like the script, and the
    # user must hear about the unknown option, not about a missing file named VALUE.
    parse_options(opts, COMMAND_LINE)
    script_text: str | None = None
    script_path: str | None = None
    args: list[str] = []
    cwd = cwd or os.getcwd()
    if rest:
        path = Path(rest[0])
        if not path.is_absolute():
            path = Path(cwd) / path
        try:
            with path.open("rb") as f:
                script_text = read_script(f, rest[0])
        except FileNotFoundError:
            raise InvalidSpec(f"batch script {rest[0]} does not exist") from None
        except OSError as e:
            raise InvalidSpec(f"cannot read batch script {rest[0]}: {e.strerror or e}") from None
        script_path = str(path)
        args = rest[1:]
    parsed = parse_submission(script_text, opts, script_name=rest[0] if rest else "script")
    fields = dict(parsed.fields)
    spec: dict[str, Any] = {k: v for k, v in fields.items() if v is not None}
    if "time_limit_s" in fields and fields["time_limit_s"] is None:
        spec["time_limit_s"] = 0  # --time=UNLIMITED (absent would mean the partition default)
    spec["submit_dir"] = cwd
    spec.setdefault("submit_host", socket.gethostname())
    if script_text is not None:
        spec["script"] = script_text
        spec["script_path"] = script_path
        spec["argv"] = args
    spec["env"] = dict(environ if environ is not None else os.environ)
    if spec.get("workdir") and not os.path.isabs(spec["workdir"]):
        spec["workdir"] = os.path.join(cwd, spec["workdir"])
    return spec, list(parsed.warnings), list(parsed.ignored)


def options_help() -> str:
    lines = ["sbatch options understood by `phalanx submit` (and in #SBATCH / #PHX lines):", ""]
    for opt in OPTIONS:
        if opt.effect is Effect.APPLIED:
            lines.append(f"  {opt.usage:<36} {opt.help}")
    lines += ["", "Accepted with no effect here (site bookkeeping):"]
    own = ("--parsable", "--wait", "--test-only")  # the submit command's, listed below
    lines.append(
        "  "
        + ", ".join(
            o.flag
            for o in OPTIONS
            if o.effect in (Effect.STORED, Effect.IGNORED) and o.flag not in own
        )
    )
    lines += [
        "",
        "sbatch's own (the submit command acts on them): --parsable (print only the id),",
        "-W/--wait (return when the job ends, with its exit status), --test-only (validate,",
        "submit nothing; command line only)",
    ]
    refused = [o for o in OPTIONS if o.effect is Effect.REFUSED and o.flag not in own]
    if refused:
        lines += ["", "Refused (not supported):", "  " + ", ".join(o.flag for o in refused)]
    return "\n".join(lines)
