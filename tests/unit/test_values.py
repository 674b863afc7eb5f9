"""Option value parsers: every Slurm spelling users paste, and the errors they get otherwise."""

from __future__ import annotations

import signal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phalanx.domain import values as v

# --- durations ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30", 30 * 60),  # MM: a bare number is minutes, as in sbatch
        ("90", 90 * 60),
        ("5:30", 5 * 60 + 30),  # MM:SS
        ("1:00:00", 3600),  # HH:MM:SS
        ("48:00:00", 48 * 3600),
        ("2-0", 2 * 86400),  # D-HH
        ("1-12", 86400 + 12 * 3600),
        ("1-2:30", 86400 + 2 * 3600 + 30 * 60),  # D-HH:MM
        ("2-00:00:00", 2 * 86400),  # D-HH:MM:SS
        ("0-00:00:01", 1),
        ("0:90:00", 90 * 60),  # Slurm does not range-check later fields
        (" 10 ", 600),
    ],
)
def test_parse_duration_every_slurm_form(text: str, seconds: int) -> None:
    assert v.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["UNLIMITED", "unlimited", "Infinite", "INFINITE"])
def test_parse_duration_unlimited_is_none(text: str) -> None:
    assert v.parse_duration(text) is None


@pytest.mark.parametrize("text", ["0", "00:00", "0-0", "0:00:00", "-5"])
def test_parse_duration_refuses_zero_and_negative(text: str) -> None:
    with pytest.raises(ValueError, match="positive"):
        v.parse_duration(text)


@pytest.mark.parametrize(
    "text", ["1:2:3:4", "abc", "", "1h", "1.5", "1-2-3", "1-", ":30", "1-2:3:4:5"]
)
def test_parse_duration_refuses_garbage_and_shows_the_forms(text: str) -> None:
    with pytest.raises(ValueError) as info:
        v.parse_duration(text)
    message = str(info.value)
    assert f"invalid time {text!r}" in message
    assert "D-HH:MM:SS" in message


def test_parse_duration_refuses_absurdly_long() -> None:
    with pytest.raises(ValueError, match="UNLIMITED"):
        v.parse_duration("999999999-00:00:00")


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "UNLIMITED"),
        (0, "00:00:00"),
        (59, "00:00:59"),
        (3661, "01:01:01"),
        (86399, "23:59:59"),
        (86400, "1-00:00:00"),
        (2 * 86400 + 3 * 3600 + 4 * 60 + 5, "2-03:04:05"),
        (59.6, "00:01:00"),
        (-5, "00:00:00"),
    ],
)
def test_format_duration(seconds: float | None, text: str) -> None:
    assert v.format_duration(seconds) == text


@given(st.integers(min_value=1, max_value=2**31 - 1))
def test_duration_round_trip(seconds: int) -> None:
    assert v.parse_duration(v.format_duration(seconds)) == seconds


# --- memory ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "mb"),
    [
        ("4000", 4000),
        ("512M", 512),
        ("512m", 512),
        ("4G", 4096),
        ("4GB", 4096),
        ("4g", 4096),
        ("1T", 1024 * 1024),
        ("100K", 1),  # rounded up, never to 0 (which would mean "all memory")
        ("2048K", 2),
        ("2049K", 3),
        ("0", 0),
    ],
)
def test_parse_memory_mb(text: str, mb: int) -> None:
    assert v.parse_memory_mb(text) == mb


@pytest.mark.parametrize("text", ["", "G", "-1G", "1.5G", "4X", "4 G", "4GiB", "four"])
def test_parse_memory_refuses_with_example(text: str) -> None:
    with pytest.raises(ValueError, match=r"invalid memory size .*e\.g\. 4000, 512M, 4G"):
        v.parse_memory_mb(text)


# --- arrays ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "indices", "limit"),
    [
        ("0-15", list(range(16)), None),
        ("1-100%10", list(range(1, 101)), 10),
        ("1,3,5-7", [1, 3, 5, 6, 7], None),
        ("0-15:4", [0, 4, 8, 12], None),
        ("7", [7], None),
        ("5-7,1-3:2,6%2", [1, 3, 5, 6, 7], 2),
        ("3,3,3", [3], None),
    ],
)
def test_parse_array(text: str, indices: list[int], limit: int | None) -> None:
    assert v.parse_array(text) == (indices, limit)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("5-1", "ends before it starts"),
        ("1-10%0", "limit"),
        ("1-10%", "limit"),
        ("1-10:0", "step"),
        ("a-b", "cannot read"),
        ("1,,2", "cannot read"),
        ("", "no indices"),
        ("%4", "no indices"),
        ("0-1000001", "maximum"),
        ("0-200000", "more than 100000 tasks"),
        ("0-60000,100000-160000", "more than 100000 tasks"),
    ],
)
def test_parse_array_refuses(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        v.parse_array(text)


def test_parse_array_accepts_exactly_the_caps() -> None:
    indices, _ = v.parse_array("900001-1000000")
    assert len(indices) == 100_000 and indices[-1] == 1_000_000


@given(st.lists(st.integers(min_value=0, max_value=5000), min_size=1, max_size=40))
def test_parse_array_lists_are_sorted_unique(numbers: list[int]) -> None:
    indices, limit = v.parse_array(",".join(map(str, numbers)))
    assert indices == sorted(set(numbers))
    assert limit is None


# --- dependencies ---------------------------------------------------------------------------


def test_parse_dependency_forms() -> None:
    assert v.parse_dependency("afterok:123:124") == [{"type": "afterok", "jobs": ["123", "124"]}]
    assert v.parse_dependency("afterany:5,afternotok:7") == [
        {"type": "afterany", "jobs": ["5"]},
        {"type": "afternotok", "jobs": ["7"]},
    ]
    assert v.parse_dependency("singleton") == [{"type": "singleton", "jobs": []}]
    assert v.parse_dependency("after:9") == [{"type": "after", "jobs": ["9"]}]
    assert v.parse_dependency("afterok:123_4,singleton") == [
        {"type": "afterok", "jobs": ["123_4"]},
        {"type": "singleton", "jobs": []},
    ]


def test_parse_dependency_refuses_or_explaining_and_only() -> None:
    with pytest.raises(ValueError, match=r"only AND \(comma\) dependencies are supported"):
        v.parse_dependency("afterok:1?afterok:2")


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("afterok", "at least one job id"),
        ("afterok:", "at least one job id"),
        ("afterok:abc", "not a job id"),
        ("afterok:1_", "not a job id"),
        ("afterok:12+30", "delayed"),
        ("aftercorr:5", "unsupported type 'aftercorr'"),
        ("before:5", "unsupported type"),
        ("singleton:5", "singleton takes no job ids"),
        ("", "empty"),
    ],
)
def test_parse_dependency_refuses(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        v.parse_dependency(text)


# --- signals --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("USR1@120", (signal.SIGUSR1, 120, False)),
        ("B:USR1@300", (signal.SIGUSR1, 300, True)),
        ("SIGUSR2@60", (signal.SIGUSR2, 60, False)),
        ("10@60", (10, 60, False)),
        ("USR1", (signal.SIGUSR1, 60, False)),  # Slurm's default lead time
        ("sigterm@30", (signal.SIGTERM, 30, False)),
        ("R:USR1@10", (signal.SIGUSR1, 10, False)),
        ("b:TERM", (signal.SIGTERM, 60, True)),
    ],
)
def test_parse_signal(text: str, expected: tuple[int, int, bool]) -> None:
    signum, before_s, batch_only = expected
    assert v.parse_signal(text) == {
        "signum": int(signum),
        "before_s": before_s,
        "batch_only": batch_only,
    }


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("FOO@60", "unknown signal name"),
        ("USR1@", "use \\[B:\\]SIG"),
        ("X:USR1", "use \\[B:\\]SIG"),
        ("999@10", "no signal number"),
        ("USR1@70000", "at most 65535"),
        ("", "use \\[B:\\]SIG"),
    ],
)
def test_parse_signal_refuses(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        v.parse_signal(text)


# --- GPUs -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("gpu", (1, None)),
        ("gpu:4", (4, None)),
        ("gpu:a40:1", (1, "a40")),
        ("gpu:h100:8", (8, "h100")),
        ("gpu:a100-80g:2", (2, "a100-80g")),
        ("gpu:a40", (1, "a40")),
        ("none", (0, None)),
        ("gpu:0", (0, None)),
    ],
)
def test_parse_gres(text: str, expected: tuple[int, str | None]) -> None:
    assert v.parse_gres(text) == expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("nvme:1", "only gpu gres is supported"),
        ("gpu:1,nvme:1", "only gpu gres is supported"),
        ("gpu:1,gpu:a40:1", "only one gpu entry"),
        ("gpu:a40:x", "not a number"),
        ("gpu:a/40:1", "bad GPU type"),
        ("gpu:a:1:2", "too many"),
        ("", "empty"),
    ],
)
def test_parse_gres_refuses(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        v.parse_gres(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1", (1, None)),
        ("a100:2", (2, "a100")),
        ("l40s:1", (1, "l40s")),
        ("gpu:a100:2", (2, "a100")),
        ("gpu:2", (2, None)),
    ],
)
def test_parse_gpus(text: str, expected: tuple[int, str | None]) -> None:
    assert v.parse_gpus(text) == expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("a100", "not a number"),
        ("a100:1,v100:1", "only one GPU type"),
        ("-1", "not a number"),
        ("gpu:a:b:1", "too many"),
    ],
)
def test_parse_gpus_refuses(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        v.parse_gpus(text)


# --- export ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("ALL", ("ALL", {})),
        ("all", ("ALL", {})),
        ("NONE", ("NONE", {})),
        ("NIL", ("NONE", {})),
        ("ALL,VAR=v,OTHER", ("ALL", {"VAR": "v", "OTHER": None})),
        ("VAR1,VAR2", ("NONE", {"VAR1": None, "VAR2": None})),  # no ALL means NONE + these
        ("EMPTY=", ("NONE", {"EMPTY": ""})),
        ("ALL,X=a=b", ("ALL", {"X": "a=b"})),
    ],
)
def test_parse_export(text: str, expected: tuple[str, dict[str, str | None]]) -> None:
    assert v.parse_export(text) == expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [("", "empty"), ("ALL,NONE", "contradict"), ("ALL,1X=2", "not a variable"), ("A,,B", "not")],
)
def test_parse_export_refuses(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        v.parse_export(text)


# --- constraints ----------------------------------------------------------------------------

A100_IB = frozenset({"a100", "ib", "a100-80G"})
H100 = frozenset({"h100"})
H100_IB = frozenset({"h100", "ib", "rack_2.1"})


@pytest.mark.parametrize(
    ("expr", "features", "ok"),
    [
        ("a100-80G", A100_IB, True),
        ("a100-80G", H100, False),
        ("a100&ib", A100_IB, True),
        ("a100&ib", H100_IB, False),
        ("(a100|h100)&ib", A100_IB, True),
        ("(a100|h100)&ib", H100_IB, True),
        ("(a100|h100)&ib", H100, False),
        ("a100|h100&ib", H100, False),  # & binds tighter than |
        ("a100|h100&ib", A100_IB, True),
        ("rack_2.1", H100_IB, True),
        (" a100 & ib ", A100_IB, True),
        ("((a100))", A100_IB, True),
    ],
)
def test_constraint_matches(expr: str, features: frozenset[str], ok: bool) -> None:
    assert v.constraint_matches(expr, features) is ok


@pytest.mark.parametrize(
    "expr", ["", "a100&", "&a100", "(a100|h100", "a100)", "a100 ib", "a100*2", "[a|b]", "!a", "()"]
)
def test_constraint_refuses_bad_syntax(expr: str) -> None:
    with pytest.raises(ValueError, match=r"invalid constraint .*e\.g\. \(a100\|h100\)&ib"):
        v.parse_constraint(expr)


def test_constraint_features_lists_every_name() -> None:
    assert v.constraint_features("(a100|h100)&ib") == {"a100", "h100", "ib"}
