"""A --no-kill job's node changes, told to the job on each of its nodes (docs/elastic.md).

When a node of a --no-kill job dies and the job goes on (a spare in its place, or without it),
the controller lists the attempt's new membership in the heartbeat replies of the job's nodes
until each agent reports having written it (``members_gen``, level-triggered like signals).
The agent writes it to the job's control directory as ``membership.json``
(``$PHX_MEMBERSHIP_FILE``), atomically and safely (the directory is the job user's:
`jobfiles.replace_file`), and keeps the generation it wrote in the task directory (root's
only) so a repeated reply or a restarted agent writes each generation once:

    {"gen": 1, "nodes": ["node01", "node03"], "node_rank": 0,
     "changes": [{"gen": 1, "at": ..., "left": ["node02"],
                  "joined": [{"node": "node03", "rank": 1, "replaces": "node02"}],
                  "nodes": [...], "reason": "node node02 is DOWN: ..."}]}

No signal is sent: Slurm sends none to a --no-kill job whose node failed, and every signal a
job might not handle (USR1, USR2, HUP...) would kill it by default. A job that wants to know
reads the file (or the job's events); torchrun needs neither: its rendezvous re-forms.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from phalanx.agent import jobfiles, shepherd_files
from phalanx.agent.files import read_json as _read_json
from phalanx.agent.files import write_json as _write_json

log = logging.getLogger("phalanx.agent")

DONE_FILE = "members-done.json"


def members_done(task_dir: Path) -> int:
    """The membership generation written to this task's control file (0: none)."""
    data = _read_json(task_dir / DONE_FILE) or {}
    try:
        return max(0, int(data.get("gen") or 0))
    except (TypeError, ValueError):
        return 0


def write_membership(tasks_dir: Path, items: list[dict[str, Any]]) -> None:
    """Write each listed membership to its task's control file, once per generation."""
    for item in items:
        d = tasks_dir / str(int(item["attempt_id"]))
        gen = int(item["gen"])
        control = d / shepherd_files.CONTROL_DIR
        if not control.is_dir() or gen <= members_done(d):
            continue
        doc = {k: item[k] for k in ("gen", "nodes", "node_rank", "changes") if k in item}
        try:
            jobfiles.replace_file(
                control / shepherd_files.MEMBERSHIP_FILE, json.dumps(doc).encode() + b"\n"
            )
        except OSError as e:
            log.warning("cannot write the membership of attempt %s: %s", d.name, e)
            continue
        _write_json(d / DONE_FILE, {"gen": gen})
        left = [n for c in doc.get("changes") or [] if c.get("gen") == gen for n in c["left"]]
        log.info(
            "attempt %s: membership %d written (nodes %s; left: %s)",
            d.name,
            gen,
            ",".join(doc.get("nodes") or []),
            ",".join(left) or "none",
        )
