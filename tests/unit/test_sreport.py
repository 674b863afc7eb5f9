"""sreport's pure parts (slurm/sreport.py): time formats, Slurm's abbreviations of reports,
columns and conditions, and the rows of each report from a usage answer."""

from __future__ import annotations

import pytest

from phalanx.slurm import sreport
from phalanx.slurm.common import SlurmUsageError


def test_time_formats_as_sreport_prints_them() -> None:
    assert sreport.time_format("minutes").text(7260, 0) == "121"
    assert sreport.time_format("Hours").text(7260, 0) == "2"
    assert sreport.time_format("s").text(90, 180) == "90"
    assert sreport.time_format("p").text(90, 180) == "50.00%"
    assert sreport.time_format("MinPer").text(120, 480) == "2(25.00%)"
    assert sreport.time_format("minper").banner == "CPU Minutes/Percentage of Total"
    assert sreport.time_format("percent").banner == "Percentage of Total"
    with pytest.raises(SlurmUsageError, match="unknown time format"):
        sreport.time_format("fortnights")


def test_abbreviations_of_reports_columns_and_conditions() -> None:
    assert sreport.pick_report("cl", "ut") == ("cluster", "utilization")
    assert sreport.pick_report("cluster", "a") == ("cluster", "accountutilizationbyuser")
    assert sreport.pick_report("user", "top") == ("user", "topusage")
    for kind, name, why in (
        ("cluster", "u", "Not valid report"),  # UserUtilizationBy... needs 18 letters
        ("cluster", "WCKeyUtilizationByUser", "WCKeys"),
        ("job", "SizesByAccount", "job size"),
        ("reservation", "utilization", "reservations"),
        ("nodes", "x", "Not valid report type"),
    ):
        with pytest.raises(SlurmUsageError, match=why):
            sreport.pick_report(kind, name)
    assert sreport.column("planned").header == "Planned"  # not PlannedDown
    assert sreport.column("pl").header == "Planned"
    assert sreport.column("planneddown").header == "PLND Down"
    assert sreport.column("acct").header == "Account"
    c = sreport.conditions(["users=a,b", "acc=x", "topcount=3", "tree", "format=Login,Used"], 0)
    assert (c.users, c.accounts, c.top, c.tree, c.fmt) == (["a", "b"], ["x"], 3, True,
                                                           ["Login", "Used"])  # fmt: skip
    with pytest.raises(SlurmUsageError, match="Unknown condition: nope=1"):
        sreport.conditions(["nope=1"], 0)


DATA = {
    "cluster": "c1",
    "allocated_s": 600.0,
    "assocs": [
        {"account": "phys", "user": "ann", "cpu_s": 120.0},
        {"account": "phys", "user": "bob", "cpu_s": 360.0},
        {"account": "chem", "user": "ann", "cpu_s": 120.0},
    ],
}


def test_rows_of_the_user_reports() -> None:
    tf = sreport.time_format("minutes")
    c = sreport.Conditions()
    tree = sreport.rows_for("accountutilizationbyuser", DATA, c, tf)
    assert [(r["accounts"], r["login"], r["used"]) for r in tree] == [
        ("root", "", "10"),
        ("chem", "", "2"),
        ("chem", "ann", "2"),
        ("phys", "", "8"),
        ("phys", "bob", "6"),
        ("phys", "ann", "2"),
    ]
    top = sreport.rows_for("topusage", DATA, sreport.Conditions(top=2), tf)
    assert [(r["login"], r["accounts"]) for r in top] == [("bob", "phys"), ("ann", "chem")]
    mine = sreport.rows_for("userutilizationbyaccount", DATA, sreport.Conditions(users=["ann"]), tf)
    assert [(r["login"], r["accounts"], r["used"]) for r in mine] == [
        ("ann", "chem", "2"),
        ("ann", "phys", "2"),
    ]
