"""Parsing sbatch options, from ``#SBATCH``/``#PHX`` script lines and from ``phalanx
submit``'s argv.

One table (``OPTIONS``, in domain/sbatch_options.py with the value converters) drives both, so
a script line and the command line accept exactly the same spellings, and the CLI prints its
help from the same rows; this module holds the parsing rules.  The rules follow sbatch,
because users arrive with Slurm scripts that must run unchanged or be refused *before*
submission with a message naming the line and the reason:

* directives are read from the header only: parsing stops at the first line that is neither
  blank nor a comment (the shebang is a comment); later ``#SBATCH`` lines are ignored, as
  sbatch does, but we warn because that is almost always a mistake;
* command-line options override the script's (``--mem`` on the command line replaces a
  script's ``--mem-per-cpu``, since the two are mutually exclusive);
* unknown options are refused, as sbatch refuses them, naming the line and the nearest
  known spelling: a typo such as ``--ntask-per-node=2`` would otherwise run a different job
  than the one asked for; known Slurm options that would change what the job does
  and that Phalanx cannot honour (``--begin``, ``--ntasks-per-gpu``, ...) are refused, because
  running such a job anyway would silently produce a different result;
* site bookkeeping options (``--mail-type``, ``--comment``, ...) are accepted; those that
  have no effect here are listed in ``ParsedOptions.ignored`` so the CLI can say so once.
"""

from __future__ import annotations

import difflib
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from phalanx.domain.sbatch_options import (
    BY_LONG,
    BY_SHORT,
    WARNING_KEY,
    Arg,
    Effect,
    Option,
    find_option,
)
from phalanx.errors import InvalidSpec

__all__ = [
    "COMMAND_LINE",
    "DIRECTIVE_PREFIXES",
    "ParsedOptions",
    "late_directives",
    "parse_options",
    "parse_submission",
    "script_directives",
    "split_cli_args",
]


DIRECTIVE_PREFIXES = ("#SBATCH", "#PHX")
COMMAND_LINE = "command line"
_SOURCE_LINE_RE = re.compile(r" line (\d+)$")


@dataclass
class ParsedOptions:
    """The result of parsing: field values plus what the user should be told."""

    fields: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    """Options given that have no effect in Phalanx (e.g. ``--mail-type``), each once."""
    origins: dict[str, str] = field(default_factory=dict)
    """Where each field was set, e.g. ``{"mem_mb": "job.sh line 4"}``, for later error messages."""


@dataclass
class _Applied:
    option: Option
    updates: dict[str, Any]
    source: str
    line: int | None


def _error(message: str, source: str, line: int | None, option: str | None) -> InvalidSpec:
    details: dict[str, Any] = {"source": source}
    if line is not None:
        details["line"] = line
    if option is not None:
        details["option"] = option
    return InvalidSpec(message, **details)


class _Accumulator:
    """Collects field updates from one place (the script, or the command line)."""

    def __init__(self) -> None:
        self.fields: dict[str, Any] = {}
        self.owner: dict[str, str] = {}  # field -> long name of the option that set it
        self.where: dict[str, str] = {}  # field -> source text
        self.warnings: list[str] = []
        self.ignored: list[str] = []
        self.applied: list[_Applied] = []

    def note_ignored(self, option: Option) -> None:
        if option.flag not in self.ignored:
            self.ignored.append(option.flag)

    def take(self, option: Option, value: str | None, source: str, line: int | None) -> None:
        """Convert one occurrence of an option and record it."""
        if option.effect is Effect.REFUSED:
            raise _error(f"{source}: {option.flag}: {option.help}", source, line, option.flag)
        if option.effect is Effect.IGNORED or option.convert is None:
            self.note_ignored(option)
            return
        try:
            updates = option.convert(value if value is not None else "")
        except ValueError as exc:
            raise _error(f"{source}: {option.flag}: {exc}", source, line, option.flag) from None
        warning = updates.pop(WARNING_KEY, None)
        if warning:
            self.warnings.append(f"{source}: {warning}")
        if option.effect is Effect.STORED:
            self.note_ignored(option)
        item = _Applied(option, updates, source, line)
        self.apply(item, override=False)
        self.applied.append(item)

    def _drop_owned_by(self, long: str) -> None:
        for name in [f for f, owner in self.owner.items() if owner == long]:
            del self.fields[name], self.owner[name], self.where[name]

    def apply(self, item: _Applied, override: bool) -> None:
        """Set fields; ``override`` is True when the command line overrides the script."""
        option, source = item.option, item.source
        # Repeating an option replaces all it set before (later wins, as in sbatch).
        self._drop_owned_by(option.long)
        for other in option.conflicts:
            clash = [f for f, owner in self.owner.items() if owner == other]
            if clash and not override:
                raise _error(
                    f"{source}: {option.flag}: cannot be combined with --{other} "
                    f"(given at {self.where[clash[0]]}); keep only one of them",
                    source,
                    item.line,
                    option.flag,
                )
            self._drop_owned_by(other)
        new_type = item.updates.get("gpu_type")
        old_type = self.fields.get("gpu_type")
        if new_type is not None and old_type not in (None, new_type) and not override:
            raise _error(
                f"{source}: {option.flag}: asks for GPU type {new_type!r} but "
                f"--{self.owner['gpu_type']} at {self.where['gpu_type']} asks for "
                f"{old_type!r}; a job uses one GPU type",
                source,
                item.line,
                option.flag,
            )
        for name, value in item.updates.items():
            self.fields[name] = value
            self.owner[name] = option.long
            self.where[name] = source

    def merge_override(self, other: _Accumulator) -> None:
        """Replay ``other`` (the command line) on top of this one (the script)."""
        for item in other.applied:
            self.apply(item, override=True)
        self.warnings.extend(other.warnings)
        for flag in other.ignored:
            if flag not in self.ignored:
                self.ignored.append(flag)

    def result(self) -> ParsedOptions:
        return ParsedOptions(
            fields=dict(self.fields),
            warnings=list(self.warnings),
            ignored=list(self.ignored),
            origins=dict(self.where),
        )


def _parse_into(acc: _Accumulator, tokens: list[str], source: str, line: int | None) -> None:
    """getopt_long-like walk over ``tokens``; see ``parse_options``."""
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if token == "--":
            for extra in tokens[i:]:
                _positional(acc, extra, source, line)
            return
        if token.startswith("--"):
            name, eq, value = token[2:].partition("=")
            try:
                option = find_option(name)
            except ValueError as exc:
                raise _error(f"{source}: {exc}", source, line, f"--{name}") from None
            if option is None:
                raise _error(
                    f"{source}: {_unknown_long(name)}", source, line, f"--{name}"
                ) from None
            if option.arg is Arg.NONE and eq:
                raise _error(
                    f"{source}: {option.flag}: takes no value (got {value!r})",
                    source,
                    line,
                    option.flag,
                )
            arg: str | None = value if eq else None
            if option.arg is Arg.REQUIRED and not eq:
                if i >= len(tokens):
                    raise _error(
                        f"{source}: {option.flag}: needs a value, e.g. "
                        f"{option.flag}={option.metavar or 'VALUE'}",
                        source,
                        line,
                        option.flag,
                    )
                arg = tokens[i]
                i += 1
            acc.take(option, arg, source, line)
        elif token.startswith("-") and len(token) > 1:
            j = 1
            while j < len(token):
                letter = token[j]
                j += 1
                option = BY_SHORT.get(letter)
                if option is None:
                    raise _error(
                        f"{source}: unknown option -{letter}{_in_cluster(token)}: not an sbatch "
                        f"option; {_LIST_HINT}",
                        source,
                        line,
                        f"-{letter}",
                    )
                if option.arg is Arg.NONE:
                    acc.take(option, None, source, line)
                    continue
                rest: str | None = token[j:] or None
                if rest is None and option.arg is Arg.REQUIRED:
                    if i >= len(tokens):
                        raise _error(
                            f"{source}: -{letter} ({option.flag}): needs a value",
                            source,
                            line,
                            option.flag,
                        )
                    rest = tokens[i]
                    i += 1
                acc.take(option, rest, source, line)
                break
        else:
            _positional(acc, token, source, line)


_LIST_HINT = "`phalanx submit --help-options` lists the options understood"


def _unknown_long(name: str) -> str:
    """The refusal of ``--name``, with the nearest known spelling when there is one."""
    close = difflib.get_close_matches(name, list(BY_LONG), n=1, cutoff=0.75)
    if close:
        return f"unknown option --{name}: did you mean --{close[0]}?"
    return f"unknown option --{name}: not an sbatch option; {_LIST_HINT}"


def _in_cluster(token: str) -> str:
    return f" (in {token})" if len(token) > 2 else ""


def _positional(acc: _Accumulator, token: str, source: str, line: int | None) -> None:
    if token.lower() in ("hetjob", "packjob", ":"):
        raise _error(
            f"{source}: heterogeneous jobs ({token}) are not supported; submit the "
            "components as separate jobs (use --dependency to order them)",
            source,
            line,
            None,
        )
    acc.warnings.append(f"{source}: unexpected argument {token!r} ignored")


def parse_options(tokens: list[str], source: str) -> ParsedOptions:
    """Parse one set of option tokens (one script line, or the command line).

    Accepts ``--opt=value``, ``--opt value``, unique prefixes of long names, ``-X value``,
    ``-Xvalue`` and clustered flags (``-Hv``), like sbatch's getopt.  ``source`` (e.g.
    ``"job.sh line 4"``) prefixes every warning and error.  Raises ``InvalidSpec`` for a bad
    value, a refused option or an unknown one.
    """
    acc = _Accumulator()
    m = _SOURCE_LINE_RE.search(source)
    _parse_into(acc, tokens, source, int(m[1]) if m else None)
    return acc.result()


def _is_directive(line: str) -> str | None:
    for prefix in DIRECTIVE_PREFIXES:
        if line.startswith(prefix):
            return prefix
    return None


def _is_header_line(line: str) -> bool:
    """Blank or a comment (``#`` after optional whitespace), like sbatch's header scan."""
    stripped = line.strip()
    return not stripped or stripped.startswith("#")


def script_directives(text: str, script_name: str = "script") -> list[tuple[int, list[str]]]:
    """(line number, tokens) of each ``#SBATCH``/``#PHX`` line in the script header.

    The header ends at the first line that is neither blank nor a comment, exactly like
    sbatch, so a directive below the first command has no effect (``late_directives`` finds
    those).  Tokens are split like sbatch does: quotes group, and an unquoted ``#`` starts a
    trailing comment.  A directive must start in column 1, as sbatch requires.
    """
    found: list[tuple[int, list[str]]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        prefix = _is_directive(line)
        if prefix is None:
            if _is_header_line(line):
                continue
            break
        try:
            tokens = shlex.split(line[len(prefix) :], comments=True)
        except ValueError as exc:  # unbalanced quotes
            source = f"{script_name} line {number}"
            raise _error(
                f"{source}: cannot read {prefix} line: {exc} (check the quotes)",
                source,
                number,
                None,
            ) from None
        found.append((number, tokens))
    return found


def late_directives(text: str) -> list[tuple[int, int]]:
    """(line, first command line) of each directive sbatch would ignore (after the header)."""
    first_command: int | None = None
    late: list[tuple[int, int]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if first_command is None:
            if _is_directive(line) is None and not _is_header_line(line):
                first_command = number
        elif _is_directive(line) is not None:
            late.append((number, first_command))
    return late


def _check_script(text: str, script_name: str) -> None:
    """Refuse what sbatch refuses, with the same reasons, before looking at directives."""
    if "\0" in text:
        line = text[: text.index("\0")].count("\n") + 1
        source = f"{script_name} line {line}"
        raise _error(f"{source}: the script contains a NUL character", source, line, None)
    if not text.startswith("#!"):
        source = f"{script_name} line 1"
        raise _error(
            f"{source}: this does not look like a batch script: the first line must start "
            "with #! followed by the interpreter, e.g. #!/bin/bash",
            source,
            1,
            None,
        )
    if "\r\n" in text:
        line = text[: text.index("\r\n")].count("\n") + 1
        source = f"{script_name} line {line}"
        raise _error(
            f"{source}: the script has DOS line breaks (\\r\\n), which the shell cannot run; "
            "convert it with dos2unix",
            source,
            line,
            None,
        )


def parse_submission(
    script_text: str | None, cli_tokens: list[str], script_name: str = "script"
) -> ParsedOptions:
    """Parse a whole submission: script header directives first, then the command line.

    Command-line options override the script's, as with sbatch.  Either a script or
    ``--wrap`` must be given, not both.  Raises ``InvalidSpec`` whose message names the
    script line (or "command line") and the option.
    """
    script = _Accumulator()
    if script_text is not None:
        _check_script(script_text, script_name)
        for number, tokens in script_directives(script_text, script_name):
            _parse_into(script, tokens, f"{script_name} line {number}", number)
        for number, first in late_directives(script_text):
            script.warnings.append(
                f"{script_name} line {number}: directive after the first command (line "
                f"{first}) is ignored, as sbatch does; move it above line {first}"
            )
    cli = _Accumulator()
    _parse_into(cli, cli_tokens, COMMAND_LINE, None)
    script.merge_override(cli)
    if script_text is None and "wrap" not in script.fields:
        raise _error(
            "no batch script given: pass a script file or --wrap=COMMAND",
            COMMAND_LINE,
            None,
            None,
        )
    if script_text is not None and "wrap" in script.fields:
        where = script.where["wrap"]
        raise _error(
            f"{where}: --wrap: cannot be combined with a batch script; use one or the other",
            where,
            None,
            "--wrap",
        )
    return script.result()


def split_cli_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split ``phalanx submit`` arguments into (option tokens, [script, script args...]).

    Only the option table knows whether ``-J x`` consumes ``x``, so the CLI uses this to find
    where options end, as sbatch does: at the first non-option token or at ``--``.  Unknown
    options are assumed to take no value here, so that the script path is never swallowed.
    """
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return argv[:i], argv[i + 1 :]
        if token.startswith("--"):
            name, eq, _ = token[2:].partition("=")
            try:
                option = find_option(name)
            except ValueError as exc:
                raise _error(str(exc), COMMAND_LINE, None, f"--{name}") from None
            i += 2 if option is not None and option.arg is Arg.REQUIRED and not eq else 1
        elif token.startswith("-") and len(token) > 1:
            i += 1
            for j, letter in enumerate(token[1:], start=2):
                option = BY_SHORT.get(letter)
                if option is None or option.arg is not Arg.NONE:
                    if option is not None and option.arg is Arg.REQUIRED and j == len(token):
                        i += 1  # "-J name": the value is the next token
                    break
        else:
            return argv[:i], argv[i:]
    return argv[:], []
