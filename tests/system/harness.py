"""Harness for system tests: real controller and agent processes on loopback.

Every process a test starts is tracked by PID, logs to its own file under the test's tmp dir, and
is killed in `Cluster.cleanup` (run from a fixture finalizer, so also when the test fails):
daemons by their Popen handle, job shepherds from `<agent state dir>/tasks/*/shepherd.pid` (and `steps/*`) (after
checking their start time), job process groups from `job.json`, and finally anything that still
carries this cluster's marker in its environment (daemons started by `phalanx up`, orphans).
Then the agents' cgroups are removed (their node roots, `<base>/phalanx/<node>-<hash>`).

Waits poll a condition against a generous deadline; a 2-core machine under load is slow, but a
condition that is met returns at once, so the deadlines cost nothing when things go well.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from phalanx.agent import cgroup_roots, cgroups, shepherd_control, shepherd_files
from phalanx.auth import keys as keyfiles
from phalanx.auth.tokens import mint_token
from phalanx.client import Client
from phalanx.domain.states import TERMINAL

T = TypeVar("T")

DEADLINE = 90.0  # seconds: default for any wait; generous on purpose
MARKER = "PHX_SYSTEM_TEST_ROOT"
TERMINAL_STATES = frozenset(s.value for s in TERMINAL)
ACTIVE_STATES = ("PENDING", "HELD", "STARTING", "RUNNING", "COMPLETING")


# ---------------------------------------------------------------------- small helpers
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time) from /proc/PID/stat, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def alive(pid: int, starttime: int | None = None) -> bool:
    """Running (not a zombie awaiting a slow PID 1) and, if given, started at `starttime`."""
    st = proc_stat(pid)
    if st is None or st[0] in ("Z", "X"):
        return False
    return starttime is None or st[1] == starttime


def wait_for(
    cond: Callable[[], T],
    *,
    timeout: float = DEADLINE,
    interval: float = 0.1,
    what: str = "condition",
) -> T:
    """Poll `cond` until it returns something truthy; return that. Exceptions count as 'not yet'."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            value = cond()
            if value:
                return value
            last = value
        except AssertionError:
            raise  # a daemon died, a job vanished: no point in waiting
        except Exception as e:  # connection refused, a controller restarting, a half-written file
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout:g}s waiting for {what} (last: {last!r})"
            )
        time.sleep(interval)


def read_json(p: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def base_env(root: Path, **extra: str) -> dict[str, str]:
    """The environment for a child: ours minus PHALANX_* settings, plus the cleanup marker."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
    env.pop("PHALANX_URL", None)
    env["PYTHONUNBUFFERED"] = "1"
    env[MARKER] = str(root)
    env.update(extra)
    return env


def phalanx_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "phalanx", *args]


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


# ---------------------------------------------------------------------- daemons
@dataclass
class Daemon:
    name: str
    kind: str  # "controller" | "agent"
    args: list[str]
    log: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    started_wall: float = 0.0

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def spawn(self) -> Daemon:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            out.write(f"===== {time.strftime('%H:%M:%S')} start: {' '.join(self.args)}\n".encode())
            out.flush()
            self.started_wall = time.time()
            self.proc = subprocess.Popen(
                phalanx_cmd(*self.args),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self.env,
            )
        return self

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 30.0) -> None:
        """Signal the daemon (only its PID) and reap it."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def check_running(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(
                f"{self.name} exited with code {self.proc.returncode}:\n{tail(self.log, 20)}"
            )


# ---------------------------------------------------------------------- cluster
@dataclass
class Cluster:
    root: Path
    port: int = 0
    db: str | None = None
    timing: dict[str, float] = field(default_factory=dict)
    daemons: dict[str, Daemon] = field(default_factory=dict)
    extra_pids: set[int] = field(default_factory=set)
    # added to every daemon's environment (e.g. PHALANX_METRICS_CACHE_SECONDS)
    extra_env: dict[str, str] = field(default_factory=dict)
    _client: Client | None = None

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.state_dir = self.root / "state"
        self.logs = self.root / "logs"
        if not self.port:
            self.port = free_port()
        # the controllers' default cluster key (their state dir), made here so tests can mint
        # tokens with it; agents get their own derived node keys (agent_auth_args)
        self.keys = keyfiles.load_or_create(self.state_dir / "keys" / "cluster.jwks")
        self.admin_token = self.token("root", "admin")
        # run_cli() gives this to the commands it runs (as $PHALANX_TOKEN_FILE)
        token_file = self.root / "admin.token"
        token_file.write_text(self.admin_token)
        token_file.chmod(0o600)

    # -------------------------------------------------------------- identity
    def token(self, user: str, role: str = "user", lifetime: float = 6 * 3600.0) -> str:
        """A bearer token for `user` signed with this cluster's key."""
        return mint_token(self.keys, user=user, role=role, cluster="phalanx", lifetime=lifetime)

    @property
    def admin_headers(self) -> dict[str, str]:
        """For raw HTTP calls (httpx) that need a credential: root, an admin."""
        return {"Authorization": f"Bearer {self.admin_token}"}

    def agent_auth_args(self, node: str) -> list[str]:
        """The node's own key (derived from the cluster key) and its credential socket."""
        key = self.agent_dir(node) / "node.jwks"
        if not key.exists():
            keyfiles.save(self.keys.for_scope("node", node), key)
        return ["--key-file", str(key), "--auth-socket", str(self.agent_socket(node))]

    def agent_socket(self, node: str) -> Path:
        """Where the agent of `node` serves local credentials."""
        return self.agent_dir(node) / "auth.sock"

    # -------------------------------------------------------------- processes
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def controller(self) -> Daemon:
        return self.daemons["ctl-1"]

    def agent(self, node: str) -> Daemon:
        return self.daemons[f"agent-{node}"]

    def env(self, **extra: str) -> dict[str, str]:
        timing = {f"PHALANX_TIMING_{k.upper()}": str(v) for k, v in self.timing.items()}
        # the tests' jobs run as root, the user running the tests
        extra.setdefault("PHALANX_AUTH_ALLOW_ROOT_JOBS", "1")
        return base_env(self.root, **timing, **{**self.extra_env, **extra})

    def start_controller(
        self,
        cid: str = "ctl-1",
        *,
        wait: bool = True,
        port: int | None = None,
        env: dict[str, str] | None = None,
    ) -> Daemon:
        """Start `phalanx controller`; `port` (default: the cluster's) lets several controllers
        share one store, each on its own port (see `controller_urls`); `env` adds to its
        environment (e.g. NOTIFY_SOCKET)."""
        args = [
            "controller",
            "--state-dir",
            str(self.state_dir),
            "--port",
            str(port or self.port),
            "--id",
            cid,
        ]
        if self.db:
            args += ["--db", self.db]
        d = Daemon(
            cid, "controller", args, self.logs / f"{cid}.log", self.env(**(env or {}))
        ).spawn()
        self.daemons[cid] = d
        if wait:
            self.wait_controller(d)
        return d

    @staticmethod
    def controller_url(d: Daemon) -> str:
        """The URL of one controller daemon (its own --host, default loopback, and --port)."""
        host = d.args[d.args.index("--host") + 1] if "--host" in d.args else "127.0.0.1"
        return f"http://{host}:{d.args[d.args.index('--port') + 1]}"

    def controller_urls(self) -> list[str]:
        """URLs of every controller started here, in start order."""
        return [self.controller_url(d) for d in self.daemons.values() if d.kind == "controller"]

    def use_all_controllers(self, read_timeout: float = 10.0) -> str:
        """Point `client()` (so every wait here) at all controllers, failing over between
        them, with a read timeout short enough to get past a frozen one; return the comma
        list of their URLs (for agents' --url and other clients)."""
        url = ",".join(self.controller_urls())
        if self._client is not None:
            self._client.close()
        self._client = Client(
            url, token=self.admin_token, timeout=httpx.Timeout(read_timeout, connect=2.0)
        )
        return url

    def wait_controller(self, d: Daemon) -> None:
        url = self.controller_url(d)

        def healthy() -> bool:
            d.check_running()
            return httpx.get(url + "/healthz", timeout=5).status_code == 200

        wait_for(healthy, what=f"{d.name} to answer /healthz", interval=0.2)

    def agent_dir(self, node: str) -> Path:
        return self.state_dir / "nodes" / node

    def start_agent(
        self,
        node: str,
        *,
        cpus: int = 4,
        mem: str = "8G",
        gpus: str = "",
        wait: bool = True,
        env: dict[str, str] | None = None,
        extra_args: Sequence[str] = (),
        url: str | None = None,
    ) -> Daemon:
        """Start `phalanx agent` for `node`; `env` adds to its environment (e.g. PHX_FAKE_NVML)
        and `extra_args` to its command line (e.g. --health-config FILE). A restart keeps both.
        `url` (default: the cluster's controller) may be a comma list of controllers."""
        args = [
            "agent",
            "--name",
            node,
            "--state-dir",
            str(self.agent_dir(node)),
            "--url",
            url or self.url,
            "--cpus",
            str(cpus),
            "--mem",
            mem,
            "--gpus",
            gpus,
            *self.agent_auth_args(node),
            *extra_args,
        ]
        name = f"agent-{node}"
        d = Daemon(name, "agent", args, self.logs / f"{name}.log", self.env(**(env or {}))).spawn()
        self.daemons[name] = d
        if wait:
            self.wait_agents([node])
        return d

    def restart(self, d: Daemon, *, wait: bool = True) -> Daemon:
        """Start a stopped daemon again with the same arguments (same state dir, same port)."""
        assert not d.running(), f"{d.name} is still running"
        d.spawn()
        if wait:
            if d.kind == "controller":
                self.wait_controller(d)
            else:
                self.wait_agents([d.args[d.args.index("--name") + 1]])
        return d

    def wait_agents(self, names: Iterable[str], timeout: float = DEADLINE) -> None:
        """Every named agent has (re-)registered since its process started, and is not DOWN."""
        want = {n: self.agent(n) for n in names}

        def registered() -> bool:
            for d in want.values():
                d.check_running()
            nodes = {n["name"]: n for n in self.client().nodes()}
            for name, d in want.items():
                n = nodes.get(name)
                if n is None or n["state"] in ("UNKNOWN", "DOWN"):
                    return False
                if (n.get("registered_at") or 0) < d.started_wall:
                    return False
            return True

        wait_for(
            registered, timeout=timeout, what=f"agents {sorted(want)} to register", interval=0.2
        )

    def start(self, nodes: int = 4, cpus: int = 4, mem: str = "8G", gpus: str = "") -> Cluster:
        self.start_controller()
        names = self.node_names(nodes)
        for n in names:
            self.start_agent(n, cpus=cpus, mem=mem, gpus=gpus, wait=False)
        self.wait_agents(names)
        return self

    @staticmethod
    def node_names(n: int) -> list[str]:
        return [f"node{i + 1:02d}" for i in range(n)]

    def client(self) -> Client:
        if self._client is None:
            self._client = Client(self.url, token=self.admin_token)
        return self._client

    def client_as(self, user: str) -> Client:
        """A client that acts as `user` (a normal user, not an admin); the caller closes it."""
        return Client(self.url, token=self.token(user))

    # -------------------------------------------------------------- jobs
    def submit_script(self, tmp_path: Path, name: str, script: str, **extra: Any) -> int:
        """Submit a batch script with output in `tmp_path/<name>-<id>.out`; return its id."""
        spec = {
            "script": script,
            "name": name,
            "submit_dir": str(tmp_path),
            "output": str(tmp_path / f"{name}-%j.out"),
            "time_limit_s": 600,
            "env": {"PATH": "/usr/local/bin:/usr/bin:/bin"},
            **extra,
        }
        return int(self.client().submit(spec)["job_id"])

    def jobs_by_id(self, ids: Iterable[int] | None = None) -> dict[int, dict[str, Any]]:
        jobs = self.client().jobs(limit=100_000)
        out = {int(j["id"]): j for j in jobs}
        if ids is not None:
            wanted = set(ids)
            out = {k: v for k, v in out.items() if k in wanted}
        return out

    def wait_terminal(
        self, ids: Sequence[int], timeout: float = DEADLINE
    ) -> dict[int, dict[str, Any]]:
        """Wait until every job in `ids` is in a terminal state; return their list views."""
        ids = list(ids)

        def done() -> dict[int, dict[str, Any]] | None:
            for d in self.daemons.values():
                if d.kind == "controller":
                    d.check_running()
            jobs = self.jobs_by_id(ids)
            missing = [i for i in ids if i not in jobs]
            assert not missing, f"jobs vanished: {missing}"
            open_ = [i for i in ids if jobs[i]["state"] not in TERMINAL_STATES]
            return None if open_ else jobs

        def describe() -> str:
            try:
                jobs = self.jobs_by_id(ids)
                open_ = {
                    i: jobs[i]["state"] for i in ids if jobs[i]["state"] not in TERMINAL_STATES
                }
                return f"{len(open_)} jobs not done, e.g. {dict(list(open_.items())[:8])}"
            except Exception as e:
                return f"({e})"

        try:
            return wait_for(done, timeout=timeout, interval=0.25, what=f"{len(ids)} jobs to end")
        except AssertionError as e:
            raise AssertionError(f"{e}; {describe()}") from None

    def wait_state(
        self, job_id: int, states: str | Sequence[str], timeout: float = DEADLINE
    ) -> dict[str, Any]:
        want = {states} if isinstance(states, str) else set(states)

        def reached() -> dict[str, Any] | None:
            j = self.client().job(job_id)[0]
            return j if j["state"] in want else None

        return wait_for(reached, timeout=timeout, what=f"job {job_id} to reach {sorted(want)}")

    # -------------------------------------------------------------- tasks & shepherds
    def task_dirs(self, node: str | None = None) -> list[Path]:
        pattern = f"nodes/{node}/tasks/*" if node else "nodes/*/tasks/*"
        roots = [self.state_dir, *self.extra_state_dirs()]
        return sorted(d for r in roots for d in r.glob(pattern) if d.is_dir())

    def step_dirs(self, node: str | None = None) -> list[Path]:
        """Step task directories (srun): `<agent state dir>/steps/<attempt>.<step>.<task>`."""
        pattern = f"nodes/{node}/steps/*.*.*" if node else "nodes/*/steps/*.*.*"
        roots = [self.state_dir, *self.extra_state_dirs()]
        return sorted(d for r in roots for d in r.glob(pattern) if d.is_dir())

    def extra_state_dirs(self) -> list[Path]:
        """State dirs of clusters started with `phalanx up` under this root."""
        return [p.parent for p in self.root.glob("*/run") if p.parent != self.state_dir]

    def task_dirs_of(self, job_id: int) -> list[Path]:
        out = []
        for d in self.task_dirs():
            meta = read_json(d / "meta.json")
            if meta and int(meta.get("job_id", -1)) == job_id:
                out.append(d)
        return out

    @staticmethod
    def shepherd_of(task_dir: Path) -> tuple[int, int | None] | None:
        info = read_json(task_dir / shepherd_files.PID_FILE)
        if not info or not isinstance(info.get("pid"), int):
            return None
        st = info.get("starttime")
        return int(info["pid"]), int(st) if isinstance(st, int) else None

    def shepherd_alive(self, task_dir: Path) -> bool:
        s = self.shepherd_of(task_dir)
        return s is not None and alive(*s)

    @staticmethod
    def job_pid_alive(task_dir: Path) -> bool:
        info = read_json(task_dir / "job.json")
        return bool(info) and _owned_by(int(info["pid"]), task_dir)  # type: ignore[index]

    def live_shepherds(self) -> list[int]:
        out = []
        for d in self.task_dirs():
            s = self.shepherd_of(d)
            if s is not None and alive(*s):
                out.append(s[0])
        return out

    # -------------------------------------------------------------- cleanup & diagnostics
    def log_tails(self, lines: int = 40) -> str:
        parts = []
        logs = sorted(self.logs.glob("*.log")) + sorted(self.root.glob("*/logs/*.log"))
        for p in logs:
            parts.append(f"----- {p} (last {lines} lines)\n{tail(p, lines)}")
        for d in self.task_dirs():
            log = d / "shepherd.log"
            if log.exists() and log.stat().st_size:
                parts.append(f"----- {log}\n{tail(log, 10)}")
        return "\n".join(parts) or "(no logs)"

    def cleanup(self) -> list[int]:
        """Kill everything this cluster started; return the PIDs that had to be swept up."""
        if self._client is not None:
            self._client.close()
            self._client = None
        for d in self.daemons.values():
            d.kill(signal.SIGKILL)
        killed: list[int] = []
        for pid in list(self.extra_pids):
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
        for d in [*self.task_dirs(), *self.step_dirs()]:
            with contextlib.suppress(Exception):
                shepherd_control.request_stop(d)
            info = read_json(d / "job.json")
            if info and isinstance(info.get("pgid"), int) and _owned_by(info["pgid"], d):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(info["pgid"], signal.SIGKILL)
                    killed.append(info["pgid"])
            s = self.shepherd_of(d)
            if s is not None and alive(*s):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(s[0], signal.SIGKILL)
                    killed.append(s[0])
        deadline = time.monotonic() + 10
        while any(alive(p) for p in killed) and time.monotonic() < deadline:
            time.sleep(0.05)  # SIGKILLed is not yet dead
        swept: list[int] = []
        for _ in range(5):
            left = marked_processes(self.root)
            if not left:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            swept += [p for p in left if p not in swept]
            time.sleep(0.5)
        self.remove_node_cgroups()
        return swept

    def node_state_dirs(self) -> list[Path]:
        """Every agent state dir of this cluster (and of `phalanx up` clusters under its root)."""
        roots = [self.state_dir, *self.extra_state_dirs()]
        return sorted(d for r in roots for d in r.glob("nodes/*") if d.is_dir())

    def remove_node_cgroups(self) -> list[str]:
        """The agents' cgroups (their node roots and attempts left by killed shepherds), once
        everything is dead: the agents were SIGKILLed, so they could not remove their own.
        Returns the roots that could not be removed."""
        kept: list[str] = []
        for d in self.node_state_dirs():
            with contextlib.suppress(OSError):
                kept += cgroup_roots.teardown(d, cgroup_roots.cgroup_name(d.name, d))
        return kept


def _environ(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _owned_by(pid: int, task_dir: Path) -> bool:
    """`pid` is a live process of the job in `task_dir` (so a recycled PID is never hit)."""
    return alive(pid) and f"PHX_TASK_DIR={task_dir}\0".encode() in _environ(pid)


def marked_processes(root: Path) -> list[int]:
    """Live processes started under `root`: daemons (marker) and jobs (task dir under root)."""
    me = os.getpid()
    keys = (f"{MARKER}={root}\0".encode(), f"PHX_TASK_DIR={root}/".encode())
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        pid = int(entry)
        env = _environ(pid)
        if env and any(k in env for k in keys) and alive(pid):
            out.append(pid)
    return out


def cgroup_layout() -> cgroups.Layout | None:
    """The cgroups an agent started by this test process would use (it inherits our cgroups),
    or None where it could not (not root, no memory+pids controllers, a read-only cgroupfs):
    tried by making and removing a probe node root."""
    found = cgroups.detect()
    probe = f"phx-probe-{os.getpid()}"
    try:
        made = cgroups.ensure_parents(found, probe)
    finally:
        cgroups.remove_empty(cgroups.node_roots(found, probe))
    return found if made.usable else None


def agent_cgroup_roots(layout: cgroups.Layout | None, state_dir: Path, node: str) -> list[str]:
    """The node roots the agent of ``node`` with ``state_dir`` makes (none without cgroups)."""
    if layout is None:
        return []
    return cgroups.node_roots(layout, cgroup_roots.cgroup_name(node, state_dir))


def run_cli(
    args: Sequence[str],
    *,
    url: str | None = None,
    cwd: Path | None = None,
    root: Path,
    timeout: float = 120.0,
    auth_socket: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `phalanx ARGS` as a user would (PHALANX_URL in the environment), as root with the
    cluster's admin token when the cluster made one (`root/admin.token`), or with credentials
    from `auth_socket` (a cluster of `phalanx up`, as its users get them)."""
    extra = {"PHALANX_URL": url} if url else {}
    if auth_socket is not None:
        extra["PHALANX_AUTH_SOCKET"] = str(auth_socket)
    elif (root / "admin.token").is_file():
        extra["PHALANX_TOKEN_FILE"] = str(root / "admin.token")
    return subprocess.run(
        phalanx_cmd(*args),
        cwd=cwd,
        env=base_env(root, COLUMNS="200", NO_COLOR="1", **extra),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
