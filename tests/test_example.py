"""`make demo` works: example_project/demo.py --no-serve, run as a newcomer would.

The example project is copied to a temporary directory (so its SQLite file is a fresh
one and the repository's example_project/db.sqlite3 is never touched) and run in a
subprocess twice: the second run proves the demo is idempotent.
"""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "example_project"
SAMPLES = ["quarterly-report.txt", "meeting-notes.txt", "poem.txt", "broken-scan.txt",
           "changelog.txt"]


def copy_example(target: Path) -> Path:
    project = target / "example_project"
    shutil.copytree(EXAMPLE, project,
                    ignore=shutil.ignore_patterns("*.sqlite3*", "__pycache__"))
    return project


def demo_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DJANGO_", "DBWORKER_DEMO_", "DEMO_"))}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_demo(python: str | Path, project: Path, env: dict[str, str],
             timeout: float = 240) -> str:
    result = subprocess.run([str(python), str(project / "demo.py"), "--no-serve"],
                            cwd=project.parent, env=env, capture_output=True, text=True,
                            timeout=timeout)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


def reported_statuses(output: str) -> dict[str, tuple[str, str]]:
    """{upload name: (analyze status, summarize status)} from the printed table."""
    rows = re.findall(r"^\s+\d+\s+(\S+)\s+(\w+|-)\s+(\w+|-)", output, re.MULTILINE)
    return {name: (analyze, summarize) for name, analyze, summarize in rows}


def assert_demo_output(output: str) -> None:
    assert "[1/4] migrate" in output
    assert re.search(r"superuser: demo / \S{12,}", output)
    assert "Drained: claimed" in output
    statuses = reported_statuses(output)
    assert set(statuses) == set(SAMPLES), output
    for name in SAMPLES:
        if "broken" in name:
            # The failing handler: FAILED with its error shown; the dependent worker
            # never became eligible, so its row is still pending.
            assert statuses[name] == ("failed", "pending"), output
        else:
            assert statuses[name] == ("finished", "finished"), output
    assert "analyze: ValueError: broken-scan.txt: cannot decode the file" in output


def demo_twice(tmp_path: Path) -> None:
    project = copy_example(tmp_path)
    env = demo_env()

    first = run_demo(sys.executable, project, env)
    assert "sample uploads: 5 created, 0 already there" in first
    assert_demo_output(first)
    # 5 uploads x 3 analyze steps (the broken one fails on its first) + 4 summaries.
    assert "claimed 17, finished 8, unfinished 8, failed 1" in first

    second = run_demo(sys.executable, project, env)
    assert "sample uploads: 0 created, 5 already there" in second
    assert "claimed 0," in second
    assert_demo_output(second)

    # The statuses in the database, not only what was printed.
    with sqlite3.connect(project / "db.sqlite3") as db:
        rows = db.execute(
            "SELECT u.name, e.worker, e.status, e.error_type, u.steps_done, u.summary "
            "FROM uploads_upload u JOIN django_dbworker_execution e "
            "ON e.source_id = CAST(u.id AS TEXT) ORDER BY u.id, e.worker"
        ).fetchall()
    assert len(rows) == 2 * len(SAMPLES)
    for name, worker, status, error_type, steps_done, summary in rows:
        if "broken" not in name:
            assert status == "finished" and steps_done == 3 and summary, rows
        elif worker == "analyze":
            # The failed run's writes were rolled back: no step was recorded.
            assert (status, error_type, steps_done) == ("failed", "ValueError", 0), rows
        else:
            assert status == "pending", rows


def demo_on_postgresql(tmp_path: Path) -> None:
    """DBWORKER_DEMO_DATABASE_URL switches the demo to PostgreSQL."""
    from urllib.parse import urlsplit, urlunsplit

    import psycopg

    server = os.environ.get("DBWORKER_TEST_POSTGRES_URL", "postgresql://root@127.0.0.1:5432/test")
    parts = urlsplit(server)
    name = f"dbworker_demo_{os.getpid()}"
    url = urlunsplit(parts._replace(path=f"/{name}"))
    project = copy_example(tmp_path)
    env = {**demo_env(), "DBWORKER_DEMO_DATABASE_URL": url}
    maintenance = urlunsplit(parts._replace(path="/postgres"))
    try:
        output = run_demo(sys.executable, project, env)  # the demo creates the database
        assert "database: PostgreSQL" in output
        assert_demo_output(output)
    finally:
        with psycopg.connect(maintenance, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# The demo brings its own database, whatever DBWORKER_TEST_DB says: its SQLite run is
# collected once, in the SQLite run of the matrix, and its PostgreSQL run in the PostgreSQL
# one, so no run repeats another's or reports a skip for it.
if os.environ.get("DBWORKER_TEST_DB", "sqlite") == "sqlite":
    test_demo_no_serve_twice = demo_twice
if os.environ.get("DBWORKER_TEST_DB") == "postgres":
    test_demo_on_postgresql = demo_on_postgresql
