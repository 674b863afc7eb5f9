"""squeue formats each line with one ``str.format`` template (common.line_template) and
falls back to escaping value by value when a line holds a control character. Both must print
exactly what `render_line` over escaped values prints, for any format Slurm's letters allow
(widths, sides, text between fields, braces in it) and any value (a job name is the user's)."""

from __future__ import annotations

import time

from hypothesis import given
from hypothesis import strategies as st

from phalanx.domain.text import escape
from phalanx.slurm import squeue
from phalanx.slurm.common import Field, line_template, render_line

texts = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30)
fields = st.lists(
    st.builds(
        Field,
        key=st.sampled_from(["i", "j", "u", "T", "r"]),
        width=st.integers(min_value=-1, max_value=25),
        right=st.booleans(),
        suffix=texts,
    ),
    min_size=1,
    max_size=6,
)


@given(prefix=texts, fields=fields, values=st.lists(texts, min_size=6, max_size=6))
def test_the_template_prints_what_render_line_prints(
    prefix: str, fields: list[Field], values: list[str]
) -> None:
    by_position = values[: len(fields)]
    expected = prefix + "".join(
        render_line("", [f], {f.key: v}) for f, v in zip(fields, by_position, strict=True)
    )
    assert line_template(prefix, fields).format(*by_position) == expected


@given(name=texts, reason=texts, width=st.integers(min_value=0, max_value=12))
def test_squeue_lines_equal_value_by_value_escaping(name: str, reason: str, width: int) -> None:
    now = time.time()
    job = {
        "id": 7, "job_id": "7", "array_job_id": None, "array_task_id": None, "name": name,
        "user": "alice", "partition": "batch", "state": "PENDING", "reason": reason,
        "start_time": None, "end_time": None, "submit_time": now, "time_limit_s": 60,
        "nodes": 1, "nodelist": None, "cpus_per_node": 1, "gpus_per_node": 0,
    }  # fmt: skip
    prefix, fmt_fields = squeue.parse_format(f"%.{width}i %{width}j %.8u %r", squeue.HEADERS)
    (line,) = squeue.format_rows(
        [job], prefix, fmt_fields, headers=squeue.HEADERS, header=False, now=now
    )
    values = squeue.field_values(job, now, [f.key for f in fmt_fields])
    assert line == render_line(prefix, fmt_fields, {k: escape(v) for k, v in values.items()})
