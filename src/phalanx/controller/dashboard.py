"""The web dashboard (`/ui`) and the two read routes it needs that the API lacked.

    GET /ui, /ui/{asset}          the dashboard's static files, shipped in the package (public:
                                  no data in them; every figure comes from the API with the
                                  user's own token, under the API's own rules)
    GET /v1/queue                 the queue as a page shows it: array tasks folded into one row
                                  per array and state, filtered, paged (users see every job's
                                  summary, as GET /v1/jobs gives it)
    GET /v1/jobs/{ref}/output     the tail of a job's output file, for its owner or an operator,
                                  when the controller host can read the file (a shared /home);
                                  otherwise where it is: the node and the path

The page polls (no connection is held open between polls), so a stuck browser costs a
controller one short request at a time, never a worker. docs/dashboard.md is the user's guide.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, Response

from phalanx.controller import access
from phalanx.controller.views import job_view
from phalanx.domain.hostlist import compress_hostlist
from phalanx.domain.states import JobState
from phalanx.errors import InvalidSpec, NotFound
from phalanx.store.queue import queue_page

ASSETS = Path(__file__).parent / "ui"
# what a page may load: only this controller (no CDN, no inline script): a cluster without
# the internet works, and an injected <script> in a job name has nowhere to come from
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidate: an upgraded controller serves its own assets
}
TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}

ACTIVE = ("PENDING", "HELD", "STARTING", "RUNNING", "COMPLETING")
MAX_PAGE = 500
MAX_OFFSET = 10_000_000
TAIL_DEFAULT = 16 * 1024
TAIL_MAX = 256 * 1024


# ---------------------------------------------------------------------- the queue, folded
def folded_row(view: dict[str, Any], count: int, tasks: list[int] | None) -> dict[str, Any]:
    """A queue row: a plain job as it is, or an array's tasks of one state and partition as
    squeue folds them (`123_[4-99]`): 10,000 tasks of one array are one line.

    `view` is the job_view of the group's first job (the lowest id)."""
    row = {**view, "array": tasks is not None, "count": count, "ref": view["job_id"]}
    if tasks is None:
        return row
    row["job_id"] = f"{view['array_job_id']}_{task_ranges(tasks)}"
    row["task_ids"] = tasks[:1000]  # what a fold-out lists; the count says how many
    if count > 1:  # one node list would describe only one task
        row["nodelist"] = None
    return row


def task_ranges(tasks: Sequence[int]) -> str:
    """Array task ids as Slurm writes them: `7`, or `[0-3,7,9-10]`."""
    ts = sorted(set(tasks))
    if len(ts) == 1:
        return str(ts[0])
    parts: list[str] = []
    start = prev = ts[0]
    for t in [*ts[1:], None]:
        if t is not None and t == prev + 1:
            prev = t
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if t is not None:
            start = prev = t
    return "[" + ",".join(parts) + "]"


def parse_states(raw: Sequence[str] | None) -> list[str]:
    """`state=` values: job states (comma lists too), `active` (the default) or `all`."""
    states = [x.strip().upper() for s in raw or [] for x in s.split(",") if x.strip()]
    if not states or "ACTIVE" in states:
        states = [*[s for s in states if s != "ACTIVE"], *ACTIVE]
    if "ALL" in states:
        return []
    for x in states:
        if x not in JobState.__members__:
            raise InvalidSpec(
                f"state: unknown job state {x!r}; give one of {', '.join(JobState)}, "
                "'active' or 'all'",
                field="state",
            )
    return sorted(set(states))


# ---------------------------------------------------------------------- output tails
@dataclass(frozen=True)
class Tail:
    available: bool
    why: str | None = None
    text: str = ""
    size: int = 0
    truncated: bool = False


def read_tail(path: str, owner_uid: int | None, nbytes: int) -> Tail:
    """The last `nbytes` of the file at `path`, if this host can read it as the job's own.

    The path comes from the job's spec, so its owner chose it: a job that wrote
    `--output=/etc/shadow` must not make the controller (root) read that file for it. The file
    must be a regular file owned by the job's user on this host, opened without following a
    symlink at the last component."""
    if not path.startswith("/") or "%" in path:
        return Tail(False, f"the path {path} is relative or not resolved on this host")
    if owner_uid is None:
        return Tail(False, "the job's user is unknown on the controller host")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return Tail(False, f"{path} is a symbolic link; the dashboard does not follow it")
        if e.errno == errno.ENOENT:
            return Tail(False, f"{path} does not exist on the controller host")
        return Tail(False, f"{path}: {e.strerror}")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return Tail(False, f"{path} is not a regular file")
        if st.st_uid != owner_uid:
            return Tail(False, f"{path} on the controller host does not belong to the job's user")
        start = max(0, st.st_size - nbytes)
        data = os.pread(fd, min(nbytes, st.st_size), start)
    finally:
        os.close(fd)
    if start > 0:  # begin at a whole line
        cut = data.find(b"\n")
        data = data[cut + 1 :] if 0 <= cut < len(data) - 1 else data
    return Tail(True, None, data.decode("utf-8", errors="replace"), st.st_size, start > 0)


def uid_of(user: str) -> int | None:
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        return None


# ---------------------------------------------------------------------- routes
def _asset(name: str) -> Response:
    # only files shipped in the package's ui/ directory, by plain name: no path walks
    if "/" in name or name.startswith(".") or Path(name).suffix not in TYPES:
        raise NotFound(f"no dashboard file {name!r}")
    path = ASSETS / name
    if not path.is_file():
        raise NotFound(f"no dashboard file {name!r}")
    return FileResponse(path, media_type=TYPES[path.suffix], headers=HEADERS)


def router(ctl: Any) -> APIRouter:
    """The dashboard's routes, bound to a controller (`runtime.Controller`)."""
    r = APIRouter()

    @r.get("/ui", response_class=HTMLResponse, summary="the web dashboard (docs/dashboard.md)")
    async def ui_index() -> Response:
        return _asset("index.html")

    @r.get("/ui/{asset}", summary="a static file of the web dashboard")
    async def ui_asset(asset: str) -> Response:
        return _asset(asset)

    @r.get("/v1/queue")
    def queue(
        state: list[str] | None = Query(
            default=None, description="job states (comma lists too), 'active' (default) or 'all'"
        ),
        user: str | None = Query(default=None, max_length=128),
        partition: str | None = Query(default=None, max_length=64),
        offset: int = Query(default=0, ge=0, le=MAX_OFFSET),
        limit: int = Query(default=100, ge=1, le=MAX_PAGE),
    ) -> dict[str, Any]:
        """The queue folded (array tasks: one row per array, state and partition) and paged."""
        states = parse_states(state)
        page = queue_page(
            ctl.store,
            states=states,
            user=user or None,
            partition=partition or None,
            offset=offset,
            limit=limit,
        )
        return {
            "rows": [folded_row(job_view(g.first), g.count, g.tasks) for g in page.groups],
            "offset": offset,
            "limit": limit,
            "total_rows": page.total_rows,
            "total_jobs": sum(page.by_state.values()),
            "by_state": page.by_state,
            "states": states or "all",
        }

    @r.get("/v1/jobs/{ref}/output")
    def job_output(
        ref: str,
        request: Request,
        stream: str = Query(default="stdout", pattern="^(stdout|stderr)$"),
        nbytes: int = Query(
            default=TAIL_DEFAULT, ge=1, le=TAIL_MAX, alias="bytes", description="how much"
        ),
    ) -> dict[str, Any]:
        """The tail of a job's output (its owner, operators and admins only)."""
        ident = request.state.identity
        ids = ctl.store.resolve_refs([ref])
        if not ids:
            raise NotFound(f"job {ref} does not exist", job=ref)
        if len(ids) != 1:
            raise InvalidSpec(f"{ref} names {len(ids)} jobs: show the output of one array task")
        row = ctl.store.get_job(ids[0])
        view = job_view(row, detail=True)
        access.check_owner(ident, [view], "reading a job's output")
        path = str(view[stream])
        node = view["batch_host"]
        out: dict[str, Any] = {"job": view["job_id"], "stream": stream, "path": path, "node": node}
        if not row["nodelist_run"]:
            ended = JobState(row["state"]).terminal
            never = "the job never ran: it has no output" if ended else "no output yet: not started"
            return {**out, "available": False, "why": never}
        tail = read_tail(path, uid_of(row["user"]), nbytes)
        why = tail.why
        if not tail.available:
            why = f"{why}; the output is on {node} at {path}"
        return {
            **out,
            "available": tail.available,
            "why": why,
            "text": tail.text,
            "size": tail.size,
            "truncated": tail.truncated,
            "nodes": compress_hostlist(row["nodelist_run"]),
        }

    return r
