"""The unit files of deploy/systemd/: what systemd needs from them, what jobs need them not to
have, command lines the CLI accepts, and `systemd-analyze verify` where it is installed."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import typer

from phalanx.cli.main import app

UNITS = Path(__file__).parents[2] / "deploy" / "systemd"
CONTROLLER = UNITS / "phalanx-controller.service"
AGENT = UNITS / "phalanx-agent.service"

# sandboxing that every process of the service inherits: jobs would run under it
INHERITED_BY_JOBS = (
    "NoNewPrivileges",
    "ProtectSystem",
    "ProtectHome",
    "PrivateTmp",
    "PrivateDevices",
    "DeviceAllow",
    "DevicePolicy",
    "ProtectClock",
    "ProtectControlGroups",
    "CapabilityBoundingSet",
    "SystemCallFilter",
    "RestrictNamespaces",
    "MemoryDenyWriteExecute",
    "RestrictSUIDSGID",
)


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """Sections -> key -> values (a key may repeat), continuation lines joined."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    pending = ""
    for raw in path.read_text().splitlines():
        line = pending + raw.strip()
        pending = ""
        if not line or line.startswith(("#", ";")):
            continue
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{path.name}: {line!r} outside a section"
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def one(unit: dict[str, dict[str, list[str]]], section: str, key: str) -> str:
    values = unit[section].get(key)
    assert values is not None, f"[{section}] {key}= is missing"
    return values[-1]


@pytest.mark.parametrize("path", [CONTROLLER, AGENT], ids=lambda p: p.stem)
def test_supervision_settings(path: Path) -> None:
    unit = parse_unit(path)
    assert one(unit, "Service", "Type") == "notify"
    assert one(unit, "Service", "NotifyAccess") == "main"
    assert one(unit, "Service", "Restart") == "always"
    assert one(unit, "Service", "WatchdogSec").endswith("s")
    # the start limit belongs in [Unit] (systemd ignores it in [Service] nowadays)
    assert int(one(unit, "Unit", "StartLimitBurst")) >= 5
    assert one(unit, "Unit", "StartLimitIntervalSec")
    assert one(unit, "Install", "WantedBy") == "multi-user.target"


@pytest.mark.parametrize("path", [CONTROLLER, AGENT], ids=lambda p: p.stem)
def test_the_command_line_is_one_the_cli_accepts(path: Path) -> None:
    argv = shlex.split(one(parse_unit(path), "Service", "ExecStart"))
    assert argv[0].endswith("/phalanx")
    command = typer.main.get_command(app).commands[argv[1]]  # type: ignore[attr-defined]
    accepted = {opt for p in command.params for opt in p.opts}
    given = {a for a in argv[2:] if a.startswith("--")}
    assert given <= accepted, given - accepted


def test_the_controller_is_sandboxed() -> None:
    unit = parse_unit(CONTROLLER)
    assert one(unit, "Service", "User") == "phalanx"
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "PrivateDevices"):
        assert one(unit, "Service", key) == "yes", key
    assert one(unit, "Service", "ProtectSystem") == "strict"
    assert one(unit, "Service", "CapabilityBoundingSet") == ""
    argv = shlex.split(one(unit, "Service", "ExecStart"))
    state = argv[argv.index("--state-dir") + 1]
    assert state == "/var/lib/" + one(unit, "Service", "StateDirectory")  # writable under strict


def test_the_agent_leaves_jobs_alone() -> None:
    unit = parse_unit(AGENT)
    service = unit["Service"]
    assert service.get("User", ["root"])[-1] == "root"  # jobs run as their users
    present = [k for k in INHERITED_BY_JOBS if k in service]
    assert not present, f"jobs would inherit {present}"
    assert one(unit, "Service", "KillMode") == "process"  # jobs outlive an agent restart
    assert one(unit, "Service", "Delegate") == "yes"  # it makes the jobs' cgroups
    assert one(unit, "Service", "TimeoutStartSec") == "infinity"  # READY=1 waits for a controller
    argv = shlex.split(one(unit, "Service", "ExecStart"))
    state = argv[argv.index("--state-dir") + 1]
    assert state == "/var/lib/" + one(unit, "Service", "StateDirectory")
    assert argv[argv.index("--auth-socket") + 1].startswith(
        "/run/" + one(unit, "Service", "RuntimeDirectory") + "/"
    )


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify_has_nothing_to_say(tmp_path: Path) -> None:
    # verify checks that ExecStart's program exists: point it at one that does
    for src in (CONTROLLER, AGENT):
        text = src.read_text().replace("/opt/phalanx/venv/bin/phalanx", "/bin/true")
        (tmp_path / src.name).write_text(text)
    proc = subprocess.run(
        [
            "systemd-analyze",
            "verify",
            "--man=no",
            *(str(tmp_path / u.name) for u in (CONTROLLER, AGENT)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and not (proc.stdout + proc.stderr).strip(), (
        proc.stdout + proc.stderr
    )
