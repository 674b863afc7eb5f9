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
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

__all__ = ["restart_layout"]


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
