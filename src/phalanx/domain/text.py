"""Text that reaches other people's terminals: control characters refused on input, escaped
on output.

A job's name, comment, partition list and the reasons given for a cancel or a drain are shown
to other users by `phalanx queue`, `squeue`, `scontrol show`, `sacct` and `sinfo`. An escape
sequence in one of them (ESC, CSI, OSC 52 to write the clipboard, a carriage return that
overwrites a line, a newline that forges a row) would act on the terminal of whoever lists
the queue. The API refuses these characters in such fields (`check_text`, a 422 naming the
field), and every human-facing renderer shows stored text through `escape` (rows stored
before the check, text from agents), so that both sides use one definition:

* C0 controls (U+0000-U+001F), DEL (U+007F) and C1 controls (U+0080-U+009F: U+009B is a
  one-byte CSI on some terminals);
* the Unicode bidirectional overrides and isolates (U+200E, U+200F, U+202A-U+202E,
  U+2066-U+2069), which reorder what follows them on the screen ("Trojan Source").

Scripts, commands and environment values are not checked: they legitimately hold newlines and
tabs, and they are shown only to their owner (and operators).
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator

CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def first_control(text: str) -> tuple[int, str] | None:
    """(position, character) of the first control character in `text`, or None."""
    m = CONTROL.search(text)
    return (m.start(), m.group(0)) if m else None


def check_text(text: str, what: str = "") -> str:
    """`text` unchanged, or ValueError naming the character and where it is (a field
    validator's refusal: the API answers 422 naming the field)."""
    found = first_control(text)
    if found is not None:
        pos, ch = found
        raise ValueError(
            f"{what + ' ' if what else ''}contains the control character U+{ord(ch):04X} at "
            f"position {pos}; "
            "names and other text fields may not contain control characters (terminal escapes, "
            "newlines, tabs, bidirectional overrides)"
        )
    return text


def _escaped(m: re.Match[str]) -> str:
    code = ord(m.group(0))
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape(value: object) -> str:
    """`value` as text safe to print on a terminal: each control character becomes its
    visible escape (ESC -> `\\x1b`, newline -> `\\x0a`, U+202E -> `\\u202e`); everything else
    is unchanged. None and other values are shown as `str()` would."""
    text = value if isinstance(value, str) else str(value)
    if CONTROL.search(text) is None:  # the common case: no copy
        return text
    return CONTROL.sub(_escaped, text)


def _checked(value: str) -> str:
    return check_text(value)


#: A request field other users may see: refused (422 naming the field) with a control character
PlainText = Annotated[str, AfterValidator(_checked)]


def escape_data(value: Any) -> Any:
    """`value` (a reply's JSON: dicts, lists, scalars) with every string `escape`d, keys too:
    for a renderer that builds its lines from many fields of one record."""
    if isinstance(value, str):
        return escape(value)
    if isinstance(value, dict):
        return {escape(k) if isinstance(k, str) else k: escape_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [escape_data(v) for v in value]
    return value
