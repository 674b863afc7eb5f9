"""Database URLs: the forms an operator may write, and the form shown to people.

`normalize_url` turns what configuration accepts (`postgres://`, `postgresql://`, libpq's
multi-host list, a bare SQLite path) into the URL SQLAlchemy and psycopg 3 take;
`describe_url` is the same URL without its password, for every message that names the
database. Kept apart from the engines so that the CLI and the server can name a database
without building one.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

from sqlalchemy.engine import make_url


def normalize_url(url: str) -> str:
    """Accept `postgresql://` and `postgres://` and use psycopg 3; accept a bare path for SQLite."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    url = _hosts_to_query(url)
    if "://" not in url:
        url = f"sqlite:///{Path(url).absolute()}"
    return url


_MULTI_HOST = re.compile(
    r"^(?P<scheme>postgresql(?:\+\w+)?)://(?P<auth>[^@/?]*@)?(?P<hosts>[^/?@]*,[^/?@]*)"
    r"(?P<path>/[^?]*)?(?:\?(?P<query>.*))?$"
)


def _hosts_to_query(url: str) -> str:
    """Rewrite libpq's multi-host form for SQLAlchemy, which cannot parse it.

    `postgresql://u@h1:5432,h2:5432/db?target_session_attrs=read-write` (what PostgreSQL's
    documentation shows, and what an operator pointing controllers at a primary and its standby
    writes) becomes `postgresql://u@/db?host=h1:5432&host=h2:5432&target_session_attrs=...`,
    which SQLAlchemy hands to libpq as the same list of hosts, tried in order.
    """
    m = _MULTI_HOST.match(url)
    if m is None:
        return url
    hosts = "&".join(f"host={h.strip()}" for h in m["hosts"].split(",") if h.strip())
    query = f"{hosts}&{m['query']}" if m["query"] else hosts
    return f"{m['scheme']}://{m['auth'] or ''}{m['path'] or '/'}?{query}"


def describe_url(url: str) -> str:
    """The URL without its password, for messages."""
    try:
        # shown to people: `host=db1:5432`, not `host=db1%3A5432`
        return unquote(make_url(_hosts_to_query(url)).render_as_string(hide_password=True))
    except Exception:
        return "<invalid url>"
