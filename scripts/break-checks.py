#!/usr/bin/env python
"""Turn one mechanism off at a time, in a copy of the tree, and run the tests that guard
it: each run must fail, or that mechanism has no test that bites.

    .venv/bin/python scripts/break-checks.py                  # every break, its databases
    .venv/bin/python scripts/break-checks.py token-guard      # some of them
    .venv/bin/python scripts/break-checks.py --list

Each break is one exact text replacement in the package (it refuses to run if the text
is gone, so a refactor cannot turn a check into a silent pass). The copy lives in a
temporary directory and is put first on PYTHONPATH, for the tests and for every process
they start; the checkout itself is never changed. Uses the same servers as `make test`
(run it alone: the test databases have fixed names).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Break:
    name: str
    what: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    databases: tuple[str, ...] = ("sqlite", "postgres", "mysql")


BREAKS = [
    Break("lease-renewal", "leases are never renewed", "django_dbworker/store/bridge.py",
          '"""Push the lease of rows this coordinator still holds; returns how many."""\n',
          '"""Push the lease of rows this coordinator still holds; returns how many."""\n'
          "        return 0\n",
          ("tests/test_crash.py::test_a_handler_longer_than_the_lease_keeps_its_row",
           "tests/test_crash.py::test_a_live_coordinators_claim_is_renewed_and_never_taken_over")),
    Break("lease-recovery", "expired leases are never taken back", "django_dbworker/coordinator/recovery.py",
          "recovered = self.bridge.recover_expired(w)", "recovered = 0",
          ("tests/test_crash.py::test_a_killed_coordinator_and_child_lose_nothing_the_lease_"
           "returns_the_row",)),
    Break("token-guard", "a child's outcome commits without checking its claim token",
          "django_dbworker/store/transitions.py",
          'e.c.claim_token == sa.bindparam(f"{ROW_TOKEN}{i}")) for i in range(rows)]',
          "sa.true()) for i in range(rows)]",
          ("tests/test_crash.py::test_a_stale_childs_commit_is_refused_while_the_new_holder_"
           "still_runs",)),
    Break("commit-guard", "a child's outcome commits whatever became of its claim",
          "django_dbworker/store/transitions.py",
          "return sa.and_(e.c.status == WORKING, sa.or_(*each))",
          'return sa.or_(*[e.c.id == sa.bindparam(f"{ROW_ID}{i}") for i in range(rows)])',
          ("tests/test_crash.py::test_a_stale_child_that_wakes_after_the_takeover_has_its_"
           "writes_discarded",)),
    Break("notify", "the triggers send no NOTIFY", "django_dbworker/vendors/postgresql.py",
          'return (f"PERFORM pg_notify({self.literal(NOTIFY_CHANNEL)}, w) FROM "',
          'return ("PERFORM 1 FROM "',
          ("tests/test_wakeups.py::test_the_first_row_after_a_long_idle_is_picked_up_at_once",),
          ("postgres",)),
    Break("quote-names", "names reach SQL through Django's quote_name, which doubles no quote",
          "django_dbworker/vendors/base.py",
          "self.qn = self.quote_name", "self.qn = connection.ops.quote_name",
          ("tests/test_hostile_names.py::test_names_holding_the_identifier_quote_itself_are_"
           "quoted_too",)),
    Break("escape-literals", "constants in trigger DDL are pasted between quotes",
          "django_dbworker/vendors/base.py",
          '''return "'" + _no_nul(value, "a value").replace("'", "''") + "'"''',
          '''return "'" + value + "'"''',
          ("tests/test_hostile_names.py::test_a_hostile_table_and_column_get_triggers_backfill_"
           "cleanup_and_reruns",)),
    Break("bind-worker-name", "migrate's clean-up pastes the worker name into its DELETE",
          "django_dbworker/installation/triggers.py",
          "WHERE worker = {bound(w.name)} AND", "WHERE worker = '{w.name}' AND",
          ("tests/test_hostile_names.py::test_a_hostile_queue_installed_anyway_deletes_nothing_"
           "of_another_worker",)),
    Break("change-probe", "idle coordinators never probe for changes",
          "django_dbworker/coordinator/wakeups.py",
          "        if token[0] != last[0]:\n            self.wake_all()\n",
          "        if token[0] != last[0]:\n            pass\n",
          ("tests/test_wakeups.py::test_the_first_row_after_a_long_idle_is_picked_up_at_once",),
          ("sqlite",)),  # (MariaDB waits in the server instead: the change-wait break)
    Break("change-wait", "MariaDB's wait in the server wakes no worker on new rows",
          "django_dbworker/coordinator/changewait.py",
          "                changed.add(ANY_WORKER_NOTICE)\n", "                pass\n",
          ("tests/test_changewait.py::test_an_idle_coordinator_waits_in_the_server_and_picks_up_"
           "a_row_at_once",
           "tests/test_wakeups.py::test_the_first_row_after_a_long_idle_is_picked_up_at_once"),
          ("mysql",)),
    Break("doorbell", "an idle SQLite coordinator does not probe when its doorbell rings",
          "django_dbworker/coordinator/wakeups.py",
          "        if self._rang(now):\n", "        if self._rang(now) and False:\n",
          ("tests/test_wakeups.py::test_on_sqlite_an_idle_coordinator_sleeps_until_the_doorbell_"
           "rings",),
          ("sqlite",)),
    Break("skip-locked", "claims wait for rows another transaction locked",
          "django_dbworker/store/transitions.py",
          "return select.with_for_update(skip_locked=True, of=execution_table())",
          "return select.with_for_update(of=execution_table())",
          ("tests/test_guarantees.py::test_a_row_locked_by_another_transaction_is_skipped_not_"
           "waited_for",),
          ("postgres",)),
    Break("skip-locked-mariadb", "claims wait for rows another transaction locked (MariaDB)",
          "django_dbworker/store/transitions.py",
          "return select.with_for_update(skip_locked=True)\n",
          "return select.with_for_update()\n",
          ("tests/test_guarantees.py::test_a_row_locked_by_another_transaction_is_skipped_not_"
           "waited_for",),
          ("mysql",)),
    Break("autodiscovery", "workers.py modules are not imported", "django_dbworker/registration/discovery.py",
          '        autodiscover_modules("workers")\n', "        pass\n",
          ("tests/test_registry.py::test_workers_py_is_autodiscovered",), ("sqlite",)),
    Break("drain-wait", "--drain ends while its handlers still run",
          "django_dbworker/coordinator/loop.py",
          "            not p.busy and (self.wakeups.backoff",
          "            (self.wakeups.backoff",
          # (Only a pool with a free slot beside a running handler can end early.)
          ("tests/test_drain.py",)),
    Break("poll-backoff", "idle claims never back off", "django_dbworker/coordinator/backoff.py",
          "self.delay = min(self.delay * 2, self.most)", "self.delay = self.first",
          ("tests/test_wakeups.py::test_an_idle_coordinator_backs_off_its_polls_up_to_max_poll_"
           "seconds",)),
    Break("stuck-give-back", "rows waiting behind a stuck handler stay with its child",
          "django_dbworker/processes/pool.py",
          "elif len(child.outstanding) > 1 and now >= running.started + self.stuck_after():",
          "elif False:",
          ("tests/test_crash.py::test_rows_sent_ahead_to_a_child_are_given_back_when_its_"
           "handler_is_stuck",)),
    Break("stop-give-back", "a stopping child runs the rows sent ahead anyway",
          "django_dbworker/processes/groups.py",
          "    if stop.value or slot[SLOT_REVOKE]:\n        slot[SLOT_REVOKE] = 0\n",
          "    if slot[SLOT_REVOKE]:\n        slot[SLOT_REVOKE] = 0\n",
          ("tests/test_crash.py::test_a_graceful_stop_gives_back_the_rows_sent_ahead_that_had_"
           "not_started",)),
    Break("graceful-stop", "the first SIGTERM kills running handlers",
          "django_dbworker/coordinator/loop.py",
          "        if self._stopping:\n            force = True\n", "        force = True\n",
          ("tests/test_runworkers.py::test_sigterm_finishes_running_handlers_then_exits_zero",
           "tests/test_crash.py::test_a_graceful_stop_gives_back_the_rows_sent_ahead_that_had_"
           "not_started")),
    Break("children-ignore-sigint", "Ctrl-C in a terminal reaches the handlers",
          "django_dbworker/processes/child.py",
          "    signal.signal(signal.SIGINT, signal.SIG_IGN)\n", "",
          ("tests/test_runworkers.py::test_children_ignore_ctrl_c_sent_to_the_process_group",)),
    Break("dead-pid-release", "a dead coordinator of this host keeps its claims until they "
          "expire", "django_dbworker/store/bridge.py",
          "dead = [r for r in others if not alive(r.pid)]", "dead = []",
          ("tests/test_crash.py::test_claims_of_a_coordinator_that_died_on_this_machine_are_"
           "released_at_once",
           "tests/test_crash_points.py::test_a_crash_at_any_point_loses_nothing_and_commits_"
           "nothing_twice[coordinator.after_claim]")),
    Break("nulls-order", "claims ignore nulls_first/nulls_last", "django_dbworker/store/claims.py",
          "            if t.nulls_first or t.nulls_last:\n", "            if False:\n",
          ("tests/test_guarantees.py::test_eligible_with_q_and_nulls_ordering_orders_a_real_"
           "claim",)),
    Break("reset-clears", "reset_failed keeps the old error", "django_dbworker/store/transitions.py",
          '        ("error_message", None), ("error_traceback", None), ("finished_at", None),\n',
          '        ("finished_at", None),\n',
          ("tests/test_api.py::test_reset_failed_only_touches_failed_rows",), ("sqlite",)),
    Break("badge-escape", "the status badge does not escape an unknown status",
          "django_dbworker/templatetags/dbworker.py",
          "        return format_html('<span class=\"dbworker-status dbworker-status--unknown\" '\n"
          "                           'title=\"{}\">Unknown ({})</span>', status, status)\n",
          "        return SafeString('<span class=\"dbworker-status dbworker-status--unknown\" '\n"
          "                          f'title=\"{status}\">Unknown ({status})</span>')\n",
          ("tests/test_templatetags.py::test_a_hostile_status_value_is_escaped_by_the_tag_itself",),
          ("sqlite",)),
    Break("admin-permission", "a viewer may run the run-again action", "django_dbworker/admin/__init__.py",
          '@admin.action(description="Run finished executions again", permissions=["change"])',
          '@admin.action(description="Run finished executions again")',
          ("tests/test_admin.py::test_viewer_sees_pages_but_changes_nothing",), ("sqlite",)),
    Break("trigger-preflight", "a coordinator starts without its workers' triggers",
          "django_dbworker/installation/preflight.py",
          "    missing = missing_triggers(database, workers)\n", "    missing: list[str] = []\n",
          ("tests/test_guarantees.py::test_missing_triggers_from_the_command_line_are_one_line_"
           "and_a_non_zero_exit",)),
    Break("database-setting", "DBWORKER['DATABASE'] is ignored", "django_dbworker/registration/options.py",
          'database=overrides.get("database") or conf.value("DATABASE"),',
          'database=overrides.get("database") or "default",',
          ("tests/test_guarantees.py::test_the_database_setting_chooses_the_coordination_"
           "database",)),
    Break("worker-modules", "DBWORKER['WORKER_MODULES'] is ignored",
          "django_dbworker/registration/discovery.py",
          "    if modules is None:\n        autodiscover_modules", "    if True:\n        autodiscover_modules",
          ("tests/test_guarantees.py::test_worker_modules_replaces_autodiscovery",), ("sqlite",)),
    Break("claimable-index-hint", "MariaDB claims may walk Execution's primary key",
          "django_dbworker/vendors/mysql.py",
          'return f"FORCE INDEX ({index})"', "return None",
          ("tests/test_claims.py::test_the_claim_plan_reads_the_claimable_index_not_the_history",),
          ("mysql",)),
    Break("rerun-flag", "a change while a row runs is forgotten when its outcome commits",
          "django_dbworker/store/transitions.py",
          "    flagged = e.c.rerun_requested == sa.true()\n", "    flagged = sa.false()\n",
          ("tests/test_reruns.py::test_a_change_while_it_runs_makes_it_run_once_more_after_its_"
           "commit", "tests/test_reruns.py::test_rows_changed_under_running_workers_all_run_with_"
           "their_last_values"),
          # SQLite: the child's BEGIN IMMEDIATE holds the one write lock from its read to its
          # commit, so a change waits for the commit (and re-pends the finished row): no
          # change can land mid-run there, and the flag is not what keeps it.
          ("postgres", "mysql")),
    Break("schedule-transaction", "a schedule's slot commits before its task is enqueued",
          "django_dbworker/schedules.py",
          "            with transaction.atomic(using=self.database, durable=True):",
          "            with transaction.mark_for_rollback_on_error(using=self.database):",
          ("tests/test_schedules.py::test_coordinators_killed_at_slot_boundaries_enqueue_every_"
           "slot_once",)),
    Break("schedule-lock", "a slot's INSERT waits on another coordinator's uncommitted slot",
          "django_dbworker/schedules.py",
          "if not vendor.try_schedule_lock(cursor, schedule.name, self.frozen_after):",
          "if False:",
          ("tests/test_schedules.py::test_a_coordinator_frozen_inside_a_slots_transaction_holds_"
           "up_no_one",), ("postgres", "mysql")),
    Break("crash-count", "a row whose child dies is claimable again at once, for ever",
          "django_dbworker/store/retry.py",
          "        if crashes >= self.max_crashes:\n            return RetryDecision(ExecutionStatus.FAILED, None)\n"
          "        if self.max_attempts is not None:\n",
          "        return RetryDecision(ExecutionStatus.UNFINISHED, None, failed_attempt=False)\n"
          "        if self.max_attempts is not None:\n",
          ("tests/test_poison.py::test_a_row_that_kills_its_child_is_quarantined_and_the_rows_"
           "behind_it_run",)),
    Break("due-while-busy", "rows that become due wait until the worker's backlog drains",
          "django_dbworker/coordinator/due.py",
          "or (worker in self._busy and now - self._looked.get(worker, 0.0) >= LOOK_SECONDS))",
          "or False)",
          ("tests/test_poison.py::test_a_row_that_kills_its_child_is_quarantined_and_the_rows_"
           "behind_it_run",)),
    Break("due-while-busy-known", "a busy worker that knows a later due time does not look "
          "for retries written since", "django_dbworker/coordinator/due.py",
          "return ((due is not None and due <= now)\n                or (worker in self._busy",
          "return ((due <= now) if due is not None\n                else (worker in self._busy",
          ("tests/test_poison.py::test_a_retry_is_claimed_while_the_backlog_drains_when_a_later_"
           "row_waits_too",)),
    Break("one-clock", "a child writes a retry's due time from its host's clock",
          "django_dbworker/store/transitions.py",
          "None if decision.delay is None else now(vendor, decision.delay)))",
          "None if decision.delay is None else sa.literal(__import__('django.utils.timezone')"
          ".utils.timezone.now() + __import__('datetime').timedelta(seconds=decision.delay))))",
          ("tests/test_one_clock.py",), ("postgres", "mysql")),
    Break("rerun-crashes", "a row re-run by a change keeps the crashes that failed it",
          "django_dbworker/vendors/triggers.py",
          'f"crashes = CASE WHEN {e}status IN ({done}) THEN 0 ELSE {e}crashes END, "',
          'f"crashes = {e}crashes, "',
          ("tests/test_reruns.py::test_a_row_failed_by_crashes_whose_data_changed_starts_its_"
           "crash_count_again",)),
    Break("cleanup-live", "dbworker_cleanup deletes what a live coordinator serves",
          "django_dbworker/management/commands/dbworker_cleanup.py",
          "    return served\n", "    return {}\n",
          ("tests/test_newcomer.py::test_cleanup_leaves_alone_a_worker_that_a_live_coordinator_"
           "serves",)),
    Break("cleanup-history", "dbworker_cleanup deletes finished work, which migrate runs again",
          "django_dbworker/management/commands/dbworker_cleanup.py",
          '        statuses = WAITING + (HISTORY if options["include_history"] else [])',
          "        statuses = WAITING + HISTORY",
          ("tests/test_newcomer.py::test_cleanup_never_makes_finished_work_run_again",)),
    Break("key-count", "a claim does not count a key's WORKING rows", "django_dbworker/vendors/claiming.py",
          'rooms = {k: (plan.per_key - running.get(k, 0), "per_key") for k in locked}',
          'rooms = {k: (plan.per_key, "per_key") for k in locked}',
          ("tests/test_flow_control.py::test_per_key_one_claims_the_first_row_of_each_key_and_rows_without_a_key",
           "tests/test_flow_control.py::test_four_coordinators_keep_the_per_key_limit_while_sampled")),
    Break("key-lock", "claims of one key do not take turns on its FlowLock row",
          "django_dbworker/vendors/claiming.py",
          "locked = sorted(self._locks(conn, plan.worker, sorted(keys), wait=False))",
          "locked = sorted(keys)",
          ("tests/test_flow_control.py::test_a_claim_passes_over_a_key_another_claim_is_taking",),
          ("postgres", "mysql")),
    Break("total-count", "a claim does not count the worker's WORKING rows against total",
          "django_dbworker/vendors/claiming.py",
          "return plan.total - running", "return plan.total",
          ("tests/test_flow_control.py::test_total_caps_the_worker_across_claimers",
           "tests/test_flow_control.py::test_total_racing_in_threads_is_never_exceeded")),
    Break("total-lock", "claims of a capped worker do not take turns on its FlowLock row",
          "django_dbworker/vendors/claiming.py",
          'self._locks(conn, plan.worker, [""], wait=True)', "None",
          ("tests/test_flow_control.py::test_a_claim_of_a_capped_worker_waits_for_the_claim_before_it",),
          ("postgres", "mysql")),
    Break("lock-made-meanwhile", "a claim that finds the lock row it waits for made by another "
          "claim after its first look goes on without locking it",
          "django_dbworker/vendors/claiming.py",
          "again = sorted(rest) if wait else missing", "again = missing",
          ("tests/test_flow_control.py::test_total_racing_in_threads_is_never_exceeded",),
          # (MariaDB's look reads the transaction's first snapshot, so it finds the row
          # missing, and its INSERT ... ON DUPLICATE KEY UPDATE locks it: no race there.)
          ("postgres",)),
    Break("rate-count", "a claim does not count the rate log's last period",
          "django_dbworker/vendors/claiming.py",
          "return plan.rate.limit - int(used)", "return plan.rate.limit",
          ("tests/test_rate_limits.py::test_a_rate_takes_its_count_then_says_when_the_next_row_may_be_claimed",
           "tests/test_rate_limits.py::test_coordinators_never_claim_more_than_fifty_in_any_second_and_never_sit_idle")),
    Break("rate-window", "the rate counts fixed windows, not a sliding one (the log is emptied per period)",
          "django_dbworker/vendors/claiming.py",
          "log.c.at <= self._now(-plan.rate.seconds)", "log.c.at <= self._now(-0.001)",
          ("tests/test_rate_limits.py::test_the_window_slides_a_token_comes_back_one_period_after_its_claim",)),
    Break("rate-wait-least", "a token due at once is a deadline the loop drops",
          "django_dbworker/coordinator/loop.py",
          "else max(rate_wait, RATE_WAIT_LEAST)", "else rate_wait",
          ("tests/unit/test_waits.py::test_a_rates_next_token_is_a_deadline_after_now_even_when_due_at_once",),
          ("sqlite",)),  # (a unit test: one run is enough)
    Break("rate-key-count", "a claim does not count a key's rate-log entries",
          "django_dbworker/vendors/claiming.py",
          "left = plan.rate.limit - used.get(k, 0)", "left = plan.rate.limit",
          ("tests/test_rate_limits.py::test_a_rate_per_key_holds_for_each_key_apart",)),
    Break("lock-wait", "a claim waits for the worker's lock row as long as the server lets it",
          "django_dbworker/vendors/claiming.py",
          "                if wait:  # (claims hold it for milliseconds",
          "                if False:  # (claims hold it for milliseconds",
          ("tests/test_flow_control.py::test_a_frozen_holder_of_the_workers_lock_row_stops_no_claim_for_long",),
          ("mysql",)),  # (PostgreSQL would wait for ever: the test would hang, not fail)
    Break("fair-turns", "a fair claim starts from the first key every time (no turns)",
          "django_dbworker/vendors/claiming.py",
          "after = db.fair_after.get(plan.worker)", "after = None",
          ("tests/test_fair_shares.py::test_a_lone_key_starts_within_one_claim_while_a_backlog_of_another_drains",
           "tests/test_fair_shares.py::test_claims_of_one_row_go_round_the_keys_and_the_rows_without_a_key")),
    Break("fair-key-index", "the triggers do not write a new row's key",
          "django_dbworker/vendors/triggers.py",
          'flow_key = ("NULL" if source.key_column is None', 'flow_key = ("NULL" if True',
          ("tests/test_fair_shares.py::test_a_lone_key_starts_within_one_claim_while_a_backlog_of_another_drains",)),
    Break("unique-lock", "unique enqueues of one key do not take turns on its TaskUniqueKey row",
          "django_dbworker/tasks/uniqueness.py",
          "holder = TaskUniqueKey.objects.using(database).select_for_update().get(**names)",
          "holder = TaskUniqueKey.objects.using(database).get(**names)",
          ("tests/test_unique_tasks.py::test_fifty_concurrent_enqueues_of_one_key_make_exactly_one_task",),
          ("postgres",)),  # (MariaDB's upsert of a present row locks it already; SQLite: one writer)
    Break("unique-status", "a held task counts whatever its state",
          "django_dbworker/tasks/uniqueness.py",
          "if held is not None and execution is not None and execution.status in AMONG[rule.among]:",
          "if held is not None and execution is not None:",
          ("tests/test_unique_tasks.py::test_an_enqueue_of_a_pending_key_returns_the_pending_task",
           "tests/test_unique_tasks.py::test_pending_counts_until_the_task_starts_and_pending_or_running_until_it_ends")),
    Break("unique-within", "a task past its status holds its key no longer, whatever its window",
          "django_dbworker/tasks/uniqueness.py",
          "if execution is not None and rule.within is not None and _in_window(",
          "if False and execution is not None and rule.within is not None and _in_window(",
          ("tests/test_unique_tasks.py::test_within_its_window_a_task_holds_its_key_whatever_it_became",)),
    Break("debounce-guard", "a debounce changes the held task whatever its state",
          "django_dbworker/store/transitions.py",
          "sa.and_(e.c.id == execution_id, e.c.status.in_(list(statuses)))",
          "e.c.id == execution_id",
          ("tests/test_unique_tasks.py::test_a_debounce_that_meets_a_claim_adds_a_task_rather_than_change_the_running_one",),
          ("postgres", "mysql")),
]


def copy_tree(into: Path) -> None:
    """The working tree's tracked files (with uncommitted edits), nothing else."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)


def apply(tree: Path, brk: Break) -> None:
    path = tree / brk.path
    text = path.read_text()
    if text.count(brk.old) != 1:
        raise SystemExit(f"{brk.name}: the text to replace occurs {text.count(brk.old)} times "
                         f"in {brk.path}, not once: update scripts/break-checks.py")
    path.write_text(text.replace(brk.old, brk.new))


def run(tree: Path, brk: Break, database: str) -> tuple[int, list[str], float]:
    env = {**os.environ, "DBWORKER_TEST_DB": database, "PYTHONPATH": str(tree)}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", "180",
         "-rfE", *brk.tests], cwd=tree, env=env, capture_output=True, text=True)
    failed = [m[1] for m in re.finditer(r"^(?:FAILED|ERROR) (\S+)", done.stdout, re.M)]
    return done.returncode, failed, time.monotonic() - started


def imports_the_copy(tree: Path) -> bool:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    where = subprocess.run([sys.executable, "-c", "import django_dbworker; print(django_dbworker.__file__)"],
                           cwd=tree, env=env, capture_output=True, text=True).stdout.strip()
    return where.startswith(str(tree))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="breaks to run (default: all)")
    parser.add_argument("--databases", help="comma-separated subset of sqlite,postgres,mysql")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()
    if args.list:
        for brk in BREAKS:
            print(f"{brk.name:<24}{brk.what} ({', '.join(brk.databases)})")
        return 0
    unknown = set(args.names) - {b.name for b in BREAKS}
    if unknown:
        raise SystemExit(f"unknown break(s) {', '.join(sorted(unknown))}: see --list")
    chosen = [b for b in BREAKS if not args.names or b.name in args.names]
    only = set(args.databases.split(",")) if args.databases else None
    results = []
    for brk in chosen:
        with tempfile.TemporaryDirectory(prefix="dbworker-break-") as tmp:
            tree = Path(tmp)
            copy_tree(tree)
            apply(tree, brk)
            if not imports_the_copy(tree):
                raise SystemExit("the copy is not what Python imports: is the package "
                                 "installed other than editable?")
            for database in brk.databases:
                if only and database not in only:
                    continue
                rc, failed, took = run(tree, brk, database)
                bites = rc == 1 and bool(failed)  # tests failed (not: no tests, bad usage)
                results.append((brk, database, bites, rc, failed))
                print(f"{'bites ' if bites else 'MISSED'} {brk.name:<24}{database:<10}"
                      f"{took:6.0f}s  {', '.join(f.split('::')[-1] for f in failed) or f'exit {rc}'}",
                      flush=True)
    missed = [r for r in results if not r[2]]
    print(f"\n{len(results) - len(missed)} of {len(results)} breaks made a test fail")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
