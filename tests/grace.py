"""A controller's failure detector past a new lease holder's grace, on a `FakeClock`: the
grace is one node_down_timeout on the controller's clock (controller/clusterduty.py), so a
test moves that clock instead of waiting."""

from __future__ import annotations

from phalanx.clock import FakeClock
from phalanx.controller.clusterduty import CLUSTER_LEASE
from phalanx.controller.runtime import Controller


def pass_the_grace(ctl: Controller, clock: FakeClock) -> None:
    """Move the controller's clock past a new lease holder's grace (one node_down_timeout)
    as its lease loop would see it: a renewal every renew_interval, so the lease is never
    lost on the way (a lapsed lease would start the grace again)."""
    for _ in range(1000):
        since = ctl.cluster.since
        assert since is not None and ctl.leases.fence(CLUSTER_LEASE) is not None
        if clock.monotonic() - since >= ctl.timing.node_down_timeout:
            return
        clock.advance(ctl.leases.renew_interval)
        ctl.leases.tick()
    raise AssertionError("the grace never ended")
