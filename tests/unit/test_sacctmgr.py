"""sacctmgr's pure parts (slurm/sacctmgr.py): the forms sites script, Slurm's keys mapped to
Phalanx's limits (others refused by name), the listings' columns, widths and `|` forms."""

from __future__ import annotations

import io
from typing import Any

import pytest

from phalanx.slurm import sacctmgr as m
from phalanx.slurm.common import SlurmUsageError


def line(text: str) -> tuple[m.Options, m.Command]:
    o, words = m.parse_options(text.split())
    return o, m.parse(words)


def test_add_forms() -> None:
    o, c = line("-i add account physics Parent=root fairshare=2 Description=Phys Organization=sci")
    assert o.immediate and (c.verb, c.entity, c.names) == ("add", "account", ["physics"])
    assert c.settings == {
        "parent": "root",
        "shares": 2,
        "description": "Phys",
        "organization": "sci",
    }
    _, c = line(
        "add user alice,bob Account=hep,bio DefaultAccount=bio MaxJobs=4 GrpTRES=gres/gpu=8"
    )
    assert (c.entity, c.names, c.accounts) == ("user", ["alice", "bob"], ["hep", "bio"])
    assert c.settings == {"default_account": "bio", "max_running_jobs": 4, "max_gpus": 8}
    _, c = line("--immediate create qos urgent Priority=100 MaxTRESPerUser=gres/gpu:h100=4 "
                "MaxWall=4:00:00 MaxJobsPU=2 MaxSubmitPU=5 PreemptMode=requeue PriorityTier=3")  # fmt: skip
    assert c.settings == {
        "priority": 100,
        "max_gpus": 4,
        "max_wall_s": 4 * 3600,
        "max_running_jobs": 2,
        "max_submit_jobs": 5,
        "preempt_mode": "requeue",
        "priority_tier": 3,
    }
    _, c = line("add user name=carol account=bio cluster=phalanx")
    assert c.names == ["carol"] and c.accounts == ["bio"] and c.clusters == ["phalanx"]


def test_modify_and_delete_forms() -> None:
    _, c = line("-i modify user where name=alice account=hep set MaxJobs=-1 maxsubmit=3")
    assert c.where == {"names": ["alice"], "accounts": ["hep"]}
    assert c.settings == {"max_running_jobs": -1, "max_submit_jobs": 3}
    _, c = line("modify user alice set DefaultAccount=bio")  # a bare name is the condition
    assert c.where == {"names": ["alice"]} and c.settings == {"default_account": "bio"}
    _, c = line("MODIFY Account Where Name=phys SET GrpJobs=10 GrpTRES=gres/gpu=-1")
    assert c.settings == {"max_running_jobs": 10, "max_gpus": None}
    _, c = line("-i delete account bio")
    assert (c.verb, c.where) == ("delete", {"names": ["bio"]})
    _, c = line("remove user where name=bob account=bio")
    assert c.where == {"names": ["bob"], "accounts": ["bio"]}
    _, c = line("-i delete qos where name=low")
    assert c.where == {"names": ["low"]}


def test_show_forms() -> None:
    o, c = line("show assoc where user=alice format=Account,User,Share%12,GrpTRES -P -n")
    assert (c.verb, c.entity, c.where) == ("show", "assoc", {"users": ["alice"]})
    assert c.fields == [("Account", None), ("User", None), ("Share", 12), ("GrpTRES", None)]
    assert o.sep == "|" and not o.trailing and not o.header
    o, c = line("list associations -p")
    assert c.entity == "assoc" and o.trailing
    _, c = line("show user withassoc where name=alice")
    assert c.where == {"names": ["alice"]}
    o, c = line("-Pn show qos")
    assert o.sep == "|" and not o.header and c.entity == "qos"


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("add account x GrpTRESMins=cpu=10", "GrpTRESMins is not supported for a account here"),
        ("add account x MaxJobs=3", "use GrpJobs="),
        ("add qos x Preempt=low", "preemption is by tier here"),
        ("add user x account=a GrpTRES=cpu=4", "TRES cpu is not limited here"),
        ("add user x account=a MaxJobs=lots", "MaxJobs=lots: not a number"),
        ("add user x account=a MaxWall=soon", "MaxWall=soon: invalid time"),
        ("add user x account=a QOS+=high", "adding to or removing from a list"),
        ("modify user alice", "No settings given"),
        ("delete user", "No conditions given"),
        ("modify user where bogus=1 set maxjobs=1", "Unknown condition: bogus"),
        ("show tres", "'tres' is not supported here"),
        ("dump cluster", "'dump' is not supported here"),
        ("frobnicate user", "Invalid keyword: frobnicate"),
        ("add assoc x", "use `sacctmgr add user"),
        ("add account", "Need name of account to add"),
        ("", "interactive mode is not supported"),
    ],
)
def test_refusals_name_what(text: str, said: str) -> None:
    with pytest.raises(SlurmUsageError) as e:
        m.parse(text.split())
    assert said in str(e.value)


DATA: dict[str, Any] = {
    "cluster": "phalanx",
    "accounts": [
        {"name": "phys", "parent": "root", "shares": 2, "description": "Physics",
         "organization": "sci", "max_running_jobs": 10, "max_submit_jobs": None,
         "max_gpus": 8, "max_wall_s": None},
        {"name": "hep", "parent": "phys", "shares": 1, "description": "hep",
         "organization": "sci", "max_running_jobs": None, "max_submit_jobs": None,
         "max_gpus": None, "max_wall_s": 86400},
        {"name": "default", "parent": "root", "shares": 1, "description": "default",
         "organization": "default", "max_running_jobs": None, "max_submit_jobs": None,
         "max_gpus": None, "max_wall_s": None},
    ],
    "users": [
        {"user": "alice", "account": "hep", "shares": 3, "default": True,
         "max_running_jobs": 4, "max_submit_jobs": 9, "max_gpus": 2, "max_wall_s": 3600},
        {"user": "alice", "account": "phys", "shares": 1, "default": False,
         "max_running_jobs": None, "max_submit_jobs": None, "max_gpus": None,
         "max_wall_s": None},
    ],
    "qos": [
        {"name": "normal", "description": "normal", "priority": 0, "priority_tier": None,
         "preempt_mode": None, "max_running_jobs": None, "max_submit_jobs": None,
         "max_gpus": None, "max_wall_s": None},
        {"name": "urgent", "description": "urgent", "priority": 100, "priority_tier": 2,
         "preempt_mode": "requeue", "max_running_jobs": 2, "max_submit_jobs": 5,
         "max_gpus": 4, "max_wall_s": 14400},
    ],
}  # fmt: skip


def show(text: str) -> list[str]:
    o, c = line(text)
    return m.render(m.columns(c.entity, c.fields), m.rows_for(c.entity, DATA, c.where), o)


def test_show_assoc_parsable_in_tree_order() -> None:
    out = show("show assoc -P")
    assert out[0] == (
        "Cluster|Account|User|Partition|Share|Priority|GrpJobs|GrpTRES|GrpSubmit|GrpWall|"
        "GrpTRESMins|MaxJobs|MaxTRES|MaxTRESPerNode|MaxSubmit|MaxWall|MaxTRESMins|QOS|Def QOS|"
        "GrpTRESRunMins"
    )
    rows = [r.split("|") for r in out[1:]]
    assert [(r[1], r[2]) for r in rows] == [
        ("root", ""),
        ("default", ""),
        ("phys", ""),
        ("phys", "alice"),
        ("hep", ""),
        ("hep", "alice"),
    ]
    phys = rows[2]
    assert (phys[4], phys[6], phys[7], phys[11]) == ("2", "10", "gres/gpu=8", "")
    alice = rows[5]  # a user's limits are MaxJobs, MaxSubmit; GPUs in use are GrpTRES
    assert (alice[4], alice[6], alice[7], alice[11], alice[14], alice[15]) == (
        "3", "", "gres/gpu=2", "4", "9", "01:00:00",
    )  # fmt: skip
    assert rows[4][15] == "1-00:00:00" and alice[17] == "normal,urgent"
    assert all(r[0] == "phalanx" for r in rows)


def test_format_where_and_widths() -> None:
    assert show("show assoc where user=alice format=account,user,fairshare,maxjobs -P -n") == [
        "phys|alice|1|",
        "hep|alice|3|4",
    ]
    assert show("show assoc where account=hep format=Account%-6,User%5,Share%3 -n") == [
        "hep   " + " " + " " * 5 + " " + "  1",
        "hep   " + " " + "alice" + " " + "  3",
    ]
    table = show("show account format=acct,descr%8")
    assert table[:2] == ["   Account    Descr", "---------- --------"]
    assert table[2] == "      phys  Physics"
    with pytest.raises(SlurmUsageError, match="Unknown field 'Bogus'"):
        show("show assoc format=Bogus")
    assert show("show account where name=phys -p") == [
        "Account|Descr|Org|",
        "phys|Physics|sci|",
    ]
    # a value too long for its width ends in '+', as sacctmgr prints it
    assert show("show account where name=phys format=descr%4 -n") == ["Phy+"]


def test_show_user_and_qos() -> None:
    assert show("show user -P") == ["User|Def Acct|Admin", "alice|hep|None"]
    out = show("show qos where name=urgent format=Name,Priority,MaxTRESPU,MaxJobsPU,"
               "MaxSubmitPU,MaxWall,PreemptMode,PriorityTier -P -n")  # fmt: skip
    assert out == ["urgent|100|gres/gpu=4|2|5|04:00:00|requeue|2"]
    head = show("show qos -P")[0].split("|")
    assert head[:6] == [
        "Name",
        "Priority",
        "GraceTime",
        "Preempt",
        "PreemptExemptTime",
        "PreemptMode",
    ]
    assert head[-1] == "MinTRES" and len(head) == 26


def test_what_a_change_prints() -> None:
    _, c = line("-i add user bob account=hep,phys fairshare=2")
    res = {
        "changes": [
            {"key": ["hep", "bob"], "settings": {"shares": 2}},
            {"key": ["phys", "bob"], "settings": {"shares": 2}},
        ]
    }
    assert m.describe(c, res, "phalanx") == [
        " Adding User(s)",
        "  bob",
        " Settings =",
        "  Default Account = hep",
        " Associations =",
        "  U = bob       A = hep        C = phalanx",
        "  U = bob       A = phys       C = phalanx",
        " Non Default Settings",
        "  Fairshare     = 2",
    ]
    _, c = line("-i modify user where name=bob set maxjobs=2")
    res = {"changes": [{"key": ["hep", "bob"], "settings": {"max_running_jobs": 2}}]}
    assert m.describe(c, res, "phalanx") == [
        " Modified user associations...",
        "  C = phalanx    A = hep        U = bob",
    ]
    _, c = line("-i delete qos low")
    assert m.describe(c, {"changes": [{"key": ["low"]}]}, "x") == [" Deleting QOS(s)...", "  low"]


def test_the_question_before_a_commit(capsys: pytest.CaptureFixture[str]) -> None:
    assert m.confirm(io.StringIO("y\n"))
    assert not m.confirm(io.StringIO("n\n"))
    assert not m.confirm(io.StringIO(""))  # no terminal, no answer: nothing committed
    assert m.confirm(io.StringIO("maybe\nY\n"))
    out = capsys.readouterr().out
    assert "Would you like to commit changes? (You have 30 seconds to decide)" in out
    assert "Y or N please" in out
