"""Elastic jobs and hot spares: which nodes a job keeps after one of its nodes failed (pure).

An elastic job (`--nodes=MIN-MAX`) or a job with hot spares (`--spares=K`) that loses a node does
not go back through the queue: the store puts it back to PENDING with a *restart reservation*
(`jobs.reserved_nodes`, rank order, until `jobs.reserved_until`) and the scheduler starts it
again on exactly those nodes before anything else, closing them to every other job meanwhile.

`restart_layout` decides that reservation from the failed attempt. The rank layout is kept:
every surviving rank stays on its node with its rank; a failed rank's node is replaced by the
first usable spare; with no spare left an elastic job drops that rank (ranks after it move up
by one) and a fixed-size job cannot restart this way (it is requeued as usual).

The reservation is a list: the rank nodes in rank order, then the spares left over. The
scheduler reads its first ``min(len, max ranks)`` entries as ranks (max ranks: MAX for an
elastic job, the node count otherwise) and the rest as spares; an elastic job below MAX may
therefore turn a leftover spare into a new last rank, which grows it without moving anyone.

A job submitted with `--no-kill` is not restarted at all: `keep_running` decides how it goes
on in the same attempt (its surviving nodes and their processes untouched, a spare in the lost
node's place, its steps' tasks started again there: `move_steps`); docs/elastic.md.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Regroup", "StepMove", "keep_running", "move_steps", "restart_layout"]


def restart_layout(
    ranks: Sequence[str],
    spares: Sequence[str],
    failed: Collection[str],
    *,
    nodes_min: int,
    elastic: bool,
) -> list[str] | None:
    """The nodes to restart on (ranks in rank order, then leftover spares), or None.

    ``ranks``: the failed attempt's nodes in rank order; ``spares``: its spare nodes;
    ``failed``: nodes that cannot be used again (dead, drained, lost their task). None means a
    fast restart is not possible: fewer than ``nodes_min`` ranks would be left.
    """
    pool = [n for n in spares if n not in failed]
    new_ranks: list[str] = []
    for node in ranks:
        if node not in failed:
            new_ranks.append(node)
        elif pool:
            new_ranks.append(pool.pop(0))
        elif not elastic:
            return None
    if len(new_ranks) < nodes_min:
        return None
    return new_ranks + pool


# --------------------------------------------------------------------------------------------
# Recovery inside the allocation (--no-kill)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Regroup:
    """A --no-kill job that lost rank nodes keeps running: its layout after the loss.

    ``ranks``: (rank, node) of every rank node after the change, in rank order (a spare takes
    the rank of the node it replaces; a rank nobody takes leaves a gap: the survivors keep
    their ranks, since their processes cannot be renumbered while they run). ``left``: the
    rank nodes that left; ``joined``: (spare node, the rank it takes, the node it replaces);
    ``spares``: the spares still held."""

    ranks: tuple[tuple[int, str], ...]
    left: tuple[str, ...]
    joined: tuple[tuple[str, int, str], ...]
    spares: tuple[str, ...]

    @property
    def nodes(self) -> list[str]:
        """The rank nodes in rank order (the attempt's node list)."""
        return [node for _, node in self.ranks]

    @property
    def moves(self) -> dict[str, str | None]:
        """Each node that left -> the spare that takes its place, or None."""
        out: dict[str, str | None] = dict.fromkeys(self.left)
        for spare, _rank, old in self.joined:
            out[old] = spare
        return out


def keep_running(
    ranks: Sequence[tuple[int, str]],
    spares: Sequence[str],
    failed: Collection[str],
    *,
    nodes_min: int,
    batch_host: bool,
) -> Regroup | None:
    """Whether a --no-kill job goes on after losing the ``failed`` nodes, and how (pure).

    ``ranks``: (rank, node) of the running attempt's rank nodes; ``spares``: its spare nodes
    in order; ``failed``: nodes that cannot be used (dead, drained, lost their task: spares
    among them are skipped); ``nodes_min``: the fewest rank nodes it may run on (MIN for an
    elastic job; 1 for a fixed-size one, which Slurm's --no-kill keeps running on what is
    left); ``batch_host``: rank 0 runs the batch script (Slurm's batch step), so losing it
    loses the job's script: no regroup then, nor when no rank node failed or fewer than
    ``nodes_min`` would remain. Each failed rank's node is replaced by the first usable
    spare, in rank order; with no spare left the rank is dropped."""
    gone = [(rank, node) for rank, node in ranks if node in failed]
    if not gone:
        return None
    if batch_host and any(rank == 0 for rank, _ in gone):
        return None
    pool = [n for n in spares if n not in failed]
    kept: list[tuple[int, str]] = []
    joined: list[tuple[str, int, str]] = []
    for rank, node in ranks:
        if node not in failed:
            kept.append((rank, node))
        elif pool:
            spare = pool.pop(0)
            kept.append((rank, spare))
            joined.append((spare, rank, node))
    if len(kept) < max(1, nodes_min):
        return None
    return Regroup(
        ranks=tuple(sorted(kept)),
        left=tuple(node for _, node in gone),
        joined=tuple(joined),
        spares=tuple(pool),
    )


@dataclass(frozen=True)
class StepMove:
    """What becomes of one running step when its job regroups (`move_steps`)."""

    step_id: int
    nodes: tuple[str, ...]  # the step's node list after the move (same order, same task ids)
    moved: tuple[tuple[str, str], ...]  # (node that left, node that runs its tasks now)
    lost: tuple[str, ...]  # nodes that left whose tasks nobody runs again


def move_steps(
    steps: Sequence[tuple[int, Sequence[str], Collection[str]]],
    moves: Mapping[str, str | None],
) -> list[StepMove]:
    """The running steps a regroup changes (pure): ``steps`` are (step id, its nodes in node
    order, the nodes whose tasks of it are still live); ``moves`` is `Regroup.moves`. A live
    step task on a node that left is started again on the node that took its place, at the
    same position of the step's node list, so it keeps its task ids (SLURM_PROCID) and node
    id; with nobody in its place it is lost. Steps with no live task on a node that left are
    not listed."""
    out: list[StepMove] = []
    for step_id, nodes, live in steps:
        hit = [n for n in nodes if n in moves and n in live]
        if not hit:
            continue
        new = [moves.get(n) or n if n in hit else n for n in nodes]
        out.append(
            StepMove(
                step_id=step_id,
                nodes=tuple(new),
                moved=tuple((n, str(moves[n])) for n in hit if moves[n] is not None),
                lost=tuple(n for n in hit if moves[n] is None),
            )
        )
    return out
