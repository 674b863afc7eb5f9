"""Who may reach the controllers and how much one client may take: credentials, keys,
roles and TLS (`[auth]`), per-user rate limits (`[limits]`), and the HTTP server's bounds on
request size, nesting, time and connections (`[http]`).

Grouped because together they are the controllers' defences (docs/security.md,
docs/deploy.md "Hostile clients").
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from phalanx.domain.spec import MAX_JOB_BYTES

__all__ = ["AuthConfig", "HttpConfig", "LimitsConfig", "MiB"]


class AuthConfig(BaseModel):
    """Who may call the API and as whom jobs run (docs/security.md)."""

    model_config = ConfigDict(extra="forbid")

    key_file: str | None = Field(
        None,
        description="the cluster key (JWKS of HS256 keys; the first signs, all verify): "
        "default <state-dir>/keys/cluster.jwks, created on first start",
    )
    credential_ttl: float = Field(
        300.0,
        ge=10,
        le=86400,
        description="seconds a local credential (minted by an agent or `phalanx authd` for "
        "the Unix user on a local socket) stays valid",
    )
    clock_skew: float = Field(
        30.0,
        ge=0,
        le=600,
        description="seconds of clock difference between hosts tolerated when checking a "
        "credential's expiry and not-before times",
    )
    token_max_lifetime: float = Field(
        365 * 86400.0,
        gt=0,
        le=10 * 365 * 86400.0,
        description="longest lifetime `phalanx token create` may give a bearer token",
    )
    admins: list[str] = Field(
        default_factory=list, description="user names that are admins (root always is)"
    )
    operators: list[str] = Field(default_factory=list, description="user names that are operators")
    allow_root_jobs: bool = Field(False, description="accept jobs that would run as root")
    private_data: bool = Field(
        True,
        description="others' jobs are listed without their command, environment, paths and "
        "events (Slurm PrivateData=jobs); false shows everything to everyone",
    )
    jwks_file: str | None = Field(
        None, description="public keys (JWKS) of the site's identity provider (RS256 tokens)"
    )
    idp_audience: str | None = Field(None, description="the 'aud' an IdP token must carry")
    idp_issuer: str | None = Field(None, description="the 'iss' an IdP token must carry")
    user_claim: str = Field("sub", description="the IdP token claim that names the user")
    role_claim: str | None = Field(
        None, description="an IdP token claim listing roles (admin, operator); none: user"
    )
    tls_cert: str | None = Field(None, description="controller: TLS certificate (PEM)")
    tls_key: str | None = Field(None, description="controller: TLS private key (PEM)")

    @model_validator(mode="after")
    def _rules(self) -> AuthConfig:
        if self.clock_skew >= self.credential_ttl:
            raise ValueError(
                f"clock_skew ({self.clock_skew:g}) must be less than credential_ttl "
                f"({self.credential_ttl:g})"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        if self.jwks_file is not None and not self.idp_audience:
            raise ValueError("jwks_file needs idp_audience (the audience IdP tokens carry)")
        return self


class LimitsConfig(BaseModel):
    """Per-user rate limits of each controller (token buckets; docs/security.md)."""

    model_config = ConfigDict(extra="forbid")

    api_rate: float = Field(
        200.0, gt=0, le=1e6, description="API calls per second per user, sustained"
    )
    api_burst: float = Field(2000.0, ge=1, le=1e7, description="API calls per user in a burst")
    submit_rate: float = Field(
        200.0, gt=0, le=1e6, description="jobs submitted per second per user, sustained"
    )
    submit_burst: float = Field(
        20000.0, ge=1, le=1e8, description="jobs per user in a burst (a batch counts each job)"
    )
    exempt_roles: list[str] = Field(
        default_factory=lambda: ["admin"], description="roles never throttled (agents never are)"
    )

    @field_validator("exempt_roles")
    @classmethod
    def _roles(cls, roles: list[str]) -> list[str]:
        bad = [r for r in roles if r not in ("admin", "operator", "user")]
        if bad:
            raise ValueError(f"unknown roles {bad}: use admin, operator or user")
        return roles


MiB = 1024 * 1024


class HttpConfig(BaseModel):
    """What one client may hold of a controller's HTTP server (docs/deploy.md, "Hostile
    clients"): request sizes, JSON depth, the time to send a request, connections."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(
        64 * MiB,
        ge=MAX_JOB_BYTES,
        le=1024 * MiB,
        description="longest request body; a longer one is answered 413 before it is read "
        "(from its Content-Length, or as it streams in). The largest legitimate request is a "
        "batch submission (POST /v1/jobs/batch, up to 10,000 jobs); at least one job at every "
        "field limit",
    )
    max_json_depth: int = Field(
        64,
        ge=8,
        le=512,
        description="deepest nesting of JSON arrays and objects in a request body; deeper is "
        "answered 400 (Python's own parser would run out of stack near 1,000)",
    )
    max_header_bytes: int = Field(
        64 * 1024,
        ge=8 * 1024,
        le=MiB,
        description="the request line and headers of one request; longer is answered 431 "
        "and the connection closed",
    )
    header_timeout: float = Field(
        10.0,
        gt=0,
        le=300,
        description="seconds a client has, from connecting (or from the first byte of its next "
        "request), to send a request's complete headers; a connection that has not is closed "
        "(slowloris)",
    )
    body_timeout: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="seconds a client has, after a request's headers, to send its whole body; "
        "a connection that has not is closed",
    )
    idle_timeout: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="seconds a kept-alive connection may stay idle between two requests",
    )
    max_connections: int = Field(
        16384,
        ge=16,
        le=1_000_000,
        description="open connections (or requests in progress) at which a new request is "
        "answered 503 at once, before the API sees it (clients fail over); every agent holds "
        "one connection to one controller, so keep it above the node count plus the clients, "
        "and below the process's file descriptor limit (LimitNOFILE)",
    )
