"""Utilisation over a window (domain/usage_report.py): clipping attempts and DOWN spells to
the window, capacity from each node's first registration, idle as what is left."""

from __future__ import annotations

from phalanx.domain.usage_report import build, down_seconds, overlap


def test_overlap_and_down_spells() -> None:
    assert overlap(0, 10, 5, 20) == 5 and overlap(0, 10, 10, 20) == 0
    # down at 10, back at 30, down again at 50 (still): within [20, 60)
    assert down_seconds(False, [(10, True), (30, False), (50, True)], 20, 60) == 10 + 10
    assert down_seconds(True, [], 0, 100) == 100  # down all along
    assert down_seconds(False, [(5, False)], 0, 100) == 0  # "back" without a DOWN


def test_a_window_clips_attempts_and_counts_nodes_from_their_registration() -> None:
    attempts = [
        {"start_time": 50, "end_time": 150, "cpus": 2, "account": "a", "user": "u1"},
        {"start_time": 180, "end_time": None, "cpus": 1, "account": "a", "user": "u2"},
        {"start_time": None, "end_time": None, "cpus": 8, "account": "a", "user": "u3"},
    ]
    nodes = [
        {"name": "n1", "cpus": 4, "registered_at": 0},
        {"name": "n2", "cpus": 4, "registered_at": 150},  # joined half way
    ]
    events = {"n1": [(20, True), (90, False)], "n2": [(160, True), (170, False)]}
    rep = build(100, 200, now=190, attempts=attempts, nodes=nodes, node_events=events)
    # nothing past now: the window is [100, 190)
    assert rep.allocated == 2 * 50 + 1 * 10
    assert rep.by_assoc == {("a", "u1"): 100, ("a", "u2"): 10}
    assert rep.reported == 4 * 90 + 4 * 40 and rep.cpus == 8
    assert rep.down == 4 * 10  # n1 was back before the window; n2 down 160-170
    assert rep.idle == rep.reported - rep.allocated - rep.down
