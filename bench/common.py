"""Code shared by the Phalanx benchmarks in this directory (submit.py, detect.py, failover.py).

The scripts run as `python bench/X.py`, which puts this directory first on sys.path, so they
import this module as plain `common`.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx

from phalanx.auth.credentials import LocalService


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- host -------------------------------------------------------------------------------------


def busy_cpus(seconds: float = 1.0) -> float:
    """CPUs kept busy by anything on the host over a short sample (Linux /proc/stat)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]

    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
    except OSError:
        return float("nan")
    return (os.cpu_count() or 1) * (1 - (i1 - i0) / max(1, t1 - t0))


def busy_before(consequence: str = "other processes compete with the cluster") -> float:
    """Sample busy CPUs before the runs and warn (with `consequence`) if the host is not idle."""
    load = busy_cpus()
    if load > 0.3:
        log(
            f"warning: {load:.1f} of {os.cpu_count()} CPUs already busy before the runs: "
            + consequence
        )
    return load


def host_line(load_before: float, load_after: float) -> str:
    return (
        f"host: {os.cpu_count()} CPUs, {load_before:.2f} busy before the runs (1 s sample); "
        f"load average at the end {load_after:.2f}"
    )


def host_info(load_before: float, load_after: float) -> dict[str, Any]:
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "busy_cpus_before": load_before,
        "loadavg_after": load_after,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int) -> int:
    """A base port such that base .. base+n-1 are all free on 127.0.0.1 right now."""
    for _ in range(200):
        base = free_port()
        if base + n > 65535:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


# --- processes --------------------------------------------------------------------------------


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of a process, or None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def alive(pid: int, starttime: int | None = None) -> bool:
    st = proc_stat(pid)
    if st is None or st[0] in ("Z", "X"):
        return False
    return starttime is None or st[1] == starttime


def group_alive(pgid: int) -> bool:
    """A process group with a live (not zombie) member; zombies await a slow PID 1."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            return True
    return False


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def kill_leftovers(state: Path, name_node: bool = True) -> list[str]:
    """SIGKILL every shepherd and job process group of this cluster that is still alive."""
    killed = []
    for task in sorted(state.glob("nodes/*/tasks/*")):
        where = f" ({task.parent.parent.name})" if name_node else ""
        shep = read_json(task / "shepherd.pid")
        if isinstance(shep, dict) and isinstance(shep.get("pid"), int):
            start = shep.get("starttime")
            if alive(shep["pid"], start if isinstance(start, int) else None):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(shep["pid"], signal.SIGKILL)
                    killed.append(f"shepherd {shep['pid']}{where}")
        job = read_json(task / "job.json")
        if isinstance(job, dict) and isinstance(job.get("pgid"), int):
            pgid = job["pgid"]
            if not group_alive(pgid):
                continue
            # only a group whose leader is still this task's job (its argv names the task dir),
            # or whose leader is gone (then the group id cannot have been reused)
            try:
                leader_cmd = Path(f"/proc/{pgid}/cmdline").read_bytes()
            except OSError:
                leader_cmd = None
            if leader_cmd is None or str(state).encode() in leader_cmd:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
                    killed.append(f"job group {pgid}{where}")
    return killed


def reap(state: Path, name_node: bool = True) -> None:
    """After `phalanx down`: give the shepherds a moment to stop, then kill what is left."""
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline and any(
        group_alive(int(p["pgid"]))
        for p in (read_json(f) for f in state.glob("nodes/*/tasks/*/job.json"))
        if isinstance(p, dict) and isinstance(p.get("pgid"), int)
    ):
        time.sleep(0.1)
    killed = kill_leftovers(state, name_node)
    if killed:
        log(f"killed leftovers: {', '.join(killed)}")


# --- local cluster ----------------------------------------------------------------------------


def timing_env(timing: dict[str, float], drop_prefix: str) -> dict[str, str]:
    """os.environ without variables starting with `drop_prefix`, plus PHALANX_TIMING_<NAME>."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop_prefix)}
    for k, v in timing.items():
        env[f"PHALANX_TIMING_{k.upper()}"] = repr(float(v))
    return env


def state_dir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))


@contextlib.contextmanager
def phalanx_up(
    state: Path,
    up_args: list[str],
    where: str,
    *,
    keep: bool,
    env: dict[str, str] | None = None,
    capture: bool = False,
    leftovers: bool = False,
    name_node: bool = True,
) -> Iterator[str | None]:
    """`phalanx up --detach --state-dir STATE UP_ARGS`; yields its stdout if `capture`.

    Always `phalanx down` afterwards, then (with `leftovers`) kill any shepherd or job process
    group still alive, then remove the state dir unless `keep`."""
    cmd = [sys.executable, "-m", "phalanx", "up", "--detach", "--state-dir", str(state), *up_args]
    t0 = time.monotonic()
    try:
        stdout = subprocess.PIPE if capture else subprocess.DEVNULL
        out = subprocess.run(cmd, check=True, stdout=stdout, env=env, text=True).stdout
        log(f"cluster up in {time.monotonic() - t0:.1f}s (state {state}, {where})")
        # this process (its Api) and the commands it runs get local credentials there
        os.environ["PHALANX_AUTH_SOCKET"] = str(state.absolute() / "auth.sock")
        yield out
    finally:
        subprocess.run(
            [sys.executable, "-m", "phalanx", "down", "--state-dir", str(state)],
            stdout=subprocess.DEVNULL,
            check=False,
            env=env,
        )
        if leftovers:
            reap(state, name_node)
        if keep:
            log(f"kept {state}")
        else:
            subprocess.run(["rm", "-rf", str(state)], check=False)


def node_args(nodes: int) -> list[str]:
    return ["--nodes", str(nodes), "--cpus", "8", "--mem", "16G"]


def controller_log_tail(state: Path, lines: int) -> str:
    out = []
    for f in sorted((state / "logs").glob("controller-*.log")):
        with contextlib.suppress(OSError):
            text = f.read_text().splitlines()[-lines:]
            out.append(f"--- {f.name} (last {len(text)} lines)\n" + "\n".join(text))
    return "\n".join(out)


# --- REST API ---------------------------------------------------------------------------------


class LocalCredential(httpx.Auth):
    """Each request carries a credential from the local credential service (as the CLI's
    do), renewed when it nears its expiry."""

    def __init__(self) -> None:
        self.source = LocalService()

    def auth_flow(self, request: httpx.Request) -> Iterator[httpx.Request]:
        token = self.source.token()
        if token is None:
            raise RuntimeError(self.source.problem or "no credential")
        request.headers["Authorization"] = f"Bearer {token}"
        yield request


class Api:
    def __init__(self, url: str, timeout: float) -> None:
        self.http = httpx.Client(
            base_url=url,
            timeout=httpx.Timeout(timeout, connect=5.0),
            auth=LocalCredential(),
        )

    def post(self, path: str, body: Any) -> Any:
        r = self.http.post(path, json=body)
        if r.status_code >= 400:
            raise RuntimeError(f"POST {path}: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    def get(self, path: str, **params: Any) -> Any:
        r = self.http.get(path, params=params)
        if r.status_code >= 400:
            raise RuntimeError(f"GET {path}: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    def job(self, jid: int) -> dict[str, Any]:
        return dict(self.get(f"/v1/jobs/{jid}")["jobs"][0])

    def events(self) -> list[dict[str, Any]]:
        return all_events(lambda since: self.get("/v1/events", since=since, limit=10_000)["events"])


class KeepAliveSubmitter:
    """POST /v1/jobs, one job per request, over `conns` concurrent keep-alive connections.

    What many `sbatch` calls in flight at once look like to a controller, sent by a client
    light enough not to be the thing measured on a small machine: httpx costs about 1 ms of
    CPU per request, as much as the controller's own work, and on 2 cores the two compete.
    Each request is real HTTP/1.1 on its own connection's turn (a request is sent only after
    the previous answer on that connection arrived: no pipelining), carries the credential
    from the local credential service in its Authorization header as the CLI's do (renewed
    when it nears expiry), holds exactly one job, and counts only if answered 201 with the
    job's id.
    """

    def __init__(self, url: str, conns: int) -> None:
        from urllib.parse import urlsplit

        u = urlsplit(url)
        if u.scheme != "http" or u.hostname is None or u.port is None:
            raise ValueError(f"KeepAliveSubmitter needs http://HOST:PORT, not {url}")
        self.host, self.port, self.conns = u.hostname, u.port, conns
        self.source = LocalService()

    def submit(self, body: dict[str, Any], n: int) -> list[int]:
        """Submit `body` n times; the job ids in the order the answers came."""
        import asyncio

        return asyncio.run(self._submit(json.dumps(body).encode(), n))

    async def _submit(self, payload: bytes, n: int) -> list[int]:
        import asyncio

        ids: list[int] = []
        left = [n]

        async def one_connection() -> None:
            reader, writer = await asyncio.open_connection(self.host, self.port)
            try:
                while left[0] > 0:
                    left[0] -= 1
                    token = self.source.token()
                    if token is None:
                        raise RuntimeError(self.source.problem or "no credential")
                    writer.write(
                        b"POST /v1/jobs HTTP/1.1\r\nHost: %s:%d\r\n"
                        b"Content-Type: application/json\r\nAuthorization: Bearer %s\r\n"
                        b"Content-Length: %d\r\n\r\n%s"
                        % (self.host.encode(), self.port, token.encode(), len(payload), payload)
                    )
                    head = await reader.readuntil(b"\r\n\r\n")
                    status, length = _status_and_length(head)
                    answer = await reader.readexactly(length)
                    if status != 201:
                        raise RuntimeError(f"POST /v1/jobs: HTTP {status}: {answer[:300]!r}")
                    ids.append(int(json.loads(answer)["job_id"]))
            finally:
                writer.close()

        await asyncio.gather(*(one_connection() for _ in range(self.conns)))
        return ids


def _status_and_length(head: bytes) -> tuple[int, int]:
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return status, int(value)
    raise RuntimeError(f"answer without Content-Length: {head[:300]!r}")


def all_events(fetch: Callable[[int], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every event, paging with `fetch(since)` (which asks for at most 10,000)."""
    out: list[dict[str, Any]] = []
    since = 0
    while True:
        batch = fetch(since)
        out += batch
        if len(batch) < 10_000:
            return out
        since = int(batch[-1]["id"])


# --- timing settings --------------------------------------------------------------------------


def checked_timings(
    names: Iterable[str], settings: dict[str, dict[str, float]], shown: Iterable[str]
) -> dict[str, dict[str, Any]]:
    """The full timing of each setting; raises if a set breaks a timing rule."""
    from phalanx.config import Timing

    timings = {}
    for name in names:
        timings[name] = Timing(**settings[name]).model_dump()
        log(f"setting {name}: {timing_text(timings[name], shown)} (rules of phalanx.config hold)")
    return timings


def timing_text(timing: dict[str, Any], shown: Iterable[str]) -> str:
    return ", ".join(f"{k}={timing[k]:g}" for k in shown)


def check_timing(tm: dict[str, Any], want: dict[str, float]) -> None:
    """Raise unless the controller's timing `tm` has every override in `want`."""
    for name, value in want.items():
        if abs(float(tm[name]) - value) > 1e-9:
            raise RuntimeError(f"controller runs {name}={tm[name]}, expected {value}")


# --- results ----------------------------------------------------------------------------------


def spread(runs: list[dict[str, Any]], keys: Iterable[str]) -> dict[str, Any]:
    """{key: {median, min, max}} over the runs that have the key (not None)."""
    out: dict[str, Any] = {}
    for key in keys:
        vals = [r[key] for r in runs if r.get(key) is not None]
        if vals:
            out[key] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    return out


def setting_result(
    timing: dict[str, Any], overrides: dict[str, float], runs: list[dict[str, Any]], summary: Any
) -> dict[str, Any]:
    return {
        "timing": timing,
        "overrides": overrides,
        "nruns": len(runs),
        "summary": summary,
        "runs": runs,
    }
