"""Network namespaces for system tests: put daemons on separate 'hosts' and cut the link.

`NetnsLab` creates namespaces named `phx-<pytest pid>-<random>-<role>`, joins two of them with a
veth pair whose two ends (and addresses, from 10.231.0.0/16) both live inside namespaces it
created, and partitions/heals a link with iptables DROP rules inside a namespace. Nothing here
touches the root namespace's interfaces, addresses or firewall, and no test traffic leaves the
namespaces. `cleanup()` kills every process left in the lab's namespaces (they only hold what
the test started there), removes the rules and deletes the namespaces, which destroys the veths.

`NetnsCluster` is the harness's `Cluster` with each daemon started through `ip netns exec NS`
(which execs in place, so the Popen PID is the daemon's) and the controller bound to an address
inside its namespace. The test process itself talks to the controller by moving its own thread
into the controller's namespace with setns(2) (`NetnsLab.entered`) for the test's duration.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from system.harness import Cluster, Daemon, alive, phalanx_cmd

CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/run/netns")
SUBNET_PREFIX = "10.231"  # link i of a lab gets 10.231.X.(4i+1)/30 and .(4i+2)/30
_NAME = re.compile(r"^phx-(\d+)-[0-9a-f]{4}-")


class NetnsError(RuntimeError):
    """A namespace, link or rule could not be set up."""


def ci() -> bool:
    """CI sets CI=true; there a missing tool must fail the test, not skip it."""
    return os.environ.get("CI", "").strip().lower() in {"true", "1", "yes"}


def missing_tools() -> str | None:
    """Why network-namespace tests cannot run here, or None if they can (so far as we can tell)."""
    if os.geteuid() != 0:
        return "network namespaces and iptables need root"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (run scripts/ensure-netns-tools.sh as root)"
    return None


def _run(*cmd: str, timeout: float = 30.0) -> str:
    try:
        p = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetnsError(f"{' '.join(cmd)}: {e}") from None
    if p.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)} exited {p.returncode}: {p.stderr.strip()}")
    return p.stdout


def _libc_setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def ns_pids(ns: str) -> list[int]:
    """Processes whose network namespace is `ns` (by their main thread), never this one."""
    try:
        out = _run("ip", "netns", "pids", ns)
    except NetnsError:
        return []
    return [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]


def _kill_all_in(ns: str, timeout: float = 10.0) -> list[int]:
    """SIGKILL every process in `ns` and wait for them to go; return the PIDs killed."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [p for p in ns_pids(ns) if alive(p)]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            if pid not in killed:
                killed.append(pid)
        time.sleep(0.1)
    return killed


def sweep_stale_namespaces() -> list[str]:
    """Delete lab namespaces left by test runs whose pytest process is gone (SIGKILLed)."""
    try:
        names = [line.split()[0] for line in _run("ip", "netns", "list").splitlines() if line]
    except NetnsError:
        return []
    swept = []
    for name in names:
        m = _NAME.match(name)
        if m is None or alive(int(m.group(1))):
            continue
        _kill_all_in(name)
        with contextlib.suppress(NetnsError):
            _run("ip", "netns", "delete", name)
            swept.append(name)
    return swept


@dataclass
class Link:
    ns_a: str
    ns_b: str
    dev_a: str
    dev_b: str
    addr_a: str
    addr_b: str


@dataclass
class NetnsLab:
    prefix: str = field(default_factory=lambda: f"phx-{os.getpid()}-{secrets.token_hex(2)}")
    namespaces: list[str] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)
    rules: list[tuple[str, list[str]]] = field(default_factory=list)  # (ns, iptables rule)
    third_octet: int = field(default_factory=lambda: secrets.randbelow(256))

    def ns(self, role: str) -> str:
        return f"{self.prefix}-{role}"

    def add(self, role: str) -> str:
        """A new namespace with its loopback up; removed again by cleanup()."""
        name = self.ns(role)
        _run("ip", "netns", "add", name)
        self.namespaces.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")
        return name

    def link(self, ns_a: str, ns_b: str) -> Link:
        """A veth pair created directly inside ns_a and ns_b, each end with a /30 address."""
        assert ns_a in self.namespaces and ns_b in self.namespaces, "only our own namespaces"
        i = len(self.links)
        tag = self.prefix.rsplit("-", 1)[1]
        dev_a, dev_b = f"phx{tag}a{i}", f"phx{tag}b{i}"  # at most 15 characters
        base = f"{SUBNET_PREFIX}.{self.third_octet}"
        addr_a, addr_b = f"{base}.{4 * i + 1}", f"{base}.{4 * i + 2}"
        _run(
            "ip",
            "link",
            "add",
            dev_a,
            "netns",
            ns_a,
            "type",
            "veth",
            "peer",
            "name",
            dev_b,
            "netns",
            ns_b,
        )
        for ns, dev, addr in ((ns_a, dev_a, addr_a), (ns_b, dev_b, addr_b)):
            _run("ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _run("ip", "-n", ns, "link", "set", dev, "up")
        link = Link(ns_a, ns_b, dev_a, dev_b, addr_a, addr_b)
        self.links.append(link)
        return link

    def check_iptables(self, ns: str) -> None:
        _run("ip", "netns", "exec", ns, "iptables", "-w", "-S")

    # -------------------------------------------------------------- partitions
    def _iptables(self, ns: str, action: str, rule: list[str]) -> None:
        assert ns in self.namespaces, "iptables only in our own namespaces"
        _run("ip", "netns", "exec", ns, "iptables", "-w", action, *rule)

    def partition(self, ns: str, peer: str) -> None:
        """Drop every packet between `ns` and `peer` (an address), both ways, inside `ns`.

        DROP (not REJECT): the peer just stops answering, so connections time out the way they
        do when a real network splits.
        """
        for rule in (
            ["OUTPUT", "-d", peer, "-j", "DROP"],
            ["INPUT", "-s", peer, "-j", "DROP"],
        ):
            self._iptables(ns, "-I", rule)
            self.rules.append((ns, rule))

    def heal(self, ns: str, peer: str) -> None:
        for entry in [r for r in self.rules if r[0] == ns and peer in r[1]]:
            self._iptables(ns, "-D", entry[1])
            self.rules.remove(entry)

    # -------------------------------------------------------------- the test's own thread
    @contextlib.contextmanager
    def entered(self, ns: str) -> Iterator[None]:
        """Move the calling thread into `ns` (new sockets it opens live there); move it back."""
        assert ns in self.namespaces, "only our own namespaces"
        with open("/proc/thread-self/ns/net") as home, open(NETNS_DIR / ns) as target:
            _libc_setns(target.fileno())
            try:
                yield
            finally:
                _libc_setns(home.fileno())

    # -------------------------------------------------------------- cleanup
    def cleanup(self) -> list[str]:
        """Remove everything the lab made, even after a failure; return what was left over."""
        problems: list[str] = []
        for ns, rule in reversed(self.rules):
            try:
                self._iptables(ns, "-D", rule)
            except NetnsError as e:
                problems.append(str(e))
        self.rules.clear()
        for ns in reversed(self.namespaces):
            killed = _kill_all_in(ns)
            if killed:
                problems.append(f"killed processes left in {ns}: {killed}")
            try:
                _run("ip", "netns", "delete", ns)
            except NetnsError as e:
                problems.append(str(e))
        left = [ns for ns in self.namespaces if (NETNS_DIR / ns).exists()]
        if left:
            problems.append(f"namespaces not removed: {left}")
        self.namespaces.clear()
        self.links.clear()
        return problems


# ---------------------------------------------------------------------- cluster in namespaces
@dataclass
class NsDaemon(Daemon):
    netns: str = ""

    def spawn(self) -> NsDaemon:
        """Daemon.spawn, started through `ip netns exec` (which execs: same PID).

        `ip netns exec` mounts a fresh /sys without cgroups, so agents in a namespace cannot
        contain jobs: unless the test gives its own config, the cluster lets such nodes run
        them (`[isolation] require_cgroups = false`, docs/isolation.md)."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        if "PHALANX_CONFIG" not in self.env:
            conf = self.log.parent / "netns.toml"
            conf.write_text("[isolation]\nrequire_cgroups = false\n")
            self.env = {**self.env, "PHALANX_CONFIG": str(conf)}
        cmd = ["ip", "netns", "exec", self.netns, *phalanx_cmd(*self.args)]
        with open(self.log, "ab") as out:
            out.write(f"===== {time.strftime('%H:%M:%S')} start in {self.netns}: {cmd}\n".encode())
            out.flush()
            self.started_wall = time.time()
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self.env,
            )
        return self


@dataclass
class NetnsCluster(Cluster):
    """A cluster whose controller listens on `host` in `ctl_ns`; agents in per-node namespaces.

    The test's thread must be inside `ctl_ns` (NetnsLab.entered) to use `client()`.
    """

    host: str = "127.0.0.1"
    ctl_ns: str = ""
    node_ns: dict[str, str] = field(default_factory=dict)  # node -> namespace (default ctl_ns)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start_controller(
        self, cid: str = "ctl-1", *, wait: bool = True, port: int | None = None
    ) -> Daemon:
        """Cluster.start_controller, in `ctl_ns` and listening on `host` (at `port`, else the
        cluster's: several controllers share the address on ports of their own)."""
        args = ["controller", "--state-dir", str(self.state_dir), "--host", self.host]
        args += ["--port", str(port or self.port), "--id", cid]
        if self.db:
            args += ["--db", self.db]
        log = self.logs / f"{cid}.log"
        d = NsDaemon(cid, "controller", args, log, self.env(), netns=self.ctl_ns).spawn()
        self.daemons[cid] = d
        if wait:
            self.wait_controller(d)
        return d

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
        """Cluster.start_agent, in the node's namespace (`node_ns`, else the controller's);
        `url`: the controller list it is given (default: the cluster's one controller)."""
        args = ["agent", "--name", node, "--state-dir", str(self.agent_dir(node))]
        args += ["--url", url or self.url, "--cpus", str(cpus), "--mem", mem, "--gpus", gpus]
        args += [*self.agent_auth_args(node), *extra_args]
        name = f"agent-{node}"
        ns = self.node_ns.get(node, self.ctl_ns)
        log = self.logs / f"{name}.log"
        d = NsDaemon(name, "agent", args, log, self.env(**(env or {})), netns=ns).spawn()
        self.daemons[name] = d
        if wait:
            self.wait_agents([node])
        return d
