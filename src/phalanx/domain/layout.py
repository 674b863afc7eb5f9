"""How a job's (or a step's) tasks are laid out over its nodes, in Slurm's terms (pure).

Scripts do world-size arithmetic with these numbers (``$((SLURM_NNODES*SLURM_NTASKS_PER_NODE))``),
so they follow Slurm: ``--ntasks-per-node`` fixes the count per node; ``--ntasks`` alone is spread
in blocks, the first nodes taking one more when it does not divide (``-N 2 -n 3``: 2 and 1);
neither means one task per node.  ``SLURM_TASKS_PER_NODE`` is the run-length form ``2(x3),1``.
"""

from __future__ import annotations

from collections.abc import Sequence


def tasks_per_node(
    nnodes: int, *, ntasks: int | None = None, ntasks_per_node: int | None = None
) -> list[int]:
    """Tasks on each node, in node order. ``ntasks`` wins where both are given and differ
    (Slurm: ``-n`` is the total, ``--ntasks-per-node`` a maximum per node)."""
    if nnodes < 1:
        raise ValueError("a layout needs at least one node")
    if ntasks is None:
        return [ntasks_per_node or 1] * nnodes
    if ntasks < nnodes:
        raise ValueError(f"{ntasks} tasks cannot cover {nnodes} nodes (one task per node at least)")
    if ntasks_per_node is not None and ntasks <= nnodes * ntasks_per_node:
        counts = []
        left = ntasks
        for i in range(nnodes):
            # fill in blocks, but leave at least one task for every node still to come
            n = min(ntasks_per_node, left - (nnodes - i - 1))
            counts.append(n)
            left -= n
        return counts
    base, extra = divmod(ntasks, nnodes)
    return [base + (1 if i < extra else 0) for i in range(nnodes)]


def compress_counts(counts: Sequence[int]) -> str:
    """Slurm's run-length form of per-node counts: ``[2, 2, 2, 1]`` -> ``2(x3),1``."""
    parts: list[str] = []
    i = 0
    while i < len(counts):
        j = i
        while j + 1 < len(counts) and counts[j + 1] == counts[i]:
            j += 1
        run = j - i + 1
        parts.append(f"{counts[i]}(x{run})" if run > 1 else str(counts[i]))
        i = j + 1
    return ",".join(parts)


def task_ranks(counts: Sequence[int]) -> list[list[int]]:
    """The global task ids (SLURM_PROCID) on each node, block distribution: [[0, 1], [2, 3]]."""
    out: list[list[int]] = []
    first = 0
    for n in counts:
        out.append(list(range(first, first + n)))
        first += n
    return out
