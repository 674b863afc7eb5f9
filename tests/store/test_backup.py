"""The SQLite backup of docs/deploy.md ("Backup and restore of the store"): SQLite's online
backup, taken while the store is being written, restores into a store a controller opens with
every job that was committed before the backup began."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from test_store_contract import submit1

from phalanx.config import load_config
from phalanx.controller.runtime import partition_rows
from phalanx.errors import NotFound
from phalanx.store.store import Store

# the command of docs/deploy.md, for hosts without the sqlite3 program
BACKUP = (
    "import sqlite3,sys; s=sqlite3.connect(sys.argv[1]); d=sqlite3.connect(sys.argv[2]); "
    "s.backup(d); d.close()"
)


def test_the_documented_backup_command_is_the_one_tested() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "deploy.md").read_text()
    assert f'python3 -c "{BACKUP}"' in doc


def test_online_backup_while_writing_restores_every_committed_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PHALANX_CONFIG", raising=False)
    live = tmp_path / "state" / "phalanx.db"
    live.parent.mkdir()
    st = Store(f"sqlite:///{live}", actor="ctl")
    st.migrate()
    st.sync_partitions(partition_rows(load_config()))
    before = [submit1(st) for _ in range(50)]

    stop = threading.Event()
    during: list[int] = []

    def write() -> None:  # a controller accepting jobs while the backup runs
        while not stop.is_set():
            during.append(submit1(st))

    writer = threading.Thread(target=write)
    writer.start()
    try:
        backup = tmp_path / "backup" / "phalanx.db"
        backup.parent.mkdir()
        subprocess.run([sys.executable, "-c", BACKUP, str(live), str(backup)], check=True)
    finally:
        stop.set()
        writer.join()
        st.close()
    assert during, "the store was written while the backup ran"

    # the restore: a fresh state dir with the backup as its phalanx.db (no -wal, no -shm)
    with sqlite3.connect(backup) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    restored = Store(f"sqlite:///{backup}", actor="ctl-restored")
    try:
        restored.migrate()  # what a controller does first at start
        for jid in before:
            assert restored.get_job(jid)["state"] == "PENDING", jid
        # a snapshot: of the jobs committed one after the other during the backup, those in
        # it are the first ones, with no gap (a later one never without an earlier one)
        present = []
        for jid in during:
            try:
                present.append(restored.get_job(jid)["state"] == "PENDING")
            except NotFound:
                present.append(False)
        assert present == sorted(present, reverse=True), present
    finally:
        restored.close()
