"""scripts/clean-cgroup-leftovers.py over a fake tree: only empty `phalanx/<node>-<8 hex>` go."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "clean-cgroup-leftovers.py"


@pytest.fixture(scope="module")
def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("clean_cgroup_leftovers", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_names(script: ModuleType) -> None:
    assert script.is_leftover_name("node01-1a2b3c4d")
    assert script.is_leftover_name("gpu-node.x_1-00000000")
    assert not script.is_leftover_name("node01-1A2B3C4D")
    assert not script.is_leftover_name("node01-1a2b3c4")
    assert not script.is_leftover_name("node01")
    assert not script.is_leftover_name("17")


def test_only_empty_node_roots_are_removed(
    script: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    v1 = tmp_path / "pids" / "phalanx"
    deep = tmp_path / "memory" / "process_api" / "ab12" / "phalanx"
    empty = [v1 / "node01-1a2b3c4d", deep / "node02-00ff00ff"]
    busy = v1 / "node03-deadbeef"
    other = [v1 / "keepme", tmp_path / "pids" / "node04-12345678"]  # not <phalanx>/<node>-<hex>
    for d in [*empty, busy / "42", *other]:
        d.mkdir(parents=True)
    old = 1_000_000_000
    for d in [*empty, busy]:
        os.utime(d, (old, old))
    young = v1 / "node05-abcdef01"  # an agent making its root right now
    young.mkdir()

    assert script.main(["--top", str(tmp_path), "--dry-run"]) == 0
    assert "would remove 2 empty node cgroups; 1 not empty" in capsys.readouterr().out
    assert all(d.is_dir() for d in empty)

    assert script.main(["--top", str(tmp_path)]) == 0
    assert "removed 2 empty node cgroups; 1 not empty (kept); 1 changed" in capsys.readouterr().out
    assert not any(d.exists() for d in empty)
    assert (busy / "42").is_dir() and young.is_dir() and all(d.is_dir() for d in other)
    assert v1.is_dir() and deep.is_dir(), "the shared phalanx directories stay"
