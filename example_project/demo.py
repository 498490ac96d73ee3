#!/usr/bin/env python
"""The django-dbworker demo (``make demo``).

1. migrate (installs the triggers that make every Upload row pending work),
2. a superuser ``demo`` with a fresh random password, printed,
3. a few sample uploads, one of which the ``analyze`` worker fails on,
4. ``manage.py runworkers --drain`` once, then the status of every row,
5. unless ``--no-serve``: ``runserver`` and ``runworkers`` together until Ctrl-C.

Idempotent: run it again and it reuses the database (a new password is printed).
SQLite in ``example_project/db.sqlite3`` by default; set
``DBWORKER_DEMO_DATABASE_URL=postgresql://user@host:5432/name`` for PostgreSQL.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
USERNAME = "demo"
SAMPLES = [
    ("quarterly-report.txt", "The quarterly report shows the revenue grew in the north."),
    ("meeting-notes.txt", "Notes from the planning meeting: ship the demo, write the docs."),
    ("poem.txt", "Rows are the queue and the queue is rows, no broker in between."),
    ("broken-scan.txt", "%PDF-1.4 garbled bytes the analyzer cannot decode"),
    ("changelog.txt", "Added workers. Fixed the leases. Removed the broker from the stack."),
]
WORKERS = ("analyze", "summarize")


def say(text: str = "") -> None:
    print(text, flush=True)


def manage(*args: str) -> list[str]:
    return [sys.executable, str(HERE / "manage.py"), *args]


# -- set-up --------------------------------------------------------------------------------
def set_up_django() -> None:
    # Not setdefault: under pytest DJANGO_SETTINGS_MODULE points at the test settings.
    os.environ["DJANGO_SETTINGS_MODULE"] = "demosite.settings"
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import django

    django.setup()


def describe_database() -> str:
    from django.db import connection

    sd = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"SQLite file {sd['NAME']}"
    return f"PostgreSQL {sd['NAME']} on {sd['HOST'] or 'localhost'}:{sd['PORT'] or 5432}"


def create_postgres_database_if_missing() -> None:
    """A convenience for the demo only: CREATE DATABASE when the URL names a new one."""
    from django.db import OperationalError, connection

    if connection.vendor != "postgresql":
        return
    try:
        connection.ensure_connection()
        return
    except OperationalError as exc:
        if "does not exist" not in str(exc):
            raise
    import psycopg

    sd = connection.settings_dict
    with psycopg.connect(dbname="postgres", user=sd["USER"] or None,
                         password=sd["PASSWORD"] or None, host=sd["HOST"] or None,
                         port=sd["PORT"] or None, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{sd["NAME"]}"')
    say(f"      created database {sd['NAME']}")


def migrate() -> None:
    from django.core.management import call_command

    create_postgres_database_if_missing()
    call_command("migrate", interactive=False, verbosity=0)


def superuser_password() -> str:
    from django.contrib.auth import get_user_model

    User = get_user_model()
    password = secrets.token_urlsafe(12)
    user = User.objects.filter(username=USERNAME).first()
    if user is None:
        User.objects.create_superuser(USERNAME, "demo@example.com", password)
    else:
        user.set_password(password)
        user.is_staff = user.is_superuser = user.is_active = True
        user.save()
    return password


def create_samples() -> tuple[int, int]:
    from uploads.models import Upload

    created = 0
    for name, content in SAMPLES:
        # Creating the row is the whole "enqueue": the insert trigger makes it pending.
        _, new = Upload.objects.get_or_create(name=name, defaults={"content": content})
        created += new
    return created, len(SAMPLES) - created


def close_connections() -> None:
    from django.db import connections

    connections.close_all()


# -- reporting ------------------------------------------------------------------------------
def report() -> dict[str, dict[str, str | None]]:
    """Print each upload's status per worker; return {name: {worker: status}}."""
    from uploads.models import Upload

    from django_dbworker import annotate_execution_status, state

    uploads = annotate_execution_status(Upload.objects.order_by("id"), *WORKERS)
    say(f"  {'#':>3}  {'upload':<24}{'analyze':<12}{'summarize':<12}error")
    result = {}
    for upload in uploads:
        statuses = {w: getattr(upload, f"{w}_execution_status") for w in WORKERS}
        error = ""
        for w in WORKERS:
            info = state(w, upload)
            if info is not None and info["error"]:
                error = f"{w}: {info['error']['type']}: {info['error']['message']}"
        columns = "".join(f"{s or '-':<12}" for s in statuses.values())
        say(f"  {upload.pk:>3}  {upload.name:<24}{columns}{error}".rstrip())
        result[upload.name] = statuses
    close_connections()
    return result


def urls(port: int) -> dict[str, str]:
    from django.urls import NoReverseMatch, reverse

    base = f"http://127.0.0.1:{port}"
    found = {"uploads": base + reverse("upload_list"), "admin": base + reverse("admin:index")}
    for label, name in [("dashboard", "admin:django_dbworker_dashboard"),
                        ("executions", "admin:django_dbworker_execution_changelist")]:
        try:
            found[label] = base + reverse(name)
        except NoReverseMatch:  # a django_dbworker without that admin page
            pass
    return found


# -- serving --------------------------------------------------------------------------------
def free_port(preferred: int) -> int:
    for port in (preferred, 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise RuntimeError("no free port")


def add_live_uploads() -> None:
    """A few rows created while the workers run, so the list page shows them move."""
    from uploads.models import Upload

    stamp = time.strftime("%H%M%S")
    for suffix, content in [("a", "The first live upload of this run."),
                            ("b", "A second one, processed alongside the first."),
                            ("broken", "This one fails on purpose.")]:
        Upload.objects.create(name=f"live-{stamp}-{suffix}.txt", content=content)
    close_connections()


def serve(port: int, password: str) -> int:
    env = {**os.environ, "DEMO_STEP_SECONDS": os.environ.get("DEMO_STEP_SECONDS", "1.5")}
    signals: list[int] = []
    processes: list[subprocess.Popen[bytes]] = []

    def on_signal(signum: int, frame: Any) -> None:
        signals.append(signum)
        if len(signals) > 1 and processes and processes[0].poll() is None:
            processes[0].send_signal(signal.SIGTERM)  # impatient: terminate the handlers

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        # Own process groups: Ctrl-C reaches only this script, which then sends each child
        # exactly one SIGTERM (a second one makes runworkers terminate its handlers).
        processes.append(subprocess.Popen(manage("runworkers"), env=env, process_group=0))
        processes.append(subprocess.Popen(
            manage("runserver", f"127.0.0.1:{port}", "--noreload"), env=env, process_group=0))
        time.sleep(2)
        add_live_uploads()
        say()
        say("The example site is running; the workers handle new uploads as they arrive:")
        for label, url in urls(port).items():
            say(f"  {label:<11}{url}")
        say(f"  {'login':<11}{USERNAME} / {password}")
        say("Press Ctrl-C to stop both.")
        say()
        while not signals and all(p.poll() is None for p in processes):
            time.sleep(0.2)
        for process, label in zip(processes, ("runworkers", "runserver"), strict=True):
            if process.returncode is not None:
                say(f"{label} exited by itself with status {process.returncode}")
    finally:
        # Whatever happened above, leave no server or coordinator behind.
        say("Stopping: runworkers lets running handlers finish ...")
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        codes = [stop(process, 60) for process in processes]
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    say("Stopped.")
    return 0 if signals else max(code or 0 for code in codes) or 1


def stop(process: subprocess.Popen[bytes], timeout: float) -> int | None:
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


# -- main -------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-serve", action="store_true",
                        help="set up, drain once, print the statuses and exit")
    parser.add_argument("--port", type=int, default=8000,
                        help="preferred port (a free one is used when it is taken)")
    args = parser.parse_args(argv)

    set_up_django()
    say("django-dbworker demo")
    say(f"  database: {describe_database()}")
    say("[1/4] migrate (creates the tables and installs the workers' triggers)")
    migrate()
    password = superuser_password()
    say(f"[2/4] superuser: {USERNAME} / {password}   (a new password on every run)")
    created, existing = create_samples()
    say(f"[3/4] sample uploads: {created} created, {existing} already there")
    close_connections()
    say("[4/4] python manage.py runworkers --drain")
    drain = subprocess.run(manage("runworkers", "--drain"))
    if drain.returncode != 0:
        say(f"runworkers --drain exited with {drain.returncode}")
        return drain.returncode
    say()
    say("What happened (analyze runs 3 steps per upload; summarize waits for analyze):")
    report()
    if args.no_serve:
        return 0
    return serve(free_port(args.port), password)


if __name__ == "__main__":
    sys.exit(main())
