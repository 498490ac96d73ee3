#!/usr/bin/env bash
# The other supported (Python, Django) pairs, on SQLite (the main run, with every database,
# is on the newest Python and Django: scripts/test.sh, which also runs this script as one of
# its lanes, beside the databases' ones). Each pair gets a venv of its own under
# .venv-combos/. With CI=true a Python that cannot be found is a failure.
#
# These runs are about what changes with Python and Django: every API, the admin and its
# pages in a browser, the tasks backend (django.tasks or the backport) with what we add
# to it (@unique, @flow_key, @periodic, a queue's PER_KEY, FAIR, RATE: the flow-control,
# fair-share, rate and schedule modules), checks, settings, migrate, the test runner,
# handlers in real children, signals and probes. They leave out the modules whose
# subject is the database and the operating system alone -- claims and their plans,
# crashes and kills, leases, wake-ups, outages, reruns, repeated drains on a busy
# machine, the stress run, and the PostgreSQL-only hosts, failover and PgBouncer modules
# -- which the main run covers on every database: they test the same SQL and the same
# processes whatever the Django. DBWORKER_TEST_COMBOS_ALL=1 runs them too.
set -uo pipefail
# Each supported Python and each supported Django runs at least once: the main run is
# 3.13 with 6.1, this one 3.12 with 5.2 LTS. The other pairings cost CI about seven minutes
# each (its limit is 90): DBWORKER_TEST_COMBOS="3.12:5.2 3.13:5.2 3.12:6.1" runs them all.
COMBOS=${DBWORKER_TEST_COMBOS:-"3.12:5.2"}
LEFT_OUT=()
if [ -z "${DBWORKER_TEST_COMBOS_ALL:-}" ]; then
  for module in test_changewait test_claims test_crash test_crash_points test_doorbell test_drain \
                test_failover test_faults test_flow_plans test_hosts test_listener test_noise \
                test_one_clock test_outage test_pgbouncer test_poison test_pool test_reruns \
                test_retry_paths test_stress test_wakeups; do
    LEFT_OUT+=("--ignore=tests/$module.py")
  done
  # And in the modules it runs, the tests whose subject is the database or processes
  # alone: query plans (EXPLAIN over 100,000 rows), and schedules' slots under several
  # coordinators killed or frozen (the slot table's SQL; @periodic itself runs end to
  # end in the others). About 130 s of the lane.
  for test in test_tasks.py::test_the_claim_plan_reads_the_priority_index_not_the_backlog_or_history \
              test_operations.py::test_the_gauges_and_the_chart_read_indexes_not_the_history \
              test_schedules.py::test_four_coordinators_over_twenty_slots_enqueue_exactly_twenty \
              test_schedules.py::test_coordinators_killed_at_slot_boundaries_enqueue_every_slot_once \
              test_schedules.py::test_a_coordinator_frozen_inside_a_slots_transaction_holds_up_no_one; do
    LEFT_OUT+=("--deselect=tests/$test")
  done
fi
# DBWORKER_TEST_MARKS: which tests (a pytest marker expression; scripts/test.sh runs the
# solo ones apart from the rest).
MARKS="not slow${DBWORKER_TEST_MARKS:+ and ($DBWORKER_TEST_MARKS)}"
status=0
summary=()

find_python() {  # python3.X on PATH, else pyenv's; one that really runs as that version
  # (a pyenv shim is on PATH for every installed version, but fails unless it is selected)
  local want=$1 p
  for p in "python$want" $(command -v pyenv >/dev/null 2>&1 && ls -d "$(pyenv root)"/versions/"$want".*/bin/python"$want" 2>/dev/null | sort -rV); do
    if command -v "$p" >/dev/null 2>&1 && "$p" -c "import sys; sys.exit(f'{sys.version_info[0]}.{sys.version_info[1]}' != '$want')" 2>/dev/null; then
      command -v "$p"; return 0
    fi
  done
  return 1
}

for combo in $COMBOS; do
  py=${combo%%:*}; dj=${combo##*:}
  python=$(find_python "$py") || {
    if [ "${CI:-}" = "true" ]; then echo "FAIL: no Python $py"; status=1; summary+=("py$py dj$dj: NO PYTHON (failure)");
    else echo "NOT RUN: no Python $py"; summary+=("py$py dj$dj: not run (no python)"); fi
    continue; }
  venv=".venv-combos/py$py-dj$dj"
  if [ ! -f "$venv/.installed" ] || [ pyproject.toml -nt "$venv/.installed" ]; then
    "$python" -m venv "$venv" && "$venv/bin/pip" install -q --upgrade pip \
      && "$venv/bin/pip" install -q -e '.[test,tasks]' "Django~=$dj.0" && touch "$venv/.installed" || {
        echo "FAIL: installing py$py dj$dj"; status=1; summary+=("py$py dj$dj: INSTALL FAILED"); continue; }
  fi
  "$venv/bin/python" -m compileall -q -j 0 django_dbworker tests >/dev/null  # (as scripts/test.sh)
  echo "=================== tests on sqlite, Python $py, Django $("$venv/bin/python" -c 'import django; print(django.get_version())') ==================="
  DBWORKER_TEST_DB=sqlite "$venv/bin/python" -m pytest -m "$MARKS" "${LEFT_OUT[@]}" "$@"
  rc=$?
  [ $rc -eq 5 ] && { echo "(no tests selected: $MARKS)"; rc=0; }
  [ $rc -ne 0 ] && status=1
  summary+=("sqlite, py$py dj$dj: pytest exit $rc")
done
echo "=================== summary (other Python and Django versions) ==================="
printf '%s\n' "${summary[@]}"
exit $status
