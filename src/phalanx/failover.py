"""Which controller a client asks next: one policy, pure, for both of Phalanx's clients (the
full `phalanx.client.Client` and the standard-library `lean_client.LeanClient` that `srun` uses
inside jobs), so the two cannot drift apart (tests/unit/test_failover.py holds them equal).

A request goes to the controller that answered last, then to the others in turn. It moves on
only where that cannot apply it twice: the connection never reached a server; the server said
it cannot reach the store (503); or the call is idempotent (level-triggered, safe to repeat)
and the server did not answer, or lost the store mid-commit (504). A call that is not
idempotent and may have been applied surfaces "outcome unknown" instead of being repeated.
Standard library only: `srun`'s start-up imports it.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Sequence

from phalanx.errors import PhalanxError

ENV_URL = "PHALANX_URL"
DEFAULT_URL = "http://127.0.0.1:6817"


class Step(enum.Enum):
    NEXT = "next"  # ask the next controller
    ANSWER = "answer"  # this reply is the answer (a success, or an error to raise)
    UNKNOWN = "unknown"  # the request may have been applied: say so, do not repeat it


def after_transport_error(*, sent: bool, idempotent: bool) -> Step:
    """No reply: `sent` is whether the request may have reached the server (the connection
    was made and the request written)."""
    if not sent or idempotent:
        return Step.NEXT
    return Step.UNKNOWN


def after_reply(status: int, *, idempotent: bool) -> Step:
    """A reply with HTTP `status`."""
    if status == 503:  # this controller cannot reach the store: it applied nothing
        return Step.NEXT
    if status == 504 and idempotent:  # it lost the store mid-commit: repeating is safe
        return Step.NEXT
    return Step.ANSWER


def urls_from(value: str | Sequence[str] | None) -> list[str]:
    """The controllers to try, in order: `value` (a comma list or a sequence), else
    $PHALANX_URL, else the local default."""
    if value is None:
        value = os.environ.get(ENV_URL) or DEFAULT_URL
    parts = value.split(",") if isinstance(value, str) else list(value)
    out = [p.strip().rstrip("/") for p in parts if p.strip()]
    for u in out:
        if not u.startswith(("http://", "https://")):
            raise PhalanxError(f"controller address '{u}' must start with http:// or https://")
    if not out:
        raise PhalanxError(f"no controller address: use --url or set {ENV_URL}")
    return out
