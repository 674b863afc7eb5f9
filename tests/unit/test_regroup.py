"""Recovery inside the allocation (`--no-kill`), the pure decisions: `keep_running` (which
nodes a job goes on with after losing some, who takes which rank) and `move_steps` (which
step tasks start again on the node that joined)."""

from __future__ import annotations

from phalanx.domain.elastic import Regroup, StepMove, keep_running, move_steps

RANKS = [(0, "n1"), (1, "n2"), (2, "n3")]


def test_a_spare_takes_the_lost_rank_and_the_others_keep_theirs() -> None:
    got = keep_running(RANKS, ["s1", "s2"], {"n2"}, nodes_min=1, batch_host=True)
    assert got == Regroup(
        ranks=((0, "n1"), (1, "s1"), (2, "n3")),
        left=("n2",),
        joined=(("s1", 1, "n2"),),
        spares=("s2",),
    )
    assert got.nodes == ["n1", "s1", "n3"]
    assert got.moves == {"n2": "s1"}


def test_a_dead_spare_is_skipped_and_each_lost_rank_gets_the_next_one() -> None:
    got = keep_running(RANKS, ["s1", "s2", "s3"], {"n2", "n3", "s1"}, nodes_min=3, batch_host=True)
    assert got is not None
    assert got.ranks == ((0, "n1"), (1, "s2"), (2, "s3"))
    assert got.joined == (("s2", 1, "n2"), ("s3", 2, "n3"))
    assert got.spares == ()


def test_without_a_spare_the_rank_is_dropped_while_min_remain() -> None:
    got = keep_running(RANKS, [], {"n2"}, nodes_min=2, batch_host=True)
    assert got is not None
    # the survivors keep their ranks: a gap where the lost one was
    assert got.ranks == ((0, "n1"), (2, "n3"))
    assert got.left == ("n2",) and got.joined == () and got.moves == {"n2": None}
    assert keep_running(RANKS, [], {"n2", "n3"}, nodes_min=2, batch_host=True) is None


def test_a_fixed_size_job_goes_on_smaller_as_slurms_no_kill() -> None:
    # the store passes nodes_min=1 for a fixed-size job: what is left keeps running
    got = keep_running(RANKS, [], {"n3"}, nodes_min=1, batch_host=True)
    assert got is not None and got.nodes == ["n1", "n2"]


def test_losing_the_batch_host_loses_the_script() -> None:
    assert keep_running(RANKS, ["s1"], {"n1"}, nodes_min=1, batch_host=True) is None
    # with the script on every node (--all-nodes) rank 0 is a node like the others
    got = keep_running(RANKS, ["s1"], {"n1"}, nodes_min=1, batch_host=False)
    assert got is not None and got.ranks[0] == (0, "s1")


def test_nothing_to_do_when_no_rank_failed() -> None:
    assert keep_running(RANKS, ["s1"], {"s1"}, nodes_min=1, batch_host=True) is None
    assert keep_running(RANKS, ["s1"], set(), nodes_min=1, batch_host=True) is None


def test_ranks_with_a_gap_stay_in_rank_order() -> None:
    got = keep_running(
        [(0, "n1"), (2, "n3"), (3, "n4")], ["s1"], {"n4"}, nodes_min=1, batch_host=True
    )
    assert got is not None and got.ranks == ((0, "n1"), (2, "n3"), (3, "s1"))


def test_a_live_step_task_on_a_lost_node_moves_to_its_replacement_in_place() -> None:
    moves = {"n2": "s1", "n4": None}
    steps = [
        (0, ["n1", "n2", "n3"], {"n1", "n2", "n3"}),  # runs on n2: moves, same position
        (1, ["n1", "n3"], {"n1", "n3"}),  # never on a lost node: untouched
        (2, ["n1", "n2"], {"n1"}),  # its task on n2 had ended already: untouched
        (3, ["n2", "n4"], {"n2", "n4"}),  # n4 has nobody in its place: lost there
    ]
    assert move_steps(steps, moves) == [
        StepMove(0, ("n1", "s1", "n3"), (("n2", "s1"),), ()),
        StepMove(3, ("s1", "n4"), (("n2", "s1"),), ("n4",)),
    ]
