"""A --no-kill job's node changes told to the job (level-triggered, as signals): the reply
lists an attempt's membership to each of its nodes until the agent reports having written
that generation; the agent writes it once to the job's control file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from phalanx.agent import membership, shepherd_files
from phalanx.agent.checkpoint_requests import control_environment
from phalanx.controller.exchange import Reply, membership_items
from phalanx.store.store import TaskReport

MEMBERS = {
    "gen": 2,
    "nodes": ["n1", "n3"],
    "changes": [{"gen": 2, "left": ["n2"], "joined": [{"node": "n3", "rank": 1}]}],
}


def row(aid: int = 7, rank: int = 0, members: Any = MEMBERS, state: str = "RUNNING") -> Any:
    return {
        "attempt_id": aid,
        "token": f"t{aid}",
        "rank": rank,
        "attempt_state": state,
        "attempt_nodes": ["n1", "n3"],
        "attempt_membership": members,
    }


def report(aid: int = 7, gen: int | None = 0, state: str = "running") -> TaskReport:
    return TaskReport(aid, f"t{aid}", state, members_gen=gen)


def test_listed_until_the_agent_wrote_that_generation() -> None:
    (item,) = membership_items([row(rank=1)], [report(gen=1)])
    assert item == {
        "attempt_id": 7,
        "gen": 2,
        "nodes": ["n1", "n3"],
        "node_rank": 1,
        "changes": MEMBERS["changes"],
    }
    assert membership_items([row()], [report(gen=2)]) == []
    assert not Reply(members=[item]).empty  # it is work: the long-poll answers at once


def test_nothing_for_jobs_without_changes_old_agents_or_ended_tasks() -> None:
    assert membership_items([row(members=None)], [report()]) == []
    assert membership_items([row()], [report(gen=None)]) == []  # an agent that cannot write
    assert membership_items([row()], []) == []
    assert membership_items([row()], [report(state="exited")]) == []
    assert membership_items([row(state="STOPPING")], [report()]) == []


def test_the_agent_writes_each_generation_once_where_the_job_reads_it(tmp_path: Path) -> None:
    task = tmp_path / "7"
    (task / shepherd_files.CONTROL_DIR).mkdir(parents=True)
    path = Path(control_environment(task)["PHX_MEMBERSHIP_FILE"])
    (item,) = membership_items([row(rank=1)], [report(gen=membership.members_done(task))])
    membership.write_membership(tmp_path, [item])
    doc = json.loads(path.read_text())
    assert doc["gen"] == 2 and doc["nodes"] == ["n1", "n3"] and doc["node_rank"] == 1
    assert membership.members_done(task) == 2
    path.write_text("the job's own edit")
    membership.write_membership(tmp_path, [item])  # a repeated reply: not written again
    assert path.read_text() == "the job's own edit"
    # a task whose control directory is not there (yet) is skipped, not created
    membership.write_membership(tmp_path, [{**item, "attempt_id": 8}])
    assert not (tmp_path / "8").exists()
