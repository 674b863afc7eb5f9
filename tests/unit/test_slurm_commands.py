"""The pure parts of sbatch/squeue/scancel/sinfo: format specs, widths, folding, filters, ids."""

from __future__ import annotations

import re
import signal
import time
from typing import Any

import pytest

from phalanx.controller.exchange import Reply, signal_items
from phalanx.slurm import scancel, sinfo, squeue
from phalanx.slurm.common import (
    Field,
    SlurmUsageError,
    SubmitFlags,
    cell,
    parse_format,
    parse_long_format,
    parse_states,
    render_line,
    script_submit_flags,
    split_submit_flags,
    wait_exit_code,
)
from phalanx.slurm.scontrol import requeues_itself
from phalanx.store.store import TaskReport

NOW = 1_800_000_000.0


def job(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "id": 12,
        "job_id": "12",
        "array_job_id": None,
        "array_task_id": None,
        "name": "train.sh",
        "user": "alice",
        "partition": "gpu",
        "state": "RUNNING",
        "reason": None,
        "priority": 0,
        "submit_time": NOW - 100,
        "start_time": NOW - 65,
        "end_time": None,
        "time_limit_s": 3600,
        "nodes": 2,
        "nodes_alloc": 2,
        "nodelist": "node[01-02]",
        "cpus_per_node": 4,
        "gpus_per_node": 0,
        "gpu_type": None,
    }
    base.update(kw)
    return base


# ---------------------------------------------------------------- format specs and widths


def test_format_spec_keeps_literals_widths_and_sides() -> None:
    prefix, fields = parse_format("[%.18i|%9P%%%j]", squeue.HEADERS)
    assert prefix == "["
    assert fields == [
        Field("i", 18, True, "|"),
        Field("P", 9, False, "%"),
        Field("j", 0, False, "]"),
    ]


def test_unknown_format_letter_is_refused_naming_it() -> None:
    with pytest.raises(SlurmUsageError, match="%!"):
        parse_format("%i %!", squeue.HEADERS)
    with pytest.raises(SlurmUsageError, match="bare %"):
        parse_format("%i %.1", squeue.HEADERS)


def test_cells_are_cut_to_the_width_and_padded_on_the_right_side() -> None:
    assert cell("averylongname", Field("j", 8, True)) == "averylon"
    assert cell("ab", Field("j", 5, True)) == "   ab"
    assert cell("ab", Field("j", 5, False)) == "ab   "
    assert cell("whole value", Field("j", 0, False, " ")) == "whole value "


def test_default_header_and_line_are_slurms_bytes() -> None:
    prefix, fields = parse_format(squeue.DEFAULT_FORMAT, squeue.HEADERS)
    lines = squeue.format_rows(
        [job()], prefix, fields, headers=squeue.HEADERS, header=True, now=NOW
    )
    assert lines == [
        "             JOBID PARTITION     NAME     USER ST       TIME  NODES NODELIST(REASON)",
        "                12       gpu train.sh    alice  R       1:05      2 node[01-02]",
    ]


def test_every_documented_letter_prints() -> None:
    letters = "ijuTtMlDRPNAakCbLSVr"
    prefix, fields = parse_format("|".join(f"%{x}" for x in letters), squeue.HEADERS)
    running = job(gpus_per_node=4, gpu_type="h100", comment="note")
    values = render_line(prefix, fields, squeue.field_values(running, NOW, letters)).split("|")
    got = dict(zip(letters, values, strict=True))
    assert got["i"] == "12" and got["j"] == "train.sh" and got["u"] == "alice"
    assert got["T"] == "RUNNING" and got["t"] == "R"
    assert got["M"] == "1:05" and got["l"] == "1:00:00" and got["L"] == "58:55"
    assert got["D"] == "2" and got["R"] == "node[01-02]" and got["N"] == "node[01-02]"
    assert got["P"] == "gpu" and got["A"] == "12" and got["a"] == "(null)"  # %a: the account
    assert got["k"] == "note" and got["C"] == "8" and got["b"] == "gres:gpu:h100:4"
    assert got["r"] == "None"
    assert got["S"] == time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(NOW - 65))
    assert got["V"] == time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(NOW - 100))


def test_pending_jobs_show_their_reason_in_parentheses() -> None:
    cases = {
        "Priority": "(Priority)",
        "Resources": "(Resources)",
        "Dependency (afterok:3 not yet COMPLETED)": "(Dependency)",
        "BeginTime (not before 2027-01-01T00:00:00)": "(BeginTime)",
    }
    for reason, shown in cases.items():
        v = squeue.job_values(job(state="PENDING", reason=reason, start_time=None), NOW)
        assert v["R"] == shown and v["N"] == "" and v["M"] == "0:00"
    held = squeue.job_values(job(state="HELD", reason="held by alice", start_time=None), NOW)
    assert held["R"] == "(JobHeldUser)" and held["t"] == "PD" and held["T"] == "PENDING"


def test_no_time_limit_is_unlimited() -> None:
    v = squeue.job_values(job(time_limit_s=0), NOW)
    assert v["l"] == "UNLIMITED" and v["L"] == "UNLIMITED"


def test_long_format_fields_take_widths_and_default_to_20() -> None:
    fields = parse_long_format("JobID:10,name,StateCompact:.3", squeue.LONG_FIELDS)
    assert fields == [Field("jobid", 10, False), Field("j", 20, False), Field("t", 3, True)]
    keys = [f.key for f in fields]
    line = render_line("", fields, squeue.field_values(job(), NOW, keys))
    assert line == "12        " + "train.sh".ljust(20) + "  R"
    with pytest.raises(SlurmUsageError, match="Bogus"):
        parse_long_format("JobID,Bogus", squeue.LONG_FIELDS)
    # a suffix after the width: Slurm's "type[:[.][size][suffix]]"
    fields = parse_long_format("JobID:.5|,UserName:|", squeue.LONG_FIELDS)
    values = squeue.field_values(job(), NOW, [f.key for f in fields])
    assert render_line("", fields, values) == "   12|" + "alice".ljust(20) + "|"


# ---------------------------------------------------------------- arrays, sorting, states


def test_pending_array_tasks_fold_and_running_ones_do_not() -> None:
    tasks = [
        job(
            id=12 + i,
            job_id=f"12_{i}",
            array_job_id=12,
            array_task_id=i,
            state="PENDING",
            reason="Priority",
            start_time=None,
        )
        for i in (3, 4, 5, 7, 8)
    ]
    running = job(id=13, job_id="12_1", array_job_id=12, array_task_id=1)
    folded = squeue.fold_arrays([running, *tasks])
    assert [squeue.job_values(j, NOW)["i"] for j in folded] == ["12_1", "12_[3-5,7-8]"]
    assert squeue.job_values(folded[1], NOW)["K"] == "[3-5,7-8]"  # %K: the array index
    one = squeue.fold_arrays(tasks[:1])
    assert squeue.job_values(one[0], NOW)["i"] == "12_3"


def test_compress_ids() -> None:
    assert squeue.compress_ids([9, 1, 2, 3, 5]) == "1-3,5,9"
    assert squeue.compress_ids([4]) == "4"


def test_sort_default_is_pending_first_then_priority_and_sort_keys_work() -> None:
    a = job(id=1, job_id="1", state="RUNNING", priority=5)
    b = job(id=2, job_id="2", state="PENDING", priority=1, start_time=None)
    c = job(id=3, job_id="3", state="PENDING", priority=9, start_time=None)
    assert [j["id"] for j in squeue.sort_jobs([a, b, c], None, NOW)] == [3, 2, 1]
    assert [j["id"] for j in squeue.sort_jobs([c, a, b], "i", NOW)] == [1, 2, 3]
    assert [j["id"] for j in squeue.sort_jobs([c, a, b], "-i", NOW)] == [3, 2, 1]
    with pytest.raises(SlurmUsageError, match="sort"):
        squeue.sort_jobs([a], "zz", NOW)


def test_state_filters_take_names_and_codes_and_refuse_unknown() -> None:
    assert parse_states("R,pd") == {"RUNNING", "PENDING"}
    assert parse_states("completed,CA") == {"COMPLETED", "CANCELLED"}
    with pytest.raises(SlurmUsageError, match="Invalid job state specified: bogus"):
        parse_states("R,bogus")


def test_json_is_the_documented_subset() -> None:
    out = squeue.json_jobs([job()], NOW)
    rec = out["jobs"][0]
    assert rec["job_id"] == 12 and rec["job_state"] == ["RUNNING"]
    assert rec["user_name"] == "alice" and rec["nodes"] == "node[01-02]"
    assert rec["node_count"] == 2 and rec["time_limit"] == 60


# ---------------------------------------------------------------- scancel


def test_scancel_ids_expand_like_slurm() -> None:
    assert scancel.expand_job_ids("12") == ["12"]
    assert scancel.expand_job_ids("12_3") == ["12_3"]
    assert scancel.expand_job_ids("12_[1-3]") == ["12_1", "12_2", "12_3"]
    assert scancel.expand_job_ids("12_[1,3-5]") == ["12_1", "12_3", "12_4", "12_5"]
    for bad in ("abc", "12_[3-1]", "12_[x]"):
        with pytest.raises(SlurmUsageError, match="Invalid job id"):
            scancel.expand_job_ids(bad)
    with pytest.raises(SlurmUsageError, match="step"):
        scancel.expand_job_ids("12.0")


def test_signal_names_with_or_without_sig_and_numbers() -> None:
    assert scancel.parse_signal("USR1") == signal.SIGUSR1
    assert scancel.parse_signal("sigusr2") == signal.SIGUSR2
    assert scancel.parse_signal("15") == 15
    for bad in ("FOO", "0", "99"):
        with pytest.raises(SlurmUsageError, match="Invalid job signal"):
            scancel.parse_signal(bad)


# ---------------------------------------------------------------- sbatch


def test_sbatch_flags_come_out_of_the_options_only() -> None:
    flags, rest = split_submit_flags(["--parsable", "-W", "-N", "2", "job.sh", "--wait"])
    assert flags.parsable and flags.wait and not flags.test_only
    assert rest == ["-N", "2", "job.sh", "--wait"]  # the script's own argument stays
    flags, rest = split_submit_flags(["--test-only", "--", "job.sh"])
    assert flags.test_only and rest == ["--", "job.sh"]


def test_sbatch_flags_in_the_script_header_count() -> None:
    text = "#!/bin/bash\n#SBATCH --parsable\n#SBATCH -W -N 1\necho\n#SBATCH --test-only\n"
    flags = script_submit_flags(text, SubmitFlags())
    assert flags.parsable and flags.wait
    assert not flags.test_only  # never from a script; and a late directive is not read
    assert script_submit_flags("#!/bin/sh\n#SBATCH --wait 'x\n", SubmitFlags()) == SubmitFlags()


def test_wait_exit_code_is_slurms() -> None:
    ok = {"state": "COMPLETED", "exit_code": 0}
    assert wait_exit_code([ok]) == 0
    assert wait_exit_code([ok, {"state": "FAILED", "exit_code": 3}]) == 3
    assert wait_exit_code([{"state": "CANCELLED", "exit_code": None}]) == 1
    assert wait_exit_code([{"state": "FAILED", "exit_code": 0}]) == 1


# ---------------------------------------------------------------- sinfo


def node(name: str, state: str, **kw: Any) -> dict[str, Any]:
    base = {
        "name": name,
        "state": state,
        "cpus": 4,
        "cpus_alloc": 0,
        "mem_mb": 8192,
        "mem_alloc_mb": 0,
        "gpus": [],
        "features": [],
        "down": state.startswith("DOWN"),
        "drain": state in ("DRAINED", "DRAINING"),
        "drain_reason": None,
        "down_reason": None,
        "drain_by": None,
        "drain_time": None,
    }
    base.update(kw)
    return base


PARTS = [
    {"name": "batch", "is_default": True, "nodes": "node*", "max_time_s": None},
    {"name": "gpu", "is_default": False, "nodes": "node0[34]", "max_time_s": 86400},
]


def test_sinfo_default_groups_nodes_by_partition_and_state() -> None:
    nodes = [
        node("node01", "IDLE"),
        node("node02", "IDLE"),
        node("node03", "MIXED", cpus_alloc=2),
        node("node04", "DOWN"),
    ]
    prefix, fields = parse_format(sinfo.DEFAULT_FORMAT, sinfo.HEADERS)
    rows = sinfo.rows_for(
        nodes,
        PARTS,
        node_oriented=False,
        fields=fields,
        want_parts=[],
        want_nodes=set(),
        want_states=None,
    )
    lines = [render_line(prefix, fields, r) for r in rows]
    assert lines == [
        "batch*       up   infinite      2   idle node[01-02]",
        "batch*       up   infinite      1    mix node03",
        "batch*       up   infinite      1  down* node04",
        "gpu          up 1-00:00:00      1    mix node03",
        "gpu          up 1-00:00:00      1  down* node04",
    ]
    header = render_line(prefix, fields, {f.key: sinfo.HEADERS[f.key] for f in fields})
    assert header == "PARTITION AVAIL  TIMELIMIT  NODES  STATE NODELIST"


def test_sinfo_state_filter_and_unknown_state() -> None:
    nodes = [node("node01", "IDLE"), node("node02", "DRAINING", cpus_alloc=1)]
    _, fields = parse_format(sinfo.NODE_FORMAT.replace("%#N", "%N"), sinfo.HEADERS)
    rows = sinfo.rows_for(
        nodes,
        PARTS[:1],
        node_oriented=True,
        fields=fields,
        want_parts=[],
        want_nodes=set(),
        want_states=sinfo.parse_node_states("drain"),
    )
    assert [(r["N"], r["t"]) for r in rows] == [("node02", "drng")]
    with pytest.raises(SlurmUsageError, match="Invalid node state specified: bogus"):
        sinfo.parse_node_states("idle,bogus")


def test_sinfo_cpu_counts_sum_over_a_group() -> None:
    nodes = [node("node01", "MIXED", cpus_alloc=1), node("node02", "MIXED", cpus_alloc=3)]
    _, fields = parse_format("%P %C %t %N", sinfo.HEADERS)
    rows = sinfo.rows_for(
        nodes,
        PARTS[:1],
        node_oriented=False,
        fields=fields,
        want_parts=[],
        want_nodes=set(),
        want_states=None,
    )
    assert [(r["C"], r["D"], r["N"]) for r in rows] == [("4/4/0/8", "2", "node[01-02]")]


# ---------------------------------------------------------------- signal delivery protocol


def work_row(
    aid: int, rank: int, signals: list[dict[str, Any]], state: str = "RUNNING"
) -> dict[str, Any]:
    return {
        "attempt_id": aid,
        "token": f"t{aid}",
        "rank": rank,
        "attempt_state": state,
        "task_state": "RUNNING",
        "attempt_signals": signals,
    }


def report(aid: int, done: int | None, state: str = "running") -> TaskReport:
    return TaskReport(attempt_id=aid, token=f"t{aid}", state=state, signals_done=done)


SIGS = [
    {"seq": 1, "signum": 10, "target": "batch"},
    {"seq": 2, "signum": 12, "target": "full"},
]


def test_signals_above_what_the_agent_delivered_are_listed_until_done() -> None:
    items = signal_items([work_row(7, 0, SIGS)], [report(7, 0)])
    assert [(i["seq"], i["signum"], i["target"]) for i in items] == [
        (1, 10, "batch"),
        (2, 12, "full"),
    ]
    assert [i["seq"] for i in signal_items([work_row(7, 0, SIGS)], [report(7, 1)])] == [2]
    assert signal_items([work_row(7, 0, SIGS)], [report(7, 2)]) == []
    assert not Reply(signals=items).empty and Reply().empty


def test_batch_signals_go_to_the_batch_host_only() -> None:
    items = signal_items([work_row(7, 1, SIGS)], [report(7, 0)])
    assert [i["seq"] for i in items] == [2]


def test_no_signals_for_agents_that_cannot_deliver_or_attempts_not_running() -> None:
    assert signal_items([work_row(7, 0, SIGS)], [report(7, None)]) == []  # an older agent
    assert signal_items([work_row(7, 0, SIGS)], []) == []  # not launched here yet
    assert signal_items([work_row(7, 0, SIGS, "STOPPING")], [report(7, 0)]) == []
    assert signal_items([work_row(7, 0, SIGS)], [report(7, 0, "exited")]) == []


def test_scontrol_knows_when_it_requeues_its_own_job() -> None:
    """A job's own requeue stops the job, scontrol with it: it must then outlive the SIGTERM."""
    job = {"SLURM_JOB_ID": "7"}
    task = {"SLURM_JOB_ID": "9", "SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "2"}
    assert requeues_itself(["7"], job) and requeues_itself(["3", "7"], job)
    assert not requeues_itself(["8"], job) and not requeues_itself(["7"], {})
    assert requeues_itself(["9"], task) and requeues_itself(["7_2"], task)
    assert requeues_itself(["7"], task)  # its whole array
    assert not requeues_itself(["7_1"], task)


@pytest.mark.parametrize(
    ("option", "env", "kind", "refused"),
    [
        (None, None, "none", None),
        ("none", None, "none", None),
        ("None", "", "none", None),
        ("pmi2", None, "pmi2", None),
        (None, "pmi2", "pmi2", None),  # srun's input variable counts as the option
        ("none", "pmi2", "none", None),  # and the option wins over it
        ("pmix", None, None, "--mpi=pmix is not supported: Open MPI's PMIx"),
        ("pmix_v4", None, None, "--mpi=pmix_v4 is not supported: Open MPI's PMIx"),
        (None, "pmix", None, "SLURM_MPI_TYPE=pmix is not supported"),
        ("cray_shasta", None, None, "--mpi=cray_shasta is not supported"),
        ("bogus", None, None, "Invalid MPI type 'bogus', --mpi=list for acceptable types"),
    ],
)
def test_srun_serves_pmi2_and_refuses_the_mpi_types_it_cannot_provide(
    option: str | None, env: str | None, kind: str | None, refused: str | None
) -> None:
    """Slurm's --mpi types: pmi2 is served (srun/pmi.py); the others are refused by name
    before anything starts, as Slurm refuses an unknown one (its message, checked on 22.05)."""
    from phalanx.slurm.srun.command import mpi_type, prepare

    if refused is None:
        assert mpi_type(option, env) == kind
        return
    with pytest.raises(SlurmUsageError, match=re.escape(refused)):
        mpi_type(option, env)
    if option is not None:  # and through srun's own parsing
        with pytest.raises(SlurmUsageError, match=re.escape(refused)):
            prepare([f"--mpi={option}", "hostname"])


def test_srun_reads_slurm_mpi_type_from_the_callers_environment() -> None:
    """The job's srun helper runs srun for another process: the variable is the caller's."""
    from phalanx.slurm.srun.command import prepare

    assert prepare(["hostname"], {"SLURM_MPI_TYPE": "pmi2"}).mpi == "pmi2"
    assert prepare(["hostname"], {}).mpi == "none"
    with pytest.raises(SlurmUsageError, match="SLURM_MPI_TYPE=pmix is not supported"):
        prepare(["hostname"], {"SLURM_MPI_TYPE": "pmix"})


def test_srun_mpi_list_prints_the_served_types(capsys: pytest.CaptureFixture[str]) -> None:
    from phalanx.slurm.srun.command import prepare

    with pytest.raises(SystemExit) as e:
        prepare(["--mpi=list"])
    assert e.value.code == 0
    assert capsys.readouterr().out == "MPI plugin types are...\n\tnone\n\tpmi2\n"


@pytest.mark.parametrize("command", ["sbatch", "squeue", "sacct", "scontrol", "sinfo", "sdiag"])
@pytest.mark.parametrize("flag", ["-V", "--version"])
def test_version_is_slurms_line(
    command: str, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Tools look at `sinfo --version` before they call: Slurm's one line, exit 0, no
    controller asked (sbatch would otherwise wait for a script on stdin)."""
    from phalanx.slurm.main import SLURM_RELEASE, run

    assert run(command, [flag]) == 0
    out = capsys.readouterr()
    assert out.out == f"slurm {SLURM_RELEASE}\n" and out.err == ""


def test_scontrol_version_is_the_same_line(capsys: pytest.CaptureFixture[str]) -> None:
    from phalanx.slurm.main import SLURM_RELEASE, run

    assert run("scontrol", ["version"]) == 0
    assert capsys.readouterr().out == f"slurm {SLURM_RELEASE}\n"
