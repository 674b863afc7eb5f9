"""A real controller against clients that do not play fair (docs/deploy.md, "Hostile clients"):
thousands of connections that never finish their headers (slowloris), more connections than
the cap, and request bodies far over the size limit, sent by nobody in particular.

Each test starts one controller process (no agents: none is needed to answer the API) with a
config of short timeouts, and talks to it over raw sockets where httpx would be too polite.
"""

from __future__ import annotations

import contextlib
import resource
import selectors
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from system.harness import Cluster, wait_for

IDLE = 2000  # half-open connections of the slowloris test
HEADER_TIMEOUT = 4.0
PARTIAL = b"GET /v1/whoami HTTP/1.1\r\nHost: ctl\r\nX-Slow: "  # and nothing more, ever


def _config(tmp_path: Path, **http: object) -> Path:
    path = tmp_path / "phalanx.toml"
    lines = ["[http]"] + [f"{k} = {v!r}" for k, v in http.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def _start(make_cluster: Callable[..., Cluster], tmp_path: Path, **http: object) -> Cluster:
    cluster = make_cluster(extra_env={"PHALANX_CONFIG": str(_config(tmp_path, **http))})
    cluster.start_controller()
    return cluster


@contextlib.contextmanager
def _files(n: int) -> Iterator[None]:
    """Room for `n` more sockets in this process (and in the controller, started after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, n + 1024)) if hard != resource.RLIM_INFINITY else max(soft, n + 1024)
    if want < n + 256:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is too low for {n} sockets")
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _open_idle(port: int, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(PARTIAL)
        s.setblocking(False)
        socks.append(s)
    return socks


def _wait_closed(socks: list[socket.socket], deadline: float) -> dict[bytes, int]:
    """Read every socket to its end (the server closed it); what each got first, counted."""
    sel = selectors.DefaultSelector()
    got: dict[int, bytes] = {}
    for s in socks:
        sel.register(s, selectors.EVENT_READ)
    open_ = len(socks)
    while open_ and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=1.0):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            try:
                data = s.recv(65536)
            except BlockingIOError:
                continue
            except ConnectionResetError:
                data = b""
            if data:
                got.setdefault(s.fileno(), data)
                continue
            got.setdefault(s.fileno(), b"")
            sel.unregister(s)
            open_ -= 1
    sel.close()
    assert open_ == 0, f"{open_} of {len(socks)} idle connections still open at the deadline"
    firsts: dict[bytes, int] = {}
    for data in got.values():
        line = data.split(b"\r\n", 1)[0]
        firsts[line] = firsts.get(line, 0) + 1
    return firsts


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.mark.timeout(600)
def test_slowloris_does_not_keep_users_out_and_idle_connections_are_closed(
    make_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    with _files(IDLE + 200):
        cluster = _start(make_cluster, tmp_path, header_timeout=HEADER_TIMEOUT)
        user = {"Authorization": f"Bearer {cluster.token('alice')}"}
        socks = _open_idle(cluster.port, IDLE)
        try:
            opened = time.monotonic()
            # a user's ordinary call, while every one of them holds its connection
            t0 = time.monotonic()
            r = httpx.get(cluster.url + "/v1/whoami", headers=user, timeout=30)
            took = time.monotonic() - t0
            assert r.status_code == 200, r.text
            assert r.json()["user"] == "alice"
            assert took < 5.0, f"a user waited {took:.1f}s behind {IDLE} idle connections"
            # and the idle ones are closed, each with a 408, once their headers are late
            firsts = _wait_closed(socks, opened + HEADER_TIMEOUT + 120)
            assert set(firsts) == {b"HTTP/1.1 408 Request Timeout"}, firsts
            assert time.monotonic() - opened >= HEADER_TIMEOUT - 0.5
        finally:
            for s in socks:
                s.close()
        cluster.controller.check_running()
        r = httpx.get(cluster.url + "/v1/whoami", headers=user, timeout=30)
        assert r.status_code == 200


@pytest.mark.timeout(300)
def test_trickled_headers_do_not_extend_the_timeout(
    make_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = _start(make_cluster, tmp_path, header_timeout=HEADER_TIMEOUT)
    s = socket.create_connection(("127.0.0.1", cluster.port), timeout=30)
    with s:
        s.sendall(b"GET /healthz HTTP/1.1\r\n")
        start = time.monotonic()
        closed = False
        while time.monotonic() - start < HEADER_TIMEOUT + 60:
            try:
                s.sendall(b"X-A: b\r\n")  # a header line a second: slow, never finished
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            s.settimeout(1.0)
            try:
                data = s.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                closed = True
                break
            assert data.startswith(b"HTTP/1.1 408") or data == b"", data
            closed = True
            break
        assert closed, "a client trickling header lines was never cut off"
        assert time.monotonic() - start < HEADER_TIMEOUT + 30


@pytest.mark.timeout(300)
def test_over_the_connection_cap_a_request_gets_503_until_idle_ones_are_closed(
    make_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    cap = 40
    cluster = _start(make_cluster, tmp_path, header_timeout=HEADER_TIMEOUT, max_connections=cap)
    user = {"Authorization": f"Bearer {cluster.token('alice')}"}
    socks = _open_idle(cluster.port, cap + 10)
    try:
        r = httpx.get(cluster.url + "/v1/whoami", headers=user, timeout=30)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "unavailable"
        assert "http.max_connections" in err["message"]
        _wait_closed(socks, time.monotonic() + HEADER_TIMEOUT + 120)
    finally:
        for s in socks:
            s.close()

    def served() -> bool:
        return httpx.get(cluster.url + "/v1/whoami", headers=user, timeout=30).status_code == 200

    wait_for(served, timeout=60, what="the controller to serve again")


def _send_all(sock: socket.socket, total: int, chunked: bool) -> int:
    """Send `total` bytes of body (chunked or not) until the server stops taking them."""
    piece = b"x" * (1024 * 1024)
    sent = 0
    try:
        while sent < total:
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            sent += len(piece)
        if chunked:
            sock.sendall(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError, TimeoutError):
        pass
    return sent


def _status(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536).split(b"\r\n", 1)[0]
    except (ConnectionResetError, TimeoutError):
        return b"(reset)"


@pytest.mark.timeout(300)
def test_huge_bodies_are_refused_before_they_are_read(
    make_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """96 MiB POSTs: anonymous with a Content-Length (413 at once), anonymous chunked (401 at
    once), a user's chunked one over the limit (413 after the limit). The controller's memory
    stays where it was, not 96 MiB (or several times that, parsed) higher."""
    size = 96 * 1024 * 1024
    limit = 8 * 1024 * 1024
    cluster = _start(make_cluster, tmp_path, max_body_bytes=limit)
    user = f"Bearer {cluster.token('alice')}"
    for _ in range(20):  # warm: the routes' first calls allocate what they keep
        httpx.post(
            cluster.url + "/v1/jobs", json={"argv": ["true"]}, headers={"Authorization": user}
        )
    before = _rss_kib(cluster.controller.pid)
    cases = [
        (b"Content-Length: %d\r\n" % size, None, False, b"413"),
        (b"Transfer-Encoding: chunked\r\n", None, True, b"401"),
        (b"Transfer-Encoding: chunked\r\n", user, True, b"413"),
    ]
    for framing, auth, chunked, want in cases:
        s = socket.create_connection(("127.0.0.1", cluster.port), timeout=30)
        with s:
            head = b"POST /v1/jobs HTTP/1.1\r\nHost: ctl\r\nContent-Type: application/json\r\n"
            head += framing
            if auth:
                head += b"Authorization: " + auth.encode() + b"\r\n"
            s.sendall(head + b"\r\n")
            if want != b"413" or not chunked:
                # refused on its headers alone: the answer comes before any byte of the body
                assert want in _status(s), (framing, auth)
                _send_all(s, size, chunked)  # and pushing it anyway changes nothing
            else:
                sent = _send_all(s, size, chunked)
                assert sent < size, "the controller read a whole 96 MiB body"
                status = _status(s)
                assert want in status or status in (b"(reset)", b""), status
        after = _rss_kib(cluster.controller.pid)
        grew = (after - before) / 1024
        assert grew < 48, f"{framing!r}: the controller grew by {grew:.0f} MiB"
    cluster.controller.check_running()
    r = httpx.post(
        cluster.url + "/v1/jobs", json={"argv": ["true"]}, headers={"Authorization": user}
    )
    assert r.status_code == 201, r.text
