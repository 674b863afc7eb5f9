"""sshare and sprio (slurm/sshare.py, slurm/sprio.py): what they print from the API's answers."""

from __future__ import annotations

from typing import Any

from phalanx.slurm import sprio, sshare

SHARE: dict[str, Any] = {
    "rows": [
        {
            "account": "phys",
            "user": None,
            "depth": 0,
            "raw_shares": 2,
            "norm_shares": 2 / 3,
            "raw_usage": 100.0,
            "effective_usage": 0.25,
            "level_fs": 2.6666666,
            "fairshare": None,
        },
        {
            "account": "phys",
            "user": "alice",
            "depth": 1,
            "raw_shares": 1,
            "norm_shares": 1.0,
            "raw_usage": 100.0,
            "effective_usage": 1.0,
            "level_fs": 1.0,
            "fairshare": 1.0,
        },
        {
            "account": "bio",
            "user": None,
            "depth": 0,
            "raw_shares": 1,
            "norm_shares": 1 / 3,
            "raw_usage": 300.0,
            "effective_usage": 0.75,
            "level_fs": 0.4444444,
            "fairshare": None,
        },
        {
            "account": "bio",
            "user": "bob",
            "depth": 1,
            "raw_shares": 1,
            "norm_shares": 1.0,
            "raw_usage": 300.0,
            "effective_usage": 1.0,
            "level_fs": None,
            "fairshare": 0.5,
        },
    ]
}


def test_sshare_shows_accounts_and_only_your_users_unless_all() -> None:
    mine = sshare.rows_for(SHARE, "bob", all_users=False, accounts=[], users=[])
    assert [(r[0], r[1]) for r in mine] == [("phys", ""), ("bio", ""), (" bio", "bob")]
    every = sshare.rows_for(SHARE, "bob", all_users=True, accounts=["bio"], users=[])
    assert [(r[0], r[1]) for r in every] == [("bio", ""), (" bio", "bob")]
    assert every[1][6:] == ["0.500000", "inf"]  # FairShare, then LevelFS (no usage: inf)


def test_sshare_parsable_and_long() -> None:
    rows = sshare.rows_for(SHARE, "x", all_users=True, accounts=[], users=["alice"])
    lines = sshare.render(rows, long=True, header=True, sep="|")
    assert lines[0].split("|")[-1] == "LevelFS"
    assert lines[1] == " phys|alice|1|1.000000|100|1.000000|1.000000|1.000000"
    plain = sshare.render(rows, long=False, header=True, sep=None)
    assert plain[0].split() == [
        "Account",
        "User",
        "RawShares",
        "NormShares",
        "RawUsage",
        "EffectvUsage",
        "FairShare",
    ]


def test_sprio_prints_each_factor_weighted() -> None:
    job = {
        "job_id": 7,
        "partition": "batch",
        "user": "alice",
        "account": "phys",
        "priority": 5643,
        "nice": 0,
        "factors": {"age": 0.5, "fairshare": 0.5, "jobsize": 0.1, "partition": 0.043, "qos": 0},
        "products": {
            "age": 500.0,
            "fairshare": 5000.0,
            "jobsize": 100.0,
            "partition": 43.0,
            "qos": 0.0,
        },
    }
    assert sprio.header(long=False).split() == [
        "JOBID",
        "PARTITION",
        "PRIORITY",
        "SITE",
        "AGE",
        "FAIRSHARE",
        "JOBSIZE",
        "PARTITION",
        "QOS",
    ]
    assert sprio.line(job, long=False, norm=False).split() == [
        "7",
        "batch",
        "5643",
        "0",
        "500",
        "5000",
        "100",
        "43",
        "0",
    ]
    assert sprio.line(job, long=True, norm=True).split()[2:4] == ["alice", "phys"]
