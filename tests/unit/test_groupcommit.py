"""Group commit (store/groupcommit.py): callers that arrive while a group runs form the next
one, each caller gets its own result or error, and a lone caller runs at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from phalanx.store.groupcommit import GroupCommit

DEADLINE = 30.0


def wait_for(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)  # polling interval of a wait on a condition


def test_a_lone_call_runs_at_once_in_a_group_of_its_own() -> None:
    groups: list[list[int]] = []

    def run(items: list[int]) -> list[int | BaseException]:
        groups.append(items)
        return [i * 10 for i in items]

    gc: GroupCommit[int, int] = GroupCommit(run)
    assert gc(1) == 10
    assert gc(2) == 20
    assert groups == [[1], [2]]


def test_calls_that_arrive_while_a_group_runs_form_the_next_group() -> None:
    release = threading.Event()
    groups: list[list[int]] = []

    def run(items: list[int]) -> list[int | BaseException]:
        groups.append(list(items))
        if items == [0]:
            release.wait(DEADLINE)  # the first group is still committing
        return [i * 10 for i in items]

    gc: GroupCommit[int, int] = GroupCommit(run)
    results: dict[int, int] = {}

    def call(i: int) -> None:
        results[i] = gc(i)

    first = threading.Thread(target=call, args=(0,))
    first.start()
    wait_for(lambda: bool(groups), "the first group to start")
    rest = [threading.Thread(target=call, args=(i,)) for i in range(1, 9)]
    for t in rest:
        t.start()
    wait_for(lambda: gc.waiting() == 8, "eight callers to wait")
    release.set()
    for t in [first, *rest]:
        t.join(DEADLINE)
    assert results == {i: i * 10 for i in range(9)}
    assert groups[0] == [0] and sorted(groups[1]) == list(range(1, 9)) and len(groups) == 2
    assert gc.largest == 8


def test_each_caller_gets_its_own_error_and_a_failed_group_fails_all_of_its_callers() -> None:
    def run(items: list[int]) -> list[int | BaseException]:
        if 99 in items:
            raise RuntimeError("the whole group failed")
        return [ValueError(f"bad {i}") if i < 0 else i for i in items]

    gc: GroupCommit[int, int] = GroupCommit(run)
    assert gc(3) == 3
    with pytest.raises(ValueError, match="bad -1"):
        gc(-1)
    with pytest.raises(RuntimeError, match="the whole group failed"):
        gc(99)
    assert gc(4) == 4  # the lead was handed back after the failure


def test_a_group_never_carries_more_than_max_group_calls() -> None:
    release = threading.Event()
    sizes: list[int] = []

    def run(items: list[int]) -> list[int | BaseException]:
        sizes.append(len(items))
        if items == [0]:
            release.wait(DEADLINE)
        return list(items)

    gc: GroupCommit[int, int] = GroupCommit(run, max_group=3)
    threads = [threading.Thread(target=gc, args=(0,))]
    threads[0].start()
    wait_for(lambda: bool(sizes), "the first group to start")
    threads += [threading.Thread(target=gc, args=(i,)) for i in range(1, 8)]
    for t in threads[1:]:
        t.start()
    wait_for(lambda: gc.waiting() == 7, "seven callers to wait")
    release.set()
    for t in threads:
        t.join(DEADLINE)
    assert sizes[0] == 1 and sum(sizes) == 8 and max(sizes) == 3
