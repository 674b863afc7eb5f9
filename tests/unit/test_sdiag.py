"""sdiag's text (slurm/sdiag.py) in Slurm 22.05's layout, from a /v1/diag view."""

from __future__ import annotations

import time
from typing import Any

import pytest

from phalanx.slurm.common import SlurmUsageError
from phalanx.slurm.sdiag import parser, render

SINCE = time.mktime((2026, 12, 7, 7, 38, 21, 0, 0, -1))


def view(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "now": SINCE + 600,
        "since": SINCE,
        "server_threads": 7,
        "jobs_submitted": 4232,
        "jobs_started": 2231,
        "jobs_completed": 2228,
        "jobs_canceled": 6,
        "jobs_failed": 1,
        "jobs_pending": 3,
        "jobs_running": 2,
        "passes": 416,
        "pass_last_s": 0.000008,
        "pass_max_s": 0.039686,
        "pass_mean_s": 0.00173,
        "rpcs": [
            {"route": "/v1/jobs", "method": "POST", "count": 2228, "total_s": 1.560929},
            {"route": "/v1/jobs", "method": "GET", "count": 936, "total_s": 2.870119},
            {
                "route": "/v1/agents/{name}/exchange",
                "method": "POST",
                "count": 2900,
                "total_s": 0.833601,
            },
        ],
    }
    return {**base, **kw}


def test_the_lines_scripts_parse_are_slurms() -> None:
    text = render(view()).splitlines()
    assert text[0] == text[3] == "*" * 55
    assert text[1] == f"sdiag output at Mon Dec 07 07:48:21 2026 ({int(SINCE + 600)})"
    assert text[2] == f"Data since      Mon Dec 07 07:38:21 2026 ({int(SINCE)})"
    assert text[4] == "Server thread count:  7"
    assert text[6:11] == [
        "Jobs submitted: 4232",
        "Jobs started:   2231",
        "Jobs completed: 2228",
        "Jobs canceled:  6",
        "Jobs failed:    1",
    ]
    assert text[13:15] == ["Jobs pending:   3", "Jobs running:   2"]
    assert text[16:23] == [
        "Main schedule statistics (microseconds):",
        "\tLast cycle:   8",
        "\tMax cycle:    39686",
        "\tTotal cycles: 416",
        "\tMean cycle:   1730",
        "\tCycles per minute: 41",  # 416 passes in 10 minutes
        "\tLast queue length: 3",
    ]
    assert text[24] == "Remote Procedure Call statistics by message type"
    # by count, the most called first, in Slurm's columns
    assert text[25] == (
        f"\t{'POST /v1/agents/{name}/exchange':<40} count:2900   ave_time:287    total_time:833601"
    )
    assert [t.split()[1] for t in text[25:]] == [
        "/v1/agents/{name}/exchange",
        "/v1/jobs",
        "/v1/jobs",
    ]


@pytest.mark.parametrize(
    ("sort", "first"),
    [("id", "GET /v1/jobs"), ("time", "GET /v1/jobs"), ("time2", "GET /v1/jobs")],
)
def test_calls_sort_as_the_options_say(sort: str, first: str) -> None:
    calls = render(view(), sort=sort).splitlines()[25:]
    assert calls[0].strip().startswith(first), calls


def test_reset_is_refused_by_name() -> None:
    with pytest.raises(SlurmUsageError, match="--reset is not supported"):
        parser().parse_args(["--reset"])
