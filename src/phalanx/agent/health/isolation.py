"""The `isolation` check: can this node contain jobs (cgroups), and does the cluster require it?

The agent detects what the host offers once at start (`phalanx.agent.cgroups`); the cluster's
`[isolation] require_cgroups` arrives with the register reply and may change, so the verdict is
computed on every run: FAIL (the node is drained with the reason) when jobs cannot be contained
and the cluster requires it, OK otherwise, with a reason naming the backend or saying that
jobs run uncontained.
"""

from __future__ import annotations

from collections.abc import Callable

from phalanx.agent.health.base import CheckResult, Status


class IsolationCheck:
    name = "isolation"

    def __init__(
        self,
        capability: Callable[[], tuple[bool, str]],
        required: Callable[[], bool],
        *,
        interval: float = 5.0,
    ) -> None:
        """`capability()`: (usable, one line describing the backend or what is missing);
        `required()`: the cluster's require_cgroups as last heard."""
        self.capability = capability
        self.required = required
        self.interval = interval

    def run(self) -> CheckResult:
        usable, detail = self.capability()
        if usable:
            return CheckResult(self.name, Status.OK, f"jobs contained by {detail}")
        if self.required():
            return CheckResult(
                self.name,
                Status.FAIL,
                f"{detail}: jobs cannot be contained; "
                "set [isolation] require_cgroups = false to run them anyway",
            )
        return CheckResult(
            self.name,
            Status.OK,
            f"jobs run uncontained: {detail} ([isolation] require_cgroups = false)",
        )
