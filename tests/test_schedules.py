"""Schedules: exactly once per slot across coordinators (a unique constraint, no leader),
the catch-up policies through the database and in real coordinators, and bad declarations
as system check errors. (The slot arithmetic alone, catch-up, time zones and DST with fixed
clocks: tests/unit/test_schedules.py.)"""

from __future__ import annotations

import contextlib
import math
import os
import random
import signal
import time
from datetime import UTC, datetime, timedelta

import pytest
from django.core.checks import run_checks
from django.db import connection
from django.test import override_settings

from django_dbworker.models import ScheduleSlot, Task
from django_dbworker.schedules import Schedule, Scheduler, periodic
from tests.helpers import runworkers, settings_module, wait_for
from tests.processes import Output, process_state

T0 = datetime(2026, 6, 1, 12, 0, 0, tzinfo=UTC)


def every_second(catch_up="latest", name="tick") -> Schedule:
    return Schedule(name=name, task_path="tests.testapp.tasks.record", every=timedelta(seconds=1),
                    args=[name], catch_up=catch_up)


# -- exactly once, through the database ------------------------------------------------------
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("catch_up,missed", [("latest", 1), ("all", 5), ("skip", 0)])
def test_a_coordinator_back_after_five_slots_follows_the_policy(catch_up, missed):
    scheduler = Scheduler("default")
    scheduler.schedules = {"tick": every_second(catch_up)}
    assert scheduler.run(T0 + timedelta(seconds=0.1)) == 0  # first sight: history starts
    assert scheduler.run(T0 + timedelta(seconds=1.1)) == 1
    assert scheduler.run(T0 + timedelta(seconds=2.1)) == 1
    # Down from 2.1 s to 7.8 s: slots 3-7 pass unseen.
    assert scheduler.run(T0 + timedelta(seconds=7.8)) == missed
    enqueued = sorted(ScheduleSlot.objects.filter(schedule="tick", task__isnull=False)
                      .values_list("slot", flat=True))
    expected = {"latest": [1, 2, 7], "all": [1, 2, 3, 4, 5, 6, 7], "skip": [1, 2]}[catch_up]
    assert enqueued == [T0 + timedelta(seconds=s) for s in expected]
    assert Task.objects.count() == len(expected)


@pytest.mark.django_db(transaction=True)
def test_two_schedulers_at_the_same_slot_enqueue_it_once():
    first, second = Scheduler("default"), Scheduler("default")
    for s in (first, second):
        s.schedules = {"tick": every_second()}
    first.run(T0)
    assert first.run(T0 + timedelta(seconds=1.5)) + second.run(T0 + timedelta(seconds=1.5)) == 1
    assert Task.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_four_coordinators_over_twenty_slots_enqueue_exactly_twenty(tmp_path):
    env = settings_module(tmp_path, """
        DBWORKER = {**DBWORKER, "SCHEDULES": {"tick": {
            "task": "tests.testapp.tasks.record", "args": ["tick"], "every": 1}}}
    """)
    procs = [runworkers("--worker", "docs", "--concurrency", "docs=1", env=env) for _ in range(4)]
    outputs = [Output(p) for p in procs]
    try:
        wait_for(lambda: ScheduleSlot.objects.filter(task__isnull=False).count() >= 22,
                 timeout=120, interval=0.2)
    finally:
        for p in procs:
            p.terminate()
        codes = [o.wait(timeout=60) for o in outputs]
    assert codes == [0, 0, 0, 0], [o.err[-2000:] for o in outputs]
    slots = list(ScheduleSlot.objects.filter(schedule="tick", task__isnull=False)
                 .order_by("slot").values_list("slot", "task_id"))
    window = slots[1:21]  # 20 consecutive slots, past the first one (start-up)
    assert [b[0] - a[0] for a, b in zip(window, window[1:], strict=False)] == [timedelta(seconds=1)] * 19
    tasks = Task.objects.filter(pk__in=[t for _, t in window])
    assert tasks.count() == 20  # one task per slot: 20 enqueues, none twice
    enqueuers = [o.err.count("Schedule tick: enqueued") for o in outputs]
    assert sum(enqueuers) == len(slots) and sum(1 for n in enqueuers if n) >= 2, enqueuers
    print(f"\nslots enqueued per coordinator: {enqueuers}")


def enqueued_slots(name: str = "tick") -> list[tuple[datetime, datetime]]:
    """(slot, enqueued_at) of every slot of ``name`` that enqueued a task, in order."""
    return list(ScheduleSlot.objects.filter(schedule=name, task__isnull=False)
                .order_by("slot").values_list("slot", "enqueued_at"))


def one_second_apart(slots: list[datetime]) -> bool:
    return all(b - a == timedelta(seconds=1) for a, b in zip(slots, slots[1:], strict=False))


def kill_machine(proc) -> None:
    """SIGKILL a runworkers process and its children (its own session), as a machine
    that loses power would leave them."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def sleep_past_next_second(offset: float) -> None:
    now = time.time()
    time.sleep(math.ceil(now) - now + offset)


@pytest.mark.django_db(transaction=True)
def test_coordinators_killed_at_slot_boundaries_enqueue_every_slot_once(tmp_path):
    """Three coordinators on a one-second schedule. The first to enqueue a slot is killed
    inside its transaction (the slot inserted, its task not yet enqueued); then,
    slot after slot, one coordinator is killed just after the slot boundary and replaced.
    Every slot is enqueued, once: no slot is missing, no task exists without its slot."""
    marker = tmp_path / "failpoint"
    env = {**settings_module(tmp_path, """
        DBWORKER = {**DBWORKER, "SCHEDULES": {"tick": {
            "task": "tests.testapp.tasks.record", "args": ["tick"], "every": 1}}}
    """), "DBWORKER_FAILPOINT": f"scheduler.slot_inserted:{marker}"}
    def start() -> Output:
        return Output(runworkers("--worker", "docs", "--concurrency", "docs=1", env=env))

    def ready(coordinators: list[Output]) -> list[Output]:
        return [c for c in coordinators if "django-dbworker coordinator" in c.err]

    coordinators = [start() for _ in range(3)]
    kills = 0
    try:
        wait_for(marker.exists, timeout=120, interval=0.05)  # one died holding its slot
        wait_for(lambda: sum(c.proc.poll() is not None for c in coordinators) == 1, timeout=30)
        coordinators = [c for c in coordinators if c.proc.poll() is None]
        wait_for(lambda: len(enqueued_slots()) >= 2, timeout=60, interval=0.1)
        rng = random.Random(len(enqueued_slots()))

        def two_ready() -> bool:
            return len(ready(coordinators)) >= 2

        for _ in range(8):  # kill one of two running coordinators, never the last one
            wait_for(two_ready, timeout=60, interval=0.05)
            sleep_past_next_second(rng.uniform(0.0, 0.03))
            victim = rng.choice(ready(coordinators))
            kill_machine(victim.proc)
            kills += 1
            coordinators.remove(victim)
            coordinators.append(start())
        target = len(enqueued_slots()) + 3
        wait_for(lambda: len(enqueued_slots()) >= target, timeout=60, interval=0.1)
    finally:
        for c in coordinators:
            kill_machine(c.proc)
    slots = [slot for slot, _ in enqueued_slots()]
    assert one_second_apart(slots), slots  # none missing
    assert Task.objects.count() == len(slots)  # none twice, none without its slot
    assert Task.objects.filter(args=["tick"]).count() == len(slots)
    # The slot whose coordinator died in its transaction left no row without a task.
    assert ScheduleSlot.objects.filter(task__isnull=True).count() == 1  # the history start
    print(f"\n{len(slots)} slots, {kills} kills at slot boundaries + 1 inside the slot's "
          f"transaction: {Task.objects.count()} tasks enqueued")


@pytest.mark.django_db(transaction=True)
def test_a_coordinator_frozen_inside_a_slots_transaction_holds_up_no_one(tmp_path):
    """Two coordinators; the first to enqueue a slot is stopped (SIGSTOP: a suspended VM,
    a cut link) between its slot INSERT and its commit. The other one does not wait on
    that uncommitted row: its loop goes on, the server ends the frozen transaction after a
    lease (3 s here), and the other enqueues the held slot and every later one, each once,
    while the first is still frozen."""
    if connection.vendor == "sqlite":
        pytest.skip("SQLite has one writer: a process frozen inside a write transaction "
                    "stops every writer of that file, whatever this app does")
    if connection.vendor == "mysql" and not connection.mysql_is_mariadb:
        pytest.skip("MySQL cannot end a transaction left idle: its schedule waits for the "
                    "frozen coordinator (docs/schedules.md), though no loop does")
    marker = tmp_path / "frozen"
    env = {**settings_module(tmp_path, """
        DBWORKER = {**DBWORKER, "LEASE_SECONDS": 3, "SCHEDULES": {"tick": {
            "task": "tests.testapp.tasks.record", "args": ["tick"], "every": 1,
            "catch_up": "all"}}}
    """), "DBWORKER_FAILPOINT": f"scheduler.slot_inserted:{marker}:stop"}
    coordinators = [runworkers("--worker", "docs", "--concurrency", "docs=1", env=env)
                    for _ in range(2)]
    try:
        wait_for(marker.exists, timeout=120, interval=0.05)
        frozen = wait_for(lambda: next((p for p in coordinators if process_state(p.pid) == "T"),
                                       None), timeout=30)
        frozen_at = datetime.now(UTC)
        later = frozen_at + timedelta(seconds=4)  # past the lease the server waits
        wait_for(lambda: sum(slot > later for slot, _ in enqueued_slots()) >= 3, timeout=60,
                 interval=0.1)
        assert process_state(frozen.pid) == "T"  # it was frozen all along
        os.killpg(frozen.pid, signal.SIGCONT)  # it finds its transaction gone, and goes on
        target = len(enqueued_slots()) + 2
        wait_for(lambda: len(enqueued_slots()) >= target, timeout=60, interval=0.1)
    finally:
        for p in coordinators:
            kill_machine(p)
    slots = [slot for slot, _ in enqueued_slots()]
    assert one_second_apart(slots), slots  # the held slot too: none missing
    assert slots[0] <= frozen_at  # the held one (or an earlier one) is in that run
    assert ScheduleSlot.objects.filter(task__isnull=True).count() == 1  # the history start
    assert Task.objects.count() == len(slots)  # none twice
    print(f"\n{len(slots)} slots, one coordinator frozen inside a slot's transaction: "
          f"{Task.objects.count()} tasks enqueued")


LATE = timedelta(seconds=0.5)  # a slot enqueued later than this after its time was caught up
# The stopped coordinator is continued this long after a slot: its catch-up slot is later
# than LATE, and its first pass has 0.45 s before the next slot would be on time.
CONTINUE_AFTER = 0.55


def frozen_across_six_slots(tmp_path, catch_up: str) -> tuple[list, datetime, datetime]:
    """One coordinator runs a one-second schedule, is stopped (SIGSTOP, as a suspended
    machine) over about six slots, and continued 0.55 s after a slot: (slot, enqueued_at)
    of the last slot enqueued before the stop and of every one after it, and when it was
    stopped and continued. (How late its start-up's slots were is not this test's
    business.)"""
    env = settings_module(tmp_path, f"""
        DBWORKER = {{**DBWORKER, "SCHEDULES": {{"tick": {{
            "task": "tests.testapp.tasks.record", "args": ["tick"], "every": 1,
            "catch_up": "{catch_up}"}}}}}}
    """)
    proc = runworkers("--worker", "docs", "--concurrency", "docs=1", env=env)
    try:
        wait_for(lambda: len(enqueued_slots()) >= 2, timeout=120, interval=0.1)
        sleep_past_next_second(0.5)
        os.killpg(proc.pid, signal.SIGSTOP)
        stopped = datetime.now(UTC)
        time.sleep(5.0)
        sleep_past_next_second(CONTINUE_AFTER)
        continued = datetime.now(UTC)
        os.killpg(proc.pid, signal.SIGCONT)
        wait_for(lambda: enqueued_slots()[-1][0] >= continued + timedelta(seconds=2),
                 timeout=60, interval=0.1)
    finally:
        kill_machine(proc)
    rows = enqueued_slots()
    before = [slot for slot, _ in rows if slot <= stopped]
    return [row for row in rows if row[0] >= before[-1]], stopped, continued


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("catch_up", ["latest", "all", "skip"])
def test_a_real_coordinator_stopped_over_six_slots_follows_its_catch_up_policy(tmp_path, catch_up):
    rows, stopped, continued = frozen_across_six_slots(tmp_path, catch_up)
    slots = [slot for slot, _ in rows]
    # The slots that passed while it was stopped (six, unless the test itself was slow).
    missed = math.floor(continued.timestamp()) - math.floor(stopped.timestamp())
    assert missed >= 5, (stopped, continued)
    late = [slot for slot, enqueued in rows[1:] if enqueued - slot > LATE]
    holes = [(a, b) for a, b in zip(slots, slots[1:], strict=False) if b - a > timedelta(seconds=1)]
    if catch_up == "all":  # the missed slots, late, then on time again
        assert one_second_apart(slots) and len(late) == missed, (slots, late)
    else:  # one hole over the missed slots
        assert len(holes) == 1 and holes[0][1] - holes[0][0] >= timedelta(seconds=missed), slots
    if catch_up == "latest":  # the newest missed slot runs, 0.55 s late, then on time
        assert late == [holes[0][1]] and continued - holes[0][1] < timedelta(seconds=1), rows
    if catch_up == "skip":  # nothing late: the next slot after the stop is the first to run
        assert late == [] and holes[0][1] > continued, rows
    assert Task.objects.count() == len(enqueued_slots())  # one task per slot
    print(f"\n{catch_up}: {len(slots) - 1} slots enqueued after the stop, {len(late)} of them "
          "caught up late")


@pytest.mark.django_db(transaction=True)
def test_no_schedules_enqueues_nothing(tmp_path):
    env = settings_module(tmp_path, """
        DBWORKER = {**DBWORKER, "SCHEDULES": {"tick": {
            "task": "tests.testapp.tasks.record", "args": ["tick"], "every": 1}}}
    """)
    proc = runworkers("--worker", "docs", "--no-schedules", env=env)
    output = Output(proc)
    wait_for(lambda: "django-dbworker coordinator" in output.err, timeout=60)
    time.sleep(2.5)
    proc.terminate()
    assert output.wait(timeout=60) == 0
    assert not ScheduleSlot.objects.exists()


# -- bad declarations -----------------------------------------------------------------------
@pytest.mark.parametrize("spec,message", [
    ({"task": "tests.testapp.tasks.record", "cron": "61 * * * *"}, "is not a cron expression"),
    ({"task": "tests.testapp.tasks.nope", "every": 5}, "cannot be imported"),
    ({"task": "tests.testapp.tasks.record", "every": 5, "cron": "* * * * *"}, "not both"),
    ({"task": "tests.testapp.tasks.record"}, "either cron"),
    ({"task": "tests.testapp.tasks.record", "every": 5, "catch_up": "some"}, "catch_up must be"),
    ({"task": "tests.testapp.models.Effect", "every": 5}, "is not a task"),
])
def test_a_bad_schedule_is_a_system_check_error_naming_the_fix(spec, message):
    from django.conf import settings

    with override_settings(DBWORKER={**settings.DBWORKER, "SCHEDULES": {"bad": spec}}):
        errors = [e for e in run_checks() if e.id.startswith("django_dbworker.")]
    assert [e.id for e in errors] == ["django_dbworker.E031"]
    assert message in errors[0].msg and "'bad'" in errors[0].msg


def test_periodic_refuses_a_bad_cron_at_declaration():
    from django.core.exceptions import ImproperlyConfigured

    from tests.testapp.tasks import record

    with pytest.raises(ImproperlyConfigured, match="is not a cron expression"):
        periodic(cron="every day")(record)


@pytest.mark.django_db(transaction=True)
def test_the_dashboard_lists_each_schedule_with_its_last_slot_task_status_and_next(
        admin_client, settings):
    import re

    from django.urls import reverse
    from django.utils import timezone

    settings.DBWORKER = {**settings.DBWORKER, "SCHEDULES": {"tick": {
        "task": "tests.testapp.tasks.record", "args": ["tick"], "every": 3600}}}
    scheduler = Scheduler("default")
    now = timezone.now()
    scheduler.run(now)  # first sight: history starts here
    assert scheduler.run(now + timedelta(seconds=3601)) == 1
    page = admin_client.get(reverse("admin:django_dbworker_dashboard"))
    row = re.search(r'<tr class="dbworker-schedule" data-schedule="tick">(.*?)</tr>',
                    page.text, re.S)
    assert row, page.text
    cells = re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", row.group(1), re.S)
    name, when, last, status, upcoming = (re.sub(r"<[^>]+>", "", c).strip() for c in cells)
    assert name == "tick" and ("3600" in when or "1:00:00" in when or "hour" in when), when
    assert last != "—" and upcoming != "—"  # the slot enqueued, and the one after it
    assert status.lower() in {"ready", "pending"}, status  # its task waits for a coordinator
