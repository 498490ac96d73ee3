"""SQLite's doorbell: the kernel (inotify) says when the database's files are written.

These tests use SQLite files of their own, so they run the same in every database's run.
"""

import select
import sqlite3
import sys
from contextlib import closing

import pytest

from django_dbworker.coordinator.doorbell import file_doorbell

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="inotify is Linux's")


@pytest.fixture
def database(tmp_path):
    path = tmp_path / "db.sqlite3"
    with closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE TABLE t (x INTEGER)")
        conn.commit()
    return path


def _write(path, journal_mode="wal"):
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute(f"PRAGMA journal_mode={journal_mode}")
        conn.execute("INSERT INTO t VALUES (1)")
    finally:
        conn.close()


@pytest.mark.parametrize("journal_mode", ["wal", "delete"])
def test_a_commit_of_another_connection_rings_and_nothing_else_does(database, journal_mode):
    with closing(sqlite3.connect(database)) as conn:
        conn.execute(f"PRAGMA journal_mode={journal_mode}")
    reader = sqlite3.connect(database, isolation_level=None)
    reader.execute("SELECT count(*) FROM t").fetchone()  # opens (makes) the -wal: kept
    bell = file_doorbell(database)
    assert bell is not None
    try:
        assert not bell.rang()  # nothing written yet
        reader.execute("SELECT count(*) FROM t").fetchone()  # a read rings nothing
        log = database.parent / "app.log"
        log.write_text("a line next to the database\n")
        assert not bell.rang()  # (its creation: not one of the database's files)
        with log.open("a") as f:
            f.write("another line\n")
        assert not select.select([bell], [], [], 0.05)[0]  # no wake-up for its writes
        _write(database, journal_mode)
        assert bell.rang()
        assert not bell.rang()  # each ring is read once
    finally:
        bell.close()
        reader.close()


def test_a_wal_file_made_anew_is_watched_too(database):
    """SQLite deletes the -wal when its last connection closes and makes a new one with
    the next: the bell rings for its creation and for the writes to the new file."""
    _write(database)
    wal = database.parent / (database.name + "-wal")
    assert not wal.exists()  # the last connection closed: checkpointed and deleted
    bell = file_doorbell(database)
    assert bell is not None
    try:
        holder = sqlite3.connect(database, isolation_level=None)
        holder.execute("SELECT count(*) FROM t").fetchone()  # opens (creates) the -wal
        assert wal.exists()
        bell.rang()  # (its creation)
        holder.execute("INSERT INTO t VALUES (2)")  # a write to the new -wal file
        assert bell.rang()
        holder.close()
    finally:
        bell.close()


def test_no_doorbell_for_a_directory_that_cannot_be_watched(tmp_path):
    assert file_doorbell(tmp_path / "missing" / "db.sqlite3") is None
