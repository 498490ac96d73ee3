#!/usr/bin/env bash
# Run the whole suite once per database -- SQLite always, PostgreSQL and MariaDB/MySQL when
# reachable -- and SQLite once more on the other supported Python and Django
# (scripts/test-combos.sh), each suite a "lane" of its own.
# With CI=true an unreachable server is a failure, never a skip.
#
#   scripts/test.sh                                 # every lane, in two phases (below)
#   scripts/test.sh -q tests/test_smoke.py          # arguments go to every lane's pytest
#   DBWORKER_TEST_LANES=1 scripts/test.sh           # one lane at a time, output live
#   DBWORKER_TEST_DATABASES=postgres DBWORKER_TEST_WITH_COMBOS=0 scripts/test.sh
#
# DBWORKER_TEST_LANES   how many lanes share the machine in the first phase (default 2)
# DBWORKER_TEST_DATABASES  which databases (default "sqlite postgres mysql")
# DBWORKER_TEST_WITH_COMBOS  0: leave out the Python/Django combos lane (default 1)
#
# Two phases.
#  1. Every lane's tests but the solo ones, DBWORKER_TEST_LANES lanes at a time. One lane
#     alone keeps the 2-core CI machine about half idle (vmstat over a whole run: 47 % idle):
#     its tests wait on leases, due times, sleeps and children starting, so a second lane
#     fills that time.
#  2. The tests marked `solo` (pyproject.toml), one lane at a time, and not in the combos
#     lane (test-combos.sh): the ones that keep every core busy on purpose, kill children
#     on a clock, run several hosts or restart a server.
#     Beside another lane they measure that lane, not themselves: three lanes at once once
#     stretched every lane about 3 times (stop 43's CI, 3,012 s against 2,824 s in a row)
#     and two chaos tests timed out, their children killed faster than a loaded machine
#     could start them.
# Running lanes side by side is safe: every run has test databases of its own (named after
# its pid, tests/settings.py; DBWORKER_TEST_RUN_ID, when set, gets the lane's name added),
# the tests that stop a server, use PgBouncer, the failover clusters or namespace hosts are
# all solo, and the release build works on a copy.
# In phase 1 a lane's output goes to a log file while it runs (one line says when each lane
# starts and ends); when all have ended each log is printed whole, in a fixed order (sqlite,
# postgres, mysql, combos). Phase 2's output is live. Then the summary; the exit status is
# non-zero if any lane failed. Ctrl-C (or SIGTERM) interrupts every lane's pytest, which
# stops its workers.
set -uo pipefail
PY=${PY:-.venv/bin/python}
DATABASES=${DBWORKER_TEST_DATABASES:-sqlite postgres mysql}
LANES=${DBWORKER_TEST_LANES:-2}
WITH_COMBOS=${DBWORKER_TEST_WITH_COMBOS:-1}
HERE=$(dirname "$0")
case $LANES in ''|*[!0-9]*|0) echo "DBWORKER_TEST_LANES=$LANES: give a number >= 1" >&2; exit 2;; esac
SHARED="not solo"
SOLO="solo"
status=0
summary=()

reachable() {
  "$PY" - "$1" <<'PYEOF'
import os, socket, sys
from urllib.parse import urlsplit
db = sys.argv[1]
url = {"postgres": os.environ.get("DBWORKER_TEST_POSTGRES_URL", "postgresql://root@127.0.0.1:5432/test"),
       "mysql": os.environ.get("DBWORKER_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")}[db]
parts = urlsplit(url)
try:
    socket.create_connection((parts.hostname, parts.port or {"postgres": 5432, "mysql": 3306}[db]), timeout=3).close()
except OSError as exc:
    print(f"{db}: {parts.hostname}:{parts.port} unreachable ({exc})")
    sys.exit(1)
PYEOF
}

# The lanes to run, in the order their logs are printed.
order=()
for db in $DATABASES; do
  case $db in
    sqlite|postgres|mysql) ;;
    *) echo "FAIL: DBWORKER_TEST_DATABASES names $db: use sqlite, postgres or mysql"
       status=1; summary+=("$db: UNKNOWN (failure)"); continue;;
  esac
  if [ "$db" != sqlite ] && ! reachable "$db"; then
    if [ "${CI:-}" = "true" ]; then
      echo "FAIL: $db is unreachable and CI=true"; status=1; summary+=("$db: UNREACHABLE (failure)")
    else
      echo "NOT RUN: $db is unreachable (set CI=true to make this a failure)"; summary+=("$db: not run (unreachable)")
    fi
    continue
  fi
  order+=("$db")
done
[ "$WITH_COMBOS" != 0 ] && order+=(combos)

# One lane's tests of one phase (its marker expression), output on stdout; a subshell, so
# what it exports stays in it. pytest's 5 (nothing selected: a lane with no solo test, or
# arguments naming only the other phase's tests) is no failure.
lane() (
  name=$1 marks=$2; shift 2
  if [ -n "${DBWORKER_TEST_RUN_ID:-}" ]; then  # one id for every lane would be one SQLite file
    export DBWORKER_TEST_RUN_ID="${DBWORKER_TEST_RUN_ID}_$name"
  fi
  if [ "$name" = combos ]; then
    DBWORKER_TEST_MARKS="$marks" "$HERE/test-combos.sh" "$@"
  else
    echo "=================== tests on $name ($marks) ==================="
    # The slowest tests of each lane, so every CI log says where its time went.
    DBWORKER_TEST_DB=$name "$PY" -m pytest --durations=25 -m "$marks" "$@"
    rc=$?
    [ $rc -eq 5 ] && { echo "(no $marks tests selected on $name)"; rc=0; }
    exit $rc
  fi
)

started=$(date +%s)
elapsed() { echo $(( $(date +%s) - started )); }
declare -A rc_of took_of   # "phase:lane" -> exit status, seconds

# run_phase PHASE MARKS AT_ONCE LANE... -- the lanes of one phase, AT_ONCE at a time.
run_phase() {
  local phase=$1 marks=$2 at_once=$3; shift 3
  local names=("$@") i
  [ "${#names[@]}" -gt "$at_once" ] || at_once=${#names[@]}
  if [ "$at_once" -le 1 ]; then
    for name in "${names[@]}"; do
      local t0; t0=$(date +%s)
      # What else uses the machine as a lane starts alone: the solo lanes of CI have taken
      # twice as long as on an idle machine (SQLite's 369 s against 179 s), cause unknown.
      echo "[$(elapsed)s] before $name ($marks): $(uptime)"
      ps -eo pcpu,etime,args --sort=-pcpu 2>/dev/null | head -6 | cut -c1-160
      lane "$name" "$marks" "${ARGS[@]}"
      rc_of[$phase:$name]=$?; took_of[$phase:$name]=$(( $(date +%s) - t0 ))
    done
    return
  fi
  local logs; logs=$(mktemp -d "${TMPDIR:-/tmp}/dbworker-lanes.XXXXXX") || exit 1
  # Job control: each lane in a process group of its own, which also keeps SIGINT from being
  # ignored in it (as it is for background commands without job control), so an interrupt
  # reaches pytest as KeyboardInterrupt and its fixtures stop the workers it started.
  set -m
  local pids=() t0s=() next=0 running=0
  interrupt() {  # stop the lanes, then show how far each had come
    trap - INT TERM
    echo "interrupted: stopping the lanes" >&2
    for pid in "${pids[@]}"; do [ -n "$pid" ] && kill -INT -- "-$pid" 2>/dev/null; done
    wait
    for i in "${!pids[@]}"; do
      echo "################### lane: ${names[$i]} (interrupted) ###################"
      cat "$logs/$i.log"
    done
    rm -rf "$logs"
    exit 130
  }
  trap interrupt INT TERM
  while [ "$next" -lt "${#names[@]}" ] || [ "$running" -gt 0 ]; do
    while [ "$running" -lt "$at_once" ] && [ "$next" -lt "${#names[@]}" ]; do
      lane "${names[$next]}" "$marks" "${ARGS[@]}" >"$logs/$next.log" 2>&1 </dev/null &
      pids[next]=$!; t0s[next]=$(date +%s)
      printf '[%5ss] %s (%s): started\n' "$(elapsed)" "${names[$next]}" "$marks"
      next=$((next + 1)); running=$((running + 1))
    done
    # Polled rather than `wait -n` (bash 4.3; which lane ended needs 5.1's -p): any bash
    # does, and a second is nothing against lanes of minutes.
    sleep 1
    for i in "${!pids[@]}"; do
      local pid=${pids[$i]}
      if [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null; then
        wait "$pid"; rc_of[$phase:${names[$i]}]=$?
        took_of[$phase:${names[$i]}]=$(( $(date +%s) - t0s[i] ))
        pids[i]=""; running=$((running - 1))
        printf '[%5ss] %s (%s): ended, exit %s (%ss)\n' "$(elapsed)" "${names[$i]}" "$marks" \
          "${rc_of[$phase:${names[$i]}]}" "${took_of[$phase:${names[$i]}]}"
      fi
    done
  done
  trap - INT TERM
  set +m
  for name in "${order[@]}"; do
    for i in "${!names[@]}"; do
      [ "${names[$i]}" = "$name" ] || continue
      echo "################### lane: $name, $marks (exit ${rc_of[$phase:$name]}, ${took_of[$phase:$name]}s) ###################"
      cat "$logs/$i.log"
    done
  done
  rm -rf "$logs"
}

ARGS=("$@")
# Bytecode for the project's own modules, once. Every handler runs in a spawned child, and
# the suite spawns about one a second: each imports Django, this package and the test
# app. Under PYTHONDONTWRITEBYTECODE (set in CI's environment) nothing is ever cached, and
# each child compiled this package from source again: 0.95 s of CPU to start, 0.80 s from
# bytecode. (Python still checks each file's time: an edited module is compiled again.)
"$PY" -m compileall -q -j 0 django_dbworker tests >/dev/null || echo "(compileall failed: the children compile from source)"
if [ "${#order[@]}" -gt 0 ]; then
  # Longest first (PostgreSQL's suite is the longest, then MariaDB's, SQLite's, the
  # combos'), so the short ones fill in at the end.
  start_order=()
  for name in postgres mysql sqlite combos; do
    for wanted in "${order[@]}"; do [ "$wanted" = "$name" ] && start_order+=("$name"); done
  done
  [ "$LANES" -eq 1 ] && start_order=("${order[@]}")
  echo "=================== phase 1: all but the solo tests, $LANES lane(s) at a time ==================="
  run_phase shared "$SHARED" "$LANES" "${start_order[@]}"
  echo "=================== phase 2: the solo tests, one lane at a time ==================="
  # Not the combos lane: its solo tests are races of several coordinators, claims and
  # chaos, which test the same SQL and processes whatever the Django (test-combos.sh);
  # they cost CI 184 s.
  solo_order=()
  for name in "${order[@]}"; do [ "$name" = combos ] || solo_order+=("$name"); done
  [ "${#solo_order[@]}" -gt 0 ] && run_phase solo "$SOLO" 1 "${solo_order[@]}"
fi

for name in "${order[@]}"; do
  line="$name:"
  for phase in shared solo; do
    [ "$name:$phase" = combos:solo ] && continue  # (no solo phase: above)
    rc=${rc_of[$phase:$name]:-?}
    [ "$rc" = 0 ] || status=1
    line+=" $phase exit $rc (${took_of[$phase:$name]:-?}s)"
  done
  [ "$name" = combos ] && line="combos (scripts/test-combos.sh):${line#combos:}"
  summary+=("$line")
done
echo "=================== summary ($(elapsed)s; phase 1 $LANES lane(s) at a time) ==================="
printf '%s\n' "${summary[@]}"
exit $status
