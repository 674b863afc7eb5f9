"""#SBATCH/#PHX script headers and `phalanx submit` options: one table, sbatch's rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.domain.directives import (
    parse_options,
    parse_submission,
    script_directives,
    split_cli_args,
)
from phalanx.domain.sbatch_options import OPTIONS, Arg, Effect, find_option
from phalanx.domain.spec import JobSpec
from phalanx.errors import InvalidSpec
from phalanx.submitting import build_spec

TORCHRUN = """\
#!/bin/bash
#SBATCH --job-name=llama-ft
#SBATCH --partition=gpu
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=16
#SBATCH --mem=128G
#SBATCH --gres=gpu:a40:1
#SBATCH --time=2-00:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --output=logs/%x-%j.out
#SBATCH --array=1-100%10
#SBATCH --requeue
#SBATCH --mail-type=END
#SBATCH --mail-user=me@example.org
#SBATCH -A proj123

# torchrun rendezvous on the first node
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR=$head_node
srun torchrun --nnodes "$SLURM_NNODES" --nproc_per_node 1 \\
    --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:29500" train.py
"""


def _refusal(script: str | None, cli: list[str] | None = None) -> InvalidSpec:
    with pytest.raises(InvalidSpec) as info:
        parse_submission(script, cli or [], "job.sh")
    return info.value


# --- a real script end to end ---------------------------------------------------------------


def test_torchrun_script_fields() -> None:
    parsed = parse_submission(TORCHRUN, [], "job.sh")
    assert parsed.fields == {
        "name": "llama-ft",
        "partition": "gpu",
        "nodes": 4,
        "ntasks_per_node": 1,
        "cpus_per_task": 16,
        "mem_mb": 128 * 1024,
        "gpus_per_node": 1,
        "gpu_type": "a40",
        "time_limit_s": 2 * 86400,
        "signal": "B:USR1@300",
        "output": "logs/%x-%j.out",
        "array": "1-100%10",
        "requeue": True,
        "mail_type": "END",
        "mail_user": "me@example.org",
        "account": "proj123",
    }
    assert parsed.warnings == []
    assert parsed.ignored == ["--mail-type", "--mail-user"]  # --account takes effect
    assert parsed.origins["time_limit_s"] == "job.sh line 9"
    # The server model accepts exactly these field names.
    JobSpec(**parsed.fields)


def test_every_target_field_exists_on_the_job_spec() -> None:
    targets = {name for option in OPTIONS for name in option.fields}
    assert targets <= set(JobSpec.model_fields)


def test_option_table_rows_are_usable_for_help() -> None:
    for option in OPTIONS:
        assert option.help
        assert option.usage.startswith(f"-{option.short}, --" if option.short else "--")
        if option.effect in (Effect.APPLIED, Effect.STORED):
            assert option.convert is not None and option.field is not None
    time, hold = find_option("time"), find_option("hold")
    assert time is not None and time.takes_value
    assert hold is not None and not hold.takes_value


# --- header scanning ------------------------------------------------------------------------


def test_header_stops_at_first_command_and_late_directives_warn() -> None:
    script = "#!/bin/sh\n\n  # indented comment\n#SBATCH -N 2\necho hi\n#SBATCH -N 8\n"
    assert script_directives(script) == [(4, ["-N", "2"])]
    parsed = parse_submission(script, [], "job.sh")
    assert parsed.fields == {"nodes": 2}
    assert parsed.warnings == [
        "job.sh line 6: directive after the first command (line 5) is ignored, as sbatch does; "
        "move it above line 5"
    ]


def test_phx_lines_and_trailing_comments_and_quotes() -> None:
    script = (
        "#!/bin/bash\n"
        "#SBATCH --time=1:00 # one minute\n"
        '#PHX --job-name="my job" --spares 1\n'
        "#SBATCH --output=run#1.out\n"  # sbatch: an unquoted # starts a comment anywhere
        "##SBATCH --mem=1G\n"  # a commented-out directive is just a comment
        " #SBATCH --mem=2G\n"  # not in column 1: a comment, as in sbatch
        "#sbatch --mem=3G\n"
    )
    parsed = parse_submission(script, [], "job.sh")
    assert parsed.fields == {
        "time_limit_s": 60,
        "name": "my job",
        "spares": 1,
        "output": "run",
    }


def test_unbalanced_quote_names_the_line() -> None:
    error = _refusal('#!/bin/bash\n#SBATCH --job-name="oops\n')
    assert error.message.startswith("job.sh line 2: cannot read #SBATCH line")
    assert error.details["line"] == 2


def test_script_must_start_with_shebang() -> None:
    error = _refusal("#SBATCH -N 1\necho hi\n")
    assert "first line must start with #!" in error.message
    assert error.details["line"] == 1


def test_dos_line_breaks_are_refused_with_the_line() -> None:
    error = _refusal("#!/bin/bash\n#SBATCH -N 1\r\necho\r\n")
    assert error.message.startswith("job.sh line 2: the script has DOS line breaks")


# --- option syntax --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens",
    [
        ["--nodes=2"],
        ["--nodes", "2"],
        ["-N", "2"],
        ["-N2"],
        ["--nodes=1", "--nodes=2"],  # later wins
    ],
)
def test_option_spellings(tokens: list[str]) -> None:
    assert parse_options(tokens, "command line").fields == {"nodes": 2}


def test_clustered_short_flags_and_value() -> None:
    parsed = parse_options(["-HJname"], "command line")
    assert parsed.fields == {"hold": True, "name": "name"}


def test_unique_prefix_is_accepted_like_getopt_long() -> None:
    assert parse_options(["--part=gpu", "--ntasks-per-n", "2"], "x").fields == {
        "partition": "gpu",
        "ntasks_per_node": 2,
    }


def test_ambiguous_prefix_is_refused() -> None:
    with pytest.raises(InvalidSpec, match="--cpus is ambiguous: could be --cpus-per-task"):
        parse_options(["--cpus=4"], "job.sh line 3")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30", 1800),
        ("5:30", 330),
        ("1:00:00", 3600),
        ("1-12", 129600),
        ("1-2:30", 95400),
        ("2-00:00:00", 172800),
        ("UNLIMITED", None),
    ],
)
def test_every_time_form_through_the_option(text: str, seconds: int | None) -> None:
    assert parse_options([f"--time={text}"], "x").fields == {"time_limit_s": seconds}
    assert parse_options(["-t", text], "x").fields == {"time_limit_s": seconds}


def test_invalid_value_names_line_and_option() -> None:
    script = "#!/bin/bash\n#SBATCH -N 1\n#SBATCH -J x\n#SBATCH --time=1:2:3:4\n"
    error = _refusal(script)
    assert error.message == (
        "job.sh line 4: --time: invalid time '1:2:3:4': use MM, MM:SS, HH:MM:SS, D-HH, "
        "D-HH:MM or D-HH:MM:SS (or UNLIMITED)"
    )
    assert error.details == {"source": "job.sh line 4", "line": 4, "option": "--time"}


def test_short_option_error_uses_the_long_name() -> None:
    error = _refusal(None, ["--wrap=true", "-t", "soon"])
    assert error.message.startswith("command line: --time: invalid time 'soon'")
    assert "line" not in error.details


def test_parse_options_reads_the_line_from_the_source() -> None:
    with pytest.raises(InvalidSpec) as info:
        parse_options(["--mem=lots"], "job.sh line 7")
    assert info.value.details["line"] == 7


def test_missing_value_and_unexpected_value() -> None:
    with pytest.raises(InvalidSpec, match="--time: needs a value"):
        parse_options(["--time"], "x")
    with pytest.raises(InvalidSpec, match="--requeue: takes no value"):
        parse_options(["--requeue=yes"], "x")


# --- unknown, ignored, stored, refused ------------------------------------------------------


def test_a_misspelt_option_is_refused_with_its_line_and_the_nearest_spelling() -> None:
    """sbatch refuses it; a warning let ``--ntask-per-node=2`` run as one task per node."""
    error = _refusal("#!/bin/bash\n#SBATCH -N 1\n#SBATCH --ntask-per-node=2\nsrun hostname\n")
    assert error.message == (
        "job.sh line 3: unknown option --ntask-per-node: did you mean --ntasks-per-node?"
    )
    assert (error.details["line"], error.details["option"]) == (3, "--ntask-per-node")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("--frobnicate", "job.sh line 2: unknown option --frobnicate: not an sbatch option"),
        ("--frob-level 3", "job.sh line 2: unknown option --frob-level: not an sbatch option"),
        ("--partiton=gpu", "job.sh line 2: unknown option --partiton: did you mean --partition?"),
        ("-Z", "job.sh line 2: unknown option -Z: not an sbatch option"),
        ("-HZ", "job.sh line 2: unknown option -Z (in -HZ): not an sbatch option"),
    ],
)
def test_unknown_script_options_are_refused(line: str, message: str) -> None:
    assert _refusal(f"#!/bin/bash\n#SBATCH {line}\n").message.startswith(message)


def test_unknown_command_line_options_are_refused() -> None:
    error = _refusal("#!/bin/bash\n", ["--time=5", "--exlusive"])
    assert error.message == "command line: unknown option --exlusive: did you mean --exclusive?"


def test_bookkeeping_options_are_silent_and_listed_once() -> None:
    script = (
        "#!/bin/bash\n#SBATCH --qos=high\n#SBATCH --hint=nomultithread\n"
        "#SBATCH --hint=compute_bound\n#SBATCH --comment='nightly run'\n#SBATCH --parsable\n"
    )
    parsed = parse_submission(script, ["--nice=10", "--wait"], "job.sh")
    assert parsed.fields == {"qos": "high", "comment": "nightly run", "nice": 10}
    assert parsed.warnings == []
    assert parsed.ignored == ["--hint", "--parsable", "--wait"]  # --qos and --nice take effect


@pytest.mark.parametrize(
    ("args", "nice"), [(["--nice"], 100), (["--nice=5"], 5), (["--nice=-20"], -20)]
)
def test_nice_defaults_to_100_as_slurm(args: list[str], nice: int) -> None:
    assert parse_submission("#!/bin/bash\n", args, "job.sh").fields == {"nice": nice}


def test_a_bad_nice_is_refused() -> None:
    assert "--nice" in _refusal("#!/bin/bash\n", ["--nice=lots"]).message


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("--begin=whenever", "Invalid time specification: whenever"),
        ("--ntasks-per-gpu=2", "not supported; use --ntasks-per-node"),
        ("--test-only", "would not submit"),
        ("-M other", "single cluster"),
        ("hetjob", "heterogeneous jobs"),
    ],
)
def test_options_phalanx_cannot_honour_are_refused(line: str, reason: str) -> None:
    error = _refusal(f"#!/bin/bash\n#SBATCH -N 1\n#SBATCH {line}\n")
    assert error.message.startswith("job.sh line 3: ")
    assert reason in error.message


# --- command line overrides the script ------------------------------------------------------


def test_command_line_overrides_script() -> None:
    parsed = parse_submission(TORCHRUN, ["--time=30", "-N", "2", "--no-requeue"], "job.sh")
    assert parsed.fields["time_limit_s"] == 1800
    assert parsed.fields["nodes"] == 2
    assert parsed.fields["requeue"] is False
    assert parsed.fields["name"] == "llama-ft"  # untouched script values remain
    assert parsed.origins["nodes"] == "command line"


def test_command_line_mem_replaces_script_mem_per_cpu() -> None:
    script = "#!/bin/bash\n#SBATCH --mem-per-cpu=2G\n"
    parsed = parse_submission(script, ["--mem=8G"], "job.sh")
    assert parsed.fields == {"mem_mb": 8192}


def test_mem_and_mem_per_cpu_in_one_script_are_refused() -> None:
    error = _refusal("#!/bin/bash\n#SBATCH --mem=4G\n#SBATCH --mem-per-cpu=1G\n")
    assert error.message == (
        "job.sh line 3: --mem-per-cpu: cannot be combined with --mem (given at job.sh line 2); "
        "keep only one of them"
    )


def test_repeated_option_later_wins_and_clears_what_it_set() -> None:
    script = "#!/bin/bash\n#SBATCH --gres=gpu:a40:2\n#SBATCH --gres=gpu:4\n#SBATCH -N 2-4\n"
    parsed = parse_submission(script, ["-N", "3"], "job.sh")
    assert parsed.fields == {"gpus_per_node": 4, "nodes": 3}


def test_node_range_sets_min_and_max() -> None:
    assert parse_options(["-N", "2-4"], "x").fields == {"nodes": 2, "nodes_max": 4}
    with pytest.raises(InvalidSpec, match="invalid node count '4-2'"):
        parse_options(["-N", "4-2"], "x")


def test_conflicting_gpu_types_in_one_script_are_refused_but_cli_wins() -> None:
    script = "#!/bin/bash\n#SBATCH --gres=gpu:a40:1\n#SBATCH --gpus-per-task=h100:1\n"
    error = _refusal(script)
    assert "asks for GPU type 'h100'" in error.message
    assert "--gres at job.sh line 2 asks for 'a40'" in error.message
    parsed = parse_submission(script.rsplit("#SBATCH", 1)[0], ["--gres=gpu:h100:2"], "job.sh")
    assert parsed.fields == {"gpus_per_node": 2, "gpu_type": "h100"}


# --- individual converters ------------------------------------------------------------------


def test_value_converters() -> None:
    parsed = parse_options(
        [
            "-w", "node[01-03]",
            "-x", "gpu7",
            "--exclusive",
            "-C", "(a100|h100)&ib",
            "--export=ALL,WANDB_MODE=offline",
            "-d", "afterok:12:13",
            "--open-mode=a",
            "-e", "none",
            "-D", "/scratch/run",
            "--priority=5",
            "--progress-timeout=30:00",
            "--checkpoint-dir=/ckpt",
            "--gpus=h100:8",
            "--mem=0",
        ],
        "command line",
    )  # fmt: skip
    assert parsed.fields == {
        "nodelist": ["node01", "node02", "node03"],
        "exclude": ["gpu7"],
        "exclusive": True,
        "constraint": "(a100|h100)&ib",
        "export": "ALL,WANDB_MODE=offline",
        "dependency": "afterok:12:13",
        "open_mode": "append",
        "error": "/dev/null",
        "workdir": "/scratch/run",
        "priority": 5,
        "progress_timeout_s": 1800,
        "checkpoint_dir": "/ckpt",
        "gpus_total": 8,
        "gpu_type": "h100",
        "mem_mb": 0,
    }


@pytest.mark.parametrize(
    ("tokens", "reason"),
    [
        (["--array=1-5%0"], "--array: invalid array"),
        (["--dependency=afterok:1?afterok:2"], "only AND (comma) dependencies"),
        (["--signal=USR9"], "--signal: invalid signal"),
        (["--constraint=a100&"], "--constraint: invalid constraint"),
        (["--export=ALL,NONE"], "--export: invalid export"),
        (["--gres=nvme:1"], "only gpu gres is supported"),
        (["-w", "hosts.txt/x"], "node list files are not supported"),
        (["--mem-per-cpu=0"], "must be more than 0"),
        (["-c", "0"], "--cpus-per-task: invalid number '0'"),
        (["--open-mode=sometimes"], "use append or truncate"),
        (["--exclusive=maybe"], "invalid --exclusive value"),
        (["-J", ""], "empty job name"),
    ],
)
def test_invalid_values_are_refused(tokens: list[str], reason: str) -> None:
    with pytest.raises(InvalidSpec) as info:
        parse_options(tokens, "job.sh line 2")
    assert reason in info.value.message
    assert info.value.message.startswith("job.sh line 2: ")


def test_exclusive_user_is_accepted_with_a_warning() -> None:
    parsed = parse_options(["--exclusive=user"], "job.sh line 2")
    assert parsed.fields == {"exclusive": True}
    assert parsed.warnings == [
        "job.sh line 2: --exclusive=user is treated as whole-node --exclusive"
    ]


# --- script / --wrap ------------------------------------------------------------------------


def test_wrap_without_script() -> None:
    parsed = parse_submission(None, ["--wrap", "python train.py", "-n", "4"])
    assert parsed.fields == {"wrap": "python train.py", "ntasks": 4}


def test_wrap_and_script_together_are_refused() -> None:
    error = _refusal("#!/bin/bash\n", ["--wrap=true"])
    assert "--wrap: cannot be combined with a batch script" in error.message


def test_nothing_to_run_is_refused() -> None:
    error = _refusal(None, ["-N", "1"])
    assert "no batch script given" in error.message


# --- splitting the CLI argv -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "options", "rest"),
    [
        (["-J", "x", "job.sh", "-N", "3"], ["-J", "x"], ["job.sh", "-N", "3"]),
        (["-Jx", "-Hv", "--time", "5", "job.sh"], ["-Jx", "-Hv", "--time", "5"], ["job.sh"]),
        (["--exclusive", "job.sh"], ["--exclusive"], ["job.sh"]),  # optional value: not taken
        (["--frob", "job.sh"], ["--frob"], ["job.sh"]),  # unknown: never swallows the script
        (["-N", "2", "--", "-weird.sh"], ["-N", "2"], ["-weird.sh"]),
        (["--wrap=hostname"], ["--wrap=hostname"], []),
    ],
)
def test_split_cli_args(argv: list[str], options: list[str], rest: list[str]) -> None:
    assert split_cli_args(argv) == (options, rest)


def test_table_has_no_duplicate_names_and_flags_take_no_value() -> None:
    longs = [option.long for option in OPTIONS]
    assert len(longs) == len(set(longs))
    for name in ("requeue", "no-requeue", "hold"):
        option = find_option(name)
        assert option is not None and option.arg is Arg.NONE


# --- per-GPU CPUs and memory ----------------------------------------------------------------


def test_per_gpu_options_are_applied() -> None:
    script = (
        "#!/bin/bash\n#SBATCH --gres=gpu:2\n#SBATCH --cpus-per-gpu=6\n#SBATCH --mem-per-gpu=40G\n"
    )
    parsed = parse_submission(script, [], "job.sh")
    assert parsed.fields == {"gpus_per_node": 2, "cpus_per_gpu": 6, "mem_per_gpu_mb": 40 * 1024}
    assert (parsed.warnings, parsed.ignored) == ([], [])


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("--cpus-per-gpu=4", "-c 2"),
        ("--mem-per-gpu=8G", "--mem=16G"),
        ("--mem-per-gpu=8G", "--mem-per-cpu=1G"),
        ("--mem=16G", "--mem-per-gpu=8G"),
    ],
)
def test_per_gpu_options_conflict_like_sbatch(first: str, second: str) -> None:
    error = _refusal(f"#!/bin/bash\n#SBATCH {first}\n#SBATCH {second}\n")
    assert error.message.startswith("job.sh line 3: ")
    assert "cannot be combined with" in error.message


def test_command_line_per_gpu_memory_replaces_the_scripts_mem() -> None:
    parsed = parse_submission("#!/bin/bash\n#SBATCH --mem=16G\n", ["--mem-per-gpu=8G"], "job.sh")
    assert parsed.fields == {"mem_per_gpu_mb": 8192}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--frob", "3", "train.sh"], "command line: unknown option --frob: not an sbatch option"),
        (["--bogus", "train.sh"], "command line: unknown option --bogus: not an sbatch option"),
        (["-t", "5", "--ntask-per-node=2", "train.sh"], "did you mean --ntasks-per-node?"),
    ],
)
def test_phalanx_submit_names_the_unknown_option_before_reading_the_script(
    tmp_path: Path, argv: list[str], message: str
) -> None:
    (tmp_path / "train.sh").write_text("#!/bin/bash\ntrue\n")
    with pytest.raises(InvalidSpec) as info:
        build_spec(argv, cwd=str(tmp_path), environ={})
    assert message in info.value.message


def test_every_sbatch_option_slurm_documents_is_handled_or_refused_by_name() -> None:
    """sbatch(1) of Slurm 22.05 (tests/data/slurm-22.05/sbatch-options.txt): each long option
    is in the one table (domain/sbatch_options.py) or is one of sbatch's own flags; a refused
    one names itself and why, in one line."""
    from pathlib import Path

    from phalanx.domain.sbatch_options import Effect, find_option

    data = Path(__file__).parents[1] / "data" / "slurm-22.05" / "sbatch-options.txt"
    listed = [x for x in data.read_text().splitlines() if x and not x.startswith("#")]
    assert len(listed) == 101
    own = {"parsable", "wait", "test-only", "wrap", "help", "usage", "version", "clusters"}
    for name in listed:
        option = find_option(name)
        assert option is not None or name in own, name
        if option is not None and option.effect is Effect.REFUSED:
            assert option.long == name and len(option.help) > 10, name


def test_every_salloc_option_slurm_documents_is_handled_or_refused_by_name() -> None:
    """salloc(1) of Slurm 22.05: salloc's own flags (slurm/salloc.py), or the one option
    table its allocation's spec is built with."""
    from phalanx.slurm.salloc import split_salloc_flags

    data = Path(__file__).parents[1] / "data" / "slurm-22.05" / "salloc-options.txt"
    listed = [x for x in data.read_text().splitlines() if x and not x.startswith("#")]
    assert len(listed) == 90
    own = {"no-shell", "quiet", "bell", "no-bell", "kill-command", "help", "usage", "version"}
    for name in listed:
        assert name in own or find_option(name) is not None, name
    flags, kept, command = split_salloc_flags(["--no-shell", "-Q", "--kill-command=TERM", "-N2"])
    assert (flags.no_shell, flags.quiet, int(flags.kill_signal)) == (True, True, 15)
    assert (kept, command) == (["-N2"], [])
    with pytest.raises(InvalidSpec, match="--x11: X11 forwarding is not supported"):
        build_spec(["--x11", "--wrap=true"])
