"""The text `scontrol` and `sacct` print, over plain job dicts as the API returns them: the
forms scripts and tools parse (show job lines, sacct -P fields, widths, time forms, updates)."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

import pytest

from phalanx.domain.policy import (
    Action,
    FailurePolicy,
    after_attempt,
    is_user_requeue,
    user_requeue_reason,
)
from phalanx.domain.states import JobState
from phalanx.slurm import records, sacct, scontrol
from phalanx.slurm.common import ACCT_STATE, SlurmUsageError, phalanx_states, slurm_state

T0 = datetime(2026, 3, 4, 10, 0, 0).timestamp()  # local time, as Slurm prints it


def stamp(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t))


def job(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "id": 42,
        "job_id": "42",
        "array_job_id": None,
        "array_task_id": None,
        "name": "train",
        "user": "root",
        "partition": "batch",
        "state": "COMPLETED",
        "reason": None,
        "priority": 7,
        "submit_time": T0,
        "eligible_time": None,
        "start_time": T0 + 5,
        "end_time": T0 + 3725,
        "time_limit_s": 7200,
        "nodes": 2,
        "nodes_alloc": 2,
        "nodelist": "node[01-02]",
        "cpus_per_node": 4,
        "mem_per_node_mb": 8192,
        "gpus_per_node": 2,
        "requeue": True,
        "dependency": [],
        "exit_code": 0,
        "exit_signal": None,
        "restart_count": 1,
        "command": "/home/root/train.sh",
        "workdir": "/home/root",
        "stdout": "/home/root/slurm-42.out",
        "stderr": "/home/root/slurm-42.out",
        "account": "physics",
        "qos": None,
        "constraint": None,
        "attempts": [{"nodes": ["node01", "node02"]}],
    }
    base.update(kw)
    return base


# ---------------------------------------------------------------------------- scontrol
def test_show_job_lines_are_slurms() -> None:
    lines = scontrol.job_lines(job(), now=T0 + 9999)
    assert lines == [
        "JobId=42 JobName=train",
        "UserId=root(0) GroupId=root(0) MCS_label=N/A",
        "Priority=7 Nice=0 Account=physics QOS=normal",
        "JobState=COMPLETED Reason=None Dependency=(null)",
        "Requeue=1 Restarts=1 BatchFlag=1 Reboot=0 ExitCode=0:0",
        "RunTime=01:02:00 TimeLimit=02:00:00 TimeMin=N/A",
        f"SubmitTime={stamp(T0)} EligibleTime={stamp(T0)}",
        f"StartTime={stamp(T0 + 5)} EndTime={stamp(T0 + 3725)} Deadline=N/A",
        "PreemptTime=None SuspendTime=None SecsPreSuspend=0",
        "Partition=batch",
        "NodeList=node[01-02]",
        "BatchHost=node01",
        "NumNodes=2 NumCPUs=8 NumTasks=2 CPUs/Task=1",
        "TRES=cpu=8,mem=16G,node=2,billing=8,gres/gpu=4",
        "Features=(null)",
        "Command=/home/root/train.sh",
        "WorkDir=/home/root",
        "StdErr=/home/root/slurm-42.out",
        "StdIn=/dev/null",
        "StdOut=/home/root/slurm-42.out",
    ]
    text = scontrol.render_blocks([lines], oneliner=False)
    assert text.startswith("JobId=42 JobName=train\n   UserId=root(0) ")
    assert text.endswith("   StdOut=/home/root/slurm-42.out\n\n")
    one = scontrol.render_blocks([lines, lines], oneliner=True).splitlines()
    assert len(one) == 2 and one[0].startswith("JobId=42 JobName=train UserId=root(0) ")


def test_show_job_of_pending_running_array_and_failed_jobs() -> None:
    pending = scontrol.job_lines(
        job(state="PENDING", reason="Dependency", start_time=None, end_time=None,
            nodelist=None, nodes_alloc=None, attempts=[], dependency=[{"type": "afterok", "jobs": [7]}]),
        now=T0 + 60,
    )  # fmt: skip
    assert "JobState=PENDING Reason=Dependency Dependency=afterok:7" in pending
    assert "StartTime=Unknown EndTime=Unknown Deadline=N/A" in pending
    assert "NodeList=(null)" in pending and not any(x.startswith("BatchHost") for x in pending)
    assert "RunTime=00:00:00 TimeLimit=02:00:00 TimeMin=N/A" in pending
    held = scontrol.job_lines(job(state="HELD", start_time=None, end_time=None), now=T0)
    assert "JobState=PENDING Reason=JobHeldUser Dependency=(null)" in held
    run = scontrol.job_lines(job(state="RUNNING", end_time=None, array_job_id=40,
                                 array_task_id=3, time_limit_s=None), now=T0 + 65)  # fmt: skip
    assert run[0] == "JobId=42 ArrayJobId=40 ArrayTaskId=3 JobName=train"
    assert "RunTime=00:01:00 TimeLimit=UNLIMITED TimeMin=N/A" in run
    assert f"StartTime={stamp(T0 + 5)} EndTime=Unknown Deadline=N/A" in run
    failed = scontrol.job_lines(job(state="FAILED", exit_code=3, exit_signal=0), now=T0)
    assert "JobState=FAILED Reason=NonZeroExitCode Dependency=(null)" in failed
    assert "Requeue=1 Restarts=1 BatchFlag=1 Reboot=0 ExitCode=3:0" in failed
    redacted = scontrol.job_lines(job(command=None, workdir=None, stdout=None), now=T0)
    assert "Command=(null)" in redacted and "StdOut=(null)" in redacted
    assert not any(x.startswith("Reservation=") for x in redacted)  # Slurm: only when asked
    reserved = scontrol.job_lines(job(reservation="maint1"), now=T0)
    assert reserved[reserved.index("Reservation=maint1") - 1].startswith("NodeList=")


def test_show_node_and_partition() -> None:
    node = {
        "name": "gpu01", "state": "MIXED", "cpus": 16, "cpus_alloc": 4, "mem_mb": 65536,
        "mem_alloc_mb": 8192, "gpus": [[0, "h100"], [1, "h100"]], "gpus_alloc": 1,
        "features": ["ib"], "drain": True, "drain_reason": "disk", "drain_by": "ops",
        "drain_time": T0, "addr": "10.0.0.5", "last_heartbeat": T0,
    }  # fmt: skip
    lines = scontrol.node_lines(node, ["gpu"])
    assert lines[0] == "NodeName=gpu01 CoresPerSocket=1"
    assert "CPUAlloc=4 CPUEfctv=16 CPUTot=16 CPULoad=N/A" in lines
    assert "Gres=gpu:h100:2" in lines and "AvailableFeatures=ib" in lines
    assert "State=MIXED ThreadsPerCore=1 TmpDisk=0 Weight=1" in lines
    assert "CfgTRES=cpu=16,mem=64G,billing=16,gres/gpu=2" in lines
    assert "AllocTRES=cpu=4,mem=8G,gres/gpu=1" in lines
    assert f"Reason=disk [ops@{stamp(T0)}]" in lines
    part = {"name": "gpu", "is_default": False, "nodes": "gpu*", "default_time_s": 3600,
            "max_time_s": None, "priority": 2}  # fmt: skip
    names = ["gpu01", "gpu02", "cpu01"]
    assert scontrol.partition_nodes(part, names) == ["gpu01", "gpu02"]
    plines = scontrol.partition_lines(part, [node, {**node, "name": "gpu02"}])
    assert plines[0] == "PartitionName=gpu"
    assert "Nodes=gpu[01-02]" in plines
    assert "AllocNodes=ALL Default=NO QoS=N/A" in plines
    assert any(x.startswith("DefaultTime=01:00:00 ") for x in plines)
    assert any(x.startswith("MaxNodes=UNLIMITED MaxTime=UNLIMITED ") for x in plines)
    assert "State=UP TotalCPUs=32 TotalNodes=2 SelectTypeParameters=NONE" in plines


def test_update_parsing() -> None:
    refs, changes = scontrol.parse_job_update(
        ["JobId=12,13_2", "TimeLimit=2:00:00", "numnodes=2-2", "Partition=gpu",
         "Dependency=afterok:5"]
    )  # fmt: skip
    assert refs == ["12", "13_2"]
    assert changes == {"time_limit": "2:00:00", "nodes": 2, "partition": "gpu",
                       "dependency": "afterok:5"}  # fmt: skip
    refs, changes = scontrol.parse_job_update(
        ["JobId=7", "ExcNodeList=node[01-02]", "ArrayTaskThrottle=3"]
    )
    assert (refs, changes) == (["7"], {"exclude": "node[01-02]", "array_throttle": 3})
    for words, msg in (
        (["JobId=1", "ArrayTaskThrottle=-1"], "give the number of tasks"),
        (["JobId=1", "Shared=1"], "Update of Shared is not supported here"),
        (["JobId=1", "NumNodes=1-4"], "node ranges are not supported"),
        (["TimeLimit=5"], "No job id given"),
        (["JobId=1"], "Nothing to update"),
        (["JobId=1", "TimeLimit"], "Invalid input: TimeLimit"),
    ):
        with pytest.raises(SlurmUsageError, match=msg):
            scontrol.parse_job_update(words)
    nodes, state, reason = scontrol.parse_node_update(
        ["NodeName=node[01-02]", "State=drain", "Reason=bad disk"]
    )
    assert (nodes, state, reason) == (["node01", "node02"], "DRAIN", "bad disk")
    assert scontrol.parse_node_update(["NodeName=n1", "State=RESUME"])[1] == "RESUME"
    with pytest.raises(SlurmUsageError, match="You must specify a reason"):
        scontrol.parse_node_update(["NodeName=n1", "State=DRAIN"])
    with pytest.raises(SlurmUsageError, match="State=DOWN is not supported"):
        scontrol.parse_node_update(["NodeName=n1", "State=DOWN", "Reason=x"])


def test_scontrol_commands_without_a_cluster(
    capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    assert scontrol.main(["show", "hostnames", "n[1-3]"]) == 0
    assert capsys.readouterr().out == "n1\nn2\nn3\n"
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[07-08]")
    assert scontrol.main(["show", "hostnames"]) == 0
    assert capsys.readouterr().out == "gpu07\ngpu08\n"
    monkeypatch.delenv("SLURM_JOB_NODELIST")
    assert scontrol.main(["show", "hostnames"]) == 1
    assert "SLURM_JOB_NODELIST is not set" in capsys.readouterr().err
    assert scontrol.main(["show", "hostlist", "n1,n2,n3,x"]) == 0
    assert capsys.readouterr().out == "n[1-3],x\n"
    for argv, words in (
        (["suspend", "12"], "suspend is not supported"),
        (["resume", "12"], "resume is not supported"),
        (["--frob", "show", "job"], "unrecognized option '--frob'"),
        (["frobnicate"], "invalid command 'frobnicate'"),
        (["reconfigure"], "reconfigure is not supported: Phalanx's controllers read"),
        (["requeue", "State=SpecialExit", "12"], "only job ids are supported here, not State="),
        (["requeue"], "no job id given"),
        (["hold", "JobId=abc"], "Invalid job id specified for job abc"),
    ):
        assert scontrol.main(argv) == 1
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err


# ---------------------------------------------------------------------------- sacct
def test_time_forms() -> None:
    now = datetime(2026, 3, 4, 15, 30, 0).timestamp()
    midnight = datetime(2026, 3, 4).timestamp()
    assert sacct.parse_time("midnight", now) == midnight == sacct.parse_time("today", now)
    assert sacct.parse_time("noon", now) == midnight + 12 * 3600
    assert sacct.parse_time("2026-01-02", now) == datetime(2026, 1, 2).timestamp()
    assert sacct.parse_time("2026-01-02T03:04:05", now) == datetime(2026, 1, 2, 3, 4, 5).timestamp()
    assert sacct.parse_time("2026-01-02T03:04", now) == datetime(2026, 1, 2, 3, 4).timestamp()
    assert sacct.parse_time("01/02", now) == datetime(2026, 1, 2).timestamp()
    assert sacct.parse_time("01/02/25", now) == datetime(2025, 1, 2).timestamp()
    assert sacct.parse_time("010225", now) == datetime(2025, 1, 2).timestamp()
    assert sacct.parse_time("08:15", now) == datetime(2026, 3, 4, 8, 15).timestamp()
    assert sacct.parse_time("now", now) == now
    assert sacct.parse_time("now-2days", now) == now - 2 * 86400
    assert sacct.parse_time("now-90", now) == now - 90
    assert sacct.parse_time("now+1hour", now) == now + 3600
    for bad in ("yesterday-ish", "2026-13-01", "now-3fortnights"):
        with pytest.raises(ValueError, match="Invalid time specification"):
            sacct.parse_time(bad, now)


def test_format_fields_and_widths() -> None:
    fields = sacct.parse_format("jobid,State%20,NodeList%5,JobName")
    assert [(f.name, w) for f, w in fields] == [
        ("JobID", -12), ("State", 20), ("NodeList", 5), ("JobName", 10)
    ]  # fmt: skip
    with pytest.raises(SlurmUsageError, match='Invalid field requested: "Bogus"'):
        sacct.parse_format("JobID,Bogus")
    with pytest.raises(SlurmUsageError, match="Invalid field width"):
        sacct.parse_format("JobID%x")


def test_rows_table_and_parsable_forms() -> None:
    steps = [
        {"step_id": 0, "name": "python", "state": "COMPLETED", "nodes": ["node01", "node02"],
         "ntasks": 4, "start_time": T0 + 10, "end_time": T0 + 20, "exit_code": 0,
         "exit_signal": 0, "usage": {"cpu_s": 12.5, "max_rss_bytes": 3 << 20,
                                     "max_rss_node": "node02", "max_rss_task": 3}},
        {"step_id": 1, "name": "bash", "state": "FAILED", "nodes": ["node02"], "ntasks": 1,
         "start_time": T0 + 30, "end_time": T0 + 31, "exit_code": 2, "exit_signal": 0},
    ]  # fmt: skip
    rows = sacct.job_rows(job(steps=steps), now=T0 + 9999)
    fields = sacct.parse_format(
        "JobID,JobIDRaw,JobName,Partition,Account,User,State,ExitCode,DerivedExitCode,Elapsed,"
        "ElapsedRaw,Start,End,Submit,NodeList,NNodes,NCPUS,AllocTRES,ReqMem,MaxRSS,TotalCPU,"
        "Timelimit,Restarts,Reason,WorkDir"
    )
    out = sacct.render(rows, fields, header=True, parsable="2").splitlines()
    assert out[0] == (
        "JobID|JobIDRaw|JobName|Partition|Account|User|State|ExitCode|DerivedExitCode|Elapsed|"
        "ElapsedRaw|Start|End|Submit|NodeList|NNodes|NCPUS|AllocTRES|ReqMem|MaxRSS|TotalCPU|"
        "Timelimit|Restarts|Reason|WorkDir"
    )
    assert out[1].split("|") == [
        "42", "42", "train", "batch", "physics", "root", "COMPLETED", "0:0", "2:0", "01:02:00",
        "3720", stamp(T0 + 5), stamp(T0 + 3725), stamp(T0), "node[01-02]", "2", "8",
        "cpu=8,mem=16G,node=2,billing=8,gres/gpu=4", "8G", "", "", "02:00:00", "1", "None",
        "/home/root",
    ]  # fmt: skip
    batch = out[2].split("|")
    assert batch[:8] == ["42.batch", "42.batch", "batch", "", "physics", "", "COMPLETED", "0:0"]
    assert batch[14:18] == ["node01", "1", "4", "cpu=4,mem=8G,node=1"]
    step0, step1 = out[3].split("|"), out[4].split("|")
    assert step0[:3] == ["42.0", "42.0", "python"] and step0[14:16] == ["node[01-02]", "2"]
    assert step0[9:11] == ["00:00:10", "10"]
    assert step0[19:21] == ["3072K", "00:12.500"]  # its tasks' exit records (steps.usage)
    assert step1[:8] == ["42.1", "42.1", "bash", "", "physics", "", "FAILED", "2:0"]
    assert step1[19:21] == ["", ""]  # no figures kept: blank, as sacct prints them
    where = sacct.parse_format("JobID,MaxRSSNode,MaxRSSTask")
    assert sacct.render(rows, where, header=False, parsable="2").splitlines()[2:] == [
        "42.0|node02|3",
        "42.1||",
    ]
    assert len(out) == 5
    # -p: every field followed by the delimiter; -n: no header; -X: the allocation only
    p = sacct.render(sacct.job_rows(job(), T0, steps=False), sacct.parse_format("JobID,State"),
                     header=False, parsable="1")  # fmt: skip
    assert p == "42|COMPLETED|\n"


def test_default_table_has_slurms_widths_and_dashes() -> None:
    rows = sacct.job_rows(job(name="a-very-long-job-name", account=None), now=T0)
    text = sacct.render(rows, sacct.parse_format(sacct.DEFAULT_FORMAT))
    assert text.splitlines() == [
        "JobID           JobName  Partition    Account  AllocCPUS      State ExitCode ",
        "------------ ---------- ---------- ---------- ---------- ---------- -------- ",
        "42           a-very-lo+      batch                     8  COMPLETED      0:0 ",
        "42.batch          batch                                4  COMPLETED      0:0 ",
    ]


def test_states_in_sacct() -> None:
    cancelled = job(state="CANCELLED", reason="cancel: cancelled by root", exit_signal=15)
    (row,) = sacct.job_rows(cancelled, T0, steps=False)
    assert row["_state"] == "CANCELLED by 0"  # the canceller's uid, as Slurm prints it
    assert records.exit_code_text(cancelled) == "0:15"
    assert (
        records.state_text(job(state="CANCELLED", reason="cancelled by nosuchuser9")) == "CANCELLED"
    )
    pending = sacct.job_rows(job(state="PENDING", reason="Priority", start_time=None,
                                 end_time=None, nodelist=None, nodes_alloc=None), T0)  # fmt: skip
    assert len(pending) == 1  # no batch step before it runs
    fields = sacct.parse_format("State,Start,End,NodeList,Reason,Elapsed")
    assert sacct.render(pending, fields, header=False, parsable="2") == (
        "PENDING|Unknown|Unknown|None assigned|Priority|00:00:00\n"
    )
    timeout = sacct.job_rows(job(state="TIMEOUT"), T0)
    assert [r["_state"] for r in timeout] == ["TIMEOUT", "CANCELLED"]


def test_a_starting_job_is_running_to_sacct() -> None:
    """Accounting has a job RUNNING from its allocation on; tools that poll sacct (submitit)
    take a state they do not know, CONFIGURING among them, as the job's end."""
    starting = job(state="STARTING", end_time=None, exit_code=None, steps=[])
    fields = sacct.parse_format("JobID,State,NodeList")
    out = sacct.render(sacct.job_rows(starting, T0), fields, header=False, parsable="2")
    assert out == "42|RUNNING|node[01-02]\n42.batch|RUNNING|node01\n"
    assert sacct.json_job(starting, T0)["state"]["current"] == "RUNNING"
    assert phalanx_states({"RUNNING"}, ACCT_STATE) == ["RUNNING", "STARTING"]  # sacct -s R
    assert slurm_state("STARTING") == "CONFIGURING"  # squeue still shows it launching


def test_a_requeued_job_shows_the_steps_of_its_last_run() -> None:
    """Each run numbers its steps from 0: sacct (no -D) shows the last run's, one `42.0`."""
    steps = [
        {"step_id": 0, "state": "FAILED", "nodes": ["node01"], "attempt_seq": 0,
         "exit_code": 255, "exit_signal": 0, "start_time": T0 + 6, "end_time": T0 + 9},
        {"step_id": 0, "state": "COMPLETED", "nodes": ["node02"], "attempt_seq": 1,
         "exit_code": 0, "exit_signal": 0, "start_time": T0 + 20, "end_time": T0 + 30},
    ]  # fmt: skip
    rows = sacct.job_rows(job(steps=steps, restart_count=1), T0 + 99)
    fields = sacct.parse_format("JobID,State,NodeList,DerivedExitCode")
    assert sacct.render(rows, fields, header=False, parsable="2").splitlines()[2:] == [
        "42.0|COMPLETED|node02|"
    ]
    assert rows[0]["_derived"] == "0:0"  # the earlier run's 255 is not this run's


def test_job_refs_and_json() -> None:
    assert sacct.job_refs("12,13_2,14_[1-3],15.batch") == [
        "12",
        "13_2",
        "14_1",
        "14_2",
        "14_3",
        "15",
    ]
    with pytest.raises(SlurmUsageError, match="Invalid job id: abc"):
        sacct.job_refs("abc")
    doc = sacct.json_job(job(state="FAILED", exit_code=3), T0 + 9999)
    assert doc["job_id"] == 42 and doc["state"] == {
        "current": "FAILED",
        "reason": "NonZeroExitCode",
    }
    assert doc["exit_code"] == {"status": "FAILED", "return_code": 3}
    assert doc["time"]["elapsed"] == 3720 and doc["time"]["limit"] == 120
    assert doc["restart_cnt"] == 1 and doc["nodes"] == "node[01-02]"
    assert {"type": "mem", "name": "", "count": 16384} in doc["tres"]["allocated"]
    assert [s["step"]["id"] for s in doc["steps"]] == ["42.batch"]


def test_unsupported_sacct_options_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, word in ((["--units=M"], "--units"), (["-L"], "-L"), (["-o", "Bogus"], "Bogus")):
        assert sacct.main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("sacct: error: ") and word in err and err.count("\n") == 1, err


# ---------------------------------------------------------------------------- requeue policy
def test_a_users_requeue_is_planned_and_requeuehold_holds() -> None:
    for hold, want in ((False, JobState.PENDING), (True, JobState.HELD)):
        stop = user_requeue_reason("alice", hold=hold)
        assert is_user_requeue(stop)
        v = after_attempt(
            result=JobState.COMPLETED, reason=None, stop_reason=stop, requeue=True,
            lost_nodes=[], launch_failed=[], launch_failures=0, policy=FailurePolicy(),
        )  # fmt: skip
        assert (v.action, v.state, v.retry) == (Action.REQUEUE, want, False)
    assert not is_user_requeue("requeue: node n1 drained by ops: disk")


def test_every_sacct_field_slurm_documents_prints() -> None:
    """sacct(1)'s "Job Accounting Fields" of Slurm 22.05 (tests/data/slurm-22.05/): each is a
    field here, headed by its name; those Phalanx keeps no figure for print blank, as sacct
    prints a field it has no data for."""
    from pathlib import Path

    listed = [
        x
        for x in (Path(__file__).parents[1] / "data/slurm-22.05/sacct-format.txt")
        .read_text()
        .splitlines()
        if x and not x.startswith("#")
    ]
    assert len(listed) == 109
    fields = sacct.parse_format(",".join(listed))
    assert [f.name.lower() for f, _ in fields] == [n.lower() for n in listed]
    job = {
        "id": 7,
        "job_id": "7",
        "name": "train",
        "user": "root",
        "state": "COMPLETED",
        "partition": "batch",
        "nodes": 1,
        "cpus_per_node": 4,
        "submit_time": 1000.0,
        "eligible_time": 1000.0,
        "start_time": 1010.0,
        "end_time": 1070.0,
        "time_limit_s": 3600,
        "nodelist": "node01",
        "qos": "normal",
    }
    text = sacct.render(sacct.job_rows(job, 2000.0), fields, parsable="2")
    header, first, *_ = text.splitlines()
    assert header.split("|") == [f.name for f, _ in fields]
    got = dict(zip(header.split("|"), first.split("|"), strict=True))
    # a minute on 4 CPUs; its 10 s of waiting; its limit in minutes
    assert got["CPUTime"] == "00:04:00" and got["CPUTimeRAW"] == "240"
    assert got["Reserved"] == "00:00:10" and got["TimelimitRaw"] == "60"
    assert got["Suspended"] == "00:00:00" and got["AveRSS"] == "" and got["WCKey"] == ""
