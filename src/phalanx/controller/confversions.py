"""The cluster configuration version a controller runs (config/versioned.py, store/configs.py).

At start (`startup`): on a store without a version, version 1 is made from this controller's
file; otherwise the current version is taken, whatever the file's cluster-wide sections say
(a warning says how they differ and how to apply them). The process-local sections always come
from the file.

While it runs (`ConfigVersions.presence`, the presence loop's tick, every `renew_interval`):
the one transaction that stamps the controller's presence also records the version it runs and
returns the current one. A new version is loaded with the same code and rules as a file
(`with_document`) and swapped in at one point, between two scheduling passes
(`Controller.adopt_config`); the scheduler also checks, in the snapshot each pass reads, that
the version it runs is still the current one, and skips the pass otherwise, so no pass plans
by an old version once a new one is committed. A controller that cannot run the current
version (its own settings break a rule with it) stops taking duties: it hands its leases back,
takes none, leaves the lease spread (its `last_seen` is no longer stamped) and says why in its
log, its `controllers` row (`config_problem`, shown by `phalanx cluster`), an event and
`/healthz/ready`; it runs the next version it can.

`validate` is what `phalanx config apply` runs on the serving controller before anything is
written: every rule of loading with its own file's settings, the rules that read another
controller's own settings with each live controller's (published when it registered:
`controllers.local_settings`, config/versioned.py `local_part`), then the checks against the
live cluster (`cross_check`). A controller of an older release publishes none: it is named as
not checked, and if it cannot run the version it stops taking duties, as before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import Gauge

from phalanx.config import Config
from phalanx.config.versioned import (
    changed_keys,
    cluster_document,
    cross_check,
    documents_equal,
    with_document,
    with_local_part,
)
from phalanx.domain import values
from phalanx.errors import ConfigError, InvalidSpec, PhalanxError
from phalanx.store.store import Store

log = logging.getLogger("phalanx.controller")

CONFIG_VERSION = Gauge(
    "phalanx_config_version",
    "The cluster configuration version this controller runs (0: none in the store)",
)
CONFIG_OK = Gauge(
    "phalanx_config_ok",
    "1 while this controller runs the current cluster configuration version; 0 when it "
    "cannot run it and takes no duties",
)
CONFIG_OK.set(1)


def partition_rows(config: Config) -> list[dict[str, Any]]:
    """The partitions table rows from the configuration."""
    rows = []
    parts = config.cluster.partitions
    has_default = any(p.default for p in parts)
    for i, p in enumerate(parts):
        rows.append(
            {
                "name": p.name,
                "is_default": p.default or (not has_default and i == 0),
                "nodes": p.nodes,
                "default_time_s": values.parse_duration(p.default_time),
                "max_time_s": values.parse_duration(p.max_time),
                "priority": p.priority,
            }
        )
    return rows


def label(version: int) -> str:
    return f"cluster configuration version {version}"


def startup(store: Store, file_config: Config, cid: str) -> tuple[Config, int]:
    """The configuration this controller starts with and its version: the store's current
    version with this file's process-local part (version 1 made from the file on a store
    without one). ConfigError: this controller's file cannot run the current version."""
    mine = cluster_document(file_config)
    current = store.config_current()
    if current is None:
        current = store.config_first(mine, actor=cid, partitions=partition_rows(file_config))
    version = int(current["version"])
    config = with_document(file_config, current["document"], label(version))
    # the version as it runs here: a key added by a later release (absent from a version
    # stored before it) has its default, and so differs from the file only if the file sets it
    stored = cluster_document(config)
    if not documents_equal(mine, stored):
        differ = changed_keys(stored, mine)
        log.warning(
            "this controller's configuration file differs from the store's %s in %s: the "
            "store's version is in force for every controller (the file's cluster-wide "
            "sections are not used); to make the file's version current run `phalanx config "
            "diff FILE` and `phalanx config apply FILE`",
            label(version),
            ", ".join(differ[:10]) + (" ..." if len(differ) > 10 else ""),
        )
    store.sync_partitions(partition_rows(config))
    CONFIG_VERSION.set(version)
    return config, version


def peer_problems(peers: Sequence[dict[str, Any]], doc: dict[str, Any], what: str) -> list[str]:
    """What keeps each other live controller (`controllers_seen` rows) from running `doc`,
    by the rules that read its own file's values (config/versioned.py, local_part): one
    sentence each. A controller that did not publish them (an older release) is not checked
    (`unchecked_peers`)."""
    out = []
    for peer in peers:
        part = peer.get("local_settings")
        if part is None:
            continue
        try:
            with_local_part(part, doc, what)
        except ConfigError as e:
            out.append(
                f"controller {peer['id']} could not run it with its own settings "
                f"({e.message.removeprefix(f'invalid configuration in {what}: ')}): change "
                "its file, or the version (rule: every live controller can run the version)"
            )
    return out


def unchecked_peers(peers: Sequence[dict[str, Any]]) -> list[str]:
    """Live controllers whose own settings are unknown (an older release): a version is
    not checked against them, and one that cannot run it takes no duties once it is applied."""
    return [str(p["id"]) for p in peers if p.get("local_settings") is None]


def validate(
    store: Store,
    local: Config,
    doc: dict[str, Any],
    current: dict[str, Any] | None,
    what: str,
    peers: Sequence[dict[str, Any]] = (),
) -> Config:
    """A new document held to every rule of loading (with this controller's own settings),
    and to the rules that read each other live controller's own settings (`peers`,
    `controllers_seen` rows without this one), then checked against the live cluster;
    InvalidSpec (422) names every rule broken."""
    try:
        new = with_document(local, doc, what)
    except ConfigError as e:
        raise InvalidSpec(f"{what} refused: {e.message}", field="config") from None
    others = peer_problems(peers, doc, what)
    if others:
        raise InvalidSpec(f"{what} refused, nothing changed: " + "; ".join(others), field="config")
    old = None
    if current is not None:
        try:
            old = with_document(local, current["document"], label(int(current["version"])))
        except ConfigError:
            old = None
    facts = store.config_live_facts()
    problems = cross_check(
        new,
        old,
        nodes=facts["nodes"],
        node_count=len(facts["nodes"]),
        licenses_in_use=store.licenses_in_use(),
        active_by_partition=facts["active_by_partition"],
    )
    if problems:
        raise InvalidSpec(
            f"{what} refused, nothing changed: " + "; ".join(problems), field="config"
        )
    return new


class ConfigVersions:
    """The version one controller runs, and its move to a new one."""

    def __init__(
        self,
        store: Store,
        local: Config,
        cid: str,
        version: int | None,
        *,
        adopt: Callable[[Config], None],
        stop_duties: Callable[[], None],
    ) -> None:
        self.store = store
        self.local = local  # this process's file: its process-local settings
        self.cid = cid
        self.version = version  # the version running (None: the store has none: tests, sim)
        self._latest: int | None = None  # the current version the last presence tick read
        self.problem: str | None = None  # why the current version cannot run here
        self.refused: int | None = None  # the version that could not run
        self.adopt = adopt
        self.stop_duties = stop_duties
        self._lock = threading.Lock()
        CONFIG_VERSION.set(version or 0)
        CONFIG_OK.set(1)

    @property
    def latest(self) -> int | None:
        """The cluster's current version as this controller last saw it (its presence loop,
        or the version it runs if newer): what a node's agent should run."""
        seen = [v for v in (self.version, self._latest) if v is not None]
        return max(seen) if seen else None

    def runs(self, version: int | None) -> bool:
        """Whether `version` (the current one, as a snapshot read it) is the one running:
        the scheduler skips a pass otherwise (the presence loop moves to it)."""
        return version is None or (version == self.version and self.problem is None)

    def presence(self) -> str:
        """The presence loop's tick: stamp presence, report the version running, and move
        to the current version if it is new."""
        current = self.store.controller_presence(
            self.cid,
            config_version=self.version,
            problem=self.problem,
            seen=self.problem is None,
        )
        if current is not None:
            self._latest = max(current, self._latest or 0)
        if self.problem is not None:
            self.stop_duties()  # a lease taken by a tick in flight when the problem came
        if current is None or current == self.version or current == self.refused:
            return ""
        return self.move()

    def move(self) -> str:
        """Load the current version and swap it in, or stop taking duties if it cannot run
        here. One sentence for the log."""
        with self._lock:
            row = self.store.config_current()
            if row is None or int(row["version"]) == self.version:
                return ""
            version = int(row["version"])
            try:
                config = with_document(self.local, row["document"], label(version))
            except ConfigError as e:
                return self._refuse(version, e.message)
            before = self.version
            self.adopt(config)
            self.version, self.problem, self.refused = version, None, None
            CONFIG_VERSION.set(version)
            CONFIG_OK.set(1)
            said = f"runs {label(version)} (was {before})"
            log.info("%s", said)
            try:
                self.store.controller_presence(self.cid, config_version=version, problem=None)
                self.store.add_event("config.running", f"controller {self.cid} {said}")
            except PhalanxError as e:  # reported again by the next presence tick
                log.warning("could not report %s: %s", label(version), e.message)
            return said

    def _refuse(self, version: int, why: str) -> str:
        self.problem = (
            f"cannot run {label(version)} (runs {self.version}): {why}; this controller takes "
            "no duties until it can (correct its own file's settings, or apply a version it "
            "accepts)"
        )
        self.refused = version
        CONFIG_OK.set(0)
        log.error("%s", self.problem)
        self.stop_duties()
        try:
            self.store.controller_presence(
                self.cid, config_version=self.version, problem=self.problem, seen=False
            )
            self.store.add_event("config.refused", f"controller {self.cid} {self.problem}")
        except PhalanxError as e:
            log.warning("could not report the refusal of %s: %s", label(version), e.message)
        return self.problem
