"""One exception tree for the whole of Phalanx, mirrored in REST error bodies.

    PhalanxError                      code             HTTP
    ├── BadRequest                    bad_request      400   a body that is not JSON we can read (too deep)
    ├── TooLarge                      too_large        413   a request body over http.max_body_bytes
    ├── InvalidSpec                   invalid_spec     422   a job spec or request field is wrong
    ├── Unsatisfiable                 unsatisfiable    422   no node/partition could ever run it
    ├── NotFound                      not_found        404
    ├── Unauthenticated               unauthenticated  401   no, or a bad, credential (says which)
    ├── Forbidden                     forbidden        403   the caller may not do this (names the rule)
    ├── RateLimited                   rate_limited     429   too many calls; Retry-After says when
    ├── InvalidTransition             invalid_state    409   illegal lifecycle edge
    ├── Conflict                      conflict         409
    ├── StoreUnavailable              store_unavailable 503  the database cannot be reached
    │   └── StoreOutcomeUnknown       store_outcome_unknown 504  a commit got no answer
    ├── LeaseLost / Fenced            fenced           409   a duty's term is no longer current
    ├── ConfigError                   config           -     refused at load with the broken rule
    └── ControllerUnavailable         unavailable      -     client side: no controller answered

"Cannot reach the database" raises StoreUnavailable; "lost a race" returns False from the store.
"""

from __future__ import annotations

from typing import Any


class PhalanxError(Exception):
    """Base of every error Phalanx raises on purpose."""

    code = "error"
    http_status = 500

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.details:
            body["details"] = self.details
        return body


class BadRequest(PhalanxError):
    """A request the server will not read: JSON nested deeper than `http.max_json_depth`."""

    code = "bad_request"
    http_status = 400


class TooLarge(PhalanxError):
    """A request body longer than `http.max_body_bytes`, refused before it is read."""

    code = "too_large"
    http_status = 413


class InvalidSpec(PhalanxError):
    code = "invalid_spec"
    http_status = 422


class Unsatisfiable(PhalanxError):
    code = "unsatisfiable"
    http_status = 422


class NotFound(PhalanxError):
    code = "not_found"
    http_status = 404


class Unauthenticated(PhalanxError):
    """Missing, malformed, forged, expired or otherwise unacceptable credential."""

    code = "unauthenticated"
    http_status = 401


class Forbidden(PhalanxError):
    """A verified caller asked for something its role or ownership does not allow."""

    code = "forbidden"
    http_status = 403


class RateLimited(PhalanxError):
    """The caller's rate limit is spent; `retry_after` (seconds) says when to come back."""

    code = "rate_limited"
    http_status = 429


class InvalidTransition(PhalanxError):
    code = "invalid_state"
    http_status = 409


class Conflict(PhalanxError):
    code = "conflict"
    http_status = 409


class StoreUnavailable(PhalanxError):
    code = "store_unavailable"
    http_status = 503


class StoreOutcomeUnknown(StoreUnavailable):
    """The database stopped answering while a commit was in flight: the change may or may not
    have been applied. Not 503, because a client retries a 503 elsewhere as "surely not
    applied" and could submit a job twice; the caller must look before retrying."""

    code = "store_outcome_unknown"
    http_status = 504


class LeaseLost(PhalanxError):
    code = "fenced"
    http_status = 409


class Fenced(LeaseLost):
    """A write was attempted under a term that is no longer the lease's current term."""


class ConfigError(PhalanxError):
    code = "config"
    http_status = 500


class ControllerUnavailable(PhalanxError):
    code = "unavailable"
    http_status = 503


BY_CODE: dict[str, type[PhalanxError]] = {
    cls.code: cls
    for cls in (
        BadRequest,
        TooLarge,
        InvalidSpec,
        Unsatisfiable,
        NotFound,
        Unauthenticated,
        Forbidden,
        RateLimited,
        InvalidTransition,
        Conflict,
        StoreUnavailable,
        StoreOutcomeUnknown,
        LeaseLost,
        ConfigError,
        ControllerUnavailable,
    )
}
