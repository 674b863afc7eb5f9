"""`phalanx up` makes its node names resolve (local.py `publish_names`): one marked line in
the hosts file for the names that do not resolve already, removed by `down` without touching
any other line. A name the resolver knows is never shadowed."""

from __future__ import annotations

import uuid
from pathlib import Path

from phalanx.local import publish_names, unpublish_names


def test_only_unknown_names_are_added_and_only_our_line_is_removed(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n10.0.0.5 other # phalanx up /elsewhere\n")
    fresh = [f"phx-{uuid.uuid4().hex[:12]}", f"phx-{uuid.uuid4().hex[:12]}"]
    state = tmp_path / "state"
    added = publish_names(["localhost", *fresh], state, hosts)
    assert added == fresh  # localhost resolves: never shadowed
    lines = hosts.read_text().splitlines()
    assert lines[:2] == ["127.0.0.1 localhost", "10.0.0.5 other # phalanx up /elsewhere"]
    assert lines[2] == f"127.0.0.1 {' '.join(fresh)} # phalanx up {state.absolute()}"
    unpublish_names(state, hosts)
    assert hosts.read_text() == "127.0.0.1 localhost\n10.0.0.5 other # phalanx up /elsewhere\n"
    unpublish_names(state, hosts)  # twice: nothing more to do


def test_an_unwritable_hosts_file_adds_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir" / "hosts"
    assert publish_names([f"phx-{uuid.uuid4().hex[:12]}"], tmp_path, missing) == []
