"""The package's import graph has no cycle and never imports upwards.

Every `import` and `from ... import` under src/phalanx is read with `ast`, lazy imports inside
functions included (a lazy import is how a cycle hides: it only breaks when the call happens).
The layers, from the bottom (docs/architecture.md): utilities that import nothing of ours,
then domain and auth, then the store, the configuration and the client, the controller, the
agent, the Slurm commands, the simulator and the local cluster, the `phalanx` CLI. A module may
import its own group and any lower layer, never a higher one.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PKG = SRC / "phalanx"

# group -> layer; a group is a subpackage or a top-level module of `phalanx`
LAYERS: dict[str, int] = {
    **dict.fromkeys(
        (
            "phalanx",
            "errors",
            "clock",
            "backoff",
            "netaddr",
            "sdnotify",
            "watchdog",
            "daemon",
            "failover",
            "faulthooks",
            "gctune",
            "native",
        ),
        0,
    ),
    "job": 0,  # the in-job helper: standard library only
    **dict.fromkeys(("domain", "auth", "api_calls"), 1),
    **dict.fromkeys(("store", "config", "client", "lean_client", "submitting", "rendezvous"), 2),
    "controller": 3,
    "agent": 4,
    "slurm": 5,
    **dict.fromkeys(("sim", "local"), 6),
    **dict.fromkeys(("cli", "__main__"), 7),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ours that `name` imports anywhere in its text (lazy imports too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # `from pkg import mod` imports the module pkg.mod; `from mod import name`, mod
            targets = [
                f"{stem}.{a.name}" if f"{stem}.{a.name}" in known else stem for a in node.names
            ]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import phalanx.x.y` where y is a name: its module
                t = t.rpartition(".")[0]
            if t.startswith("phalanx") and t != name:
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports(name, path, known) for name, path in mods.items()}


def group(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def test_the_reader_sees_lazy_and_relative_imports() -> None:
    edges = graph()
    assert "phalanx.domain.spec" in edges["phalanx.controller.submit_api"]
    # a lazy import inside a function counts (main's `submit` imports submitting late)
    assert "phalanx.submitting" in edges["phalanx.cli.main"]


def test_every_group_has_a_layer() -> None:
    assert {group(m) for m in modules()} <= set(LAYERS), "a new package: give it a layer here"


def test_no_import_cycle() -> None:
    assert cycles(graph()) == []


def test_cycle_finder_finds_one() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_runs_up_the_layers() -> None:
    upward = defaultdict(list)
    for module, targets in graph().items():
        for t in targets:
            g, h = group(module), group(t)
            if g != h and LAYERS[h] > LAYERS[g]:
                upward[f"{g} (layer {LAYERS[g]}) -> {h} (layer {LAYERS[h]})"].append(
                    f"{module} imports {t}"
                )
    if upward:
        pytest.fail("\n".join(f"{k}: {v}" for k, v in sorted(upward.items())))
