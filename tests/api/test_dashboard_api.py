"""The dashboard's server side: its static files, the folded and paged queue, output tails.

The browser itself is driven in tests/system/test_dashboard.py; here the routes it calls are
checked against the real app over a real store: who may read what, and what a page gets.
"""

from __future__ import annotations

import os
import pwd
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from api_auth import ANONYMOUS, KEYS, AuthedClient, as_user
from fastapi.testclient import TestClient

from phalanx.config import load_config
from phalanx.controller import dashboard
from phalanx.controller.api import create_app
from phalanx.controller.runtime import Controller, partition_rows
from phalanx.store.store import Store
from schema_copy import fresh_db

ME = pwd.getpwuid(os.getuid()).pw_name  # a user this host knows: the tests' own
ALICE = as_user("alice")
BOB = as_user("bob")
OPS = as_user("ops", "operator")
JOB = {"argv": ["/bin/true"], "time_limit_s": 60}
PARTITIONS = [
    {"name": "batch", "default": True, "nodes": "n*"},
    {"name": "gpu", "nodes": "g*"},
]


@pytest.fixture
def app(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, schema_db: Path
) -> Iterator[tuple[TestClient, Controller]]:
    monkeypatch.delenv("PHALANX_CONFIG", raising=False)
    cfg = load_config(
        overrides={"cluster": {"partitions": PARTITIONS}, "auth": {"allow_root_jobs": True}}
    )
    st = Store(fresh_db(schema_db, tmp_path / "ui.db"), actor="t")
    st.sync_partitions(partition_rows(cfg))
    ctl = Controller(st, cfg, cid="t")
    assert "took term" in ctl.leases.tick()
    try:
        with AuthedClient(create_app(ctl, KEYS)) as c:
            for node in ("n1", "g1"):
                r = c.post(f"/v1/agents/{node}/register", json={"cpus": 4, "mem_mb": 8192})
                assert r.status_code == 200, r.text
            yield c, ctl
    finally:
        st.close()


def submit(c: TestClient, who: dict[str, str], **spec: Any) -> list[int]:
    r = c.post("/v1/jobs", json={**JOB, **spec}, headers=who)
    assert r.status_code == 201, r.text
    return [int(i) for i in r.json()["job_ids"]]


# ------------------------------------------------------------------ static files


def test_the_dashboard_is_served_without_a_credential_and_loads_nothing_from_outside(
    app: tuple[TestClient, Controller],
) -> None:
    c, _ = app
    r = c.get("/ui", headers=ANONYMOUS)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "script-src 'self'" in csp
    # every file the page names is served from /ui by this controller
    names = set(re.findall(r'(?:src|href)="/ui/([^"]+)"', r.text))
    assert {"app.js", "style.css"} <= names
    for name in sorted(dashboard.ASSETS.iterdir()):
        body = c.get(f"/ui/{name.name}", headers=ANONYMOUS)
        assert body.status_code == 200, name
        assert body.headers["x-content-type-options"] == "nosniff"
        # no CDN, no web font, no absolute URL of any kind: an offline cluster gets it all
        # (an SVG's namespace is a name, never fetched)
        text = body.text.replace('xmlns="http://www.w3.org/2000/svg"', "")
        assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", text), name.name
        # modules import only siblings
        for imp in re.findall(r'from "([^"]+)"', body.text):
            assert imp.startswith("./") and (dashboard.ASSETS / imp[2:]).is_file(), imp


@pytest.mark.parametrize(
    "name", ["..%2Fapi.py", ".hidden.js", "api.py", "nope.js", "%2Fetc%2Fpasswd"]
)
def test_only_shipped_assets_are_served(app: tuple[TestClient, Controller], name: str) -> None:
    c, _ = app
    r = c.get(f"/ui/{name}", headers=ANONYMOUS)
    assert r.status_code == 404
    if "%2F" not in name:  # a slash never reaches the route: the router's own 404
        assert "no dashboard file" in r.json()["error"]["message"]


def test_the_assets_are_package_data() -> None:
    """pyproject ships controller/ui/*: an installed controller has its dashboard."""
    text = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert '"controller/ui/*"' in text
    assert (dashboard.ASSETS / "index.html").is_file()


# ------------------------------------------------------------------ the queue


def test_task_ranges_are_written_as_slurm_writes_them() -> None:
    assert dashboard.task_ranges([3]) == "3"
    assert dashboard.task_ranges([0, 1, 2, 3, 7, 9, 10]) == "[0-3,7,9-10]"
    assert dashboard.task_ranges([5, 1, 2, 1]) == "[1-2,5]"


def test_the_queue_folds_arrays_and_pages(app: tuple[TestClient, Controller]) -> None:
    c, ctl = app
    arr = submit(c, ALICE, array="0-249")
    plain = [submit(c, BOB)[0] for _ in range(3)]
    ctl.store.hold([arr[5], arr[6]], "alice")
    r = c.get("/v1/queue", params={"limit": 2}, headers=BOB)
    assert r.status_code == 200, r.text
    q = r.json()
    # 250 tasks: one row of the pending ones, one of the two held; and bob's three jobs
    assert q["total_jobs"] == 253 and q["total_rows"] == 5
    assert q["by_state"] == {"PENDING": 251, "HELD": 2}
    assert len(q["rows"]) == 2
    first = q["rows"][0]
    assert first["array"] and first["count"] == 248 and first["state"] == "PENDING"
    assert first["job_id"] == f"{arr[0]}_[0-4,7-249]"
    assert first["ref"] == f"{arr[0]}_0"
    assert first["user"] == "alice"
    held = q["rows"][1]
    assert (held["job_id"], held["count"], held["state"]) == (f"{arr[0]}_[5-6]", 2, "HELD")
    # the last page
    q = c.get("/v1/queue", params={"limit": 2, "offset": 4}, headers=BOB).json()
    assert [r["job_id"] for r in q["rows"]] == [str(plain[2])]
    assert q["rows"][0]["count"] == 1 and not q["rows"][0]["array"]


def test_the_queue_filters(app: tuple[TestClient, Controller]) -> None:
    c, ctl = app
    a = submit(c, ALICE)[0]
    b = submit(c, BOB, partition="gpu")[0]
    done = submit(c, BOB)[0]
    ctl.store.cancel([done], "bob")

    def ids(**params: Any) -> list[str]:
        r = c.get("/v1/queue", params=params, headers=ALICE)
        assert r.status_code == 200, r.text
        return [row["job_id"] for row in r.json()["rows"]]

    assert ids() == [str(a), str(b)]  # active jobs by default, as squeue
    assert ids(state="all") == [str(a), str(b), str(done)]
    assert ids(state="CANCELLED") == [str(done)]
    assert ids(state="pending,cancelled", user="bob") == [str(b), str(done)]
    assert ids(partition="gpu") == [str(b)]
    assert ids(user="carol") == []
    r = c.get("/v1/queue", params={"state": "SLEEPING"}, headers=ALICE)
    assert r.status_code == 422
    assert "unknown job state 'SLEEPING'" in r.json()["error"]["message"]
    r = c.get("/v1/queue", params={"limit": 501}, headers=ALICE)
    assert r.status_code == 422


# ------------------------------------------------------------------ output tails


def test_a_pending_jobs_output_is_not_there_yet(app: tuple[TestClient, Controller]) -> None:
    c, _ = app
    (jid,) = submit(c, ALICE)
    r = c.get(f"/v1/jobs/{jid}/output", headers=ALICE)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["available"] is False and out["why"] == "no output yet: not started"
    c.post("/v1/jobs/cancel", json={"jobs": [str(jid)]}, headers=ALICE)
    out = c.get(f"/v1/jobs/{jid}/output", headers=ALICE).json()
    assert out["why"] == "the job never ran: it has no output"


def test_output_is_for_its_owner_and_operators(app: tuple[TestClient, Controller]) -> None:
    c, _ = app
    (jid,) = submit(c, ALICE)
    r = c.get(f"/v1/jobs/{jid}/output", headers=BOB)
    assert r.status_code == 403
    assert r.json()["error"]["message"] == (
        f"job {jid} belongs to alice; bob may act only on their own jobs (reading a job's output)"
    )
    assert c.get(f"/v1/jobs/{jid}/output", headers=OPS).status_code == 200
    assert c.get("/v1/jobs/999999/output", headers=ALICE).status_code == 404


def started(c: TestClient, ctl: Controller, output: Path, who: dict[str, str]) -> int:
    (jid,) = submit(c, who, output=str(output))
    ctl.leases.tick()
    assert ctl.schedule_tick().startswith("started 1 jobs")
    return jid


def test_the_tail_of_a_started_jobs_output(
    app: tuple[TestClient, Controller], tmp_path: Path
) -> None:
    c, ctl = app
    out = tmp_path / "job.out"
    out.write_text("".join(f"line {i}\n" for i in range(10_000)))
    jid = started(c, ctl, out, as_user(ME))
    r = c.get(f"/v1/jobs/{jid}/output", params={"bytes": 100}, headers=as_user(ME))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["available"] and body["truncated"] and body["node"] == "n1"
    assert body["size"] == out.stat().st_size
    # whole lines only, the last ones
    assert body["text"].endswith("line 9999\n")
    assert body["text"].startswith("line ") and len(body["text"]) <= 100


def test_a_file_the_jobs_user_does_not_own_is_not_read(
    app: tuple[TestClient, Controller], tmp_path: Path
) -> None:
    """The output path is the owner's choice: it must not make the controller read files
    for them that are not theirs. alice is unknown here, and a link is never followed."""
    c, ctl = app
    secret = tmp_path / "secret"
    secret.write_text("root's secret\n")
    jid = started(c, ctl, secret, ALICE)
    body = c.get(f"/v1/jobs/{jid}/output", headers=ALICE).json()
    assert body["available"] is False
    assert "unknown on the controller host" in body["why"]
    assert f"on n1 at {secret}" in body["why"]
    assert "secret" not in body.get("text", "")

    link = tmp_path / "link.out"
    link.symlink_to(secret)
    jid = started(c, ctl, link, as_user(ME))
    body = c.get(f"/v1/jobs/{jid}/output", headers=as_user(ME)).json()
    assert body["available"] is False and "symbolic link" in body["why"]
    assert body["text"] == ""


def test_read_tail_checks_the_owner_and_the_kind_of_file(tmp_path: Path) -> None:
    f = tmp_path / "o.txt"
    f.write_text("a\nb\n")
    assert dashboard.read_tail(str(f), os.getuid(), 1000).text == "a\nb\n"
    other = dashboard.read_tail(str(f), os.getuid() + 1, 1000)
    assert not other.available and "does not belong" in str(other.why)
    assert "not a regular file" in str(dashboard.read_tail(str(tmp_path), os.getuid(), 10).why)
    assert "does not exist" in str(dashboard.read_tail(str(f) + ".x", os.getuid(), 10).why)
    assert not dashboard.read_tail("rel/path", os.getuid(), 10).available
    assert not dashboard.read_tail("/x/%N.out", os.getuid(), 10).available
