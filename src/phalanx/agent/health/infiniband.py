"""InfiniBand (and RoCE) port health from sysfs: link state and error-counter growth.

Layout read (the kernel's, reproduced by tests in a tmp dir)::

    <sysfs_root>/<dev>/ports/<n>/state          "4: ACTIVE"
    <sysfs_root>/<dev>/ports/<n>/phys_state     "5: LinkUp"     (optional)
    <sysfs_root>/<dev>/ports/<n>/counters/<counter>             an integer
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from phalanx.agent.health.base import CheckResult, Status, one_line

#: Counters whose growth means a bad cable, transceiver or HCA (not congestion, which is why
#: port_xmit_discards / port_xmit_wait are not here).
ERROR_COUNTERS = (
    "symbol_error",
    "link_error_recovery",
    "link_downed",
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
)


class InfinibandCheck:
    """A port that is not ACTIVE -> FAIL (multi-node jobs would hang or fall back to TCP);
    fewer ports than `expect_ports` -> FAIL (an HCA vanished); an error counter growing by more
    than `error_counters_warn` between two runs -> WARN (a flaky link: stop new work).

    No IB devices with `expect_ports` None is fine (a node without InfiniBand).  Ports an
    administrator disabled (phys_state "Disabled") are skipped, and `ports` (e.g.
    ``["mlx5_0/1"]``) restricts the check to the cabled ones on multi-port HCAs.  The first run
    only records counter baselines; a counter that went down (reset) is re-baselined.
    """

    def __init__(
        self,
        sysfs_root: str | os.PathLike[str] = "/sys/class/infiniband",
        expect_ports: int | None = None,
        error_counters_warn: int = 10,
        interval: float = 30,
        *,
        ports: Iterable[str] | None = None,
        counters: Iterable[str] = ERROR_COUNTERS,
        name: str = "infiniband",
    ) -> None:
        self.root = Path(sysfs_root)
        self.expect_ports = expect_ports
        self.error_counters_warn = error_counters_warn
        self.interval = float(interval)
        self.only = set(ports) if ports is not None else None
        self.counters = tuple(counters)
        self.name = name
        self._last: dict[tuple[str, str], int] = {}

    def _ports(self) -> list[tuple[str, Path]]:
        out = []
        try:
            devs = sorted(self.root.iterdir())
        except OSError:
            return []
        for dev in devs:
            try:
                ports = sorted((dev / "ports").iterdir(), key=lambda p: (len(p.name), p.name))
            except OSError:
                continue
            for port in ports:
                label = f"{dev.name}/{port.name}"
                if self.only is None or label in self.only:
                    out.append((label, port))
        return out

    def run(self) -> CheckResult:
        problems: list[tuple[Status, str]] = []
        seen = 0
        for label, port in self._ports():
            phys = _read(port / "phys_state")
            if phys is not None and _word(phys).lower() == "disabled":
                continue
            seen += 1
            state = _read(port / "state")
            dev, num = label.split("/", 1)
            where = f"{dev} port {num}"
            if state is None:
                problems.append((Status.FAIL, f"{where}: state unreadable"))
            elif _word(state).upper() != "ACTIVE":
                detail = f" (phys {_word(phys)})" if phys else ""
                problems.append((Status.FAIL, f"{where}: {_word(state)}{detail}"))
            problems.extend(
                (Status.WARN, f"{where}: {r}") for r in self._counter_growth(label, port)
            )
        if self.expect_ports is not None and seen < self.expect_ports:
            problems.insert(
                0, (Status.FAIL, f"expected {self.expect_ports} IB ports, found {seen}")
            )
        fails = [r for s, r in problems if s is Status.FAIL]
        warns = [r for s, r in problems if s is Status.WARN]
        if fails or warns:
            status, first = (Status.FAIL, fails[0]) if fails else (Status.WARN, warns[0])
            more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
            return CheckResult(self.name, status, one_line(first + more))
        if seen == 0:
            return CheckResult(self.name, Status.OK, "no InfiniBand ports")
        return CheckResult(self.name, Status.OK, f"{seen} IB ports active")

    def _counter_growth(self, label: str, port: Path) -> list[str]:
        out = []
        for counter in self.counters:
            raw = _read(port / "counters" / counter)
            if raw is None:
                continue
            try:
                value = int(raw.split()[0])
            except (ValueError, IndexError):
                continue
            key = (label, counter)
            before = self._last.get(key)
            self._last[key] = value
            if before is not None and value - before > self.error_counters_warn:
                out.append(f"{counter} +{value - before} since last check")
        return out


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _word(value: str) -> str:
    """ "4: ACTIVE" -> "ACTIVE"; a bare "ACTIVE" stays as it is."""
    return value.split(":", 1)[1].strip() if ":" in value else value.strip()
