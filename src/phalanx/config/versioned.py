"""The cluster-wide part of the configuration, kept in the store as numbered versions.

Every controller must schedule by the same rules, so what describes the cluster (its
partitions and licences, retries, topology, priority weights, preemption, the timings
controllers and agents must agree on) is one *document* in the store (`cluster_config`, one
row per version; docs/configuration.md "What lives where"). What belongs to one process (its
ports, paths, keys, database URL, HTTP bounds, rate limits, watchdog, the database deadline
`timing.db_op_timeout`) stays in each process's file. `[fairshare]`'s accounts, users and QOS
are not part of the document: `sacctmgr` keeps them in tables of their own.

A document is a plain dict of sections, complete (every default filled in) so that a version
says exactly what it means whatever later releases change in the defaults. This module is
pure: the split (`cluster_document`), a document from TOML text (`document_from_toml`), a
process's configuration with a document in force (`with_document`), the TOML form people read
and diff (`to_toml`, `unified_diff`), what changed (`changed_keys`), and the checks of a new
document against the live cluster (`cross_check`). Validation is `Config`'s own: a version is
held to every rule that loading a file checks.
"""

from __future__ import annotations

import difflib
import json
import tomllib
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ValidationError

from phalanx.config.loading import Config, explain_validation
from phalanx.config.timing import Timing
from phalanx.errors import ConfigError

__all__ = [
    "CLUSTER_SECTIONS",
    "LOCAL_TIMING",
    "OPTIONAL_SECTIONS",
    "changed_keys",
    "cluster_document",
    "cross_check",
    "document_from_toml",
    "documents_equal",
    "local_part",
    "to_toml",
    "unified_diff",
    "with_document",
    "with_local_part",
]

# the sections of the versioned document, in the order they are shown
CLUSTER_SECTIONS = ("cluster", "retry", "topology", "priority", "preemption", "timing", "nodes")
# sections a document holds only when they set something (`[nodes]`, config/nodes.py): a
# version made before they existed means the same as one that leaves them empty
OPTIONAL_SECTIONS = frozenset({"nodes"})
# timings that stay in each process's file: how long this process waits for its database
LOCAL_TIMING = frozenset({"db_op_timeout"})


def cluster_document(config: Config) -> dict[str, Any]:
    """The cluster-wide part of a loaded configuration, every value given."""
    doc = {sec: getattr(config, sec).model_dump(mode="json") for sec in CLUSTER_SECTIONS}
    if config.nodes.is_empty():
        del doc["nodes"]
    else:
        doc["nodes"] = config.nodes.model_dump(mode="json", exclude_none=True)
    for key in LOCAL_TIMING:
        doc["timing"].pop(key, None)
    return doc


def document_from_toml(
    text: str, source: str = "the file", local: Config | None = None
) -> tuple[dict[str, Any], list[str]]:
    """The document a TOML text describes (a whole configuration file may be given: only its
    cluster-wide sections are taken, defaults filling the rest) and the sections or keys it
    holds that are not part of it (process-local, left to each process's file). Checked by
    every rule of loading, with `local`'s process-local timings (default: the defaults)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source} is not valid TOML: {e}") from None
    picked = {k: data[k] for k in CLUSTER_SECTIONS if k in data}
    ignored = sorted(k for k in data if k not in CLUSTER_SECTIONS)
    timing = picked.get("timing")
    if isinstance(timing, dict):
        dropped = sorted(k for k in timing if k in LOCAL_TIMING)
        picked["timing"] = {k: v for k, v in timing.items() if k not in LOCAL_TIMING}
        ignored += [f"timing.{k}" for k in dropped]
    own = local.timing if local is not None else Timing()
    picked["timing"] = {
        **dict(picked.get("timing") or {}),
        **{k: getattr(own, k) for k in LOCAL_TIMING},
    }
    try:
        config = Config.model_validate(picked)
    except ValidationError as e:
        raise ConfigError(f"invalid configuration in {source}: {explain_validation(e)}") from None
    return cluster_document(config), ignored


def with_document(local: Config, doc: Mapping[str, Any], label: str = "the document") -> Config:
    """`local` (a process's file) with the cluster-wide sections of `doc` in force, validated
    whole: the rules that span a document and a process's own settings (the watchdog's, the
    lease rules with this process's `db_op_timeout`) are checked here. ConfigError names the
    rule."""
    data = local.model_dump()
    for sec in CLUSTER_SECTIONS:
        if sec in doc:
            data[sec] = dict(doc[sec])
        elif sec in OPTIONAL_SECTIONS:
            data[sec] = {}  # not in the document: empty, whatever this process's file says
    data["timing"] = {
        **data["timing"],
        **{k: getattr(local.timing, k) for k in LOCAL_TIMING},
    }
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"invalid configuration in {label}: {explain_validation(e)}") from None


def local_part(config: Config) -> dict[str, Any]:
    """What a process's own file sets of the values that the configuration's rules read
    across sections: `timing.db_op_timeout` (the lease rules) and `[watchdog]` (its rules
    with the timings). Each controller publishes it (`controllers.local_settings`), so that a
    new version is held to every controller's rules, not only the one that serves the apply."""
    return {
        "timing": {k: getattr(config.timing, k) for k in sorted(LOCAL_TIMING)},
        "watchdog": config.watchdog.model_dump(mode="json"),
    }


def with_local_part(
    part: Mapping[str, Any], doc: Mapping[str, Any], label: str = "the document"
) -> Config:
    """`doc` in force with another process's `local_part` (the defaults for the rest of its
    file, which no rule across sections reads), validated whole: ConfigError names the rule
    that process could not run it by."""
    data: dict[str, Any] = {sec: dict(doc[sec]) for sec in CLUSTER_SECTIONS if sec in doc}
    data["timing"] = {**dict(doc.get("timing") or {}), **dict(part.get("timing") or {})}
    if part.get("watchdog") is not None:
        data["watchdog"] = dict(part["watchdog"])
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"invalid configuration in {label}: {explain_validation(e)}") from None


def documents_equal(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> bool:
    """Whether two documents say the same (key order aside)."""
    return _canon(a) == _canon(b)


def _canon(doc: Mapping[str, Any] | None) -> str:
    return json.dumps(doc, sort_keys=True)


# ---------------------------------------------------------------- the TOML form
def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ", ".join(_scalar(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {type(v).__name__}")


def _is_table_list(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def _table(out: list[str], name: str, table: Mapping[str, Any], header: str) -> None:
    out.append(header)
    nested = []
    for k, v in table.items():
        if v is None:
            continue  # TOML has no null: an unset optional value is left out
        if isinstance(v, dict) or _is_table_list(v):
            nested.append((k, v))
        else:
            out.append(f"{k} = {_scalar(v)}")
    for k, v in nested:
        sub = f"{name}.{k}"
        if isinstance(v, dict):
            out.append("")
            _table(out, sub, v, f"[{sub}]")
        else:
            for item in v:
                out.append("")
                _table(out, sub, item, f"[[{sub}]]")


def to_toml(doc: Mapping[str, Any]) -> str:
    """The document as TOML (what `phalanx config show` prints and `apply` reads back)."""
    out: list[str] = []
    for sec in [*CLUSTER_SECTIONS, *(k for k in doc if k not in CLUSTER_SECTIONS)]:
        if sec not in doc:
            continue
        if out:
            out.append("")
        _table(out, sec, doc[sec], f"[{sec}]")
    return "\n".join(out) + "\n"


def unified_diff(
    old: Mapping[str, Any] | None, new: Mapping[str, Any], old_label: str, new_label: str
) -> str:
    """A unified diff of the two documents' TOML forms ('' when they say the same)."""
    a = to_toml(old).splitlines(keepends=True) if old else []
    b = to_toml(new).splitlines(keepends=True)
    return "".join(difflib.unified_diff(a, b, fromfile=old_label, tofile=new_label))


def changed_keys(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> list[str]:
    """The dotted keys whose values differ (a list of tables counts as one key): for events."""
    out: list[str] = []

    def walk(prefix: str, a: Any, b: Any) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in [*a, *(k for k in b if k not in a)]:
                walk(f"{prefix}.{k}" if prefix else str(k), a.get(k), b.get(k))
        elif _canon(a) != _canon(b):
            out.append(prefix)

    walk("", dict(old or {}), dict(new))
    return out


# ---------------------------------------------------------------- against the live cluster
def cross_check(
    new: Config,
    old: Config | None,
    *,
    nodes: Iterable[str],
    node_count: int,
    licenses_in_use: Mapping[str, int],
    active_by_partition: Mapping[str, int],
) -> list[str]:
    """What a new version would break in the live cluster, one sentence per problem, each
    naming its rule (empty: none). `nodes`: the registered node names; `active_by_partition`:
    jobs not yet ended, by the first partition they list."""
    from phalanx.domain.scheduling import node_partitions

    problems: list[str] = []
    names = sorted(nodes)
    rows = [{"name": p.name, "nodes": p.nodes} for p in new.cluster.partitions]
    if names:
        covered: dict[str, int] = {p.name: 0 for p in new.cluster.partitions}
        for n in names:
            for part in node_partitions(n, rows):
                covered[part] += 1
        for p in new.cluster.partitions:
            if covered[p.name] == 0:
                problems.append(
                    f"partition {p.name}: no node of the cluster matches nodes = {p.nodes!r} "
                    f"(rule: every partition has at least one node; the cluster's "
                    f"{len(names)} nodes: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''})"
                )
    kept = {p.name for p in new.cluster.partitions}
    for part, count in sorted(active_by_partition.items()):
        if count and part not in kept:
            problems.append(
                f"partition {part}: {count} job(s) not yet ended belong to it (rule: a "
                "partition with jobs pending or running cannot be removed; cancel or move "
                "them first)"
            )
    totals = new.cluster.license_totals()
    for name, used in sorted(licenses_in_use.items()):
        if used and totals.get(name, 0) < used:
            problems.append(
                f"cluster.licenses: {name} = {totals.get(name, 0)} is below the {used} in use "
                "by running jobs (rule: a limit may not fall below running usage)"
            )
    try:
        new.timing.for_cluster(node_count)
    except ValidationError as e:
        msg = explain_validation(e)
        problems.append(
            f"timing: scaled for the cluster's {node_count} nodes (heartbeat_budget "
            f"{new.timing.heartbeat_budget:g}) the timings break a rule: {msg}"
        )
    if old is not None and old.cluster.name != new.cluster.name:
        problems.append(
            f"cluster.name: {old.cluster.name!r} cannot change to {new.cluster.name!r} "
            "(rule: tokens and clients carry the cluster's name)"
        )
    return problems
