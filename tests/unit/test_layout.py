"""Task layouts in Slurm's terms: counts per node, their run-length form, global task ids."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phalanx.domain.layout import compress_counts, task_ranks, tasks_per_node


def test_layouts_as_slurm_spreads_them() -> None:
    assert tasks_per_node(3) == [1, 1, 1]
    assert tasks_per_node(2, ntasks_per_node=4) == [4, 4]
    assert tasks_per_node(2, ntasks=3) == [2, 1]  # -N 2 -n 3: SLURM_TASKS_PER_NODE=2,1
    assert tasks_per_node(3, ntasks=7) == [3, 2, 2]
    assert tasks_per_node(2, ntasks=3, ntasks_per_node=2) == [2, 1]
    with pytest.raises(ValueError, match="cannot cover"):
        tasks_per_node(3, ntasks=2)


def test_run_length_form() -> None:
    assert compress_counts([2, 2, 2, 1]) == "2(x3),1"
    assert compress_counts([1]) == "1"
    assert compress_counts([3, 1, 1]) == "3,1(x2)"


@given(st.integers(1, 50), st.integers(0, 200), st.one_of(st.none(), st.integers(1, 8)))
def test_every_task_is_placed_once(nnodes: int, extra: int, per_node: int | None) -> None:
    ntasks = nnodes + extra
    counts = tasks_per_node(nnodes, ntasks=ntasks, ntasks_per_node=per_node)
    assert len(counts) == nnodes and sum(counts) == ntasks and min(counts) >= 1
    ranks = task_ranks(counts)
    assert [r for node in ranks for r in node] == list(range(ntasks))
